"""Every fenced code block of README.md, run as printed against one real SmolLM2 server on 127.0.0.1.

The blocks are extracted from the README itself, so an example edited there is tested as edited. The one change
made to a block is the server address: the README's `http://127.0.0.1:30000` (what `make serve` binds) becomes
this test's server, started with the default flags `make serve` uses. A block that needs something this test
does not have is listed in SKIPPED with the reason; a block neither run nor listed fails the test, so a new
README example cannot go untested.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.server.harness import ROOT

README = os.path.join(ROOT, "README.md")
README_URL = "http://127.0.0.1:30000"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

# first line of a block -> why it is not run here
SKIPPED = {
    "make serve   # set up .venv, install, start the server on http://127.0.0.1:30000 (default model)":
        "builds a second .venv and serves in the foreground; this test starts the same server itself",
}


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence

    @property
    def first(self) -> str:
        return self.code.splitlines()[0] if self.code.strip() else ""


def readme_blocks() -> list[Block]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in _FENCE.finditer(text)]


def _is_client_call(b: Block) -> bool:
    if b.lang == "python":
        return True
    return b.lang in ("bash", "sh", "shell") and b.code.lstrip().startswith("curl ")


def _check_json_city(out: str) -> None:
    doc = json.loads(out.strip().splitlines()[-1])
    assert isinstance(doc["city"], str) and isinstance(doc["population"], int), doc


def _check_qa(out: str) -> None:
    assert out.strip().split()[-1] in ("yes", "no"), out


def _check_paris(out: str) -> None:
    assert "Paris" in out, out


def _check_json_line(out: str) -> None:
    json.loads(out.strip().splitlines()[-1])


def _check_rag(out: str) -> None:
    assert "Paris" in out, out
    assert int(out.split()[-1]) > 0, f"the second question should reuse the document's cached prefix: {out}"


# a string the block contains -> what its output must satisfy (beyond exit status 0 and some output)
CHECKS: dict[str, Callable[[str], None]] = {
    '"json_schema": {"name": "city"': _check_json_city,
    "fl.select(\"sure\"": _check_qa,
    "curl ": _check_json_line,
    "client.responses.create(": _check_paris,
    "Answer from these notes only": _check_rag,
}


def _run(b: Block, url: str) -> subprocess.CompletedProcess:
    code = b.code.replace(README_URL, url)
    env = {**os.environ, "PYTHONPATH": ROOT}
    if b.lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_every_block_is_run_or_listed_as_skipped():
    blocks = readme_blocks()
    assert len(blocks) >= 3
    unlisted = [b for b in blocks if not _is_client_call(b) and b.first not in SKIPPED]
    assert not unlisted, f"README blocks neither run nor in SKIPPED: {[(b.line, b.first) for b in unlisted]}"
    stale = set(SKIPPED) - {b.first for b in blocks}
    assert not stale, f"SKIPPED names blocks the README no longer has: {stale}"


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


CLIENT_BLOCKS = [b for b in readme_blocks() if _is_client_call(b)]


@pytest.mark.parametrize("block", CLIENT_BLOCKS, ids=[f"README.md:{b.line}" for b in CLIENT_BLOCKS])
def test_readme_example_runs_as_printed(block: Block, server):
    if block.lang != "python" and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    assert README_URL in block.code, "a client example should address the server `make serve` starts"
    r = _run(block, server.url)
    assert r.returncode == 0, f"README.md:{block.line} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert r.stdout.strip(), f"README.md:{block.line} printed nothing"
    for marker, check in CHECKS.items():
        if marker in block.code:
            check(r.stdout)
