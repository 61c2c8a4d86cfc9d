// Fused row-wise CPU kernels for the eager forward (extend and mixed steps; the compiled decode graphs get the
// same fusions from inductor). Each replaces a chain of 4-10 aten ops and their float32 temporaries with one
// pass over the rows; compiled once per ISA variant (kernels/cpu/isa.h), registered by dispatch.cpp.
//
//   add_rmsnorm(x [T, H], residual [T, H] or None, weight [H], eps) -> (out [T, H], h [T, H] or [0] if None)
//       h = x + residual (rounded to x's dtype, as torch's add), out = h * rsqrt(mean(h^2) + eps) * weight
//   rope(x [T, Nh, D], cos_sin [P, D] float32, positions [T] int64) -> [T, Nh, D]
//       rotate-half (Neox) rotary; cos_sin's first D/2 columns are cos, the last D/2 sin
//   silu_mul(gate_up [T, 2I]) -> [T, I]        silu(gate) * up, gate the first I columns (silu 0 for gate < -87)
//   apply_token_bitmask_(logits [B, V] float32, bitmask [R, W] int32, rows [R] int64 or None)
//       in place: logits[rows[r], t] = -inf where bit t % 32 of bitmask[r][t / 32] is 0 (rows None: r itself);
//       the grammar mask of runtime/constrained, one pass instead of unpacking [R, V] bools and masked_fill
//
// Numerics match kernels/ref.py: inputs float32 or bfloat16, math in float32, one rounding to the input dtype at
// the end (ref's silu_mul rounds twice in bf16, so bf16 results may differ by one ulp). Rows are independent and
// each row's reduction order is fixed, so results do not depend on T (batch-invariant).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "vec_math.h"

namespace RADIXGEN_NS {
namespace {

using bf16_bits = uint16_t;  // bfloat16 tensors are read as raw bits (vec_math.h)

// Calls fn with a null pointer of the storage type: float for float32, bf16_bits for bfloat16 (the Python side
// never sends more); the kernels read tensors through ptr<T>.
template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

template <typename Fn>
void dispatch_f32_bf16(at::ScalarType t, const char* op, Fn&& fn) {
  if (t == at::kFloat) {
    fn(static_cast<float*>(nullptr));
  } else if (t == at::kBFloat16) {
    fn(static_cast<bf16_bits*>(nullptr));
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 expected, got ", t);
  }
}

constexpr int64_t kGrain = 16;  // rows per parallel task (rows are 1-6 KB: smaller tasks cost more than they save)

template <typename T>
void add_rmsnorm_rows(const T* x, const T* res, const T* w, T* out, T* h, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t b, int64_t e) {
    std::vector<float> buf(n);
    std::vector<float> wf(n);
    for (int64_t j = 0; j < n; ++j) wf[j] = to_float(w[j]);
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * n;
      float* hb = buf.data();
      if (res != nullptr) {
        const T* rr = res + r * n;
        T* hr = h + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          const T s = from_float<T>(to_float(xr[j]) + to_float(rr[j]));  // rounded as torch's add
          hr[j] = s;
          hb[j] = to_float(s);
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) hb[j] = to_float(xr[j]);
      }
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < n; ++j) acc += hb[j] * hb[j];
      const float inv = 1.f / std::sqrt(acc / static_cast<float>(n) + eps);
      T* outr = out + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) outr[j] = from_float<T>(hb[j] * inv * wf[j]);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                               const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "add_rmsnorm: shape mismatch");
  auto xc = x.contiguous();
  auto wc = weight.to(x.scalar_type()).contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto out = at::empty_like(xc);
  at::Tensor h, rc;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "add_rmsnorm: residual must match x");
    rc = residual->contiguous();
    h = at::empty_like(xc);
  } else {
    h = at::empty({0}, x.options());  // no residual: h is x itself (the Python wrapper returns x; no alias here)
  }
  dispatch_f32_bf16(x.scalar_type(), "add_rmsnorm", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    add_rmsnorm_rows<scalar_t>(ptr<scalar_t>(xc), rc.defined() ? ptr<scalar_t>(rc) : nullptr,
                               ptr<scalar_t>(wc), ptr<scalar_t>(out),
                               rc.defined() ? ptr<scalar_t>(h) : nullptr, rows, n, static_cast<float>(eps));
  });
  return {out, h};
}

namespace {

template <typename T>
void rope_rows(const T* x, const float* cs, const int64_t* pos, T* out, int64_t t, int64_t heads, int64_t d,
               int64_t x_row_stride) {
  const int64_t half = d / 2;
  at::parallel_for(0, t, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* c = cs + pos[i] * d;
      const float* s = c + half;
      for (int64_t hh = 0; hh < heads; ++hh) {
        const T* xr = x + i * x_row_stride + hh * d;
        T* o = out + (i * heads + hh) * d;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = to_float(xr[j]), x2 = to_float(xr[j + half]);
          o[j] = from_float<T>(x1 * c[j] - x2 * s[j]);
          o[j + half] = from_float<T>(x2 * c[j] + x1 * s[j]);
        }
      }
    }
  });
}

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos_sin, const at::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && cos_sin.dim() == 2 && cos_sin.size(1) == x.size(2) && x.size(2) % 2 == 0,
              "rope: x [T, Nh, D] and cos_sin [P, D] expected");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat, "rope: cos_sin must be float32");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0), "rope: positions [T] expected");
  // x is usually a view of the fused qkv projection: rows strided, heads and dims contiguous inside a row.
  auto xc = (x.stride(2) == 1 && x.stride(1) == x.size(2)) ? x : x.contiguous();
  auto cs = cos_sin.contiguous();
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  if (t > 0) {
    auto mx = pos.max().item<int64_t>(), mn = pos.min().item<int64_t>();
    TORCH_CHECK(mn >= 0 && mx < cs.size(0), "rope: position out of the cos/sin table");
  }
  auto out = at::empty({t, heads, d}, x.options());
  dispatch_f32_bf16(x.scalar_type(), "rope", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    rope_rows<scalar_t>(ptr<scalar_t>(xc), cs.data_ptr<float>(), pos.data_ptr<int64_t>(),
                        ptr<scalar_t>(out), t, heads, d, xc.stride(0));
  });
  return out;
}

namespace {

// silu(g) = g / (1 + exp(-g)) with a sigmoid of 0 for g below this (|silu(g)| < 1e-35 there; exp(-g) would
// leave exp_f's range, and g = -inf gives NaN, as torch's silu).
constexpr float SILU_ZERO_BELOW = -87.0f;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// One bf16 row: silu(g) * u = g * u / (1 + 2^t), t = -g log2 e, on 16 lanes: the power by vec_math.h's short
// 2^t (t <= 125.6 where it is used), the quotient by a reciprocal estimate and one Newton step (relative error
// ~1e-7); below SILU_ZERO_BELOW the sigmoid is 0, as in the scalar loop. One rounding to bf16 at the end.
inline void silu_mul_row_bf16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n) {
  const __m512 nl2e = _mm512_set1_ps(-LOG2E), lo = _mm512_set1_ps(SILU_ZERO_BELOW), cap = _mm512_set1_ps(126.0f),
               one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = head_mask16(static_cast<int>(std::min<int64_t>(16, n - j)));
    const __m512 gf = load16_bf16(g + j, k), uf = load16_bf16(u + j, k);
    const __m512 t = _mm512_mul_ps(gf, nl2e);
    const __m512 d = _mm512_add_ps(one, exp2_bf16w16(_mm512_min_ps(t, cap)));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(gf, lo, _CMP_GE_OQ), r, _mm512_fnmadd_ps(d, r, two));
    const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_mul_ps(gf, r), uf));
    _mm256_mask_storeu_epi16(o + j, k, y);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// One float32 row on 8 lanes: the scalar loop's arithmetic (exp8 is exp_f's polynomial), sigmoid 0 below
// SILU_ZERO_BELOW as g * 0 (NaN for g = -inf, as torch); the tail in the scalar loop's form. (AVX-512 variants
// leave the float32 loop to the vectorizer, which widens it to 16 lanes; for 8 it did not: 2.6 ms against 0.8 at
// 1,000 x 1,536.)
inline void silu_mul_row_f32(const float* g, const float* u, float* o, int64_t n) {
  const __m256 lo = _mm256_set1_ps(SILU_ZERO_BELOW), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 gf = _mm256_loadu_ps(g + j);
    const __m256 sg = _mm256_div_ps(gf, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gf))));
    const __m256 s = _mm256_blendv_ps(sg, _mm256_mul_ps(gf, zero), _mm256_cmp_ps(gf, lo, _CMP_LT_OQ));
    _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
  }
  for (; j < n; ++j) o[j] = (g[j] < SILU_ZERO_BELOW ? g[j] * 0.f : g[j] / (1.f + exp_f(-g[j]))) * u[j];
}
#endif

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gu + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16_bits>) {
        silu_mul_row_bf16(g, u, o, n);
        continue;
      }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        silu_mul_row_f32(g, u, o, n);
        continue;
      }
#endif
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float gf = to_float(g[j]);
        const float sg = gf < SILU_ZERO_BELOW ? gf * 0.f : gf / (1.f + exp_f(-gf));
        o[j] = from_float<T>(sg * to_float(u[j]));
      }
    }
  });
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [T, 2I] expected");
  auto gu = gate_up.contiguous();
  const int64_t rows = gu.size(0), n = gu.size(1) / 2;
  auto out = at::empty({rows, n}, gu.options());
  dispatch_f32_bf16(gu.scalar_type(), "silu_mul", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    silu_mul_rows<scalar_t>(ptr<scalar_t>(gu), ptr<scalar_t>(out), rows, n);
  });
  return out;
}

void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask_: logits float32 [B, V] with contiguous rows expected");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask_: bitmask contiguous int32 [R, W] expected");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), r_count = bitmask.size(0);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask_: bitmask has ", words, " words for ", vocab, " tokens");
  at::Tensor idx;
  if (rows.has_value()) {
    idx = rows->contiguous();
    TORCH_CHECK(idx.scalar_type() == at::kLong && idx.numel() == r_count, "apply_token_bitmask_: rows int64 [R]");
  } else {
    TORCH_CHECK(r_count == logits.size(0), "apply_token_bitmask_: bitmask rows != logits rows");
  }
  const int64_t* row_of = rows.has_value() ? idx.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; r < r_count; ++r) {
    TORCH_CHECK(!row_of || (row_of[r] >= 0 && row_of[r] < logits.size(0)), "apply_token_bitmask_: row out of range");
  }
  const auto* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, r_count, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* out = base + (row_of ? row_of[r] : r) * stride;
      const uint32_t* m = mask + r * words;
      for (int64_t w = 0; w < words; ++w) {
        uint32_t banned = ~m[w];
        const int64_t t0 = w * 32;
        if (banned == 0) continue;                       // all 32 allowed
        if (banned == 0xFFFFFFFFu && t0 + 32 <= vocab) {  // all banned (most words of a grammar's mask)
          for (int j = 0; j < 32; ++j) out[t0 + j] = ninf;
          continue;
        }
        while (banned) {
          const int64_t t = t0 + __builtin_ctz(banned);
          banned &= banned - 1;
          if (t < vocab) out[t] = ninf;
        }
      }
    }
  });
}

}  // namespace RADIXGEN_NS
