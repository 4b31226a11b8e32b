// Paged decode attention: one query token per row, keys and values read straight from the
// pool's pages (no gather copy), softmax in float32. A task is a chunk of one row's context
// with every head, walked 16 tokens (one page at the default page size) at a time:
//  - scores: each query head against the 16 keys of its kv head (bf16 pairs multiplied
//    exactly with vdpbf16ps), 16 dot products reduced together by a transpose-add tree;
//  - values: each kv head's 16 value rows converted to float32 once and shared by the
//    query heads of its group (grouped-query attention without expanding K/V).
// An fp8 cache (e4m3 or e5m2) is read in place, one byte per value, converted through
// float16 bit patterns (see load16_fp8); its scales are folded into the score scale and the
// output factor, so the loops stay the same. With bfloat16 queries and head_dim a multiple
// of 32 each kv head's 16 key rows and value rows of a block are widened to bfloat16 once
// (exactly: widen_fp8_bf16, table lookups where the CPU has AVX-512 VBMI) into scratch and taken by the bfloat16 paths (vdpbf16ps, the
// probabilities rounded to bfloat16 as for a bfloat16 cache): converting every key row
// once per query head and weighing values in float32 made an fp8 pool's steps slower than
// a bfloat16 pool's at batch 8 and 16 although it reads half the bytes.
// Chunks of one row are merged with their log-sum-exp, so even one long sequence keeps
// every thread busy.
// Memory: each 16-token page lies anywhere in the pool, so the hardware prefetchers stop at
// every page; the kernel asks for pages itself (see LineStream), a few lines between
// computations: keys and values FAR_BLOCKS blocks ahead while scoring, the next block's
// values while weighing, and the next task's first blocks while weighing this one's.
// Measured on the AMD EPYC host (2 cores; batch 8 and 16, contexts 256-650, timers around
// the kernel inside decode steps): 0.75-0.88x the attention time of asking for whole blocks
// at once two blocks ahead, which stalled the core on the prefetches themselves once the
// miss queue was full (perf put ~15% of the kernel's samples on those loops); whole decode
// steps 0.92-0.97x at batch 8 and 16 with contexts of 768, ~0.94x at batch 16 with 256
// (benchmarks/results/decode_attention_prefetch_steps*.md).
#include <initializer_list>

#include "avx512_common.h"

namespace preheat {
namespace avx512 {
namespace {

constexpr int64_t MAX_DV = 16;  // head_dim / 16

// 16 fp8 values to float32 through their float16 bit patterns: e5m2 is the top byte of a
// float16, exactly; e4m3's sign, exponent and mantissa moved to their float16 positions read
// as value / 256 (exponent bias 15 instead of 7; subnormals map to subnormals the same way),
// a factor the caller folds into its scales. NaN (never stored: writes clamp) is not kept.
inline __m512 load16_fp8(const void* p, int kt) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  if (kt == KV_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
  // The byte to the top (sign at bit 15), one arithmetic shift down (exponent and mantissa
  // to float16's places, the sign copied into bit 14), bit 14 cleared: three ops.
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1), _mm256_set1_epi16((short)0xBFFF));
  return _mm512_cvtph_ps(h);
}

template <int DT, int KT>
inline __m512 load_kv16(const char* p) {
  return KT == KV_SAME ? load16(p, DT) : load16_fp8(p, KT);
}

// out[i] = sum of the 16 lanes of v[i], for 16 vectors at once.
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // x[i] holds, per 128-bit lane L, partial sums of v[4i..4i+3]; add the four lanes.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

struct Scratch {
  LineStream* upcoming;  // the next task's first blocks, asked for while this one weighs values
  bool first_asked;      // this task's first blocks were the previous task's `upcoming`
  float* s;     // [H, chunk]: scores, then probabilities
  float* o;     // [H, D]: output accumulators
  float* vf;    // [16, D]: one kv head's value rows in float32
  uint16_t* rows_bf16;  // [16, D]: an fp8 cache's 16 key or value rows of one kv head, widened
};

// Whether an fp8 cache (KT) is read through bfloat16 rows (rows_bf16) for queries of dtype
// DT and head_dim D.
template <int DT, int KT>
constexpr bool widens_fp8(int64_t D) {
  return DT == 1 && KT != KV_SAME && D % 32 == 0;
}

// rows[0..16) of this kv head widened to bfloat16 into `out` [16, D]; `widened` gets `out`'s rows.
template <int KT>
inline void widen_rows(const char* const* rows, int64_t offset, int64_t D, uint16_t* out, const char** widened) {
  for (int i = 0; i < 16; ++i) {
    widen_fp8_bf16<KT>(rows[i] + offset, D, out + i * D);
    widened[i] = (const char*)(out + i * D);
  }
}

// Scores of one head against 16 key rows (rows[i] = row i's key for this kv head).
template <int DVC, int DT, int KT>
inline __m512 scores16(const char* qh, const char* const* rows, int64_t D) {
  const int64_t DV = DVC > 0 ? DVC : D / 16;
  constexpr int64_t KS = kv_size<DT, KT>();
  __m512 acc[16];
  if (DT == 1 && KT == KV_SAME && D % 32 == 0) {
    __m512i qv[MAX_DV / 2];
    for (int64_t w = 0; w < DV / 2; ++w) qv[w] = _mm512_loadu_si512(qh + w * 64);
    for (int i = 0; i < 16; ++i) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t w = 0; w < DV / 2; ++w)
        s = _mm512_dpbf16_ps(s, (__m512bh)qv[w], (__m512bh)_mm512_loadu_si512(rows[i] + w * 64));
      acc[i] = s;
    }
  } else {
    __m512 qv[MAX_DV];
    for (int64_t v = 0; v < DV; ++v) qv[v] = load16(qh + v * 16 * (DT == 0 ? 4 : 2), DT);
    for (int i = 0; i < 16; ++i) {
      __m512 s = _mm512_mul_ps(qv[0], load_kv16<DT, KT>(rows[i]));
      for (int64_t v = 1; v < DV; ++v) s = _mm512_fmadd_ps(qv[v], load_kv16<DT, KT>(rows[i] + v * 16 * KS), s);
      acc[i] = s;
    }
  }
  return reduce16(acc);
}

// o[h] += sum_t p[h][t] v[t] in float32 (values converted once per kv head and block).
template <int DVC, int DT, int KT>
void weigh_values(const DecodeAttnArgs& a, const int32_t* pages, int64_t t0, int64_t t1, const Scratch& sc) {
  const int64_t DV = DVC > 0 ? DVC : a.D / 16;
  const int64_t G = a.H / a.KVH, D = a.D, esz = kv_size<DT, KT>();
  const char* vrow[16];
  WeighAhead ahead(a, sc.upcoming, pages, t0, t1, esz);
  for (int64_t blk = t0; blk < t1; blk += 16) {
    const int64_t n = imin(16, t1 - blk);
    token_rows(a, a.v_cache, pages, blk, n, esz, vrow);
    ahead.block(blk);
    for (int64_t kvh = 0; kvh < a.KVH; ++kvh) {
      ahead.head();
      for (int64_t i = 0; i < n; ++i)
        for (int64_t v = 0; v < DV; ++v)
          _mm512_storeu_ps(sc.vf + i * D + v * 16, load_kv16<DT, KT>(vrow[i] + (kvh * a.kv_stride_head + v * 16) * esz));
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const float* p = sc.s + h * a.chunk + (blk - t0);
        __m512 o[MAX_DV];
        for (int64_t v = 0; v < DV; ++v) o[v] = _mm512_loadu_ps(sc.o + h * D + v * 16);
        for (int64_t i = 0; i < n; ++i) {
          const __m512 pv = _mm512_set1_ps(p[i]);
          for (int64_t v = 0; v < DV; ++v) o[v] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(sc.vf + i * D + v * 16), o[v]);
        }
        for (int64_t v = 0; v < DV; ++v) _mm512_storeu_ps(sc.o + h * D + v * 16, o[v]);
      }
    }
  }
}

// The same for bfloat16 values, two tokens per vdpbf16ps: rows t and t+1 interleaved
// ((v[t][d], v[t+1][d]) pairs) against the pair (p[t], p[t+1]) rounded to bfloat16, as
// SDPA's bfloat16 path rounds its probabilities. unpack{lo,hi}_epi16 leave the outputs in
// a lane order of their own (per 32 values: lo = d 0-3, 8-11, 16-19, 24-27; hi = the
// rest); the accumulators keep that order and are put back when stored.
template <int DVC>
void weigh_values_bf16(const DecodeAttnArgs& a, const int32_t* pages, int64_t t0, int64_t t1, const Scratch& sc) {
  const int64_t DV = DVC > 0 ? DVC : a.D / 16;
  const int64_t G = a.H / a.KVH, D = a.D, W = D / 32, len = t1 - t0;
  uint16_t* pb = (uint16_t*)sc.vf;                 // [H, chunk] probabilities in bf16
  uint16_t* vi = pb + a.H * a.chunk;               // [8 pairs, D] interleaved value rows
  for (int64_t h = 0; h < a.H; ++h)
    for (int64_t i = 0; i < len; i += 16)
      _mm256_storeu_si256((__m256i*)(pb + h * a.chunk + i),
                          f32_to_bf16(_mm512_maskz_loadu_ps(tail_mask(len - i), sc.s + h * a.chunk + i)));
  __m512 acc[MAX_DV];
  const char* vrow[16];
  WeighAhead ahead(a, sc.upcoming, pages, t0, t1, 2);
  for (int64_t blk = t0; blk < t1; blk += 16) {
    const int64_t n = imin(16, t1 - blk), pairs = (n + 1) / 2;
    token_rows(a, a.v_cache, pages, blk, n, 2, vrow);
    ahead.block(blk);
    for (int64_t kvh = 0; kvh < a.KVH; ++kvh) {
      ahead.head();
      for (int64_t pr = 0; pr < pairs; ++pr) {
        const char* r0 = vrow[2 * pr] + kvh * a.kv_stride_head * 2;
        const char* r1 = vrow[2 * pr + 1] + kvh * a.kv_stride_head * 2;
        for (int64_t w = 0; w < W; ++w) {
          const __m512i x0 = _mm512_loadu_si512(r0 + w * 64), x1 = _mm512_loadu_si512(r1 + w * 64);
          _mm512_storeu_si512(vi + pr * 2 * D + w * 64, _mm512_unpacklo_epi16(x0, x1));
          _mm512_storeu_si512(vi + pr * 2 * D + w * 64 + 32, _mm512_unpackhi_epi16(x0, x1));
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const uint16_t* p = pb + h * a.chunk + (blk - t0);
        for (int64_t v = 0; v < DV; ++v) acc[v] = _mm512_setzero_ps();
        for (int64_t pr = 0; pr < pairs; ++pr) {
          // An odd last token pairs with a copy of row 0 whose weight is the 0 past `len`.
          const __m512i pp = _mm512_set1_epi32((int32_t)p[2 * pr] | ((int32_t)p[2 * pr + 1] << 16));
          for (int64_t v = 0; v < DV; ++v)
            acc[v] = _mm512_dpbf16_ps(acc[v], (__m512bh)_mm512_loadu_si512(vi + pr * 2 * D + v * 32), (__m512bh)pp);
        }
        // acc[2w] (lo) and acc[2w+1] (hi) hold d = 32w + {0-3, 8-11, 16-19, 24-27} and the rest.
        float* o = sc.o + h * D;
        for (int64_t w = 0; w < W; ++w) {
          const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
          const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
          const __m512 first = _mm512_permutex2var_ps(acc[2 * w], lo_idx, acc[2 * w + 1]);
          const __m512 second = _mm512_permutex2var_ps(acc[2 * w], hi_idx, acc[2 * w + 1]);
          _mm512_storeu_ps(o + w * 32, _mm512_add_ps(_mm512_loadu_ps(o + w * 32), first));
          _mm512_storeu_ps(o + w * 32 + 16, _mm512_add_ps(_mm512_loadu_ps(o + w * 32 + 16), second));
        }
      }
    }
  }
}

// The same product, each kv head's two value rows of a pair of tokens interleaved in
// registers once and shared by up to GS query heads of its group (whose probability pairs
// the softmax wrote as bfloat16 pairs), accumulators loaded and stored once per block and
// head: no scratch copy of the values, no per-pair packing of probabilities. Blocks stay
// the outer loop so each block's value rows (one page) are read once, front to back. Same
// products and rounding as weigh_values_bf16.
template <int DV, int GS, int KT>
void weigh_values_bf16_regs(const DecodeAttnArgs& a, const int32_t* pages, int64_t t0, int64_t t1,
                            const Scratch& sc) {
  constexpr int64_t W = DV / 2, ESZ = KT == KV_SAME ? 2 : 1;
  const int64_t G = a.H / a.KVH, D = a.D, half = a.chunk / 2;
  const uint32_t* pp = (const uint32_t*)sc.vf;  // [H, chunk / 2] probability pairs (t, t + 1) as bf16
  // The accumulators in sc.o keep unpack{lo,hi}'s lane order until the end.
  const char* vrow[16];
  const char* widened[16];
  WeighAhead ahead(a, sc.upcoming, pages, t0, t1, ESZ);
  for (int64_t blk = t0; blk < t1; blk += 16) {
    const int64_t n = imin(16, t1 - blk), pairs = (n + 1) / 2, p0 = (blk - t0) / 2;
    token_rows(a, a.v_cache, pages, blk, n, ESZ, vrow);
    ahead.block(blk);
    for (int64_t kvh = 0; kvh < a.KVH; ++kvh) {
      ahead.head();
      // Row i of this kv head: in the page (bfloat16), or widened from fp8 once for the group.
      const char* const* rows = vrow;
      int64_t offset = kvh * a.kv_stride_head * 2;
      if constexpr (KT != KV_SAME) {
        widen_rows<KT>(vrow, kvh * a.kv_stride_head, D, sc.rows_bf16, widened);
        rows = widened;
        offset = 0;
      }
      for (int64_t g0 = 0; g0 < G; g0 += GS) {
        const int64_t gs = imin(GS, G - g0), h0 = kvh * G + g0;
        __m512 acc[GS][DV];
        for (int g = 0; g < GS && g < gs; ++g)
          for (int v = 0; v < DV; ++v) acc[g][v] = _mm512_loadu_ps(sc.o + (h0 + g) * D + v * 16);
        for (int64_t pr = 0; pr < pairs; ++pr) {
          // An odd last token pairs with a copy of row 0 whose weight is the 0 past `len`.
          const char* r0 = rows[2 * pr] + offset;
          const char* r1 = rows[2 * pr + 1] + offset;
          __m512i vi[DV];
          for (int w = 0; w < W; ++w) {
            const __m512i x0 = _mm512_loadu_si512(r0 + w * 64), x1 = _mm512_loadu_si512(r1 + w * 64);
            vi[2 * w] = _mm512_unpacklo_epi16(x0, x1);
            vi[2 * w + 1] = _mm512_unpackhi_epi16(x0, x1);
          }
          for (int g = 0; g < GS && g < gs; ++g) {
            const __m512i pv = _mm512_set1_epi32((int32_t)pp[(h0 + g) * half + p0 + pr]);
            for (int v = 0; v < DV; ++v) acc[g][v] = _mm512_dpbf16_ps(acc[g][v], (__m512bh)vi[v], (__m512bh)pv);
          }
        }
        for (int g = 0; g < GS && g < gs; ++g)
          for (int v = 0; v < DV; ++v) _mm512_storeu_ps(sc.o + (h0 + g) * D + v * 16, acc[g][v]);
      }
    }
  }
  // acc[2w] (lo) and acc[2w+1] (hi) hold d = 32w + {0-3, 8-11, 16-19, 24-27} and the rest.
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < a.H; ++h) {
    float* o = sc.o + h * D;
    for (int64_t w = 0; w < W; ++w) {
      const __m512 lo = _mm512_loadu_ps(o + w * 32), hi = _mm512_loadu_ps(o + w * 32 + 16);
      _mm512_storeu_ps(o + w * 32, _mm512_permutex2var_ps(lo, lo_idx, hi));
      _mm512_storeu_ps(o + w * 32 + 16, _mm512_permutex2var_ps(lo, hi_idx, hi));
    }
  }
}

template <int DVC, int DT, int KT>
void attend_chunk(const DecodeAttnArgs& a, int64_t b, int64_t t0, int64_t t1, bool direct, float* part,
                  const Scratch& sc) {
  const int64_t DV = DVC > 0 ? DVC : a.D / 16;
  const int64_t H = a.H, G = a.H / a.KVH, D = a.D, len = t1 - t0, esz = DT == 0 ? 4 : 2;
  const int64_t kesz = kv_size<DT, KT>();
  const int32_t* pages = a.page_table + b * a.pt_stride;
  const char* qb = (const char*)a.q + b * a.q_stride_b * esz;
  const __m512 scale = _mm512_set1_ps(a.scale);
  const char* krow[16];
  // Scores, 16 tokens at a time.
  for (int64_t blk = t0; blk < t1; blk += 16) {
    const int64_t n = imin(16, t1 - blk);
    token_rows(a, a.k_cache, pages, blk, n, kesz, krow);
    // Keys and values ahead (see ask_ahead_of_scores), a share before each head's scores.
    LineStream far;
    ask_ahead_of_scores(far, a, pages, blk, t0, t1, sc.first_asked, kesz);
    const int64_t far_share = far.share(H);
    for (int64_t kvh = 0; kvh < a.KVH; ++kvh) {
      const char* rows[16];
      for (int i = 0; i < 16; ++i) rows[i] = krow[i] + kvh * a.kv_stride_head * kesz;
      if (widens_fp8<DT, KT>(D)) widen_rows<KT>(krow, kvh * a.kv_stride_head, D, sc.rows_bf16, rows);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        far.issue(far_share);
        const char* qh = qb + h * a.q_stride_h * esz;
        const __m512 s = widens_fp8<DT, KT>(D) ? scores16<DVC, DT, KV_SAME>(qh, rows, D)
                                               : scores16<DVC, DT, KT>(qh, rows, D);
        _mm512_storeu_ps(sc.s + h * a.chunk + (blk - t0), _mm512_mul_ps(s, scale));
      }
    }
  }
  // Softmax numerators per head (tail positions zeroed); for the register path straight
  // into bfloat16 pairs, as it multiplies them.
  constexpr bool regs = DT == 1 && (KT == KV_SAME || widens_fp8<DT, KT>(DVC * 16)) && (DVC == 4 || DVC == 8);
  float mx[256], sum[256];
  for (int64_t h = 0; h < H; ++h) {
    float* s = sc.s + h * a.chunk;
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < len; i += 16)
      m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(len - i), s + i));
    mx[h] = _mm512_reduce_max_ps(m);
    const __m512 mv = _mm512_set1_ps(mx[h]);
    __m512 l = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
      const __m512 e = _mm512_maskz_mov_ps(tail_mask(len - i), exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv)));
      if constexpr (regs)
        _mm256_storeu_si256((__m256i*)((uint16_t*)sc.vf + h * a.chunk + i), f32_to_bf16(e));
      else
        _mm512_storeu_ps(s + i, e);
      l = _mm512_add_ps(l, e);
    }
    sum[h] = _mm512_reduce_add_ps(l);
  }
  // Weighted values, 16 tokens at a time.
  for (int64_t i = 0; i < H * D; i += 16) _mm512_storeu_ps(sc.o + i, _mm512_setzero_ps());
  if constexpr (regs) {
    // head_dim 64: 5 heads x 4 accumulators; 128: 2 heads x 8.
    weigh_values_bf16_regs<DVC, DVC == 4 ? 5 : 2, KT>(a, pages, t0, t1, sc);
  } else if (DT == 1 && KT == KV_SAME && D % 32 == 0)
    weigh_values_bf16<DVC>(a, pages, t0, t1, sc);
  else
    weigh_values<DVC, DT, KT>(a, pages, t0, t1, sc);
  for (int64_t h = 0; h < H; ++h) {
    if (direct) {
      const __m512 inv = _mm512_set1_ps(a.v_mult / sum[h]);
      for (int64_t v = 0; v < DV; ++v)
        store16(elem(a.out, (b * H + h) * D + v * 16, DT), _mm512_mul_ps(_mm512_loadu_ps(sc.o + h * D + v * 16), inv), DT);
    } else {
      float* p = part + h * (D + 2);
      p[0] = mx[h];
      p[1] = sum[h];
      memcpy(p + 2, sc.o + h * D, D * 4);
    }
  }
}

}  // namespace

// Floats of the part after the scores and output accumulators: either float32 value rows
// [16, D] or the bfloat16 probabilities [H, chunk] and interleaved value pairs [16, D] (half
// a float each).
inline int64_t values_scratch(const DecodeAttnArgs& a) {
  return 16 * a.D > (a.H * a.chunk + 16 * a.D) / 2 ? 16 * a.D : (a.H * a.chunk + 16 * a.D) / 2 + 16;
}

int64_t decode_attention_scratch(const DecodeAttnArgs& a) {
  // scores, output accumulators, the values' part, an fp8 cache's widened rows [16, D] bf16.
  return a.H * a.chunk + a.H * a.D + values_scratch(a) + 8 * a.D;
}

void decode_attention_tasks(const DecodeAttnArgs& a, const int32_t* task_b, const int32_t* task_chunk,
                            const int32_t* num_chunks, float* scratch, int64_t begin, int64_t end) {
  LineStream upcoming;
  float* const o = scratch + a.H * a.chunk;
  Scratch sc{&upcoming, false, scratch, o, o + a.H * a.D, (uint16_t*)(o + a.H * a.D + values_scratch(a))};
  for_each_task(a, task_b, task_chunk, num_chunks, begin, end, upcoming,
                [&](int64_t b, int64_t t0, int64_t t1, bool direct, float* part, bool first_asked) {
                  sc.first_asked = first_asked;
                  with_attention_types(a, [&](auto dt, auto kt, auto d) {
                    attend_chunk<decltype(d)::value / 16, decltype(dt)::value, decltype(kt)::value>(
                        a, b, t0, t1, direct, part, sc);
                  });
                });
}

void decode_attention_combine(const DecodeAttnArgs& a, const int64_t* first_task, const int32_t* num_chunks,
                              int64_t begin, int64_t end) {
  combine_partials(a, first_task, num_chunks, begin, end);
}

}  // namespace avx512
}  // namespace preheat
