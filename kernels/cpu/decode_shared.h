// Decode's shared-prefix (cascade) items through brgemm (kernels/cpu/attention_decode.cpp).
//
// A shared-prefix item of decode is one KV head h and one chunk [j0, j0 + n) of the prefix keys, against all
// M = B * G query rows of h (request b's query heads h*G .. h*G + G-1, rows ordered (b, g)): a GEMM shape,
// S = Q [M, D] x K^T [D, n], so it runs on extend_amx.h's micro-kernels: the chunk is packed one block of NB keys
// at a time into a per-thread buffer (read once, used by all M rows while in L1/L2), then attend_block.
// Each row leaves a partial (o normalized, lse) that decode's merge pass combines with the row's own keys.
// Numerics as extend: scores, softmax and O in float32; for bf16 the probabilities P round to bf16 before P x V.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "extend_amx.h"

namespace RADIXGEN_NS::amx {

// Which kernel runs decode's shared-prefix items.
enum class SharedPath { rows, brgemm_bf16, brgemm_f32 };

// Measured on a 2-core AMX Xeon (1,500 shared + 100 own keys, G = 3): at B = 6 (M = 18) brgemm takes bf16 0.18
// vs 0.33 ms per layer, float32 0.33 vs 0.39; B = 4 (M = 12) was not measured on brgemm.
// bf16 AMX tiles beat the row kernel from M = B*G >= GEMM_MIN_ROWS; float32 brgemm (AVX-512 FMA) does too.
// A float16 pool under float32 q (AVX-512 variant) packs its blocks to float32: on a 2-vCPU Ice Lake, 16 rows
// over a 2,150-key prefix (bench/step_profile.py `rag`) the row kernel's shared pass ran at ~42 GFLOP/s.
constexpr int GEMM_MIN_ROWS = 16;

template <typename R>
inline SharedPath shared_path(int M, int D) {
  if (M < GEMM_MIN_ROWS || D % 32 != 0 || D > 256) return SharedPath::rows;
  if constexpr (std::is_same_v<R, float>) return SharedPath::brgemm_f32;
  else if constexpr (std::is_same_v<R, uint16_t>)
    return available<uint16_t>() ? SharedPath::brgemm_bf16 : SharedPath::rows;  // AMX brgemm or vdpbf16ps
  else {
#if defined(__AVX512F__)
    return SharedPath::brgemm_f32;  // float16 pools: widened to float32 while packing (extend_amx.h)
#else
    return SharedPath::rows;  // float16 pools without AVX-512: the row kernel (F16C in place)
#endif
  }
}

// Keys per shared-prefix chunk: whole NB blocks, few enough items per KV head that each amortizes its setup
// (copying A, writing M partials), enough (about 4 per thread over all heads) to balance the threads.
inline int64_t shared_chunk(int64_t P, int Hkv, int threads) {
  const int64_t n_blk = (P + NB - 1) / NB;
  const int64_t per = std::max<int64_t>(1, n_blk * Hkv / (4 * int64_t(threads)));
  return per * NB;
}

template <typename R>
struct KvView {  // one KV head of a layer: key / value row of slot s at k + s * rs, v + s * rs (D contiguous)
  const R* k;
  const R* v;
  int64_t rs;
};

// Attends the M query rows q_rows (raw, unscaled) to the n keys in slots slot[0, n), no causal limit; leaves
// the flash state (b.o unnormalized, b.m, b.l) for the caller to read. R: pool type, T: packed type.
template <typename R, typename Q, typename T>
inline void attend_keys(const KvView<R>& kv, const int32_t* slot, int n, const Q* const* q_rows, int M, int D,
                        float scale, Buffers<T>& b) {
  start_rows(q_rows, M, D, b);
  b.pack.resize(block_elems(D));
  for (int j0 = 0; j0 < n; j0 += NB) {
    const int nb = std::min(NB, n - j0);
    pack_block(kv.k, kv.v, kv.rs, slot + j0, nb, D, b.pack.data());
    attend_block(Block<T>{b.pack.data(), j0, nb}, nullptr, M, D, scale, b);
  }
}

}  // namespace RADIXGEN_NS::amx
