"""What clients and sglang-router send a worker, on one model-free server (the echo scheduler of
tests/server/fake_scheduler.py, real tokenizer): the `model` names served as the default model, the load
and info routes the router polls, and metric label sets stable from the first scrape."""

from __future__ import annotations

import pytest

from runtime.config import Config
from runtime.tokenizer.generate_input import RequestError
from server.app import ServerState
from server.openai.common import check_model
from tests.server.conftest import ServerProc

CHAT = "/v1/chat/completions"
M = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--served-model-name", "smol", "--log-level", "warning", fake=True)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


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
