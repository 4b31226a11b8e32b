// The bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later): a decode step's products and
// a prompt's (up to cpu_ext.DENSE_PREFILL_ROWS_AMX_KERNELS rows, oneDNN's beyond). Where a
// CPU has AMX-BF16, its AVX-512 vdpbf16ps can be the slow way to multiply bf16 pairs
// (measured on the Xeon host, benchmarks/results/dot_product_rate.md: 1.7 G vdpbf16ps a
// second a core against 7.1 G vpdpwssd), which made 8 and 16 rows compute-bound; one
// TDPBF16PS multiplies a tile of up to 16 rows x 32 inputs by 32 inputs x 16 columns
// (16 x 512 multiply-adds), so the products are left waiting on memory only.
//
// The packed weights ([K/2, 16, 2] bf16 pairs per block of 16 columns) are already the B
// tile's layout: 16 input pairs x 16 columns, 64 bytes a pair, 1 KiB back to back. The rows
// of x are the A tile (M x 32 inputs, row stride ldx). Tiles: C 0-2 (three column blocks at
// a time), A 3, B 4 and 5 (alternating), and for K not a multiple of 32 an A tail 6 and a B
// tail 7 of the remaining pairs. The epilogue (bias, residual, rounding, store) is the
// AVX-512 kernel's, on the accumulators stored to a float tile.
//
// Tile state is per thread: each call loads its configuration and releases the tiles
// before returning (another library, oneDNN, may configure them differently between calls
// on the same thread). The process must have asked Linux for AMX state first (bindings.cpp,
// amx_bf16_usable) or TILELOADD faults.
// AMX code generation switched on before the AVX-512 one (avx512_common.h's pragma adds to
// this), so that kernels.h declares gemm_bf16_amx_blocks under the same target it is defined
// with: a pragma after the declaration makes GCC treat the definition as another version.
#pragma GCC target("amx-tile,amx-bf16")
#include "gemm_common.h"

namespace preheat {
namespace avx512 {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tile i
  uint8_t rows[16] = {};
};

constexpr int NB = 3;  // column blocks (C tiles) per pass over K

// Loads this thread's tile configuration. GCC 12 does not count LDTILECFG as reading the
// configuration: without the barrier it dropped the stores that fill it in (a zero
// configuration, then #UD at the first tile instruction).
inline void load_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Stores rows [m0, m0 + rows) of column blocks [nb, nb + nt) from the accumulators the tiles
// were stored to (acc: block j's row i at acc + (j * block_rows + i) * 16) with bias and
// residual.
inline void store_blocks(const GemmArgs& a, const float* acc, int64_t block_rows, int64_t nb, int64_t nt,
                         int64_t m0, int64_t rows) {
  for (int64_t j = 0; j < nt; ++j) {
    const int64_t n0 = (nb + j) * 16;
    if (n0 >= a.N) break;
    const __mmask16 mask = tail_mask(a.N - n0);
    const __m512 bias = block_bias(a, n0, mask);
    for (int64_t i = 0; i < rows; ++i)
      store_row(a, _mm512_load_ps(acc + (j * block_rows + i) * 16), m0 + i, n0, bias, mask);
  }
}

// The tile intrinsics take literal tile numbers (they are spelled into the instruction).
// Column blocks nb0 .. nb0 + NBT - 1 (NBT <= NB), all M rows; `w` holds block nb0's weights
// and the next ones' after them (64 bytes per input pair of a block).
template <int NBT>
void pass(const GemmArgs& a, const char* w, int64_t K2, int64_t full, int64_t tail, float (*acc)[16][16]) {
  const char* x = (const char*)a.x;
  const int64_t ldx = a.ldx * 2, wblock = K2 * 64;
  _tile_zero(0);
  if constexpr (NBT > 1) _tile_zero(1);
  if constexpr (NBT > 2) _tile_zero(2);
  for (int64_t kp = 0; kp < full; kp += 16) {
    _tile_loadd(3, x + kp * 4, ldx);
    _tile_loadd(4, w + kp * 64, 64);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (NBT > 1) {
      _tile_loadd(5, w + wblock + kp * 64, 64);
      _tile_dpbf16ps(1, 3, 5);
    }
    if constexpr (NBT > 2) {
      _tile_loadd(4, w + 2 * wblock + kp * 64, 64);
      _tile_dpbf16ps(2, 3, 4);
    }
  }
  if (tail > 0) {
    _tile_loadd(6, x + full * 4, ldx);
    _tile_loadd(7, w + full * 64, 64);
    _tile_dpbf16ps(0, 6, 7);
    if constexpr (NBT > 1) {
      _tile_loadd(7, w + wblock + full * 64, 64);
      _tile_dpbf16ps(1, 6, 7);
    }
    if constexpr (NBT > 2) {
      _tile_loadd(7, w + 2 * wblock + full * 64, 64);
      _tile_dpbf16ps(2, 6, 7);
    }
  }
  _tile_stored(0, &acc[0][0][0], 64);
  if constexpr (NBT > 1) _tile_stored(1, &acc[1][0][0], 64);
  if constexpr (NBT > 2) _tile_stored(2, &acc[2][0][0], 64);
  // GCC 12's tile loads and stores are asm statements without a memory clobber: tell it
  // that acc was written before the epilogue reads it.
  asm volatile("" : : : "memory");
}

// 17 to 32 rows (K a multiple of 32): two tiles of rows against two column blocks at a time,
// each B tile used twice. Tiles: C 0, 1 (rows 0-15, blocks j0, j1) and 2, 3 (rows 16-), A 4
// and 5 (the two tiles of rows), B 6 and 7 (the two blocks).
template <int NBT>
void pass_two_row_tiles(const GemmArgs& a, int64_t m0, const char* w, int64_t K2, float (*acc)[32][16]) {
  const int64_t ldx = a.ldx * 2, wblock = K2 * 64;
  const char* x = (const char*)a.x + m0 * ldx;
  const char* x1 = x + 16 * ldx;
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NBT > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t kp = 0; kp < K2; kp += 16) {
    _tile_loadd(4, x + kp * 4, ldx);
    _tile_loadd(5, x1 + kp * 4, ldx);
    _tile_loadd(6, w + kp * 64, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NBT > 1) {
      _tile_loadd(7, w + wblock + kp * 64, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, &acc[0][0][0], 64);
  _tile_stored(2, &acc[0][16][0], 64);
  if constexpr (NBT > 1) {
    _tile_stored(1, &acc[1][0][0], 64);
    _tile_stored(3, &acc[1][16][0], 64);
  }
  asm volatile("" : : : "memory");  // see pass
}

// More than 32 rows: groups of 32, the last one ending at row M (overlapping the one before
// when M is not a multiple of 32: its rows are computed twice, to the same values, and
// written twice; y is never the residual). Weights are read from memory once per group of
// two column blocks and from cache for every further group of rows.
void two_row_tiles(const GemmArgs& a, const char* w, int64_t nb_begin, int64_t nb_end) {
  const int64_t K2 = a.K / 2, M = a.M, group = M < 32 ? M : 32;
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {  // C (0-3) and A (4, 5): 16 rows, or the rest in the second tile of rows
    cfg.rows[t] = (uint8_t)(t == 2 || t == 3 || t == 5 ? group - 16 : 16);
    cfg.colsb[t] = 64;
  }
  for (int t = 6; t < 8; ++t) {  // B: 16 input pairs x 16 columns
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
  alignas(64) float acc[2][32][16];
  for (int64_t nb = nb_begin; nb < nb_end; nb += 2) {
    const int64_t nt = imin(2, nb_end - nb);
    const char* wb = w + (nb - nb_begin) * K2 * 64;
    for (int64_t m = 0; m < M; m += group) {
      const int64_t m0 = imin(m, M - group);
      if (nt == 2)
        pass_two_row_tiles<2>(a, m0, wb, K2, acc);
      else
        pass_two_row_tiles<1>(a, m0, wb, K2, acc);
      store_blocks(a, &acc[0][0][0], 32, nb, nt, m0, group);
    }
  }
  _tile_release();
}

// Column blocks [nb_begin, nb_end), their weights from `w` on.
void amx_blocks(const GemmArgs& a, const char* w, int64_t nb_begin, int64_t nb_end) {
  if (a.M > 16) return two_row_tiles(a, w, nb_begin, nb_end);
  const int64_t K2 = a.K / 2, full = K2 / 16 * 16, tail = K2 - full, M = a.M;
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) {  // C: M rows x 16 floats
    cfg.rows[t] = (uint8_t)M;
    cfg.colsb[t] = 64;
  }
  cfg.rows[3] = (uint8_t)M;  // A: M rows x 16 input pairs
  cfg.colsb[3] = 64;
  for (int t = 4; t < 6; ++t) {  // B: 16 input pairs x 16 columns
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  if (tail > 0) {
    cfg.rows[6] = (uint8_t)M;
    cfg.colsb[6] = (uint16_t)(tail * 4);
    cfg.rows[7] = (uint8_t)tail;
    cfg.colsb[7] = 64;
  }
  load_config(cfg);
  alignas(64) float acc[NB][16][16];
  for (int64_t nb = nb_begin; nb < nb_end; nb += NB) {
    const int64_t nt = imin(NB, nb_end - nb);
    const char* wb = w + (nb - nb_begin) * K2 * 64;  // block nb's weights
    switch (nt) {
      case 3: pass<3>(a, wb, K2, full, tail, acc); break;
      case 2: pass<2>(a, wb, K2, full, tail, acc); break;
      default: pass<1>(a, wb, K2, full, tail, acc); break;
    }
    store_blocks(a, &acc[0][0][0], 16, nb, nt, 0, M);
  }
  _tile_release();
}

}  // namespace

void gemm_bf16_amx_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  amx_blocks(a, (const char*)a.w + nb_begin * (a.K / 2) * 64, nb_begin, nb_end);
}

void gemm_bf16_amx_panel(const GemmArgs& a, const uint16_t* panel, int64_t nb0, int64_t nt) {
  amx_blocks(a, (const char*)panel, nb0, nb0 + nt);
}

}  // namespace avx512
}  // namespace preheat
