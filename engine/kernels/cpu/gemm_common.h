// The epilogue and tile dispatch shared by the bf16 and int8 GEMMs (AVX-512 units only).
#pragma once
#include "avx512_common.h"

namespace preheat {
namespace avx512 {

// The next group of column blocks' bytes, fetched toward L2 a few lines per inner step
// while this group computes. A group's first tile of rows streams its weights from memory
// and the other row tiles run from cache, leaving the memory idle: without this, a decode
// step's multiplies took about the time of the memory plus that of the arithmetic
// (measured: 4-bit codes at 8 rows, 30 layers cold 4.35 ms against 2.54 hot).
struct Ahead {
  const char* next = nullptr;
  int64_t bytes = 0;     // left to fetch
  int64_t per_step = 0;  // bytes a step() asks for
  void step() {
    const int64_t n = per_step < bytes ? per_step : bytes;
    for (int64_t off = 0; off < n; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
    next += n;
    bytes -= n;
  }
};

// `bytes` from `p` spread over `steps` calls of step() (nothing when p is null).
inline Ahead ahead_over(const void* p, int64_t bytes, int64_t steps) {
  Ahead a;
  if (p != nullptr && bytes > 0 && steps > 0) {
    a.next = (const char*)p;
    a.bytes = bytes;
    a.per_step = ((bytes + steps - 1) / steps + 63) / 64 * 64;
  }
  return a;
}

}  // namespace avx512

namespace {

// Stores row m of column block n0 (bias: that block's, or zero when a.bias is null).
inline void store_row(const GemmArgs& a, __m512 v, int64_t m, int64_t n0, __m512 bias, __mmask16 mask) {
  const int dt = a.out_dtype;
  if (a.bias) v = _mm512_add_ps(v, bias);
  if (a.residual) {
    if (dt == 1) v = round_bf16(v);
    v = _mm512_add_ps(v, load16_masked(elem(a.residual, m * a.ldr + n0, dt), dt, mask));
  }
  store16_masked(elem(a.y, m * a.ldy + n0, dt), v, dt, mask);
}

// Column block n0's bias (zero when there is none) and its mask of columns below N.
inline __m512 block_bias(const GemmArgs& a, int64_t n0, __mmask16 mask) {
  return a.bias ? load16_masked(elem(a.bias, n0, a.out_dtype), a.out_dtype, mask) : _mm512_setzero_ps();
}

// Stores accumulator rows [m0, m0 + MT) x column blocks [nb0, nb0 + NT) with bias and residual.
template <int MT, int NT>
inline void store_tile(const GemmArgs& a, __m512 (&acc)[MT][NT], int64_t m0, int64_t nb0) {
  for (int j = 0; j < NT; ++j) {
    const int64_t n0 = (nb0 + j) * 16;
    if (n0 >= a.N) break;
    const __mmask16 mask = tail_mask(a.N - n0);
    const __m512 bias = block_bias(a, n0, mask);
    for (int i = 0; i < MT; ++i) store_row(a, acc[i][j], m0 + i, n0, bias, mask);
  }
}

// Whether a bf16 product of these rows runs on AMX tiles (gemm_bf16_amx.cpp): where they are
// switched on, any rows up to 16, more when K is a multiple of 32 (two tiles of rows).
inline bool amx_bf16_takes(const GemmArgs& a) { return amx_bf16_on && (a.M <= 16 || a.K % 32 == 0); }

}  // namespace

namespace avx512 {
// Rows and column blocks per tile of the bf16 GEMM (as many as the registers hold).
constexpr int64_t MT_BF16 = 6, NT_BF16 = 4;
// The bf16 GEMM's rows [0, a.M) x column blocks [nb0, nb0 + nt) (nt <= NT_BF16), the weights
// read from `w` in the packed layout ([K/2, 16, 2] bf16 pairs per block): the int8 GEMM runs
// it over a panel of dequantized codes (gemm_int8_avx512.cpp).
// `ahead`: bytes to fetch meanwhile (the next group's), or null; it steps once per 16
// input pairs of every tile of rows, bf16_rows_steps(a) times in all.
void gemm_bf16_rows(const GemmArgs& a, const uint16_t* w, int64_t nb0, int64_t nt, Ahead* ahead);
inline int64_t bf16_row_tiles(const GemmArgs& a) { return (a.M + row_tile(a.M, MT_BF16) - 1) / row_tile(a.M, MT_BF16); }
inline int64_t bf16_rows_steps(const GemmArgs& a) { return bf16_row_tiles(a) * ((a.K / 2 + 15) / 16); }
}  // namespace avx512
}  // namespace preheat
