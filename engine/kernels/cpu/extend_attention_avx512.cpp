// Paged extend (prompt) attention, bfloat16, with the queries in the vector lanes: a task is
// one sequence, one kv head and up to EXTEND_TASK_ROWS of its new tokens, for every query head of the
// group. A lane is one (new token, query head of the group) pair, row-major (lane f: row f / G,
// head f % G), 16 to a vector: every head of a group reads the same keys and values, so they
// share vectors, and an extend of a few tokens (a speculative-decoding verify of 5 tokens,
// SmolLM2's 3 heads a group: 15 lanes) fills one vector instead of one per head with 5 of its
// 16 lanes used. Per vector:
//  - scores: for each key, sum over the head's dimension pairs of (query pair j of 16 lanes,
//    transposed once per task) x (the key's pair j, broadcast): vdpbf16ps, 16 lanes' scores
//    of one key per vector, no horizontal sums. A block's keys are transposed once per task
//    (pair j of its 16 keys side by side), so each query pair is loaded once for 16 keys and
//    every product reads one operand from memory (a broadcast) instead of two;
//  - softmax: online over blocks of 16 keys (running max and sum per lane);
//  - values: for each pair of keys, (their probabilities of 16 lanes, as bfloat16 pairs) x
//    (the pair's values at dimension d, broadcast): vdpbf16ps into output dimension d.
// Keys and values are read from the pages where they lie; the key block is one page at the
// default page size. Probabilities are rounded to bfloat16 for the value products, as
// SDPA's bfloat16 path rounds them; sums are float32. Each lane computes what it computed
// when lanes held one head's rows (the same products in the same order). An fp8 cache's
// keys and values are widened to bfloat16 as they are read (exact: each fp8 value is a
// bfloat16 one; e4m3 read as value / 256, as the decode kernel reads it), its scales folded
// into the score scale and the outputs' factor.
#include <type_traits>

#include "avx512_common.h"

namespace preheat {
namespace avx512 {
namespace {

constexpr int64_t LANES = 16;  // (row, head) pairs per vector

struct ExtendScratch {
  float* qt;   // [vectors][D/2][16] query pairs, transposed (bf16 pairs as int32)
  float* ot;   // [vectors][D][16] output accumulators, transposed
  float* ml;   // [vectors][2][16] running max and sum
  float* vp;   // [8][D] value pairs of a key block: (v[2i][d], v[2i+1][d]) as int32
  float* pp;   // [8][16] probability pairs of 16 rows
  float* kt;   // [D/2][16] key pairs of a key block, transposed (bf16 pairs as int32)
  int32_t* rp;  // [vectors][16] each lane's row position (the last key it sees)
};

// Offsets (floats) of ExtendScratch's parts for `vectors` vectors of lanes, and their total:
// the one layout both the task and extend_attention_scratch read.
struct ExtendLayout {
  int64_t qt, ot, ml, vp, pp, kt, rp, total;
};
inline int64_t lane_vectors(int64_t rows, int64_t G) { return (rows * G + LANES - 1) / LANES; }
inline ExtendLayout extend_layout(int64_t vectors, int64_t D) {
  ExtendLayout l;
  l.qt = 0;
  l.ot = l.qt + vectors * (D / 2) * 16;
  l.ml = l.ot + vectors * D * 16;
  l.vp = l.ml + vectors * 2 * 16;
  l.pp = l.vp + 8 * D;
  l.kt = l.pp + 8 * 16;
  l.rp = l.kt + (D / 2) * 16;
  l.total = l.rp + vectors * 16;
  return l;
}

// The 16 x 16 int32 matrix r (r[i] = row i) transposed in place: r[j] lane i = old r[i] lane j.
inline void transpose16(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: elements 0, 1 / 2, 3 of rows i, i + 1
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // b[i + e], lane L: element 4L + e of rows i .. i + 3
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // the 4 x 4 transpose of 128-bit lanes, b[e], b[4 + e], ...
    const __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x88), c1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xDD);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x88);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xDD);
    r[e] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    r[12 + e] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
}

template <int D, int KT>
void task(const ExtendAttnArgs& a, int64_t b, int64_t kvh, int64_t r0, int64_t r1, float* scratch) {
  constexpr int64_t ESZ = KT == 0 ? 2 : 1;  // bytes per cached value
  constexpr int64_t DP = D / 2;
  const int64_t G = a.H / a.KVH, rows = r1 - r0, lanes = rows * G, vectors = lane_vectors(rows, G);
  const int64_t prefix = a.prefix_lens[b], last_key = prefix + r1;  // keys [0, last_key)
  const int32_t* pages = a.page_table + b * a.pt_stride;
  const ExtendLayout l = extend_layout(vectors, D);
  const ExtendScratch sc{scratch + l.qt, scratch + l.ot, scratch + l.ml, scratch + l.vp, scratch + l.pp,
                        scratch + l.kt, (int32_t*)(scratch + l.rp)};
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Lane L of vector v is pair f = 16 v + L: row r0 + f / G, head kvh * G + f % G.
  auto lane_row = [&](int64_t v) {  // relative to r0
    alignas(64) int32_t r[LANES];
    for (int64_t L = 0; L < LANES; ++L) r[L] = (int32_t)((v * LANES + L) / G);
    return _mm512_load_si512(r);
  };
  auto lane_head = [&](int64_t v) {  // within the group
    alignas(64) int32_t h[LANES];
    for (int64_t L = 0; L < LANES; ++L) h[L] = (int32_t)((v * LANES + L) % G);
    return _mm512_load_si512(h);
  };
  // Queries transposed: lane L of qt[v][j] = pair j of lane L's row and head.
  const uint32_t* q = (const uint32_t*)a.q + ((a.q_start[b] + r0) * a.q_stride_t + kvh * G * a.q_stride_h) / 2;
  for (int64_t v = 0; v < vectors; ++v) {
    const __mmask16 live = tail_mask(lanes - v * LANES);
    const __m512i row = lane_row(v);
    _mm512_storeu_si512(sc.rp + v * 16, _mm512_add_epi32(row, _mm512_set1_epi32((int32_t)(prefix + r0))));
    const __m512i off = _mm512_add_epi32(_mm512_mullo_epi32(row, _mm512_set1_epi32((int32_t)(a.q_stride_t / 2))),
                                         _mm512_mullo_epi32(lane_head(v), _mm512_set1_epi32((int32_t)(a.q_stride_h / 2))));
    float* dst = sc.qt + v * DP * 16;
    for (int64_t j = 0; j < DP; ++j)
      _mm512_storeu_si512(dst + j * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, off, q + j, 4));
    float* o = sc.ot + v * D * 16;
    for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(o + d * 16, _mm512_setzero_ps());
    _mm512_storeu_ps(sc.ml + v * 32, _mm512_set1_ps(-INFINITY));
    _mm512_storeu_ps(sc.ml + v * 32 + 16, _mm512_setzero_ps());
  }
  const __m512 scale = _mm512_set1_ps(a.scale);
  const char* krow[16];
  const char* vrow[16];
  for (int64_t k0 = 0; k0 < last_key; k0 += 16) {
    const int64_t n = imin(16, last_key - k0), pairs = (n + 1) / 2;
    token_rows(a, a.k_cache, pages, k0, n, ESZ, krow);
    token_rows(a, a.v_cache, pages, k0, n, ESZ, vrow);
    // Value pairs of this block, kv head kvh: vp[i][d] = (v[2i][d], v[2i+1][d]); an odd last
    // key pairs with a zero value (its probability pair's second half is 0 too).
    for (int64_t i = 0; i < pairs; ++i) {
      const char* v0 = vrow[2 * i] + kvh * a.kv_stride_head * ESZ;
      const char* v1 = vrow[2 * i + 1] + kvh * a.kv_stride_head * ESZ;
      const bool odd = 2 * i + 1 >= n;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i x0 = load32_bf16<KT>(v0 + d * ESZ);
        const __m512i x1 = odd ? _mm512_setzero_si512() : load32_bf16<KT>(v1 + d * ESZ);
        // unpack{lo,hi} interleave within 128-bit lanes; permute back to d order.
        const __m512i lo = _mm512_unpacklo_epi16(x0, x1), hi = _mm512_unpackhi_epi16(x0, x1);
        const __m512i first = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi);
        const __m512i second = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi);
        _mm512_storeu_si512(sc.vp + i * D + d, first);
        _mm512_storeu_si512(sc.vp + i * D + d + 16, second);
      }
    }
    // Key pairs of this block transposed: kt[j][i] = pair j of key i (keys past n repeat key 0).
    for (int64_t c = 0; c < DP; c += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = load32_bf16<KT>(krow[i] + (kvh * a.kv_stride_head + c * 2) * ESZ);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(sc.kt + (c + j) * 16, r[j]);
    }
    for (int64_t v = 0; v < vectors; ++v) {
      // Rows of this vector's first and last live lanes (relative to r0).
      const int64_t first_row = v * LANES / G, last_row = (imin(v * LANES + LANES, lanes) - 1) / G;
      if (k0 > prefix + r0 + last_row) continue;  // every key here is after every row
      // Key k is visible to a lane when k <= prefix + its row.
      const __m512i row_pos = _mm512_loadu_si512(sc.rp + v * 16);
      const bool diagonal = k0 + n - 1 > prefix + r0 + first_row;
      const uint32_t* qt = (const uint32_t*)sc.qt + v * DP * 16;
      __m512 s[16];
      __mmask16 visible[16];
      for (int i = 0; i < 16; ++i) s[i] = _mm512_setzero_ps();
      const int32_t* kt = (const int32_t*)sc.kt;
      for (int64_t j = 0; j < DP; ++j) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt + j * 16);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) s[i] = _mm512_dpbf16_ps(s[i], qv, (__m512bh)_mm512_set1_epi32(kt[j * 16 + i]));
      }
      for (int64_t i = 0; i < n; ++i) {
        s[i] = _mm512_mul_ps(s[i], scale);
        visible[i] = diagonal ? _mm512_cmple_epi32_mask(_mm512_set1_epi32((int32_t)(k0 + i)), row_pos) : 0xFFFF;
        s[i] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible[i], s[i]);
      }
      float* ml = sc.ml + v * 32;
      const __m512 m_old = _mm512_loadu_ps(ml);
      __m512 m_new = m_old;
      for (int64_t i = 0; i < n; ++i) m_new = _mm512_max_ps(m_new, s[i]);
      // Rows that see no key of this block keep -inf: exp(-inf - -inf) is NaN, so such
      // lanes compute with 0 instead and their probabilities come out 0.
      const __mmask16 seen = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m512 m_use = _mm512_maskz_mov_ps(seen, m_new);
      const __m512 corr = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(m_old, m_use)));
      __m512 l = _mm512_mul_ps(_mm512_loadu_ps(ml + 16), corr);
      uint32_t* pp = (uint32_t*)sc.pp;
      for (int64_t i = 0; i < pairs * 2; i += 2) {
        const __m512 p0 = _mm512_maskz_mov_ps(seen & visible[i], exp16(_mm512_sub_ps(s[i], m_use)));
        const __m512 p1 = i + 1 < n ? _mm512_maskz_mov_ps(seen & visible[i + 1], exp16(_mm512_sub_ps(s[i + 1], m_use)))
                                    : _mm512_setzero_ps();
        l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
        // (p0[r], p1[r]) as a bf16 pair in lane r.
        const __m512i b0 = _mm512_cvtepu16_epi32(f32_to_bf16(p0)), b1 = _mm512_cvtepu16_epi32(f32_to_bf16(p1));
        _mm512_storeu_si512(pp + (i / 2) * 16, _mm512_or_si512(b0, _mm512_slli_epi32(b1, 16)));
      }
      _mm512_storeu_ps(ml, m_new);
      _mm512_storeu_ps(ml + 16, l);
      float* o = sc.ot + v * D * 16;
      const bool rescale = _mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_OQ) != 0;
      const uint32_t* vp = (const uint32_t*)sc.vp;
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 acc[16];
        for (int64_t d = 0; d < 16; ++d) {
          acc[d] = _mm512_loadu_ps(o + (d0 + d) * 16);
          if (rescale) acc[d] = _mm512_mul_ps(acc[d], corr);
        }
        for (int64_t i = 0; i < pairs; ++i) {
          const __m512bh pv = (__m512bh)_mm512_loadu_si512(pp + i * 16);
          for (int64_t d = 0; d < 16; ++d)
            acc[d] = _mm512_dpbf16_ps(acc[d], pv, (__m512bh)_mm512_set1_epi32(vp[i * D + d0 + d]));
        }
        for (int64_t d = 0; d < 16; ++d) _mm512_storeu_ps(o + (d0 + d) * 16, acc[d]);
      }
    }
  }
  // out[row, h, :] = ot[:, lane] / l[lane], for each live lane.
  uint16_t* out = (uint16_t*)a.out;
  for (int64_t v = 0; v < vectors; ++v) {
    float* o = sc.ot + v * D * 16;
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(a.v_mult), _mm512_loadu_ps(sc.ml + v * 32 + 16));
    for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(o + d * 16, _mm512_mul_ps(_mm512_loadu_ps(o + d * 16), inv));
    const int64_t n_lanes = imin(LANES, lanes - v * LANES);
    for (int64_t L = 0; L < n_lanes; ++L) {
      const int64_t f = v * LANES + L, row = f / G, h = kvh * G + f % G;
      uint16_t* dst = out + ((a.q_start[b] + r0 + row) * a.H + h) * D;
      const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(16)), _mm512_set1_epi32((int32_t)L));
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i*)(dst + d), f32_to_bf16(_mm512_i32gather_ps(idx, o + d * 16, 4)));
    }
  }
}

}  // namespace

// float32 queries go to the AVX2 build's kernel (float32 FMAs at 8 lanes): this one
// multiplies bfloat16 pairs, and no 16-lane float32 variant is written.
int64_t extend_attention_scratch(const ExtendAttnArgs& a) {
  if (a.dtype == 0) return avx2::extend_attention_scratch(a);
  return extend_layout(lane_vectors(EXTEND_TASK_ROWS, a.H / a.KVH), a.D).total;
}

void extend_attention_task(const ExtendAttnArgs& a, int64_t b, int64_t kvh, int64_t r0, int64_t r1, float* scratch) {
  if (a.dtype == 0) return avx2::extend_attention_task(a, b, kvh, r0, r1, scratch);
  auto with_kv = [&](auto d) {
    constexpr int D = decltype(d)::value;
    if (a.kv_dtype == 1)
      task<D, 1>(a, b, kvh, r0, r1, scratch);
    else if (a.kv_dtype == KV_E5M2)
      task<D, KV_E5M2>(a, b, kvh, r0, r1, scratch);
    else
      task<D, 0>(a, b, kvh, r0, r1, scratch);
  };
  if (a.D == 64)
    with_kv(std::integral_constant<int, 64>{});
  else
    with_kv(std::integral_constant<int, 128>{});
}

}  // namespace avx512
}  // namespace preheat
