// Paged extend (prompt) attention of extend_attention_avx512.cpp for AVX2 CPUs, and for
// float32 queries on any CPU (the AVX-512 build hands them here: its kernel multiplies
// bfloat16 pairs). The same tasks (a sequence, a kv head, up to EXTEND_TASK_ROWS of its new
// tokens, every query head of the group) and the same lanes: one (new token, query head)
// pair per lane, row-major, 8 to a vector, so the heads of a group share every key and value
// read. What differs is the arithmetic, float32 FMAs at 8 lanes:
//  - scores: the block's 8 keys converted to float32 once per task (bfloat16 and fp8 exactly;
//    e4m3 read as value / 256, as the decode kernels read it), then for each dimension d one
//    load of the queries' d (8 lanes, transposed once per task) and, per key, a broadcast
//    of the key's d into an FMA: no horizontal sums. Two vectors that both see the block
//    go together, 4 keys at a time, each broadcast feeding both (6 loads per 8 FMAs instead
//    of 9, in AVX2's 16 registers; 0.87-0.96x the time of a vector at a time);
//  - softmax: online over blocks of 8 keys (running max and sum per lane);
//  - values: for each key, its probabilities of 8 lanes times the key's value at d
//    (broadcast) into output dimension d, two vectors together as for the scores.
// bfloat16 queries: probabilities are rounded to bfloat16 before they weigh the values and
// summed unrounded, as the AVX-512 kernel (and SDPA's bfloat16 path) does; float32 queries
// keep them float32. Keys and values are read from the pages where they lie.
#include <type_traits>

#include "avx2_common.h"

namespace preheat {
namespace avx2 {
namespace {

constexpr int64_t LANES = 8;  // (row, head) pairs per vector
constexpr int64_t KEYS = 8;   // keys per block

// Offsets (floats) of a task's scratch for `vectors` vectors of lanes: queries transposed
// [vectors][D][8], output accumulators [vectors][D][8], running max and sum [vectors][2][8],
// the block's keys and values in float32 [KEYS][D] each, probabilities and raw scores of
// two vectors [2][KEYS][8] each, each lane's row position (the last key it sees) [vectors][8].
struct ExtendLayout {
  int64_t qt, ot, ml, kf, vf, pp, sb, rp, total;
};
inline int64_t lane_vectors(int64_t rows, int64_t G) { return (rows * G + LANES - 1) / LANES; }
inline ExtendLayout extend_layout(int64_t vectors, int64_t D) {
  ExtendLayout l;
  l.qt = 0;
  l.ot = l.qt + vectors * D * LANES;
  l.ml = l.ot + vectors * D * LANES;
  l.kf = l.ml + vectors * 2 * LANES;
  l.vf = l.kf + KEYS * D;
  l.pp = l.vf + KEYS * D;
  l.sb = l.pp + 2 * KEYS * LANES;
  l.rp = l.sb + 2 * KEYS * LANES;
  l.total = l.rp + vectors * LANES;
  return l;
}

template <int D, int DT, int KT>
void task(const ExtendAttnArgs& a, int64_t b, int64_t kvh, int64_t r0, int64_t r1, float* scratch) {
  constexpr int64_t KS = kv_size<DT, KT>();  // bytes per cached value
  constexpr int64_t QS = DT == 0 ? 4 : 2;    // bytes per query / output value
  const int64_t G = a.H / a.KVH, lanes = (r1 - r0) * G, vectors = lane_vectors(r1 - r0, G);
  const int64_t prefix = a.prefix_lens[b], last_key = prefix + r1;  // keys [0, last_key)
  const int32_t* pages = a.page_table + b * a.pt_stride;
  const ExtendLayout l = extend_layout(vectors, D);
  float* const qt = scratch + l.qt;
  float* const ot = scratch + l.ot;
  float* const ml = scratch + l.ml;
  float* const kf = scratch + l.kf;
  float* const vf = scratch + l.vf;
  float* const pp = scratch + l.pp;
  float* const sb = scratch + l.sb;
  int32_t* const rp = (int32_t*)(scratch + l.rp);
  // Queries transposed: qt[v][d][L] = dimension d of lane L's row and head (lanes past the
  // last pair read 0 and see no key: row position -1).
  const char* q = (const char*)a.q + ((a.q_start[b] + r0) * a.q_stride_t + kvh * G * a.q_stride_h) * QS;
  for (int64_t v = 0; v < vectors; ++v) {
    for (int64_t L = 0; L < LANES; ++L) {
      const int64_t f = v * LANES + L;
      float* dst = qt + v * D * LANES + L;
      if (f < lanes) {
        const char* src = q + ((f / G) * a.q_stride_t + (f % G) * a.q_stride_h) * QS;
        for (int64_t d = 0; d < D; ++d) dst[d * LANES] = load1(src + d * QS, DT);
        rp[v * LANES + L] = (int32_t)(prefix + r0 + f / G);
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d * LANES] = 0.0f;
        rp[v * LANES + L] = -1;
      }
    }
    for (int64_t d = 0; d < D; ++d) _mm256_storeu_ps(ot + (v * D + d) * LANES, _mm256_setzero_ps());
    _mm256_storeu_ps(ml + v * 2 * LANES, _mm256_set1_ps(-INFINITY));
    _mm256_storeu_ps(ml + v * 2 * LANES + LANES, _mm256_setzero_ps());
  }
  const __m256 scale = _mm256_set1_ps(a.scale), neg_inf = _mm256_set1_ps(-INFINITY);
  // Whether any live lane of vector v sees a key of the block starting at k0.
  auto sees_block = [&](int64_t v, int64_t k0) {
    const int64_t last_row = (imin(v * LANES + LANES, lanes) - 1) / G;  // relative to r0
    return k0 <= prefix + r0 + last_row;
  };
  // Raw scores of the block's KEYS keys for vector v's lanes: out[i][L].
  auto scores_one = [&](int64_t v, float* out) {
    const float* qv = qt + v * D * LANES;
    __m256 s[KEYS];
    for (int64_t i = 0; i < KEYS; ++i) s[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 x = _mm256_loadu_ps(qv + d * LANES);
#pragma GCC unroll 8
      for (int64_t i = 0; i < KEYS; ++i) s[i] = _mm256_fmadd_ps(x, _mm256_set1_ps(kf[i * D + d]), s[i]);
    }
    for (int64_t i = 0; i < KEYS; ++i) _mm256_storeu_ps(out + i * LANES, s[i]);
  };
  // The same for vectors v and v + 1, half the keys at a time.
  auto scores_pair = [&](int64_t v, float* out0, float* out1) {
    const float* q0 = qt + v * D * LANES;
    const float* q1 = q0 + D * LANES;
    for (int64_t half = 0; half < KEYS; half += 4) {
      __m256 s0[4], s1[4];
      for (int64_t i = 0; i < 4; ++i) s0[i] = s1[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m256 x0 = _mm256_loadu_ps(q0 + d * LANES), x1 = _mm256_loadu_ps(q1 + d * LANES);
#pragma GCC unroll 4
        for (int64_t i = 0; i < 4; ++i) {
          const __m256 k = _mm256_set1_ps(kf[(half + i) * D + d]);
          s0[i] = _mm256_fmadd_ps(x0, k, s0[i]);
          s1[i] = _mm256_fmadd_ps(x1, k, s1[i]);
        }
      }
      for (int64_t i = 0; i < 4; ++i) {
        _mm256_storeu_ps(out0 + (half + i) * LANES, s0[i]);
        _mm256_storeu_ps(out1 + (half + i) * LANES, s1[i]);
      }
    }
  };
  struct Weights {
    __m256 corr;
    bool rescale;
  };
  // Online softmax of vector v over the block's raw scores `raw`: probabilities into p[i][L]
  // (bfloat16 queries: rounded to bfloat16), running max and sum updated; returns the
  // factor the output accumulators take first.
  auto softmax = [&](int64_t v, int64_t n, int64_t k0, const float* raw, float* p_out) -> Weights {
    const int64_t first_row = v * LANES / G;
    const bool diagonal = k0 + n - 1 > prefix + r0 + first_row;
    const __m256i row_pos = _mm256_loadu_si256((const __m256i*)(rp + v * LANES));
    __m256 s[KEYS], visible[KEYS];
    // Key k0 + i is visible to a lane when it is one of the block's n and k0 + i <= the
    // lane's row position.
    for (int64_t i = 0; i < KEYS; ++i) {
      if (i >= n) {
        visible[i] = _mm256_setzero_ps();
      } else if (diagonal) {
        visible[i] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(row_pos, _mm256_set1_epi32((int32_t)(k0 + i - 1))));
      } else {
        visible[i] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
      }
      s[i] = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(_mm256_loadu_ps(raw + i * LANES), scale), visible[i]);
    }
    float* m_l = ml + v * 2 * LANES;
    const __m256 m_old = _mm256_loadu_ps(m_l);
    __m256 m_new = m_old;
    for (int64_t i = 0; i < KEYS; ++i) m_new = _mm256_max_ps(m_new, s[i]);
    // Lanes that have seen no key yet keep -inf: exp(-inf - -inf) is NaN, so they compute
    // with 0 instead and their probabilities come out 0.
    const __m256 seen = _mm256_cmp_ps(m_new, neg_inf, _CMP_NEQ_OQ);
    const __m256 m_use = _mm256_and_ps(seen, m_new);
    const __m256 corr = _mm256_and_ps(seen, exp8(_mm256_sub_ps(m_old, m_use)));
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(m_l + LANES), corr);
    for (int64_t i = 0; i < n; ++i) {
      __m256 p = _mm256_and_ps(_mm256_and_ps(seen, visible[i]), exp8(_mm256_sub_ps(s[i], m_use)));
      sum = _mm256_add_ps(sum, p);
      if constexpr (DT == 1) p = round_bf16(p);
      _mm256_storeu_ps(p_out + i * LANES, p);
    }
    _mm256_storeu_ps(m_l, m_new);
    _mm256_storeu_ps(m_l + LANES, sum);
    return {corr, _mm256_movemask_ps(_mm256_cmp_ps(corr, _mm256_set1_ps(1.0f), _CMP_NEQ_OQ)) != 0};
  };
  // Output accumulators of vector v += its probabilities times the block's values.
  auto values_one = [&](int64_t v, int64_t n, const Weights& w, const float* p_in) {
    float* o = ot + v * D * LANES;
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 acc[8];
      for (int64_t d = 0; d < 8; ++d) {
        acc[d] = _mm256_loadu_ps(o + (d0 + d) * LANES);
        if (w.rescale) acc[d] = _mm256_mul_ps(acc[d], w.corr);
      }
      for (int64_t i = 0; i < n; ++i) {
        const __m256 p = _mm256_loadu_ps(p_in + i * LANES);
#pragma GCC unroll 8
        for (int64_t d = 0; d < 8; ++d) acc[d] = _mm256_fmadd_ps(p, _mm256_set1_ps(vf[i * D + d0 + d]), acc[d]);
      }
      for (int64_t d = 0; d < 8; ++d) _mm256_storeu_ps(o + (d0 + d) * LANES, acc[d]);
    }
  };
  // The same for vectors v and v + 1, each value broadcast once for both.
  auto values_pair = [&](int64_t v, int64_t n, const Weights& w0, const Weights& w1, const float* p0,
                         const float* p1) {
    float* o0 = ot + v * D * LANES;
    float* o1 = o0 + D * LANES;
    for (int64_t d0 = 0; d0 < D; d0 += 4) {
      __m256 a0[4], a1[4];
      for (int64_t d = 0; d < 4; ++d) {
        a0[d] = _mm256_loadu_ps(o0 + (d0 + d) * LANES);
        a1[d] = _mm256_loadu_ps(o1 + (d0 + d) * LANES);
        if (w0.rescale) a0[d] = _mm256_mul_ps(a0[d], w0.corr);
        if (w1.rescale) a1[d] = _mm256_mul_ps(a1[d], w1.corr);
      }
      for (int64_t i = 0; i < n; ++i) {
        const __m256 x0 = _mm256_loadu_ps(p0 + i * LANES), x1 = _mm256_loadu_ps(p1 + i * LANES);
#pragma GCC unroll 4
        for (int64_t d = 0; d < 4; ++d) {
          const __m256 val = _mm256_set1_ps(vf[i * D + d0 + d]);
          a0[d] = _mm256_fmadd_ps(x0, val, a0[d]);
          a1[d] = _mm256_fmadd_ps(x1, val, a1[d]);
        }
      }
      for (int64_t d = 0; d < 4; ++d) {
        _mm256_storeu_ps(o0 + (d0 + d) * LANES, a0[d]);
        _mm256_storeu_ps(o1 + (d0 + d) * LANES, a1[d]);
      }
    }
  };
  const char* krow[16];
  const char* vrow[16];
  for (int64_t k0 = 0; k0 < last_key; k0 += KEYS) {
    const int64_t n = imin(KEYS, last_key - k0);
    token_rows(a, a.k_cache, pages, k0, n, KS, krow);
    token_rows(a, a.v_cache, pages, k0, n, KS, vrow);
    // Keys and values of kv head kvh in float32 (rows past n repeat key 0: finite, masked).
    for (int64_t i = 0; i < KEYS; ++i) {
      const char* kr = krow[i] + kvh * a.kv_stride_head * KS;
      const char* vr = vrow[i] + kvh * a.kv_stride_head * KS;
      for (int64_t d = 0; d < D; d += 8) {
        _mm256_storeu_ps(kf + i * D + d, load_kv8<DT, KT>(kr + d * KS));
        _mm256_storeu_ps(vf + i * D + d, load_kv8<DT, KT>(vr + d * KS));
      }
    }
    // Vectors in pairs where both see keys of this block: each key's broadcast then feeds
    // two vectors' FMAs (6 loads per 8 FMAs instead of 9).
    for (int64_t v = 0; v < vectors;) {
      if (!sees_block(v, k0)) {
        ++v;
        continue;
      }
      if (v + 1 < vectors && sees_block(v + 1, k0)) {
        scores_pair(v, sb, sb + KEYS * LANES);
        Weights w0 = softmax(v, n, k0, sb, pp), w1 = softmax(v + 1, n, k0, sb + KEYS * LANES, pp + KEYS * LANES);
        values_pair(v, n, w0, w1, pp, pp + KEYS * LANES);
        v += 2;
      } else {
        scores_one(v, sb);
        Weights w = softmax(v, n, k0, sb, pp);
        values_one(v, n, w, pp);
        ++v;
      }
    }
  }
  // out[row, h, :] = ot[:, lane] * v_mult / sum[lane], for each live lane.
  for (int64_t v = 0; v < vectors; ++v) {
    alignas(32) float inv[LANES];
    _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(a.v_mult), _mm256_loadu_ps(ml + v * 2 * LANES + LANES)));
    const float* o = ot + v * D * LANES;
    const int64_t n_lanes = imin(LANES, lanes - v * LANES);
    for (int64_t L = 0; L < n_lanes; ++L) {
      const int64_t f = v * LANES + L, row = f / G, h = kvh * G + f % G;
      char* dst = (char*)a.out + ((a.q_start[b] + r0 + row) * a.H + h) * D * QS;
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        alignas(32) float col[8];
        for (int64_t d = 0; d < 8; ++d) col[d] = o[(d0 + d) * LANES + L];
        store8(dst + d0 * QS, _mm256_mul_ps(_mm256_load_ps(col), _mm256_set1_ps(inv[L])), DT);
      }
    }
  }
}

}  // namespace

int64_t extend_attention_scratch(const ExtendAttnArgs& a) {
  return extend_layout(lane_vectors(EXTEND_TASK_ROWS, a.H / a.KVH), a.D).total;
}

void extend_attention_task(const ExtendAttnArgs& a, int64_t b, int64_t kvh, int64_t r0, int64_t r1, float* scratch) {
  auto with_types = [&](auto d, auto dt) {
    constexpr int D = decltype(d)::value, DT = decltype(dt)::value;
    if (a.kv_dtype == 1)
      task<D, DT, 1>(a, b, kvh, r0, r1, scratch);
    else if (a.kv_dtype == KV_E5M2)
      task<D, DT, KV_E5M2>(a, b, kvh, r0, r1, scratch);
    else
      task<D, DT, KV_SAME>(a, b, kvh, r0, r1, scratch);
  };
  auto with_d = [&](auto dt) {
    if (a.D == 64)
      with_types(std::integral_constant<int, 64>{}, dt);
    else
      with_types(std::integral_constant<int, 128>{}, dt);
  };
  if (a.dtype == 0)
    with_d(std::integral_constant<int, 0>{});
  else
    with_d(std::integral_constant<int, 1>{});
}

}  // namespace avx2
}  // namespace preheat
