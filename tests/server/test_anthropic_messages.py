"""/v1/messages and /v1/messages/count_tokens through the official `anthropic` client, against the session's
shared SmolLM2 server (127.0.0.1); the API key check against a model-free server started with --api-key.
Greedy answers are checked against the OpenAI chat route on the same server (same template, same tokens);
max_tokens stay small: the CPU is shared. The client no longer takes `temperature` as an argument, so greedy
requests send it through `extra_body`, as such clients do."""

from __future__ import annotations

import concurrent.futures
import json

import anthropic
import httpx
import jsonschema
import pytest

KEY = "test-key"
GREEDY = {"extra_body": {"temperature": 0}}
HELLO = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def par(*thunks):
    """Run the calls concurrently (the scheduler batches them)."""
    with concurrent.futures.ThreadPoolExecutor(len(thunks)) as pool:
        return [f.result() for f in [pool.submit(t) for t in thunks]]


def one_by_one(*thunks):
    """Run the calls one after another, so each decodes alone. Answers compared across two routes are made so:
    decode attention's float32 rounding depends on the batch (its split-KV chunk length follows the batch's total
    keys, and requests sharing a prefix read it in one pass; kernels/cpu/attention_decode.cpp), and a near tie
    can then go either way."""
    return [t() for t in thunks]


def chat(server, messages, max_tokens, **kw) -> dict:
    """The OpenAI chat route's greedy answer to the same conversation (the reference)."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                                 **kw})
    assert r.status_code == 200, r.text
    return r.json()


def text_of(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_create_plain_system_and_multi_turn_match_the_chat_route(client, server):
    turns = [*HELLO, {"role": "assistant", "content": "Red, green and blue."},
             {"role": "user", "content": "And two more?"}]
    plain, system, multi, blocks = one_by_one(
        lambda: client.messages.create(model="default", max_tokens=8, **GREEDY, messages=HELLO,
                                       metadata={"user_id": "u1"}),
        lambda: client.messages.create(model="default", max_tokens=8, **GREEDY, messages=HELLO,
                                       system="Answer in French."),
        lambda: client.messages.create(model="default", max_tokens=8, **GREEDY, messages=turns),
        lambda: client.messages.create(model="default", max_tokens=8, **GREEDY, messages=HELLO,
                                       system=[{"type": "text", "text": "Answer in French."}]))
    assert plain.type == "message" and plain.role == "assistant" and plain.id.startswith("msg_")
    assert plain.content[0].type == "text" and plain.stop_reason in ("end_turn", "max_tokens")
    assert plain.usage.output_tokens <= 8
    refs = one_by_one(lambda: chat(server, HELLO, 8),
                      lambda: chat(server, [{"role": "system", "content": "Answer in French."}, *HELLO], 8),
                      lambda: chat(server, turns, 8))
    for msg, ref in zip((plain, system, multi), refs, strict=True):
        (choice,) = ref["choices"]
        assert text_of(msg) == choice["message"]["content"]
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == ref["usage"]["prompt_tokens"]
        assert msg.usage.output_tokens == ref["usage"]["completion_tokens"]
        assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    assert text_of(blocks) == text_of(system)  # system as blocks is the same prompt
    assert text_of(system) != text_of(plain)


def test_stop_sequence_and_prefill(client, server):
    full = client.messages.create(model="default", max_tokens=12, **GREEDY, messages=HELLO)
    text = text_of(full)
    assert len(text) >= 8, text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # greedy: the same answer stops where this first appears
    prefill = [*HELLO, {"role": "assistant", "content": "My favorite is"}]
    cut, prefilled, ref = par(
        lambda: client.messages.create(model="default", max_tokens=12, **GREEDY, messages=HELLO,
                                       stop_sequences=[stop]),
        lambda: client.messages.create(model="default", max_tokens=6, **GREEDY, messages=prefill),
        lambda: chat(server, prefill, 6, continue_final_message=True, add_generation_prompt=False))
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text_of(cut) == text[:text.index(stop)]
    assert text_of(prefilled) == ref["choices"][0]["message"]["content"]


def _streamed(client, **kw):
    with client.messages.stream(**kw) as stream:
        return list(stream.text_stream), stream.get_final_message()


def _raw_event_types(client, **kw) -> list[str]:
    with client.messages.create(**kw, stream=True) as raw:
        return [ev.type for ev in raw]


def test_stream_text_and_final_message(client):
    ask = {"model": "default", "max_tokens": 10, "messages": HELLO}
    whole, (pieces, final), kinds = par(lambda: client.messages.create(**ask, **GREEDY),
                                        lambda: _streamed(client, **ask, **GREEDY),
                                        lambda: _raw_event_types(client, **{**ask, "max_tokens": 4}))
    assert "".join(pieces) == text_of(final) == text_of(whole)
    assert len(pieces) > 1  # streamed, not one lump
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1


def test_tool_round_trip_with_tool_choice_any(client, server):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg, (_, streamed) = par(
        lambda: client.messages.create(model="default", max_tokens=40, **GREEDY, messages=ask, tools=[WEATHER],
                                       tool_choice={"type": "any"}),
        lambda: _streamed(client, model="default", max_tokens=40, **GREEDY, messages=ask, tools=[WEATHER],
                          tool_choice={"type": "tool", "name": "get_weather"}))
    assert msg.stop_reason == "tool_use", msg
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    (named,) = streamed.content
    assert named.type == "tool_use" and streamed.stop_reason == "tool_use"
    jsonschema.validate(named.input, WEATHER["input_schema"])
    follow = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C, sunny"}]}]
    ref_messages = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "name": "get_weather", "content": "18C, sunny"}]
    chat_tool = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                  "parameters": WEATHER["input_schema"]}}
    answer, ref = par(
        lambda: client.messages.create(model="default", max_tokens=12, **GREEDY, messages=follow, tools=[WEATHER]),
        lambda: chat(server, ref_messages, 12, tools=[chat_tool]))
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == ref["usage"]["prompt_tokens"]
    ref_msg = ref["choices"][0]["message"]
    assert [b.name for b in answer.content if b.type == "tool_use"] == \
        [c["function"]["name"] for c in ref_msg.get("tool_calls") or []]
    assert text_of(answer) == (ref_msg["content"] or "")


def test_count_tokens(client, server):
    n = client.messages.count_tokens(model="default", messages=HELLO, system="Answer in French.")
    ref = chat(server, [{"role": "system", "content": "Answer in French."}, *HELLO], 1)
    assert n.input_tokens == ref["usage"]["prompt_tokens"]
    with_tools = client.messages.count_tokens(model="default", messages=HELLO, tools=[WEATHER])
    assert with_tools.input_tokens > client.messages.count_tokens(model="default", messages=HELLO).input_tokens


def _refused(client, status: int, kind: str, **body) -> str:
    with pytest.raises(anthropic.APIStatusError) as e:
        client.post("/v1/messages", cast_to=object, body=body)
    assert e.value.status_code == status
    err = e.value.body
    assert set(err) == {"type", "error"} and err["type"] == "error" and err["error"]["type"] == kind, err
    return err["error"]["message"]


def test_bad_inputs_get_the_envelope_and_the_server_keeps_serving(client, server):
    assert "max_tokens" in _refused(client, 400, "invalid_request_error", model="default", messages=HELLO)
    assert "messages[0].role" in _refused(client, 400, "invalid_request_error", model="default", max_tokens=4,
                                          messages=[{"role": "robot", "content": "hi"}])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    assert "image" in _refused(client, 400, "invalid_request_error", model="default", max_tokens=4,
                               messages=[{"role": "user", "content": [image, {"type": "text", "text": "what?"}]}])
    assert "--reasoning-parser" in _refused(client, 400, "invalid_request_error", model="default", max_tokens=4,
                                            messages=HELLO, thinking={"type": "enabled", "budget_tokens": 1024})
    assert "model" in _refused(client, 404, "not_found_error", model="claude-no-such", max_tokens=4, messages=HELLO)
    unserved = {**WEATHER, "input_schema": {"type": "object", "properties": {"n": {"not": {"const": 3}}}}}
    # refused before the stream starts: a 400, not an error event
    with pytest.raises(anthropic.BadRequestError) as e, client.messages.stream(
            model="default", max_tokens=8, messages=HELLO, tools=[unserved], tool_choice={"type": "any"}) as stream:
        stream.get_final_message()
    assert e.value.body["type"] == "error" and "not" in e.value.body["error"]["message"]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.get("/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error"
        r = c.post("/v1/messages", content=b"x" * (9 * 1024 * 1024))
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    ok = client.messages.create(model="default", max_tokens=2, messages=HELLO)
    assert ok.content and ok.usage.output_tokens >= 1


def test_api_key_as_x_api_key_or_bearer(server_factory):
    keyed = server_factory("--api-key", KEY, "--log-level", "warning", fake=True).wait_ready()
    bad = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="default", max_tokens=4, messages=HELLO)
    assert e.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "invalid or missing API key (Authorization: Bearer, or x-api-key)"}}
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model="default", messages=HELLO)
    good = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0, timeout=30)  # sends x-api-key
    assert good.messages.count_tokens(model="default", messages=HELLO).input_tokens > 0
    assert good.messages.create(model="default", max_tokens=4, messages=HELLO).usage.output_tokens == 4
    with httpx.Client(base_url=keyed.url, timeout=30) as c:  # Bearer is the same key
        r = c.post("/v1/messages/count_tokens", json={"messages": HELLO}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
