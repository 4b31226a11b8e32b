// Skinny bf16 GEMM for decode-sized batches (a few to a few dozen rows): weights are read
// once from memory per call (row tiles re-read them from L2), vdpbf16ps multiplies bf16
// pairs exactly and accumulates in float32.
#include "gemm_common.h"

namespace preheat {
namespace avx512 {
namespace {

// `w`: the packed pairs of column block nb0 ([K/2, 16, 2] per block, blocks back to back).
template <int MT, int NT>
void tile_bf16(const GemmArgs& a, const uint16_t* w, int64_t m0, int64_t nb0, Ahead& ahead) {
  const int64_t K2 = a.K / 2;
  const uint16_t* x = (const uint16_t*)a.x + m0 * a.ldx;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kp0 = 0; kp0 < K2; kp0 += 16) {
    ahead.step();
    for (int64_t kp = kp0, end = imin(kp0 + 16, K2); kp < end; ++kp) {
      __m512i wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = _mm512_loadu_si512(w + (j * K2 + kp) * 32);
      for (int i = 0; i < MT; ++i) {
        const __m512i xb = _mm512_set1_epi32(load_i32(x + i * a.ldx + 2 * kp));
        for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[j], (__m512bh)xb);
      }
    }
  }
  store_tile<MT, NT>(a, acc, m0, nb0);
}

template <int MT>
void tile_bf16_nt(const GemmArgs& a, const uint16_t* w, int64_t m0, int64_t nb0, int64_t nt, Ahead& ahead) {
  switch (nt) {
    case 4: tile_bf16<MT, 4>(a, w, m0, nb0, ahead); break;
    case 3: tile_bf16<MT, 3>(a, w, m0, nb0, ahead); break;
    case 2: tile_bf16<MT, 2>(a, w, m0, nb0, ahead); break;
    default: tile_bf16<MT, 1>(a, w, m0, nb0, ahead); break;
  }
}

}  // namespace

void gemm_bf16_rows(const GemmArgs& a, const uint16_t* w, int64_t nb0, int64_t nt, Ahead* ahead) {
  Ahead none;
  Ahead& fetch = ahead != nullptr ? *ahead : none;
  const int64_t mt = row_tile(a.M, MT_BF16);
  for (int64_t m0 = 0; m0 < a.M; m0 += mt) {
    switch (imin(mt, a.M - m0)) {
      case 6: tile_bf16_nt<6>(a, w, m0, nb0, nt, fetch); break;
      case 5: tile_bf16_nt<5>(a, w, m0, nb0, nt, fetch); break;
      case 4: tile_bf16_nt<4>(a, w, m0, nb0, nt, fetch); break;
      case 3: tile_bf16_nt<3>(a, w, m0, nb0, nt, fetch); break;
      case 2: tile_bf16_nt<2>(a, w, m0, nb0, nt, fetch); break;
      default: tile_bf16_nt<1>(a, w, m0, nb0, nt, fetch); break;
    }
  }
}

void gemm_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  if (amx_bf16_takes(a)) return gemm_bf16_amx_blocks(a, nb_begin, nb_end);
  const uint16_t* w = (const uint16_t*)a.w;
  const int64_t block = a.K / 2 * 32;  // bf16 values per column block
  // One tile of rows (up to MT_BF16) streams the weights once and the hardware's prefetchers
  // keep the long streams of bf16 pairs coming: fetching the next group as well measured
  // 1.1x slower at 1 row (Xeon). From two tiles the second re-reads the group from L2 while
  // the memory idles: fetching the next group meanwhile measured 0.7-0.8x the time at 16 rows
  // (Xeon); at 8 rows (two tiles of 4) no faster on the Xeon, on the AMD EPYC host (Zen 4,
  // 2026-12-07) 0.78-0.88x the time of SmolLM2's gate_up and qkv products, 0.91-1.02x its down
  // (30 copies cycled so the weights come from memory, builds alternating in one process), and
  // whole bf16 decode steps at batch 8 0.856x (benchmarks/results/bf16_fetch_next_steps.md).
  const bool fetch_next = bf16_row_tiles(a) >= 2;
  const int64_t steps = bf16_rows_steps(a);
  for (int64_t nb = nb_begin; nb < nb_end; nb += NT_BF16) {
    const int64_t next = fetch_next ? imin(NT_BF16, nb_end - nb - NT_BF16) : 0;  // blocks in the next group
    Ahead ahead = ahead_over(next > 0 ? w + (nb + NT_BF16) * block : nullptr, next * block * 2, steps);
    gemm_bf16_rows(a, w + nb * block, nb, imin(NT_BF16, nb_end - nb), &ahead);
  }
}

}  // namespace avx512
}  // namespace preheat
