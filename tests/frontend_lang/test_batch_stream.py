"""run_batch (threads, progress bar, prefix pre-cache, per-item errors), streaming, and prefix tracing."""

from __future__ import annotations

import asyncio
import time

import pytest

import frontend_lang as fl

FEW_SHOT = "".join(f"Q: What is {i} plus {i}?\nA: {2 * i}\n" for i in range(10))


@fl.function
def few_shot(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\nA:"
    s += fl.gen("answer", max_tokens=3)


def test_trace_prefix_is_the_constant_text(backend):
    assert few_shot.trace_prefix(backend=backend) == FEW_SHOT

    @fl.function
    def chat(s, q):
        s += fl.system("Sys.")
        with s.user():
            s += "Context. "
            s += q
        s += fl.assistant(fl.gen("a"))

    prefix = chat.trace_prefix(backend=backend)
    assert prefix == "<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\nContext. "
    real = chat.run(q="Why?", backend=backend, max_new_tokens=2)
    assert real.text().startswith(prefix)

    @fl.function
    def branchy(s, flag):
        s += "head "
        if flag:
            s += "yes"

    assert branchy.trace_prefix(backend=backend) == "head "


def test_run_batch_precaches_and_keeps_order(fake, backend, capsys):
    states = few_shot.run_batch([{"question": f"q{i}"} for i in range(32)], backend=backend,
                                num_threads=8, progress_bar=True)
    assert len(states) == 32
    assert all(st.error() is None for st in states)
    bodies = fake.bodies("/generate")
    assert bodies[0] == {"text": FEW_SHOT, "sampling_params": {"max_new_tokens": 0}}
    assert len(bodies) == 33
    for i, st in enumerate(states):
        assert st.text().startswith(FEW_SHOT + f"Q: q{i}\nA:")
        assert st.get_meta_info("answer")["cached_tokens"] >= len(FEW_SHOT)
    assert "32/32" in capsys.readouterr().err


def test_run_batch_tuples_single_thread_and_empty(fake, backend):
    states = few_shot.run_batch([("a",), ("b",)], backend=backend, num_threads=1, temperature=0.0,
                                max_new_tokens=1)
    assert [st["answer"] for st in states] == ["abc", "abc"]  # the gen's max_tokens=3 beats the run default
    assert all(b["sampling_params"]["temperature"] == 0.0 for b in fake.bodies("/generate")[1:])
    assert few_shot.run_batch([], backend=backend) == []
    with pytest.raises(TypeError):
        few_shot.run_batch([("a",)], backend=backend, bogus=1)


def test_run_batch_error_in_one_program_is_isolated(backend):
    @fl.function
    def prog(s, i):
        s += f"item {i}: "
        s += fl.gen("x", max_tokens=2)
        if i == 5:
            raise ValueError("program 5 failed")
        s += fl.gen("y", max_tokens=2)

    t0 = time.monotonic()
    states = prog.run_batch([{"i": i} for i in range(12)], backend=backend, num_threads=4)
    assert time.monotonic() - t0 < 30
    assert isinstance(states[5].error(), ValueError) and "program 5" in str(states[5].error())
    assert states[5]["x"] == "ab"
    for i, st in enumerate(states):
        if i != 5:
            assert st.error() is None and st["y"] == "ab"


def test_stream_text_iter_var_and_whole(fake, backend):
    @fl.function
    def prog(s):
        s += "Start. "
        s += fl.gen("x", max_tokens=11)
        s += " End."

    st = prog.run(stream=True, backend=backend)
    chunks = list(st.text_iter("x"))
    assert len(chunks) > 1
    assert "".join(chunks) == st["x"] == "abc def ghi"
    assert fake.bodies("/generate")[-1]["stream"] is True

    st2 = prog.run(stream=True, backend=backend)
    assert "".join(st2.text_iter()) == "Start. abc def ghi End."


def test_text_async_iter(backend):
    @fl.function
    def prog(s):
        s += fl.gen("x", max_tokens=7)

    async def collect():
        st = prog.run(stream=True, backend=backend)
        out = [c async for c in st.text_async_iter("x")]
        meta = [m async for _, m in prog.run(stream=True, backend=backend).text_async_iter(
            "x", return_meta_data=True)]
        return out, meta

    out, meta = asyncio.run(collect())
    assert "".join(out) == "abc def"
    assert meta and meta[-1]["completion_tokens"] == 7


def test_text_iter_without_stream_yields_final(backend):
    @fl.function
    def prog(s):
        s += fl.gen("x", max_tokens=2)

    st = prog.run(backend=backend)
    assert list(st.text_iter("x")) == ["ab"]
    assert list(st.text_iter()) == ["ab"]


def test_stream_error_releases_readers(fake, backend):
    from tests.frontend_lang.fake_server import FakeError

    def script(prompt, params):
        raise FakeError(400, "bad request")

    fake.script = script

    @fl.function
    def prog(s):
        s += fl.gen("x", max_tokens=4)

    st = prog.run(stream=True, backend=backend)
    assert list(st.text_iter("x")) == []
    assert isinstance(st.error(), fl.BackendError)
