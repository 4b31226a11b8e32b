// Skinny bf16 GEMM for decode-sized batches (a few to a few dozen rows): weights are read
// once from memory per call (row tiles re-read them from L2), vdpbf16ps multiplies bf16
// pairs exactly and accumulates in float32.
#include "gemm_common.h"

namespace preheat {
namespace avx512 {
namespace {

// `w`: the packed pairs of column block nb0 ([K/2, 16, 2] per block, blocks back to back).
template <int MT, int NT>
void tile_bf16(const GemmArgs& a, const uint16_t* w, int64_t m0, int64_t nb0) {
  const int64_t K2 = a.K / 2;
  const uint16_t* x = (const uint16_t*)a.x + m0 * a.ldx;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = _mm512_loadu_si512(w + (j * K2 + kp) * 32);
    for (int i = 0; i < MT; ++i) {
      const __m512i xb = _mm512_set1_epi32(load_i32(x + i * a.ldx + 2 * kp));
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[j], (__m512bh)xb);
    }
  }
  store_tile<MT, NT>(a, acc, m0, nb0);
}

template <int MT>
void tile_bf16_nt(const GemmArgs& a, const uint16_t* w, int64_t m0, int64_t nb0, int64_t nt) {
  switch (nt) {
    case 4: tile_bf16<MT, 4>(a, w, m0, nb0); break;
    case 3: tile_bf16<MT, 3>(a, w, m0, nb0); break;
    case 2: tile_bf16<MT, 2>(a, w, m0, nb0); break;
    default: tile_bf16<MT, 1>(a, w, m0, nb0); break;
  }
}

constexpr int64_t MT_BF16 = 6;

}  // namespace

void gemm_bf16_rows(const GemmArgs& a, const uint16_t* w, int64_t nb0, int64_t nt) {
  const int64_t mt = row_tile(a.M, MT_BF16);
  for (int64_t m0 = 0; m0 < a.M; m0 += mt) {
    switch (imin(mt, a.M - m0)) {
      case 6: tile_bf16_nt<6>(a, w, m0, nb0, nt); break;
      case 5: tile_bf16_nt<5>(a, w, m0, nb0, nt); break;
      case 4: tile_bf16_nt<4>(a, w, m0, nb0, nt); break;
      case 3: tile_bf16_nt<3>(a, w, m0, nb0, nt); break;
      case 2: tile_bf16_nt<2>(a, w, m0, nb0, nt); break;
      default: tile_bf16_nt<1>(a, w, m0, nb0, nt); break;
    }
  }
}

void gemm_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  const uint16_t* w = (const uint16_t*)a.w;
  for (int64_t nb = nb_begin; nb < nb_end; nb += NT_BF16)
    gemm_bf16_rows(a, w + nb * (a.K / 2) * 32, nb, imin(NT_BF16, nb_end - nb));
}

}  // namespace avx512
}  // namespace preheat
