// Included first by every *_avx2.cpp and by nothing else: it switches the rest of the
// translation unit to AVX2 + FMA + F16C code generation. Everything defined here is
// `static` (an unnamed namespace), so no AVX2 copy of a function can be picked by the
// linker for code outside these files. The helpers mirror avx512_common.h's at 8 lanes;
// what AVX-512 does with a mask register (tails, masked loads and stores) goes through an
// 8-float stack buffer here.
#pragma once
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "portable.h"

namespace preheat {
namespace {

// bf16 bits <-> float32 (8 lanes). Rounding to bf16 is round-to-nearest-even, as torch's
// (and vcvtneps2bf16's); a NaN stays a (quiet) NaN.
inline __m256 bf16_to_f32(__m128i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m128i f32_to_bf16(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(x, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  // 8 x u32 (each <= 0xFFFF) -> 8 x u16: pack within 128-bit lanes, then gather qwords 0, 2.
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(p);
}
// float32 rounded to bf16 and back: what a bf16 tensor op stores between two ops.
inline __m256 round_bf16(__m256 v) { return bf16_to_f32(f32_to_bf16(v)); }

inline __m256 load8(const void* p, int dtype) {
  if (dtype == 0) return _mm256_loadu_ps((const float*)p);
  return bf16_to_f32(_mm_loadu_si128((const __m128i*)p));
}
inline void store8(void* p, __m256 v, int dtype) {
  if (dtype == 0)
    _mm256_storeu_ps((float*)p, v);
  else
    _mm_storeu_si128((__m128i*)p, f32_to_bf16(v));
}
// The first n (< 8 allowed) elements; the other lanes read as 0 / are left untouched.
inline __m256 load8_n(const void* p, int dtype, int64_t n) {
  if (n >= 8) return load8(p, dtype);
  alignas(32) uint8_t buf[32] = {0};
  memcpy(buf, p, n * (dtype == 0 ? 4 : 2));
  return load8(buf, dtype);
}
inline void store8_n(void* p, __m256 v, int dtype, int64_t n) {
  if (n >= 8) return store8(p, v, dtype);
  alignas(32) uint8_t buf[32];
  store8(buf, v, dtype);
  memcpy(p, buf, n * (dtype == 0 ? 4 : 2));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 8 fp8 values to float32 (see load16_fp8 in attention_avx512.cpp: e4m3 reads as value / 256);
// the decode and extend attention kernels' reading of an fp8 cache.
inline __m256 load8_fp8(const void* p, int kt) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  if (kt == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
  // As load16_fp8: the byte to the top, one arithmetic shift down, bit 14 cleared.
  return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(b, 8), 1), _mm_set1_epi16((short)0xBFFF)));
}

// 8 cached values as float32: a cache of the queries' dtype DT, or fp8 (KT).
template <int DT, int KT>
inline __m256 load_kv8(const char* p) {
  return KT == KV_SAME ? load8(p, DT) : load8_fp8(p, KT);
}

// exp(x) for x <= 88 (Cephes' single-precision polynomial, ~1 ulp, as exp16 in
// avx512_common.h); x below -87.3 gives ~0. 2^n is built in the exponent bits (n >= -126).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // p in [0.5, 2): multiply by 2^n in two halves so n = 128 (x near 88.7) cannot overflow the exponent.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h1 = _mm256_srai_epi32(ni, 1), h2 = _mm256_sub_epi32(ni, h1);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h1, _mm256_set1_epi32(127)), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h2, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

}  // namespace
}  // namespace preheat
