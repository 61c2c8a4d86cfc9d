// The GEMM family: float32 linear layers on weights packed in column panels. Compiled once per ISA variant
// (kernels/cpu/isa.h), registered as radixgen::linear_panels by dispatch.cpp.
//
//   linear_panels(x [M, K] float32, panels [N / 16, K, 16] float32) -> y [M, N] = x @ W^T
//       panels[p, k, j] = W[16 p + j, k] (kernels.cpu.ops.pack_panels); N % 16 == 0.
//
// Why: MKL's float32 GEMM through inductor (mkl::_mkl_linear on its packed weights) reaches ~55-80 GFLOP/s at
// the decode shapes of a 2-core AVX2 EPYC (M = 8-32 rows), this kernel about twice that (bench/linear_cpu.py,
// bench/results/linear_cpu-zen3.md). The weights stream once per call, each 16-column panel [K, 16] read
// contiguously; a register tile of 6 rows x 16 columns (12 accumulators, 2 loads of the panel row and 1
// broadcast of x per k: 15 of the 16 ymm registers) runs over every block of rows while the panel is in L1/L2.
// AVX-512 variant: a tile of up to 12 rows x 2 panels (24 zmm accumulators, 2 loads of panel rows and 1
// broadcast of x per row and k). Threads split the panels. Each output element is one float32 dot product over k
// in order 0..K-1 (one fused multiply-add per k), whatever M, the tile or the thread count, so results are
// batch-invariant and the same bits in the AVX2 and AVX-512 variants.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "isa.h"
#include "vec_math.h"

namespace RADIXGEN_NS {
namespace {

constexpr int PANEL = 16;    // output columns per panel
constexpr int ROW_BLOCK = 96;  // rows of x per pass over a thread's panels (96 x K floats stay in L2)

#if defined(__AVX512F__)
// C[MR, 16 NP] = A[MR, K] x NP panels (panel j at b + j * pstride, row k at + 16 k), one zmm per (row, panel).
template <int MR, int NP>
inline void tile16(int K, const float* a, int64_t lda, const float* b, int64_t pstride, float* c, int64_t ldc) {
  __m512 acc[MR][NP];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int k = 0; k < K; ++k) {
    __m512 bv[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) bv[j] = _mm512_loadu_ps(b + j * pstride + k * PANEL);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + k]);
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(c + i * ldc + j * PANEL, acc[i][j]);
}

template <int NP>
inline void panel_rows_np(int M, int K, const float* x, const float* panel, float* y, int64_t ldy) {
  constexpr int MR = 12;
  const int64_t ps = int64_t(K) * PANEL;
  int m = 0;
  for (; m + MR <= M; m += MR) tile16<MR, NP>(K, x + m * int64_t(K), K, panel, ps, y + m * ldy, ldy);
  const float* xm = x + m * int64_t(K);
  float* ym = y + m * ldy;
  switch (M - m) {
#define RADIXGEN_TAIL(r) \
  case r: tile16<r, NP>(K, xm, K, panel, ps, ym, ldy); break;
    RADIXGEN_TAIL(11) RADIXGEN_TAIL(10) RADIXGEN_TAIL(9) RADIXGEN_TAIL(8) RADIXGEN_TAIL(7) RADIXGEN_TAIL(6)
    RADIXGEN_TAIL(5) RADIXGEN_TAIL(4) RADIXGEN_TAIL(3) RADIXGEN_TAIL(2) RADIXGEN_TAIL(1)
#undef RADIXGEN_TAIL
    default: break;
  }
}

// Rows [0, M) of x against panels [p0, p1) (each [K, 16]) -> their 16-column slices of y, two panels at a time.
inline void panels_rows(int M, int K, const float* x, const float* panels, int64_t p0, int64_t p1, float* y,
                        int64_t ldy) {
  int64_t p = p0;
  for (; p + 2 <= p1; p += 2) panel_rows_np<2>(M, K, x, panels + p * K * PANEL, y + p * PANEL, ldy);
  if (p < p1) panel_rows_np<1>(M, K, x, panels + p * K * PANEL, y + p * PANEL, ldy);
}
#elif defined(__AVX2__) && defined(__FMA__)
// C[MR, 8 NR] = A[MR, K] x B[K, 8 NR] (B rows ldb apart). Fully unrolled over (i, j) so the accumulators stay in
// registers (GCC spills a vector array indexed by loop counters it has not unrolled: measured 2x slower).
template <int MR, int NR>
inline void tile(int K, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  __m256 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int k = 0; k < K; ++k) {
    __m256 bv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) bv[j] = _mm256_loadu_ps(b + k * ldb + j * 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i * lda + k);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) _mm256_storeu_ps(c + i * ldc + j * 8, acc[i][j]);
}

// Rows [0, M) of x against one panel [K, 16] -> y[:, 0:16) of those rows.
inline void panel_rows(int M, int K, const float* x, const float* panel, float* y, int64_t ldy) {
  int m = 0;
  for (; m + 6 <= M; m += 6) tile<6, 2>(K, x + m * int64_t(K), K, panel, PANEL, y + m * ldy, ldy);
  const float* xm = x + m * int64_t(K);
  float* ym = y + m * ldy;
  switch (M - m) {
    case 5: tile<5, 2>(K, xm, K, panel, PANEL, ym, ldy); break;
    case 4: tile<4, 2>(K, xm, K, panel, PANEL, ym, ldy); break;
    case 3: tile<3, 2>(K, xm, K, panel, PANEL, ym, ldy); break;
    case 2: tile<2, 2>(K, xm, K, panel, PANEL, ym, ldy); break;
    case 1: tile<1, 2>(K, xm, K, panel, PANEL, ym, ldy); break;
    default: break;
  }
}
#else
inline void panel_rows(int M, int K, const float* x, const float* panel, float* y, int64_t ldy) {
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < PANEL; ++j) {
      float acc = 0.0f;
      for (int k = 0; k < K; ++k) acc += x[m * int64_t(K) + k] * panel[k * PANEL + j];
      y[m * ldy + j] = acc;
    }
}
#endif

#if !defined(__AVX512F__)
inline void panels_rows(int M, int K, const float* x, const float* panels, int64_t p0, int64_t p1, float* y,
                        int64_t ldy) {
  for (int64_t p = p0; p < p1; ++p) panel_rows(M, K, x, panels + p * K * PANEL, y + p * PANEL, ldy);
}
#endif

}  // namespace

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_panels: x must be float32 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.scalar_type() == at::kFloat &&
                  panels.is_contiguous(),
              "linear_panels: panels must be contiguous float32 [N / 16, K, 16]");
  TORCH_CHECK(panels.size(1) == x.size(1), "linear_panels: K of x (", x.size(1), ") != K of the panels (",
              panels.size(1), ")");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = panels.size(0), N = P * PANEL;
  auto y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
      const int rows = int(std::min<int64_t>(ROW_BLOCK, M - m0));
      panels_rows(rows, int(K), xp + m0 * K, wp, p0, p1, yp + m0 * N, N);
    }
  });
  return y;
}

bool panels_native() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

}  // namespace RADIXGEN_NS
