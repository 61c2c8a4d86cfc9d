"""The map stays true: every repository path named in a comment, a docstring or a doc exists, and nothing cites a
document outside the repository (what a reader needs is in the repository).

Scanned: comments and docstrings of the Python files, the C++ sources' comments, README.md, docs/ and
bench/results/. A path is a run like `runtime/scheduler/core.py`, `tests/server/`, `kernels/cpu/linear.cpp`
that starts at a top-level folder of the repository (a `::test` suffix is dropped); shell globs and
placeholders (`<package>`, `*`) are not paths.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = ("runtime", "radix_cache", "kernels", "server", "frontend_lang", "tests", "bench", "docs")
# A path starts at a top-level folder after a non-path character and runs over path characters.
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[\w./-]*[\w/])")
# Documents outside the repository, and references to the tracker instead of to the code.
OUTSIDE = re.compile(r"\b(?:DESIGN|REFERENCE|STYLE)\.md\b|\breference/sglang\b|\.\./shared\b|\bissue \d+\b", re.I)
SKIP_DIRS = {".venv", ".git", ".peers", "__pycache__", "data"}
GENERATED = ("bench/.peers",)  # made by `make bench-peers` (git-ignored): named by the bench scripts


def _files(patterns: tuple[str, ...]) -> list[Path]:
    out = []
    for pattern in patterns:
        out += [p for p in ROOT.glob(pattern) if not SKIP_DIRS & set(p.relative_to(ROOT).parts)]
    return sorted(set(out))


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    src = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, body[0].value.value))
    return out


def _cpp_prose(path: Path) -> list[tuple[int, str]]:
    src = path.read_text()
    return [(src.count("\n", 0, m.start()) + 1, m.group(0)) for m in re.finditer(r"//[^\n]*|/\*.*?\*/", src, re.S)]


def _doc_prose(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text().splitlines(), 1))


def _prose() -> list[tuple[str, int, str]]:
    out: list[tuple[str, int, str]] = []
    for path in _files(tuple(f"{d}/**/*.py" for d in TOP)):
        out += [(str(path.relative_to(ROOT)), n, t) for n, t in _python_prose(path)]
    for path in _files(("kernels/**/*.cpp", "kernels/**/*.h")):
        out += [(str(path.relative_to(ROOT)), n, t) for n, t in _cpp_prose(path)]
    for path in _files(("README.md", "docs/**/*.md", "bench/results/*.md", "tests/**/*.md")):
        out += [(str(path.relative_to(ROOT)), n, t) for n, t in _doc_prose(path)]
    return out


def _is_placeholder(p: str) -> bool:
    return any(c in p for c in "*<>{}") or p.endswith("/.")


def missing_paths(prose: list[tuple[str, int, str]]) -> list[str]:
    bad = []
    for where, line, text in prose:
        for m in PATH.finditer(text):
            p = m.group(1).split("::")[0].rstrip(".")
            after, before = text[m.end():m.end() + 1], text[max(m.start() - 6, 0):m.start()]
            if _is_placeholder(p) or after in ("*", "<", "{") or p.startswith(GENERATED):
                continue
            if before == "--out " or (ROOT / p).exists():  # a command's output file is not a repository path
                continue
            bad.append(f"{where}:{line}: {p}")
    return bad


def outside_citations(prose: list[tuple[str, int, str]]) -> list[str]:
    return [f"{where}:{line}: {m.group(0)}" for where, line, text in prose for m in OUTSIDE.finditer(text)]


@pytest.fixture(scope="module")
def prose() -> list[tuple[str, int, str]]:
    return _prose()


def test_every_path_named_in_prose_exists(prose) -> None:
    assert len(prose) > 1000  # the scan reaches the code's comments and docstrings
    bad = missing_paths(prose)
    assert not bad, "paths named in comments, docstrings or docs that do not exist:\n" + "\n".join(bad)


def test_nothing_cites_a_document_outside_the_repository(prose) -> None:
    bad = outside_citations(prose)
    assert not bad, "citations of documents outside the repository:\n" + "\n".join(bad)


def test_the_scanner_catches_what_it_should() -> None:
    prose = [("x.py", 1, "see runtime/scheduler/nothing_here.py and runtime/scheduler/core.py"),
             ("x.py", 2, "tests/runtime/<package>/, kernels/cpu/*.cpp and server/openai/responses*.py are patterns"),
             ("x.md", 3, "as DESIGN.md section 2 says; issue 17 measured it")]
    assert missing_paths(prose) == ["x.py:1: runtime/scheduler/nothing_here.py"]
    assert outside_citations(prose) == ["x.md:3: DESIGN.md", "x.md:3: issue 17"]
