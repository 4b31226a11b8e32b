// What both instruction sets' kernels share: scalar helpers and the loops around the vector
// code (which token rows a block reads, how tasks and rows are walked). Included by
// avx512_common.h and avx2_common.h after their `#pragma GCC target`, so each build compiles
// its own copy; everything is in an unnamed namespace (static), so no copy is shared across
// builds by the linker.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

namespace preheat {
namespace {

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// Element i of a float32 (dtype 0) or bf16 (dtype 1) array.
inline const char* elem(const void* base, int64_t i, int dtype) {
  return (const char*)base + i * (dtype == 0 ? 4 : 2);
}
inline char* elem(void* base, int64_t i, int dtype) { return (char*)base + i * (dtype == 0 ? 4 : 2); }

inline int32_t load_i32(const void* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

// Row tiles of a GEMM: as even as possible, at most `max_mt` rows each.
inline int64_t row_tile(int64_t M, int64_t max_mt) {
  const int64_t tiles = (M + max_mt - 1) / max_mt;
  return (M + tiles - 1) / tiles;
}

constexpr int KV_SAME = 0, KV_E5M2 = 2;  // DecodeAttnArgs::kv_dtype (1 = e4m3)

// Bytes per cached value for queries of dtype DT and a cache of kv dtype KT.
template <int DT, int KT>
constexpr int64_t kv_size() {
  return KT != KV_SAME ? 1 : DT == 0 ? 4 : 2;
}

// Row pointers of tokens [t, t + n) (n <= 16) in `cache`; rows past n repeat the first
// (valid memory, weighted 0). One division per block: page and offset then advance.
template <typename Args>  // DecodeAttnArgs or ExtendAttnArgs: the same page fields
inline void token_rows(const Args& a, const void* cache, const int32_t* pages, int64_t t, int64_t n,
                       int64_t esz, const char** rows) {
  int64_t page = t / a.S, off = t % a.S;
  if (off + n <= a.S) {  // within one page (always, at the default 16 tokens a page): a stride
    const char* base = (const char*)cache + ((int64_t)pages[page] * a.kv_stride_page + off * a.kv_stride_tok) * esz;
    const int64_t step = a.kv_stride_tok * esz;
    for (int64_t i = 0; i < 16; ++i) rows[i] = base + (i < n ? i : 0) * step;
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = (const char*)cache + ((int64_t)pages[page] * a.kv_stride_page + off * a.kv_stride_tok) * esz;
    if (++off == a.S) {
      off = 0;
      ++page;
    }
  }
  for (int64_t i = n; i < 16; ++i) rows[i] = rows[0];
}

// Memory for decode attention: each page lies anywhere in the pool, so the hardware
// prefetchers stop at every page; the kernels ask for pages themselves, a few cache lines
// between computations (a burst of a block's lines at once stalled the core on the
// prefetches once the miss queue was full): keys and values FAR_BLOCKS blocks ahead while
// scoring, the next block's values while weighing, the next task's first blocks during this
// task's values.
constexpr int64_t FAR_BLOCKS = 3;  // blocks of 16 tokens between the one scored and the one asked for

// Cache lines to ask for (into L2), handed out a few at a time between computations. Rows
// that follow each other in memory (a page's, whenever its rows are contiguous) make one
// stretch. Holds up to CAP stretches; more are dropped (only prefetches).
class LineStream {
 public:
  void reset(int64_t row_bytes) {
    n_ = cur_ = total_ = 0;
    row_bytes_ = row_bytes;
  }
  void add(const char* const* rows, int64_t k) {
    for (int64_t i = 0; i < k && n_ < CAP;) {
      int64_t j = i + 1;
      while (j < k && rows[j] == rows[j - 1] + row_bytes_) ++j;
      start_[n_] = rows[i];
      lines_[n_] = ((j - i) * row_bytes_ + 63) / 64;
      total_ += lines_[n_++];
      i = j;
    }
  }
  // The rows of tokens [t, t + n) of one cache, n <= 16.
  template <typename Args>
  void add_tokens(const Args& a, const void* cache, const int32_t* pages, int64_t t, int64_t n, int64_t esz) {
    if (n <= 0) return;
    const char* rows[16];
    token_rows(a, cache, pages, t, n, esz, rows);
    add(rows, n);
  }
  int64_t total() const { return total_; }
  // Lines per call when the stream is spread over `calls` calls.
  int64_t share(int64_t calls) const { return (total_ + calls - 1) / calls; }
  inline void issue(int64_t count) {
    while (count > 0 && cur_ < n_) {
      const int64_t k = imin(count, lines_[cur_]);
      const char* p = start_[cur_];
      for (int64_t l = 0; l < k; ++l) _mm_prefetch(p + l * 64, _MM_HINT_T1);
      count -= k;
      if (k == lines_[cur_]) {
        ++cur_;
      } else {
        start_[cur_] = p + k * 64;
        lines_[cur_] -= k;
      }
    }
  }

 private:
  static constexpr int64_t CAP = 128;
  const char* start_[CAP];
  int64_t lines_[CAP];
  int64_t n_ = 0, cur_ = 0, total_ = 0, row_bytes_ = 64;
};

// What the values loops ask for as they go: the next block's values (a share per kv head)
// and the next task's first blocks (spread over every block and kv head of this task).
class WeighAhead {
 public:
  WeighAhead(const DecodeAttnArgs& a, LineStream* upcoming, const int32_t* pages, int64_t t0, int64_t t1, int64_t esz)
      : a_(a), upcoming_(upcoming), pages_(pages), t1_(t1), esz_(esz),
        upcoming_share_(upcoming->share(imax(1, (t1 - t0 + 15) / 16 * a.KVH))) {}
  void block(int64_t blk) {
    values_.reset(a_.KVH * a_.D * esz_);
    values_.add_tokens(a_, a_.v_cache, pages_, blk + 16, imin(16, t1_ - blk - 16), esz_);
    values_share_ = values_.share(a_.KVH);
  }
  void head() {
    upcoming_->issue(upcoming_share_);
    values_.issue(values_share_);
  }

 private:
  const DecodeAttnArgs& a_;
  LineStream* upcoming_;
  const int32_t* pages_;
  int64_t t1_, esz_, upcoming_share_, values_share_ = 0;
  LineStream values_;
};

// The lines a scoring pass asks for at block `blk` of a task over [t0, t1): keys and values
// FAR_BLOCKS blocks ahead; at the task's first block, unless the previous task asked for
// them (`first_asked`), this block's values and the blocks in between as well.
inline void ask_ahead_of_scores(LineStream& far, const DecodeAttnArgs& a, const int32_t* pages, int64_t blk,
                                int64_t t0, int64_t t1, bool first_asked, int64_t esz) {
  far.reset(a.KVH * a.D * esz);
  if (blk == t0 && !first_asked) {
    far.add_tokens(a, a.v_cache, pages, blk, imin(16, t1 - blk), esz);
    for (int64_t d = 1; d < FAR_BLOCKS; ++d) {
      far.add_tokens(a, a.k_cache, pages, blk + 16 * d, imin(16, t1 - blk - 16 * d), esz);
      far.add_tokens(a, a.v_cache, pages, blk + 16 * d, imin(16, t1 - blk - 16 * d), esz);
    }
  }
  far.add_tokens(a, a.k_cache, pages, blk + 16 * FAR_BLOCKS, imin(16, t1 - blk - 16 * FAR_BLOCKS), esz);
  far.add_tokens(a, a.v_cache, pages, blk + 16 * FAR_BLOCKS, imin(16, t1 - blk - 16 * FAR_BLOCKS), esz);
}

// Bytes of one cached value: an fp8 cache's byte, else the model's dtype.
inline int64_t kv_value_bytes(const DecodeAttnArgs& a) { return a.kv_dtype != 0 ? 1 : a.dtype == 0 ? 4 : 2; }

// Decode-attention tasks [begin, end): attend(row b, t0, t1, direct, partial, first_asked)
// for each, `direct` when the row's context is one chunk (written to `out` at once). Before
// each, `upcoming` holds the next task's first FAR_BLOCKS blocks (keys and values), which
// the kernel asks for while it weighs this task's values;
// `first_asked` tells a task that its own were asked for that way.
template <typename Attend>
inline void for_each_task(const DecodeAttnArgs& a, const int32_t* task_b, const int32_t* task_chunk,
                          const int32_t* num_chunks, int64_t begin, int64_t end, LineStream& upcoming,
                          Attend&& attend) {
  const int64_t esz = kv_value_bytes(a);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = task_b[t], c = task_chunk[t];
    const int64_t t0 = c * a.chunk, t1 = imin(a.seq_lens[b], t0 + a.chunk);
    upcoming.reset(a.KVH * a.D * esz);
    if (t + 1 < end) {
      const int64_t nb = task_b[t + 1], n0 = task_chunk[t + 1] * a.chunk, n1 = imin(a.seq_lens[nb], n0 + a.chunk);
      const int32_t* np = a.page_table + nb * a.pt_stride;
      for (int64_t blk = n0; blk < imin(n1, n0 + 16 * FAR_BLOCKS); blk += 16) {
        upcoming.add_tokens(a, a.k_cache, np, blk, imin(16, n1 - blk), esz);
        upcoming.add_tokens(a, a.v_cache, np, blk, imin(16, n1 - blk), esz);
      }
    }
    attend(b, t0, t1, num_chunks[b] == 1, a.partial + t * a.H * (a.D + 2), t > begin);
  }
}

// float32 to bf16 bits, round-to-nearest-even (as torch and vcvtneps2bf16); NaN stays NaN.
inline uint16_t bf16_bits(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? (x >> 16) | 0x40 : rounded);  // a select, not a branch
}

// Merges the chunk partials of rows (b, h) in [begin, end) of B*H by their log-sum-exp
// (the partial layout both builds write: max, sum, then D weighted values). Plain loops:
// it runs once per row and head, and the compiler vectorizes them for each build.
inline void combine_partials(const DecodeAttnArgs& a, const int64_t* first_task, const int32_t* num_chunks,
                             int64_t begin, int64_t end) {
  const int64_t D = a.D;
  float o[256];
  for (int64_t r = begin; r < end; ++r) {
    const int64_t b = r / a.H, h = r % a.H;
    const int64_t n = num_chunks[b];
    if (n <= 1) continue;
    float m = -INFINITY;
    for (int64_t c = 0; c < n; ++c) {
      const float* p = a.partial + ((first_task[b] + c) * a.H + h) * (D + 2);
      m = p[0] > m ? p[0] : m;
    }
    float l = 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t c = 0; c < n; ++c) {
      const float* p = a.partial + ((first_task[b] + c) * a.H + h) * (D + 2);
      const float w = expf(p[0] - m);
      l += w * p[1];
      for (int64_t d = 0; d < D; ++d) o[d] += w * p[2 + d];
    }
    const float inv = a.v_mult / l;
    if (a.dtype == 0) {
      float* out = (float*)a.out + (b * a.H + h) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = o[d] * inv;
    } else {
      uint16_t* out = (uint16_t*)a.out + (b * a.H + h) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = bf16_bits(o[d] * inv);
    }
  }
}

// Packed weights back to dense rows y [N, K] (bf16, or float32 for int8 codes when
// out_dtype is 0), column blocks [nb_begin, nb_end) of 16: for a long prompt a library GEMM
// (oneDNN on AMX) multiplies dense rows many times faster than the skinny kernels, and
// unpacking one matrix costs about one pass over it. bf16: [nb, K/2, 16, 2] -> rows.
inline void unpack_bf16_rows(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  const int64_t K2 = a.K / 2;
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    const uint32_t* src = (const uint32_t*)a.w + nb * K2 * 16;  // one (k, k+1) pair per uint32
    const int64_t cols = imin(16, a.N - nb * 16);
    uint32_t* rows = (uint32_t*)a.y + nb * 16 * K2;
    for (int64_t kp = 0; kp < K2; ++kp)
      for (int64_t c = 0; c < cols; ++c) rows[c * K2 + kp] = src[kp * 16 + c];
  }
}

// int8 / 4-bit codes with their block scales and offsets (see GemmArgs) to rows
// w = d * q + m, rounded to bf16 (out_dtype 1) or kept in float32 (0). Walked as the codes
// lie (per input pair, the 16 columns of a block side by side) into a 16 x 32 tile in L1,
// then each row's 32 values written at once: a whole cache line per row and block.
inline void dequantize_int8_rows(const GemmArgs& a, int64_t nb_begin, int64_t nb_end) {
  const int64_t K = a.K, KB = K / 32;
  const int64_t stride = a.code_bits == 8 ? K * 16 : K * 8;  // bytes per column block
  alignas(64) float d[16], m[16], tile[16][32];
  alignas(64) uint16_t tile16[16][32];
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    const int64_t cols = imin(16, a.N - nb * 16);
    const uint8_t* codes = (const uint8_t*)a.w + nb * stride;
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint16_t* blk = a.dm + (nb * KB + kb) * 32;
      for (int c = 0; c < 16; ++c) {
        d[c] = _cvtsh_ss(blk[c]);
        m[c] = _cvtsh_ss(blk[16 + c]);
      }
      for (int p = 0; p < 16; ++p) {  // input pair kb * 16 + p: inputs 2p, 2p + 1 of the block
        uint8_t q[32];
        if (a.code_bits == 8) {
          memcpy(q, codes + (kb * 16 + p) * 32, 32);
        } else {
          const uint8_t* src = codes + ((kb * 16 + p) / 2) * 32;
          const int shift = 4 * (p % 2);
          for (int i = 0; i < 32; ++i) q[i] = (uint8_t)((src[i] >> shift) & 15);
        }
        for (int c = 0; c < 16; ++c) {
          tile[c][2 * p] = d[c] * (float)q[2 * c] + m[c];
          tile[c][2 * p + 1] = d[c] * (float)q[2 * c + 1] + m[c];
        }
      }
      const int64_t n0 = nb * 16;
      if (a.out_dtype == 0) {
        for (int64_t c = 0; c < cols; ++c) memcpy((float*)a.y + (n0 + c) * K + kb * 32, tile[c], sizeof tile[c]);
      } else {
        for (int c = 0; c < 16; ++c)
          for (int i = 0; i < 32; ++i) tile16[c][i] = bf16_bits(tile[c][i]);
        for (int64_t c = 0; c < cols; ++c)
          memcpy((uint16_t*)a.y + (n0 + c) * K + kb * 32, tile16[c], sizeof tile16[c]);
      }
    }
  }
}

// A compile-time int, to hand a runtime value to a template (a plain struct: the kernel
// files include no C++ library header).
template <int V>
struct Int {
  static constexpr int value = V;
};

// attend(Int<dtype>, Int<kv_dtype>, Int<head_dim>) for `a`'s types: head dims 64 and 128 get
// their own instantiation, any other is Int<0> (the kernel reads a.D). What both builds'
// attend_chunk templates are instantiated over.
template <int DT, int KT, typename Attend>
inline void with_head_dim(const DecodeAttnArgs& a, Attend& attend) {
  switch (a.D) {
    case 64: attend(Int<DT>{}, Int<KT>{}, Int<64>{}); break;
    case 128: attend(Int<DT>{}, Int<KT>{}, Int<128>{}); break;
    default: attend(Int<DT>{}, Int<KT>{}, Int<0>{}); break;
  }
}
template <int DT, typename Attend>
inline void with_kv_dtype(const DecodeAttnArgs& a, Attend& attend) {
  switch (a.kv_dtype) {
    case 1: with_head_dim<DT, 1>(a, attend); break;
    case 2: with_head_dim<DT, 2>(a, attend); break;
    default: with_head_dim<DT, 0>(a, attend); break;
  }
}
template <typename Attend>
inline void with_attention_types(const DecodeAttnArgs& a, Attend&& attend) {
  if (a.dtype == 0)
    with_kv_dtype<0>(a, attend);
  else
    with_kv_dtype<1>(a, attend);
}

inline uint32_t float_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  return b;
}
inline float bits_float(uint32_t b) {
  float x;
  memcpy(&x, &b, 4);
  return x;
}
// One element of a float32 (dtype 0) or bfloat16 (1) array, as float32.
inline float load1(const void* p, int dtype) {
  if (dtype == 0) {
    float f;
    memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, p, 2);
  return bits_float((uint32_t)h << 16);
}

// A float as a float8 byte: e4m3fn (kv_dtype 1) or e5m2 (2), rounded to nearest even the way
// torch's .to(torch.float8_e4m3fn / float8_e5m2) rounds on the CPU (c10's
// fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value, step for step), so a cache written
// here holds the bytes the PyTorch path writes. Subnormals are rounded by adding a power of
// two that leaves their bits in the low byte.
inline uint8_t fp8_from_float(float x, int kv_dtype) {
  const uint32_t bits = float_bits(x), sign = bits & 0x80000000u, a = bits ^ sign;
  uint32_t code;
  if (kv_dtype == 1) {
    if (a >= (1087u << 20)) {
      code = a > 0x7F800000u ? 0x7F : 0x7E;  // NaN; 480 and above (and infinity) saturate
    } else if (a < (121u << 23)) {
      code = float_bits(bits_float(a) + bits_float(141u << 23)) - (141u << 23);
    } else {
      code = (a + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
      if (code == 0x7F) code = 0x7E;  // a carry into NaN's pattern saturates too
    }
  } else {
    if (a >= (143u << 23)) {
      code = a > 0x7F800000u ? 0x7F : 0x7C;  // NaN, infinity
    } else if (a < (113u << 23)) {
      code = float_bits(bits_float(a) + bits_float(134u << 23)) - (134u << 23);
    } else {
      code = (a + ((uint32_t)(15 - 127) << 23) + 0xFFFFFu + ((a >> 21) & 1u)) >> 21;
    }
  }
  return (uint8_t)(code | (sign >> 24));
}

// n values of dtype `dt` at x stored into an fp8 cache row: x / scale, clamped to the
// format's largest value (a NaN stays NaN), as a float8 byte (kv_fp8.store's steps).
inline void store_fp8(const void* x, int dt, uint8_t* out, int64_t n, float scale, int kv_dtype) {
  const float top = kv_dtype == 1 ? 448.0f : 57344.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load1(elem(x, i, dt), dt);
    float y = v / scale;
    y = y < -top ? -top : y > top ? top : y;  // comparisons with a NaN fail: it passes through
    out[i] = fp8_from_float(y, kv_dtype);
  }
}

// Rows [m_begin, m_end) of rope + KV write, `rope_head(x, cos_sin, out, D, dtype)` rotating one head.
// An fp8 cache (a.kv_dtype) gets the rotated key in the activations' dtype, as the PyTorch
// path rotates it, then stored as kv_fp8.store stores it.
template <typename RopeHead>
inline void rope_kv_rows_with(const RopeKVArgs& a, int64_t m_begin, int64_t m_end, RopeHead&& rope_head) {
  const int dt = a.dtype;
  const int64_t D = a.D;
  alignas(64) float rotated[256];  // one head's key (D <= 256), float32 or bf16
  for (int64_t m = m_begin; m < m_end; ++m) {
    const void* cs = elem(a.cos_sin, a.positions[m] * 2 * D, dt);
    const void* row = elem(a.qkv, m * a.ld, dt);
    for (int64_t h = 0; h < a.H; ++h) rope_head(elem(row, h * D, dt), cs, elem(a.q_out, (m * a.H + h) * D, dt), D, dt);
    const int64_t slot = a.slots[m];
    for (int64_t h = 0; h < a.KVH; ++h) {
      const int64_t at = (slot * a.KVH + h) * D;
      const void* v = elem(row, (a.H + a.KVH + h) * D, dt);
      if (a.kv_dtype != 0) {
        rope_head(elem(row, (a.H + h) * D, dt), cs, rotated, D, dt);
        store_fp8(rotated, dt, (uint8_t*)a.k_cache + at, D, a.k_scale, a.kv_dtype);
        store_fp8(v, dt, (uint8_t*)a.v_cache + at, D, a.v_scale, a.kv_dtype);
        continue;
      }
      rope_head(elem(row, (a.H + h) * D, dt), cs, elem(a.k_cache, at, dt), D, dt);
      memcpy(elem(a.v_cache, at, dt), v, D * (dt == 0 ? 4 : 2));
    }
  }
}

}  // namespace
}  // namespace preheat
