// Preheat's CPU kernels: plain functions over raw pointers.
//
// The kernel translation units (*_avx512.cpp) are compiled for AVX-512 (F/BW/VL/DQ, VNNI,
// BF16) through `#pragma GCC target`, and include nothing but C headers and intrinsics: an
// inline C++ or torch function compiled there could be merged by the linker with the copy
// other code uses and run AVX-512 instructions on a CPU without them. bindings.cpp (built
// for the baseline x86-64) checks arguments, allocates tensors, splits the work across
// threads with at::parallel_for and calls these only after the CPU check passed.
//
// Element types: `dtype` 0 = float32, 1 = bfloat16 (stored as uint16_t bits).
#pragma once
#include <stdint.h>

namespace preheat {

// ---- CPU features -------------------------------------------------------------------
bool cpu_has_avx512_kernels();

// ---- paged decode attention (attention_avx512.cpp) ----------------------------------
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
// Floats of per-thread scratch one task needs.
int64_t decode_attention_scratch(const DecodeAttnArgs& a);
// Task t covers the tokens [task_chunk[t] * chunk, ...) of row task_b[t], every head; a
// row whose context fits one chunk is written to `out` directly.
void decode_attention_tasks(const DecodeAttnArgs& a, const int32_t* task_b, const int32_t* task_chunk,
                            const int32_t* num_chunks, float* scratch, int64_t begin, int64_t end);
// Merges the chunk partials of rows (b, h) in [begin, end) of B*H.
void decode_attention_combine(const DecodeAttnArgs& a, const int64_t* first_task, const int32_t* num_chunks,
                              int64_t begin, int64_t end);

// ---- bf16 skinny GEMM (gemm_bf16_avx512.cpp) ----------------------------------------
// Weights are packed by linear.py (a permute): [ceil(N/16), K/2, 16, 2] bf16, K even, so one
// 64-byte load holds 16 output columns x 2 inputs, the operand vdpbf16ps takes.
// y[m, n] = x[m, :] . W[n, :] (+ bias[n]) (+ residual[m, n], added after rounding the
// product to the output type, as `residual + F.linear(...)` does).
struct GemmArgs {
  const void* x;          // [M, K] activations (bf16 for the bf16 GEMM, int16 codes for int8)
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
};
// Columns blocks [nb_begin, nb_end) of 16, all rows.
void gemm_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end);

// ---- int8-weight GEMM (gemm_int8_avx512.cpp) ----------------------------------------
// A weight is u8 codes q with, per block of 32 along K, a scale d and an offset m:
// w = d * q + m (symmetric int8: q = i8 + 128, m = -128 d; GGUF Q4_1: q in 0..15, m = min;
// Q8_0: like symmetric int8). Packed by int8.py: codes [ceil(N/16), K/2, 16, 2] (32 bytes
// = 16 columns x 2 inputs, widened to vpdpwssd's operand) or, when every code fits in 4
// bits, [ceil(N/16), K/4, 32] (two such steps per 32 bytes: low nibbles, high nibbles);
// dm [ceil(N/16), K/32, 2, 16].
// Activations are quantized per row and block of 32 to int16 (scale = absmax / 32767).
void quantize_rows_int16(const void* x, int64_t ldx, int dtype, int64_t K, int16_t* q, float* scales, float* sums,
                         int64_t m_begin, int64_t m_end);
void gemm_int8_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end);

// ---- element-wise (elementwise_avx512.cpp) ------------------------------------------
// transformers' Llama RMSNorm: y = w * round(x / rms(x)), normalised in float32.
void rms_norm_rows(const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int64_t n, float eps,
                   int dtype, int64_t m_begin, int64_t m_end);
// y = silu(gu[:, :I]) * gu[:, I:], rounded to the dtype after each op as torch does.
void silu_mul_rows(const void* gu, int64_t ldg, void* y, int64_t ldy, int64_t inter, int dtype,
                   int64_t m_begin, int64_t m_end);
// Rotary embedding and the KV write of rows [m_begin, m_end) of a fused qkv projection:
// q heads rotated into q_out, k heads rotated and v heads copied into the caches at the
// rows' slots. cos_sin row p = [cos (D), signed sin (D)] for position p (see llama.py).
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
};
void rope_kv_rows(const RopeKVArgs& a, int64_t m_begin, int64_t m_end);

}  // namespace preheat
