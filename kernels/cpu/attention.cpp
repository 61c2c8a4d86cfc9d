// Native CPU attention over radixgen's paged KV pool (one translation unit, built by kernels/cpu/build.py).
//
// Pool: k_cache, v_cache [L, S, Hkv, D] contiguous; slot s of layer l holds K[l, s, h, :] for every KV head h.
// Request row r's i-th token lives in slot req_to_token[r, i] (int32). Nothing is gathered into a padded copy:
// the kernels walk req_to_token and read each key/value row in place, one block of BLK keys at a time.
//
// Ops (registered under radixgen::, schemas at the bottom; kernels/cpu/ops.py documents them for Python):
//   decode  : B requests x 1 new token. Work items are (KV head, key chunk) for the shared prefix (all B*G query
//             rows of that KV head against one chunk: the prefix is read once per layer) and (request, KV head,
//             key chunk) for each request's own keys (split-KV). Each item leaves a partial (o, lse) per query row;
//             a merge pass combines them by log-sum-exp. Items are pulled dynamically by every thread. With
//             B*G >= 16 rows per KV head the prefix items run on brgemm instead (decode_shared.h: one item per
//             (KV head, chunk of whole 128-key blocks), bf16 blocks on AMX tiles or AVX-512-BF16 (gemm_bf16.h), or
//             float32 brgemm); else the row kernel.
//   extend  : ragged new tokens (E_b per request after P_b cached ones), flash-style online softmax per
//             (request, block of QB queries); query i of request b sees keys [0, P_b + i]. For head_dim % 32 == 0
//             it runs on brgemm micro-kernels over key blocks packed once per call, the shared prefix once for
//             the batch (extend_amx.h: bf16 AMX tiles where oneDNN has them, else bf16 vdpbf16ps where the CPU
//             has AVX-512-BF16 (gemm_bf16.h), else float32 brgemm); other head
//             sizes take the row kernel below.
// Numerics: inputs float32 or bfloat16, scores/softmax/accumulators float32, outputs in the input dtype; a
// float16 pool (--kv-cache-dtype float16) under float32 q is widened as read (F16C in the AVX2 row kernel) and
// takes the row kernel for decode's shared prefix, the float32 brgemm path (converted while packing) for extend.
// GQA: the G = Hq / Hkv query heads of a KV head are rows of the same item, so each K/V row is read once for them.
// The row kernels are plain C++ for the compiler's vectorizer (-O3 -march=native: AVX2 or AVX-512), with
// AVX-512 / AVX-512-BF16 intrinsics behind #if for the hot decode loops; the same source builds on any x86-64
// (and aarch64) machine, specialised for the CPU that compiles it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

#include "row_math.h"  // BLK, QB, SMALL_M, conversions, exp_neg, dot, scores16, pv_rows, softmax_block

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
    const float alpha = exp_neg(sc.m[m] - mx);
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
          for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(pv, load8(vj + 8 * c), acc[c]);
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

#include "gemm_bf16.h"
#include "extend_amx.h"
#include "decode_shared.h"

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
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

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
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

// Q: q and output element (float or bf16 bits), R: pool element (the same, or at::Half under float32 q).
template <typename Q, typename R, int DT>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer,
                 const at::Tensor& r2t, const at::Tensor& rows_t, const at::Tensor& lens_t, int64_t shared_len,
                 double scale, at::Tensor& out) {
  const int B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), G = Hq / Hkv;
  const int64_t rs = int64_t(Hkv) * D, C = r2t.size(1);
  const R* kl = reinterpret_cast<const R*>(k_cache.data_ptr()) + layer * k_cache.stride(0);
  const R* vl = reinterpret_cast<const R*>(v_cache.data_ptr()) + layer * v_cache.stride(0);
  const Q* qp = reinterpret_cast<const Q*>(q.data_ptr());
  Q* op = reinterpret_cast<Q*>(out.data_ptr());
  const int32_t* tab = r2t.data_ptr<int32_t>();
  const int64_t* rows = rows_t.data_ptr<int64_t>();
  const int64_t* lens = lens_t.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  int64_t P = shared_len, total = 0;
  for (int b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= C, "decode: bad sequence length ", lens[b]);
    total += lens[b];
  }
  TORCH_CHECK(P >= 0 && (B == 0 || P < *std::min_element(lens, lens + B)), "decode: shared prefix too long");
  if (B < 2) P = 0;
  total -= int64_t(B - 1) * P;  // keys actually read per KV head
  // Chunk length: about 8 items per thread, at least one block.
  const int threads = at::get_num_threads();
  const int64_t target = 8LL * threads;
  int64_t chunk = (total + target - 1) / target;
  chunk = std::max<int64_t>(BLK, (chunk + BLK - 1) / BLK * BLK);
  // Shared prefix: n_pre chunks of pre_chunk keys, each a partial of every row. Row kernel: one item per chunk
  // (all KV heads); brgemm: one item per (chunk, KV head), item it = c * Hkv + h.
  const amx::SharedPath path = P > 0 ? amx::shared_path<R>(B * G, D) : amx::SharedPath::rows;
  const bool gemm = path != amx::SharedPath::rows;
  const int64_t pre_chunk = gemm ? amx::shared_chunk(P, Hkv, threads) : chunk;
  const int64_t n_pre = (P + pre_chunk - 1) / pre_chunk;
  std::vector<int64_t> n_own(B), item_start(B + 1);
  int64_t max_parts = 0;
  item_start[0] = gemm ? n_pre * Hkv : n_pre;
  for (int b = 0; b < B; ++b) {
    n_own[b] = (lens[b] - P + chunk - 1) / chunk;
    max_parts = std::max(max_parts, n_pre + n_own[b]);
    item_start[b + 1] = item_start[b] + n_own[b];
  }
  // Partials: o [B, max_parts, Hq, D], lse [B, max_parts, Hq] (float32); request b's are [0, n_pre + n_own[b]).
  std::vector<float> part_o(size_t(B) * max_parts * Hq * D), part_lse(size_t(B) * max_parts * Hq);
  auto part = [&](int b, int64_t p) { return (int64_t(b) * max_parts + p) * Hq; };
  const float sc = float(scale);
  auto save = [&](const float* o, float m, float l, int64_t dst_row) {  // a row's normalized output and lse
    const float inv = 1.0f / l;
    float* dst = part_o.data() + dst_row * D;
    for (int x = 0; x < D; ++x) dst[x] = o[x] * inv;
    part_lse[dst_row] = m + std::log(l);
  };
  // brgemm prefix item: chunk c, KV head h, rows (b, g) of A are request b's query head h*G + g.
  auto gemm_item = [&]<typename T>(int64_t it) {
    thread_local amx::Buffers<T> buf;
    const int64_t c = it / Hkv, j0 = c * pre_chunk, n = std::min(pre_chunk, P - j0);
    const int h = it % Hkv, M = B * G;
    std::vector<const Q*> qr(M);
    for (int b = 0; b < B; ++b)
      for (int g = 0; g < G; ++g) qr[b * G + g] = qp + b * qs0 + (h * G + g) * qs1;
    amx::attend_keys(amx::KvView<R>{kl + h * D, vl + h * D, rs}, tab + rows[0] * C + j0, int(n), qr.data(), M, D,
                     sc, buf);
    for (int m = 0; m < M; ++m)
      save(buf.o.data() + size_t(m) * D, buf.m[m], buf.l[m], part(m / G, c) + h * G + m % G);
    at::native::cpublas::brgemm_release();
  };
  const int max_m = std::max(Hq, P > 0 && !gemm ? B * Hq : 0);
  run_items(item_start[B], max_m, D, Hkv * D, [&](int64_t it, Scratch& s) {
    if (it < item_start[0] && gemm) {
      if constexpr (std::is_same_v<R, uint16_t>) {
        if (path == amx::SharedPath::brgemm_bf16) return gemm_item.template operator()<uint16_t>(it);
      }
      return gemm_item.template operator()<float>(it);
    }
    if (it < item_start[0]) {  // shared prefix chunk c = it, all B*Hq rows ordered (h, b, g)
      const int64_t j0 = it * chunk, n = std::min(chunk, P - j0);
      Rows<R, DT> rw(Hkv, B * G, D, sc, s);
      for (int h = 0; h < Hkv; ++h)
        for (int b = 0; b < B; ++b)
          for (int g = 0; g < G; ++g) load_q(s, (h * B + b) * G + g, qp + b * qs0 + (h * G + g) * qs1, D, sc);
      rw.init();
      rw.attend(tab + rows[0] * C + j0, n, kl, vl, rs, nullptr);
      for (int m = 0; m < rw.M; ++m) {
        const int h = m / (B * G), b = (m / G) % B, g = m % G;
        save(s.o.data() + size_t(m) * D, s.m[m], s.l[m], part(b, it) + h * G + g);
      }
      return;
    }
    // request b's own keys, chunk c; rows are its Hq query heads in order (h, g)
    const int b = std::upper_bound(item_start.begin(), item_start.end(), it) - item_start.begin() - 1;
    const int64_t c = it - item_start[b], j0 = P + c * chunk, n = std::min(chunk, lens[b] - j0);
    Rows<R, DT> rw(Hkv, G, D, sc, s);
    for (int hq = 0; hq < Hq; ++hq) load_q(s, hq, qp + b * qs0 + hq * qs1, D, sc);
    rw.init();
    rw.attend(tab + rows[b] * C + j0, n, kl, vl, rs, nullptr);
    for (int hq = 0; hq < Hq; ++hq) save(s.o.data() + size_t(hq) * D, s.m[hq], s.l[hq], part(b, n_pre + c) + hq);
  });
  // Merge: out[b, hq] = sum_p exp(lse_p - lse) * o_p.
  at::parallel_for(0, int64_t(B) * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int b = bh / Hq, hq = bh % Hq;
      const int64_t np = n_pre + n_own[b];
      float mx = NEG_INF;
      for (int64_t p = 0; p < np; ++p) mx = std::max(mx, part_lse[part(b, p) + hq]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float wsum = 0.0f;
      for (int64_t p = 0; p < np; ++p) {
        const float w = std::exp(part_lse[part(b, p) + hq] - mx);
        wsum += w;
        const float* o = part_o.data() + (part(b, p) + hq) * D;
        for (int x = 0; x < D; ++x) acc[x] += w * o[x];
      }
      const float inv = 1.0f / wsum;
      for (int x = 0; x < D; ++x) acc[x] *= inv;
      from_f32(acc.data(), op + bh * D, D);
    }
  });
}

template <typename Q, typename R, int DT>
void extend_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer,
                 const at::Tensor& r2t, const at::Tensor& rows_t, const at::Tensor& pre_t, const at::Tensor& ext_t,
                 int64_t shared_len, double scale, at::Tensor& out) {
  const int Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), G = Hq / Hkv;
  const int B = rows_t.size(0);
  const int64_t rs = int64_t(Hkv) * D, C = r2t.size(1);
  const R* kl = reinterpret_cast<const R*>(k_cache.data_ptr()) + layer * k_cache.stride(0);
  const R* vl = reinterpret_cast<const R*>(v_cache.data_ptr()) + layer * v_cache.stride(0);
  const Q* qp = reinterpret_cast<const Q*>(q.data_ptr());
  Q* op = reinterpret_cast<Q*>(out.data_ptr());
  const int32_t* tab = r2t.data_ptr<int32_t>();
  const int64_t* rows = rows_t.data_ptr<int64_t>();
  const int64_t* pre = pre_t.data_ptr<int64_t>();
  const int64_t* ext = ext_t.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  // Items (request b, block of QB queries), all KV heads each, the longest key ranges first for load balance.
  struct Item { int b; int64_t q0; int64_t keys; };
  std::vector<Item> items;
  std::vector<int64_t> start(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    TORCH_CHECK(pre[b] >= 0 && ext[b] >= 0 && pre[b] + ext[b] <= C, "extend: bad lengths");
    start[b + 1] = start[b] + ext[b];
    for (int64_t q0 = 0; q0 < ext[b]; q0 += QB) items.push_back({b, q0, pre[b] + std::min(q0 + QB, ext[b])});
  }
  TORCH_CHECK(start[B] == q.size(0), "extend: sum of extend lengths != number of query tokens");
  TORCH_CHECK(shared_len >= 0 && (B == 0 || shared_len <= *std::min_element(pre, pre + B)),
              "extend: shared prefix longer than a cached prefix");
  if (B < 2) shared_len = 0;
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  const float sc = float(scale);
  // Through brgemm: packed blocks of T = R (float32; bf16 where VNNI bf16 kernels exist) or float32 (bf16 pools
  // elsewhere, converted while packing).
  auto brgemm_path = [&]<typename T>() {
    {
      // Key blocks: the shared prefix [0, P0) once, then each request's own keys [P0, pre + ext).
      const int64_t nS = (shared_len + amx::NB - 1) / amx::NB;
      std::vector<int64_t> first(B + 1);  // request b's own blocks: [first[b], first[b + 1])
      first[0] = nS;
      for (int b = 0; b < B; ++b) first[b + 1] = first[b] + (pre[b] + ext[b] - shared_len + amx::NB - 1) / amx::NB;
      const int64_t n_blk = first[B];
      const size_t be = amx::block_elems(D);
      thread_local std::vector<T> pack_buf;  // reused across calls made from this (caller) thread
      if (pack_buf.size() < size_t(n_blk) * Hkv * be) pack_buf.resize(size_t(n_blk) * Hkv * be);
      T* const packed = pack_buf.data();  // [n_blk, Hkv, be]
      auto key_block = [&](int b, int64_t k, int* j0, int* nb) {  // block k of request b (k < nS: shared)
        const int64_t start_key = k < nS ? k * amx::NB : shared_len + (k - first[b]) * amx::NB;
        const int64_t end_key = k < nS ? shared_len : pre[b] + ext[b];
        *j0 = int(start_key);
        *nb = int(std::min<int64_t>(amx::NB, end_key - start_key));
      };
      std::vector<int> owner(n_blk, 0);  // request whose slots a block reads (shared: request 0)
      for (int b = 0; b < B; ++b)
        for (int64_t k = first[b]; k < first[b + 1]; ++k) owner[k] = b;
      run_items(n_blk * Hkv, 1, D, D, [&](int64_t u, Scratch&) {
        const int64_t k = u / Hkv;
        const int h = u % Hkv, b = owner[k];
        int j0, nb;
        key_block(b, k, &j0, &nb);
        amx::pack_block(kl + h * D, vl + h * D, rs, tab + rows[b] * C + j0, nb, D,
                        packed + (size_t(k) * Hkv + h) * be);
      });
      run_items(items.size(), 1, D, D, [&](int64_t i, Scratch&) {
        thread_local amx::Buffers<T> buf;
        const Item it = items[i];
        const int nq = std::min<int64_t>(QB, ext[it.b] - it.q0), M = nq * G;
        std::vector<const Q*> qr(M);
        std::vector<Q*> orow(M);
        std::vector<int> lim(M);
        std::vector<amx::Block<T>> blocks;
        for (int h = 0; h < Hkv; ++h) {
          blocks.clear();
          auto add = [&](int64_t k) {
            int j0, nb;
            key_block(it.b, k, &j0, &nb);
            if (j0 < it.keys) blocks.push_back({packed + (size_t(k) * Hkv + h) * be, j0, nb});
          };
          for (int64_t k = 0; k < nS; ++k) add(k);
          for (int64_t k = first[it.b]; k < first[it.b + 1]; ++k) add(k);
          for (int qi = 0; qi < nq; ++qi) {
            const int64_t t = start[it.b] + it.q0 + qi;
            for (int g = 0; g < G; ++g) {
              qr[qi * G + g] = qp + t * qs0 + (h * G + g) * qs1;
              orow[qi * G + g] = op + t * int64_t(Hq) * D + (h * G + g) * D;
              lim[qi * G + g] = int(pre[it.b] + it.q0 + qi + 1);
            }
          }
          amx::attend_head(qr.data(), lim.data(), M, D, blocks.data(), int(blocks.size()), sc, orow.data(), buf);
        }
        at::native::cpublas::brgemm_release();
      });
    }
  };
  if (D % 32 == 0 && D <= 256) {
    if constexpr (std::is_same_v<R, uint16_t>) {
      if (amx::available<uint16_t>()) brgemm_path.template operator()<uint16_t>();
      else brgemm_path.template operator()<float>();
    } else {
      brgemm_path.template operator()<float>();
    }
    return;
  }
  run_items(items.size(), QB * Hq, D, Hkv * D, [&](int64_t i, Scratch& s) {
    const Item it = items[i];
    const int nq = std::min<int64_t>(QB, ext[it.b] - it.q0);
    Rows<R, DT> rw(Hkv, nq * G, D, sc, s);  // rows ordered (h, query, g)
    for (int h = 0; h < Hkv; ++h) {
      for (int qi = 0; qi < nq; ++qi) {
        const int64_t t = start[it.b] + it.q0 + qi;
        for (int g = 0; g < G; ++g) {
          const int m = (h * nq + qi) * G + g;
          load_q(s, m, qp + t * qs0 + (h * G + g) * qs1, D, sc);
          s.lim[m] = int(pre[it.b] + it.q0 + qi + 1);
        }
      }
    }
    rw.init();
    rw.attend(tab + rows[it.b] * C, int(it.keys), kl, vl, rs, s.lim.data());
    for (int m = 0; m < rw.M; ++m) {
      const int h = m / (nq * G), qi = (m / G) % nq, g = m % G;
      const int64_t t = start[it.b] + it.q0 + qi;
      float* om = s.o.data() + size_t(m) * D;
      const float inv = 1.0f / s.l[m];
      for (int x = 0; x < D; ++x) om[x] *= inv;
      from_f32(om, op + t * int64_t(Hq) * D + (h * G + g) * D, D);
    }
  });
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

template <typename Q, typename R, int DT>
struct DecodeFn {
  template <typename... A>
  static void run(const at::Tensor& q, A&&... a) { decode_impl<Q, R, DT>(q, a...); }
};
template <typename Q, typename R, int DT>
struct ExtendFn {
  template <typename... A>
  static void run(const at::Tensor& q, A&&... a) { extend_impl<Q, R, DT>(q, a...); }
};

at::Tensor decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                  at::Tensor v_cache, int64_t layer, const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                  const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, int64_t shared_len, double scale) {
  check_inputs(q, k_cache, v_cache, req_to_token, req_pool_indices);
  TORCH_CHECK(req_pool_indices.size(0) == q.size(0) && seq_lens.size(0) == q.size(0), "decode: batch sizes");
  TORCH_CHECK(q.stride(2) == 1, "q's last dim must be contiguous");
  store_kv(k, v, k_cache, v_cache, layer, out_cache_loc.to(at::kLong).contiguous());
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto rows = req_pool_indices.contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  dispatch<DecodeFn>(q, k_cache, v_cache, layer, req_to_token, rows, lens, shared_len, scale, out);
  return out;
}

at::Tensor extend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                  at::Tensor v_cache, int64_t layer, const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                  const at::Tensor& req_pool_indices, const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                  int64_t shared_len, double scale) {
  check_inputs(q, k_cache, v_cache, req_to_token, req_pool_indices);
  TORCH_CHECK(q.stride(2) == 1, "q's last dim must be contiguous");
  store_kv(k, v, k_cache, v_cache, layer, out_cache_loc.to(at::kLong).contiguous());
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto rows = req_pool_indices.contiguous();
  auto pre = prefix_lens.to(at::kLong).contiguous();
  auto ext = extend_lens.to(at::kLong).contiguous();
  dispatch<ExtendFn>(q, k_cache, v_cache, layer, req_to_token, rows, pre, ext, shared_len, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(radixgen, m) {
  m.def(
      "attn_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, "
      "Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int shared_len, "
      "float scale) -> Tensor");
  m.def(
      "attn_extend(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, "
      "Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor prefix_lens, "
      "Tensor extend_lens, int shared_len, float scale) -> Tensor");
}

// Selects the bf16 key-block kernel (tests and benchmarks); not a tensor op, so it is registered as a
// catch-all kernel and runs with any (or no) tensors around.
static std::string bf16_attn_gemm(const std::string& mode) { return amx::set_bf16_gemm(mode); }

TORCH_LIBRARY_FRAGMENT(radixgen, m) {
  m.def("bf16_attn_gemm(str mode) -> str", &bf16_attn_gemm);
}

TORCH_LIBRARY_IMPL(radixgen, CPU, m) {
  m.impl("attn_decode", &decode);
  m.impl("attn_extend", &extend);
}
