"""Model-free tests of the Messages API layer: content blocks -> chat messages, tools and tool_choice -> tool
plans, top-level parameters, the error envelope, and the event order of a stream built from the chat route's
real chunk sequence over scripted runtime results."""

from __future__ import annotations

import asyncio
import json

import pytest

from runtime.config import ServerConfig
from runtime.messages import FinishAbort, FinishLength, FinishReason, FinishStop
from runtime.tokenizer.generate_input import RequestError
from server.anthropic import messages as M
from server.anthropic import params as A
from server.anthropic import response as R
from server.anthropic import tools as AT
from server.anthropic.routes import _peek
from server.anthropic.streaming import MessageStream
from server.errors import anthropic_error_body, envelope
from server.openai.chat_output import OutputPlan
from server.openai.reasoning import ReasoningPlan
from server.openai.streaming import ChatStream, guarded

SRV = ServerConfig()
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def err(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value


# ---------------------------------------------------------------- messages


def test_system_and_text_blocks():
    conv = M.conversation([{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                          [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                        {"type": "text", "text": "there", "cache_control":
                                                         {"type": "ephemeral"}}]}])
    assert conv.messages == [{"role": "system", "content": "Be brief.\nBe kind."},
                             {"role": "user", "content": "Hi\nthere"}]
    assert not conv.prefill


def test_tool_round_trip_messages():
    conv = M.conversation("sys", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ])
    sys_msg, user, assistant, tool, follow = conv.messages
    assert assistant["content"] == "Checking."
    (call,) = assistant["tool_calls"]
    assert call["id"] == "toolu_1" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "18C"}
    assert follow == {"role": "user", "content": "And tomorrow?"}


def test_tool_result_error_and_blocks():
    conv = M.conversation(None, [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "is_error": True,
         "content": [{"type": "text", "text": "no such city"}]}]}])
    assert conv.messages == [{"role": "tool", "tool_call_id": "t", "name": "the function",
                              "content": "Error: no such city"}]


def test_prefill():
    conv = M.conversation(None, [{"role": "user", "content": "Say A"}, {"role": "assistant", "content": "The "}])
    assert conv.prefill and conv.messages[-1] == {"role": "assistant", "content": "The "}
    empty = M.conversation(None, [{"role": "user", "content": "Say A"}, {"role": "assistant", "content": ""}])
    assert not empty.prefill and len(empty.messages) == 1


@pytest.mark.parametrize("messages, param, code", [
    (None, "messages", "missing_required_parameter"),
    ([], "messages", "empty_array"),
    ([{"role": "system", "content": "x"}], "messages[0].role", "invalid_value"),
    ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
    ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
    ([{"role": "user", "content": "x", "name": "bob"}], "messages[0].name", "unsupported_parameter"),
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages[0].content[0].type",
     "unsupported_parameter"),
    ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages[0].content[0].type",
     "unsupported_parameter"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{"a": 1}]}]}],
     "messages[0].content[0].citations", "unsupported_parameter"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}],
     "messages[0].content[0].type", "invalid_value"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": "{}"}]}],
     "messages[0].content[0].input", "invalid_type"),
    ([{"role": "user", "content": [{"type": "tool_result"}]}], "messages[0].content[0].tool_use_id",
     "missing_required_parameter"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "b", "input": {}}]}], "messages[1].content", "invalid_value"),
])
def test_message_errors(messages, param, code):
    e = err(M.conversation, None, messages)
    assert (e.param, e.code, e.status) == (param, code, 400)


def test_system_errors():
    assert err(M.system_text, 5).param == "system"
    assert err(M.system_text, [{"type": "image"}]).param == "system[0].type"


# ---------------------------------------------------------------- tools


@pytest.mark.parametrize("choice, mode, parallel", [
    (None, "auto", True), ({"type": "auto"}, "auto", True), ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True), ({"type": "tool", "name": "get_weather"}, "named", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
])
def test_tool_choice(choice, mode, parallel):
    tools = AT.parse([WEATHER], choice)
    assert (tools.plan.mode, tools.parallel) == (mode, parallel)
    assert tools.plan.tools[0].parameters == WEATHER["input_schema"]


def test_tool_errors_name_anthropic_fields():
    bad_schema = {**WEATHER, "input_schema": {"type": "object", "properties": 5}}
    assert err(AT.parse, [bad_schema], None).param == "tools[0].input_schema"
    assert err(AT.parse, [{**WEATHER, "name": "bad name!"}], None).param == "tools[0].name"
    assert err(AT.parse, [{k: v for k, v in WEATHER.items() if k != "input_schema"}], None).param == \
        "tools[0].input_schema"
    e = err(AT.parse, [{"type": "web_search_20250305", "name": "web_search"}], None)
    assert (e.param, e.code) == ("tools[0].type", "unsupported_parameter")
    assert err(AT.parse, [WEATHER], {"type": "tool", "name": "nope"}).param == "tool_choice.name"
    assert err(AT.parse, [WEATHER], {"type": "required"}).param == "tool_choice.type"
    assert err(AT.parse, None, {"type": "any"}).param == "tool_choice"


def test_tool_use_blocks():
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"X"}'}}
    assert AT.tool_use_block(call) == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                                       "input": {"city": "X"}}
    cut = {**call, "function": {"name": "get_weather", "arguments": '{"city":"X'}}
    assert AT.tool_use_block(cut) is None
    assert R.content_blocks("Sure.", [call]) == [{"type": "text", "text": "Sure."}, AT.tool_use_block(call)]
    assert R.content_blocks(None, [cut]) == [{"type": "text", "text": '{"city":"X'}]
    assert R.content_blocks("", []) == [{"type": "text", "text": ""}]


# ---------------------------------------------------------------- parameters and envelope


@pytest.mark.parametrize("data, param, code", [
    ({"frequency_penalty": 1}, "frequency_penalty", "unsupported_parameter"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens", "invalid_value"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type", "invalid_value"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id", "invalid_type"),
    ({"metadata": {"session": "x"}}, "metadata.session", "unsupported_parameter"),
    ({"container": "c1"}, "container", "unsupported_parameter"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers", "unsupported_parameter"),
    ({"service_tier": "priority"}, "service_tier", "invalid_value"),
])
def test_body_refusals(data, param, code):
    e = err(A.body, {"model": "m", **data}, A.KNOWN)
    assert (e.param, e.code) == (param, code)


def test_thinking_names_the_flag_and_disabled_passes():
    enabled = {"type": "enabled", "budget_tokens": 1024}
    A.body({"thinking": enabled}, A.KNOWN)  # the shape is fine; the server decides below
    e = err(A.thinking_plan, enabled, None)
    assert "--reasoning-parser" in e.message and (e.param, e.code) == ("thinking", "unsupported_parameter")
    assert A.thinking_plan({"type": "disabled"}, None).parser is None
    assert A.thinking_plan(None, "deepseek-r1").parser is None  # no thinking asked: no split
    plan = A.thinking_plan(enabled, "deepseek-r1")
    assert (plan.parser, plan.budget, plan.separate, plan.stream) == ("deepseek-r1", 1024, True, True)
    assert A.thinking_plan({"type": "adaptive"}, "qwen3").budget is None


def test_sampling_params():
    b = A.body({"temperature": 0.5, "top_p": 0.9, "top_k": 0, "stop_sequences": ["\n\n", "END"],
                "max_tokens": 7}, A.KNOWN)
    sp, stops = A.sampling_params(b, SRV)
    assert sp == {"temperature": 0.5, "top_p": 0.9, "top_k": -1, "stop": ["\n\n", "END"]}
    assert stops == ["\n\n", "END"] and A.max_tokens(b) == 7
    assert err(A.max_tokens, A.body({}, A.KNOWN)).code == "missing_required_parameter"
    assert err(A.max_tokens, A.body({"max_tokens": 0}, A.KNOWN)).param == "max_tokens"
    assert err(A.sampling_params, A.body({"temperature": 1.5}, A.KNOWN), SRV).param == "temperature"
    assert err(A.sampling_params, A.body({"stop_sequences": [""]}, A.KNOWN), SRV).param == "stop_sequences"


def test_output_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    b = A.body({"output_config": {"format": {"type": "json_schema", "schema": schema}}}, A.KNOWN)
    assert json.loads(A.output_schema(b)) == schema
    b = A.body({"output_config": {"effort": "high"}}, A.KNOWN)
    assert err(A.output_schema, b).param == "output_config.effort"


@pytest.mark.parametrize("chat, matched, expect", [
    ("length", None, ("max_tokens", None)), ("tool_calls", None, ("tool_use", None)),
    ("stop", "END", ("stop_sequence", "END")), ("stop", 2, ("end_turn", None)), ("stop", None, ("end_turn", None)),
])
def test_stop_reason(chat, matched, expect):
    assert R.stop_reason(chat, matched, ["END"]) == expect


def test_operator_abort_is_500():
    assert err(R.stop_reason, "abort", None, []).status == 500


def test_envelope_by_path():
    assert envelope("/v1/messages", 404, "The model `x` does not exist.", param="model") == {
        "type": "error", "error": {"type": "not_found_error", "message": "model: The model `x` does not exist."}}
    assert envelope("/v1/messages/count_tokens", 401, "bad key")["error"]["type"] == "authentication_error"
    assert envelope("/v1/chat/completions", 400, "bad", param="x") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": None}}
    assert envelope("/v1/messagesx", 400, "bad")["error"]["param"] is None  # not an Anthropic path
    assert anthropic_error_body(500, "boom")["error"]["type"] == "api_error"
    assert anthropic_error_body(503, "loading")["error"]["type"] == "overloaded_error"
    assert anthropic_error_body(400, "'max_tokens' is required", "max_tokens")["error"]["message"] == \
        "'max_tokens' is required"


# ---------------------------------------------------------------- the event stream


def _result(text: str, fr: FinishReason | None, completion: int) -> dict:
    return {"index": 0, "text": text, "output_ids": [], "meta_info": {
        "finish_reason": fr, "prompt_tokens": 20, "completion_tokens": completion, "cached_tokens": 4}}


async def _scripted(results: list[dict]):
    for r in results:
        yield r


def _events(results: list[dict], tools=None, stops=()) -> list[dict]:
    plan, parallel = tools or AT.parse(None, None)
    state = type("S", (), {"cfg": type("C", (), {"server": SRV})()})()
    output = OutputPlan(plan, ReasoningPlan(None), None, parallel)
    chunks = ChatStream(_scripted(results), {}, 1, output, None, 0, True,
                        lambda metas: R.usage(state, metas[0])).events()
    start = {**R.message("msg_1", "m"), "usage": R.usage(state, results[0]["meta_info"])}
    stream = MessageStream(chunks, start, plan.mode == "named", list(stops))

    async def run() -> list[dict]:
        return [ev async for ev in stream.events()]

    return asyncio.run(run())


def test_text_stream_order():
    evs = _events([_result("Hel", None, 1), _result("Hello", None, 2),
                   _result("Hello!", FinishStop(matched="END"), 3)], stops=["END"])
    assert [e["type"] for e in evs] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                        "content_block_delta", "content_block_delta", "content_block_stop",
                                        "message_delta", "message_stop"]
    assert evs[0]["message"]["content"] == [] and evs[0]["message"]["stop_reason"] is None
    assert "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta") == "Hello!"
    assert evs[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert evs[-2]["usage"] == {"input_tokens": 16, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0,
                                "output_tokens": 3}


def test_any_tool_stream_is_whole_input_json():
    tools = AT.parse([WEATHER], {"type": "any"})
    out = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    evs = _events([_result(out[:10], None, 3), _result(out, FinishStop(matched=2), 12)], tools)
    kinds = [e["type"] for e in evs]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    block = evs[2]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["id"].startswith("toolu_")
    assert json.loads(evs[3]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"


def test_named_tool_stream_streams_input():
    tools = AT.parse([WEATHER], {"type": "tool", "name": "get_weather"})
    evs = _events([_result('{"city"', None, 2), _result('{"city": "Rome"}', FinishStop(matched=2), 5)],
                  tools)
    deltas = [e["delta"]["partial_json"] for e in evs if e["type"] == "content_block_delta"]
    assert len(deltas) == 2 and json.loads("".join(deltas)) == {"city": "Rome"}
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"


def test_auto_tool_stream_puts_text_before_tools():
    tools = AT.parse([WEATHER], None)
    out = '{"name": "get_weather", "arguments": {"city": "Lima"}} Checking Lima.'
    evs = _events([_result(out, FinishStop(matched=2), 20)], tools)
    starts = [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"]
    assert [e["index"] for e in evs if e["type"] == "content_block_stop"] == [0, 1]
    assert evs[3]["delta"]["text"] == "Checking Lima." and evs[-2]["delta"]["stop_reason"] == "tool_use"


def test_empty_output_is_one_empty_text_block_and_length_is_max_tokens():
    evs = _events([_result("", FinishLength(length=2), 1)])
    assert [e["type"] for e in evs][2:5] == ["content_block_start", "content_block_stop", "message_delta"]
    assert evs[-2]["delta"]["stop_reason"] == "max_tokens"


def test_error_mid_stream_is_an_error_event_without_done():
    async def failing():
        yield {"type": "message_start", "message": {}}
        raise RequestError("runtime died", None, "server_unavailable", 503, "server_error")

    async def run() -> list[bytes]:
        return [b async for b in guarded(failing(), True, lambda e: anthropic_error_body(e.status, e.message),
                                         False)]

    frames = asyncio.run(run())
    assert frames[0].startswith(b"event: message_start\ndata: ")
    assert frames[1] == b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":' \
                        b'"runtime died"}}\n\n'
    assert len(frames) == 2


class _Handle:
    """A RequestHandle's iteration protocol over scripted results, recording aborts."""

    def __init__(self, results: list[dict]) -> None:
        self.results, self.aborted = results, 0

    async def __aiter__(self):
        for r in self.results:
            yield r

    def abort(self) -> None:
        self.aborted += 1


def test_peek_raises_a_request_error_before_the_stream_and_replays_the_first_result():
    bad = _Handle([_result("", FinishAbort(message="grammar: unsupported keyword 'not'", status_code=400), 0)])
    e = err(lambda: asyncio.run(_peek(bad)))
    assert (e.status, "not" in e.message, bad.aborted) == (400, True, 1)
    good = _Handle([_result("a", None, 1), _result("ab", FinishLength(length=2), 2)])

    async def run() -> tuple[dict, list[dict]]:
        first, items = await _peek(good)
        return first, [r async for r in items]

    first, items = asyncio.run(run())
    assert first["text"] == "a" and [r["text"] for r in items] == ["a", "ab"] and good.aborted == 1


def test_reasoning_deltas_become_a_thinking_block_first():
    def chunk(delta: dict, reason: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}

    async def chunks():
        for c in (chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Think"}),
                  chunk({"reasoning_content": "ing."}), chunk({"content": "Answer."}), chunk({}, "stop"),
                  {"choices": [], "usage": {"input_tokens": 3, "output_tokens": 4}}):
            yield c

    start = {**R.message("msg_1", "m"), "usage": {"input_tokens": 3, "output_tokens": 0}}

    async def run() -> list[dict]:
        return [ev async for ev in MessageStream(chunks(), start, False, []).events()]

    evs = asyncio.run(run())
    starts = [e["content_block"] for e in evs if e["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
    assert deltas == [{"type": "thinking_delta", "thinking": "Think"}, {"type": "thinking_delta", "thinking": "ing."},
                      {"type": "text_delta", "text": "Answer."}]
    assert R.content_blocks("Answer.", [], "Thinking.") == [
        {"type": "thinking", "thinking": "Thinking.", "signature": ""}, {"type": "text", "text": "Answer."}]
