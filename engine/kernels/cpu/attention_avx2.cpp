// Paged decode attention of attention_avx512.cpp for AVX2 CPUs: the same tasks (a chunk of
// one row's context, every head, 16 tokens per block), the same partials and merge, the
// same fp8 reading (through float16 bit patterns, scales folded by the caller). What
// differs is the arithmetic at 8 lanes: each key row is converted to float32 once and
// dotted with every query head of its group (FMA, then a horizontal sum), and values are
// weighed in float32. For a bfloat16 cache the probabilities are rounded to bfloat16 before
// they weigh the values, as the AVX-512 build (and SDPA's bfloat16 path) does. Pages are
// asked for as in the AVX-512 build (LineStream, portable.h).
#include "avx2_common.h"

namespace preheat {
namespace avx2 {
namespace {

constexpr int64_t MAX_DV = 32;  // head_dim / 8

// Floats [i, i + 8) of s, lanes at or past n reading `fill`.
inline __m256 load8_fill(const float* s, int64_t i, int64_t n, float fill) {
  if (i + 8 <= n) return _mm256_loadu_ps(s + i);
  alignas(32) float buf[8];
  for (int k = 0; k < 8; ++k) buf[k] = i + k < n ? s[i + k] : fill;
  return _mm256_load_ps(buf);
}

struct Scratch {
  LineStream* upcoming;  // the next task's first blocks, asked for while this one weighs values
  bool first_asked;      // this task's first blocks were the previous task's `upcoming`
  float* s;     // [H, chunk]: scores, then probabilities
  float* o;     // [H, D]: output accumulators
  float* vf;    // [16, D]: one kv head's value rows in float32
  float* qf;    // [H, D]: the row's queries in float32
};

template <int DVC, int DT, int KT>
void attend_chunk(const DecodeAttnArgs& a, int64_t b, int64_t t0, int64_t t1, bool direct, float* part,
                  const Scratch& sc) {
  const int64_t DV = DVC > 0 ? DVC : a.D / 8;
  const int64_t H = a.H, G = a.H / a.KVH, D = a.D, len = t1 - t0, esz = DT == 0 ? 4 : 2;
  constexpr int64_t KS = kv_size<DT, KT>();
  const int32_t* pages = a.page_table + b * a.pt_stride;
  const char* qb = (const char*)a.q + b * a.q_stride_b * esz;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t v = 0; v < DV; ++v)
      _mm256_storeu_ps(sc.qf + h * D + v * 8, load8(qb + (h * a.q_stride_h + v * 8) * esz, DT));
  const char* krow[16];
  const char* vrow[16];
  __m256 kf[MAX_DV];
  // Scores, 16 tokens at a time; each key row converted once for the heads of its group.
  for (int64_t blk = t0; blk < t1; blk += 16) {
    const int64_t n = imin(16, t1 - blk);
    token_rows(a, a.k_cache, pages, blk, n, KS, krow);
    // Keys and values ahead (see ask_ahead_of_scores), a share before each key row.
    LineStream far;
    ask_ahead_of_scores(far, a, pages, blk, t0, t1, sc.first_asked, KS);
    const int64_t far_share = far.share(a.KVH * n);
    for (int64_t kvh = 0; kvh < a.KVH; ++kvh) {
      for (int64_t i = 0; i < n; ++i) {
        far.issue(far_share);
        const char* kr = krow[i] + kvh * a.kv_stride_head * KS;
        for (int64_t v = 0; v < DV; ++v) kf[v] = load_kv8<DT, KT>(kr + v * 8 * KS);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kvh * G + g;
          const float* qh = sc.qf + h * D;
          __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qh), kf[0]), s1 = _mm256_setzero_ps();
          for (int64_t v = 1; v + 1 < DV; v += 2) {
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + v * 8), kf[v], s1);
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + v * 8 + 8), kf[v + 1], s0);
          }
          if (DV % 2 == 0) s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + (DV - 1) * 8), kf[DV - 1], s1);
          sc.s[h * a.chunk + (blk - t0) + i] = hsum8(_mm256_add_ps(s0, s1)) * a.scale;
        }
      }
    }
  }
  // Softmax numerators per head.
  float mx[256], sum[256];
  for (int64_t h = 0; h < H; ++h) {
    float* s = sc.s + h * a.chunk;
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < len; i += 8) m = _mm256_max_ps(m, load8_fill(s, i, len, -INFINITY));
    mx[h] = hmax8(m);
    const __m256 mv = _mm256_set1_ps(mx[h]);
    __m256 l = _mm256_setzero_ps();
    for (int64_t i = 0; i < len; i += 8) {
      __m256 e = exp8(_mm256_sub_ps(load8_fill(s, i, len, -INFINITY), mv));
      if (i + 8 > len)  // lanes past the context weigh exactly 0 (exp8 of -inf is ~1e-38)
        e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_ps((float)(len - i)), _CMP_LT_OQ));
      l = _mm256_add_ps(l, e);  // summed before any rounding, as the AVX-512 build does
      if (DT == 1 && KT == KV_SAME) e = round_bf16(e);
      _mm256_storeu_ps(s + i, e);  // s has room: chunk is a multiple of 16
    }
    sum[h] = hsum8(l);
  }
  // Weighted values, 16 tokens at a time.
  for (int64_t i = 0; i < H * D; i += 8) _mm256_storeu_ps(sc.o + i, _mm256_setzero_ps());
  WeighAhead ahead(a, sc.upcoming, pages, t0, t1, KS);
  for (int64_t blk = t0; blk < t1; blk += 16) {
    const int64_t n = imin(16, t1 - blk);
    token_rows(a, a.v_cache, pages, blk, n, KS, vrow);
    ahead.block(blk);
    for (int64_t kvh = 0; kvh < a.KVH; ++kvh) {
      ahead.head();
      for (int64_t i = 0; i < n; ++i)
        for (int64_t v = 0; v < DV; ++v)
          _mm256_storeu_ps(sc.vf + i * D + v * 8, load_kv8<DT, KT>(vrow[i] + (kvh * a.kv_stride_head + v * 8) * KS));
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const float* p = sc.s + h * a.chunk + (blk - t0);
        __m256 o[MAX_DV];
        for (int64_t v = 0; v < DV; ++v) o[v] = _mm256_loadu_ps(sc.o + h * D + v * 8);
        for (int64_t i = 0; i < n; ++i) {
          const __m256 pv = _mm256_set1_ps(p[i]);
          for (int64_t v = 0; v < DV; ++v) o[v] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(sc.vf + i * D + v * 8), o[v]);
        }
        for (int64_t v = 0; v < DV; ++v) _mm256_storeu_ps(sc.o + h * D + v * 8, o[v]);
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    if (direct) {
      const __m256 inv = _mm256_set1_ps(a.v_mult / sum[h]);
      for (int64_t v = 0; v < DV; ++v)
        store8(elem(a.out, (b * H + h) * D + v * 8, DT), _mm256_mul_ps(_mm256_loadu_ps(sc.o + h * D + v * 8), inv), DT);
    } else {
      float* p = part + h * (D + 2);
      p[0] = mx[h];
      p[1] = sum[h];
      memcpy(p + 2, sc.o + h * D, D * 4);
    }
  }
}

}  // namespace

int64_t decode_attention_scratch(const DecodeAttnArgs& a) {
  // scores, output accumulators, float32 value rows [16, D], float32 queries [H, D].
  return a.H * a.chunk + a.H * a.D + 16 * a.D + a.H * a.D;
}

void decode_attention_tasks(const DecodeAttnArgs& a, const int32_t* task_b, const int32_t* task_chunk,
                            const int32_t* num_chunks, float* scratch, int64_t begin, int64_t end) {
  float* o = scratch + a.H * a.chunk;
  LineStream upcoming;
  Scratch sc{&upcoming, false, scratch, o, o + a.H * a.D, o + a.H * a.D + 16 * a.D};
  for_each_task(a, task_b, task_chunk, num_chunks, begin, end, upcoming,
                [&](int64_t b, int64_t t0, int64_t t1, bool direct, float* part, bool first_asked) {
                  sc.first_asked = first_asked;
                  with_attention_types(a, [&](auto dt, auto kt, auto d) {
                    attend_chunk<decltype(d)::value / 8, decltype(dt)::value, decltype(kt)::value>(
                        a, b, t0, t1, direct, part, sc);
                  });
                });
}

void decode_attention_combine(const DecodeAttnArgs& a, const int64_t* first_task, const int32_t* num_chunks,
                              int64_t begin, int64_t end) {
  combine_partials(a, first_task, num_chunks, begin, end);
}

}  // namespace avx2
}  // namespace preheat
