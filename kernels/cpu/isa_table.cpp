// The table of entry points of the ISA variant being compiled (kernels/cpu/isa.h): one per variant, picked by
// dispatch.cpp.

#include "isa.h"

#define RADIXGEN_STR2(x) #x
#define RADIXGEN_STR(x) RADIXGEN_STR2(x)
#define RADIXGEN_CAT2(a, b) a##b
#define RADIXGEN_CAT(a, b) RADIXGEN_CAT2(a, b)

namespace radixgen_cpu {

extern const Kernels RADIXGEN_CAT(kernels_, RADIXGEN_ISA);
const Kernels RADIXGEN_CAT(kernels_, RADIXGEN_ISA) = {
    .name = RADIXGEN_STR(RADIXGEN_ISA),
    .attn_decode = &RADIXGEN_NS::attn_decode,
    .attn_extend = &RADIXGEN_NS::attn_extend,
    .bf16_attn_gemm = &RADIXGEN_NS::bf16_attn_gemm,
    .linear_panels = &RADIXGEN_NS::linear_panels,
    .panels_native = &RADIXGEN_NS::panels_native,
    .q4_linear = &RADIXGEN_NS::q4_linear,
    .q8_linear = &RADIXGEN_NS::q8_linear,
    .q_gemv_native = &RADIXGEN_NS::q_gemv_native,
    .w8a8_linear = &RADIXGEN_NS::w8a8_linear,
    .w8a8_native = &RADIXGEN_NS::w8a8_native,
    .w8a8_int_mm = &RADIXGEN_NS::w8a8_int_mm,
    .add_rmsnorm = &RADIXGEN_NS::add_rmsnorm,
    .rope = &RADIXGEN_NS::rope,
    .silu_mul = &RADIXGEN_NS::silu_mul,
    .apply_token_bitmask_ = &RADIXGEN_NS::apply_token_bitmask_,
};

}  // namespace radixgen_cpu
