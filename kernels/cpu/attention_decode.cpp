// Native CPU decode attention over radixgen's paged KV pool (pool layout: kernels/cpu/attention_rows.h).
// Compiled once per ISA variant (kernels/cpu/isa.h); registered as radixgen::attn_decode by dispatch.cpp
// (kernels/cpu/ops.py documents the op for Python).
//
// B requests x 1 new token. Work items are (KV head, key chunk) for the shared prefix (all B*G query rows of that
// KV head against one chunk: the prefix is read once per layer) and (request, KV head, key chunk) for each
// request's own keys (split-KV). Rows no longer than the shared prefix (a compiled graph's padding rows, a short
// request) skip the shared items and read all their keys as their own. Each item leaves a partial (o, lse) per query row; a merge pass combines them by
// log-sum-exp. Items are pulled dynamically by every thread. With B*G >= 16 rows per KV head the prefix items run
// on brgemm instead (decode_shared.h: one item per (KV head, chunk of whole 128-key blocks), bf16 blocks on AMX
// tiles or AVX-512-BF16 (gemm_bf16.h), or float32 brgemm); else the row kernel (attention_rows.h).
// Numerics: inputs float32 or bfloat16, scores/softmax/accumulators float32, outputs in the input dtype; a
// float16 pool (--kv-cache-dtype float16) under float32 q is widened as read (F16C in the AVX2 row kernel); its
// shared prefix takes float32 brgemm in the AVX-512 variant (blocks widened while packing), else the row kernel.
// GQA: the G = Hq / Hkv query heads of a KV head are rows of the same item, so each K/V row is read once for them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_rows.h"
#include "decode_shared.h"
#include "isa.h"

namespace RADIXGEN_NS {
namespace {

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
  TORCH_CHECK(P >= 0 && P < C, "decode: bad shared prefix length ", P);
  // Sharing rows sh: those longer than P (their first P slots are those of sh[0]); a shorter row (a graph's
  // padding row, a short request) reads all its keys itself.
  std::vector<int> sh;
  for (int b = 0; b < B; ++b)
    if (lens[b] > P) sh.push_back(b);
  if (sh.size() < 2) P = 0;
  if (P == 0) {
    sh.resize(B);
    for (int b = 0; b < B; ++b) sh[b] = b;
  }
  const int S = int(sh.size());
  std::vector<int64_t> off(B, 0);  // first key of row b's own items
  for (int b : sh) off[b] = P;
  total -= int64_t(S - 1) * P;  // keys actually read per KV head
  // Chunk length: about 8 items per thread, at least one block.
  const int threads = at::get_num_threads();
  const int64_t target = 8LL * threads;
  int64_t chunk = (total + target - 1) / target;
  chunk = std::max<int64_t>(BLK, (chunk + BLK - 1) / BLK * BLK);
  // Shared prefix: n_pre chunks of pre_chunk keys, each a partial of every row. Row kernel: one item per chunk
  // (all KV heads); brgemm: one item per (chunk, KV head), item it = c * Hkv + h.
  const amx::SharedPath path = P > 0 ? amx::shared_path<R>(S * G, D) : amx::SharedPath::rows;
  const bool gemm = path != amx::SharedPath::rows;
  const int64_t pre_chunk = gemm ? amx::shared_chunk(P, Hkv, threads) : chunk;
  const int64_t n_pre = (P + pre_chunk - 1) / pre_chunk;
  std::vector<int64_t> n_own(B), item_start(B + 1);
  int64_t max_parts = 0;
  item_start[0] = gemm ? n_pre * Hkv : n_pre;
  for (int b = 0; b < B; ++b) {
    n_own[b] = (lens[b] - off[b] + chunk - 1) / chunk;
    max_parts = std::max(max_parts, n_pre + n_own[b]);
    item_start[b + 1] = item_start[b] + n_own[b];
  }
  // Partials: o [B, max_parts, Hq, D], lse [B, max_parts, Hq] (float32); request b's are [0, n_pre + n_own[b])
  // if it shares the prefix, else [n_pre, n_pre + n_own[b]).
  std::vector<float> part_o(size_t(B) * max_parts * Hq * D), part_lse(size_t(B) * max_parts * Hq);
  auto part = [&](int b, int64_t p) { return (int64_t(b) * max_parts + p) * Hq; };
  const float sc = float(scale);
  auto save = [&](const float* o, float m, float l, int64_t dst_row) {  // a row's normalized output and lse
    const float inv = 1.0f / l;
    float* dst = part_o.data() + dst_row * D;
    for (int x = 0; x < D; ++x) dst[x] = o[x] * inv;
    part_lse[dst_row] = m + std::log(l);
  };
  // brgemm prefix item: chunk c, KV head h, rows (i, g) of A are sharing request sh[i]'s query head h*G + g.
  auto gemm_item = [&]<typename T>(int64_t it) {
    thread_local amx::Buffers<T> buf;
    const int64_t c = it / Hkv, j0 = c * pre_chunk, n = std::min(pre_chunk, P - j0);
    const int h = it % Hkv, M = S * G;
    std::vector<const Q*> qr(M);
    for (int i = 0; i < S; ++i)
      for (int g = 0; g < G; ++g) qr[i * G + g] = qp + sh[i] * qs0 + (h * G + g) * qs1;
    amx::attend_keys(amx::KvView<R>{kl + h * D, vl + h * D, rs}, tab + rows[sh[0]] * C + j0, int(n), qr.data(), M,
                     D, sc, buf);
    for (int m = 0; m < M; ++m)
      save(buf.o.data() + size_t(m) * D, buf.m[m], buf.l[m], part(sh[m / G], c) + h * G + m % G);
    at::native::cpublas::brgemm_release();
  };
  const int max_m = std::max(Hq, P > 0 && !gemm ? S * Hq : 0);
  run_items(item_start[B], max_m, D, Hkv * D, [&](int64_t it, Scratch& s) {
    if (it < item_start[0] && gemm) {
      if constexpr (std::is_same_v<R, uint16_t>) {
        if (path == amx::SharedPath::brgemm_bf16) return gemm_item.template operator()<uint16_t>(it);
      }
      return gemm_item.template operator()<float>(it);
    }
    if (it < item_start[0]) {  // shared prefix chunk c = it, all S*Hq rows ordered (h, i, g), row sh[i]
      const int64_t j0 = it * chunk, n = std::min(chunk, P - j0);
      Rows<R, DT> rw(Hkv, S * G, D, sc, s);
      for (int h = 0; h < Hkv; ++h)
        for (int i = 0; i < S; ++i)
          for (int g = 0; g < G; ++g) load_q(s, (h * S + i) * G + g, qp + sh[i] * qs0 + (h * G + g) * qs1, D, sc);
      rw.init();
      rw.attend(tab + rows[sh[0]] * C + j0, n, kl, vl, rs, nullptr);
      for (int m = 0; m < rw.M; ++m) {
        const int h = m / (S * G), b = sh[(m / G) % S], g = m % G;
        save(s.o.data() + size_t(m) * D, s.m[m], s.l[m], part(b, it) + h * G + g);
      }
      return;
    }
    // request b's own keys, chunk c; rows are its Hq query heads in order (h, g)
    const int b = std::upper_bound(item_start.begin(), item_start.end(), it) - item_start.begin() - 1;
    const int64_t c = it - item_start[b], j0 = off[b] + c * chunk, n = std::min(chunk, lens[b] - j0);
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
      const int64_t np = n_pre + n_own[b], p0 = off[b] == P ? 0 : n_pre;  // a non-sharing row has no prefix parts
      float mx = NEG_INF;
      for (int64_t p = p0; p < np; ++p) mx = std::max(mx, part_lse[part(b, p) + hq]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float wsum = 0.0f;
      for (int64_t p = p0; p < np; ++p) {
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
struct DecodeFn {
  template <typename... A>
  static void run(const at::Tensor& q, A&&... a) { decode_impl<Q, R, DT>(q, a...); }
};

}  // namespace

at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
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

}  // namespace RADIXGEN_NS
