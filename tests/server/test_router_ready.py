"""What clients and sglang-router send a worker, on one model-free server (the echo scheduler of
tests/server/fake_scheduler.py, real tokenizer): the `model` names served as the default model, the load
and info routes the router polls, SGLang's metric names with label sets stable from the first scrape, and
/version, /tokenize, /detokenize in SGLang's shapes."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest

from runtime.config import Config
from runtime.tokenizer.generate_input import RequestError
from server.app import ServerState
from server.metrics import Metrics
from server.openai.common import check_model
from tests.server.harness import ServerProc

CHAT = "/v1/chat/completions"
M = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--served-model-name", "smol", "--log-level", "warning", fake=True)  # SGLang's metric names
    try:
        yield s.wait_ready()
    finally:
        s.stop()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? \S+$")


def label_names(text: str) -> dict[str, set[frozenset[str]]]:
    """Sample name -> the label-name sets its samples carry (one set per name when the family is stable)."""
    out: dict[str, set[frozenset[str]]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, line
            names = frozenset(kv.split("=", 1)[0] for kv in m.group(2).split(",")) if m.group(2) else frozenset()
            out.setdefault(m.group(1), set()).add(names)
    return out


def test_metric_label_names_agree_from_the_first_scrape(server):
    """Must run first on the module's server: its first scrape, before any request finished."""
    with server.client() as c:
        first = c.get("/metrics").text
        assert c.post("/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        later = c.get("/metrics").text
    before, after = label_names(first), label_names(later)
    assert all(len(v) == 1 for v in (*before.values(), *after.values())), (before, after)
    for name, labels in before.items():
        assert after[name] == labels, name
    # no unlabelled sample in a family that later has labels: the request counters start per finish reason
    assert before["sglang:num_requests_total"] == {frozenset({"model_name", "finish_reason"})}
    for reason in ("stop", "length", "abort"):
        assert f'sglang:num_requests_total{{model_name="smol",finish_reason="{reason}"}} 0' in first
    assert 'sglang:num_requests_total{model_name="smol",finish_reason="length"} 1' in later
    assert "sglang:http_requests_total{" not in first
    assert 'sglang:http_requests_total{model_name="smol",route="/generate",status="200"} 1' in later


def test_metrics_label_names_unit():
    m = Metrics()
    before = label_names(m.render("sglang", "smol", None))
    m.on_finish(1.0, 3, 2, 0, "stop")
    m.on_http("/generate", 200)
    after = label_names(m.render("sglang", "smol", None))
    assert before.keys() <= after.keys() and all(after[k] == v for k, v in before.items())
    assert all(len(v) == 1 for v in after.values())


STATE = ServerState(cfg=Config(), model_path="/models/SmolLM2.gguf", served_model_name="smol")


@pytest.mark.parametrize("model, echoed", [
    ("smol", "smol"),                                    # the served name
    ("/models/SmolLM2.gguf", "/models/SmolLM2.gguf"),    # the model path
    ("default", "smol"),                                 # the README's and SGLang's examples
    ("unknown", "smol"),                                 # what sglang-router fills in
    (None, "smol"),                                      # no model at all
])
def test_model_names_served_as_the_one_model(model, echoed):
    assert check_model(STATE, model) == echoed


@pytest.mark.parametrize("model, status, code", [("gpt-4", 404, "model_not_found"), ("", 404, "model_not_found"),
                                                 (7, 400, "invalid_type")])
def test_other_model_names_are_refused(model, status, code):
    with pytest.raises(RequestError) as e:
        check_model(STATE, model)
    assert (e.value.status, e.value.code, e.value.param) == (status, code, "model")


def test_model_names_end_to_end(server):
    with server.client() as c:
        path = c.get("/get_model_info").json()["model_path"]
        for model, echoed in (("smol", "smol"), (path, path), ("default", "smol"), ("unknown", "smol")):
            r = c.post(CHAT, json={"model": model, "messages": M, "max_tokens": 2})
            assert r.status_code == 200, (model, r.text)
            assert r.json()["model"] == echoed
            r = c.post("/v1/completions", json={"model": model, "prompt": "a b", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == echoed, (model, r.text)
        r = c.post(CHAT, json={"messages": M, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "smol"
        r = c.post(CHAT, json={"model": "gpt-4", "messages": M, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_model_info_aliases_with_model_type(server):
    with server.client() as c:
        info = c.get("/get_model_info").json()
        assert c.get("/model_info").json() == info
        assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]  # SmolLM2 GGUF
        assert info["served_model_name"] == "smol" and info["max_context_length"] == 2048
        si, alias = c.get("/get_server_info").json(), c.get("/server_info").json()
        assert alias.keys() == si.keys() and alias["served_model_name"] == si["served_model_name"] == "smol"


def _load(c: httpx.Client) -> dict:
    r = c.get("/get_load")
    assert r.status_code == 200, r.text
    (entry,) = r.json()
    assert entry.keys() == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} and entry["dp_rank"] == 0
    return entry


def test_get_load_counts_the_schedulers_requests_and_tokens(server):
    """The echo scheduler holds prompt + max_new_tokens slots per running request out of 4096: two requests
    of 4 + 1500 run (3008 slots), the third waits (4 prompt tokens), so the load is 3 requests, 1 waiting,
    3012 tokens; after abort_all it is back to zero."""
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1500}}
    with server.client(timeout=120) as c, concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert _load(c) == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}

        def one() -> dict:
            with server.client(timeout=120) as cc:
                return cc.post("/generate", json=body).json()

        futs = [pool.submit(one) for _ in range(3)]
        deadline = time.monotonic() + 30
        while (load := _load(c))["num_reqs"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert load == {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 2 * 1504 + 4}
        assert c.post("/abort_request", json={"abort_all": True}).status_code == 200
        reasons = [f.result()["meta_info"]["finish_reason"]["type"] for f in futs]
        assert reasons == ["abort"] * 3
        assert _load(c) == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_gen_throughput_is_tokens_delivered_over_the_last_window():
    now = [100.0]
    m = Metrics(clock=lambda: now[0])
    assert m.gen_throughput() == 0.0
    now[0] = 102.0
    m.on_generated(30)
    assert m.gen_throughput() == 15.0          # 30 tokens in the 2 s since start
    now[0] = 108.0
    m.on_generated(50)
    assert m.gen_throughput() == 10.0          # 80 tokens in 8 s
    now[0] = 113.0
    assert m.gen_throughput() == 5.0           # the window is 10 s: the 30 at t=102 fell out
    now[0] = 200.0
    assert m.gen_throughput() == 0.0
    assert 'sglang:gen_throughput{model_name="smol"} 0' in m.render("sglang", "smol", None)


def test_sglang_metric_names_by_default_with_gen_throughput(server):
    with server.client() as c:
        r = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 40}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 40
        text = c.get("/metrics").text
    assert "radixgen:" not in text
    (line,) = [x for x in text.splitlines() if x.startswith("sglang:gen_throughput{")]
    assert float(line.split()[-1]) > 0
    assert 'sglang:num_grammar_queue_reqs{model_name="smol"} 0' in text


def test_version(server):
    from importlib.metadata import version

    with server.client() as c:
        r = c.get("/version")
        info_version = c.get("/get_server_info").json()["version"]
    assert r.status_code == 200 and r.json() == {"version": version("radixgen")} == {"version": info_version}


def test_tokenize_detokenize_round_trip(server):
    with server.client() as c:
        r = c.post("/tokenize", json={"prompt": "Hello world, how are you?"})
        assert r.status_code == 200, r.text
        tok = r.json()
        assert tok.keys() == {"tokens", "count", "max_model_len"}
        ids = tok["tokens"]
        assert tok["count"] == len(ids) > 0 and tok["max_model_len"] == 2048
        # the echo scheduler outputs the prompt's own token ids: the server's tokenizer agrees with /tokenize
        echo = c.post("/generate", json={"text": "Hello world, how are you?",
                                         "sampling_params": {"max_new_tokens": len(ids)}}).json()
        assert echo["output_ids"] == ids
        assert c.post("/v1/tokenize", json={"model": "default", "prompt": "Hello world, how are you?"}).json() == tok
        assert c.post("/detokenize", json={"tokens": ids}).json() == {"text": "Hello world, how are you?"}
        batch = c.post("/tokenize", json={"prompt": ["a b", "Hello world, how are you?"]}).json()
        assert batch["tokens"][1] == ids and batch["count"] == [len(batch["tokens"][0]), len(ids)]
        texts = c.post("/v1/detokenize", json={"tokens": batch["tokens"]}).json()
        assert texts == {"text": ["a b", "Hello world, how are you?"]}
        (start,) = c.post("/tokenize", json={"prompt": "<|im_start|>"}).json()["tokens"]
        kept = c.post("/detokenize", json={"tokens": [start, *ids], "skip_special_tokens": False}).json()
        assert kept == {"text": "<|im_start|>Hello world, how are you?"}
        assert c.post("/detokenize", json={"tokens": [start, *ids]}).json() == {"text": "Hello world, how are you?"}
        assert c.post("/detokenize", json={"tokens": []}).json() == {"text": ""}


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens"),
    ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [[1], "x"]}, 400, "tokens"),
])
def test_tokenize_detokenize_refuse_bad_bodies(server, route, body, status, param):
    with server.client() as c:
        r = c.post(route, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
