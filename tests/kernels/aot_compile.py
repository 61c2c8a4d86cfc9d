"""Compile every Triton kernel for an H100/H200 target (sm_90) without a GPU, in bf16 and fp32.

The interpreter (TRITON_INTERPRET=1) runs kernels through numpy and misses codegen errors (loop-carried
type changes, dot shapes, constexpr misuse); this catches them on a CPU-only machine. Run as a script with
TRITON_INTERPRET unset: `python -m tests.kernels.aot_compile`. Prints one line per kernel and dtype.
"""

from __future__ import annotations

import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _sig(ptrs: dict[str, str], ints: list[str], consts: dict, floats: tuple[str, ...] = ()) -> tuple[dict, dict]:
    sig = dict(ptrs)
    sig.update({n: "i32" for n in ints})
    sig.update({n: "fp32" for n in floats})
    sig.update({n: "constexpr" for n in consts})
    return sig, consts


def kernel_specs(dt: str) -> list[tuple[object, dict, dict]]:
    from kernels.triton import decode_attention as da
    from kernels.triton import extend_attention as ea
    from kernels.triton import rmsnorm as rn
    from kernels.triton import rope as rp
    from kernels.triton import store_kv as sk

    prec = "ieee" if dt == "*fp32" else "tf32"
    i64 = "*i64"
    return [
        (ea._extend_kernel, *_sig(
            {"q_ptr": dt, "kc_ptr": dt, "vc_ptr": dt, "o_ptr": dt, "r2t_ptr": "*i32", "rpi_ptr": i64,
             "plen_ptr": i64, "elen_ptr": i64, "qstart_ptr": i64},
            ["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cs", "stride_ch", "stride_r2t"],
            {"GROUP": 3, "D": 64, "BLOCK_D": 64, "BLOCK_M": 64, "BLOCK_N": 64, "PRECISION": prec}, ("scale",))),
        (da._decode_split_kernel, *_sig(
            {"q_ptr": dt, "kc_ptr": dt, "vc_ptr": dt, "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
             "r2t_ptr": "*i32", "rpi_ptr": i64, "slen_ptr": i64},
            ["stride_qb", "stride_qh", "stride_cs", "stride_ch", "stride_r2t",
             "stride_mb", "stride_mh", "stride_ms", "stride_lb", "stride_lh"],
            {"GROUP": 3, "D": 64, "BLOCK_D": 64, "BLOCK_H": 16, "BLOCK_N": 64, "NUM_SPLITS": 8,
             "PRECISION": prec}, ("scale",))),
        (da._decode_reduce_kernel, *_sig(
            {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "o_ptr": dt, "slen_ptr": i64},
            ["stride_mb", "stride_mh", "stride_ms", "stride_lb", "stride_lh", "stride_ob", "stride_oh"],
            {"D": 64, "BLOCK_D": 64, "NUM_SPLITS": 8})),
        (sk._store_kv_kernel, *_sig(
            {"k_ptr": dt, "v_ptr": dt, "kc_ptr": dt, "vc_ptr": dt, "loc_ptr": i64},
            ["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs", "stride_ch"],
            {"D": 64, "HD": 192, "BLOCK": 256})),
        (rn._rmsnorm_kernel, *_sig(
            {"x_ptr": dt, "r_ptr": dt, "w_ptr": dt, "out_ptr": dt, "h_ptr": dt},
            ["stride_x", "stride_r", "stride_o", "stride_h", "N"],
            {"HAS_RESIDUAL": True, "BLOCK": 1024}, ("eps",))),
        (rp._rope_kernel, *_sig(
            {"x_ptr": dt, "out_ptr": dt, "pos_ptr": i64, "cs_ptr": "*fp32"},
            ["stride_xt", "stride_xh", "stride_ot", "stride_oh", "stride_cs", "H"],
            {"HALF": 32, "BLOCK_H": 16, "BLOCK_HALF": 32})),
    ]


def main() -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "run with TRITON_INTERPRET unset"
    target = GPUTarget("cuda", 90, 32)
    for dt in ("*bf16", "*fp32"):
        for fn, sig, consts in kernel_specs(dt):
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
            print(f"{fn.__name__} {dt[1:]} ok ptx={len(compiled.asm['ptx'])}")


if __name__ == "__main__":
    main()
