"""Check a convert_gguf.py directory against radixgen's own reading of the GGUF: transformers loads the
directory (float32), radixgen runs the GGUF's float32 forward (`--quantization none`), and on each prompt
the token ids must be equal and the last-position logits close.

    .venv/bin/python bench/peers/check_hf_dir.py MODEL.gguf HF_DIR [--tol 1e-4]

Prints one line per prompt (tokens, max |diff| / max |logit|, both argmaxes) and exits non-zero on a miss.
A prompt longer than 512 tokens exercises Gemma 3's sliding-window layers. Runs of more than 16 spaces are
cut to 16 in the text: Gemma's whitespace-run pieces are matched longest-first by SentencePiece, llama.cpp and
radixgen, while transformers' GGUF tokenizer conversion merges them as BPE pieces (different ids for 17+).
"""

from __future__ import annotations

import argparse
import glob
import os
import pathlib
import re
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from runtime.config import make_config  # noqa: E402
from runtime.executor.forward_batch import ForwardBatch  # noqa: E402
from runtime.executor.greedy import OfflineBatch  # noqa: E402
from runtime.executor.model_runner import create_model_runner  # noqa: E402
from runtime.tokenizer.load import load_tokenizer  # noqa: E402


def last_logits(runner, ids: list[int]) -> torch.Tensor:
    """radixgen's last-position logits of one prompt, one prefill."""
    batch = OfflineBatch(runner, [ids])
    try:
        slots = batch._alloc(len(ids))
        runner.req_to_token.write(batch.rows[0], 0, slots)
        return runner.forward(ForwardBatch.build([ids], [0], slots, batch.rows, 0))[0].float()
    finally:
        batch.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("hf_dir")
    ap.add_argument("--tol", type=float, default=1e-4, help="max |diff| / max |logit| allowed")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(args.hf_dir)
    runner = create_model_runner(make_config(model_path=args.gguf, dtype="float32", kv_cache_dtype="float32",
                                             quantization="none", max_total_tokens=4096, disable_compile=True),
                                 progress=False)
    tok = load_tokenizer(args.gguf)
    docs = "\n\n".join(pathlib.Path(f).read_text() for f in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))
    ok = True
    for text in ["The capital of France is", re.sub(" {17,}", " " * 16, docs[:4000])]:
        ids = tok.encode(text)
        same_ids = hf_tok(text)["input_ids"] == ids
        with torch.no_grad():
            want = hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
        got = last_logits(runner, ids)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        ok &= same_ids and rel <= args.tol and int(got.argmax()) == int(want.argmax())
        print(f"{len(ids)} tokens: ids equal {same_ids}, logits max|diff|/max|logit| {rel:.2e}, "
              f"argmax {int(got.argmax())} / {int(want.argmax())}")
    print(f"{type(hf).__name__} from {args.hf_dir}: {'OK' if ok else 'MISMATCH'} (tol {args.tol:g})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
