"""200 sentences of varied length for the embedding tests: real prose from this repository's README, docs and
bench results (one word up to about 250 tokens of all-MiniLM-L6-v2's tokenizer: its limit is 256), plus a few
non-ASCII ones."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[3]
EXTRA = ["a", "Zürich ist schön im Frühling.", "東京タワーは高い。", "naïve café — 42 °C, ½ price!",
         "Emoji 🙂 and tabs\tand\nnewlines.", "UPPER lower MiXeD 12345"]


def sentences(count: int = 200, limit: int = 250) -> list[str]:
    """`count` distinct sentences whose lengths spread from one word to `limit` tokens (deterministic for one
    checkout of the docs)."""
    from runtime.models.registry import embedding_model_path
    from runtime.tokenizer.load import load_tokenizer

    tok = load_tokenizer(embedding_model_path())
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "bench" / "results").glob("*.md"))]
    text = "\n".join(p.read_text(encoding="utf-8") for p in files)
    parts = [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+|\n\s*\n", text)]
    pool = sorted({s for s in parts if s and len(tok.encode(s)) <= limit}, key=lambda s: (len(s), s))
    # long ones: runs of consecutive sentences up to the limit
    longs, run = [], ""
    for s in parts:
        cand = f"{run} {s}".strip()
        if len(tok.encode(cand)) > limit:
            if len(tok.encode(run)) > limit // 2:
                longs.append(run)
            run = s if len(tok.encode(s)) <= limit else ""
        else:
            run = cand
    longs = longs[:: max(len(longs) // 30, 1)][:30]
    rest = count - len(EXTRA) - len(longs) + 20  # spare: a picked one may repeat a long run
    step = max(len(pool) / rest, 1)
    picked = [pool[int(i * step)] for i in range(min(rest, len(pool)))]
    out = list(dict.fromkeys(EXTRA + longs + picked))
    assert len(out) >= count, f"only {len(out)} sentences from the docs"
    return out[:count]
