// Per-token dynamic int8 quantization of one activation row, shared by the W8A8 ops (w8a8_linear.cpp's fused
// kernel, w8a8_int_mm.cpp's oneDNN-core path). Compiled per ISA variant (kernels/cpu/isa.h); the loops are plain
// code the vectorizer widens, so every variant rounds alike.
//
//   xs = x * inv_s (float32; inv_s may be null), a = max_k |xs|, sx = a / 127 (1 for a = 0; NaN for a row with a
//   NaN or inf), q = round-half-even(xs / sx) in -127..127, stored as C(q + OFF) (OFF 128 with C = uint8_t for
//   vpdpbusd's unsigned operand, OFF 0 with C = int8_t for s8 x s8). A non-finite row stores q = 0 everywhere.
// Each step is the torch twin's (kernels/quant/w8a8.py quantize_rows), so the codes and scales are its bits.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>

#include "isa.h"
#include "vec_math.h"

namespace RADIXGEN_NS {

// round-half-even of |v| < 2^22 without a libm call (vectorizes; exact: the add and subtract are not folded)
inline float round_even(float v) {
  constexpr float MAGIC = 12582912.0f;  // 1.5 * 2^23
  return v >= 0.0f ? (v + MAGIC) - MAGIC : (v - MAGIC) + MAGIC;
}

// x [K] (float32 or bf16 bits) -> a [K] codes, *sx; buf: K floats of scratch.
template <typename C, int OFF, typename T>
void quantize_row(const T* x, const float* inv_s, int64_t K, C* a, float* sx, float* buf) {
  float amax = 0.0f, probe = 0.0f;  // probe: NaN iff some xs is NaN or infinite
#pragma omp simd reduction(max : amax) reduction(+ : probe)
  for (int64_t k = 0; k < K; ++k) {
    const float v = inv_s ? to_float(x[k]) * inv_s[k] : to_float(x[k]);
    buf[k] = v;
    amax = std::max(amax, std::fabs(v));
    probe += v * 0.0f;
  }
  if (!(probe == 0.0f) || !std::isfinite(amax)) {  // a NaN or inf in the row: codes 0, scale NaN -> NaN outputs
    std::memset(a, OFF, K * sizeof(C));
    *sx = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) a[k] = static_cast<C>(static_cast<int32_t>(round_even(buf[k] / s)) + OFF);
  *sx = s;
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
