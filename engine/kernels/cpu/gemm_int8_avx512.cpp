// int8-weight GEMM: u8 weight codes (8 bits, or a GGUF's 4 kept at 4) multiplied with
// activation codes, integer sums per block of 32 inputs, scaled into float32 per block:
//   sum_k w x = sum_blocks d * xs * sum(q * qx) + m * xs * sum(qx)
// (w = d q + m per weight block, x = xs qx per activation block). By default activations
// are quantized per row and block of 32 to int16 (scale absmax / 32767: a relative error
// near 1e-5, far below bfloat16's own rounding) and multiplied by vpdpwssd on the codes
// widened to 16 bits. With --int8-activation-bits 8 (GemmArgs::act_bits) they are int8
// (absmax / 127), as llama.cpp quantizes them (Q8_1) against its 4-bit blocks, and one
// vpdpbusd does 64 multiply-adds where vpdpwssd does 32: prompts and batches of 8+ rows,
// bound by compute, gain; benchmarks/results/int8_accuracy.md measures what it costs in
// accuracy. A decode step reads the weights once, at a byte (or half a byte) each. A
// prompt's bf16 rows at int16 codes take another way (gemm_int8_bf16_blocks): the codes
// dequantized into a bf16 panel and the bf16 GEMM over it, as fast as vdpbf16ps runs.
#include "gemm_common.h"

#include <vector>

namespace preheat {
namespace avx512 {
namespace {

constexpr int64_t PREFETCH_BLOCKS = 4;  // how many blocks of 32 inputs ahead each stream is fetched

// Codes of column block j, input pair kp, widened to 16 bits: [16 columns x 2 inputs].
// 8-bit codes: 32 bytes per pair. 4-bit codes (a GGUF Q4_1's, kept at their size): 32 bytes
// per two pairs, the low nibbles holding pair 2p and the high ones pair 2p + 1.
template <int BITS>
inline int64_t column_stride(int64_t K2) {
  return BITS == 8 ? K2 * 32 : K2 * 16;
}

// Rows of a prompt or a large batch use every weight many times: putting the codes into
// vpdpbusd's order in registers for each tile of rows (a shift, an insert, an and and a
// vpermw per 4 inputs of 16 columns, shared by only 4 rows) cost about as much as the
// products. With 8-bit activation codes such a call first expands each group of column
// blocks once into a panel that holds the operands as vpdpbusd takes them (EXPANDED: int8
// quads, 64 bytes per 16 columns x 4 inputs), then runs every tile of rows over it with
// plain loads. (The same panel of int16 pairs for vpdpwssd measured no faster than widening
// in registers: int16 codes of a prompt go through a bf16 panel instead, see
// gemm_int8_bf16_blocks.)
constexpr int EXPANDED = 0;

// Bytes per column block of an EXPANDED panel: 16 columns x K inputs, a byte each.
inline int64_t panel_stride(int64_t K2) { return K2 * 32; }

// One block of 32 inputs, int16 activation codes: vpdpwssd on the weight codes widened to
// 16 bits, 32 products per instruction.
template <int MT, int NT, int BITS>
inline void block_int16(__m512i (&ia)[MT][NT], const uint8_t* w, int64_t stride, const int16_t* x, int64_t ldx,
                        int64_t kb) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 8
  for (int p = 0; p < 16; p += 2) {
    const int64_t kp = kb * 16 + p;
    __m256i raw[NT];
    __m512i wv[NT];
    for (int half = 0; half < 2; ++half) {
      for (int j = 0; j < NT; ++j) {
        if constexpr (BITS == 8) {
          wv[j] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + j * stride + (kp + half) * 32)));
        } else {
          if (half == 0) raw[j] = _mm256_loadu_si256((const __m256i*)(w + j * stride + kp * 16));
          const __m256i nib = half == 0 ? raw[j] : _mm256_srli_epi16(raw[j], 4);
          wv[j] = _mm512_cvtepu8_epi16(_mm256_and_si256(nib, low4));
        }
      }
      for (int i = 0; i < MT; ++i) {
        const __m512i xb = _mm512_set1_epi32(load_i32(x + i * ldx + (kp + half) * 2));
        for (int j = 0; j < NT; ++j) ia[i][j] = _mm512_dpwssd_epi32(ia[i][j], wv[j], xb);
      }
    }
  }
}

// The packing holds 16 columns x 2 inputs per 32 bytes (input pair p, then pair p + 1);
// vpdpbusd wants 16 columns x 4 inputs, each column's four bytes in its own 32-bit lane.
// Words 2c, 2c + 1 of the result are word c of pair p and word c of pair p + 1.
alignas(64) constexpr uint16_t QUAD_ORDER[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Codes of column block j for inputs 4 kq .. 4 kq + 3, in vpdpbusd's order. 8-bit codes:
// pairs 2 kq and 2 kq + 1 are 64 consecutive bytes; 4-bit codes: 32 bytes, pair 2 kq in the
// low nibbles and 2 kq + 1 in the high ones.
template <int BITS>
inline __m512i quad_codes(const uint8_t* column, int64_t kq, __m512i order) {
  if constexpr (BITS == EXPANDED) return _mm512_loadu_si512(column + kq * 64);
  __m512i halves;
  if constexpr (BITS == 8) {
    halves = _mm512_loadu_si512(column + kq * 64);
  } else {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(column + kq * 32));
    halves = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1),
                              _mm512_set1_epi8(0x0F));
  }
  return _mm512_permutexvar_epi16(order, halves);
}

// One block of 32 inputs, int8 activation codes: vpdpbusd (u8 weight codes x s8
// activations), 64 products per instruction.
template <int MT, int NT, int BITS>
inline void block_int8(__m512i (&ia)[MT][NT], const uint8_t* w, int64_t stride, const int8_t* x, int64_t ldx,
                       int64_t kb) {
  const __m512i order = _mm512_load_si512(QUAD_ORDER);
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    const int64_t kq = kb * 8 + q;
    __m512i wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = quad_codes<BITS>(w + j * stride, kq, order);
    for (int i = 0; i < MT; ++i) {
      const __m512i xb = _mm512_set1_epi32(load_i32(x + i * ldx + kq * 4));
      for (int j = 0; j < NT; ++j) ia[i][j] = _mm512_dpbusd_epi32(ia[i][j], wv[j], xb);
    }
  }
}

// Rows [m0, m0 + MT) x column blocks [nb0, nb0 + NT): integer sums per block of 32 inputs
// (block_int16 / block_int8, by a.act_bits), scaled into float32 per block.
// `w`: the codes of column block nb0 (in the packing, or the panel when BITS is EXPANDED).
// `ahead`: the next group's codes and scales, fetched meanwhile (see Ahead).
template <int MT, int NT, int BITS>
void tile_int8(const GemmArgs& a, const uint8_t* w, int64_t m0, int64_t nb0, Ahead (&ahead)[2]) {
  const int64_t K2 = a.K / 2, KB = a.K / 32;
  const int64_t stride = BITS == EXPANDED ? panel_stride(K2) : column_stride<BITS>(K2);
  const uint16_t* dm = a.dm + nb0 * KB * 32;
  const float* xs = a.xs + m0 * KB;
  const float* xsum = a.xsum + m0 * KB;
  constexpr int64_t block_bytes = BITS == 8 ? 512 : 256;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    ahead[0].step();
    ahead[1].step();
    // Each column block is its own stream: ask for its lines early (a panel is in cache).
    if constexpr (BITS != EXPANDED) {
      for (int j = 0; j < NT; ++j) {
        const uint8_t* ahead = w + j * stride + (kb + PREFETCH_BLOCKS) * block_bytes;
        for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch((const char*)ahead + line, _MM_HINT_T0);
      }
    }
    __m512i ia[MT][NT];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j) ia[i][j] = _mm512_setzero_si512();
    if (BITS == EXPANDED || a.act_bits == 8)
      block_int8<MT, NT, BITS>(ia, w, stride, (const int8_t*)a.x + m0 * a.ldx, a.ldx, kb);
    else if constexpr (BITS != EXPANDED)
      block_int16<MT, NT, BITS>(ia, w, stride, (const int16_t*)a.x + m0 * a.ldx, a.ldx, kb);
    for (int j = 0; j < NT; ++j) {
      const __m512i dmv = _mm512_loadu_si512(dm + (j * KB + kb) * 32);
      const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(dmv));
      const __m512 m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dmv, 1));
      for (int i = 0; i < MT; ++i) {
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(ia[i][j]), _mm512_set1_ps(xs[i * KB + kb]));
        acc[i][j] = _mm512_fmadd_ps(d, f, acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[i * KB + kb]), acc[i][j]);
      }
    }
  }
  store_tile<MT, NT>(a, acc, m0, nb0);
}

template <int MT, int NTMAX, int BITS>
void tile_int8_nt(const GemmArgs& a, const uint8_t* w, int64_t m0, int64_t nb0, int64_t nt, Ahead (&ahead)[2]) {
  if constexpr (NTMAX >= 4) { if (nt >= 4) return tile_int8<MT, 4, BITS>(a, w, m0, nb0, ahead); }
  if constexpr (NTMAX >= 3) { if (nt >= 3) return tile_int8<MT, 3, BITS>(a, w, m0, nb0, ahead); }
  if (nt >= 2) return tile_int8<MT, 2, BITS>(a, w, m0, nb0, ahead);
  return tile_int8<MT, 1, BITS>(a, w, m0, nb0, ahead);
}

// Rows [0, M) x column blocks [nb, nb + nt), read from `w` (the packing, or a panel).
template <int BITS>
void rows_int8(const GemmArgs& a, const uint8_t* w, int64_t nb, int64_t nt, int64_t mt, Ahead (&ahead)[2]) {
  for (int64_t m0 = 0; m0 < a.M; m0 += mt) {
    switch (imin(mt, a.M - m0)) {
      case 4: tile_int8_nt<4, 3, BITS>(a, w, m0, nb, nt, ahead); break;
      case 3: tile_int8_nt<3, 4, BITS>(a, w, m0, nb, nt, ahead); break;
      case 2: tile_int8_nt<2, 4, BITS>(a, w, m0, nb, nt, ahead); break;
      default: tile_int8_nt<1, 4, BITS>(a, w, m0, nb, nt, ahead); break;
    }
  }
}

// The codes and scales of the group of column blocks after [nb, nb + group) (up to nb_end),
// spread over `steps` inner steps.
template <int BITS>
void ahead_of_next(const GemmArgs& a, int64_t nb, int64_t group, int64_t nb_end, int64_t steps, Ahead (&ahead)[2]) {
  const int64_t next = imin(group, nb_end - nb - group), K2 = a.K / 2, KB = a.K / 32;
  const int64_t stride = column_stride<BITS>(K2);
  ahead[0] = ahead_over(next > 0 ? (const uint8_t*)a.w + (nb + group) * stride : nullptr, next * stride, steps);
  ahead[1] = ahead_over(next > 0 ? a.dm + (nb + group) * KB * 32 : nullptr, next * KB * 64, steps);
}

// Column blocks [nb0, nb0 + nt) of the packed codes, expanded into `panel` (see EXPANDED).
template <int BITS>
void expand_panel(const GemmArgs& a, int64_t nb0, int64_t nt, uint8_t* panel) {
  const int64_t K2 = a.K / 2, stride = column_stride<BITS>(K2), out = panel_stride(K2);
  const uint8_t* w = (const uint8_t*)a.w + nb0 * stride;
  const __m512i order = _mm512_load_si512(QUAD_ORDER);
  for (int64_t j = 0; j < nt; ++j)
    for (int64_t kq = 0; kq < a.K / 4; ++kq)
      _mm512_storeu_si512(panel + j * out + kq * 64, quad_codes<BITS>(w + j * stride, kq, order));
}

// Column blocks [nb0, nb0 + nt) of the codes as bf16 pairs in the bf16 GEMM's packing
// ([K/2, 16, 2] per block): w = d q + m per block of 32 inputs in float32, rounded once.
template <int BITS>
void dequantize_panel(const GemmArgs& a, int64_t nb0, int64_t nt, uint16_t* panel) {
  const int64_t K2 = a.K / 2, KB = a.K / 32, stride = column_stride<BITS>(K2);
  const uint8_t* w = (const uint8_t*)a.w + nb0 * stride;
  // A pair's 32 codes are columns 0-7 then 8-15, each column's two inputs side by side:
  // each column's scale and offset, twice.
  const __m512i first_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i last_cols = _mm512_add_epi32(first_cols, _mm512_set1_epi32(8));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t j = 0; j < nt; ++j) {
    const uint8_t* column = w + j * stride;
    uint16_t* out = panel + j * K2 * 32;
    for (int64_t kb = 0; kb < KB; ++kb) {
      const __m512i dmv = _mm512_loadu_si512(a.dm + ((nb0 + j) * KB + kb) * 32);
      const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(dmv));
      const __m512 m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dmv, 1));
      const __m512 d0 = _mm512_permutexvar_ps(first_cols, d), d1 = _mm512_permutexvar_ps(last_cols, d);
      const __m512 m0 = _mm512_permutexvar_ps(first_cols, m), m1 = _mm512_permutexvar_ps(last_cols, m);
      for (int64_t kp = kb * 16; kp < kb * 16 + 16; ++kp) {
        __m256i codes;  // pair kp: 16 columns x 2 inputs, a byte each
        if constexpr (BITS == 8) {
          codes = _mm256_loadu_si256((const __m256i*)(column + kp * 32));
        } else {
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(column + (kp & ~1) * 16));
          codes = _mm256_and_si256(kp & 1 ? _mm256_srli_epi16(raw, 4) : raw, low4);
        }
        const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes)));
        const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1)));
        const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(d1, v1, m1), _mm512_fmadd_ps(d0, v0, m0));
        _mm512_storeu_si512(out + kp * 32, (__m512i)pairs);
      }
    }
  }
}

// Rows from which a call with 8-bit activation codes expands panels. Measured on Zen 5
// (2026-12-05), the model's four matrices: at 8 rows the panel was no faster (each weight
// serves two tiles of rows); 1.17x at 16, 1.3x at 32, 1.44x at 256.
constexpr int64_t PANEL_ROWS = 16;

// A buffer of this thread's, kept between calls (every layer of a prompt needs one).
inline void* thread_panel(size_t bytes) {
  thread_local std::vector<__m512i> panel;
  if (panel.size() * 64 < bytes) panel.resize((bytes + 63) / 64);
  return panel.data();
}

template <int BITS>
void gemm_int8_bits(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  const int64_t mt = row_tile(a.M, 4);
  const int64_t ntmax = mt <= 3 ? 4 : 3;  // column tiles as wide as the registers allow
  const int64_t K2 = a.K / 2, steps = (a.M + mt - 1) / mt * (a.K / 32);  // inner steps per group
  if (a.act_bits == 8 && a.M >= PANEL_ROWS) {
    uint8_t* panel = (uint8_t*)thread_panel(ntmax * panel_stride(K2));
    for (int64_t nb = nb_begin; nb < nb_end; nb += ntmax) {
      const int64_t nt = imin(ntmax, nb_end - nb);
      expand_panel<BITS>(a, nb, nt, panel);
      Ahead ahead[2];
      ahead_of_next<BITS>(a, nb, ntmax, nb_end, steps, ahead);
      rows_int8<EXPANDED>(a, panel, nb, nt, mt, ahead);
    }
    return;
  }
  const uint8_t* w = (const uint8_t*)a.w;
  for (int64_t nb = nb_begin; nb < nb_end; nb += ntmax) {
    Ahead ahead[2];
    ahead_of_next<BITS>(a, nb, ntmax, nb_end, steps, ahead);
    rows_int8<BITS>(a, w + nb * column_stride<BITS>(K2), nb, imin(ntmax, nb_end - nb), mt, ahead);
  }
}

template <int BITS>
void gemm_int8_bf16_bits(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  uint16_t* panel = (uint16_t*)thread_panel(NT_BF16 * (a.K / 2) * 64);
  const int64_t steps = bf16_rows_steps(a);
  for (int64_t nb = nb_begin; nb < nb_end; nb += NT_BF16) {
    const int64_t nt = imin(NT_BF16, nb_end - nb);
    dequantize_panel<BITS>(a, nb, nt, panel);
    Ahead ahead[2];
    ahead_of_next<BITS>(a, nb, NT_BF16, nb_end, steps, ahead);
    if (amx_bf16_takes(a))
      gemm_bf16_amx_panel(a, panel, nb, nt);
    else
      gemm_bf16_rows(a, panel, nb, nt, &ahead[0]);  // the scales are a fifth of the bytes: left to the hardware
  }
}

}  // namespace

void gemm_int8_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  if (a.code_bits == 4)
    gemm_int8_bits<4>(a, nb_begin, nb_end);
  else
    gemm_int8_bits<8>(a, nb_begin, nb_end);
}

void gemm_int8_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  if (a.code_bits == 4)
    gemm_int8_bf16_bits<4>(a, nb_begin, nb_end);
  else
    gemm_int8_bf16_bits<8>(a, nb_begin, nb_end);
}

namespace {

// Rows to Code (int16_t or int8_t) codes per block of 32: scale = absmax / the largest code.
template <typename Code>
void quantize_rows(const void* x, int64_t ldx, int dtype, int64_t K, Code* q, float* scales, float* sums,
                   int64_t m_begin, int64_t m_end) {
  constexpr float levels = sizeof(Code) == 2 ? 32767.0f : 127.0f;
  const int64_t KB = K / 32;
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      const __m512 v0 = load16(elem(x, m * ldx + kb * 32, dtype), dtype);
      const __m512 v1 = load16(elem(x, m * ldx + kb * 32 + 16, dtype), dtype);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / levels;
      const __m512 id = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
      Code* out = q + m * K + kb * 32;
      if constexpr (sizeof(Code) == 2) {
        _mm256_storeu_si256((__m256i*)out, _mm512_cvtsepi32_epi16(q0));
        _mm256_storeu_si256((__m256i*)(out + 16), _mm512_cvtsepi32_epi16(q1));
      } else {
        _mm_storeu_si128((__m128i*)out, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtsepi32_epi8(q1));
      }
      scales[m * KB + kb] = d;
      sums[m * KB + kb] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
  }
}

}  // namespace

const int ACTIVATION_BITS = 8;

void quantize_activations(const void* x, int64_t ldx, int dtype, int64_t K, int bits, void* codes, float* scales,
                          float* sums, int64_t m_begin, int64_t m_end) {
  if (bits == 8)
    quantize_rows(x, ldx, dtype, K, (int8_t*)codes, scales, sums, m_begin, m_end);
  else
    quantize_rows(x, ldx, dtype, K, (int16_t*)codes, scales, sums, m_begin, m_end);
}

void unpack_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) { unpack_bf16_rows(a, nb_begin, nb_end); }

void dequantize_int8_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  dequantize_int8_rows(a, nb_begin, nb_end);
}

}  // namespace avx512
}  // namespace preheat
