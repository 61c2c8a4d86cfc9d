"""Interpreter + RuntimeEndpoint against the fake native server: text, roles, vars, forks, errors."""

from __future__ import annotations

import json

import pytest

import frontend_lang as fl
from frontend_lang import ir

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_gen_sends_every_sampling_key_with_nulls(fake, backend):
    @fl.function
    def prog(s):
        s += "Hello"
        s += fl.gen("x", max_tokens=5, temperature=0.5)

    st = prog.run(backend=backend, top_k=7)
    assert st.error() is None
    assert st["x"] == "abc d"
    assert st.text() == "Helloabc d"
    body = fake.bodies("/generate")[-1]
    sp = body["sampling_params"]
    assert body["text"] == "Hello"
    for key in ir.NATIVE_SAMPLING_KEYS:
        assert key in sp
    assert sp["regex"] is None and sp["json_schema"] is None and sp["stop_regex"] is None
    assert sp["max_new_tokens"] == 5 and sp["temperature"] == 0.5 and sp["top_k"] == 7
    assert sp["skip_special_tokens"] is True
    assert "<|im_end|>" in sp["stop"]  # SmolLM2's chat template stop string, found via /get_model_info
    assert "return_logprob" not in body
    meta = st.get_meta_info("x")
    assert meta["prompt_tokens"] == 5 and meta["finish_reason"]["type"] == "length"


def test_gen_logprob_keys_go_top_level(fake, backend):
    @fl.function
    def prog(s):
        s += "Hi"
        s += fl.gen("x", max_tokens=3, return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True)

    st = prog.run(backend=backend)
    body = fake.bodies("/generate")[-1]
    assert body["return_logprob"] is True and body["logprob_start_len"] == 0
    meta = st.get_meta_info("x")
    assert meta["input_token_logprobs"][0][0] is None
    assert [t[2] for t in meta["output_token_logprobs"]] == list("abc")


def test_roles_template_and_messages(backend):
    @fl.function
    def chat(s):
        s += fl.user("Hi")
        s += fl.assistant(fl.gen("a", max_tokens=3))
        with s.user():
            s += "More"
        s += fl.assistant_begin()
        s += fl.gen("b", max_tokens=2)
        s += fl.assistant_end()

    st = chat.run(backend=backend)
    assert st.error() is None
    assert st.text() == (f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                         "<|im_start|>assistant\nabc<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n"
                         "<|im_start|>assistant\nab<|im_end|>\n")
    assert st.messages() == [
        {"role": "system", "content": SMOL_SYSTEM}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "abc"}, {"role": "user", "content": "More"},
        {"role": "assistant", "content": "ab"}]


def test_explicit_system_replaces_default(backend):
    @fl.function
    def chat(s):
        s += fl.system("Be brief.")
        s += fl.user("Q")

    st = chat.run(backend=backend)
    assert st.messages()[0] == {"role": "system", "content": "Be brief."}
    assert SMOL_SYSTEM not in st.text()


def test_nested_roles_error(backend):
    @fl.function
    def bad(s):
        s += fl.user_begin()
        s += fl.assistant("x")

    st = bad.run(backend=backend)
    assert isinstance(st.error(), ValueError)
    assert "nested" in str(st.error())


def test_var_scope_and_set_var(backend):
    @fl.function
    def prog(s):
        s += "A "
        with s.var_scope("v"):
            s += "inside "
            s += fl.gen("g", max_tokens=2)
        s += " after"
        s["manual"] = 3

    st = prog.run(backend=backend)
    assert st["v"] == "inside ab"
    assert st["manual"] == 3 and "manual" in st


def test_blocking_read_inside_program(backend):
    @fl.function
    def prog(s):
        s += fl.gen("first", max_tokens=3)
        s += " then " + s["first"].upper()  # s["first"] blocks until produced

    st = prog.run(backend=backend)
    assert st.text() == "abc then ABC"


def test_expression_concatenation_and_ret_value(backend):
    @fl.function
    def prog(s, q):
        s += "Q: " + q + "\nA:" + fl.gen("a", max_tokens=2)
        return s["a"] + "!"

    st = prog.run(q="why", backend=backend)
    assert st.text() == "Q: why\nA:ab"
    assert st.ret_value == "ab!"


def test_bind_and_positional(backend):
    @fl.function
    def prog(s, a, b):
        s += f"{a}-{b}"

    assert prog.bind(b="B").run("A", backend=backend).text() == "A-B"
    with pytest.raises(TypeError):
        prog.bind(zzz=1)
    with pytest.raises(TypeError):
        fl.function(lambda x: None)


def test_dtypes(fake, backend):
    @fl.function
    def prog(s):
        s += "n=" + fl.gen("n", dtype=int, max_tokens=4)
        s += " i=" + fl.gen_int("i", max_tokens=4)
        s += " b=" + fl.gen("b", dtype=bool)
        s += " s=" + fl.gen_string("str")

    st = prog.run(backend=backend)
    assert st.error() is None
    assert st["n"] == 42 and isinstance(st["n"], int) and st["i"] == 42
    assert st["b"] is True
    assert "n=42" in st.text()
    sent = [b["sampling_params"] for b in fake.bodies("/generate")]
    assert sent[0]["regex"] == ir.REGEX_INT and " " in sent[0]["stop"] and "\n" in sent[0]["stop"]
    assert sent[2]["regex"] == ir.REGEX_BOOL
    assert sent[3]["regex"] == ir.REGEX_STR


def test_json_schema_dict_sent_as_string(fake, backend):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}

    @fl.function
    def prog(s):
        s += fl.gen("j", json_schema=schema, max_tokens=40)

    st = prog.run(backend=backend)
    assert json.loads(st["j"]) == {"name": "Ann", "age": 7}
    assert json.loads(fake.bodies("/generate")[-1]["sampling_params"]["json_schema"]) == schema


def test_bad_regex_is_rejected_client_side():
    with pytest.raises(ValueError, match="regular expression"):
        fl.gen("x", regex="[unclosed")


def test_image_on_text_only_model_is_clear_error(backend):
    @fl.function
    def prog(s):
        s += fl.user(fl.image("cat.png") + "What is this?")

    with pytest.raises(ValueError, match="text-only model"):
        prog.run(backend=backend)


def test_fork_commits_prefix_then_joins(fake, backend):
    @fl.function
    def tot(s):
        s += "Think step by step about the question. "
        forks = s.fork(3)
        forks += lambda i: f"Path {i}: "
        forks += fl.gen("thought", max_tokens=3)
        forks.join()
        s += "Best: " + s["thought"][0]

    st = tot.run(backend=backend)
    assert st.error() is None
    assert st["thought"] == ["abc", "abc", "abc"]
    assert st.text() == "Think step by step about the question. Best: abc"
    bodies = fake.bodies("/generate")
    assert bodies[0] == {"text": "Think step by step about the question. ", "sampling_params": {"max_new_tokens": 0}}
    branch_texts = sorted(b["text"] for b in bodies[1:4])
    assert branch_texts == [f"Think step by step about the question. Path {i}: " for i in range(3)]
    # Each branch found the committed prefix in the (fake) cache.
    assert all(m >= len("Think step by step about the question. ") - 1
               for m in (fake._cached(t) for t in branch_texts))


def test_fork_group_list_and_iteration(backend):
    @fl.function
    def prog(s):
        s += "P"
        g = s.fork(2)
        g += ["x", "y"]
        assert [st.text() for st in g] == ["Px", "Py"]
        assert len(g) == 2
        g.join()

    assert prog.run(backend=backend).error() is None


def test_copy_context_manager(backend):
    @fl.function
    def prog(s):
        s += "Base. "
        with s.copy() as c:
            c += fl.gen("side", max_tokens=2)
        s += "main"

    st = prog.run(backend=backend)
    assert st["side"] == ["ab"]
    assert st.text() == "Base. main"


def test_server_error_surfaces_without_hanging(fake, backend):
    from tests.frontend_lang.fake_server import FakeError

    def script(prompt, params):
        if "boom" in prompt:
            raise FakeError(400, "regex is not supported")
        return "ok"

    fake.script = script

    @fl.function
    def prog(s):
        s += "boom"
        s += fl.gen("x", max_tokens=4)
        s += fl.gen("y", max_tokens=4)

    st = prog.run(backend=backend)
    err = st.error()
    assert isinstance(err, fl.BackendError) and err.status == 400 and "not supported" in str(err)
    with pytest.raises(RuntimeError, match="not produced"):
        st["y"]
    assert len(fake.bodies("/generate")) == 1  # later nodes were skipped


def test_body_exception_propagates_from_run(backend):
    @fl.function
    def prog(s):
        s += "x"
        raise KeyError("mine")

    with pytest.raises(KeyError):
        prog.run(backend=backend)


def test_default_backend_and_helpers(fake, backend):
    @fl.function
    def prog(s):
        s += fl.gen("x", max_tokens=1)

    fl.set_default_backend(backend)
    try:
        assert prog.run()["x"] == "a"
        fl.flush_cache()
        assert fake.bodies("/flush_cache")
        assert fl.get_server_info()["model_path"].endswith(".gguf")
    finally:
        fl.set_default_backend(None)
    with pytest.raises(RuntimeError, match="no backend"):
        prog.run()


def test_aborted_generation_is_an_error(fake, backend):
    orig = fake.generate_one

    def aborting(prompt, params, body):
        res = orig(prompt, params, body)
        res["text"] = ""
        res["meta_info"]["finish_reason"] = {"type": "abort", "message": "no grammar backend"}
        return res

    fake.generate_one = aborting

    @fl.function
    def prog(s):
        s += fl.gen("x", regex="[0-9]+")

    st = prog.run(backend=backend)
    assert isinstance(st.error(), fl.GenerationAborted) and "no grammar backend" in str(st.error())
    st = prog.run(stream=True, backend=backend)
    assert list(st.text_iter("x")) == [] and isinstance(st.error(), fl.GenerationAborted)


def test_program_argument_named_like_a_sampling_key(fake, backend):
    @fl.function
    def prog(s, temperature):
        s += f"It is {temperature} degrees. "
        s += fl.gen("x", max_tokens=1)

    st = prog.run(temperature=30, backend=backend, top_p=0.5)
    assert st.text().startswith("It is 30 degrees.")
    sp = fake.bodies("/generate")[-1]["sampling_params"]
    assert sp["temperature"] == 1.0 and sp["top_p"] == 0.5
