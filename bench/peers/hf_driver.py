"""The transformers peer: an in-process `generate()` driver, run in bench/.peers/venv-hf and spoken to over
stdin/stdout, one JSON object per line (bench/peers/systems.py is the other end).

    venv-hf/bin/python bench/peers/hf_driver.py MODEL.gguf [--dtype bfloat16] [--threads 2]

Request:  {"reqs": [{"ids": [...] | "messages": [...], "max_tokens": N, "ignore_eos": bool}], "concurrency": C}
Reply:    {"outs": [{"ok", "prompt_len", "output_len", "ttft", "e2e", "text"}], "wall": s}

Static batching, as a user of `generate()` would do it: requests are taken C at a time, in order, left-padded
into one batch. Times are from the start of the whole call, so a request in the second batch waits for the
first (its TTFT includes the queueing), like a client of a server would see. ignore_eos = min_new_tokens =
max_new_tokens, so each row yields exactly max_tokens tokens. TTFT of a batch = when generate() hands the
streamer its first generated tokens (the prefill and first sampling are done).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer


class FirstTokenClock(BaseStreamer):
    """generate() calls put() once with the prompt, then once per step with the new tokens."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def load(gguf: str, dtype: str):  # noqa: ANN201
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype)).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok, model


@torch.inference_mode()
def run_batch(tok, model, batch: list[dict], t0: float) -> list[dict]:  # noqa: ANN001
    prompts = []
    for r in batch:
        if "messages" in r:
            # transformers 5 returns an Encoding from tokenize=True; render the text and encode it instead
            # (the template already holds the special tokens).
            text = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
            prompts.append(tok.encode(text, add_special_tokens=False))
        else:
            prompts.append(list(r["ids"]))
    # Left padding by hand (the prompts are ids already): pad id 2 with attention mask 0.
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    max_new = max(r["max_tokens"] for r in batch)
    ban = all(r["ignore_eos"] for r in batch)
    clock = FirstTokenClock()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        min_new_tokens=max_new if ban else 0,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        streamer=clock,
    )
    end = time.perf_counter()
    ttft = (clock.first or end) - t0
    res = []
    for i, r in enumerate(batch):
        gen = out[i, width : width + r["max_tokens"]].tolist()
        if not r["ignore_eos"] and tok.eos_token_id in gen:
            gen = gen[: gen.index(tok.eos_token_id)]
        res.append(
            {
                "ok": True,
                "prompt_len": len(prompts[i]),
                "output_len": len(gen),
                "ttft": ttft,
                "e2e": end - t0,
                "text": tok.decode(gen, skip_special_tokens=True),
            }
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, model = load(args.gguf, args.dtype)
    import transformers

    hello = {
        "ready": True,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        reqs, conc = msg["reqs"], max(1, int(msg["concurrency"]))
        t0 = time.perf_counter()
        outs: list[dict] = []
        try:
            for i in range(0, len(reqs), conc):
                outs += run_batch(tok, model, reqs[i : i + conc], t0)
            reply = {"outs": outs, "wall": time.perf_counter() - t0}
        except Exception as e:  # reported to the orchestrator, which records the failure
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
