// Weight-only quantized linears for few rows (decode) on CPUs with AVX2: 4-bit and 8-bit weights in GGUF's own
// block layouts, times activations quantized per block of 32 to int8 (llama.cpp's Q4_1 x Q8 / Q8_0 x Q8 scheme,
// written here from the formats' definitions). Built into the same extension as attention.cpp
// (kernels/cpu/build.py); kernels/quant/cpu_blocks.py packs the weights and holds the contracts' Python side.
//
//   q4_linear(x [M, K] float32, qs [N, K / 2] uint8, dm [N, 2, K / 32] float16) -> y [M, N] float32
//       weight value W[n, 32 b + i] = d[n, b] * q + m[n, b], q = low nibble of qs[n, 16 b + i] for i < 16, the
//       high nibble of qs[n, 16 b + i - 16] for i >= 16 (GGUF Q4_1's nibble order); d = dm[n, 0, b], m = dm[n, 1, b]
//   q8_linear(x [M, K] float32, codes [N, K] int8, d [N, K / 32] float16) -> y [M, N] float32
//       W[n, 32 b + i] = d[n, b] * codes[n, 32 b + i] (GGUF Q8_0)
//
// Arithmetic, per row of x and block b of 32 inputs: x's block is rounded to int8 a = round(x / s), s = max|x| /
// 127, and X_b = s * sum(a); the int8 dot of codes and a is exact in int32 (maddubs/madd); then
// y += d * s * dot (+ m * X_b for q4) in float32: W times the rounded x. The rounding moves an element by at most
// max|x_b| / 254 (a bfloat16 activation, what torch's CPU int4/int8 kernels take, by |x| / 256: finer for the
// block's small elements; llama.cpp decodes with this int8 scheme). Each output element's
// order of operations depends only on its own row and K (two float32 accumulators over alternate blocks), never on
// M or the thread count: results are batch-invariant. Threads split N.
//
// Why: at batch 1 decode is bound by the weight bytes read per token. torch._weight_int4pack_mm_for_cpu reads
// them at about half of a 2-core AVX2 EPYC's bandwidth; here each 32-weight block costs one 16-byte load and
// ~8 vector instructions per row of x: 1.75x torch's int4 per layer at one row, the q8 lm_head at the read bound
// (bench/results/quant_kernels-zen3.md, quant.md). Cost grows with the rows of x: from ~3 rows a dense float32
// GEMM on a kept copy is faster (kernels/quant/weights.py's dense_min_rows decides).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RADIXGEN_QGEMV_AVX2 1
#endif

namespace {

constexpr int QK = 32;       // weights per block
constexpr int MAX_ROWS = 4;  // rows of x per pass over a weight row (accumulators stay in registers)

// Activations of one call quantized per block: a [M, K] int8, s [M, K / 32] (scale), sum [M, K / 32] = s * sum(a),
// the sum of the rounded block (not of x: then y is exactly W times the rounded x, whose error is sum_j W_j e_j;
// with x's own sum the offset m would meet unrounded activations and the q-part's error would not cancel).
struct QuantizedRows {
  std::vector<int8_t> a;
  std::vector<float> s, sum;
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  QuantizedRows q{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * QK;
      float amax = 0.0f;
      bool finite = true;
      for (int i = 0; i < QK; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        finite &= std::isfinite(xb[i]);
      }
      int8_t* ab = q.a.data() + r * K + b * QK;
      if (!finite) {  // a NaN or inf in the block: codes 0, scale NaN, so its outputs are NaN
        std::fill(ab, ab + QK, int8_t{0});
        q.s[r * nb + b] = q.sum[r * nb + b] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float s = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < QK; ++i) {
        ab[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));  // |.| <= 127
        sum += ab[i];
      }
      q.s[r * nb + b] = s;
      q.sum[r * nb + b] = s * static_cast<float>(sum);
    }
  return q;
}

// float16 -> float32 for n values (the block parameters of up to 16 weight rows).
inline void halfs_to_float(const at::Half* h, float* f, int64_t n) {
  int64_t i = 0;
#ifdef RADIXGEN_QGEMV_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) f[i] = _cvtsh_ss(h[i].x);
#else
  for (; i < n; ++i) f[i] = static_cast<float>(h[i]);
#endif
}

#ifdef RADIXGEN_QGEMV_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_j u[j] * v[j] in float32: 8 lanes over j, then the lanes, then the tail in order.
inline float dot_f32(const float* u, const float* v, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(u + j), _mm256_loadu_ps(v + j), acc);
  float t = hsum(acc);
  for (; j < n; ++j) t = std::fma(u[j], v[j], t);
  return t;
}

// Sum of products of 32 unsigned bytes u (< 128) and 32 signed bytes a, as 8 int32 lanes -> float.
inline __m256 dot_u8_i8(__m256i u, __m256i a) {
  const __m256i pairs = _mm256_maddubs_epi16(u, a);  // |.| <= 2 * 128 * 127: no saturation
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// The products d[b] * s[b] of a weight row's and an x row's block scales, for R rows of x: on the stack up to
// MAX_ROWS x 512 blocks (K = 16384), else on the heap.
class BlockScales {
 public:
  explicit BlockScales(int64_t n) : ptr_(n <= int64_t(sizeof(stack_) / sizeof(float)) ? stack_ : nullptr) {
    if (ptr_ == nullptr) {
      heap_.resize(n);
      ptr_ = heap_.data();
    }
  }
  const float* of(int r, int64_t nb, const float* d, const float* s) {
    float* out = ptr_ + r * nb;
    for (int64_t b = 0; b < nb; ++b) out[b] = d[b] * s[b];
    return out;
  }

 private:
  float stack_[MAX_ROWS * 512];
  std::vector<float> heap_;
  float* ptr_;
};

// Accumulates block b's products into acc[r] for r < R (q4 codes; sum_blocks drives it).
template <int R>
inline void q4_block(__m256 (&acc)[R], int64_t b, const uint8_t* qs, const int8_t* const (&a)[R],
                     const float* const (&ds)[R]) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
  const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256i ab = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r] + b * QK));
    acc[r] = _mm256_fmadd_ps(dot_u8_i8(w, ab), _mm256_broadcast_ss(ds[r] + b), acc[r]);
  }
}

// Sums block(acc, b, a, ds) over one weight row's blocks for R rows of x, into two accumulator sets by block
// parity (straight-line: an array indexed by b & 1 would live on the stack); dots[r] = the row's total. d: the
// weight row's block scales, float32.
template <int R, class Block>
inline void sum_blocks(int64_t nb, const float* d, const QuantizedRows& q, int64_t r0, int64_t K, float (&dots)[R],
                       Block block) {
  __m256 even[R], odd[R];
  const int8_t* a[R];
  const float* ds[R];
  BlockScales scales(R * nb);
  for (int r = 0; r < R; ++r) {
    even[r] = odd[r] = _mm256_setzero_ps();
    a[r] = q.a.data() + (r0 + r) * K;
    ds[r] = scales.of(r, nb, d, q.s.data() + (r0 + r) * nb);
  }
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block(even, b, a, ds);
    block(odd, b + 1, a, ds);
  }
  if (b < nb) block(even, b, a, ds);
  for (int r = 0; r < R; ++r) dots[r] = hsum(_mm256_add_ps(even[r], odd[r]));
}

// One q4 weight row against R rows of x -> y[r * ldy] for r < R. d, m: the row's block parameters, float32.
template <int R>
inline void q4_row(int64_t nb, const uint8_t* qs, const float* d, const float* m, const QuantizedRows& q,
                   int64_t r0, int64_t K, float* y, int64_t ldy) {
  float dots[R];
  sum_blocks<R>(nb, d, q, r0, K, dots,
                [&](__m256 (&acc)[R], int64_t b, const int8_t* const (&a)[R], const float* const (&ds)[R]) {
                  q4_block<R>(acc, b, qs, a, ds);
                });
  for (int r = 0; r < R; ++r)
    y[r * ldy] = dots[r] + dot_f32(m, q.sum.data() + (r0 + r) * nb, nb);  // + the m * X_b terms
}

template <int R>
inline void q8_block(__m256 (&acc)[R], int64_t b, const int8_t* codes, const int8_t* const (&a)[R],
                     const float* const (&ds)[R]) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * QK));
  const __m256i wabs = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes (-128 -> 128)
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256i ab = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r] + b * QK));
    // |w| * (a * sign(w)) = w * a
    acc[r] = _mm256_fmadd_ps(dot_u8_i8(wabs, _mm256_sign_epi8(ab, w)), _mm256_broadcast_ss(ds[r] + b), acc[r]);
  }
}

// One q8 weight row against R rows of x.
template <int R>
inline void q8_row(int64_t nb, const int8_t* codes, const float* d, const QuantizedRows& q, int64_t r0, int64_t K,
                   float* y, int64_t ldy) {
  float dots[R];
  sum_blocks<R>(nb, d, q, r0, K, dots,
                [&](__m256 (&acc)[R], int64_t b, const int8_t* const (&a)[R], const float* const (&ds)[R]) {
                  q8_block<R>(acc, b, codes, a, ds);
                });
  for (int r = 0; r < R; ++r) y[r * ldy] = dots[r];
}
#endif

// The portable twin (no AVX2): the same per-block arithmetic, one accumulator per parity of b.
[[maybe_unused]] inline float q4_dot_scalar(int64_t nb, const uint8_t* qs, const float* d, const float* m,
                                            const QuantizedRows& q, int64_t row, int64_t K) {
  float acc[2] = {0.0f, 0.0f}, bias = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* a = q.a.data() + row * K + b * QK;
    int32_t dot = 0;
    for (int i = 0; i < 16; ++i) dot += (qs[b * 16 + i] & 0x0F) * a[i] + (qs[b * 16 + i] >> 4) * a[i + 16];
    acc[b & 1] = std::fma(static_cast<float>(dot), d[b] * q.s[row * nb + b], acc[b & 1]);
  }
  for (int64_t b = 0; b < nb; ++b) bias = std::fma(m[b], q.sum[row * nb + b], bias);
  return acc[0] + acc[1] + bias;
}

[[maybe_unused]] inline float q8_dot_scalar(int64_t nb, const int8_t* codes, const float* d,
                                            const QuantizedRows& q, int64_t row, int64_t K) {
  float acc[2] = {0.0f, 0.0f};
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* a = q.a.data() + row * K + b * QK;
    int32_t dot = 0;
    for (int i = 0; i < QK; ++i) dot += codes[b * QK + i] * a[i];
    acc[b & 1] = std::fma(static_cast<float>(dot), d[b] * q.s[row * nb + b], acc[b & 1]);
  }
  return acc[0] + acc[1];
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be float32 [M, K]");
  TORCH_CHECK(x.size(1) == K, op, ": K of x (", x.size(1), ") != K of the weight (", K, ")");
  TORCH_CHECK(K % QK == 0, op, ": K must be a multiple of ", QK, ", got ", K);
}

// Runs row(n, r0, R, y, f) for every weight row n and every chunk of <= MAX_ROWS rows of x, threads over n; f is
// row n's `per_row` float16 block parameters (params [N, per_row]) in float32, converted 16 rows at a time.
template <class RowFn>
at::Tensor run_rows(const at::Tensor& x, int64_t N, const at::Half* params, int64_t per_row, RowFn row) {
  constexpr int64_t CHUNK = 16;
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, CHUNK, [&](int64_t n0, int64_t n1) {
    std::vector<float> f(CHUNK * per_row);
    for (int64_t c0 = n0; c0 < n1; c0 += CHUNK) {
      const int64_t c1 = std::min(n1, c0 + CHUNK);
      halfs_to_float(params + c0 * per_row, f.data(), (c1 - c0) * per_row);
      for (int64_t n = c0; n < c1; ++n)
        for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS)
          row(n, r0, std::min<int64_t>(MAX_ROWS, M - r0), yp + r0 * N + n, f.data() + (n - c0) * per_row);
    }
  });
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "q4_linear: qs must be contiguous uint8 [N, K / 2]");
  const int64_t N = qs.size(0), K = qs.size(1) * 2, nb = K / QK;
  check_x(x, K, "q4_linear");
  TORCH_CHECK(dm.dim() == 3 && dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.size(0) == N &&
                  dm.size(1) == 2 && dm.size(2) == nb,
              "q4_linear: dm must be contiguous float16 [N, 2, K / 32]");
  auto xc = x.contiguous();
  const QuantizedRows q = quantize_rows(xc.data_ptr<float>(), xc.size(0), K);
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  return run_rows(xc, N, dm.data_ptr<at::Half>(), 2 * nb,
                  [&](int64_t n, int64_t r0, int64_t R, float* y, const float* f) {  // f: d then m
    const uint8_t* w = qp + n * (K / 2);
#ifdef RADIXGEN_QGEMV_AVX2
    switch (R) {
      case 4: q4_row<4>(nb, w, f, f + nb, q, r0, K, y, N); break;
      case 3: q4_row<3>(nb, w, f, f + nb, q, r0, K, y, N); break;
      case 2: q4_row<2>(nb, w, f, f + nb, q, r0, K, y, N); break;
      default: q4_row<1>(nb, w, f, f + nb, q, r0, K, y, N); break;
    }
#else
    for (int64_t r = 0; r < R; ++r) y[r * N] = q4_dot_scalar(nb, w, f, f + nb, q, r0 + r, K);
#endif
  });
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "q8_linear: codes must be contiguous int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), nb = K / QK;
  check_x(x, K, "q8_linear");
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.is_contiguous() && d.size(0) == N &&
                  d.size(1) == nb,
              "q8_linear: d must be contiguous float16 [N, K / 32]");
  auto xc = x.contiguous();
  const QuantizedRows q = quantize_rows(xc.data_ptr<float>(), xc.size(0), K);
  const int8_t* cp = codes.data_ptr<int8_t>();
  return run_rows(xc, N, d.data_ptr<at::Half>(), nb,
                  [&](int64_t n, int64_t r0, int64_t R, float* y, const float* f) {
    const int8_t* w = cp + n * K;
#ifdef RADIXGEN_QGEMV_AVX2
    switch (R) {
      case 4: q8_row<4>(nb, w, f, q, r0, K, y, N); break;
      case 3: q8_row<3>(nb, w, f, q, r0, K, y, N); break;
      case 2: q8_row<2>(nb, w, f, q, r0, K, y, N); break;
      default: q8_row<1>(nb, w, f, q, r0, K, y, N); break;
    }
#else
    for (int64_t r = 0; r < R; ++r) y[r * N] = q8_dot_scalar(nb, w, f, q, r0 + r, K);
#endif
  });
}

bool q_gemv_native() {
#ifdef RADIXGEN_QGEMV_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixgen, m) {
  m.def("q4_linear(Tensor x, Tensor qs, Tensor dm) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor codes, Tensor d) -> Tensor");
  m.def("q_gemv_native() -> bool", &q_gemv_native);  // not a tensor op: a catch-all kernel
}

TORCH_LIBRARY_IMPL(radixgen, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}
