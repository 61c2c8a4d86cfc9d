"""POST /v1/responses through the official client (`client.responses.create` and `.stream`) against one real
SmolLM2 server (module-scoped, 127.0.0.1, float32 so greedy reruns of one prompt are exact); the request
translation's refusals as unit checks. max_output_tokens stay small: the CPU is shared."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from runtime.tokenizer.generate_input import RequestError
from server.openai import responses_input as I
from server.openai import tools as T

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"]}
WEATHER = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(float32_server):
    return float32_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)


def test_text_with_instructions_equals_the_same_turns_as_a_message_list(client):
    a = client.responses.create(model="default", instructions="Answer in one short sentence.",
                                input="What is the capital of France?", max_output_tokens=24, temperature=0)
    b = client.responses.create(model="default", max_output_tokens=24, temperature=0, input=[
        {"role": "developer", "content": "Answer in one short sentence."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}])
    assert a.object == "response" and a.id.startswith("resp_") and a.status == "completed"
    assert a.incomplete_details is None and a.instructions == "Answer in one short sentence."
    assert "Paris" in a.output_text and a.output_text == b.output_text
    assert [o.type for o in a.output] == ["message"] and a.output[0].content[0].type == "output_text"
    assert a.usage.input_tokens == b.usage.input_tokens > 10
    assert 0 < a.usage.output_tokens <= 24 and a.usage.total_tokens == a.usage.input_tokens + a.usage.output_tokens
    assert a.model == client.models.list().data[0].id


def test_max_output_tokens_cuts_and_says_incomplete(client):
    r = client.responses.create(model="default", input="Write a long story about a dragon.", max_output_tokens=5,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete" and r.output_text


def test_json_schema_text_format_is_constrained(client):
    r = client.responses.create(model="default", input="Name a big city as JSON.", max_output_tokens=60,
                                temperature=0, text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                                                 "strict": True}})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema"


def test_stream_events_in_order_and_final_response(client):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY}}
    with client.responses.stream(model="default", input="Name a big city as JSON.", max_output_tokens=60,
                                 temperature=0, text=fmt) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(deltas) >= 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.status == "completed" and final.output_text == "".join(deltas)
    with httpx.Client(base_url=str(client.base_url), timeout=120) as c:  # raw framing: `event:` then `data:`
        raw = c.post("/responses", json={"model": "default", "input": "Hi", "max_output_tokens": 2,
                                         "stream": True}).text
    blocks = [b.split("\n") for b in raw.strip().split("\n\n")]
    assert all(b[0] == "event: " + json.loads(b[1][6:])["type"] for b in blocks[:-1]) and blocks[-1] == ["data: [DONE]"]
    jsonschema.validate(json.loads(final.output_text), CITY)
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="default", instructions="Answer in one short sentence.",
                                    input="What is the capital of France?", max_output_tokens=24, temperature=0)
    second = client.responses.create(model="default", previous_response_id=first.id, input="And of Italy?",
                                     max_output_tokens=24, temperature=0)
    assert second.previous_response_id == first.id and "Rome" in second.output_text
    # the follow-up's prompt holds the first turn and its answer (instructions are not carried over)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 15
    assert client.responses.retrieve(first.id).id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="default", previous_response_id=first.id, input="Hi", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="default", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_tools_required_call_then_its_output(client):
    r = client.responses.create(model="default", input="What is the weather in Paris?", tools=WEATHER,
                                tool_choice="required", max_output_tokens=40)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    follow = client.responses.create(model="default", previous_response_id=r.id, tools=WEATHER,
                                     tool_choice="none", max_output_tokens=24, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 24 C"}])
    assert [o.type for o in follow.output] == ["message"] and follow.output_text
    # the follow-up's prompt holds the question, the call and its result (the question alone is < 40 tokens
    # with the template's default system line; tool_choice none drops the tool instructions)
    assert follow.usage.input_tokens > 60
    named = client.responses.create(model="default", input="Paris weather?", tools=WEATHER, max_output_tokens=40,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert [o.type for o in named.output] == ["function_call"] and named.output[0].name == "get_weather"


def test_stream_of_a_required_tool_call(client):
    with client.responses.stream(model="default", input="What is the weather in Paris?", tools=WEATHER,
                                 tool_choice="required", max_output_tokens=40) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments)["city"]


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": WEATHER, "tool_choice": "required", "text": {"format": {"type": "json_schema", "name": "c",
                                                                          "schema": CITY}}}, "tool_choice"),
])
def test_unsupported_parameters_are_a_400_naming_them(client, extra, param):
    body = {"model": "default", "input": "hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body=body, cast_to=object)
    assert e.value.body["param"] == param, e.value.body


def test_input_items_become_chat_turns():
    msgs = I.input_messages([
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"}])
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "c2", "name": "get_weather", "content": "rain"}
    with pytest.raises(RequestError) as e:
        I.input_messages([{"type": "reasoning", "summary": []}])
    assert e.value.param == "input[0].type"


def test_parallel_tool_calls_false_keeps_at_most_one_call():
    plan = I.tool_plan(WEATHER, "auto")
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {}}]'
    assert len(T.calls_of(plan, text, parallel=True)[1]) == 2
    content, calls = T.calls_of(plan, text, parallel=False)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert isinstance(plan, T.ToolPlan) and plan.mode == "auto"
