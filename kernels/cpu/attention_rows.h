// The row kernel of attention and what both attention sources share (kernels/cpu/attention_decode.cpp,
// attention_extend.cpp): per-thread scratch, the work-item pool, the online-softmax row kernel over keys read in
// place (Rows), storing a step's new K/V, input checks and the dtype / head-size dispatch.
//
// Pool: k_cache, v_cache [L, S, Hkv, D] contiguous; slot s of layer l holds K[l, s, h, :] for every KV head h.
// Request row r's i-th token lives in slot req_to_token[r, i] (int32). Nothing is gathered into a padded copy:
// the kernels walk req_to_token and read each key/value row in place, one block of BLK keys at a time.
// The row kernels are plain C++ for the compiler's vectorizer, with AVX-512 / AVX-512-BF16 / AVX2 intrinsics
// behind #if for the hot loops: each ISA variant (kernels/cpu/isa.h) compiles its own form.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "row_math.h"
#include "vec_math.h"

namespace RADIXGEN_NS {

// Per-thread scratch, sized for the largest item of a call (hd = Hkv * D: one slot's row of all KV heads).
struct Scratch {
  std::vector<float> q, o, s, m, l, kbuf, vbuf;
  std::vector<int> lim;
  std::vector<uint16_t> qb;  // q rows as raw bf16 (unscaled), for the bf16 dot-product path
  Scratch(int max_m, int d, int hd)
      : q(size_t(max_m) * d), o(size_t(max_m) * d), s(size_t(max_m) * BLK), m(max_m), l(max_m),
        kbuf(size_t(BLK) * hd), vbuf(size_t(BLK) * hd), lim(max_m), qb(size_t(max_m) * d) {}
};

// Query row m of an item: sc.q[m] = scale * q (float32) and sc.qb[m] = q's raw bf16 bits (bf16 inputs only).
inline void load_q(Scratch& sc, int m, const float* src, int d, float scale) {
  float* dst = sc.q.data() + size_t(m) * d;
  for (int x = 0; x < d; ++x) dst[x] = src[x] * scale;
}
inline void load_q(Scratch& sc, int m, const uint16_t* src, int d, float scale) {
  float* dst = sc.q.data() + size_t(m) * d;
  to_f32(src, dst, d);
  for (int x = 0; x < d; ++x) dst[x] *= scale;
  std::memcpy(sc.qb.data() + size_t(m) * d, src, sizeof(uint16_t) * d);
}

// Runs f(item, scratch) for item in [0, n), items pulled from a shared counter by every intra-op thread.
template <class F>
void run_items(int64_t n, int max_m, int d, int hd, const F& f) {
  if (n <= 0) return;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    Scratch sc(max_m, d, hd);
    for (int64_t t = b; t < e; ++t) {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i, sc);
    }
  });
}

// Online softmax attention of M = H * Mh query rows (sc.q [M, D] float32, already scaled) against n keys read
// in place: rows [h*Mh, (h+1)*Mh) use KV head h. Key j in [0, n) lives in slot slot[j]; a slot's row holds all
// H KV heads contiguously (H*D elements), so each key is one contiguous read for every head and query row.
// Row m sees keys j < lim[m] when lim is given (causal). State per row: running max sc.m, sum sc.l,
// unnormalized output sc.o [M, D]. Call init() first.
#if defined(__AVX2__) && defined(__FMA__)
// Pools whose rows the AVX2 row kernel reads in place (8 float32 lanes per load): float32, and float16 with F16C.
template <typename R>
constexpr bool kInPlace = std::is_same_v<R, float>
#if defined(__F16C__)
                          || std::is_same_v<R, at::Half>
#endif
    ;
#endif

template <typename R, int DT>
struct Rows {
  int H, Mh, M, D, HD;
  float scale;  // sc.q is already scaled; paths that read raw q (sc.qb) scale their scores
  Scratch& sc;
  Rows(int H_, int Mh_, int D_, float scale_, Scratch& sc_)
      : H(H_), Mh(Mh_), M(H_ * Mh_), D(DT ? DT : D_), HD(H_ * (DT ? DT : D_)), scale(scale_), sc(sc_) {}

  // Scale for scores computed from raw q: bf16 with dot-product instructions reads sc.qb (unscaled).
  float raw_q_scale() const {
#if defined(__AVX512BF16__)
    return scale;
#else
    return 1.0f;
#endif
  }

  void init() {
    std::fill_n(sc.m.data(), M, NEG_INF);
    std::fill_n(sc.l.data(), M, 0.0f);
    std::fill_n(sc.o.data(), size_t(M) * D, 0.0f);
  }

  // Online-softmax step of row m over its n new scores sm[0, n) (turned into exp(s - new max)): updates the
  // row's running max and sum, returns the factor its running output must be scaled by (0 when the row had no
  // keys yet: m = -inf).
  float softmax_row(int m, float* sm, int n) {
    float sum = 0.0f;
    const float mx = softmax_block(sm, n, sc.m[m], &sum);
    const float alpha = exp_f(sc.m[m] - mx);
    sc.m[m] = mx;
    sc.l[m] = sc.l[m] * alpha + sum;
    return alpha;
  }

  // kbase/vbase point at slot 0 of the layer; row_stride = elements between slots (Hkv * D).
  void attend(const int32_t* slot, int n, const R* kbase, const R* vbase, int64_t row_stride, const int* lim) {
    prefetch(slot, std::min(BLK, n), kbase, vbase, row_stride);
    for (int j0 = 0; j0 < n; j0 += BLK) {
      const int nb = std::min(BLK, n - j0);
      if (j0 + BLK < n) prefetch(slot + j0 + BLK, std::min(BLK, n - j0 - BLK), kbase, vbase, row_stride);
      block(slot + j0, nb, j0, kbase, vbase, row_stride, lim);
    }
  }

  // Slots are scattered (pages of any size, in any order), so the hardware prefetcher cannot follow them:
  // request the next block's K and V rows while this block computes.
  void prefetch(const int32_t* slot, int nb, const R* kbase, const R* vbase, int64_t rs) {
    const int bytes = HD * int(sizeof(R));
    for (int j = 0; j < nb; ++j) {
      const char* k = reinterpret_cast<const char*>(kbase + int64_t(slot[j]) * rs);
      const char* v = reinterpret_cast<const char*>(vbase + int64_t(slot[j]) * rs);
      for (int x = 0; x < bytes; x += 64) {
        __builtin_prefetch(k + x);
        __builtin_prefetch(v + x);
      }
    }
  }

#if defined(__AVX512BF16__)
  // block() for a bf16 pool, head size DT in {32, 64, 128} and no causal limit (decode rows, shared-prefix
  // rows): scores per row with q in registers, then per KV head the P.V of up to RP rows at once with their
  // accumulators in registers, each value row widened once for all of them. Same math as block().
  void block_fast(const int32_t* slot, int nb, const R* kbase, const R* vbase, int64_t rs) {
    constexpr int RP = 256 / DT;  // RP rows x DT / 16 accumulators = 16 registers
    const auto* kb = reinterpret_cast<const uint16_t*>(kbase);
    const auto* vb = reinterpret_cast<const uint16_t*>(vbase);
    float* s = sc.s.data();
    const uint16_t* krow[BLK];
    const uint16_t* vrow[BLK];
    for (int h = 0; h < H; ++h) {
      for (int j = 0; j < nb; ++j) krow[j] = kb + int64_t(slot[j]) * rs + h * DT;
      for (int mm = 0; mm < Mh; ++mm) {
        const int m = h * Mh + mm;
        const uint16_t* qb = sc.qb.data() + size_t(m) * DT;
        for (int j = 0; j < nb; j += 16)
          scores16_bf16<DT>(qb, krow + j, std::min(16, nb - j), raw_q_scale(), s + m * BLK + j);
      }
      for (int j = 0; j < nb; ++j) vrow[j] = vb + int64_t(slot[j]) * rs + h * DT;
      for (int r0 = 0; r0 < Mh; r0 += RP) {
        const int rows = std::min(RP, Mh - r0);
        float alpha[RP];
        float* o[RP];
        const float* p[RP];
        for (int r = 0; r < rows; ++r) {
          const int m = h * Mh + r0 + r;
          float* sm = s + m * BLK;
          alpha[r] = softmax_row(m, sm, nb);
          o[r] = sc.o.data() + size_t(m) * DT;
          p[r] = sm;
        }
        pv_rows<DT, RP>(o, alpha, p, rows, vrow, nb);
      }
    }
  }
#endif

  void block(const int32_t* slot, int nb, int j0, const R* kbase, const R* vbase, int64_t rs, const int* lim) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<R, uint16_t> && (DT == 32 || DT == 64 || DT == 128)) {
      if (lim == nullptr) return block_fast(slot, nb, kbase, vbase, rs);
    }
#endif
    const int d = D, hd = HD;
    float* kb = sc.kbuf.data();
    float* s = sc.s.data();
#if defined(__AVX512F__)
    if (!std::is_same_v<R, at::Half> && Mh <= SMALL_M && d % 32 == 0) {  // K in place, 16 keys per pass
      const R* krow[BLK];
      for (int h = 0; h < H; ++h) {
        for (int j = 0; j < nb; ++j) krow[j] = kbase + int64_t(slot[j]) * rs + h * d;
        for (int mm = 0; mm < Mh; ++mm) {
          const int m = h * Mh + mm;
          const float* q32 = sc.q.data() + size_t(m) * d;
          const uint16_t* qb = sc.qb.data() + size_t(m) * d;
          if constexpr (!std::is_same_v<R, at::Half>)
            for (int j = 0; j < nb; j += 16)
              scores16(q32, reinterpret_cast<const R*>(qb), krow + j, std::min(16, nb - j), d,
                       std::is_same_v<R, float> ? 1.0f : raw_q_scale(), s + m * BLK + j);
        }
      }
    } else
#elif defined(__AVX2__) && defined(__FMA__)
    if (kInPlace<R> && Mh <= SMALL_M && d % 8 == 0) {  // float32/float16 K read in place, 8 keys per pass
      using KR = std::conditional_t<kInPlace<R>, R, float>;  // (R itself whenever this branch runs)
      const KR* krow[BLK];
      for (int h = 0; h < H; ++h) {
        for (int j = 0; j < nb; ++j) krow[j] = reinterpret_cast<const KR*>(kbase + int64_t(slot[j]) * rs) + h * d;
        for (int mm = 0; mm < Mh; ++mm) {
          const int m = h * Mh + mm;
          for (int j = 0; j < nb; j += 8)
            scores8(sc.q.data() + size_t(m) * d, krow + j, std::min(8, nb - j), d, s + m * BLK + j);
        }
      }
    } else
#endif
    if (Mh <= SMALL_M) {  // kb [BLK, H*D]: dot products
      for (int j = 0; j < nb; ++j) to_f32(kbase + int64_t(slot[j]) * rs, kb + j * hd, hd);
      for (int m = 0; m < M; ++m) {
        const float* qm = sc.q.data() + size_t(m) * d;
        const float* kh = kb + (m / Mh) * d;
        for (int j = 0; j < nb; ++j) s[m * BLK + j] = dot(qm, kh + j * hd, d);
      }
    } else {  // kb [H*D, BLK]: a row's BLK scores accumulate in registers over d
      float tmp[512];
      for (int j = 0; j < nb; ++j) {
        const R* kr = kbase + int64_t(slot[j]) * rs;
        for (int x0 = 0; x0 < hd; x0 += 512) {
          const int w = std::min(512, hd - x0);
          to_f32(kr + x0, tmp, w);
          for (int x = 0; x < w; ++x) kb[(x0 + x) * BLK + j] = tmp[x];
        }
      }
      for (int j = nb; j < BLK; ++j)
        for (int x = 0; x < hd; ++x) kb[x * BLK + j] = 0.0f;
      for (int m = 0; m < M; ++m) {
        const float* qm = sc.q.data() + size_t(m) * d;
        const float* kh = kb + size_t(m / Mh) * d * BLK;
        float acc[BLK] = {};
        for (int x = 0; x < d; ++x) {
          const float qx = qm[x];
          const float* kx = kh + x * BLK;
#pragma omp simd
          for (int j = 0; j < BLK; ++j) acc[j] += qx * kx[j];
        }
        std::memcpy(s + m * BLK, acc, sizeof(acc));
      }
    }
    bool v_loaded = false;
    float* vb = sc.vbuf.data();
    for (int m = 0; m < M; ++m) {
      const int vis = lim ? std::min(nb, lim[m] - j0) : nb;  // keys of this block row m may see
      if (vis <= 0) continue;
      float* sm = s + m * BLK;
      const float alpha = softmax_row(m, sm, vis);
      float* om = sc.o.data() + size_t(m) * d;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
      if constexpr (kInPlace<R> && DT % 8 == 0 && DT > 0 && DT <= 128) {  // V rows read in place
        constexpr int NV = DT / 8;
        __m256 acc[NV];
        const __m256 av = _mm256_set1_ps(alpha);
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) acc[c] = _mm256_mul_ps(_mm256_loadu_ps(om + 8 * c), av);
        const R* vh0 = vbase + (m / Mh) * DT;
        for (int j = 0; j < vis; ++j) {
          const __m256 pv = _mm256_set1_ps(sm[j]);
          const R* vj = vh0 + int64_t(slot[j]) * rs;
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(pv, load8_f32(vj + 8 * c), acc[c]);
        }
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) _mm256_storeu_ps(om + 8 * c, acc[c]);
        continue;
      }
#endif
      if (!v_loaded) {
        for (int j = 0; j < nb; ++j) to_f32(vbase + int64_t(slot[j]) * rs, vb + j * hd, hd);
        v_loaded = true;
      }
      const float* vh = vb + (m / Mh) * d;
      if (DT) {
        float acc[DT ? DT : 1];
        for (int x = 0; x < DT; ++x) acc[x] = om[x] * alpha;
        for (int j = 0; j < vis; ++j) {
          const float p = sm[j];
          const float* vj = vh + j * hd;
#pragma omp simd
          for (int x = 0; x < DT; ++x) acc[x] += p * vj[x];
        }
        std::memcpy(om, acc, sizeof(float) * DT);
      } else {
        for (int x = 0; x < d; ++x) om[x] *= alpha;
        for (int j = 0; j < vis; ++j) {
          const float p = sm[j];
          const float* vj = vh + j * hd;
#pragma omp simd
          for (int x = 0; x < d; ++x) om[x] += p * vj[x];
        }
      }
    }
  }
};

inline void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              int64_t layer, const at::Tensor& loc) {
  const int64_t t = loc.size(0);
  if (t == 0) return;
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  const int64_t esz = k_cache.element_size();
  auto kk = k.to(k_cache.scalar_type()).contiguous();
  auto vv = v.to(v_cache.scalar_type()).contiguous();
  const int64_t* lp = loc.data_ptr<int64_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr()) + layer * k_cache.stride(0) * esz;
  char* vc = static_cast<char*>(v_cache.data_ptr()) + layer * v_cache.stride(0) * esz;
  const char* ks = static_cast<const char*>(kk.data_ptr());
  const char* vs = static_cast<const char*>(vv.data_ptr());
  for (int64_t i = 0; i < t; ++i) {
    std::memcpy(kc + lp[i] * row * esz, ks + i * row * esz, row * esz);
    std::memcpy(vc + lp[i] * row * esz, vs + i * row * esz, row * esz);
  }
}

inline void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& req_to_token, const at::Tensor& rows) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "radixgen cpu attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad q/cache ranks");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the K and V caches must share a dtype");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK((qt == ct && (qt == at::kFloat || qt == at::kBFloat16)) || (qt == at::kFloat && ct == at::kHalf),
              "q / cache dtypes: float32 / float32, bfloat16 / bfloat16 or float32 / float16 only, got ", qt, " / ",
              ct);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.is_contiguous(), "req_to_token int32");
  TORCH_CHECK(rows.scalar_type() == at::kLong, "row indices int64");
}

template <typename Q, typename R, template <typename, typename, int> class Fn, typename... Args>
void dispatch_d(const at::Tensor& q, Args&&... args) {
  switch (q.size(2)) {
    case 64: return Fn<Q, R, 64>::run(q, args...);
    case 128: return Fn<Q, R, 128>::run(q, args...);
    default: return Fn<Q, R, 0>::run(q, args...);
  }
}

// (q, pool) element types: (float, float), (bf16, bf16) or (float, float16) (check_inputs).
template <template <typename, typename, int> class Fn, typename... Args>
void dispatch(const at::Tensor& q, const at::Tensor& k_cache, Args&&... args) {
  if (k_cache.scalar_type() == at::kHalf) return dispatch_d<float, at::Half, Fn>(q, k_cache, args...);
  if (q.scalar_type() == at::kBFloat16) return dispatch_d<uint16_t, uint16_t, Fn>(q, k_cache, args...);
  return dispatch_d<float, float, Fn>(q, k_cache, args...);
}

}  // namespace RADIXGEN_NS
