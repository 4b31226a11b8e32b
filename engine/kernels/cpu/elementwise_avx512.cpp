// The element-wise work of a layer, fused so each is one pass and one call: RMSNorm, the
// SiLU gate, and rotary embedding together with the KV-cache write. In bfloat16 every step
// is rounded where torch's separate ops would round, so the results match the reference.
#include "avx512_common.h"

namespace preheat {
namespace avx512 {

void rms_norm_rows(const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int64_t n, float eps,
                   int dtype, int64_t m_begin, int64_t m_end) {
  for (int64_t m = m_begin; m < m_end; ++m) {
    const void* row = elem(x, m * ldx, dtype);
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 v = load16_masked(elem(row, i, dtype), dtype, tail_mask(n - i));
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float r = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps);
    const __m512 rv = _mm512_set1_ps(r);
    void* out = elem(y, m * ldy, dtype);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 mask = tail_mask(n - i);
      __m512 v = _mm512_mul_ps(load16_masked(elem(row, i, dtype), dtype, mask), rv);
      if (dtype == 1) v = round_bf16(v);
      v = _mm512_mul_ps(v, load16_masked(elem(w, i, dtype), dtype, mask));
      store16_masked(elem(out, i, dtype), v, dtype, mask);
    }
  }
}

void silu_mul_rows(const void* gu, int64_t ldg, void* y, int64_t ldy, int64_t inter, int dtype, int64_t m_begin,
                   int64_t m_end) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t i = 0; i < inter; i += 16) {
      const __mmask16 mask = tail_mask(inter - i);
      const __m512 g = load16_masked(elem(gu, m * ldg + i, dtype), dtype, mask);
      const __m512 u = load16_masked(elem(gu, m * ldg + inter + i, dtype), dtype, mask);
      __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      if (dtype == 1) s = round_bf16(s);
      store16_masked(elem(y, m * ldy + i, dtype), _mm512_mul_ps(s, u), dtype, mask);
    }
  }
}

void argmax_rows(const float* x, int64_t ldx, int64_t n, int64_t* out, int64_t m_begin, int64_t m_end) {
  const __m512 low = _mm512_set1_ps(-INFINITY);
  for (int64_t m = m_begin; m < m_end; ++m) {
    const float* row = x + m * ldx;
    // The largest value, and whether any is NaN (max_ps would pass one over).
    __m512 best = low;
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 mask = tail_mask(n - i);
      const __m512 v = _mm512_mask_loadu_ps(low, mask, row + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best = _mm512_max_ps(best, v);
    }
    int64_t at = 0;
    if (nan) {
      while (!(row[at] != row[at])) ++at;
    } else {
      // Then the first lane equal to it (the row is in cache now).
      const __m512 b = _mm512_set1_ps(_mm512_reduce_max_ps(best));
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = tail_mask(n - i);
        const __mmask16 eq = _mm512_mask_cmp_ps_mask(mask, _mm512_maskz_loadu_ps(mask, row + i), b, _CMP_EQ_OQ);
        if (eq) {
          at = i + __builtin_ctz(eq);
          break;
        }
      }
    }
    out[m] = at;
  }
}

namespace {
// out = x * cos + roll(x, D/2) * signed_sin for one head (D a multiple of 32).
inline void rope_head(const void* x, const void* cs, void* out, int64_t D, int dtype) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; i += 16) {
    const int64_t j = i < half ? i + half : i - half;
    const __m512 xv = load16(elem(x, i, dtype), dtype);
    const __m512 rv = load16(elem(x, j, dtype), dtype);
    const __m512 c = load16(elem(cs, i, dtype), dtype);
    const __m512 s = load16(elem(cs, D + i, dtype), dtype);
    __m512 a = _mm512_mul_ps(xv, c), b = _mm512_mul_ps(rv, s);
    if (dtype == 1) {
      a = round_bf16(a);
      b = round_bf16(b);
    }
    store16(elem(out, i, dtype), _mm512_add_ps(a, b), dtype);
  }
}
}  // namespace

void rope_kv_rows(const RopeKVArgs& a, int64_t m_begin, int64_t m_end) {
  rope_kv_rows_with(a, m_begin, m_end, rope_head);
}

}  // namespace avx512
}  // namespace preheat
