// Weight-only quantized linears for few rows (decode) on CPUs with AVX2: 4-bit and 8-bit weights in GGUF's own
// block layouts, times activations quantized per block of 32 to int8 (llama.cpp's Q4_1 x Q8 / Q8_0 x Q8 scheme,
// written here from the formats' definitions). The GEMV family: compiled once per ISA variant (kernels/cpu/isa.h),
// registered by dispatch.cpp; kernels/quant/cpu_blocks.py packs the weights and holds the contracts' Python side.
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
// block's small elements; llama.cpp decodes with this int8 scheme). q4 works on pairs of blocks: one 32-byte load
// holds both blocks' nibbles, and the activations are laid out to match (QuantizedRows, pair order), so the int32 sums
// of block 2p land in lanes 0-3 and of 2p + 1 in lanes 4-7 of one vector. Each output element's order of
// operations depends only on its own row and K, never on M or the thread count: results are batch-invariant.
// Threads split N.
//
// Why: at batch 1 decode is bound by the weight bytes read per token. torch._weight_int4pack_mm_for_cpu reads
// them at about half of a 2-core AVX2 EPYC's bandwidth; here the q4 loop costs ~6 vector instructions per block
// and row and prefetches the rows ahead, the q8 lm_head runs at the read bound (bench/results/
// quant_kernels-zen3.md, quant.md). Cost grows with the rows of x: from ~3 rows a dense float32 GEMM on a kept
// copy is faster (kernels/quant/weights.py's dense_min_rows decides).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "isa.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXGEN_QGEMV_AVX2 1
#endif

namespace RADIXGEN_NS {
namespace {

constexpr int QK = 32;       // weights per block
constexpr int MAX_ROWS = 4;  // rows of x per pass over a weight row (accumulators stay in registers)
// q4 prefetches weight rows this far ahead of the loop: every call streams rows no cache holds, and the hardware
// prefetcher starts over at each call (a decode step makes 4 calls per layer): ~15 % off the streamed q4 time at
// one row of x on a 2-core AVX2 EPYC (bench/results/quant_kernels-zen3.md).
constexpr int64_t PF_ROWS = 32;

// Activations of one call quantized per block: a [M, K] int8, s [M, K / 32] (scale), sum [M, K / 32] = s * sum(a),
// the sum of the rounded block (not of x: then y is exactly W times the rounded x, whose error is sum_j W_j e_j;
// with x's own sum the offset m would meet unrounded activations and the q-part's error would not cancel).
struct QuantizedRows {
  // natural order (group 0): a [M, K]; group order (q4, group G = 2 for AVX2, 4 for AVX-512): 32 G bytes per
  // group of G blocks (G g .. G g + G - 1) of a row, their codes 0-15 block after block, then their codes 16-31
  // (G = 2: a[2p][0:16], a[2p+1][0:16], a[2p][16:32], a[2p+1][16:32]; missing blocks past the row's end: zeros),
  // row r's groups from r * ngroups, and s2 [M, ngroups, 4 G]: s of block G g + j in lanes 4j .. 4j + 3 (0 for a
  // missing block).
  std::vector<int8_t> a;
  std::vector<float> s, sum, s2;
};

inline int64_t num_pairs(int64_t nb) { return (nb + 1) / 2; }

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int group = 0) {
  const int64_t nb = K / QK, G = group, ng = G ? (nb + G - 1) / G : 0;
  QuantizedRows q{std::vector<int8_t>(G ? M * ng * 32 * G : M * K, int8_t{0}), std::vector<float>(M * nb),
                  std::vector<float>(M * nb), std::vector<float>(G ? M * ng * 4 * G : 0, 0.0f)};
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * QK;
      // where the block's codes 0-15 and 16-31 go
      int8_t* lo = G ? q.a.data() + (r * ng + b / G) * 32 * G + (b % G) * 16 : q.a.data() + r * K + b * QK;
      int8_t* hi = lo + (G ? 16 * G : 16);
      float amax = 0.0f;
      bool finite = true;
      for (int i = 0; i < QK; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        finite &= std::isfinite(xb[i]);
      }
      float s = std::numeric_limits<float>::quiet_NaN();
      if (!finite) {  // a NaN or inf in the block: codes 0 (as allocated), scale NaN, so its outputs are NaN
        q.s[r * nb + b] = q.sum[r * nb + b] = s;
      } else {
        s = amax / 127.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QK; ++i) {
          const auto c = static_cast<int8_t>(std::nearbyint(xb[i] * inv));  // |.| <= 127
          (i < 16 ? lo[i] : hi[i - 16]) = c;
          sum += c;
        }
        q.s[r * nb + b] = s;
        q.sum[r * nb + b] = s * static_cast<float>(sum);
      }
      if (G) std::fill_n(q.s2.data() + (r * ng + b / G) * 4 * G + (b % G) * 4, 4, s);
    }
  return q;
}

#ifdef RADIXGEN_QGEMV_AVX2
// sum_j u[j] * v[j] in float32: 8 lanes over j, then the lanes, then the tail in order.
inline float dot_f32(const float* u, const float* v, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(u + j), _mm256_loadu_ps(v + j), acc);
  float t = hsum8(acc);
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
  for (int r = 0; r < R; ++r) dots[r] = hsum8(_mm256_add_ps(even[r], odd[r]));
}

// NR weight rows (qs rows ldq bytes apart; f: their float32 block parameters, d then m, per_row apart) against
// R rows of x (from r0), one pair of blocks per step: a 32-byte load holds both blocks' nibbles, the low nibbles
// (weights 0-15 of each block) meet the pair's first 32 activation bytes, the high ones its second, so lanes
// 0-3 of the int32 sums belong to block 2p and lanes 4-7 to 2p + 1; they are scaled by d * s per half and summed into one float32
// accumulator per (weight row, x row). y[i][r * ldy] = that accumulator's lane sum + the m * X_b terms.
// Every output element's order of operations depends only on K: the same for any R, NR, M or thread count.
template <int NR, int R>
inline void q4_rows(int64_t nb, const uint8_t* qs, int64_t ldq, const float* f, int64_t per_row,
                    const QuantizedRows& q, int64_t r0, float* y, int64_t ldy) {
  const int64_t np = num_pairs(nb);
  __m256 acc[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const int8_t* a2 = q.a.data() + r0 * np * 64;  // pair order
  const float* s2 = q.s2.data() + r0 * np * 8;
  for (int64_t p = 0; p < np; ++p) {
    const bool full = 2 * p + 1 < nb;
    __m256i alo[R], ahi[R];
    __m256 sv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      alo[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a2 + (r * np + p) * 64));
      ahi[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a2 + (r * np + p) * 64 + 32));
      sv[r] = _mm256_loadu_ps(s2 + (r * np + p) * 8);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      const uint8_t* w = qs + i * ldq + p * 32;
      const __m256i raw = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))
                               : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      const float* d = f + i * per_row + 2 * p;
      const __m128 d01 = full ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d))) : _mm_load_ss(d);
      const __m256 dv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d01), halves);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        // |lo * a| + |hi * a| per int16 lane <= 2 * (2 * 15 * 127): no saturation
        const __m256i i16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo[r]), _mm256_maddubs_epi16(hi, ahi[r]));
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(i16, ones));
        acc[i][r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(dv, sv[r]), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r)
      y[i + r * ldy] = hsum8(acc[i][r]) + dot_f32(f + i * per_row + nb, q.sum.data() + (r0 + r) * nb, nb);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXGEN_QGEMV_AVX512 1
// q4_rows on AVX-512: one 64-byte load holds four blocks' nibbles (group order G = 4), lanes 4j .. 4j + 3 of the
// int32 sums belong to block 4g + j; u8 x s8 products summed by vpdpbusd where the CPU has AVX-512-VNNI, else by
// maddubs + madd (both exact in int32). A last group of fewer than four blocks is read under a mask (zeros).
template <int NR, int R>
inline void q4_rows16(int64_t nb, const uint8_t* qs, int64_t ldq, const float* f, int64_t per_row,
                      const QuantizedRows& q, int64_t r0, float* y, int64_t ldy) {
  const int64_t ng = (nb + 3) / 4;
  __m512 acc[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
#if !defined(__AVX512VNNI__)
  const __m512i ones = _mm512_set1_epi16(1);
#endif
  const int8_t* a4 = q.a.data() + r0 * ng * 128;  // group order, G = 4
  const float* s4 = q.s2.data() + r0 * ng * 16;
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t blocks = std::min<int64_t>(4, nb - 4 * g);
    const __mmask64 wmask = blocks == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * blocks)) - 1;
    const __mmask8 dmask = __mmask8((1u << blocks) - 1);
    __m512i alo[R], ahi[R];
    __m512 sv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      alo[r] = _mm512_loadu_si512(a4 + (r * ng + g) * 128);
      ahi[r] = _mm512_loadu_si512(a4 + (r * ng + g) * 128 + 64);
      sv[r] = _mm512_loadu_ps(s4 + (r * ng + g) * 16);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      const __m512i raw = _mm512_maskz_loadu_epi8(wmask, qs + i * ldq + g * 64);
      const __m512i lo = _mm512_and_si512(raw, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      const __m128 d4 = _mm_maskz_loadu_ps(dmask, f + i * per_row + 4 * g);
      const __m512 dv = _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(d4));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
#if defined(__AVX512VNNI__)
        const __m512i i32 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, alo[r]), hi, ahi[r]);
#else
        const __m512i i16 = _mm512_add_epi16(_mm512_maddubs_epi16(lo, alo[r]), _mm512_maddubs_epi16(hi, ahi[r]));
        const __m512i i32 = _mm512_madd_epi16(i16, ones);
#endif
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_mul_ps(dv, sv[r]), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r)
      y[i + r * ldy] = _mm512_reduce_add_ps(acc[i][r]) +
                       dot_f32(f + i * per_row + nb, q.sum.data() + (r0 + r) * nb, nb);
}
#endif

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
      to_f32(params + c0 * per_row, f.data(), (c1 - c0) * per_row);
      for (int64_t n = c0; n < c1; ++n)
        for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS)
          row(n, r0, std::min<int64_t>(MAX_ROWS, M - r0), yp + r0 * N + n, f.data() + (n - c0) * per_row);
    }
  });
  return y;
}

#ifdef RADIXGEN_QGEMV_AVX2
// The q4 kernel of this variant: 64-byte groups of four blocks on AVX-512, 32-byte pairs on AVX2 (the activations'
// group order matches: quantize_rows' group 4 or 2).
template <int NR, int R>
inline void q4_kernel(int64_t nb, const uint8_t* qs, int64_t ldq, const float* f, int64_t per_row,
                      const QuantizedRows& q, int64_t r0, float* y, int64_t ldy) {
#if defined(RADIXGEN_QGEMV_AVX512)
  q4_rows16<NR, R>(nb, qs, ldq, f, per_row, q, r0, y, ldy);
#else
  q4_rows<NR, R>(nb, qs, ldq, f, per_row, q, r0, y, ldy);
#endif
}
#endif

}  // namespace

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "q4_linear: qs must be contiguous uint8 [N, K / 2]");
  const int64_t N = qs.size(0), K = qs.size(1) * 2, nb = K / QK;
  check_x(x, K, "q4_linear");
  TORCH_CHECK(dm.dim() == 3 && dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.size(0) == N &&
                  dm.size(1) == 2 && dm.size(2) == nb,
              "q4_linear: dm must be contiguous float16 [N, 2, K / 32]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), per_row = 2 * nb;
#if defined(RADIXGEN_QGEMV_AVX512)
  const QuantizedRows q = quantize_rows(xc.data_ptr<float>(), M, K, 4);
#elif defined(RADIXGEN_QGEMV_AVX2)
  const QuantizedRows q = quantize_rows(xc.data_ptr<float>(), M, K, 2);
#else
  const QuantizedRows q = quantize_rows(xc.data_ptr<float>(), M, K);
#endif
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const at::Half* params = dm.data_ptr<at::Half>();
  auto y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  float* yp = y.data_ptr<float>();
  constexpr int64_t CHUNK = 16;  // weight rows whose block parameters are converted together
  at::parallel_for(0, N, CHUNK, [&](int64_t n0, int64_t n1) {
    std::vector<float> f(CHUNK * per_row);
    {  // this thread's first rows and block parameters: the loop's prefetches run PF_ROWS ahead of it
      const char* w0 = reinterpret_cast<const char*>(qp + n0 * (K / 2));
      const int64_t bytes = std::min<int64_t>(n1 - n0, PF_ROWS) * (K / 2);
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(w0 + off);
    }
    for (int64_t c0 = n0; c0 < n1; c0 += CHUNK) {
      const int64_t c1 = std::min(n1, c0 + CHUNK);
      {  // the next chunk's block parameters
        const char* pn = reinterpret_cast<const char*>(params + c1 * per_row);
        const char* pe = reinterpret_cast<const char*>(params + n1 * per_row);
        for (int64_t off = 0; off < CHUNK * per_row * 2 && pn + off < pe; off += 64) __builtin_prefetch(pn + off);
      }
      to_f32(params + c0 * per_row, f.data(), (c1 - c0) * per_row);
      for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
        const int64_t R = std::min<int64_t>(MAX_ROWS, M - r0);
        for (int64_t n = c0; n < c1;) {
          const float* fn = f.data() + (n - c0) * per_row;
          const uint8_t* w = qp + n * (K / 2);
          float* yn = yp + r0 * N + n;
#ifdef RADIXGEN_QGEMV_AVX2
          if (R == 1 && n + 4 <= c1) {  // one row of x: 4 weight rows per step
            // rows PF_ROWS ahead: each call streams fresh rows (the hardware prefetcher restarts per call)
            const char* ahead = reinterpret_cast<const char*>(w + PF_ROWS * (K / 2));
            const char* end = reinterpret_cast<const char*>(qp + N * (K / 2));
            for (int64_t off = 0; off < 4 * (K / 2) && ahead + off < end; off += 64)
              __builtin_prefetch(ahead + off);
            q4_kernel<4, 1>(nb, w, K / 2, fn, per_row, q, r0, yn, N);
            n += 4;
            continue;
          }
          switch (R) {
            case 4: q4_kernel<1, 4>(nb, w, K / 2, fn, per_row, q, r0, yn, N); break;
            case 3: q4_kernel<1, 3>(nb, w, K / 2, fn, per_row, q, r0, yn, N); break;
            case 2: q4_kernel<1, 2>(nb, w, K / 2, fn, per_row, q, r0, yn, N); break;
            default: q4_kernel<1, 1>(nb, w, K / 2, fn, per_row, q, r0, yn, N); break;
          }
#else
          for (int64_t r = 0; r < R; ++r) yn[r * N] = q4_dot_scalar(nb, w, fn, fn + nb, q, r0 + r, K);
#endif
          ++n;
        }
      }
    }
  });
  return y;
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

}  // namespace RADIXGEN_NS
