"""Priority scheduling and predicted outputs over HTTP, on one real SmolLM2 server (float32, dense weights,
n-gram speculation, one running request at a time so priority decides who runs).

- A high-priority request sent while a low-priority one decodes preempts it: it finishes first, the low one
  is retracted once and still completes its full output.
- A chat request with `prediction` returns the same greedy text as without, and reports how many proposed
  tokens the model accepted (usage.completion_tokens_details); with the answer itself as the prediction,
  most proposals are accepted.
"""

from __future__ import annotations

import json
import threading

import pytest

from tests.server.harness import ServerProc

FILE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
"""


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--enable-priority-scheduling", "--max-running-requests", "1", "--speculative-algorithm",
                   "ngram", "--quantization", "none", "--dtype", "float32", "--max-total-tokens", "4096",
                   "--log-level", "warning")
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


def test_a_higher_priority_request_preempts_a_running_one(server):
    finished: list[tuple[str, dict]] = []
    started = threading.Event()

    def low():
        body = {"text": "Count from one to one hundred:", "priority": 0, "stream": True,
                "sampling_params": {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}}
        with server.client(timeout=300) as c, c.stream("POST", "/generate", json=body) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
                    started.set()
            finished.append(("low", last["meta_info"]))

    t = threading.Thread(target=low)
    t.start()
    assert started.wait(120), "the low-priority request never started"
    with server.client(timeout=300) as c:
        r = c.post("/generate", json={"text": "The capital of France is", "priority": 100,
                                      "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert r.status_code == 200, r.text
        finished.append(("high", r.json()["meta_info"]))
    t.join(300)
    assert [name for name, _ in finished] == ["high", "low"]
    meta = dict(finished)
    assert meta["low"]["completion_tokens"] == 96 and meta["low"]["num_retractions"] >= 1
    with server.client() as c:
        state = c.get("/get_server_info").json()["internal_states"][0]
    assert state["num_preempted_reqs"] >= 1


def _chat(server, prediction: str | None) -> dict:
    body = {"model": "default", "temperature": 0, "max_tokens": 64, "messages": [
        {"role": "user", "content": "Rewrite this Python file with `width` renamed to `w`. Reply with the code "
                                    "only.\n\n" + FILE}]}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    with server.client(timeout=300) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_prediction_keeps_greedy_output_and_reports_accepted_tokens(server):
    plain = _chat(server, None)
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]
    for prediction in (FILE, text):
        r = _chat(server, prediction)
        assert r["choices"][0]["message"]["content"] == text
        details = r["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] >= 0 and details["rejected_prediction_tokens"] >= 0
    # the answer itself as the prediction: most of it is proposed and accepted
    assert details["accepted_prediction_tokens"] >= r["usage"]["completion_tokens"] // 2, details
