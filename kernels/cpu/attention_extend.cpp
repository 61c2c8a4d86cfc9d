// Native CPU extend (prefill) attention over radixgen's paged KV pool (pool layout: kernels/cpu/attention_rows.h).
// Compiled once per ISA variant (kernels/cpu/isa.h); registered as radixgen::attn_extend and
// radixgen::bf16_attn_gemm by dispatch.cpp (kernels/cpu/ops.py documents the ops for Python).
//
// Ragged new tokens (E_b per request after P_b cached ones), flash-style online softmax per (request, block of QB
// queries); query i of request b sees keys [0, P_b + i]. For head_dim % 32 == 0 it runs on brgemm micro-kernels
// over key blocks packed once per call, the shared prefix once for the batch (extend_amx.h: bf16 AMX tiles where
// oneDNN has them, else bf16 vdpbf16ps where the CPU has AVX-512-BF16 (gemm_bf16.h), else float32 brgemm); other
// head sizes take the row kernel (attention_rows.h).
// Numerics: inputs float32 or bfloat16, scores/softmax/accumulators float32, outputs in the input dtype; a
// float16 pool under float32 q takes the float32 brgemm path (converted while packing).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_rows.h"
#include "extend_amx.h"
#include "isa.h"

namespace RADIXGEN_NS {
namespace {

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

template <typename Q, typename R, int DT>
struct ExtendFn {
  template <typename... A>
  static void run(const at::Tensor& q, A&&... a) { extend_impl<Q, R, DT>(q, a...); }
};

}  // namespace

at::Tensor attn_extend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
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

// Selects the bf16 key-block kernel (tests and benchmarks); returns the mode in effect for this variant.
std::string bf16_attn_gemm(const std::string& mode) { return amx::set_bf16_gemm(mode); }

}  // namespace RADIXGEN_NS
