"""The native CPU ops (kernels/cpu/*.cpp), as torch custom ops an opaque caller (eager or torch.compile) can use.

Every op runs the entry point of one instruction-set variant (kernels/cpu/isa.h): the best this CPU runs,
chosen when the library loads, or the one `cpu_isa` forces (tests and benchmarks run each variant).

The attention ops:

Both ops first store the step's new K/V rows into the pool (mutating `k_cache`/`v_cache` at `layer`), then
attend, reading K/V slots in place through `req_to_token`. All index/length tensors live on the CPU.

  torch.ops.radixgen.attn_decode(
      q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, D],      # one new token per request; q's last dim contiguous
      k_cache [L, S, Hkv, D] (mutated), v_cache (mutated), layer: int,
      out_cache_loc [B] int64,                         # slot of each new token
      req_to_token [R, C] int32, req_pool_indices [B] int64, seq_lens [B] int64,   # seq_len includes the new token
      shared_len: int,                                 # leading slots every row with seq_len > it shares (0: none)
      scale: float) -> out [B, Hq, D]
  torch.ops.radixgen.attn_extend(
      q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D],      # requests' new tokens concatenated, T = sum(extend_lens)
      k_cache (mutated), v_cache (mutated), layer: int, out_cache_loc [T] int64,
      req_to_token, req_pool_indices [B] int64, prefix_lens [B] int64, extend_lens [B] int64,
      shared_len: int,                                 # leading slots all B rows share; <= min(prefix_lens)
      scale: float) -> out [T, Hq, D]

q and the caches share one dtype, float32 or bfloat16; accumulation is float32; out has q's dtype.
Request b's new token i (0-based) sees its tokens [0, prefix_lens[b] + i], as in kernels/ref.py.
`shared_len` is a promise about req_to_token (kernels/cpu/backend.py:shared_prefix_len finds it once per step):
the shared slots are read (and, for extend, packed) once per call for all rows.
"""

from __future__ import annotations

import torch

from kernels.cpu import build

_registered = False


def load() -> None:
    """Build/load the extension and register the fake (meta) kernels; idempotent."""
    global _registered
    build.load()
    if _registered:
        return

    @torch.library.register_fake("radixgen::attn_decode")
    def _decode_fake(q, k, v, k_cache, v_cache, layer, out_cache_loc, req_to_token, req_pool_indices,
                     seq_lens, shared_len, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("radixgen::linear_panels")
    def _linear_fake(x, panels):
        return x.new_empty((x.shape[0], panels.shape[0] * panels.shape[2]))

    @torch.library.register_fake("radixgen::q4_linear")
    def _q4_fake(x, qs, dm):
        return x.new_empty((x.shape[0], qs.shape[0]))

    @torch.library.register_fake("radixgen::q8_linear")
    def _q8_fake(x, codes, d):
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("radixgen::w8a8_linear")
    def _w8a8_fake(x, wp, colsum, sw, inv_s, fidx, wf):
        return x.new_empty((x.shape[0], sw.shape[0]))

    @torch.library.register_fake("radixgen::w8a8_int_mm")
    def _w8a8_int_mm_fake(x, wt, sw, inv_s, fidx, wf):
        return x.new_empty((x.shape[0], sw.shape[0]))

    @torch.library.register_fake("radixgen::attn_extend")
    def _extend_fake(q, k, v, k_cache, v_cache, layer, out_cache_loc, req_to_token, req_pool_indices,
                     prefix_lens, extend_lens, shared_len, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    _registered = True


def isas() -> list[str]:
    """The ISA variants built for this CPU and runnable here, best first ("avx512", "avx2", "portable")."""
    load()
    return list(torch.ops.radixgen.cpu_isas())


def cpu_isa(mode: str = "auto") -> str:
    """Force the ISA variant every op runs ("avx512", "avx2", "portable"; one of isas()) or go back to the
    start-up choice ("auto"). Process-wide, for tests and benchmarks; raises on a variant not built here and then
    changes nothing. Returns the variant now in effect."""
    load()
    return str(torch.ops.radixgen.cpu_isa(mode))


# The fused elementwise ops of kernels/cpu/elementwise.cpp, with kernels.ref's signatures (the eager forward's
# CPU twins of the Triton rmsnorm/rope kernels; call load() first).


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As kernels.ref.rmsnorm: (rmsnorm(x + residual) * weight, x + residual), one pass over the rows."""
    out, h = torch.ops.radixgen.add_rmsnorm(x, residual, weight, eps)
    return out, (x if residual is None else h)


def rope(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of x [T, Nh, D] at `positions` [T] from the float32 table cos_sin [P, D]."""
    return torch.ops.radixgen.rope(x, cos_sin, positions)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As kernels.ref.apply_rope."""
    return rope(q, cos_sin, positions), rope(k, cos_sin, positions)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate first) -> [T, I]."""
    return torch.ops.radixgen.silu_mul(gate_up)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: logits[rows[r], t] = -inf where bit t % 32 of bitmask[r, t // 32] is 0. logits float32 [B, V]
    with contiguous rows; bitmask int32 [R, ceil(V / 32)]; rows int64 [R], or None for R = B (row r itself)."""
    torch.ops.radixgen.apply_token_bitmask_(logits, bitmask, rows)


PANEL = 16  # output columns per panel of linear_panels (kernels/cpu/linear.cpp)


def panels_preferred() -> bool:
    """Whether float32 linears should run on packed panels (linear_panels) here: CPUs with AVX2 + FMA and no
    AVX-512, where the panel kernel beats MKL's float32 GEMM at every measured row count
    (bench/results/linear_cpu-zen3.md); AVX-512 machines keep oneDNN/MKL (not measured against it there)."""
    flags = set(build.cpu_flags().split())
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] (N % 16 == 0) -> panels [N / 16, K, 16], panels[p, k, j] = w[16 p + j, k]."""
    n, k = w.shape
    if n % PANEL:
        raise ValueError(f"pack_panels: N must be a multiple of {PANEL}, got {n}")
    return w.float().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_panels: [N / 16, K, 16] -> [N, K]."""
    p, k, j = panels.shape
    return panels.transpose(1, 2).reshape(p * j, k)


def linear_panels(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] on W packed by pack_panels (call load() first)."""
    return torch.ops.radixgen.linear_panels(x, panels)


# Weight-only block linears of kernels/cpu/quant_gemv.cpp (layouts: kernels/quant/cpu_blocks.py; load() first).


def q4_linear(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32, W in 4-bit blocks of 32: qs uint8 [N, K / 2] (GGUF Q4_1 nibble
    order), dm float16 [N, 2, K / 32] (d then m; W = d * q + m); x is rounded to int8 per block of 32."""
    return torch.ops.radixgen.q4_linear(x, qs, dm)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32, W = d * codes: codes int8 [N, K], d float16 [N, K / 32]."""
    return torch.ops.radixgen.q8_linear(x, codes, d)


# The fused W8A8 int8 linear of kernels/cpu/w8a8_linear.cpp (contract there; kernels/quant/w8a8.py's twin; load()
# first).

VNNI_TILE, VNNI_GROUP = 16, 4  # output channels per weight tile, k per group (one vpdpbusd lane)


def pack_vnni(wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes wt [K, N] (torch._int_mm's layout) -> (wp int8 [ceil(N / 16), ceil(K / 4), 16, 4], colsum int32
    [16 ceil(N / 16)]): wp[t, g, j, i] = wt[4 g + i, 16 t + j], zero past K or N; colsum[n] = sum_k wt[k, n]."""
    if wt.dim() != 2 or wt.dtype != torch.int8:
        raise ValueError(f"pack_vnni takes int8 codes [K, N], got {wt.dtype} {tuple(wt.shape)}")
    k, n = wt.shape
    k4, t = -(-k // VNNI_GROUP), -(-n // VNNI_TILE)
    padded = torch.zeros(k4 * VNNI_GROUP, t * VNNI_TILE, dtype=torch.int8)
    padded[:k, :n] = wt
    wp = padded.reshape(k4, VNNI_GROUP, t, VNNI_TILE).permute(2, 0, 3, 1).contiguous()
    return wp, padded.sum(0, dtype=torch.int32)


def w8a8_linear(x: torch.Tensor, wp: torch.Tensor, colsum: torch.Tensor, sw: torch.Tensor,
                inv_s: torch.Tensor | None = None, fidx: torch.Tensor | None = None,
                wf: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 | bfloat16 -> [M, N] in x's dtype: per-token int8 x the packed int8 weight (pack_vnni),
    dequantized by sx * sw, plus x[:, fidx] @ wf (kernels/cpu/w8a8_linear.cpp)."""
    return torch.ops.radixgen.w8a8_linear(x, wp, colsum, sw, inv_s, fidx, wf)


def w8a8_int_mm(x: torch.Tensor, wt: torch.Tensor, sw: torch.Tensor, inv_s: torch.Tensor | None = None,
                fidx: torch.Tensor | None = None, wf: torch.Tensor | None = None) -> torch.Tensor:
    """As w8a8_linear on the unpacked codes wt int8 [K, N] (or a transposed view of [N, K] codes): the product runs
    on oneDNN's int8 GEMM (torch._int_mm), quantization and epilogue native (kernels/cpu/w8a8_int_mm.cpp); the same
    bits as w8a8_linear."""
    return torch.ops.radixgen.w8a8_int_mm(x, wt, sw, inv_s, fidx, wf)


def w8a8_native() -> bool:
    """Whether w8a8_linear runs a vector kernel in the variant in effect (else the portable loop)."""
    load()
    return bool(torch.ops.radixgen.w8a8_native())


def panels_native() -> bool:
    """Whether linear_panels runs a vector kernel in the variant in effect (else the portable loop)."""
    load()
    return bool(torch.ops.radixgen.panels_native())


def q_gemv_native() -> bool:
    """Whether the block linears run their AVX2 kernels in the variant in effect (else the portable scalar twin)."""
    load()
    return bool(torch.ops.radixgen.q_gemv_native())


def bf16_attn_gemm(mode: str = "auto") -> str:
    """Select the kernel that multiplies bf16 key blocks in attn_extend and decode's shared prefix: "brgemm"
    (oneDNN AMX tiles), "dot" (AVX-512-BF16 vdpbf16ps, kernels/cpu/gemm_bf16.h; forced on a CPU without it, a slow
    portable twin that tests the same layouts), "f32" (blocks converted to
    float32: float32 brgemm for extend, the row kernel for decode) or "auto" (the first of those this CPU has).
    Process-wide, for tests and benchmarks; raises on a mode this CPU lacks. Returns the mode now in effect."""
    load()
    return torch.ops.radixgen.bf16_attn_gemm(mode)
