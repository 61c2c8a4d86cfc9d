// Row kernels of attention (kernels/cpu/attention_rows.h): the 8- and 16-key score kernels that read K rows in
// place, the bf16 P x V register kernel and the online-softmax step of one row. AVX-512 / AVX-512-BF16 / AVX2
// forms behind #if on the variant's macros (kernels/cpu/isa.h), plain loops for the vectorizer elsewhere.

#pragma once

#include <ATen/ATen.h>

#include "vec_math.h"

namespace RADIXGEN_NS {

constexpr int BLK = 32;     // keys per block (scores of one block stay in L1)
constexpr int QB = 64;      // queries per extend item
constexpr int SMALL_M = 8;  // up to this many query rows, scores are dot products; above, a transposed K block

#if defined(__AVX2__) && defined(__FMA__)
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
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8_f32(k[j] + x), acc[j]);
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
      const __m512 k = load16_bf16(krow[j] + x);
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
      vv[v] = load16_bf16(vrow[j] + 16 * v);
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
    const __m512 p = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mxv)));
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
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
    _mm256_storeu_ps(s + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  float tail = 0.0f;
  for (; j < n; ++j) {
    s[j] = exp_f(s[j] - mx);
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
    const float p = exp_f(s[j] - mx);
    s[j] = p;
    acc += p;
  }
  *sum += acc;
  return mx;
#endif
}

}  // namespace RADIXGEN_NS
