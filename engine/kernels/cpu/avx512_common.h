// Included first by every *_avx512.cpp and by nothing else: it switches the rest of the
// translation unit to AVX-512 code generation. Everything defined here is `static`, so no
// AVX-512 copy of a function can be picked by the linker for code outside these files.
#pragma once
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "portable.h"

namespace preheat {
namespace {

// bf16 bits <-> float32 (16 lanes). Rounding to bf16 is round-to-nearest-even, as torch's.
inline __m512 bf16_to_f32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m256i f32_to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
// float32 rounded to bf16 and back: what a bf16 tensor op stores between two ops.
inline __m512 round_bf16(__m512 v) { return bf16_to_f32(f32_to_bf16(v)); }

inline __m512 load16(const void* p, int dtype) {
  if (dtype == 0) return _mm512_loadu_ps((const float*)p);
  return bf16_to_f32(_mm256_loadu_si256((const __m256i*)p));
}
inline __m512 load16_masked(const void* p, int dtype, __mmask16 m) {
  if (dtype == 0) return _mm512_maskz_loadu_ps(m, (const float*)p);
  return bf16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}
inline void store16(void* p, __m512 v, int dtype) {
  if (dtype == 0)
    _mm512_storeu_ps((float*)p, v);
  else
    _mm256_storeu_si256((__m256i*)p, f32_to_bf16(v));
}
inline void store16_masked(void* p, __m512 v, int dtype, __mmask16 m) {
  if (dtype == 0)
    _mm512_mask_storeu_ps((float*)p, m, v);
  else
    _mm256_mask_storeu_epi16(p, m, f32_to_bf16(v));
}
inline float load1(const void* p, int dtype) {
  if (dtype == 0) return *(const float*)p;
  uint32_t bits = (uint32_t)(*(const uint16_t*)p) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// exp(x) for x <= 88 (Cephes' single-precision polynomial, ~1 ulp); x below -87.3 gives ~0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// 32 cached values at p as 32 bfloat16 (KT: the cache's kv_dtype): the values themselves
// for a bfloat16 cache; an fp8 cache's bytes through float16 (e5m2 is float16's top byte;
// e4m3 placed so that it reads as value / 256, subnormals included) to bfloat16, exactly.
// The decode and extend attention kernels' reading of an fp8 cache as bfloat16.
template <int KT>
inline __m512i load32_bf16(const char* p) {
  if constexpr (KT == 0) {
    return _mm512_loadu_si512(p);
  } else {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
    __m512i h;
    if constexpr (KT == KV_E5M2) {
      h = _mm512_slli_epi16(b, 8);
    } else {
      h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(b, 8), 1), _mm512_set1_epi16((short)0xBFFF));
    }
    const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

}  // namespace
}  // namespace preheat
