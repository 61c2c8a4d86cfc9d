// Extend through brgemm micro-kernels (oneDNN's, via ATen's cpublas): bf16 on CPUs whose kernels take
// VNNI-packed bf16 (AMX machines), bf16 through gemm_bf16.h's AVX-512-BF16 kernel on the same packed blocks
// elsewhere, float32 everywhere (kernels/cpu/attention_extend.cpp);
// decode's shared-prefix items reuse pack_block / start_rows / attend_block (decode_shared.h).
// Two phases per call:
//   pack:   every block of NB keys of the batch, per KV head, is read once through req_to_token and packed:
//           Bk = K^T in VNNI pairs [D/2, NB, 2], Bv = V in VNNI pairs [NB/2, D, 2] (pad keys zero). The
//           shared prefix (leading slots all requests have in common) is packed once for the whole batch.
//   attend: per item (request, block of nq <= QB queries) and KV head h, A = its queries of head h, rows
//           (query, g), [M = nq*G, D] bf16 (raw, unscaled); over the request's blocks in key order:
//             S = A x Bk (brgemm, float32 [M, NB]), scale, causal limit per row,
//             online softmax -> P ([M, NB], input dtype), O *= exp(old max - new max), O += P x Bv;
//           out = O / l.
// For bf16, P is rounded to bf16 before the second product (as the flash kernels of torch and SGLang do on
// CPU), and computed by vec_math.h's short 2^t (relative error 3e-6, far below bf16's 2^-9); everything else
// accumulates in float32. Causal rows skip the keys they cannot see in whole groups of 16 (dot path: 4 rows
// at a time), which leaves every result bit as the full product gives it.

#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm_bf16.h"
#include "vec_math.h"

namespace RADIXGEN_NS::amx {

constexpr int NB = 128;  // keys per brgemm block (a multiple of 32: whole AMX tiles, even VNNI pairs)
constexpr int DOT_ROWS = 4;  // rows of dot_gemm's register tile: the causal trim's granularity

// bf16 blocks need VNNI-packed brgemm kernels (AMX) or AVX-512-BF16 (gemm_bf16.h), unless forced to float32;
// float32 brgemm runs everywhere (oneDNN or cpublas gemm).
template <typename T>
inline bool available() {
  if constexpr (std::is_same_v<T, float>) return true;
  else return bf16_gemm() != Bf16Gemm::f32;
}

template <typename T>
using Elem = std::conditional_t<std::is_same_v<T, float>, float, at::BFloat16>;  // what brgemm takes

// A packed key block of one KV head: K^T then V, in brgemm's B layouts (elements of T).
inline size_t block_elems(int D) { return size_t(2) * D * NB; }

// bf16: Bk as 32-bit words [D/2, NB]: word (p, j) = K row j's bf16 pair (2p, 2p+1) (a 32-bit transpose);
//       Bv [NB/2, D, 2]: element (i, d, e) = V row (2i + e), column d (VNNI pairs).
// float: Bk [D, NB] = K^T; Bv [NB, D] = V rows.   Keys past nb are zero in both.
// R is the pool's element type, T the packed one (bf16 pools pack to float32 where bf16 brgemm is unavailable).
#if defined(__AVX512F__)
// 16 float32 lanes to 16 consecutive softmax weights (float32, or bf16 bits rounded to nearest even).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {  // rounded to nearest even, as f32_to_bf16
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int x = 0; x < 16; ++x) p[x] = f32_to_bf16(tmp[x]);
#endif
}

// In-register transpose of a 16 x 16 float32 tile: afterwards r[j] lane i = r[i] lane j before.
// Stage 1-2 (within 128-bit lanes): u[4a + c] lane k = rows 4a..4a+3 of column 4k + c; stage 3-4 move lanes.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  __m512 u[16];
  for (int a = 0; a < 4; ++a) {
    const __m512 *t0 = t + 4 * a, *t1 = t + 4 * a + 2;  // unpack lo/hi of rows (4a, 4a+1) and (4a+2, 4a+3)
    u[4 * a + 0] = _mm512_shuffle_ps(t0[0], t1[0], 0x44);
    u[4 * a + 1] = _mm512_shuffle_ps(t0[0], t1[0], 0xEE);
    u[4 * a + 2] = _mm512_shuffle_ps(t0[1], t1[1], 0x44);
    u[4 * a + 3] = _mm512_shuffle_ps(t0[1], t1[1], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), w = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 x = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 y = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(v, x, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(v, x, 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(w, y, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(w, y, 0xDD);
  }
}

// Row i < n of a 16 x 16 float32 tile is load(i) (rows past n are zero); writes column x of the tile, 16
// floats, to dst + x * NB: a block of 16 keys' values, transposed into Bk's rows.
template <typename Load>
inline void store_transposed16(const Load& load, int n, float* dst) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = i < n ? load(i) : _mm512_setzero_ps();
  if (n > 0) transpose16(r);
  for (int x = 0; x < 16; ++x) _mm512_storeu_ps(dst + size_t(x) * NB, r[x]);
}

// pack_block to float32 blocks (any pool type), D % 16 == 0: K^T by 16 x 16 register transposes (16 keys x
// 16 dims per tile), V rows widened 16 lanes at a time; keys past nb are zero.
template <typename R>
inline void pack_block_f32(const R* kbase, const R* vbase, int64_t rs, const int32_t* slot, int nb, int D,
                           float* dst) {
  const __m512 zero = _mm512_setzero_ps();
  float* bv = dst + size_t(D) * NB;
  for (int j0 = 0; j0 < NB; j0 += 16) {
    const int n = std::max(0, std::min(16, nb - j0));  // real keys of this group of 16
    for (int d0 = 0; d0 < D; d0 += 16)
      store_transposed16([&](int i) { return load16_f32(kbase + int64_t(slot[j0 + i]) * rs + d0); }, n,
                         dst + size_t(d0) * NB + j0);
    for (int i = 0; i < 16; ++i) {
      float* o = bv + size_t(j0 + i) * D;
      const R* vr = i < n ? vbase + int64_t(slot[j0 + i]) * rs : nullptr;
      for (int d0 = 0; d0 < D; d0 += 16) _mm512_storeu_ps(o + d0, vr ? load16_f32(vr + d0) : zero);
    }
  }
}
#endif

template <typename R, typename T>
inline void pack_block(const R* kbase, const R* vbase, int64_t rs, const int32_t* slot, int nb, int D, T* dst) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (D % 16 == 0) return pack_block_f32(kbase, vbase, rs, slot, nb, D, dst);
  }
#endif
  if constexpr (!std::is_same_v<R, T>) {  // bf16 or float16 pool -> float32 blocks
    for (int j = 0; j < NB; ++j) {
      if (j < nb) {
        const R* kr = kbase + int64_t(slot[j]) * rs;
        for (int d = 0; d < D; ++d) dst[d * NB + j] = to_float(kr[d]);
        to_f32(vbase + int64_t(slot[j]) * rs, dst + size_t(D) * NB + size_t(j) * D, D);
      } else {
        for (int d = 0; d < D; ++d) dst[d * NB + j] = 0.0f;
        std::fill_n(dst + size_t(D) * NB + size_t(j) * D, D, 0.0f);
      }
    }
    return;
  } else {
  constexpr bool bf = std::is_same_v<T, uint16_t>;
  static const T zeros[512] = {};
  const int W = bf ? D / 2 : D;  // 32-bit words per K row
  uint32_t* bk = reinterpret_cast<uint32_t*>(dst);
#if defined(__AVX512F__)
  if (W % 16 == 0) {  // K^T as 32-bit words by 16 x 16 register transposes (16 keys x 16 words per tile)
    for (int j0 = 0; j0 < NB; j0 += 16) {
      const int n = std::max(0, std::min(16, nb - j0));  // real keys of this group of 16
      for (int p0 = 0; p0 < W; p0 += 16) {  // the words move as float32 bits, unchanged
        auto row = [&](int i) { return reinterpret_cast<const float*>(kbase + int64_t(slot[j0 + i]) * rs) + p0; };
        store_transposed16([&](int i) { return _mm512_loadu_ps(row(i)); }, n,
                           reinterpret_cast<float*>(bk + size_t(p0) * NB + j0));
      }
    }
  } else
#endif
  {
    for (int j = 0; j < nb; ++j) {
      const uint32_t* kr = reinterpret_cast<const uint32_t*>(kbase + int64_t(slot[j]) * rs);
      for (int p = 0; p < W; ++p) bk[p * NB + j] = kr[p];
    }
    for (int p = 0; p < W; ++p)
      for (int j = nb; j < NB; ++j) bk[p * NB + j] = 0;
  }
  T* bv = dst + size_t(D) * NB;
  if constexpr (bf) {
    for (int i = 0; i < NB / 2; ++i) {
      const int j = 2 * i;
      const T* r0 = j < nb ? vbase + int64_t(slot[j]) * rs : zeros;
      const T* r1 = j + 1 < nb ? vbase + int64_t(slot[j + 1]) * rs : zeros;
      T* o = bv + size_t(i) * D * 2;
#pragma omp simd
      for (int d = 0; d < D; ++d) {
        o[2 * d] = r0[d];
        o[2 * d + 1] = r1[d];
      }
    }
  } else {
    for (int j = 0; j < NB; ++j)
      std::memcpy(bv + size_t(j) * D, j < nb ? vbase + int64_t(slot[j]) * rs : zeros, sizeof(T) * D);
  }
  }
}

// Row softmax step fused for the brgemm path: raw scores s[0, vis) (unscaled); returns the new running max
// (of scaled scores), writes P = exp(scale * s - max) as bf16 into p[0, NB) (zeros past vis), adds sum(P) to *sum.
template <typename T>
inline float softmax_to(const float* s, int vis, float scale, float old_max, T* p, float* sum) {
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(NEG_INF);
  for (int j = 0; j < vis; j += 16) {
    const __mmask16 k = j + 16 <= vis ? __mmask16(0xffff) : __mmask16((1u << (vis - j)) - 1);
    mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + j));
  }
  const float mx = std::max(old_max, _mm512_reduce_max_ps(mv) * scale);
  // float weights: exp by the accurate exp16; bf16 weights (rounded next): 2^(log2e (scale s - mx)), the short 2^t
  constexpr bool bf = !std::is_same_v<T, float>;
  const float c = bf ? LOG2E : 1.0f;
  const __m512 mxv = _mm512_set1_ps(mx * c), scv = _mm512_set1_ps(scale * c);
  __m512 acc = _mm512_setzero_ps();
  int j = 0;
  for (; j < vis; j += 16) {
    const __mmask16 k = head_mask16(vis - j);
    const __m512 t = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), scv, mxv);
    const __m512 e = _mm512_maskz_mov_ps(k, bf ? exp2_bf16w16(t) : exp16(t));
    acc = _mm512_add_ps(acc, e);
    store16(p + j, e);
  }
  for (; j < NB; j += 16) store16(p + j, _mm512_setzero_ps());
  *sum += _mm512_reduce_add_ps(acc);
  return mx;
#elif defined(__AVX2__) && defined(__FMA__)
  float mx = old_max;
  {
    __m256 mv = _mm256_set1_ps(NEG_INF);
    int j = 0;
    for (; j + 8 <= vis; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    mx = std::max(mx, hmax8(mv) * scale);
    for (; j < vis; ++j) mx = std::max(mx, s[j] * scale);
  }
  const __m256 mxv = _mm256_set1_ps(mx), scv = _mm256_set1_ps(scale);
  __m256 acc = _mm256_setzero_ps();
  alignas(32) float e8[8];
  for (int j = 0; j < NB; j += 8) {
    __m256 e = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), scv, mxv));
    if (j + 8 > vis) e = _mm256_and_ps(e, tail_mask8(vis - j));  // keys past vis (and pad keys) weigh 0
    acc = _mm256_add_ps(acc, e);
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(p + j, e);
    } else {
      _mm256_store_ps(e8, e);
      for (int x = 0; x < 8; ++x) p[j + x] = f32_to_bf16(e8[x]);
    }
  }
  *sum += hsum8(acc);
  return mx;
#else
  float mx = old_max;
  for (int j = 0; j < vis; ++j) mx = std::max(mx, s[j] * scale);
  float acc = 0.0f;
  for (int j = 0; j < NB; ++j) {
    const float e = j < vis ? exp_f(s[j] * scale - mx) : 0.0f;
    acc += e;
    if constexpr (std::is_same_v<T, float>) p[j] = e;
    else p[j] = f32_to_bf16(e);
  }
  *sum += acc;
  return mx;
#endif
}

template <typename T>
struct Block {
  const T* packed;  // pack_block output
  int j0, nb;              // keys [j0, j0 + nb) of the request
};

template <typename T>
struct Buffers {  // per thread, grown on demand
  std::vector<T> a, p, pack;  // pack: one block_elems(D) block (decode packs as it goes)
  std::vector<float> s, o, m, l;
  void reserve(int M, int D) {
    a.resize(size_t(M) * D);
    p.resize(size_t(M) * NB);
    s.resize(size_t(M) * NB);
    o.resize(size_t(M) * D);
    m.resize(M);
    l.resize(M);
  }
};

// Flash state of one (item, KV head) in b: A = its M query rows [M, D] (raw, unscaled; q_rows[m] points at row
// m, D contiguous), and per row the running max m (of scaled scores), sum l and unnormalized output o [M, D].
template <typename R, typename T>
inline void start_rows(const R* const* q_rows, int M, int D, Buffers<T>& b) {
  b.reserve(M, D);
  for (int m = 0; m < M; ++m) {
    if constexpr (std::is_same_v<R, T>) std::memcpy(b.a.data() + size_t(m) * D, q_rows[m], sizeof(T) * D);
    else to_f32(q_rows[m], b.a.data() + size_t(m) * D, D);
  }
  std::fill_n(b.m.data(), M, NEG_INF);
  std::fill_n(b.l.data(), M, 0.0f);
  std::fill_n(b.o.data(), size_t(M) * D, 0.0f);
}

// One packed key block into the state: S = A x Bk [M, NB]; row m sees the block's keys [0, vis), vis = nb, or
// min(nb, lim[m] - j0) with a causal limit lim (row m sees keys j < lim[m]); online softmax; O = O*alpha + P x Bv.
template <typename T>
inline void attend_block(const Block<T>& blk, const int* lim, int M, int D, float scale, Buffers<T>& b) {
  using at::native::cpublas::brgemm;
  using E = Elem<T>;
  constexpr bool vnni = std::is_same_v<T, uint16_t>;
  const auto* A = reinterpret_cast<const E*>(b.a.data());
  const auto* bk = reinterpret_cast<const E*>(blk.packed);
  const auto* bv = reinterpret_cast<const E*>(blk.packed + size_t(D) * NB);
  bool dot = false;  // bf16 blocks through gemm_bf16.h's vdpbf16ps kernel instead of brgemm
  if constexpr (vnni) dot = bf16_gemm() == Bf16Gemm::dot;
  auto vis_of = [&](int m) { return lim ? std::min(blk.nb, lim[m] - blk.j0) : blk.nb; };  // keys row m sees
  // dot path: rows in groups of DOT_ROWS (lim rises with m) multiply only the key columns the group's last
  // row sees (S: rounded up to 16 columns; P x Bv: to whole pairs). Dropped S columns are never read, dropped
  // P entries are zeros, so the result is the full product's.
  if (dot) {
    if constexpr (vnni)
      for (int m = 0; m < M; m += DOT_ROWS) {
        const int rows = std::min(DOT_ROWS, M - m), n = std::min(NB, (vis_of(m + rows - 1) + 15) & ~15);
        if (n > 0)
          dot_gemm(rows, n, D, b.a.data() + size_t(m) * D, D, reinterpret_cast<const uint32_t*>(blk.packed), NB,
                   b.s.data() + size_t(m) * NB, NB, false);
      }
  } else {
    brgemm(M, NB, D, D, NB, NB, false, A, bk, b.s.data(), vnni);
  }
  for (int m = 0; m < M; ++m) {
    float* sm = b.s.data() + size_t(m) * NB;
    T* pm = b.p.data() + size_t(m) * NB;
    const int vis = vis_of(m);
    if (vis <= 0) {
      std::fill_n(pm, NB, T(0));
      continue;
    }
    float sum = 0.0f;
    const float mx = softmax_to(sm, vis, scale, b.m[m], pm, &sum);
    const float alpha = exp_f(b.m[m] - mx);
    b.m[m] = mx;
    b.l[m] = b.l[m] * alpha + sum;
    if (alpha != 1.0f) {
      float* om = b.o.data() + size_t(m) * D;
      for (int x = 0; x < D; ++x) om[x] *= alpha;
    }
  }
  if (dot) {
    if constexpr (vnni)
      for (int m = 0; m < M; m += DOT_ROWS) {
        const int rows = std::min(DOT_ROWS, M - m), k = std::min(NB, (vis_of(m + rows - 1) + 1) & ~1);
        if (k > 0)
          dot_gemm(rows, D, k, b.p.data() + size_t(m) * NB, NB,
                   reinterpret_cast<const uint32_t*>(blk.packed + size_t(D) * NB), D, b.o.data() + size_t(m) * D,
                   D, true);
      }
  } else {
    brgemm(M, D, NB, NB, D, D, true, reinterpret_cast<const E*>(b.p.data()), bv, b.o.data(), vnni);
  }
}

// One (item, KV head) over packed key blocks in key order; row m sees keys j < lim[m]; out_rows[m] receives
// the normalized result (R).
template <typename R, typename T>
inline void attend_head(const R* const* q_rows, const int* lim, int M, int D, const Block<T>* blocks,
                        int n_blocks, float scale, R* const* out_rows, Buffers<T>& b) {
  start_rows(q_rows, M, D, b);
  for (int k = 0; k < n_blocks; ++k) attend_block(blocks[k], lim, M, D, scale, b);
  for (int m = 0; m < M; ++m) {
    float* om = b.o.data() + size_t(m) * D;
    const float inv = 1.0f / b.l[m];
    for (int x = 0; x < D; ++x) om[x] *= inv;
    from_f32(om, out_rows[m], D);
  }
}

}  // namespace RADIXGEN_NS::amx
