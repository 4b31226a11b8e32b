// The skinny GEMMs of gemm_bf16_avx512.cpp, gemm_f32_avx512.cpp and gemm_int8_avx512.cpp for AVX2 CPUs, on the
// same packed weights (linear.py and int8.py pack once, whatever the CPU).
//  - bf16: AVX2 has no bf16 dot product, so each 32-byte load of packed pairs (8 columns x
//    2 inputs) becomes two float32 vectors, the even inputs (shifted up 16 bits) and the
//    odd ones (masked), each multiplied exactly in float32 against a broadcast activation
//    (the row is converted to float32 once per call) with FMA.
//  - float32: the same FMAs, 8 columns per register instead of 16.
//  - int8: vpmaddwd is vpdpwssd without the accumulate (pairs of int16 products summed into
//    int32 lanes), so the integer block sums and the per-block float32 scaling are those of
//    the AVX-512 build, 8 columns per register instead of 16.
#include <stdlib.h>

#include "avx2_common.h"

namespace preheat {
namespace avx2 {
namespace {

// Stores accumulator rows [m0, m0 + MT) x column blocks [nb0, nb0 + NT) (two halves of 8
// columns each) with bias and residual.
template <int MT, int NT>
inline void store_tile(const GemmArgs& a, const __m256 (&acc)[MT][NT][2], int64_t m0, int64_t nb0) {
  const int dt = a.out_dtype;
  for (int j = 0; j < NT; ++j) {
    for (int h = 0; h < 2; ++h) {
      const int64_t n0 = (nb0 + j) * 16 + h * 8;
      if (n0 >= a.N) return;
      const int64_t n = a.N - n0;
      const __m256 bias = a.bias ? load8_n(elem(a.bias, n0, dt), dt, n) : _mm256_setzero_ps();
      for (int i = 0; i < MT; ++i) {
        __m256 v = a.bias ? _mm256_add_ps(acc[i][j][h], bias) : acc[i][j][h];
        if (a.residual) {
          if (dt == 1) v = round_bf16(v);
          v = _mm256_add_ps(v, load8_n(elem(a.residual, (m0 + i) * a.ldr + n0, dt), dt, n));
        }
        store8_n(elem(a.y, (m0 + i) * a.ldy + n0, dt), v, dt, n);
      }
    }
  }
}

// The accumulators as a copy for store_tile: handing the loop's own array to it by
// reference makes GCC keep that array in memory too, storing every accumulator on each
// step of the inner loop (measured: a third of the AVX2 GEMMs' time); a copy taken after
// the loop leaves the loop's array in registers.
template <int MT, int NT>
struct Accumulators {
  __m256 v[MT][NT][2];
};
template <int MT, int NT>
inline Accumulators<MT, NT> spill_free(const __m256 (&acc)[MT][NT][2]) {
  Accumulators<MT, NT> out;
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out.v[i][j][0] = acc[i][j][0], out.v[i][j][1] = acc[i][j][1];
  return out;
}

// ---- bf16 ---------------------------------------------------------------------------
template <int MT, int NT>
void tile_bf16(const GemmArgs& a, const float* xf, int64_t m0, int64_t nb0) {
  const int64_t K = a.K, K2 = K / 2;
  const uint16_t* w = (const uint16_t*)a.w + nb0 * K2 * 32;
  const __m256i high = _mm256_set1_epi32((int32_t)0xFFFF0000u);
  __m256 acc[MT][NT][2];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m256 we[NT][2], wo[NT][2];
    for (int j = 0; j < NT; ++j) {
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + (j * K2 + kp) * 32 + h * 16));
        we[j][h] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        wo[j][h] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m256 xe = _mm256_set1_ps(xf[(m0 + i) * K + 2 * kp]);
      const __m256 xo = _mm256_set1_ps(xf[(m0 + i) * K + 2 * kp + 1]);
      for (int j = 0; j < NT; ++j)
        for (int h = 0; h < 2; ++h) {
          acc[i][j][h] = _mm256_fmadd_ps(we[j][h], xe, acc[i][j][h]);
          acc[i][j][h] = _mm256_fmadd_ps(wo[j][h], xo, acc[i][j][h]);
        }
    }
  }
  store_tile<MT, NT>(a, spill_free(acc).v, m0, nb0);
}

template <int NT>
void rows_bf16(const GemmArgs& a, const float* xf, int64_t mt, int64_t nb) {
  for (int64_t m0 = 0; m0 < a.M; m0 += mt) {
    switch (imin(mt, a.M - m0)) {
      case 4: tile_bf16<4, NT>(a, xf, m0, nb); break;
      case 3: tile_bf16<3, NT>(a, xf, m0, nb); break;
      case 2: tile_bf16<2, NT>(a, xf, m0, nb); break;
      default: tile_bf16<1, NT>(a, xf, m0, nb); break;
    }
  }
}

// ---- float32 ------------------------------------------------------------------------
// [ceil(N/16), K, 16] floats: two 32-byte loads per input and column block; up to 6 rows x
// 2 halves of accumulators, 2 weight vectors and a broadcast: 15 of the 16 registers.
template <int MT>
void tile_f32(const GemmArgs& a, int64_t m0, int64_t nb0) {
  const int64_t K = a.K;
  const float* x = (const float*)a.x + m0 * a.ldx;
  const float* w = (const float*)a.w + nb0 * K * 16;
  __m256 acc[MT][1][2];
  for (int i = 0; i < MT; ++i) acc[i][0][0] = acc[i][0][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
    for (int i = 0; i < MT; ++i) {
      const __m256 xb = _mm256_set1_ps(x[i * a.ldx + k]);
      acc[i][0][0] = _mm256_fmadd_ps(w0, xb, acc[i][0][0]);
      acc[i][0][1] = _mm256_fmadd_ps(w1, xb, acc[i][0][1]);
    }
  }
  store_tile<MT, 1>(a, spill_free(acc).v, m0, nb0);
}

// ---- int8 ---------------------------------------------------------------------------
constexpr int64_t PREFETCH_BLOCKS = 4;  // how many blocks of 32 inputs ahead the weights are fetched

template <int MT, int BITS>
void tile_int8(const GemmArgs& a, int64_t m0, int64_t nb0) {
  const int64_t K2 = a.K / 2, KB = a.K / 32, stride = BITS == 8 ? K2 * 32 : K2 * 16;
  const int16_t* x = (const int16_t*)a.x + m0 * a.ldx;
  const uint8_t* w = (const uint8_t*)a.w + nb0 * stride;
  const uint16_t* dm = a.dm + nb0 * KB * 32;
  const float* xs = a.xs + m0 * KB;
  const float* xsum = a.xsum + m0 * KB;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  constexpr int64_t block_bytes = BITS == 8 ? 512 : 256;
  __m256 acc[MT][1][2];
  for (int i = 0; i < MT; ++i) acc[i][0][0] = acc[i][0][1] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* ahead = w + (kb + PREFETCH_BLOCKS) * block_bytes;
    for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch((const char*)ahead + line, _MM_HINT_T0);
    __m256i ia[MT][2];
    for (int i = 0; i < MT; ++i) ia[i][0] = ia[i][1] = _mm256_setzero_si256();
    for (int64_t kp = kb * 16; kp < kb * 16 + 16; kp += 2) {
      __m256i raw;
      for (int half = 0; half < 2; ++half) {
        __m256i codes;  // 16 columns x 2 inputs, a byte each
        if constexpr (BITS == 8) {
          codes = _mm256_loadu_si256((const __m256i*)(w + (kp + half) * 32));
        } else {
          if (half == 0) raw = _mm256_loadu_si256((const __m256i*)(w + kp * 16));
          codes = _mm256_and_si256(half == 0 ? raw : _mm256_srli_epi16(raw, 4), low4);
        }
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(codes));       // columns 0-7
        const __m256i w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(codes, 1));  // columns 8-15
        for (int i = 0; i < MT; ++i) {
          const __m256i xb = _mm256_set1_epi32(load_i32(x + i * a.ldx + (kp + half) * 2));
          ia[i][0] = _mm256_add_epi32(ia[i][0], _mm256_madd_epi16(w0, xb));
          ia[i][1] = _mm256_add_epi32(ia[i][1], _mm256_madd_epi16(w1, xb));
        }
      }
    }
    const uint16_t* blk = dm + kb * 32;
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + h * 8)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 + h * 8)));
      for (int i = 0; i < MT; ++i) {
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(ia[i][h]), _mm256_set1_ps(xs[i * KB + kb]));
        acc[i][0][h] = _mm256_fmadd_ps(d, f, acc[i][0][h]);
        acc[i][0][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[i * KB + kb]), acc[i][0][h]);
      }
    }
  }
  store_tile<MT, 1>(a, spill_free(acc).v, m0, nb0);
}

template <int BITS>
void gemm_int8_bits(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  const int64_t mt = row_tile(a.M, 4);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    for (int64_t m0 = 0; m0 < a.M; m0 += mt) {
      switch (imin(mt, a.M - m0)) {
        case 4: tile_int8<4, BITS>(a, m0, nb); break;
        case 3: tile_int8<3, BITS>(a, m0, nb); break;
        case 2: tile_int8<2, BITS>(a, m0, nb); break;
        default: tile_int8<1, BITS>(a, m0, nb); break;
      }
    }
  }
}

}  // namespace

void gemm_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  // The rows in float32 once: every column block broadcasts from them.
  float* xf = (float*)malloc(sizeof(float) * (a.M * a.K + 8));  // + 8: a row's last store may run over
  if (xf == nullptr) abort();
  for (int64_t m = 0; m < a.M; ++m) {
    const uint16_t* row = (const uint16_t*)a.x + m * a.ldx;
    for (int64_t k = 0; k < a.K; k += 8)
      _mm256_storeu_ps(xf + m * a.K + k, load8_n(row + k, 1, a.K - k));
  }
  const int64_t mt = row_tile(a.M, 4);
  for (int64_t nb = nb_begin; nb < nb_end;) {
    if (mt <= 2 && nb + 1 < nb_end) {  // few rows: two column blocks per tile keep the FMAs busy
      rows_bf16<2>(a, xf, mt, nb);
      nb += 2;
    } else {
      rows_bf16<1>(a, xf, mt, nb);
      nb += 1;
    }
  }
  free(xf);
}

void gemm_f32_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  const int64_t mt = row_tile(a.M, 6);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    for (int64_t m0 = 0; m0 < a.M; m0 += mt) {
      switch (imin(mt, a.M - m0)) {
        case 6: tile_f32<6>(a, m0, nb); break;
        case 5: tile_f32<5>(a, m0, nb); break;
        case 4: tile_f32<4>(a, m0, nb); break;
        case 3: tile_f32<3>(a, m0, nb); break;
        case 2: tile_f32<2>(a, m0, nb); break;
        default: tile_f32<1>(a, m0, nb); break;
      }
    }
  }
}

void gemm_int8_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  if (a.code_bits == 4)
    gemm_int8_bits<4>(a, nb_begin, nb_end);
  else
    gemm_int8_bits<8>(a, nb_begin, nb_end);
}

const int ACTIVATION_BITS = 16;  // no vpdpbusd without AVX-VNNI, and vpmaddubsw saturates on 8-bit codes

void quantize_activations(const void* x, int64_t ldx, int dtype, int64_t K, int bits, void* codes, float* scales,
                          float* sums, int64_t m_begin, int64_t m_end) {
  (void)bits;  // always 16 here (linear_int8 checks)
  int16_t* q = (int16_t*)codes;
  const int64_t KB = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = load8(elem(x, m * ldx + kb * 32 + i * 8, dtype), dtype);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      }
      const float d = hmax8(amax) / 32767.0f;
      const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      __m256i qi[4], total = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
        total = _mm256_add_epi32(total, qi[i]);
      }
      // packs works within 128-bit lanes: (a0-3, b0-3, a4-7, b4-7), put back in order.
      for (int i = 0; i < 4; i += 2)
        _mm256_storeu_si256((__m256i*)(q + m * K + kb * 32 + i * 8),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[i], qi[i + 1]), 0xD8));
      scales[m * KB + kb] = d;
      sums[m * KB + kb] = d * (float)hsum8_epi32(total);
    }
  }
}

void unpack_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) { unpack_bf16_rows(a, nb_begin, nb_end); }

void dequantize_int8_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  dequantize_int8_rows(a, nb_begin, nb_end);
}

}  // namespace avx2
}  // namespace preheat
