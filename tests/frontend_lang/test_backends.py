"""OpenAI backend (chat and completion), Runtime launch/shutdown, chat templates, the import rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import frontend_lang as fl
from tests.frontend_lang.fake_server import default_logprob


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


@pytest.fixture
def chat_backend(fake):
    be = fl.OpenAI("SmolLM2-135M-Instruct", base_url=fake.url + "/v1", api_key="k")
    yield be
    be.shutdown()


def test_openai_chat_gen_after_assistant(fake, chat_backend):
    @fl.function
    def prog(s):
        s += fl.system("Be brief.")
        s += fl.user("Hi")
        s += fl.assistant(fl.gen("a", max_tokens=5, top_k=3))
        s += fl.user("json please")
        s += fl.assistant(fl.gen("j", json_schema={"type": "object"}))

    st = prog.run(backend=chat_backend)
    assert st.error() is None
    assert st["a"] == "abc d"
    assert json.loads(st["j"]) == {"name": "Ann", "age": 7}
    first, second = fake.bodies("/v1/chat/completions")
    assert first["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert first["max_tokens"] == 5 and first["top_k"] == 3 and first["model"] == "SmolLM2-135M-Instruct"
    assert second["response_format"]["type"] == "json_schema"
    assert second["messages"][-2] == {"role": "assistant", "content": "abc d"}
    assert st.get_meta_info("a")["prompt_tokens"] > 0


def test_openai_chat_gen_outside_assistant_is_an_error(chat_backend):
    @fl.function
    def prog(s):
        s += "plain text "
        s += fl.gen("a", max_tokens=3)

    st = prog.run(backend=chat_backend)
    assert isinstance(st.error(), RuntimeError) and "right after assistant" in str(st.error())


def test_openai_chat_select_is_unsupported(chat_backend):
    @fl.function
    def prog(s):
        s += fl.user("Pick")
        s += fl.assistant(fl.select("x", choices=["a", "b"]))

    assert isinstance(prog.run(backend=chat_backend).error(), NotImplementedError)


def test_openai_chat_stream(chat_backend):
    @fl.function
    def prog(s):
        s += fl.user("Hi")
        s += fl.assistant(fl.gen("a", max_tokens=8))

    st = prog.run(stream=True, backend=chat_backend)
    chunks = list(st.text_iter("a"))
    assert "".join(chunks) == st["a"] == "abc def "


def test_openai_completion_select_by_logit_bias(fake):
    be = fl.OpenAI("gpt-3.5-turbo-instruct", base_url=fake.url + "/v1", tokenizer=CharTokenizer())
    assert be.is_chat_model is False
    choices = ["xq", "ab", "az"]

    @fl.function
    def prog(s):
        s += "Choose: "
        s += fl.select("c", choices=choices)
        s += fl.gen("rest", max_tokens=3)

    st = prog.run(backend=be)
    assert st.error() is None
    # Step 1 allows x/a; the likelier wins; step 2 among the survivors' second tokens.
    first = max("xa", key=lambda c: default_logprob("", c))
    survivors = [c for c in choices if c[0] == first]
    expected = survivors[0] if len(survivors) == 1 else max(survivors, key=lambda c: default_logprob("", c[1]))
    assert st["c"] == expected
    bias_bodies = [b for b in fake.bodies("/v1/completions") if b.get("logit_bias")]
    assert bias_bodies[0]["logit_bias"] == {str(ord("x")): 100, str(ord("a")): 100}
    assert bias_bodies[0]["max_tokens"] == 1
    assert fake.bodies("/v1/completions")[-1]["prompt"] == "Choose: " + expected
    be.shutdown()


def test_runtime_launches_and_shuts_down():
    script = str(Path(__file__).with_name("fake_server.py"))
    rt = fl.Runtime(model_path="/m/SmolLM2.gguf", launch_command=[sys.executable, script],
                    launch_timeout=60, env={"PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        assert rt.endpoint.chat_template.name == "smollm"

        @fl.function
        def prog(s):
            s += fl.gen("x", max_tokens=2)

        assert prog.run(backend=rt)["x"] == "ab"  # a Runtime stands for its endpoint
        proc = rt.process
    finally:
        rt.shutdown()
    assert proc.poll() is not None


def test_runtime_reports_a_failed_launch():
    with pytest.raises(RuntimeError, match="exited during launch"):
        fl.Runtime(launch_command=[sys.executable, "-c", "import sys; print('no model'); sys.exit(3)"],
                   launch_timeout=30)


def test_server_flags():
    from frontend_lang.backend.runtime import server_flags
    assert server_flags({"model_path": "m", "disable_radix_cache": True, "api_key": None, "tp_size": 2,
                         "x": False}) == ["--model-path", "m", "--disable-radix-cache", "--tp-size", "2"]


def test_runtime_command_line_is_one_the_real_cli_takes():
    """What `fl.Runtime(model_path=..., **server_args)` launches (`python -m server` + these flags) is parsed by
    the real CLI into the config asked for."""
    from frontend_lang.backend.runtime import server_flags
    from server.cli import build_parser, config_from_args

    args = {"model_path": "/m/SmolLM2.gguf", "host": "127.0.0.1", "port": 30123, "log_level": "warning",
            "api_key": None, "max_total_tokens": 4096, "disable_radix_cache": True}
    flags = server_flags(args)
    assert flags[0].startswith("--")  # so `python -m server FLAGS` means `python -m server serve FLAGS`
    cfg = config_from_args(build_parser().parse_args(["serve", *flags]))
    assert (cfg.model.model_path, cfg.server.host, cfg.server.port, cfg.server.api_key, cfg.server.log_level) == (
        "/m/SmolLM2.gguf", "127.0.0.1", 30123, None, "warning")
    assert cfg.cache.max_total_tokens == 4096 and cfg.cache.disable_radix_cache


@pytest.mark.parametrize("path,name", [
    ("/x/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm"), ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-instruct"),
    ("Qwen/Qwen2-7B-Instruct", "qwen"), ("meta-llama/Llama-2-7b-chat-hf", "llama-2-chat"),
    ("google/gemma-2b-it", "gemma-it"), ("lmsys/vicuna-7b-v1.5", "vicuna_v1.1"), ("some/unknown", "default"),
])
def test_template_by_model_path(path, name):
    assert fl.get_chat_template_by_model_path(path).name == name


def test_custom_template_registration_and_llama2_style():
    fl.register_chat_template(fl.ChatTemplate("mine", {r: (f"[{r}]", "[/]") for r in ("system", "user", "assistant")},
                                              stop_str=("[/]",)))
    fl.register_chat_template_matching_function(lambda p: "mine" if "my-model" in p else None)
    assert fl.get_chat_template_by_model_path("org/my-model").name == "mine"
    t = fl.get_chat_template("llama-2-chat")
    assert t.get_prefix_and_suffix("system", []) == ("[INST] <<SYS>>\n", "\n<</SYS>>\n\n")
    assert t.get_prefix_and_suffix("user", [{"role": "system", "content": "x"}]) == ("", " [/INST]")
    assert t.get_prefix_and_suffix("user", []) == ("[INST] ", " [/INST]")
    with pytest.raises(ValueError):
        fl.get_chat_template("nope")


def test_llama3_template_renders_in_a_program(fake):
    fake.model_path = "/models/Meta-Llama-3-8B-Instruct"
    be = fl.RuntimeEndpoint(fake.url)

    @fl.function
    def prog(s):
        s += fl.user("Hi")
        s += fl.assistant(fl.gen("a", max_tokens=2))

    st = prog.run(backend=be)
    assert st.text() == ("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\nab<|eot_id|>")
    assert "<|eot_id|>" in fake.bodies("/generate")[-1]["sampling_params"]["stop"]


def test_api_key_is_sent(fake):
    be = fl.RuntimeEndpoint(fake.url, api_key="secret")
    assert be.http.client.headers["authorization"] == "Bearer secret"


def test_frontend_never_imports_the_runtime():
    code = ("import sys, frontend_lang; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('runtime', 'server', 'kernels', 'radix_cache', 'torch', 'numpy')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kwargs, named", [({"n": 2}, "n=2"), ({"stop_regex": r"\d+"}, "stop_regex"),
                                           ({"return_logprob": True}, "return_logprob"),
                                           ({"top_logprobs_num": 3}, "top_logprobs_num")])
def test_openai_backend_raises_on_options_it_cannot_pass(fake, chat_backend, kwargs, named):
    @fl.function
    def prog(s):
        s += fl.user("Hi")
        s += fl.assistant(fl.gen("a", max_tokens=3, **kwargs))

    err = prog.run(backend=chat_backend).error()
    assert isinstance(err, ValueError) and named in str(err)
    assert fake.bodies("/v1/chat/completions") == []  # nothing was sent without them


def test_runtime_endpoint_sends_images_as_image_data(fake):
    be = fl.RuntimeEndpoint(fake.url, chat_template_name="chatml-llava")

    @fl.function
    def prog(s):
        s += fl.user(fl.image("cat.png") + "What is this?")
        s += fl.assistant(fl.gen("a", max_tokens=3))

    try:
        prog.run(backend=be)
        assert fake.bodies("/generate")[-1]["image_data"] == ["cat.png"]
    finally:
        be.shutdown()
