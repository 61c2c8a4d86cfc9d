"""Prometheus metrics in the text exposition format, named like SGLang's (`sglang:` by default, so SGLang
dashboards and sglang-router read them; `--metrics-prefix` changes it).

Request timings and delivered tokens (`gen_throughput`) arrive from the TokenizerManager (`Metrics` is its
StatsSink); HTTP outcomes from the app;
gauges (running, queued, token usage, cache hit rate, retractions, grammar counters) are read from the
scheduler's internal state at scrape time. Every sample carries the `model_name` label.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
GEN_WINDOW_S = 10.0  # the window of sglang:gen_throughput
FINISH_REASONS = ("stop", "length", "abort")  # the scheduler's finish types
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)



# The hierarchical cache's file tier: (name, kind, help). backuped_/prefetched_tokens_total are SGLang's names
# for tokens written to and read from its storage tier.
HICACHE_METRICS = (
    ("hicache_hits_total", "counter", "Requests whose prefix continued in the file tier and was loaded back."),
    ("hicache_misses_total", "counter", "Requests whose prompt went past the pool's match and the tier had none of it."),
    ("backuped_tokens_total", "counter", "Tokens written to the file tier."),
    ("prefetched_tokens_total", "counter", "Tokens loaded back from the file tier instead of recomputed."),
    ("hicache_backup_bytes_total", "counter", "Bytes written to the file tier."),
    ("hicache_load_bytes_total", "counter", "Bytes loaded back from the file tier."),
    ("hicache_load_seconds_per_token", "gauge", "Mean seconds to load one token's KV from the file tier."),
    ("hicache_rejected_entries_total", "counter",
     "Tier entries found torn, truncated, corrupt, foreign or stale: never served, recomputed."),
    ("hicache_dropped_writes_total", "counter", "Tier writes dropped (queue full or an I/O error)."),
    ("hicache_used_bytes", "gauge", "Bytes held by the file tier."),
    ("hicache_total_bytes", "gauge", "Size limit of the file tier in bytes (--hicache-size)."),
)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times


def _labels(d: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in d.items()) + "}"


class Metrics:
    """Counters and histograms of one server process (thread-safe; the Engine has none)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._started = clock()
        self._generated: deque[tuple[float, int]] = deque()  # (delivery time, tokens) within GEN_WINDOW_S
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.requests: dict[str, int] = defaultdict(int)  # finish type -> count
        self.http: dict[tuple[str, int], int] = defaultdict(int)  # (route, status) -> count
        self.rejected = 0

    # StatsSink
    def on_first_token(self, ttft: float) -> None:
        with self._lock:
            self.ttft.observe(ttft)

    def on_tokens(self, gap: float, num_tokens: int) -> None:
        with self._lock:
            self.itl.observe(gap / max(1, num_tokens), max(1, num_tokens))

    def on_generated(self, num_tokens: int) -> None:
        with self._lock:
            now = self._clock()
            self._generated.append((now, num_tokens))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._generated and self._generated[0][0] <= now - GEN_WINDOW_S:
            self._generated.popleft()

    def gen_throughput(self) -> float:
        """Output tokens per second delivered over the last GEN_WINDOW_S seconds (or since start, if sooner)."""
        with self._lock:
            now = self._clock()
            self._trim(now)
            window = min(GEN_WINDOW_S, now - self._started)
            return sum(n for _, n in self._generated) / window if window > 0 else 0.0

    def on_finish(self, e2e: float, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                  finish_type: str) -> None:
        with self._lock:
            self.e2e.observe(e2e)
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            self.cached_tokens += cached_tokens
            self.requests[finish_type or "unknown"] += 1

    def on_http(self, route: str, status: int) -> None:
        with self._lock:
            self.http[(route, status)] += 1
            if status == 503:
                self.rejected += 1

    def render(self, prefix: str, model_name: str, state: dict[str, Any] | None) -> str:
        """The exposition text; `state` is the scheduler's internal state (None if it did not answer)."""
        p = prefix.rstrip(":") + ":"
        base = {"model_name": model_name}
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
            lines.append(f"# HELP {p}{name} {help_}")
            lines.append(f"# TYPE {p}{name} {kind}")
            for suffix, labels, value in samples:
                lines.append(f"{p}{name}{suffix}{_labels({**base, **labels})} {value:g}")

        def hist(name: str, help_: str, h: Histogram) -> None:
            samples: list[tuple[str, dict[str, str], float]] = []
            acc = 0
            for bound, c in zip((*h.buckets, float("inf")), h.counts, strict=True):
                acc += c
                samples.append(("_bucket", {"le": "+Inf" if bound == float("inf") else f"{bound:g}"}, acc))
            samples += [("_sum", {}, h.sum), ("_count", {}, h.count)]
            metric(name, "histogram", help_, samples)

        s = state or {}
        total = s.get("max_total_num_tokens") or 0
        used = total - s.get("kv_free_slots", total) - s.get("kv_evictable_slots", 0) if total else 0
        throughput = self.gen_throughput()
        with self._lock:
            metric("num_running_reqs", "gauge", "Requests decoding or prefilling.",
                   [("", {}, s.get("num_running_reqs", 0))])
            metric("num_queue_reqs", "gauge", "Requests in the waiting queue.", [("", {}, s.get("num_waiting_reqs", 0))])
            metric("num_grammar_queue_reqs", "gauge", "Requests waiting for their grammar to compile.",
                   [("", {}, s.get("num_grammar_queue_reqs", 0))])
            metric("gen_throughput", "gauge", f"Output tokens per second over the last {GEN_WINDOW_S:g} s.",
                   [("", {}, throughput)])
            metric("num_used_tokens", "gauge", "KV slots held by running requests.", [("", {}, used)])
            metric("token_usage", "gauge", "Fraction of KV slots held by running requests.",
                   [("", {}, used / total if total else 0.0)])
            metric("cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / prompt tokens.",
                   [("", {}, s.get("cache_hit_rate", 0.0))])
            metric("num_retracted_reqs", "gauge", "Requests retracted to the waiting queue so far.",
                   [("", {}, s.get("num_retracted_reqs", 0))])
            metric("num_stall_steps_total", "counter",
                   "Steps in which a running request got no token, by reason (a step may have several).",
                   [("", {"reason": r}, s.get(f"stall_steps_{r}", 0))
                    for r in ("prefill_only", "retraction", "grammar_wait", "other")])
            metric("num_mixed_steps_total", "counter", "Steps carrying both decode and prefill rows.",
                   [("", {}, s.get("mixed_steps", 0))])
            if "spec_verify_ct" in s:  # speculative decoding is on (--speculative-algorithm)
                metric("spec_accept_length", "gauge", "Mean tokens emitted per speculative verify step.",
                       [("", {}, s.get("spec_accept_length", 0.0))])
                metric("spec_accept_rate", "gauge", "Accepted / proposed speculative draft tokens.",
                       [("", {}, s.get("spec_accept_rate", 0.0))])
                metric("spec_verify_steps_total", "counter", "Speculative verify steps (one per request and step).",
                       [("", {}, s.get("spec_verify_ct", 0))])
            if s.get("hicache"):  # --enable-hierarchical-cache (docs/hicache.md)
                for key, kind, help_ in HICACHE_METRICS:
                    metric(key, kind, help_, [("", {}, s.get(key, 0))])
            if "swa_total_slots" in s:  # the sliding-window layers' own KV pool (docs/gemma3.md)
                swa_total = s["swa_total_slots"] or 1
                swa_used = s["swa_total_slots"] - s.get("swa_free_slots", 0) - s.get("swa_evictable_slots", 0)
                metric("swa_num_used_tokens", "gauge", "Sliding-window KV slots held by running requests.",
                       [("", {}, swa_used)])
                metric("swa_token_usage", "gauge", "Fraction of sliding-window KV slots held by running requests.",
                       [("", {}, swa_used / swa_total)])
                metric("swa_evictable_tokens", "gauge", "Sliding-window KV slots of the prefix cache (tombstonable).",
                       [("", {}, s.get("swa_evictable_slots", 0))])
                metric("swa_max_total_num_tokens", "gauge", "Slots of the sliding-window KV pool.",
                       [("", {}, s["swa_total_slots"])])
            if "compiled_buckets" in s:  # CPU decode graphs (--compile-mode background/sync)
                metric("compiled_decode_buckets", "gauge", "Decode batch-size buckets running compiled graphs.",
                       [("", {}, len(s["compiled_buckets"]))])
                metric("pending_decode_buckets", "gauge", "Decode buckets still running eagerly (compiling).",
                       [("", {}, len(s.get("pending_buckets", [])))])
            for key, help_ in (("num_grammar_total", "Constrained requests."),
                               ("num_grammar_cache_hit_total", "Grammar cache hits."),
                               ("num_grammar_timeout_total", "Grammar compiles that timed out.")):
                metric(key, "counter", help_, [("", {}, s.get(key, 0))])
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [("", {}, self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Generated tokens of finished requests.",
                   [("", {}, self.generation_tokens)])
            metric("cached_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
                   [("", {}, self.cached_tokens)])
            # Label sets never change between scrapes (Prometheus clients and sglang-router's /engine_metrics
            # refuse a family whose samples disagree on label names): every finish reason from the start,
            # and no sample at all before the first HTTP response rather than an unlabelled one.
            reasons = {**dict.fromkeys(FINISH_REASONS, 0), **self.requests}
            metric("num_requests_total", "counter", "Finished requests by finish reason.",
                   [("", {"finish_reason": k}, v) for k, v in sorted(reasons.items())])
            metric("num_aborted_requests_total", "counter", "Aborted requests.",
                   [("", {}, self.requests.get("abort", 0))])
            metric("http_requests_total", "counter", "HTTP responses by route and status.",
                   [("", {"route": r, "status": str(c)}, v) for (r, c), v in sorted(self.http.items())])
            metric("num_rejected_requests_total", "counter", "Requests refused with 503 (overload, not ready).",
                   [("", {}, self.rejected)])
            hist("time_to_first_token_seconds", "Time to first token.", self.ttft)
            hist("inter_token_latency_seconds", "Time between output tokens.", self.itl)
            hist("e2e_request_latency_seconds", "End-to-end request latency.", self.e2e)
            metric("grammar_compilation_seconds_total", "counter", "Seconds spent compiling grammars.",
                   [("", {}, s.get("grammar_compilation_time_seconds_sum", 0.0))])
        return "\n".join(lines) + "\n"
