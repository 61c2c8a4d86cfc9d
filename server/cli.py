"""The `radixgen` command (console script; also `python -m server`).

`radixgen serve [flags]`: flags are generated from the frozen config dataclasses in runtime/config.py, one
per field (`max_running_requests` -> `--max-running-requests`, SGLang's names), each field's docstring
(read with `ast` from the source) as its help. Booleans that default to False are switches; those that
default to True also get a `--no-` form.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from collections.abc import Sequence
from typing import Any

from runtime import config as config_mod
from runtime.config import SECTIONS, Config, make_config
from server.parsers import REASONING_PARSERS, TOOL_PARSERS

CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "kv_cache_dtype": config_mod.KV_CACHE_DTYPES,
    "device": ("auto", "cpu", "cuda"),
    "compile_mode": config_mod.COMPILE_MODES,
    "attention_backend": ("auto", "cpu", "torch", "triton", "flashinfer"),
    "schedule_policy": ("auto", "lpm", "fcfs", "dfs-weight"),
    "grammar_backend": ("llguidance", "xgrammar", "outlines", "none"),
    "log_level": ("debug", "info", "warning", "error", "critical"),
    "router_policy": ("cache_aware", "round_robin", "random", "power_of_two"),
    "speculative_algorithm": ("ngram", "draft", "none"),
    "reasoning_parser": tuple(REASONING_PARSERS),
    "tool_call_parser": tuple(TOOL_PARSERS),
}
TITLES = {"model": "model", "cache": "KV cache", "scheduler": "scheduler", "grammar": "constrained decoding",
          "speculative": "speculative decoding", "server": "HTTP server", "parallel": "data parallel (sglang-router)"}


def field_docs(cls: type) -> dict[str, str]:
    """{field name: the docstring literal right after its annotation} from the class source."""
    tree = ast.parse(inspect.getsource(config_mod))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    body = node.body
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _value_type(annotation: Any) -> type:
    """bool, int, float or str from a field annotation such as "int | None" (a string under PEP 563)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    base = text.replace("| None", "").replace("None |", "").strip()
    return {"bool": bool, "int": int, "float": float}.get(base, str)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixgen", description="radixgen: an SGLang-style LLM serving runtime")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="serve the native and OpenAI-compatible HTTP APIs",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_flags(serve)
    cache = sub.add_parser("cache", help="the compiled decode graph cache (RADIXGEN_CACHE_DIR, else "
                                         "~/.cache/radixgen/graphs)")
    cache.add_argument("action", choices=("clear", "info"), help="clear: remove it; info: its path and size")
    cache.add_argument("--compile-cache-dir", dest="compile_cache_dir", default=None, help="the cache's path")
    return parser


def run_cache(action: str, root: str | None) -> int:
    from runtime.env import load_env
    from runtime.executor.artifact_cache import ArtifactCache

    cache = ArtifactCache(root or load_env().cache_dir)
    if action == "clear":
        print(f"removed {cache.root} ({cache.clear() / 2**20:.1f} MiB)")
    else:
        entries = cache.entries()
        print(f"{cache.root}: {len(entries)} entries, {sum(e[1] for e in entries) / 2**20:.1f} MiB")
    return 0


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(TITLES.get(section, section))
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_ = docs.get(f.name, "")
            typ = _value_type(f.type)
            default = f.default if f.default is not dataclasses.MISSING else None
            if typ is bool:
                action = argparse.BooleanOptionalAction if default else "store_true"
                group.add_argument(flag, dest=f.name, action=action, default=default, help=help_)
            else:
                group.add_argument(flag, dest=f.name, type=typ, default=default, help=help_,
                                   choices=CHOICES.get(f.name), metavar=f.name.upper())


def config_from_args(ns: argparse.Namespace) -> Config:
    names = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    return make_config(**{k: v for k, v in vars(ns).items() if k in names})


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]  # `radixgen --model-path ...` behaves like `radixgen serve ...`
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "cache":
        return run_cache(ns.action, ns.compile_cache_dir)
    if ns.command != "serve":
        parser.print_help()
        return 2
    cfg = config_from_args(ns)
    if cfg.parallel.dp_size > 1:
        from server.dp import run_dp

        return run_dp(cfg)
    if cfg.parallel.node_rank > 0:
        from server.tp_node import run_tp_node

        return run_tp_node(cfg)
    from server.serve import run_server

    return run_server(cfg)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
