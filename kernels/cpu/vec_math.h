// Vector math shared by every native CPU op, written once: bf16 <-> float32 conversion, float16 widening, one
// accurate exp polynomial (scalar, 8 and 16 lanes) and a short 2^t for weights rounded to bf16 (16 lanes),
// horizontal sums / maxima, dot products. Compiled per ISA variant
// (kernels/cpu/isa.h): the AVX-512 / AVX2 forms are behind #if on the variant's own macros, the scalar forms are
// plain code the vectorizer widens, so every variant (the portable twin included) has every helper.

#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "isa.h"

namespace RADIXGEN_NS {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// bfloat16 data is handled as its raw uint16_t bits (c10::BFloat16's own conversions carry a branch per element
// and its struct loads defeat gcc's vectorizer): bf16 is the high half of a float32.
inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept quiet, as torch does; a select rather than a branch, so loops vectorize.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (f != f) ? uint16_t(0x7fc0) : uint16_t(rounded);
}

// One element of a float32, bf16 (raw bits) or float16 tensor as float32, and back.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t h) { return bf16_to_f32(h); }
inline float to_float(at::Half h) { return static_cast<float>(h); }
template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline uint16_t from_float<uint16_t>(float f) { return f32_to_bf16(f); }

// Rows of n elements to / from float32 (float16: F16C where the variant has it).
inline void to_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void to_f32(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
inline void to_f32(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void from_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void from_f32(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// exp(x) for every float32 x: 0 below -87 (and for -inf), exp(88) above 88; NaN gives NaN here, 0 in exp8/exp16. x = n ln2 + r with n the
// nearest integer (the 1.5 * 2^23 rounding trick: std::nearbyint is a libm call that blocks vectorization; exact
// for |x log2 e| < 2^22, and without -ffast-math the add and subtract are not folded), |r| <= ln2 / 2 (ln2 split
// in two for an exact reduction), exp(r) by the Cephes degree-7 polynomial, 2^n by bits: relative error ~2e-7.
// Branch-free, so the loops calling it vectorize. exp8 / exp16 are the same steps on 8 / 16 lanes.
constexpr float EXP_LO = -87.0f, EXP_HI = 88.0f, LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_P0 = 1.9875691500e-4f, EXP_P1 = 1.3981999507e-3f, EXP_P2 = 8.3334519073e-3f,
                EXP_P3 = 4.1665795894e-2f, EXP_P4 = 1.6666665459e-1f, EXP_P5 = 5.0000001201e-1f;

inline float exp_f(float x) {
  const float xc = x < EXP_LO ? EXP_LO : (x > EXP_HI ? EXP_HI : x);  // (std::fmin/fmax's NaN rules block simd)
  constexpr float kRound = 12582912.f;
  const float n = (xc * LOG2E + kRound) - kRound;
  float r = xc - n * LN2_HI;
  r = r - n * LN2_LO;
  float p = EXP_P0;
  p = p * r + EXP_P1;
  p = p * r + EXP_P2;
  p = p * r + EXP_P3;
  p = p * r + EXP_P4;
  p = p * r + EXP_P5;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  return x < EXP_LO ? 0.0f : p * s;
}

// dot(a, b) over n floats (one horizontal sum per dot on AVX-512, else the vectorizer's choice).
inline float dot(const float* a, const float* b, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int x = 0; x < n; x += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + x), _mm512_loadu_ps(b + x), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int x = 0; x < n; ++x) acc += a[x] * b[x];
  return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_P0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ));  // (x < -87, -inf, NaN: 0)
}

inline __m256 load8_bf16(const uint16_t* p) {  // 8 bf16 -> float32 (exact: the bits shifted into the high half)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 consecutive elements (float32, bf16 bits or float16) as float32 lanes.
inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f32(const uint16_t* p) { return load8_bf16(p); }
#if defined(__F16C__)
inline __m256 load8_f32(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline __m256 tail_mask8(int r) {  // all-ones in lanes [0, r), zeros elsewhere (r <= 0: none, r >= 8: all)
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(r), lanes));
}

// Horizontal sums of 8 vectors at once: lane i of the result is the sum of v[i]'s 8 lanes.
inline __m256 reduce8(const __m256* v) {
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]: after two levels the low 128 bits
  // hold v0..v3 summed over lanes 0-3 (b0) or v4..v7 (b1), the high 128 bits the same over lanes 4-7.
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_P0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ), y);
}

// 16 bf16 values (raw bits) as float32 lanes: a plain load, or lanes [0, n) of a masked one (zeros past n).
inline __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16_bf16(const uint16_t* p) {
  return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#if defined(__AVX512BW__)
inline __m512 load16_bf16(const uint16_t* p, __mmask16 k) { return bf16x16_to_f32(_mm256_maskz_loadu_epi16(k, p)); }
#endif

// 16 consecutive elements (float32, bf16 bits or float16) as float32 lanes.
inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_f32(const uint16_t* p) { return load16_bf16(p); }
inline __m512 load16_f32(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 2^t on 16 lanes for softmax weights that are rounded to bf16 next (8 significant bits): t = n + f, n the
// nearest integer, 2^f on |f| <= 1/2 by a degree-4 polynomial fitted for relative error (<= 3e-6 in float32),
// 2^n by vscalefps. t is clamped to [-160, 128] first (NaN passes: min/max return their second operand), so
// -inf and t below -150 give 0, +inf and t >= 128 give inf, NaN gives NaN. Not for float32 outputs: exp16 is the
// accurate one.
constexpr float EXP2_C1 = 0.693124175f, EXP2_C2 = 0.240240991f, EXP2_C3 = 0.0559064299f, EXP2_C4 = 0.00958285294f;

inline __m512 exp2_bf16w16(__m512 t) {
  t = _mm512_min_ps(_mm512_set1_ps(128.0f), _mm512_max_ps(_mm512_set1_ps(-160.0f), t));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(EXP2_C4), f, _mm512_set1_ps(EXP2_C3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Horizontal sums of 16 vectors at once: lane i of the result is the sum of v[i]'s 16 lanes.
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], w[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v[4i..4i+3]
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int EVEN = _MM_SHUFFLE(2, 0, 2, 0), ODD = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], EVEN), _mm512_shuffle_f32x4(w[0], w[1], ODD));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], EVEN), _mm512_shuffle_f32x4(w[2], w[3], ODD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, EVEN), _mm512_shuffle_f32x4(x0, x1, ODD));
}

inline __mmask16 head_mask16(int n) {  // lanes [0, n) of 16 (n >= 16: all)
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n > 0 ? n : 0)) - 1);
}
#endif

}  // namespace RADIXGEN_NS
