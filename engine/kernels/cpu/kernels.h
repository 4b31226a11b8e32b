// Preheat's CPU kernels: plain functions over raw pointers, in two builds of one contract.
//
// Each instruction set has its own translation units: *_avx512.cpp (AVX-512 F/BW/VL/DQ,
// VNNI, BF16: Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later) and
// *_avx2.cpp (AVX2, FMA, F16C: every x86-64 CPU since Haswell / Zen 1). Their code
// generation is switched on with `#pragma GCC target`, and they include nothing but C
// headers and intrinsics: an inline C++ or torch function compiled there could be merged by
// the linker with the copy other code uses and run instructions the CPU lacks. The same
// functions (kernel_functions.h) are declared once per set, in namespaces `avx512` and
// `avx2`, and collected into a `KernelSet` table. bindings.cpp (built for the baseline
// x86-64) checks arguments, allocates tensors, splits the work across threads with
// at::parallel_for and calls a table's functions only after the CPU check for that set.
//
// Element types: `dtype` 0 = float32, 1 = bfloat16 (stored as uint16_t bits).
#pragma once
#include <stdint.h>

namespace preheat {

// ---- CPU features -------------------------------------------------------------------
bool cpu_has_avx512_kernels();
bool cpu_has_avx2_kernels();

// ---- paged decode attention ---------------------------------------------------------
struct DecodeAttnArgs {
  const void* q;          // [B, H, D], strides below (elements)
  int64_t q_stride_b, q_stride_h;
  const void* k_cache;    // [pages, S, KVH, D]
  const void* v_cache;
  int64_t kv_stride_page, kv_stride_tok, kv_stride_head;  // same for k and v
  const int32_t* page_table;  // [B, pt_stride]
  int64_t pt_stride;
  const int32_t* seq_lens;    // [B]
  void* out;              // [B, H, D] contiguous
  float* partial;         // [num_tasks, H, D + 2] merged by decode_attention_combine
  int64_t B, H, KVH, D, S;
  int64_t chunk;          // tokens per task, a multiple of 16
  float scale;            // times the key scale of an fp8 cache (and 256 for e4m3, see below)
  int dtype;              // of q and out: 0 float32, 1 bfloat16
  int kv_dtype = 0;       // of the caches: 0 = dtype, 1 = float8_e4m3fn, 2 = float8_e5m2
  float v_mult = 1.0f;    // the outputs' factor: an fp8 cache's value scale (and 256 for e4m3)
};

// ---- paged extend (prompt) attention ------------------------------------------------
// The new tokens of several sequences, back to back in q; token j of a sequence with p
// cached tokens sees keys 0 .. p + j (its own K/V already written to the pages). q and out
// bfloat16 or float32 (`dtype`), caches of q's dtype or fp8 (read exactly: every e4m3 /
// e5m2 value is a bfloat16 one); head_dim 64 or 128. The AVX-512 build multiplies bfloat16
// pairs (extend_attention_avx512.cpp) and hands float32 queries to the AVX2 build's kernel
// (extend_attention_avx2.cpp, float32 FMAs).
struct ExtendAttnArgs {
  const void* q;          // [T, H, D], strides below (elements)
  int64_t q_stride_t, q_stride_h;
  const void* k_cache;    // [pages, S, KVH, D]
  const void* v_cache;
  int64_t kv_stride_page, kv_stride_tok, kv_stride_head;
  const int32_t* page_table;  // [B, pt_stride]
  int64_t pt_stride;
  const int32_t* prefix_lens;  // [B]
  const int64_t* q_start;      // [B]: the sequence's first row of q
  void* out;              // [T, H, D] contiguous
  int64_t H, KVH, D, S;
  float scale;            // times the key scale of an fp8 cache (and 256 for e4m3, as DecodeAttnArgs)
  int kv_dtype = 0;       // of the caches: 0 = q's dtype, 1 = float8_e4m3fn, 2 = float8_e5m2
  float v_mult = 1.0f;    // the outputs' factor: an fp8 cache's value scale (and 256 for e4m3)
  int dtype = 1;          // of q and out: 0 = float32, 1 = bfloat16
};
// One task: sequence b, kv head kvh (all its query heads), query rows [r0, r1) of b (at
// most EXTEND_TASK_ROWS). Floats of scratch a task needs: extend_attention_scratch.
constexpr int64_t EXTEND_TASK_ROWS = 32;

// ---- skinny GEMMs ---------------------------------------------------------------------
// bf16: weights packed by linear.py (a permute): [ceil(N/16), K/2, 16, 2] bf16, K even, so
// one 64-byte load holds 16 output columns x 2 inputs, the operand vdpbf16ps takes (the
// AVX2 build splits the pairs into two float32 vectors instead).
// float32: [ceil(N/16), K, 16] float32 (packed by linear.py), 16 columns of one input per
// 64-byte load.
// y[m, n] = x[m, :] . W[n, :] (+ bias[n]) (+ residual[m, n], added after rounding the
// product to the output type, as `residual + F.linear(...)` does).
//
// int8: a weight is u8 codes q with, per block of 32 along K, a scale d and an offset m:
// w = d * q + m (symmetric int8: q = i8 + 128, m = -128 d; GGUF Q4_1: q in 0..15, m = min;
// Q8_0: like symmetric int8). Packed by int8.py: codes [ceil(N/16), K/2, 16, 2] (32 bytes
// = 16 columns x 2 inputs, widened to vpdpwssd's / vpmaddwd's operand) or, when every code
// fits in 4 bits, [ceil(N/16), K/4, 32] (two such steps per 32 bytes: low nibbles, high
// nibbles); dm [ceil(N/16), K/32, 2, 16].
// Activations are quantized per row and block of 32 to int16 (scale absmax / 32767) or, at
// act_bits 8, to int8 (absmax / 127, vpdpbusd; the AVX-512 build only: KernelSet::
// activation_bits is the narrowest width a build runs).
struct GemmArgs {
  const void* x;          // [M, K] activations (bf16 / float32 for those GEMMs, int8 / int16 codes for int8)
  int64_t ldx;
  const void* w;          // packed weights
  const uint16_t* dm;     // int8 only: per (n block, k block) 16 scales then 16 offsets, fp16
  const float* xs;        // int8 only: per (m, k block) activation scale
  const float* xsum;      // int8 only: per (m, k block) scale * sum of codes
  const void* bias;       // [N] or null (output dtype)
  const void* residual;   // [M, ldr] or null (output dtype)
  int64_t ldr;
  void* y;                // [M, ldy]
  int64_t ldy;
  int64_t M, N, K;
  int out_dtype;
  int code_bits;          // int8 only: 8, or 4 for codes that fit (GGUF Q4_1) kept at 4 bits
  int act_bits;           // int8 only: activation codes, 8 or 16 bits
};

// ---- element-wise ---------------------------------------------------------------------
// Rotary embedding and the KV write of rows of a fused qkv projection: q heads rotated
// into q_out, k heads rotated and v heads copied into the caches at the rows' slots.
// cos_sin row p = [cos (D), signed sin (D)] for position p (see llama.py).
struct RopeKVArgs {
  const void* qkv;        // [T, (H + 2 KVH) * D], row stride ld
  int64_t ld;
  int64_t H, KVH, D;
  const void* cos_sin;    // [positions, 2 D]
  const int64_t* positions;
  const int64_t* slots;
  void* q_out;            // [T, H, D] contiguous
  void* k_cache;          // slot s, head h at (s * KVH + h) * D
  void* v_cache;
  int dtype;
  // The caches' format: 0 = dtype; 1 = float8_e4m3fn, 2 = float8_e5m2, each value stored as
  // x / its scale (K's, V's), clamped to the format's range and rounded as torch rounds
  // (engine/kernels/kv_fp8.py's store).
  int kv_dtype = 0;
  float k_scale = 1.0f, v_scale = 1.0f;
};

// ---- the functions, once per instruction set ----------------------------------------
namespace avx512 {
#include "kernel_functions.h"
// int8-weight GEMM of bf16 rows (a.x, not codes): each group of column blocks dequantized
// into a bf16 panel, then the bf16 GEMM over it. This build only.
void gemm_int8_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end);
// Rows from which linear_int8 takes that path for bfloat16 rows at 16-bit activation codes
// (benchmarks/results/long_prompt_matmul.md: 0.9-0.94x the int16 products' time at 32 rows;
// at 16 the panel did not pay).
constexpr int64_t INT8_BF16_PANEL_ROWS = 32;
// The bf16 GEMM on AMX-BF16 tiles (gemm_bf16_amx.cpp), any rows a.M <= 16, or any number
// with K a multiple of 32: gemm_bf16_blocks takes it for such products while amx_bf16_on
// (below) is set (gemm_common.h, amx_bf16_takes).
void gemm_bf16_amx_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end);
// The same over a panel holding column blocks [nb0, nb0 + nt) in the packed layout (the
// int8 GEMM's dequantized codes, gemm_int8_bf16_blocks).
void gemm_bf16_amx_panel(const GemmArgs& a, const uint16_t* panel, int64_t nb0, int64_t nt);
}  // namespace avx512
// Whether the AVX-512 build's bf16 GEMM uses AMX tiles: set by bindings.cpp once the CPU
// reports AMX-BF16 and Linux granted this process the tile state (and not switched off by
// PREHEAT_CPU_AMX=0 or the module's `use_amx`); read by every call.
extern volatile bool amx_bf16_on;
// Whether the AVX-512 build's attention kernels widen fp8 pages to bfloat16 by table lookup
// (vpermi2b, AVX-512 VBMI: 7 instructions per 64 values instead of 16): set by bindings.cpp
// once the CPU reports AVX512_VBMI (and not switched off by PREHEAT_CPU_VBMI=0 or the
// module's `use_vbmi`); read at each call.
extern volatile bool fp8_vbmi_on;
namespace avx2 {
#include "kernel_functions.h"
}  // namespace avx2

// One instruction set's build of every kernel.
struct KernelSet {
  const char* name;  // "avx512" or "avx2": what `isa()` reports
  bool (*runs_here)();
  int64_t (*decode_attention_scratch)(const DecodeAttnArgs&);
  void (*decode_attention_tasks)(const DecodeAttnArgs&, const int32_t*, const int32_t*, const int32_t*, float*,
                                 int64_t, int64_t);
  void (*decode_attention_combine)(const DecodeAttnArgs&, const int64_t*, const int32_t*, int64_t, int64_t);
  void (*gemm_bf16_blocks)(const GemmArgs&, int64_t, int64_t);
  void (*gemm_f32_blocks)(const GemmArgs&, int64_t, int64_t);
  int activation_bits;  // the int8 GEMM's narrowest activation codes: 8 (vpdpbusd; 16 also runs) or 16 only
  void (*quantize_activations)(const void*, int64_t, int, int64_t, int, void*, float*, float*, int64_t, int64_t);
  void (*gemm_int8_blocks)(const GemmArgs&, int64_t, int64_t);
  void (*rms_norm_rows)(const void*, int64_t, const void*, void*, int64_t, int64_t, float, int, int64_t, int64_t);
  void (*silu_mul_rows)(const void*, int64_t, void*, int64_t, int64_t, int, int64_t, int64_t);
  void (*rope_kv_rows)(const RopeKVArgs&, int64_t, int64_t);
  void (*argmax_rows)(const float*, int64_t, int64_t, int64_t*, int64_t, int64_t);
  void (*unpack_bf16_blocks)(const GemmArgs&, int64_t, int64_t);
  void (*dequantize_int8_blocks)(const GemmArgs&, int64_t, int64_t);
  int64_t (*extend_attention_scratch)(const ExtendAttnArgs&);  // null: not in this set
  void (*extend_attention_task)(const ExtendAttnArgs&, int64_t, int64_t, int64_t, int64_t, float*);
  void (*gemm_int8_bf16_blocks)(const GemmArgs&, int64_t, int64_t);  // null: not in this set
  int64_t int8_bf16_panel_rows;  // rows from which linear_int8 uses it (bf16 rows, 16-bit codes)
};

}  // namespace preheat
