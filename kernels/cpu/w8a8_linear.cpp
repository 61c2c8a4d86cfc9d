// The W8A8 int8 linear in one call: per-token dynamic int8 activations x per-output-channel int8 weights, int32
// accumulation, dequantization and the float input channels fused. Compiled once per ISA variant
// (kernels/cpu/isa.h), registered as radixgen::w8a8_linear by dispatch.cpp; kernels/quant/w8a8.py packs the
// weights (pack_vnni) and holds the torch twin of the same arithmetic (w8a8_mm).
//
//   w8a8_linear(x [M, K] float32 | bfloat16, wp [T, K4, 16, 4] int8, colsum [16 T] int32, sw [N] float32,
//               inv_s [K] float32?, fidx [F] int64?, wf [F, N] float32?) -> y [M, N], x's dtype
//       T = ceil(N / 16), K4 = ceil(K / 4); wp[t, g, j, i] = W8[16 t + j, 4 g + i] (int8 codes, zero past N or K);
//       colsum[n] = sum_k W8[n, k]; W[n, k] = W8[n, k] * sw[n] (divided by inv_s[k] where inv_s is given).
//
// Arithmetic, per row m (each step the same as the twin's, so both give the same bits without float channels):
//   xs = x[m] * inv_s (float32), a = max_k |xs|, sx = a / 127 (1 for a = 0; NaN for a non-finite row),
//   q = round-half-even(xs / sx) in -127..127, stored as u8 q + 128 (s8 q on AVX2; padding past K: q = 0);
//   acc[n] = sum_k (q_k + 128) W8[n, k] - 128 colsum[n] = sum_k q_k W8[n, k], exact in int32;
//   y = (float(acc) * sx) * sw[n], then y = fma(x[m, fidx[f]], wf[f, n], y) for f = 0..F-1 in order.
// An output element depends on its own row of x only, in an order fixed by K and F: rows are batch-invariant, and
// every variant (AVX-512 VNNI, AVX2, portable) gives the same bits (the int32 sums are exact).
//
// AVX-512 VNNI: the u8 x s8 product of one k-group of 4 for 16 output channels is one vpdpbusd (the weight tile
// row, 64 bytes, times the activation's 4 bytes broadcast); a register tile of 4 rows x 4 tiles (16 zmm
// accumulators, 4 weight loads and 4 broadcasts per k-group) runs the whole K. AVX2 (and AVX-512 without VNNI):
// |w| times sign(w) * q through vpmaddubsw + vpmaddwd (no int16 saturation: |q|, |w| <= 127), 4 rows x 16 channels
// per tile (|w| computed once a k-group for the 4 rows). Portable: plain int32 loops. Work splits into (64 output
// channels) x (64 rows) blocks, the rows inner, so each thread reuses a weight block (K x 64 bytes) from cache
// across its rows; at::parallel_for over blocks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "isa.h"
#include "vec_math.h"
#include "w8a8_quant.h"

namespace RADIXGEN_NS {
namespace {

constexpr int TILE = 16;     // output channels per weight tile
constexpr int KG = 4;        // k per group (one vpdpbusd lane)
constexpr int NT_MAX = 4;    // tiles per block of work (64 channels)
constexpr int MR_MAX = 4;    // rows per register tile
constexpr int64_t MC = 64;   // rows per block of work
// The register tile this variant compiles (below): vpdpbusd, else AVX2's vpmaddubsw, else the portable loop.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RADIXGEN_W8A8_VNNI 1
#elif defined(__AVX2__)
#define RADIXGEN_W8A8_AVX2 1
#endif
// The activation codes' offset: u8 q + 128 for vpdpbusd's unsigned operand (and the portable loop, which subtracts
// 128 colsum like it); s8 q for the AVX2 tile, which multiplies signed codes exactly.
#if defined(RADIXGEN_W8A8_AVX2)
constexpr int A_OFF = 0;
#else
constexpr int A_OFF = 128;
#endif

// Activations of one call: codes [M, K4 * 4] (q + A_OFF as bytes; padding past K: A_OFF, i.e. q = 0), scales sx [M],
// the float channels' raw values [M, F].
struct Rows {
  std::vector<uint8_t> a;
  std::vector<float> sx, xf;
  int64_t lda = 0, nf = 0;
};

template <typename T>
Rows quantize(const at::Tensor& x, const float* inv_s, const int64_t* fidx, int64_t nf) {
  const int64_t M = x.size(0), K = x.size(1), K4 = (K + KG - 1) / KG, ldx = x.stride(0);
  Rows r{std::vector<uint8_t>(M * K4 * KG, uint8_t{A_OFF}), std::vector<float>(M), std::vector<float>(M * nf),
         K4 * KG, nf};
  const T* xp = static_cast<const T*>(x.data_ptr());
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(K);
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row<uint8_t, A_OFF>(xp + m * ldx, inv_s, K, r.a.data() + m * r.lda, r.sx.data() + m, buf.data());
      for (int64_t f = 0; f < nf; ++f) r.xf[m * nf + f] = to_float(xp[m * ldx + fidx[f]]);
    }
  });
  return r;
}

// The call's fixed operands, shared by every block of work.
struct Operands {
  const int8_t* wp;
  const int32_t* colsum;
  const float* sw;
  const float* wf;  // [F, N] or null
  int64_t N, K4;
};

// y[r, c] for rows r0..r0+R-1 and channels n0..n0+nc-1 from their int32 sums acc[r][c] (offset included where
// `offset`: the sums of q + 128, less 128 colsum here), module-doc order; out: row r0 at y + r0 * N.
template <typename T>
inline void epilogue(const int32_t (*acc)[NT_MAX * TILE], bool offset, int R, int64_t r0, int64_t n0, int64_t nc,
                     const Rows& rows, const Operands& op, T* y) {
  constexpr int64_t LD = NT_MAX * TILE;
  float tmp[MR_MAX][LD];
  for (int r = 0; r < R; ++r) {
    const float sx = rows.sx[r0 + r];
    const int32_t* cs = op.colsum + n0;
    for (int64_t c = 0; c < nc; ++c)
      tmp[r][c] = static_cast<float>(offset ? acc[r][c] - 128 * cs[c] : acc[r][c]) * sx * op.sw[n0 + c];
  }
  if (rows.nf) fma_channels_rows(R, tmp[0], LD, rows.xf.data() + r0 * rows.nf, rows.nf, op.wf + n0, op.N, nc);
  for (int r = 0; r < R; ++r) {
    T* out = y + (r0 + r) * op.N + n0;
    for (int64_t c = 0; c < nc; ++c) out[c] = from_float<T>(tmp[r][c]);
  }
}

#if defined(RADIXGEN_W8A8_VNNI)
// acc[r][16 j + c] = sum over the K4 groups of (q + 128) x W8 for R rows (a, lda bytes apart) and NT tiles (w,
// `ts` bytes apart).
template <int R, int NT>
inline void tile_vnni(const uint8_t* a, int64_t lda, const int8_t* w, int64_t ts, int64_t K4,
                      int32_t (*acc)[NT_MAX * TILE]) {
  __m512i c[R][NT];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) c[r][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < K4; ++g) {
    __m512i b[NT];
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) {
      b[j] = _mm512_loadu_si512(w + j * ts + g * 64);
      asm("" : "+v"(b[j]));  // keeps b[j] in a register: folded into each vpdpbusd it would be loaded R times
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, a + r * lda + g * KG, 4);
      const __m512i av = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) c[r][j] = _mm512_dpbusd_epi32(c[r][j], av, b[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NT; ++j) _mm512_storeu_si512(acc[r] + j * TILE, c[r][j]);
}
#elif defined(RADIXGEN_W8A8_AVX2)
// As tile_vnni with exact signed sums on s8 codes (no offset): per k-group and 8 channels, maddubs(|w|, sign(q, w))
// pairs then madd with ones; |q|, |w| <= 127, so a pair is at most 2 * 127 * 127 < 2^15.
template <int R>
inline void tile_avx2(const uint8_t* a, int64_t lda, const int8_t* w, int64_t K4, int32_t (*acc)[NT_MAX * TILE],
                      int col0) {
  __m256i c[R][2];
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < K4; ++g) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + 32));
    const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, a + r * lda + g * KG, 4);
      const __m256i q = _mm256_set1_epi32(quad);
      c[r][0] = _mm256_add_epi32(c[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(q, w0)), ones));
      c[r][1] = _mm256_add_epi32(c[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(q, w1)), ones));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc[r] + col0), c[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc[r] + col0 + 8), c[r][1]);
  }
}
#endif

// One block: rows [m0, m1) x tiles [t0, t0 + nt) -> y.
template <typename T>
void run_block(const Rows& rows, const Operands& op, int64_t m0, int64_t m1, int64_t t0, int nt, T* y) {
  alignas(64) int32_t acc[MR_MAX][NT_MAX * TILE];
  const int64_t ts = op.K4 * 64, n0 = t0 * TILE, nc = std::min<int64_t>(nt * TILE, op.N - n0);
  const int8_t* w = op.wp + t0 * ts;
  for (int64_t r0 = m0; r0 < m1; r0 += MR_MAX) {
    const int R = static_cast<int>(std::min<int64_t>(MR_MAX, m1 - r0));
    const uint8_t* a = rows.a.data() + r0 * rows.lda;
#if defined(RADIXGEN_W8A8_VNNI)
#define RADIXGEN_W8A8_CASE(RR, NN) \
  case (RR) * 8 + (NN): tile_vnni<RR, NN>(a, rows.lda, w, ts, op.K4, acc); break;
    switch (R * 8 + nt) {
      RADIXGEN_W8A8_CASE(4, 4) RADIXGEN_W8A8_CASE(4, 3) RADIXGEN_W8A8_CASE(4, 2) RADIXGEN_W8A8_CASE(4, 1)
      RADIXGEN_W8A8_CASE(3, 4) RADIXGEN_W8A8_CASE(3, 3) RADIXGEN_W8A8_CASE(3, 2) RADIXGEN_W8A8_CASE(3, 1)
      RADIXGEN_W8A8_CASE(2, 4) RADIXGEN_W8A8_CASE(2, 3) RADIXGEN_W8A8_CASE(2, 2) RADIXGEN_W8A8_CASE(2, 1)
      RADIXGEN_W8A8_CASE(1, 4) RADIXGEN_W8A8_CASE(1, 3) RADIXGEN_W8A8_CASE(1, 2) RADIXGEN_W8A8_CASE(1, 1)
      default: TORCH_CHECK(false, "w8a8_linear: bad tile ", R, "x", nt);
    }
#undef RADIXGEN_W8A8_CASE
    constexpr bool offset = true;
#elif defined(RADIXGEN_W8A8_AVX2)
    for (int j = 0; j < nt; ++j) {
      switch (R) {
        case 4: tile_avx2<4>(a, rows.lda, w + j * ts, op.K4, acc, j * TILE); break;
        case 3: tile_avx2<3>(a, rows.lda, w + j * ts, op.K4, acc, j * TILE); break;
        case 2: tile_avx2<2>(a, rows.lda, w + j * ts, op.K4, acc, j * TILE); break;
        default: tile_avx2<1>(a, rows.lda, w + j * ts, op.K4, acc, j * TILE); break;
      }
    }
    constexpr bool offset = false;
#else
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < nt; ++j)
        for (int c = 0; c < TILE; ++c) {
          int32_t s = 0;
          const int8_t* wc = w + j * ts + c * KG;
          const uint8_t* ar = a + r * rows.lda;
          for (int64_t g = 0; g < op.K4; ++g)
            for (int i = 0; i < KG; ++i) s += int32_t(ar[g * KG + i]) * int32_t(wc[g * 64 + i]);
          acc[r][j * TILE + c] = s;
        }
    constexpr bool offset = true;
#endif
    epilogue<T>(acc, offset, R, r0, n0, nc, rows, op, y);
  }
}

template <typename T>
void run(const at::Tensor& x, const Operands& op, const float* inv_s, const int64_t* fidx, int64_t nf, T* y) {
  const int64_t M = x.size(0), T_ = (op.N + TILE - 1) / TILE, nblk = (T_ + NT_MAX - 1) / NT_MAX;
  const Rows rows = quantize<T>(x, inv_s, fidx, nf);
  const int64_t mchunks = (M + MC - 1) / MC;
  // block b: channels block b / mchunks, rows chunk b % mchunks (a thread's consecutive blocks share weights)
  at::parallel_for(0, nblk * mchunks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t0 = (b / mchunks) * NT_MAX, m0 = (b % mchunks) * MC;
      run_block<T>(rows, op, m0, std::min(M, m0 + MC), t0, static_cast<int>(std::min<int64_t>(NT_MAX, T_ - t0)), y);
    }
  });
}

}  // namespace

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& colsum, const at::Tensor& sw,
                       const std::optional<at::Tensor>& inv_s, const std::optional<at::Tensor>& fidx,
                       const std::optional<at::Tensor>& wf) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "w8a8_linear: x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(sw.dim() == 1 && sw.scalar_type() == at::kFloat && sw.is_contiguous(),
              "w8a8_linear: sw must be contiguous float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = sw.size(0);
  const int64_t T_ = (N + TILE - 1) / TILE, K4 = (K + KG - 1) / KG;
  TORCH_CHECK(wp.dim() == 4 && wp.scalar_type() == at::kChar && wp.is_contiguous() && wp.size(0) == T_ &&
                  wp.size(1) == K4 && wp.size(2) == TILE && wp.size(3) == KG,
              "w8a8_linear: wp must be contiguous int8 [ceil(N / 16), ceil(K / 4), 16, 4] = [", T_, ", ", K4,
              ", 16, 4] for N = ", N, ", K = ", K, " (x's K), got ", wp.sizes());
  TORCH_CHECK(colsum.dim() == 1 && colsum.scalar_type() == at::kInt && colsum.is_contiguous() &&
                  colsum.size(0) == T_ * TILE,
              "w8a8_linear: colsum must be contiguous int32 [16 ceil(N / 16)]");
  const Extras ex = check_extras("w8a8_linear", K, N, inv_s, fidx, wf);
  const float* inv = ex.inv_s;
  const int64_t* fi = ex.fidx;
  const float* wfp = ex.wf;
  const int64_t nf = ex.nf;
  auto xc = x.stride(1) == 1 ? x : x.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Operands op{wp.data_ptr<int8_t>(), colsum.data_ptr<int32_t>(), sw.data_ptr<float>(), wfp, N, K4};
  if (x.scalar_type() == at::kFloat)
    run<float>(xc, op, inv, fi, nf, y.data_ptr<float>());
  else
    run<uint16_t>(xc, op, inv, fi, nf, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

bool w8a8_native() {
#if defined(RADIXGEN_W8A8_VNNI) || defined(RADIXGEN_W8A8_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace RADIXGEN_NS
