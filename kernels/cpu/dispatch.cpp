// The one dispatch of the native CPU ops: registers every radixgen:: op once and forwards each call to the
// entry points of one ISA variant (kernels/cpu/isa.h). Compiled once, with the baseline flags, so it runs on any
// CPU; kernels/cpu/build.py compiles only the variants this CPU can run and says which through
// RADIXGEN_HAVE_AVX512 / RADIXGEN_HAVE_AVX2 (portable is always built).
//
// At start-up (library load) the best built variant whose instructions the CPU reports is chosen: avx512, then
// avx2, then portable. radixgen::cpu_isa(mode) forces one process-wide (tests and benchmarks run every variant
// the machine can execute) or goes back to that choice with "auto"; radixgen::cpu_isas() lists the built ones.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "isa.h"

namespace radixgen_cpu {

#if RADIXGEN_HAVE_AVX512
extern const Kernels kernels_avx512;
#endif
#if RADIXGEN_HAVE_AVX2
extern const Kernels kernels_avx2;
#endif
extern const Kernels kernels_portable;

std::atomic<int>& bf16_gemm_override() {
  static std::atomic<int> mode{0};  // auto
  return mode;
}

namespace {

// The built variants this CPU runs, best first (portable always last).
std::vector<const Kernels*> runnable() {
  std::vector<const Kernels*> out;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#if RADIXGEN_HAVE_AVX512
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
    out.push_back(&kernels_avx512);
#endif
#if RADIXGEN_HAVE_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    out.push_back(&kernels_avx2);
#endif
#endif
  out.push_back(&kernels_portable);
  return out;
}

const std::vector<const Kernels*>& variants() {
  static const std::vector<const Kernels*> v = runnable();
  return v;
}

std::atomic<const Kernels*> g_active{nullptr};

const Kernels& active() {
  const Kernels* k = g_active.load(std::memory_order_acquire);
  return k ? *k : *variants().front();
}

std::string cpu_isa(const std::string& mode) {
  if (mode == "auto") {
    g_active.store(nullptr, std::memory_order_release);
    return active().name;
  }
  std::string names;
  for (const Kernels* k : variants()) {
    if (mode == k->name) {
      g_active.store(k, std::memory_order_release);
      return k->name;
    }
    names += std::string(names.empty() ? "" : ", ") + k->name;
  }
  TORCH_CHECK(false, "cpu_isa: '", mode, "' is not a variant built for this CPU (auto, ", names, ")");
}

std::vector<std::string> cpu_isas() {
  std::vector<std::string> out;
  for (const Kernels* k : variants()) out.emplace_back(k->name);
  return out;
}

// Forwarders: one per op, the active variant's entry point.
at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                       at::Tensor v_cache, int64_t layer, const at::Tensor& loc, const at::Tensor& r2t,
                       const at::Tensor& rows, const at::Tensor& seq_lens, int64_t shared_len, double scale) {
  return active().attn_decode(q, k, v, k_cache, v_cache, layer, loc, r2t, rows, seq_lens, shared_len, scale);
}
at::Tensor attn_extend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                       at::Tensor v_cache, int64_t layer, const at::Tensor& loc, const at::Tensor& r2t,
                       const at::Tensor& rows, const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                       int64_t shared_len, double scale) {
  return active().attn_extend(q, k, v, k_cache, v_cache, layer, loc, r2t, rows, prefix_lens, extend_lens,
                              shared_len, scale);
}
std::string bf16_attn_gemm(const std::string& mode) { return active().bf16_attn_gemm(mode); }
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels) { return active().linear_panels(x, panels); }
bool panels_native() { return active().panels_native(); }
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm) {
  return active().q4_linear(x, qs, dm);
}
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  return active().q8_linear(x, codes, d);
}
bool q_gemv_native() { return active().q_gemv_native(); }
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& colsum, const at::Tensor& sw,
                       const std::optional<at::Tensor>& inv_s, const std::optional<at::Tensor>& fidx,
                       const std::optional<at::Tensor>& wf) {
  return active().w8a8_linear(x, wp, colsum, sw, inv_s, fidx, wf);
}
bool w8a8_native() { return active().w8a8_native(); }
at::Tensor w8a8_int_mm(const at::Tensor& x, const at::Tensor& wt, const at::Tensor& sw,
                       const std::optional<at::Tensor>& inv_s, const std::optional<at::Tensor>& fidx,
                       const std::optional<at::Tensor>& wf) {
  return active().w8a8_int_mm(x, wt, sw, inv_s, fidx, wf);
}
std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                               const at::Tensor& weight, double eps) {
  return active().add_rmsnorm(x, residual, weight, eps);
}
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos_sin, const at::Tensor& positions) {
  return active().rope(x, cos_sin, positions);
}
at::Tensor silu_mul(const at::Tensor& gate_up) { return active().silu_mul(gate_up); }
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows) {
  active().apply_token_bitmask_(logits, bitmask, rows);
}

}  // namespace
}  // namespace radixgen_cpu

TORCH_LIBRARY(radixgen, m) {
  m.def(
      "attn_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, "
      "Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int shared_len, "
      "float scale) -> Tensor");
  m.def(
      "attn_extend(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, "
      "Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor prefix_lens, "
      "Tensor extend_lens, int shared_len, float scale) -> Tensor");
  m.def("add_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos_sin, Tensor positions) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor? rows) -> ()");
  m.def("linear_panels(Tensor x, Tensor panels) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor qs, Tensor dm) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor codes, Tensor d) -> Tensor");
  m.def(
      "w8a8_linear(Tensor x, Tensor wp, Tensor colsum, Tensor sw, Tensor? inv_s, Tensor? fidx, Tensor? wf) "
      "-> Tensor");
  m.def("w8a8_int_mm(Tensor x, Tensor wt, Tensor sw, Tensor? inv_s, Tensor? fidx, Tensor? wf) -> Tensor");
  // Not tensor ops: catch-all kernels that run with any (or no) tensors around.
  m.def("bf16_attn_gemm(str mode) -> str", &radixgen_cpu::bf16_attn_gemm);
  m.def("cpu_isa(str mode) -> str", &radixgen_cpu::cpu_isa);
  m.def("cpu_isas() -> str[]", &radixgen_cpu::cpu_isas);
  m.def("panels_native() -> bool", &radixgen_cpu::panels_native);
  m.def("q_gemv_native() -> bool", &radixgen_cpu::q_gemv_native);
  m.def("w8a8_native() -> bool", &radixgen_cpu::w8a8_native);
}

TORCH_LIBRARY_IMPL(radixgen, CPU, m) {
  m.impl("attn_decode", &radixgen_cpu::attn_decode);
  m.impl("attn_extend", &radixgen_cpu::attn_extend);
  m.impl("add_rmsnorm", &radixgen_cpu::add_rmsnorm);
  m.impl("rope", &radixgen_cpu::rope);
  m.impl("silu_mul", &radixgen_cpu::silu_mul);
  m.impl("apply_token_bitmask_", &radixgen_cpu::apply_token_bitmask_);
  m.impl("linear_panels", &radixgen_cpu::linear_panels);
  m.impl("q4_linear", &radixgen_cpu::q4_linear);
  m.impl("q8_linear", &radixgen_cpu::q8_linear);
  m.impl("w8a8_linear", &radixgen_cpu::w8a8_linear);
  m.impl("w8a8_int_mm", &radixgen_cpu::w8a8_int_mm);
}
