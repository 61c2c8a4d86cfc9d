"""sglang-router (installed from PyPI) in front of radixgen workers, each its own process on 127.0.0.1.

Two routers: `fakes` fronts two model-free workers started for the module (the echo scheduler,
tests/server/fake_scheduler.py) for the plumbing (routes, /get_loads, /engine_metrics, a dead worker);
`real` fronts the session's SmolLM2 server (`default_server`), where the answer matters (the README's
JSON-schema call and prompt program, whose `select` the router makes go one request per choice). The routers
are killed by PID at the end.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import pytest

import frontend_lang as fl
from tests.server.harness import ServerProc
from tests.server.router_proc import RouterProc

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def cluster(default_server):
    """The real worker is the session's `default_server` (the router only adds itself in front of it)."""
    workers = [ServerProc("--log-level", "warning", fake=True), ServerProc("--log-level", "warning", fake=True)]
    routers: list[RouterProc] = []
    try:
        for w in workers:
            w.wait_ready()
        routers.append(RouterProc([workers[0].url, workers[1].url], health_check_interval=1,
                                  health_failure_threshold=1))
        routers.append(RouterProc([default_server.url]))
        for r in routers:
            r.wait_registered()
        yield {"workers": workers, "fakes": routers[0], "real": routers[1]}
    finally:
        for r in routers:
            r.stop()
        for w in workers:
            w.stop()


def test_native_routes_through_the_router(cluster):
    with cluster["fakes"].client() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").status_code == 200
        info = c.get("/get_model_info").json()
        assert info["model_type"] == "llama" and info["max_context_length"] == 2048
        served = info["served_model_name"]
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [served]
        r = c.post("/generate", json={"text": "Hello world", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()["text"] == "Hello world"  # the echo of its 2 tokens
        ids = c.post("/generate", json={"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 3}})
        assert [a["output_ids"] for a in ids.json()] == [[5, 6, 5], [7, 8, 9]]
        events = []
        with c.stream("POST", "/generate", json={"text": "a b c", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 3}}) as s:
            assert s.status_code == 200
            events = [line[5:].strip() for line in s.iter_lines() if line.startswith("data:")]
        # events carry the cumulative text; tokens that arrive together may share one event
        assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == "a b c", events
        assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "length", events
        assert c.post("/generate", json={"text": ["a", "b"]}).status_code == 422  # why select falls back
        assert c.post("/flush_cache").status_code == 200


def test_openai_routes_through_the_router(cluster):
    with cluster["fakes"].client() as c:
        served = c.get("/get_model_info").json()["served_model_name"]
        msgs = [{"role": "user", "content": "hi"}]
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})  # the router sends "unknown"
        assert r.status_code == 200 and r.json()["model"] == served and r.json()["usage"]["completion_tokens"] == 3
        with c.stream("POST", "/v1/chat/completions", json={"model": "default", "messages": msgs, "max_tokens": 3,
                                                            "stream": True}) as s:
            data = [line[5:].strip() for line in s.iter_lines() if line.startswith("data:")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"model": "default", "prompt": "a b c", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a b c"


def test_readme_examples_through_the_router(cluster):
    """The README's JSON-schema call (OpenAI client) and its prompt program, on the real model."""
    from openai import OpenAI

    url = cluster["real"].url
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"]}
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name a big city as JSON."}], max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)

    @fl.function
    def qa(s, question):
        s += fl.system("You are a concise assistant.")
        s += fl.user(question)
        s += fl.assistant(fl.gen("answer", max_tokens=16, stop="\n"))
        s += fl.user("Is that answer certain?")
        s += fl.assistant(fl.select("sure", choices=["yes", "no"]))

    backend = fl.RuntimeEndpoint(url)
    try:
        state = qa.run(question="What is the capital of France?", backend=backend)
        assert state.error() is None, state.error()
        assert state["sure"] in ("yes", "no") and backend.batch_refused
        assert all(lp > float("-inf") for lp in state.get_meta_info("sure")["normalized_prompt_logprobs"])
    finally:
        backend.shutdown()


_METRIC = re.compile(r'^sglang_(\w+)\{(.*)\} (\S+)$')


def _samples(text: str, name: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """worker_addr -> [(labels, value)] of one metric family in the router's /engine_metrics."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(1) == name:
            labels = dict(kv.split("=", 1) for kv in re.findall(r'(\w+="[^"]*")', m.group(2)))
            labels = {k: v.strip('"') for k, v in labels.items()}
            out.setdefault(labels["worker_addr"], []).append((labels, float(m.group(3))))
    return out


def test_get_loads_and_engine_metrics_answer_with_real_values(cluster):
    """Three long requests held by the workers: /get_loads reports each worker's /get_load tokens, and
    /engine_metrics each worker's running requests; after an abort, the finished count says 3 aborts."""
    fakes, (w0, w1) = cluster["fakes"], cluster["workers"]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1500}}
    results: list[int] = []

    def one(i: int) -> None:
        with fakes.client(timeout=120) as cc:
            results.append(cc.post("/generate", json={**body, "input_ids": [5 + i, 6, 7, 8]}).status_code)

    with fakes.client() as c:
        before = _samples(c.get("/engine_metrics").text, "num_requests_total")
        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        direct: dict[str, dict] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            direct = {w.url: httpx.get(w.url + "/get_load").json()[0] for w in (w0, w1)}
            # all three admitted: a request still waiting counts its 4 prompt tokens, then 1504 once running,
            # and the router's read below must see the same loads
            held = sum(d["num_reqs"] for d in direct.values()) == 3
            if held and not any(d["num_waiting_reqs"] for d in direct.values()):
                break
            time.sleep(0.05)
        assert sum(d["num_reqs"] for d in direct.values()) == 3 and not any(
            d["num_waiting_reqs"] for d in direct.values()), direct
        loads = c.get("/get_loads")
        assert loads.status_code == 200
        assert {x["worker"]: x["load"] for x in loads.json()["workers"]} == {
            u: d["num_tokens"] for u, d in direct.items()}
        assert sum(x["load"] for x in loads.json()["workers"]) == 3 * 1504
        metrics = c.get("/engine_metrics")
        assert metrics.status_code == 200
        running = _samples(metrics.text, "num_running_reqs")
        assert {u: v[0][1] for u, v in running.items()} == {u: d["num_reqs"] for u, d in direct.items()}
        for w in (w0, w1):
            assert httpx.post(w.url + "/abort_request", json={"abort_all": True}).status_code == 200
        for t in threads:
            t.join(60)
        assert results == [200, 200, 200]
        after = _samples(c.get("/engine_metrics").text, "num_requests_total")

    def aborts(s: dict) -> float:
        return sum(v for rows in s.values() for labels, v in rows if labels["finish_reason"] == "abort")

    assert aborts(after) - aborts(before) == 3


def test_killing_one_worker_leaves_the_other_serving(cluster):
    """Runs last: worker 1 goes down for good. Once the router's health check (every second here) marks it
    unhealthy, every request gets its answer from worker 0 (before that, the router answers the requests it
    sends to the dead worker with 500: it does not retry a refused connection elsewhere)."""
    fakes, (_, w1) = cluster["fakes"], cluster["workers"]
    w1.stop()
    with fakes.client() as c:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = {w["url"]: w["is_healthy"] for w in c.get("/workers").json()["workers"]}
            if health.get(w1.url) is False:
                break
            time.sleep(0.2)
        assert health.get(w1.url) is False, health
        for i in range(8):
            r = c.post("/generate", json={"text": f"prompt number {i} here", "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 200, (i, r.text)
            assert r.json()["text"] == f"prompt number {i}"[: len(r.json()["text"])]
        assert c.get("/health").status_code == 200


def test_router_command_and_lookup(tmp_path):
    from server.router import RouterNotFound, find_router, router_command

    assert find_router().endswith("sglang-router")
    with pytest.raises(RouterNotFound, match="not an executable file"):
        find_router(str(tmp_path / "nope"))
    argv = router_command("/bin/r", "127.0.0.1", 8000, ["http://a:1", "http://b:2"], "cache_aware", 9000, "warning")
    assert argv[:2] == ["/bin/r", "launch"]
    assert argv[argv.index("--worker-urls") + 1:argv.index("--policy")] == ["http://a:1", "http://b:2"]
    assert argv[argv.index("--log-level") + 1] == "warn" and argv[argv.index("--prometheus-port") + 1] == "9000"
    with pytest.raises(ValueError, match="unknown router policy"):
        router_command("/bin/r", "h", 1, ["u"], "fastest", 2)
    with pytest.raises(ValueError, match="at least one worker"):
        router_command("/bin/r", "h", 1, [], "cache_aware", 2)
