"""Grammar backends side by side, called from bench/constrained.py --backends:

(1) Compile, per backend, over JSONSchemaBench's 475 MaskBench schemas (tests/data/jsonschemabench): share
    compiled, share refused, compile time p50/p99 (one compile thread, cold cache, wall per schema).
(2) Mask time per token at batch 1 and 32: grammars advanced along the valid MaskBench documents, one
    `apply_grammar_masks` per step over [B, V] logits (the scheduler's call).
(3) End to end on SmolLM2 through a real server (`/v1/chat/completions`, response_format json_schema, default
    flags but --grammar-backend): share of requests that return a valid document (and how many of those the
    closing window ended, finish_reason length), share refused (400), and 200-and-invalid ("broken") split into
    cut by max_tokens and wrong; and how many of the schemas the llguidance library compiles by itself.
(4) 32 concurrent constrained vs unconstrained requests of the same output lengths on the JSON workload:
    throughput ratio, alternating rounds; the figure is the median of the per-round paired ratios (a round's
    two kinds run back to back, so a VM that slows down between rounds moves both).
"""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import os
import random
import statistics
import time

import httpx
import jsonschema
import torch

from runtime.config import GrammarConfig
from runtime.constrained import Grammar, GrammarBackend, GrammarError, apply_grammar_masks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "jsonschemabench", "maskbench_subset.json.gz")
BACKENDS = ("llguidance", "xgrammar", "outlines")


def cases() -> list[dict]:
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        return json.load(f)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def compile_all(tok, name: str, entries: list[dict], timeout: float = 10.0) -> dict:  # noqa: ANN001
    """(1): one compile thread, so each wall time is one schema's compile. Schema semantics of the spec, as in
    tests/runtime/constrained/test_jsonschemabench.py (extra properties allowed, numbers, strings, arrays and
    maps unbounded), so that (2) can advance the grammars along the valid documents; the server in (3) runs the
    defaults."""
    cfg = GrammarConfig(grammar_backend=name, grammar_compile_timeout=timeout, json_allow_extra_properties=True,
                        json_bound_numbers=False, json_max_string_length=0, json_max_array_items=0,
                        json_max_object_properties=0)
    walls, ok, refused, grammars = [], 0, 0, {}
    with GrammarBackend.from_tokenizer(tok, cfg, num_workers=1) as be:
        for e in entries:
            t = time.perf_counter()
            g = be.compile_blocking("json_schema", json.dumps(e["schema"]), timeout=timeout + 30)
            walls.append(time.perf_counter() - t)
            if isinstance(g, GrammarError):
                refused += 1
            else:
                ok += 1
                grammars[e["id"]] = g
        stats = be.stats()
    return {"n": len(entries), "compiled": ok, "refused": refused, "p50": pct(walls, 0.5), "p99": pct(walls, 0.99),
            "max": max(walls), "timeouts": stats["timeouts"], "grammars": grammars}


def mask_time(tok, grammars: dict[str, Grammar], entries: list[dict], batch: int, steps: int = 40) -> float:  # noqa: ANN001
    """(2): seconds per token per row of one batched mask, rows at real positions of valid documents, with the
    native one-pass mask loaded as in the scheduler (kernels/cpu; the torch path where it cannot be built)."""
    try:
        from kernels.cpu import ops

        ops.load()
    except Exception as e:  # noqa: BLE001 - no toolchain: measure the torch path, as the scheduler would run it
        print(f"native CPU ops unavailable ({str(e).splitlines()[0]}): timing the torch mask path")
    rows: list[tuple[Grammar, list[int]]] = []
    for e in entries:
        g = grammars.get(e["id"])
        for t in e["tests"]:
            if g is not None and t["valid"]:
                text = json.dumps(t["data"], separators=(",", ":"), ensure_ascii=False)
                ids = tok.encode(text, add_special_tokens=False, allow_special=False)
                if len(ids) > steps:
                    rows.append((g, ids))
    rows = random.Random(0).sample(rows, min(batch, len(rows)))
    while len(rows) < batch:
        rows.append(rows[len(rows) % max(1, len(rows))])
    gs = [g.copy() for g, _ in rows]
    logits = torch.zeros(batch, tok.vocab_size)
    total = 0.0
    for step in range(steps):
        t = time.perf_counter()
        apply_grammar_masks(logits, gs)
        total += time.perf_counter() - t
        for g, (_, ids) in zip(gs, rows, strict=True):
            g.accept_token(ids[step])
    return total / steps / batch


def llguidance_alone(entries: list[dict]) -> set[str]:
    """The ids of the schemas the llguidance library compiles by itself (the user's schema as sent, its default
    options, no rewrite of ours): the issue's reference for the end-to-end valid share."""
    import llguidance as llg

    ok = set()
    for e in entries:
        try:
            text = llg.LLMatcher.grammar_from_json_schema(json.dumps(e["schema"]))
        except ValueError:
            continue
        if not llg.LLMatcher.validate_grammar(text, None):
            ok.add(e["id"])
    return ok


# ------------------------------------------------------------ end to end through a real server


def _chat(client: httpx.Client, schema: dict, i: int, max_tokens: int, temperature: float) -> dict:
    body = {"model": "default", "max_tokens": max_tokens, "temperature": temperature, "seed": i,
            "messages": [{"role": "user", "content": "Produce a JSON document that satisfies this JSON schema:\n"
                          + json.dumps(schema)[:1500]}],
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code == 400:
        return {"outcome": "refused", "why": r.json()["error"]["message"][:300]}
    r.raise_for_status()
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] or ""
    try:
        value = json.loads(text)
        jsonschema.validators.validator_for(schema)(schema).validate(value)
        return {"outcome": "valid", "finish": choice["finish_reason"], "tokens": r.json()["usage"]["completion_tokens"]}
    except (ValueError, jsonschema.ValidationError) as e:
        kind = "cut" if choice["finish_reason"] == "length" else "invalid"
        return {"outcome": kind, "why": str(e)[:300], "text": text, "finish": choice["finish_reason"]}


def end_to_end(url: str, entries: list[dict], max_tokens: int, temperature: float, concurrency: int = 32) -> dict:
    """(3): every schema once, `concurrency` requests in flight."""
    with httpx.Client(base_url=url, timeout=1800) as client, \
            concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        t = time.perf_counter()
        res = list(pool.map(lambda ie: _chat(client, ie[1]["schema"], ie[0], max_tokens, temperature),
                            enumerate(entries)))
        wall = time.perf_counter() - t
    out = {k: sum(r["outcome"] == k for r in res) for k in ("valid", "refused", "cut", "invalid")}
    # valid answers the closing window ended (--json-close-reserve, runtime/constrained/closing.py)
    out["closed"] = sum(r["outcome"] == "valid" and r["finish"] == "length" for r in res)
    for r, e in zip(res, entries, strict=True):
        r["id"] = e["id"]
    out.update(n=len(entries), wall=wall, broken=[r for r in res if r["outcome"] == "invalid"][:5],
               cut_examples=[r for r in res if r["outcome"] == "cut"][:3], results=res)
    return out


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "employed"]}


def throughput(url: str, n: int = 32, rounds: int = 7, max_tokens: int = 96) -> dict:
    """(4): n concurrent PERSON-schema requests vs n unconstrained ones with the same output lengths
    (ignore_eos: each the length of its constrained twin's latest answer), after an untimed warm-up round of
    both; rounds alternate which kind goes first. ratio: the median over rounds of unconstrained tok/s /
    constrained tok/s within the round (paired); ratio_of_medians: median / median, as reported before."""
    prompts = [f"Invent person number {i} (name, age, city, employed) as JSON." for i in range(n)]

    def one(client: httpx.Client, i: int, constrained: bool, length: int) -> int:
        body: dict = {"model": "default", "temperature": 0.7, "seed": i,
                      "messages": [{"role": "user", "content": prompts[i]}]}
        if constrained:
            body.update(max_tokens=max_tokens, response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON}})
        else:
            body.update(max_tokens=length, ignore_eos=True)
        r = client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    cons_tps, free_tps = [], []
    with httpx.Client(base_url=url, timeout=1800) as client, concurrent.futures.ThreadPoolExecutor(n) as pool:
        def timed(constrained: bool, lens: list[int]) -> tuple[list[int], float]:
            t = time.perf_counter()
            got = list(pool.map(lambda i: one(client, i, constrained, max(1, lens[i])), range(n)))
            return got, sum(got) / (time.perf_counter() - t)

        # Untimed warm-up round of both kinds: compiles the grammar and puts the n prompts in the radix cache, so
        # every timed round of either kind starts from the same cache state (the first constrained round would
        # otherwise be the only one that prefills the prompts).
        lens, _ = timed(True, [0] * n)
        timed(False, lens)
        for r in range(rounds):
            for constrained in ((True, False) if r % 2 == 0 else (False, True)):  # alternate which goes first
                got, tps = timed(constrained, lens)
                (cons_tps if constrained else free_tps).append(tps)
                if constrained:
                    lens = got
    paired = [f / c for f, c in zip(free_tps, cons_tps, strict=True)]
    return {"cons": cons_tps, "free": free_tps, "paired": paired, "ratio": statistics.median(paired),
            "ratio_of_medians": statistics.median(free_tps) / statistics.median(cons_tps)}


# ------------------------------------------------------------ driver


class Server:
    """`python -m server serve` on 127.0.0.1:port with extra flags; stopped by its pid."""

    def __init__(self, port: int, *flags: str) -> None:
        import subprocess
        import sys

        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/radixgen-bench-constrained-{port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--compile-mode", "sync", "--host", "127.0.0.1", "--port",
                                      str(port), "--log-level", "warning", *flags], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run(tok, port: int, e2e_n: int, max_tokens: int, temperature: float, backends: tuple[str, ...],  # noqa: ANN001
        skip_server: bool, server_flags: tuple[str, ...] = (), rounds: int = 7, dump: str | None = None) -> list[str]:
    """The --backends section's lines. server_flags: extra `serve` flags for the end-to-end servers; dump: write
    every end-to-end answer (outcome, finish reason, full text of cut ones, refusal reason) there as JSON."""
    entries = cases()
    e2e = random.Random(7).sample(entries, min(e2e_n, len(entries)))
    lines = ["## Grammar backends side by side (bench/constrained_backends.py)", "",
             f"Machine: shared 2-core CPU (load average {os.getloadavg()[0]:.1f} at start), SmolLM2-135M; "
             f"data: JSONSchemaBench MaskBench subset ({len(entries)} schemas).", "",
             "| backend | compiled | refused | compile p50 | compile p99 | mask/token/row B=1 | B=32 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    e2e_rows, tp_rows = [], []
    for name in backends:
        c = compile_all(tok, name, entries)
        m1 = mask_time(tok, c["grammars"], entries, 1)
        m32 = mask_time(tok, c["grammars"], entries, 32)
        lines.append(f"| {name} | {c['compiled']}/{c['n']} ({c['compiled'] / c['n']:.0%}) | {c['refused']} | "
                     f"{c['p50'] * 1e3:.1f} ms | {c['p99'] * 1e3:.0f} ms | {m1 * 1e6:.0f} us | {m32 * 1e6:.0f} us |")
        print(lines[-1], flush=True)
        if skip_server:
            continue
        srv = Server(port, "--grammar-backend", name, "--max-total-tokens", "32768", *server_flags)
        try:
            r = end_to_end(srv.url, e2e, max_tokens, temperature)
            e2e_rows.append((name, r, sum(1 for e in e2e if e["id"] in c["grammars"])))
            print(name, {k: r[k] for k in ("valid", "closed", "refused", "cut", "invalid", "wall")}, flush=True)
            if dump:
                with open(f"{dump}.{name}.json", "w") as f:
                    json.dump(r["results"], f, indent=1)
            if name == backends[0]:
                tp_rows.append(throughput(srv.url, rounds=rounds))
        finally:
            srv.stop()
    lines.append("")
    if e2e_rows:
        flags = f", server flags `{' '.join(server_flags)}`" if server_flags else ""
        lines += [f"End to end: {len(e2e)} schemas (seeded sample), `/v1/chat/completions` with response_format "
                  f"json_schema, max_tokens {max_tokens}, temperature {temperature}, 32 in flight{flags}:", "",
                  "| backend | valid 200 | of which closed by the budget | refused 400 | cut by max_tokens "
                  "| 200 and invalid | compiled (same schemas) | llguidance alone compiles |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        alone = len(llguidance_alone(e2e))
        for name, r, comp in e2e_rows:
            n = r["n"]
            lines.append(f"| {name} | {r['valid']}/{n} ({r['valid'] / n:.0%}) | {r['closed']} | {r['refused']} | "
                         f"{r['cut']} | "
                         f"**{r['invalid']}** | {comp}/{n} ({comp / n:.0%}) | {alone}/{n} ({alone / n:.0%}) |")
        lines.append("")
        for name, r, _ in e2e_rows:
            if r["invalid"]:
                lines.append(f"- {name} 200-and-invalid examples: {r['broken']}")
            if r["cut"]:
                lines.append(f"- {name} cut examples: {[x['text'][:80] for x in r['cut_examples']]}")
        lines.append("")
    for t in tp_rows:
        lines += [f"32 concurrent PERSON-schema requests vs 32 unconstrained of the same lengths ({backends[0]}, "
                  f"{len(t['cons'])} alternating rounds): constrained tok/s {[round(x, 1) for x in t['cons']]}, "
                  f"unconstrained {[round(x, 1) for x in t['free']]}; paired round ratios (unconstrained / "
                  f"constrained) {[round(x, 2) for x in t['paired']]}; **overhead ratio (median of the paired "
                  f"ratios) {t['ratio']:.2f}x** (median / median: {t['ratio_of_medians']:.2f}x)", ""]
    return lines
