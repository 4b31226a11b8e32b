// Skinny float32 GEMM for a float32 model: weights packed by linear.py as [ceil(N/16), K, 16]
// (one 64-byte load = 16 output columns of one input), each column block streamed once per
// call and re-read from L2 by the row tiles; one FMA per (row, 16 columns, input).
//
// Why not the library's sgemm: on CPUs where MKL does not take its AVX-512 path (AMD) it
// multiplies a decode batch's few rows at a quarter of this kernel's rate, and a float32
// model's step is nearly all products (benchmarks/results/cpu_builds.md).
#include "gemm_common.h"

namespace preheat {
namespace avx512 {
namespace {

template <int MT, int NT>
void tile_f32(const GemmArgs& a, int64_t m0, int64_t nb0) {
  const int64_t K = a.K;
  const float* x = (const float*)a.x + m0 * a.ldx;
  const float* w = (const float*)a.w + nb0 * K * 16;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = _mm512_loadu_ps(w + (j * K + k) * 16);
    for (int i = 0; i < MT; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * a.ldx + k]);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_fmadd_ps(wv[j], xb, acc[i][j]);
    }
  }
  store_tile<MT, NT>(a, acc, m0, nb0);
}

template <int MT>
void tile_f32_nt(const GemmArgs& a, int64_t m0, int64_t nb0, int64_t nt) {
  switch (nt) {
    case 4: tile_f32<MT, 4>(a, m0, nb0); break;
    case 3: tile_f32<MT, 3>(a, m0, nb0); break;
    case 2: tile_f32<MT, 2>(a, m0, nb0); break;
    default: tile_f32<MT, 1>(a, m0, nb0); break;
  }
}

// 6 x 4 accumulators + 4 weight vectors + a broadcast: 29 of the 32 registers.
constexpr int64_t NT_F32 = 4, MT_F32 = 6;

}  // namespace

void gemm_f32_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  const int64_t mt = row_tile(a.M, MT_F32);
  for (int64_t nb = nb_begin; nb < nb_end; nb += NT_F32) {
    const int64_t nt = imin(NT_F32, nb_end - nb);
    for (int64_t m0 = 0; m0 < a.M; m0 += mt) {
      switch (imin(mt, a.M - m0)) {
        case 6: tile_f32_nt<6>(a, m0, nb, nt); break;
        case 5: tile_f32_nt<5>(a, m0, nb, nt); break;
        case 4: tile_f32_nt<4>(a, m0, nb, nt); break;
        case 3: tile_f32_nt<3>(a, m0, nb, nt); break;
        case 2: tile_f32_nt<2>(a, m0, nb, nt); break;
        default: tile_f32_nt<1>(a, m0, nb, nt); break;
      }
    }
  }
}

}  // namespace avx512
}  // namespace preheat
