// Per-token dynamic int8 quantization of one activation row, shared by the W8A8 ops (w8a8_linear.cpp's fused
// kernel, w8a8_int_mm.cpp's oneDNN-core path). Compiled per ISA variant (kernels/cpu/isa.h): AVX-512 and AVX2
// passes in intrinsics, the rest plain loops; every step is exact or correctly rounded, so every variant rounds alike.
//
//   xs = x * inv_s (float32; inv_s may be null), a = max_k |xs|, sx = a / 127 (1 for a = 0; NaN for a row with a
//   NaN or inf), q = round-half-even(xs / sx) in -127..127, stored as C(q + OFF) (OFF 128 with C = uint8_t for
//   vpdpbusd's unsigned operand; OFF 0 for s8 x s8: C = int8_t, or uint8_t holding the s8 bytes for the AVX2
//   tile). A non-finite row stores q = 0 everywhere.
// Each step is the torch twin's (kernels/quant/w8a8.py quantize_rows), so the codes and scales are its bits.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "isa.h"
#include "vec_math.h"

namespace RADIXGEN_NS {

// round-half-even of |v| < 2^22 without a libm call (vectorizes; exact: the add and subtract are not folded)
inline float round_even(float v) {
  constexpr float MAGIC = 12582912.0f;  // 1.5 * 2^23
  return v >= 0.0f ? (v + MAGIC) - MAGIC : (v - MAGIC) + MAGIC;
}

// buf[k] = x[k] * inv_s[k] (or x[k]); *amax = max_k |buf[k]|; *probe = sum_k buf[k] * 0 (NaN iff some buf[k] is NaN
// or infinite). A max is exact in any order, so the lanes give the scalar loop's amax whenever probe is 0.
template <typename T>
void row_stats(const T* x, const float* inv_s, int64_t K, float* buf, float* amax, float* probe) {
  float mx = 0.0f, pr = 0.0f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 vmx = _mm512_setzero_ps(), vpr = _mm512_setzero_ps();
  const __m512 zero = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m512 v = load16_f32(x + k);
    if (inv_s) v = _mm512_mul_ps(v, _mm512_loadu_ps(inv_s + k));
    _mm512_storeu_ps(buf + k, v);
    vmx = _mm512_max_ps(vmx, _mm512_abs_ps(v));
    vpr = _mm512_add_ps(vpr, _mm512_mul_ps(v, zero));
  }
  mx = _mm512_reduce_max_ps(vmx);
  pr = _mm512_reduce_add_ps(vpr);
#elif defined(__AVX2__)
  __m256 vmx = _mm256_setzero_ps(), vpr = _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps(), abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (; k + 8 <= K; k += 8) {
    __m256 v = load8_f32(x + k);
    if (inv_s) v = _mm256_mul_ps(v, _mm256_loadu_ps(inv_s + k));
    _mm256_storeu_ps(buf + k, v);
    vmx = _mm256_max_ps(vmx, _mm256_and_ps(v, abs_mask));
    vpr = _mm256_add_ps(vpr, _mm256_mul_ps(v, zero));
  }
  mx = hmax8(vmx);
  pr = hsum8(vpr);
#endif
  for (; k < K; ++k) {
    const float v = inv_s ? to_float(x[k]) * inv_s[k] : to_float(x[k]);
    buf[k] = v;
    mx = std::max(mx, std::fabs(v));
    pr += v * 0.0f;
  }
  *amax = mx;
  *probe = pr;
}

// x [K] (float32 or bf16 bits) -> a [K] codes, *sx; buf: K floats of scratch.
template <typename C, int OFF, typename T>
void quantize_row(const T* x, const float* inv_s, int64_t K, C* a, float* sx, float* buf) {
  float amax, probe;
  row_stats(x, inv_s, K, buf, &amax, &probe);
  if (!(probe == 0.0f) || !std::isfinite(amax)) {  // a NaN or inf in the row: codes 0, scale NaN -> NaN outputs
    std::memset(a, OFF, K * sizeof(C));
    *sx = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
  int64_t k = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // 8 codes a step: the same division, cvtps rounds half to even (the default rounding mode), and the packs
  // cannot saturate (q + OFF lies in 1..255 for OFF 128, unsigned pack; in -127..127 for OFF 0, signed pack)
  const __m256 vs = _mm256_set1_ps(s);
  const __m256i off = _mm256_set1_epi32(OFF);
  for (; k + 8 <= K; k += 8) {
    const __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(buf + k), vs)), off);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    const __m128i b = OFF ? _mm_packus_epi16(w, w) : _mm_packs_epi16(w, w);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(a + k), b);
  }
#endif
#pragma omp simd
  for (int64_t i = k; i < K; ++i) a[i] = static_cast<C>(static_cast<int32_t>(round_even(buf[i] / s)) + OFF);
  *sx = s;
}

// The float input channels' term for R rows x nc (<= 64) output channels: y[r, c] = fma(xv[r, f], wf[f, c],
// y[r, c]) for f = 0..F-1 in order (the module contract of both W8A8 ops); y rows ldy floats apart, xv [R, F],
// wf rows N floats apart. AVX-512 keeps the R x 64 block in registers across f (one weight row load serves R
// rows); elsewhere plain loops. Each element sees the same fused multiply-adds in the same order either way.
template <int R>
inline void fma_channels(float* y, int64_t ldy, const float* xv, int64_t nf, const float* wf, int64_t N, int64_t nc) {
#if defined(__AVX512F__)
  __mmask16 mask[4];
  for (int v = 0; v < 4; ++v) {
    const int64_t left = std::clamp<int64_t>(nc - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>((1u << left) - 1u);
  }
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_maskz_loadu_ps(mask[v], y + r * ldy + 16 * v);
  for (int64_t f = 0; f < nf; ++f) {
    __m512 w[4];
    for (int v = 0; v < 4; ++v) w[v] = _mm512_maskz_loadu_ps(mask[v], wf + f * N + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(xv[r * nf + f]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(b, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask[v], acc[r][v]);
#else
  for (int64_t f = 0; f < nf; ++f)
    for (int r = 0; r < R; ++r) {
      const float b = xv[r * nf + f];
      float* yr = y + r * ldy;
      const float* w = wf + f * N;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) yr[c] = std::fma(b, w[c], yr[c]);
    }
#endif
}

// fma_channels for a run-time R in 1..4.
inline void fma_channels_rows(int R, float* y, int64_t ldy, const float* xv, int64_t nf, const float* wf, int64_t N,
                              int64_t nc) {
  switch (R) {
    case 4: fma_channels<4>(y, ldy, xv, nf, wf, N, nc); break;
    case 3: fma_channels<3>(y, ldy, xv, nf, wf, N, nc); break;
    case 2: fma_channels<2>(y, ldy, xv, nf, wf, N, nc); break;
    default: fma_channels<1>(y, ldy, xv, nf, wf, N, nc); break;
  }
}

// The optional operands of a W8A8 call, checked against K and N: smoothing inv_s [K] float32, the float input
// channels fidx [F] int64 (each in [0, K)) with their weight rows wf [F, N] float32; all contiguous.
struct Extras {
  const float* inv_s = nullptr;
  const int64_t* fidx = nullptr;
  const float* wf = nullptr;
  int64_t nf = 0;
};

inline Extras check_extras(const char* op, int64_t K, int64_t N, const std::optional<at::Tensor>& inv_s,
                           const std::optional<at::Tensor>& fidx, const std::optional<at::Tensor>& wf) {
  Extras ex;
  if (inv_s.has_value()) {
    TORCH_CHECK(inv_s->dim() == 1 && inv_s->scalar_type() == at::kFloat && inv_s->is_contiguous() &&
                    inv_s->size(0) == K,
                op, ": inv_s must be contiguous float32 [K]");
    ex.inv_s = inv_s->data_ptr<float>();
  }
  TORCH_CHECK(fidx.has_value() == wf.has_value(), op, ": fidx and wf come together");
  if (fidx.has_value()) {
    ex.nf = fidx->numel();
    TORCH_CHECK(fidx->dim() == 1 && fidx->scalar_type() == at::kLong && fidx->is_contiguous(), op,
                ": fidx must be contiguous int64 [F]");
    TORCH_CHECK(wf->dim() == 2 && wf->scalar_type() == at::kFloat && wf->is_contiguous() && wf->size(0) == ex.nf &&
                    wf->size(1) == N,
                op, ": wf must be contiguous float32 [F, N]");
    ex.fidx = fidx->data_ptr<int64_t>();
    for (int64_t f = 0; f < ex.nf; ++f)
      TORCH_CHECK(ex.fidx[f] >= 0 && ex.fidx[f] < K, op, ": fidx entry ", ex.fidx[f], " out of [0, ", K, ")");
    ex.wf = wf->data_ptr<float>();
  }
  return ex;
}

}  // namespace RADIXGEN_NS
