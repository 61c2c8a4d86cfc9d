"""Test helpers: greedy tokens of the default model through runtime's own model runner with a given attention
backend, prefilled in two chunks (an extend over the cached half), then decoded as a batch; and the check that
two such runs agree until a near-tie."""

from __future__ import annotations

import torch


def engine_greedy(device: str, backend: str, dtype: str, prompts: list[list[int]],
                  max_new: int) -> tuple[list[list[int]], list[list[float]]]:
    """Returns (greedy tokens per prompt, top1 - top2 logit margin at each of them). Eager forward (no
    compiled graphs), so the attention backend named is the one that runs."""
    from runtime.config import make_config, resolve
    from runtime.executor.greedy import OfflineBatch
    from runtime.executor.model_runner import create_model_runner

    cfg = resolve(make_config(device=device, dtype=dtype, attention_backend=backend, max_total_tokens=8192,
                              disable_compile=True))
    runner = create_model_runner(cfg, progress=False)
    batch = OfflineBatch(runner, prompts)
    try:
        logits = batch.extend([p[: len(p) // 2] for p in prompts])
        logits = batch.extend([p[len(p) // 2 :] for p in prompts])
        tokens: list[list[int]] = [[] for _ in prompts]
        margins: list[list[float]] = [[] for _ in prompts]
        for step in range(max_new):
            top = logits.float().topk(2, dim=-1)
            nxt = top.indices[:, 0].tolist()
            for b, t in enumerate(nxt):
                tokens[b].append(t)
                margins[b].append(float(top.values[b, 0] - top.values[b, 1]))
            if step + 1 < max_new:
                logits = batch.extend([[t] for t in nxt], is_decode=True)
        return tokens, margins
    finally:
        batch.release()
        del runner
        if device == "cuda":
            torch.cuda.empty_cache()


def assert_same_until_near_tie(tok, want, got, margins, near_tie: float, max_new: int) -> None:  # noqa: ANN001
    """Greedy tokens equal until the first divergence, and that divergence (if any) is at a reference near-tie
    (top1 - top2 < near_tie in `margins`, the reference run's). At least `max_new` tokens in all must agree
    before any divergence."""
    agreed = 0
    for w, g, m in zip(want, got, margins, strict=True):
        i = next((j for j in range(max_new) if g[j] != w[j]), max_new)
        agreed += i
        if i < max_new:
            assert m[i] < near_tie, (i, m[i], tok.decode(w), tok.decode(g))
    assert agreed >= max_new, (agreed, [tok.decode(x) for x in got + want])
