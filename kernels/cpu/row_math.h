// Vector math of the row kernels: included by attention.cpp inside its anonymous namespace.
//
// bf16 <-> float32 conversion, a branch-free exp for non-positive arguments, dot products, the 16-key score
// and P x V register kernels of bf16 decode, and the online-softmax step of one row. AVX-512 / AVX-512-BF16
// intrinsics behind #if, plain loops for the vectorizer elsewhere (the same source builds on any x86-64).

#pragma once

constexpr int BLK = 32;     // keys per block (scores of one block stay in L1)
constexpr int QB = 64;      // queries per extend item
constexpr int SMALL_M = 8;  // up to this many query rows, scores are dot products; above, a transposed K block
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline void to_f32(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void to_f32(const uint16_t* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
// float16 pools (--kv-cache-dtype float16): K/V only, widened to float32 on read (F16C where the CPU has it).
inline float elem_f32(uint16_t h) { return bf16_to_f32(h); }  // a bf16 pool element
inline float elem_f32(at::Half h) { return static_cast<float>(h); }
inline void to_f32(const at::Half* src, float* dst, int n) {
  int i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void from_f32(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void from_f32(const float* src, uint16_t* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// exp(x) for x <= 0 (scores minus their running max), 0 below -87 (and for -inf). Cephes-style polynomial,
// relative error ~2e-7; branch-free so the loops calling it vectorize.
inline float exp_neg(float x) {
  float xc = std::max(x, -87.0f);
  float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = int32_t(n) + 127;
  uint32_t bits = uint32_t(e) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  return x < -87.0f ? 0.0f : p * s;
}

// dot(a, b) over n floats. AVX-512 where the build machine has it (one horizontal sum per dot), else the
// vectorizer's choice.
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

#if defined(__AVX512F__)
inline __m512 exp_neg16(__m512 x) {  // exp_neg on 16 lanes, same polynomial
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f),
                                                        _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), y);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_neg8(__m256 x) {  // exp_neg on 8 lanes (AVX2), same polynomial
  const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

// 8 elements of a float32 or float16 pool row as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#if defined(__F16C__)
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
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

// Float32 scores of one query row against up to 8 keys read in place: out[j] = dot(q, krow[j]) for j < n,
// d % 8 == 0 (q already scaled). The 8 accumulators stay in registers; one transposed reduction per 8 keys.
template <typename KV>
inline void scores8(const float* q, const KV* const* krow, int n, int d, float* out) {
  const KV* k[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) k[j] = krow[j < n ? j : 0];  // pad lanes read key 0 again; not stored
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int x = 0; x < d; x += 8) {
    const __m256 qv = _mm256_loadu_ps(q + x);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k[j] + x), acc[j]);
  }
  const __m256 r = reduce8(acc);
  if (n == 8) {
    _mm256_storeu_ps(out, r);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, r);
    for (int j = 0; j < n; ++j) out[j] = tmp[j];
  }
}
#endif

#if defined(__AVX512F__)
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

// One query row (q32: float32, unscaled; qb: the same row as raw bf16 when R is bf16) against up to 16 keys
// read straight from the pool: out[j] = scale * dot(q, K[slot[j]]), j < n. D % 32 == 0.
inline void scores16(const float* q32, const uint16_t* qb, const uint16_t* const* krow, int n, int d, float scale,
                     float* out) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  (void)q32;
  for (int j = 0; j < n; ++j)
    for (int x = 0; x < d; x += 32)
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(qb + x), (__m512bh)_mm512_loadu_si512(krow[j] + x));
#else
  (void)qb;
  for (int j = 0; j < n; ++j)
    for (int x = 0; x < d; x += 16) {
      const __m512 k = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(krow[j] + x))), 16));
      acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q32 + x), k, acc[j]);
    }
#endif
  const __m512 r = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1), r);
}

inline void scores16(const float* q32, const float*, const float* const* krow, int n, int d, float scale,
                     float* out) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int j = 0; j < n; ++j)
    for (int x = 0; x < d; x += 16)
      acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q32 + x), _mm512_loadu_ps(krow[j] + x), acc[j]);
  const __m512 r = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1), r);
}
#if defined(__AVX512BF16__)
// Fixed head size DD (a multiple of 32), bf16 pool: scores16 with q held in registers and the 16 keys unrolled,
// so the 16 accumulators stay in registers (the runtime-d loop above spills them). Keys past n repeat key
// n - 1; their lanes are not stored.
template <int DD>
inline void scores16_bf16(const uint16_t* qb, const uint16_t* const* krow, int n, float scale, float* out) {
  constexpr int NX = DD / 32;
  __m512bh qv[NX];
  for (int x = 0; x < NX; ++x) qv[x] = (__m512bh)_mm512_loadu_si512(qb + 32 * x);
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const uint16_t* kr = krow[j < n ? j : n - 1];
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int x = 0; x < NX; ++x) a = _mm512_dpbf16_ps(a, qv[x], (__m512bh)_mm512_loadu_si512(kr + 32 * x));
    acc[j] = a;
  }
  const __m512 r = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1), r);
}

// o[r] = o[r] * alpha[r] + sum_j p[r][j] * V[j] for `rows` <= RP query rows of one KV head: each bf16 value row
// (DD elements at vrow[j]) is widened once for all rows, and the RP x DD/16 accumulators stay in registers.
template <int DD, int RP>
inline void pv_rows(float* const* o, const float* alpha, const float* const* p, int rows, const uint16_t* const* vrow,
                    int nb) {
  constexpr int NV = DD / 16;
  __m512 acc[RP][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RP; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      acc[r][v] = r < rows ? _mm512_mul_ps(_mm512_loadu_ps(o[r] + 16 * v), _mm512_set1_ps(alpha[r]))
                           : _mm512_setzero_ps();
  for (int j = 0; j < nb; ++j) {
    __m512 vv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      vv[v] = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vrow[j] + 16 * v))), 16));
#pragma GCC unroll 8
    for (int r = 0; r < RP; ++r) {
      if (r >= rows) break;
      const __m512 pr = _mm512_set1_ps(p[r][j]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(pr, vv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RP; ++r)
    if (r < rows)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o[r] + 16 * v, acc[r][v]);
}
#endif
#endif

// Softmax step of one row over its n visible scores s[0, n): returns the new max, turns s into
// exp(s - new max) and adds their sum to *sum.
inline float softmax_block(float* s, int n, float old_max, float* sum) {
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(old_max);
  for (int j = 0; j < n; j += 16) {
    const __mmask16 k = j + 16 <= n ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + j));
  }
  const float mx = _mm512_reduce_max_ps(mv);
  const __m512 mxv = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __mmask16 k = j + 16 <= n ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    const __m512 p = _mm512_maskz_mov_ps(k, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mxv)));
    _mm512_mask_storeu_ps(s + j, k, p);
    acc = _mm512_add_ps(acc, p);
  }
  *sum += _mm512_reduce_add_ps(acc);
  return mx;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 mv = _mm256_set1_ps(old_max);
  int j = 0;
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  float mx = hmax8(mv);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 p = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
    _mm256_storeu_ps(s + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  float tail = 0.0f;
  for (; j < n; ++j) {
    s[j] = exp_neg(s[j] - mx);
    tail += s[j];
  }
  *sum += hsum8(acc) + tail;
  return mx;
#else
  float mx = old_max;
  for (int j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int j = 0; j < n; ++j) {
    const float p = exp_neg(s[j] - mx);
    s[j] = p;
    acc += p;
  }
  *sum += acc;
  return mx;
#endif
}
