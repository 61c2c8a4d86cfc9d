"""Reasoning and tool-call formats end to end on real SmolLM2 servers, through the official `openai` client and
plain HTTP.

Server A: `--reasoning-parser deepseek-r1` (the output starts inside the thinking; SmolLM2 never writes
`</think>` itself, so its thinking runs to the `thinking_budget`, where the marker is forced),
`--tool-call-parser qwen25` and ngram speculation. Server B: default flags, no parser.
Shown: the reasoning comes back separately and the answer validates against the schema; without a parser the
same request is masked from its first token and asking for reasoning is a 400 naming --reasoning-parser; streamed
deltas join to the whole answer; speculation (A) and the radix cache leave greedy output unchanged across the
boundary; tool calls in the qwen25 syntax; the Responses API's reasoning item; /generate separate_reasoning.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.harness import ServerProc

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "Name a large city and its population."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20}},
                                                "required": ["city"], "additionalProperties": False}}}
BUDGET = 12


@pytest.fixture(scope="module")
def servers():
    # float32 with dense weights: where speculative and plain greedy output are promised equal (docs/speculative.md)
    exact = ("--dtype", "float32", "--quantization", "none")
    a = ServerProc("--reasoning-parser", "deepseek-r1", "--tool-call-parser", "qwen25", "--speculative-algorithm",
                   "ngram", "--max-total-tokens", "8192", "--grammar-compile-timeout", "120", "--log-level", "info",
                   *exact)
    b = ServerProc("--max-total-tokens", "8192", "--grammar-compile-timeout", "120", "--log-level", "warning", *exact)
    try:
        yield a.wait_ready(600), b.wait_ready(600)  # a shared, loaded CPU can take minutes
    finally:
        a.stop()
        b.stop()


def _oai(s: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=120, max_retries=0)


def test_start_up_log_names_the_parsers(servers):
    a, _ = servers
    assert "tool-call parser: qwen25 (from --tool-call-parser)" in a.output
    assert "reasoning parser: deepseek-r1" in a.output


def test_json_answer_after_separate_reasoning(servers):
    a, _ = servers
    r = _oai(a).chat.completions.create(model="default", messages=ASK, response_format=RF, max_tokens=80,
                                        temperature=0, extra_body={"thinking_budget": BUDGET})
    msg = r.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning
    assert msg.content.startswith("{") and "</think>" not in msg.content
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > BUDGET  # thinking tokens, the marker, then the answer


def test_without_a_parser_the_same_request_is_masked_from_the_first_token(servers):
    _, b = servers
    r = _oai(b).chat.completions.create(model="default", messages=ASK, response_format=RF, max_tokens=80,
                                        temperature=0)
    msg = r.choices[0].message
    assert "reasoning_content" not in (msg.model_extra or {})
    assert msg.content.startswith("{")
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    with b.client() as c:
        resp = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "thinking_budget": BUDGET})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "thinking_budget" and "--reasoning-parser" in err["message"]
        # SGLang's defaults, which sglang-router adds to every chat request: accepted, nothing to split
        plain = {"messages": ASK, "max_tokens": 8, "temperature": 0}
        resp = c.post("/v1/chat/completions", json={**plain, "separate_reasoning": True, "stream_reasoning": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"] == c.post("/v1/chat/completions", json=plain).json()[
            "choices"][0]["message"]
        resp = c.post("/generate", json={"text": "hi", "separate_reasoning": True})
        assert resp.status_code == 400 and "--reasoning-parser" in resp.json()["error"]["message"]


def test_stream_deltas_join_to_the_whole_answer(servers):
    a, _ = servers
    kw = dict(model="default", messages=ASK, response_format=RF, max_tokens=80, temperature=0,
              extra_body={"thinking_budget": BUDGET})
    whole = _oai(a).chat.completions.create(**kw).choices[0].message
    reasoning, content = [], []
    for chunk in _oai(a).chat.completions.create(stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
            content.append(d.content or "")
    assert "".join(reasoning) == whole.model_extra["reasoning_content"]
    assert "".join(content) == whole.content


def _generate(s: ServerProc, body: dict) -> dict:
    with s.client(timeout=120) as c:
        r = c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()


def test_speculation_cache_and_jump_forward_keep_greedy_output_across_the_boundary(servers):
    """The same raw request (think params straight in sampling_params) on A (ngram speculation) and B (none), and
    again on A (its prompt now cached): one greedy text, valid after the marker."""
    a, b = servers
    sp = {"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(SCHEMA), "think_end": "</think>",
          "thinking_budget": BUDGET}
    prompt = "<|im_start|>user\nName a large city and its population.<|im_end|>\n<|im_start|>assistant\n"
    first = _generate(a, {"text": prompt, "sampling_params": sp})
    plain = _generate(b, {"text": prompt, "sampling_params": sp})
    again = _generate(a, {"text": prompt, "sampling_params": sp})
    assert first["text"] == plain["text"] == again["text"]
    assert again["meta_info"]["cached_tokens"] > 0
    thinking, _, answer = first["text"].partition("</think>")
    assert thinking and answer
    jsonschema.validate(json.loads(answer), SCHEMA)
    with a.client() as c:
        state = c.get("/get_server_info").json()["internal_states"][0]
    assert state.get("jump_forward_tokens", 0) > 0  # the schema's forced keys were appended whole


def test_generate_separate_reasoning(servers):
    a, _ = servers
    body = {"text": "<|im_start|>user\nName a city.<|im_end|>\n<|im_start|>assistant\n", "separate_reasoning": True,
            "sampling_params": {"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(SCHEMA),
                                "thinking_budget": 8}}
    out = _generate(a, body)
    assert out["reasoning_text"] and "</think>" not in out["text"]
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    with a.client(timeout=120) as c, c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["text"] == out["text"] and chunks[-1]["reasoning_text"] == out["reasoning_text"]
    for prev, cur in zip(chunks, chunks[1:], strict=False):  # cumulative: both only grow
        assert cur["text"].startswith(prev["text"]) and cur["reasoning_text"].startswith(prev["reasoning_text"])
    with a.client() as c:
        r = c.post("/separate_reasoning", json={"text": "plan</think>answer"}).json()
    assert r == {"text": "answer", "reasoning_text": "plan"}


def test_required_tool_call_in_the_qwen25_syntax(servers):
    a, _ = servers
    r = _oai(a).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=100, temperature=0, extra_body={"thinking_budget": 6})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.model_extra["reasoning_content"]
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    raw = _generate(a, {"text": "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n",
                        "sampling_params": {"max_new_tokens": 60, "temperature": 0, "structural_tag": json.dumps({
                            "structures": [{"begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
                                            "schema": WEATHER["function"]["parameters"], "end": "}\n</tool_call>"}],
                            "triggers": ["<tool_call>"], "only_tags": True, "max_tags": 1})}})
    assert raw["text"].startswith('<tool_call>\n{"name": "get_weather", "arguments": {') and raw["text"].endswith(
        "}\n</tool_call>")


def test_strict_tool_in_auto_mode_and_streamed_calls(servers):
    a, _ = servers
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    calls: dict[int, dict] = {}
    kw = dict(model="default", messages=[{"role": "user", "content": "Weather in Rome? Use the tool."}],
              tools=[strict], max_tokens=50, temperature=0, extra_body={"thinking_budget": 6})
    for chunk in _oai(a).chat.completions.create(stream=True, **kw):
        for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
    whole = _oai(a).chat.completions.create(**kw).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls or []] == [
        (v["name"], v["arguments"]) for _, v in sorted(calls.items())]
    for v in calls.values():  # strict: whatever the model chose to call validates
        jsonschema.validate(json.loads(v["arguments"]), WEATHER["function"]["parameters"])


def test_responses_api_reasoning_item(servers):
    a, _ = servers
    resp = _oai(a).responses.create(model="default", input="Name a large city and its population.",
                                    max_output_tokens=80, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}})
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"]
    assert resp.output[0].content[0].text
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    with a.client(timeout=120) as c, c.stream("POST", "/v1/responses", json={
            "input": "Name a city.", "max_output_tokens": 60, "temperature": 0, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}}}) as r:
        types = [json.loads(line[6:])["type"] for line in r.iter_lines() if line.startswith("data: {")]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")


def test_unknown_parser_flag_fails_start_up():
    proc = ServerProc("--tool-call-parser", "nope")
    try:
        proc.proc.wait(60)
        assert proc.proc.returncode != 0 and "invalid choice" in proc.output
    finally:
        proc.stop()


def test_frontend_program_with_separate_reasoning(servers):
    """SGLang's frontend API in radixgen's frontend_lang: `separate_reasoning(gen(...), model_type)` splits the
    gen's variable, and its json_schema applies after the thinking (the server forces the marker at the cap)."""
    import frontend_lang as fl

    a, _ = servers

    @fl.function
    def city(s):
        s += fl.user("Name a large city and its population.")
        s += fl.assistant(fl.separate_reasoning(fl.gen("answer", max_tokens=60, temperature=0, json_schema=SCHEMA),
                                                model_type="deepseek-r1"))

    state = city.run(backend=fl.RuntimeEndpoint(a.url))
    assert state.error() is None, repr(state.error())
    assert state["answer_reasoning_content"] and "</think>" not in state["answer"]
    jsonschema.validate(json.loads(state["answer"]), SCHEMA)
    assert "</think>" in state.text()  # the program's text keeps the raw output


def test_messages_api_thinking_block_then_a_valid_answer(servers):
    """The Messages API on server A: `thinking` comes back as a thinking block first (whole and streamed), and
    the JSON answer (`output_config.format`) after it validates; server B (no parser) answers 400 naming the
    flag."""
    import anthropic

    a, b = servers
    kw = {"model": "default", "max_tokens": 80, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": BUDGET},
          "extra_body": {"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}}
    client = anthropic.Anthropic(base_url=a.url, api_key="none", max_retries=0, timeout=120)
    msg = client.messages.create(**kw)
    assert [blk.type for blk in msg.content] == ["thinking", "text"], msg.content
    assert msg.content[0].thinking.strip()
    jsonschema.validate(json.loads(msg.content[1].text), SCHEMA)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(blk.type, getattr(blk, "thinking", None), getattr(blk, "text", None)) for blk in final.content] == \
        [(blk.type, getattr(blk, "thinking", None), getattr(blk, "text", None)) for blk in msg.content]
    plain = anthropic.Anthropic(base_url=b.url, api_key="none", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as e:
        plain.messages.create(**kw)
    assert "--reasoning-parser" in str(e.value)
