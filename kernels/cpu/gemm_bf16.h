// The bf16 products of extend_amx.h's key blocks on CPUs without AMX: an AVX-512-BF16 (vdpbf16ps) micro-kernel
// over the same packed layouts, so bf16 pools keep bf16 blocks (half the packing traffic and cache footprint of
// float32 blocks, two multiply-adds per lane per instruction) where oneDNN has no VNNI bf16 brgemm.
// Used by extend_amx.h (extend's key blocks and decode's shared-prefix items).
//
// Both products of a block are C[M, N] (+)= A[M, K] x B[K, N] with K even, read as bf16 pairs:
//   A: rows of K bf16 (row stride lda elements): word (m, p) = A's pair (2p, 2p + 1) of row m;
//   B: 32-bit words [K/2, N] (row stride ldb words): word (p, n) = B's pair (rows 2p, 2p + 1) of column n.
// S = A x Bk is (A = queries [M, D], B = Bk [D/2, NB]); O += P x Bv is (A = P [M, NB], B = Bv [NB/2, D]) — the
// layouts pack_block writes for AMX, so packing is shared. vdpbf16ps multiplies bf16 pairs exactly and adds them
// in float32 (round to nearest even, denormal inputs and outputs flushed to zero); C stays float32.
// Register tile: MR rows x NR vectors of 16 floats (MR * NR <= 16 accumulators, NR loads of B per pair of K).

#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "vec_math.h"

namespace RADIXGEN_NS::amx {

// Which kernel multiplies bf16 blocks: brgemm (oneDNN's AMX tiles), dot (this file) or f32 (blocks converted to
// float32 while packing, float32 brgemm). Auto picks the first this machine has; an override (the
// radixgen::bf16_attn_gemm op, for tests and benchmarks; one process-wide value shared by every ISA variant)
// forces one.
enum class Bf16Gemm : int { automatic = 0, f32 = 1, dot = 2, brgemm = 3 };

// Auto picks dot only where it is the vdpbf16ps kernel; forcing it elsewhere runs dot_gemm's portable twin.
inline bool dot_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

inline Bf16Gemm bf16_gemm() {
  static const bool amx_ok = at::native::cpublas::could_pack(at::kBFloat16);
  const auto forced = Bf16Gemm(radixgen_cpu::bf16_gemm_override().load(std::memory_order_relaxed));
  if (forced != Bf16Gemm::automatic) return forced;
  return amx_ok ? Bf16Gemm::brgemm : dot_native() ? Bf16Gemm::dot : Bf16Gemm::f32;
}

// Sets the override ("auto", "f32", "dot", "brgemm"); fails on brgemm where oneDNN lacks it. Returns the mode
// now in effect.
inline const char* set_bf16_gemm(const std::string& mode) {
  static const char* names[] = {"auto", "f32", "dot", "brgemm"};
  int m = -1;
  for (int i = 0; i < 4; ++i)
    if (mode == names[i]) m = i;
  TORCH_CHECK(m >= 0, "bf16_attn_gemm: unknown mode '", mode, "' (auto, f32, dot, brgemm)");
  TORCH_CHECK(m != int(Bf16Gemm::brgemm) || at::native::cpublas::could_pack(at::kBFloat16),
              "bf16_attn_gemm: oneDNN has no bf16 brgemm on this CPU (AMX)");
  radixgen_cpu::bf16_gemm_override().store(m);
  return names[int(bf16_gemm())];
}

#if defined(__AVX512BF16__)
template <int MR, int NR>
inline void dot_tile(int K2, const uint32_t* a, int64_t lda_w, const uint32_t* b, int64_t ldb_w, float* c,
                     int64_t ldc, bool accumulate) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      acc[i][j] = accumulate ? _mm512_loadu_ps(c + i * ldc + j * 16) : _mm512_setzero_ps();
  for (int p = 0; p < K2; ++p) {
    __m512bh bv[NR];
    for (int j = 0; j < NR; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + p * ldb_w + j * 16);
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int(a[i * lda_w + p]));
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, acc[i][j]);
}

template <int MR>
inline void dot_rows(int N, int K2, const uint32_t* a, int64_t lda_w, const uint32_t* b, int64_t ldb_w, float* c,
                     int64_t ldc, bool accumulate) {
  int n = 0;
  for (; n + 64 <= N; n += 64) dot_tile<MR, 4>(K2, a, lda_w, b + n, ldb_w, c + n, ldc, accumulate);
  switch ((N - n) / 16) {
    case 3: dot_tile<MR, 3>(K2, a, lda_w, b + n, ldb_w, c + n, ldc, accumulate); break;
    case 2: dot_tile<MR, 2>(K2, a, lda_w, b + n, ldb_w, c + n, ldc, accumulate); break;
    case 1: dot_tile<MR, 1>(K2, a, lda_w, b + n, ldb_w, c + n, ldc, accumulate); break;
    default: break;
  }
}
#endif

// C[M, N] (+)= A[M, K] x B[K, N] in the pair layouts above; N % 16 == 0, K even. lda in bf16 elements (even),
// ldb in 32-bit words, ldc in floats.
inline void dot_gemm(int M, int N, int K, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                     float* c, int64_t ldc, bool accumulate) {
#if defined(__AVX512BF16__)
  const auto* aw = reinterpret_cast<const uint32_t*>(a);
  const int K2 = K / 2;
  const int64_t lda_w = lda / 2;
  int m = 0;
  for (; m + 4 <= M; m += 4) dot_rows<4>(N, K2, aw + m * lda_w, lda_w, b, ldb, c + m * ldc, ldc, accumulate);
  switch (M - m) {
    case 3: dot_rows<3>(N, K2, aw + m * lda_w, lda_w, b, ldb, c + m * ldc, ldc, accumulate); break;
    case 2: dot_rows<2>(N, K2, aw + m * lda_w, lda_w, b, ldb, c + m * ldc, ldc, accumulate); break;
    case 1: dot_rows<1>(N, K2, aw + m * lda_w, lda_w, b, ldb, c + m * ldc, ldc, accumulate); break;
    default: break;
  }
#else  // portable twin, same products and float32 sums: lets every machine test the layouts (forced "dot")
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc = accumulate ? c[m * ldc + n] : 0.0f;
      for (int p = 0; p < K / 2; ++p) {
        const uint32_t w = b[p * ldb + n];
        acc += bf16_to_f32(a[m * lda + 2 * p]) * bf16_to_f32(uint16_t(w & 0xffff)) +
               bf16_to_f32(a[m * lda + 2 * p + 1]) * bf16_to_f32(uint16_t(w >> 16));
      }
      c[m * ldc + n] = acc;
    }
#endif
}

}  // namespace RADIXGEN_NS::amx
