"""README.md stays short and true: under 8 KB; every figure of its benchmark tables is found in the
bench/results file its row names, and that file names its machine and its command; the product folders and
runtime subpackages it lists are the tree's."""

from __future__ import annotations

import os
import re

from tests.server.harness import ROOT

README = os.path.join(ROOT, "README.md")
_FILE = re.compile(r"`(bench/results/[\w.-]+\.md)`")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def figure_rows(text: str) -> list[tuple[str, list[str]]]:
    """(results file, the numbers of the row's other cells) for each table row of the Benchmarks section that
    names a results file."""
    rows = []
    for line in _section(text, "Benchmarks").splitlines():
        m = _FILE.search(line) if line.startswith("|") else None
        if m:
            cells = [c for c in line.strip("|").split("|") if not _FILE.search(c)]
            rows.append((m.group(1), [n for c in cells for n in _NUMBER.findall(c)]))
    return rows


def test_readme_is_under_8_kb():
    assert len(_readme().encode()) < 8 * 1024


def test_every_benchmark_figure_is_in_the_file_its_row_names():
    rows = figure_rows(_readme())
    assert len(rows) >= 3
    for path, numbers in rows:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            body = f.read()
        missing = [n for n in numbers if n not in body]
        assert not missing, f"{path} does not contain {missing}"
        assert re.search(r"^Machine: \S", body, re.M), f"{path} does not name its machine"
        assert re.search(r"`[^`]*bench/[\w/]+\.py[^`]*`|bench\.constrained", body), f"{path} gives no command"


def test_architecture_lists_the_tree():
    arch = _section(_readme(), "Architecture")
    for folder in ("runtime", "radix_cache", "kernels", "server", "frontend_lang", "bench", "tests"):
        assert f"`{folder}/`" in arch and os.path.isdir(os.path.join(ROOT, folder)), folder
    runtime = os.path.join(ROOT, "runtime")
    packages = {d for d in os.listdir(runtime) if os.path.isfile(os.path.join(runtime, d, "__init__.py"))}
    listed = set(re.findall(r"`(\w+)/`", arch.split("subpackages", 1)[1].split("\n- ", 1)[0]))
    assert listed == packages, (sorted(listed), sorted(packages))
    tests_runtime = {d for d in os.listdir(os.path.join(ROOT, "tests", "runtime"))
                     if os.path.isdir(os.path.join(ROOT, "tests", "runtime", d)) and not d.startswith("__")}
    assert tests_runtime <= packages, f"tests/runtime/ folders without a runtime package: {tests_runtime - packages}"
