// The per-ISA layout of the native CPU ops: every op-family source (attention_decode.cpp, attention_extend.cpp,
// linear.cpp, quant_gemv.cpp, w8a8_linear.cpp, w8a8_int_mm.cpp, elementwise.cpp,
// isa_table.cpp) is compiled once per instruction-set variant this
// CPU can run (kernels/cpu/build.py), with -DRADIXGEN_ISA=<variant> and that variant's -m flags:
//   avx512   : x86-64-v4 (AVX-512 F/BW/DQ/VL, plus AVX-512-BF16 / VNNI where the CPU has them)
//   avx2     : x86-64-v3 (AVX2, FMA, F16C)
//   portable : the baseline ISA (plain C++ for the vectorizer; the twin every machine can run)
// Everything a variant defines lives in namespace radixgen_cpu::<variant> (RADIXGEN_NS), so inline helpers
// compiled for different ISAs never meet in the linker. Each variant fills one table of entry points (Kernels,
// isa_table.cpp); dispatch.cpp (compiled once, baseline flags) registers the torch ops and forwards each call
// to the table chosen at start-up (the best variant this CPU runs) or forced by radixgen::cpu_isa.

#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#ifndef RADIXGEN_ISA
#define RADIXGEN_ISA portable
#endif
#define RADIXGEN_NS radixgen_cpu::RADIXGEN_ISA

namespace radixgen_cpu {

// The entry points of one ISA variant (contracts: kernels/cpu/ops.py).
struct Kernels {
  const char* name;
  at::Tensor (*attn_decode)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                            at::Tensor v_cache, int64_t layer, const at::Tensor& out_cache_loc,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, int64_t shared_len, double scale);
  at::Tensor (*attn_extend)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                            at::Tensor v_cache, int64_t layer, const at::Tensor& out_cache_loc,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& prefix_lens, const at::Tensor& extend_lens, int64_t shared_len,
                            double scale);
  std::string (*bf16_attn_gemm)(const std::string& mode);  // sets the shared override, returns the mode in effect
  at::Tensor (*linear_panels)(const at::Tensor& x, const at::Tensor& panels);
  bool (*panels_native)();  // linear_panels runs a vector kernel (not the portable loop)
  at::Tensor (*q4_linear)(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm);
  at::Tensor (*q8_linear)(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d);
  bool (*q_gemv_native)();  // the block linears run a vector kernel (not the portable twin)
  at::Tensor (*w8a8_linear)(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& colsum, const at::Tensor& sw,
                            const std::optional<at::Tensor>& inv_s, const std::optional<at::Tensor>& fidx,
                            const std::optional<at::Tensor>& wf);
  bool (*w8a8_native)();  // w8a8_linear runs a vector kernel (not the portable twin)
  at::Tensor (*w8a8_int_mm)(const at::Tensor& x, const at::Tensor& wt, const at::Tensor& sw,
                            const std::optional<at::Tensor>& inv_s, const std::optional<at::Tensor>& fidx,
                            const std::optional<at::Tensor>& wf);
  std::tuple<at::Tensor, at::Tensor> (*add_rmsnorm)(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                   const at::Tensor& weight, double eps);
  at::Tensor (*rope)(const at::Tensor& x, const at::Tensor& cos_sin, const at::Tensor& positions);
  at::Tensor (*silu_mul)(const at::Tensor& gate_up);
  void (*apply_token_bitmask_)(at::Tensor logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows);
};

// The bf16 key-block kernel override shared by every variant (0 auto, 1 f32, 2 dot, 3 brgemm; gemm_bf16.h).
std::atomic<int>& bf16_gemm_override();

}  // namespace radixgen_cpu

// Entry points of the variant being compiled (defined by its op-family sources, gathered by isa_table.cpp).
namespace RADIXGEN_NS {
at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                       at::Tensor v_cache, int64_t layer, const at::Tensor& out_cache_loc,
                       const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                       int64_t shared_len, double scale);
at::Tensor attn_extend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                       at::Tensor v_cache, int64_t layer, const at::Tensor& out_cache_loc,
                       const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                       const at::Tensor& prefix_lens, const at::Tensor& extend_lens, int64_t shared_len, double scale);
std::string bf16_attn_gemm(const std::string& mode);
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels);
bool panels_native();
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d);
bool q_gemv_native();
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& colsum, const at::Tensor& sw,
                       const std::optional<at::Tensor>& inv_s, const std::optional<at::Tensor>& fidx,
                       const std::optional<at::Tensor>& wf);
bool w8a8_native();
at::Tensor w8a8_int_mm(const at::Tensor& x, const at::Tensor& wt, const at::Tensor& sw,
                       const std::optional<at::Tensor>& inv_s, const std::optional<at::Tensor>& fidx,
                       const std::optional<at::Tensor>& wf);
std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                               const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos_sin, const at::Tensor& positions);
at::Tensor silu_mul(const at::Tensor& gate_up);
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows);
}  // namespace RADIXGEN_NS
