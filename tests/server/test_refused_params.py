"""Parameters radixgen does not serve are a 400 naming them, never silently dropped: on the OpenAI routes any
unknown field, `modalities` (but text), `audio`, `web_search_options`, a `service_tier` but auto/default,
`reasoning_effort`, a `verbosity` but medium, `return_hidden_states`, chat `store: true`, `priority` without
--enable-priority-scheduling, `prediction` without n-gram speculation; on native `/generate` any unknown key
and `image_data`, `lora_path`, `return_hidden_states`, `custom_logit_processor`, `background`, `return_bytes`,
`return_entropy`; a json_schema response_format without a schema. OpenAI's informational fields and the
fields sglang-router fills in pass. Unit checks on the validators, then the same through HTTP on the model-free
echo server."""

from __future__ import annotations

import time

import pytest

from runtime.messages import FinishStop
from runtime.tokenizer.chat_template import check_chat_template
from runtime.tokenizer.generate_input import RequestError, normalize_generate
from server.cli import build_parser
from server.openai import params as P
from server.openai import tools as T
from server.openai.chat import _choice
from server.openai.chat_output import OutputPlan
from server.openai.reasoning import ReasoningPlan
from tests.server.harness import ServerProc

M = [{"role": "user", "content": "hi"}]

NATIVE_REFUSED = [
    ("image_data", "https://example.com/cat.png"),
    ("image_data", ["data:image/png;base64,AAAA"]),
    ("lora_path", "adapters/sql"),
    ("return_hidden_states", True),
    ("custom_logit_processor", "{\"callable\": \"x\"}"),
    ("background", True),
    ("return_bytes", True),
    ("return_entropy", True),
    ("session_params", {"id": "s"}),
    ("no_such_key", 1),
]
OPENAI_REFUSED = [
    ("modalities", ["text", "audio"]),
    ("modalities", ["audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("web_search_options", {}),
    ("web_search_options", {"search_context_size": "low"}),
    ("service_tier", "flex"),
    ("service_tier", "priority"),
    ("reasoning_effort", "low"),
    ("verbosity", "high"),
    ("return_hidden_states", True),
    ("no_such_field", 1),
]
# what sglang-router sends on every request, and OpenAI's informational fields
OPENAI_ACCEPTED = {"user": "u-1", "metadata": {"k": "v"}, "safety_identifier": "h", "prompt_cache_key": "c",
                   "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
                   "service_tier": "auto", "verbosity": "medium"}
ROUTER_GENERATE = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False}


def _err(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value


@pytest.mark.parametrize("key, value", NATIVE_REFUSED)
def test_native_keys_that_change_meaning_are_refused(key, value):
    e = _err(normalize_generate, {"text": "hi", key: value})
    assert (e.status, e.param, e.code) == (400, key, "unsupported_parameter") and key in e.message


@pytest.mark.parametrize("key, value", [("image_data", None), ("lora_path", None), ("return_hidden_states", False),
                                        ("custom_logit_processor", None), ("image_data", [])])
def test_native_keys_left_at_their_default_pass(key, value):
    (req,), is_batch = normalize_generate({"text": "hi", key: value})
    assert req.text == "hi" and not is_batch


@pytest.mark.parametrize("key, value", OPENAI_REFUSED)
def test_openai_parameters_asking_for_what_is_not_served_are_refused(key, value):
    e = _err(P.Body, {"messages": M, key: value}, frozenset({"messages"}))
    assert (e.status, e.param, e.code) == (400, key, "unsupported_parameter") and key in e.message


def test_openai_defaults_pass():
    body = P.Body({"messages": M, "modalities": ["text"], "audio": None, "web_search_options": None},
                  frozenset({"messages"}))
    assert body.raw("modalities") == ["text"]
    P.Body({"messages": M, **OPENAI_ACCEPTED}, frozenset({"messages"}))


def test_what_sglang_router_sends_to_generate_passes():
    (req,), _ = normalize_generate({"text": "hi", "sampling_params": {"max_new_tokens": 2}, **ROUTER_GENERATE})
    assert req.text == "hi"


def test_json_schema_without_schema_is_a_400_not_a_compile():
    for rf in ({"type": "json_schema", "json_schema": {"name": "x"}},
               {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": None}}):
        e = _err(P.response_format_schema, rf)
        assert (e.status, e.param, e.code) == (400, "response_format.json_schema.schema",
                                                "missing_required_parameter")


def test_context_length_help_says_it_only_lowers():
    parser = build_parser()
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    (action,) = [a for a in serve._actions if "--context-length" in a.option_strings]
    assert "can only lower" in action.help


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_parallel_tool_calls_false_keeps_one_call():
    plan = T.parse_tools(TOOLS, "auto")
    two = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {}}]'
    r = {"index": 0, "text": two, "meta_info": {"finish_reason": FinishStop()}}
    def output(parallel: bool) -> OutputPlan:
        return OutputPlan(plan, ReasoningPlan(None), None, parallel)

    assert len(_choice(r, output(True), None, 0)["message"]["tool_calls"]) == 2
    one = _choice(r, output(False), None, 0)
    assert [c["function"]["arguments"] for c in one["message"]["tool_calls"]] == ['{"city": "Paris"}']
    assert one["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("template, ok", [(None, True), ("chatml", True), ("{{ messages[0].content }}", True),
                                          ("no-such-template", False), ("{% for m in messages %}", False)])
def test_chat_template_is_checked_at_start_up(template, ok):
    if ok:
        check_chat_template(template)
    else:
        with pytest.raises(ValueError, match="--chat-template"):
            check_chat_template(template)


def test_server_with_a_bad_chat_template_exits_at_start_up():
    s = ServerProc("--chat-template", "no-such-template", "--log-level", "warning", fake=True)
    try:
        assert s.proc.wait(60) == 1
        deadline = time.monotonic() + 10  # the reader thread may still be draining the pipe
        while "--chat-template 'no-such-template'" not in s.output and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "--chat-template 'no-such-template'" in s.output
    finally:
        s.stop()


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--log-level", "warning", fake=True)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_refusals_over_http(server):
    with server.client() as c:
        for key, value in NATIVE_REFUSED:
            r = c.post("/generate", json={"text": "hi", key: value, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 400 and r.json()["error"]["param"] == key, (key, r.text)
        for key, value in OPENAI_REFUSED:
            r = c.post("/v1/chat/completions", json={"messages": M, "max_tokens": 2, key: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == key, (key, r.text)
        r = c.post("/v1/chat/completions", json={"messages": M, "max_tokens": 2,
                                                 "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = c.post("/v1/chat/completions", json={"messages": M, "max_tokens": 2, "tools": TOOLS,
                                                     "tool_choice": choice,
                                                     "response_format": {"type": "json_object"}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        r = c.post("/v1/chat/completions", json={"messages": M, "max_tokens": 2, "modalities": ["text"]})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json={"messages": M, "max_tokens": 2, **OPENAI_ACCEPTED})
        assert r.status_code == 200, r.text
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, **ROUTER_GENERATE})
        assert r.status_code == 200, r.text
        # what this server (no priority scheduling, no speculation) cannot honour
        for route, extra in (("/v1/chat/completions", {"store": True}), ("/v1/chat/completions", {"priority": 1}),
                             ("/v1/completions", {"priority": 1}), ("/generate", {"priority": 1}),
                             ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}})):
            body = {"messages": M} if route == "/v1/chat/completions" else {"prompt": "hi"}
            if route == "/generate":
                body = {"text": "hi"}
            r = c.post(route, json={**body, "max_tokens": 2, **extra} if route != "/generate" else {**body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), (route, r.text)
        r = c.post("/generate", json={"text": "hi", "return_hidden_states": False, "lora_path": None,
                                      "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text
