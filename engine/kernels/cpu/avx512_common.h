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


// bfloat16 bits of M * 2^E (0 <= M < 16), exactly (M has at most 4 significant bits).
constexpr uint16_t bf16_bits(int M, int E) {
  if (M == 0) return 0;
  int top = 3;
  while (!(M >> top)) --top;
  return (uint16_t)(((E + top + 127) << 7) | ((M << (7 - top)) & 0x7F));
}
// bfloat16 bits of each fp8 magnitude code 0..127 as the attention kernels read it: e4m3 as
// value / 256 (as load32_bf16 and load16_fp8 read it), e5m2 as its value (inf and NaN kept).
struct Fp8Table {
  uint8_t lo[128], hi[128];
};
constexpr Fp8Table fp8_table(int kt) {
  Fp8Table t{};
  for (int m = 0; m < 128; ++m) {
    uint16_t b = 0;
    if (kt == KV_E5M2) {
      const int e = m >> 2, f = m & 3;
      b = e == 31 ? (f == 0 ? 0x7F80 : 0x7FC0) : e == 0 ? bf16_bits(f, -16) : bf16_bits(4 + f, e - 17);
    } else {
      const int e = m >> 3, f = m & 7;
      b = m == 0x7F ? 0x7FC0 : e == 0 ? bf16_bits(f, -9 - 8) : bf16_bits(8 + f, e - 10 - 8);
    }
    t.lo[m] = (uint8_t)(b & 0xFF);
    t.hi[m] = (uint8_t)(b >> 8);
  }
  return t;
}
constexpr Fp8Table FP8_E4M3_TABLE = fp8_table(1), FP8_E5M2_TABLE = fp8_table(KV_E5M2);

// 64 fp8 values at p widened to 64 bfloat16 at out (the same bits as load32_bf16), by
// looking each byte's magnitude up in a 128-entry table per bfloat16 byte (vpermi2b: the
// index's bit 6 picks the half, bit 7, the sign, is ignored) and putting the sign back:
// the bytes go in an order (`spread`) that the byte unpacks then interleave back into
// place. 7 instructions per 64 values where load32_bf16 takes 16. AVX-512 VBMI only.
template <int KT>
__attribute__((target("avx512vbmi"))) inline void widen64_vbmi(const char* p, uint16_t* out) {
  const Fp8Table& t = KT == KV_E5M2 ? FP8_E5M2_TABLE : FP8_E4M3_TABLE;
  // spread[16L + j] = 8L + j, spread[16L + 8 + j] = 32 + 8L + j: unpacklo then yields values
  // 0-31 in order, unpackhi 32-63.
  alignas(64) static constexpr uint8_t spread[64] = {
      0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39, 8,  9,  10, 11, 12, 13,
      14, 15, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51,
      52, 53, 54, 55, 24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
  const __m512i x = _mm512_permutexvar_epi8(_mm512_load_si512(spread), _mm512_loadu_si512(p));
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(t.lo), x, _mm512_loadu_si512(t.lo + 64));
  __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(t.hi), x, _mm512_loadu_si512(t.hi + 64));
  hi = _mm512_ternarylogic_epi32(hi, x, _mm512_set1_epi8((char)0x80), 0xF8);  // hi | (x & 0x80)
  _mm512_storeu_si512(out, _mm512_unpacklo_epi8(lo, hi));
  _mm512_storeu_si512(out + 32, _mm512_unpackhi_epi8(lo, hi));
}

// n fp8 values at p (n a multiple of 32) widened to bfloat16 at out, exactly.
template <int KT>
inline void widen_fp8_bf16(const char* p, int64_t n, uint16_t* out) {
  int64_t i = 0;
  if (fp8_vbmi_on)
    for (; i + 64 <= n; i += 64) widen64_vbmi<KT>(p + i, out + i);
  for (; i < n; i += 32) _mm512_storeu_si512(out + i, load32_bf16<KT>(p + i));
}
}  // namespace
}  // namespace preheat
