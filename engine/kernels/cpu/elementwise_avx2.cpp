// The element-wise kernels of elementwise_avx512.cpp for AVX2 CPUs, 8 lanes at a time and
// rounded at the same places (bf16 after each op torch would round after).
#include "avx2_common.h"

namespace preheat {
namespace avx2 {

void rms_norm_rows(const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int64_t n, float eps,
                   int dtype, int64_t m_begin, int64_t m_end) {
  for (int64_t m = m_begin; m < m_end; ++m) {
    const void* row = elem(x, m * ldx, dtype);
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 v = load8_n(elem(row, i, dtype), dtype, n - i);
      ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 rv = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)n + eps));
    void* out = elem(y, m * ldy, dtype);
    for (int64_t i = 0; i < n; i += 8) {
      __m256 v = _mm256_mul_ps(load8_n(elem(row, i, dtype), dtype, n - i), rv);
      if (dtype == 1) v = round_bf16(v);
      v = _mm256_mul_ps(v, load8_n(elem(w, i, dtype), dtype, n - i));
      store8_n(elem(out, i, dtype), v, dtype, n - i);
    }
  }
}

void silu_mul_rows(const void* gu, int64_t ldg, void* y, int64_t ldy, int64_t inter, int dtype, int64_t m_begin,
                   int64_t m_end) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t i = 0; i < inter; i += 8) {
      const int64_t n = inter - i;
      const __m256 g = load8_n(elem(gu, m * ldg + i, dtype), dtype, n);
      const __m256 u = load8_n(elem(gu, m * ldg + inter + i, dtype), dtype, n);
      __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      if (dtype == 1) s = round_bf16(s);
      store8_n(elem(y, m * ldy + i, dtype), _mm256_mul_ps(s, u), dtype, n);
    }
  }
}

void argmax_rows(const float* x, int64_t ldx, int64_t n, int64_t* out, int64_t m_begin, int64_t m_end) {
  const int64_t whole = n / 8 * 8;
  for (int64_t m = m_begin; m < m_end; ++m) {
    const float* row = x + m * ldx;
    // The largest value, and whether any is NaN (max_ps would pass one over).
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();
    for (int64_t i = 0; i < whole; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      best = _mm256_max_ps(best, v);
    }
    float top = hmax8(best);
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t i = whole; i < n; ++i) {
      has_nan = has_nan || row[i] != row[i];
      top = row[i] > top ? row[i] : top;
    }
    int64_t at = 0;
    if (has_nan) {
      while (!(row[at] != row[at])) ++at;
    } else {
      // Then the first lane equal to it (the row is in cache now).
      const __m256 b = _mm256_set1_ps(top);
      at = n;
      for (int64_t i = 0; i < whole && at == n; i += 8) {
        const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), b, _CMP_EQ_OQ));
        if (eq) at = i + __builtin_ctz(eq);
      }
      for (int64_t i = whole; i < n && at == n; ++i)
        if (row[i] == top) at = i;
    }
    out[m] = at;
  }
}

namespace {
// out = x * cos + roll(x, D/2) * signed_sin for one head (D a multiple of 32).
inline void rope_head(const void* x, const void* cs, void* out, int64_t D, int dtype) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; i += 8) {
    const int64_t j = i < half ? i + half : i - half;
    const __m256 xv = load8(elem(x, i, dtype), dtype);
    const __m256 rv = load8(elem(x, j, dtype), dtype);
    const __m256 c = load8(elem(cs, i, dtype), dtype);
    const __m256 s = load8(elem(cs, D + i, dtype), dtype);
    __m256 a = _mm256_mul_ps(xv, c), b = _mm256_mul_ps(rv, s);
    if (dtype == 1) {
      a = round_bf16(a);
      b = round_bf16(b);
    }
    store8(elem(out, i, dtype), _mm256_add_ps(a, b), dtype);
  }
}
}  // namespace

void rope_kv_rows(const RopeKVArgs& a, int64_t m_begin, int64_t m_end) {
  rope_kv_rows_with(a, m_begin, m_end, rope_head);
}

}  // namespace avx2
}  // namespace preheat
