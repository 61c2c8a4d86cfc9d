"""The leading KV slots a batch's requests have in common, for the attention backends' shared-prefix passes.

The radix cache hands every request that matched a cached prefix the very slots of that prefix, so a prefix
shared in the token sense is shared in req_to_token: row r's first p slots equal row r''s. A backend finds p once
per step and reads those keys once for the whole batch (kernels/cascade.py, kernels/torch_extend.py, the native
ops through kernels/cpu/backend.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def common_prefix_len(req_to_token: torch.Tensor, rows: torch.Tensor | list[int], limits: Sequence[int],
                      min_prefix: int) -> int:
    """Leading slots every row has in common, at most min(limits): req_to_token[rows[i], :p] equal for all i.
    0 for fewer than two rows, or when that is under min_prefix. Decode passes seq_len - 1 (each row keeps >= 1
    key of its own), extend the cached prefix lengths."""
    if len(limits) < 2 or min(limits) < min_prefix:
        return 0
    lead = req_to_token[rows, : min(limits)]  # [B, shortest]
    same = (lead == lead[:1]).all(0)
    p = int(torch.cumprod(same.to(torch.int32), 0).sum())
    return p if p >= min_prefix else 0


def long_rows_prefix_len(req_to_token: torch.Tensor, rows: torch.Tensor, limits: Sequence[int],
                         min_prefix: int) -> int:
    """common_prefix_len over the rows whose limit is at least min_prefix; the others (a compiled graph's padding
    rows, of seq_len 1; short requests) are left out and read their own keys. Invariant the callers rely on:
    every row with limit >= the result shares its first result slots with the others."""
    long = [i for i, n in enumerate(limits) if n >= min_prefix]
    if len(long) == len(limits):
        return common_prefix_len(req_to_token, rows, limits, min_prefix)
    return common_prefix_len(req_to_token, rows[long], [limits[i] for i in long], min_prefix)
