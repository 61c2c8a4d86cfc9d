// The W8A8 int8 linear on oneDNN's int8 GEMM core: the per-token quantization (w8a8_quant.h) and the
// dequantization epilogue are native passes, the int8 x int8 -> int32 product is at::_int_mm (oneDNN: AVX512-VNNI,
// AMX-INT8, AVX-VNNI or AVX2, chosen at run time). On an AVX-512 VNNI CPU the bare core is up to ~1.4x the fused
// register-tile kernel (w8a8_linear.cpp) at hundreds of rows, but the separate epilogue pass (and the float
// channels' pass) gives that back (bench/results/int8_linear.md), so kernels/quant/w8a8.py runs it only where a
// weight's int_mm_rows is set, or under set_kernel("int_mm"). Compiled once per ISA variant (kernels/cpu/isa.h),
// registered as radixgen::w8a8_int_mm by dispatch.cpp.
//
//   w8a8_int_mm(x [M, K] float32 | bfloat16, wt [K, N] int8 (any strides at::_int_mm takes: the [K, N] codes or a
//               transposed view of [N, K] codes), sw [N] float32, inv_s [K] float32?, fidx [F] int64?,
//               wf [F, N] float32?) -> y [M, N], x's dtype
//
// Arithmetic per row m, step for step w8a8_linear's (so the two ops, and the torch twin without float channels,
// give the same bits): q, sx from w8a8_quant.h (s8 codes, no offset); acc = q @ wt exact in int32;
// y = (float(acc) * sx) * sw[n], then y = fma(x[m, fidx[f]], wf[f, n], y) for f = 0..F-1 in order; a non-finite
// row has codes 0 and sx NaN, so NaN outputs. Rows are independent and the int32 sums exact whatever blocking
// oneDNN picks, so a row's output is the same in any batch.
//
// Memory: q int8 [M, K]; acc int32 [M, N], which a float32 output reuses in place (y is acc's storage).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "vec_math.h"
#include "w8a8_quant.h"

namespace RADIXGEN_NS {
namespace {

// acc [M, N] int32 -> float32 in place (the module doc's order), then out [M, N] of T (out may alias acc for
// float). x: the call's input rows (T's storage, row stride ldx) for the float channels.
template <typename T>
void epilogue(int32_t* acc, const float* sx, const float* sw, const T* x, int64_t ldx, const Extras& ex, int64_t M,
              int64_t N, T* out) {
  float* y = reinterpret_cast<float*>(acc);  // same size, element by element in place
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t* a = acc + m * N;
      float* yf = y + m * N;
      const float s = sx[m];
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) yf[n] = static_cast<float>(a[n]) * s * sw[n];
    }
    if (ex.nf) {  // float channels in (64 rows x 64 channels) blocks, 4-row register blocks inner (wf's chunk stays
                  // in cache across the rows, as in the fused op)
      std::vector<float> xv((m1 - m0) * ex.nf);
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t f = 0; f < ex.nf; ++f) xv[(m - m0) * ex.nf + f] = to_float(x[m * ldx + ex.fidx[f]]);
      for (int64_t mb = m0; mb < m1; mb += 64)
        for (int64_t n0 = 0; n0 < N; n0 += 64)
          for (int64_t m = mb; m < std::min(m1, mb + 64); m += 4)
            fma_channels_rows(static_cast<int>(std::min<int64_t>(4, std::min(m1, mb + 64) - m)), y + m * N + n0, N,
                              xv.data() + (m - m0) * ex.nf, ex.nf, ex.wf + n0, N, std::min<int64_t>(64, N - n0));
    }
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t m = m0; m < m1; ++m) {
        const float* yf = y + m * N;
        T* o = out + m * N;
#pragma omp simd
        for (int64_t n = 0; n < N; ++n) o[n] = from_float<T>(yf[n]);
      }
    }
  });
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& wt, const float* sw, const Extras& ex, at::ScalarType dtype) {
  const int64_t M = x.size(0), K = x.size(1), N = wt.size(1), ldx = x.stride(0);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  std::vector<float> sx(M);
  const T* xp = static_cast<const T*>(x.data_ptr());
  int8_t* qp = q.data_ptr<int8_t>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(K);
    for (int64_t m = m0; m < m1; ++m)
      quantize_row<int8_t, 0>(xp + m * ldx, ex.inv_s, K, qp + m * K, &sx[m], buf.data());
  });
  auto acc = at::_int_mm(q, wt);
  TORCH_CHECK(acc.is_contiguous() && acc.size(0) == M && acc.size(1) == N, "w8a8_int_mm: unexpected _int_mm result");
  int32_t* ap = acc.data_ptr<int32_t>();
  if constexpr (std::is_same_v<T, float>) {
    epilogue<float>(ap, sx.data(), sw, xp, ldx, ex, M, N, nullptr);
    return acc.view(at::kFloat);
  } else {
    auto y = at::empty({M, N}, x.options().dtype(dtype));
    epilogue<T>(ap, sx.data(), sw, xp, ldx, ex, M, N, reinterpret_cast<T*>(y.data_ptr()));
    return y;
  }
}

}  // namespace

at::Tensor w8a8_int_mm(const at::Tensor& x, const at::Tensor& wt, const at::Tensor& sw,
                       const std::optional<at::Tensor>& inv_s, const std::optional<at::Tensor>& fidx,
                       const std::optional<at::Tensor>& wf) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "w8a8_int_mm: x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(sw.dim() == 1 && sw.scalar_type() == at::kFloat && sw.is_contiguous(),
              "w8a8_int_mm: sw must be contiguous float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = sw.size(0);
  TORCH_CHECK(wt.dim() == 2 && wt.scalar_type() == at::kChar && wt.size(0) == K && wt.size(1) == N,
              "w8a8_int_mm: wt must be int8 [K, N] = [", K, ", ", N, "] (x's K, sw's N), got ", wt.scalar_type(), " ",
              wt.sizes());
  const Extras ex = check_extras("w8a8_int_mm", K, N, inv_s, fidx, wf);
  auto xc = x.stride(1) == 1 ? x : x.contiguous();
  if (M == 0 || N == 0) return at::empty({M, N}, x.options());
  TORCH_CHECK(K > 0, "w8a8_int_mm: K must be positive");
  if (x.scalar_type() == at::kFloat) return run<float>(xc, wt, sw.data_ptr<float>(), ex, at::kFloat);
  return run<uint16_t>(xc, wt, sw.data_ptr<float>(), ex, at::kBFloat16);
}

}  // namespace RADIXGEN_NS
