"""Model-free tests of the OpenAI layer's pieces: parameter validation, response_format, tool plans,
tool-call parsing and the prompt for templates without tool support."""

from __future__ import annotations

import json

import pytest

from runtime.config import ServerConfig
from runtime.messages import FinishAbort, FinishStop
from runtime.sampling.params import SamplingParams
from runtime.tokenizer.generate_input import OpenAINames, RequestError
from runtime.tokenizer.manager import check_constraint
from server.openai import params as P
from server.openai import tools as T

SRV = ServerConfig()


def body(**kw) -> P.Body:
    return P.Body(kw, frozenset(kw))


def err(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value


def test_body_must_be_object():
    for bad in ([], 42, None, "x"):
        assert err(P.Body, bad, frozenset()).code == "invalid_type"


@pytest.mark.parametrize("kw, param, code", [
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": -1}, "temperature", "decimal_below_min_value"),
    ({"temperature": 3}, "temperature", "decimal_above_max_value"),
    ({"temperature": float("inf")}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "decimal_below_min_value"),
    ({"top_p": 1.5}, "top_p", "decimal_above_max_value"),
    ({"top_k": -5}, "top_k", "integer_below_min_value"),
    ({"top_k": 0.5}, "top_k", "invalid_type"),
    ({"presence_penalty": 5}, "presence_penalty", "decimal_above_max_value"),
    ({"repetition_penalty": 0}, "repetition_penalty", "decimal_below_min_value"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"stop": ["x"] * 1000}, "stop", "invalid_value"),
    ({"stop": "x" * 300}, "stop", "invalid_value"),
    ({"stop": 5}, "stop", "invalid_type"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": 1e9}}, "logit_bias", "invalid_value"),
    ({"seed": "1"}, "seed", "invalid_type"),
    ({"ignore_eos": 1}, "ignore_eos", "invalid_type"),
])
def test_sampling_param_errors(kw, param, code):
    e = err(P.sampling_params, body(**kw), SRV, 49152)
    assert (e.param, e.code, e.status) == (param, code, 400)


def test_sampling_params_mapping():
    sp = P.sampling_params(body(temperature=0, top_p=0.5, top_k=0, seed=7, stop="x", min_tokens=2,
                                logit_bias={"5": -100}), SRV, 49152)
    assert sp == {"temperature": 0.0, "top_p": 0.5, "top_k": -1, "sampling_seed": 7, "stop": ["x"],
                  "min_new_tokens": 2, "logit_bias": {"5": -100.0}}


def test_max_tokens_precedence_and_bounds():
    assert P.max_tokens(body(max_tokens=5, max_completion_tokens=7), ("max_completion_tokens", "max_tokens")) == (
        7, "max_completion_tokens")
    assert P.max_tokens(body(max_tokens=5), ("max_completion_tokens", "max_tokens")) == (5, "max_tokens")
    assert err(P.max_tokens, body(max_tokens=0), ("max_tokens",)).code == "integer_below_min_value"
    assert err(P.max_tokens, body(max_tokens=10.5), ("max_tokens",)).code == "invalid_type"


def test_stream_options_needs_stream():
    assert err(P.stream_options, body(stream_options={"include_usage": True}), False).param == "stream_options"
    assert P.stream_options(body(stream_options={"include_usage": True}), True) is True


@pytest.mark.parametrize("rf, expect", [
    (None, None), ({"type": "text"}, None), ({"type": "json_object"}, json.loads(P.JSON_OBJECT_SCHEMA)),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": True}},
     {"type": "integer"}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}, {"type": "string"}),
    ({"type": "json_schema", "schema": {"type": "boolean"}}, {"type": "boolean"}),
])
def test_response_format(rf, expect):
    out = P.response_format_schema(rf)
    assert (None if out is None else json.loads(out)) == expect


@pytest.mark.parametrize("rf, param", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "bogus"}, "response_format.type"),
    ({}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"properties": {"foo": "bar"}}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"minLength": -1}}}, "response_format.json_schema.schema"),
    ("json", "response_format"),
])
def test_response_format_errors(rf, param):
    e = err(P.response_format_schema, rf)
    assert e.status == 400 and e.param == param


def test_schema_depth_and_size_caps():
    """The front end takes the runtime's limits (runtime/constrained/json_rules.py: 1 MiB, depth 128), not
    smaller ones of its own: schemas that llguidance compiles are not refused here."""
    from runtime.constrained.json_rules import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH

    assert (P.MAX_SCHEMA_BYTES, P.MAX_SCHEMA_DEPTH) == (MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH) == (1 << 20, 128)
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    P.check_schema(deep, "s")  # 42 levels: refused by the old front-end limit of 32
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    e = err(P.check_schema, deep, "s")
    assert e.code == "grammar_too_complex" and f"nested deeper than {MAX_SCHEMA_DEPTH}" in e.message
    P.check_schema({"enum": ["x" * 100] * 1000}, "s")  # 100 KiB: over the old 64 KiB
    e = err(P.check_schema, {"enum": ["x" * 100] * 11000}, "s")
    assert e.code == "invalid_value" and f"larger than {MAX_SCHEMA_BYTES} bytes" in e.message
    assert ServerConfig().max_body_bytes >= 2 * MAX_SCHEMA_BYTES  # a body can carry the largest schema


def test_one_constraint_only():
    e = err(P.constraint, body(regex="a+", response_format={"type": "json_object"}))
    assert e.status == 400
    assert err(P.constraint, body(regex="((")).param == "regex"
    assert P.constraint(body(regex="a+")) == ({"regex": "a+"}, "regex")
    assert P.constraint(body()) == ({}, None)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tool_plans():
    assert T.parse_tools(None, None).mode == "none"
    assert T.parse_tools([WEATHER], None).mode == "auto"
    assert T.parse_tools([WEATHER], "none").mode == "none"
    plan = T.parse_tools([WEATHER, TIME], "required")
    assert plan.constrained and len(plan.schema()["anyOf"]) == 2
    named = T.parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and named.schema() == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("tools, choice, param", [
    (None, "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER, WEATHER], None, "tools"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}], None,
     "tools[0].function.parameters"),
    ("x", None, "tools"),
])
def test_tool_errors(tools, choice, param):
    e = err(T.parse_tools, tools, choice)
    assert e.status == 400 and e.param == param


def test_parse_constrained_outputs():
    req = T.parse_tools([WEATHER, TIME], "required")
    calls = T.parse_constrained(req, '{"name":"get_weather","arguments":{"city":"Paris"}}')
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert T.parse_constrained(req, '{"name":"get_weather","argu') is None
    named = T.parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(T.parse_constrained(named, '{"city":"Rome"}')[0]["function"]["arguments"]) == {"city": "Rome"}


@pytest.mark.parametrize("text, content, names", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, ["get_weather"]),
    ('Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Sure.", ["get_time"]),
    ('```json\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n```', None, ["get_weather"]),
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "x"}}]', None,
     ["get_time", "get_weather"]),
    ('{"name": "unknown_fn", "arguments": {}}', '{"name": "unknown_fn", "arguments": {}}', []),
    ("The weather is nice.", "The weather is nice.", []),
])
def test_parse_auto(text, content, names):
    plan = T.parse_tools([WEATHER, TIME], "auto")
    got_content, calls = T.parse_auto(plan, text)
    assert got_content == content
    assert [c["function"]["name"] for c in calls] == names


def test_may_be_call():
    assert T.may_be_call("") and T.may_be_call(' {"na') and T.may_be_call("<tool") and T.may_be_call("`")
    assert not T.may_be_call("Hello") and not T.may_be_call("<b>")


def test_prompt_without_native_tools():
    plan = T.parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    msgs, tools = T.prompt_messages(history, plan, native=False)
    assert tools is None
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and "`get_weather`" in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert msgs[3] == {"role": "user", "content": "Result of the function (call_1): sunny"}
    native, specs = T.prompt_messages(history, plan, native=True)
    assert specs == [T.parse_tools([WEATHER], None).tools[0].spec]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


@pytest.mark.parametrize("cons, code", [
    ({"regex": "(ab"}, "invalid_value"),
    ({"json_schema": '{"type": "integer", "not": {"const": 3}}'}, "invalid_value"),
    ({"json_schema": '{"enum": [' + ",".join(['"' + "x" * 64 + '"'] * 20000) + "]}"}, "grammar_too_complex"),
    ({"json_schema": '{"type": "string", "minLength": 5, "maxLength": 2}'}, "invalid_value"),
    ({"ebnf": "root ::= 'a'"}, "invalid_value"),
])
def test_check_constraint_uses_the_grammar_validator(cons, code):
    names = OpenAINames(prompt="messages", max_tokens="max_tokens", constraint="response_format")
    e = err(check_constraint, SamplingParams.from_dict(cons), None, names)
    assert (e.status, e.param, e.code) == (400, "response_format", code)
    check_constraint(SamplingParams.from_dict({"json_schema": '{"type": "object"}'}), None, names)
    check_constraint(SamplingParams.from_dict({}), None, None)


# ---------------------------------------------------------------- the chat chunk sequence (fake handle)

class FakeHandle:
    """Yields TokenizerManager-shaped cumulative results: [(index, text, finish_reason), ...]."""

    def __init__(self, steps, prompt_tokens=7):
        self.steps, self.prompt_tokens = steps, prompt_tokens
        self.rids = sorted({i for i, _, _ in steps})

    async def __aiter__(self):
        for i, text, fr in self.steps:
            yield {"index": i, "text": text, "output_ids": [], "meta_info": {
                "finish_reason": fr, "prompt_tokens": self.prompt_tokens, "completion_tokens": len(text),
                "cached_tokens": 3}}


def _events(steps, plan=None, n=1, include_usage=True):
    import asyncio

    from server.openai.streaming import ChatStream

    def usage_of(metas):
        return {"completion_tokens": sum(m["completion_tokens"] for m in metas)}

    from server.openai.chat_output import OutputPlan
    from server.openai.reasoning import ReasoningPlan

    output = OutputPlan(plan or T.ToolPlan([], "none"), ReasoningPlan(None), None)
    stream = ChatStream(FakeHandle(steps), {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1,
                                            "model": "m", "system_fingerprint": None},
                        n, output, None, 0, include_usage, usage_of)

    async def run():
        return [ev async for ev in stream.events()]

    return asyncio.run(run())


STOP = FinishStop(matched=2)


def test_stream_role_first_then_content_finish_and_usage():
    evs = _events([(0, "He", None), (0, "Hello", None), (0, "Hello!", STOP)])
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"].get("content") for e in evs[1:-2]]
    assert deltas == ["He", "llo", "!"]
    assert evs[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                     "matched_stop": 2}
    assert evs[-1]["choices"] == [] and evs[-1]["usage"] == {"completion_tokens": 6}
    assert all(e["usage"] is None for e in evs[:-1])
    assert "usage" not in _events([(0, "x", STOP)], include_usage=False)[-1]


def test_stream_n2_roles_for_each_index():
    evs = _events([(1, "b", None), (0, "a", STOP), (1, "bb", STOP)], n=2)
    assert [e["choices"][0]["index"] for e in evs[:2]] == [0, 1]
    finals = {e["choices"][0]["index"] for e in evs if e["choices"] and e["choices"][0]["finish_reason"]}
    assert finals == {0, 1}


def test_stream_named_tool_streams_argument_fragments():
    plan = T.parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    evs = _events([(0, '{"ci', None), (0, '{"city":"Rome"}', STOP)], plan)
    calls = [e["choices"][0]["delta"]["tool_calls"][0] for e in evs if e["choices"]
             and "tool_calls" in e["choices"][0]["delta"]]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"Rome"}'
    assert evs[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_stream_auto_holds_a_call_and_streams_plain_text():
    plan = T.parse_tools([WEATHER], "auto")
    evs = _events([(0, '{"name": "get_weather", ', None),
                   (0, '{"name": "get_weather", "arguments": {"city": "Oslo"}}', STOP)], plan)
    assert not any(e["choices"] and e["choices"][0]["delta"].get("content") for e in evs[1:])
    (call,) = next(e["choices"][0]["delta"]["tool_calls"] for e in evs if e["choices"]
                   and "tool_calls" in e["choices"][0]["delta"])
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert evs[-2]["choices"][0]["finish_reason"] == "tool_calls"
    evs = _events([(0, "Sun", None), (0, "Sunny.", STOP)], plan)
    assert [e["choices"][0]["delta"].get("content") for e in evs[1:3]] == ["Sun", "ny."]


def test_stream_required_call_cut_short_without_parallel_calls_is_content():
    import asyncio

    from runtime.messages import FinishLength
    from server.openai.chat_output import OutputPlan
    from server.openai.reasoning import ReasoningPlan
    from server.openai.streaming import ChatStream

    text = '{"name": "get_wea'  # a required call cut by max_tokens: it does not parse
    output = OutputPlan(T.parse_tools([WEATHER], "required"), ReasoningPlan(None), None, parallel=False)
    stream = ChatStream(FakeHandle([(0, text, FinishLength(length=5))]),
                        {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                         "system_fingerprint": None},
                        1, output, None, 0, False, lambda metas: {})

    async def run():
        return [ev async for ev in stream.events()]

    evs = asyncio.run(run())
    assert [e["choices"][0]["delta"].get("content") for e in evs[1:-1]] == [text]
    assert not any("tool_calls" in e["choices"][0]["delta"] for e in evs)
    assert evs[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_abort_from_a_bad_grammar_raises_for_the_error_chunk():
    import asyncio

    from server.openai.streaming import guarded

    fr = FinishAbort(message="failed to compile the grammar: boom")

    async def run():
        from server.openai.chat_output import OutputPlan
        from server.openai.reasoning import ReasoningPlan
        from server.openai.streaming import ChatStream

        output = OutputPlan(T.ToolPlan([], "none"), ReasoningPlan(None), None)
        stream = ChatStream(FakeHandle([(0, "", fr)]), {"id": "x"}, 1, output, None, 0, False, lambda m: {})
        return [b async for b in guarded(stream.events())]

    out = asyncio.run(run())
    assert out[-1] == b"data: [DONE]\n\n"
    err = json.loads(out[-2][len(b"data: "):])
    assert err["error"]["code"] == "invalid_value" and "boom" in err["error"]["message"]


def test_chat_template_flag_name_file_or_model_default(tmp_path):
    from types import SimpleNamespace

    from runtime.tokenizer.chat_template import BUILTIN_TEMPLATES
    from server.openai.chat import chat_template

    def resolve(flag, model_template="{{ 'model' }}"):
        state = SimpleNamespace(cfg=SimpleNamespace(server=SimpleNamespace(chat_template=flag)))
        return chat_template(state, SimpleNamespace(tokenizer=SimpleNamespace(chat_template=model_template)))

    assert resolve(None) == "{{ 'model' }}"
    assert resolve("chatml") == BUILTIN_TEMPLATES["chatml"]
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert resolve(str(f)) == "{{ messages[0]['content'] }}"
    assert err(resolve, "no-such-template").status == 500
    assert err(resolve, None, None).status == 400  # no template at all: use --chat-template
