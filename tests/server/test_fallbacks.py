"""Start-up fallbacks are loud: each is one warning line and an entry of /get_server_info's `fallbacks`.

A real SmolLM2 server whose native CPU kernels cannot build (an empty HOME, so no cached build, and CXX=false)
serves on torch's attention and norm/rope ops, says so once per part in its log, and reports both parts; a
server whose kernels build reports none."""

from __future__ import annotations

import logging

from kernels import fallbacks
from tests.server.harness import ServerProc


def test_record_logs_one_line_per_part(caplog, monkeypatch):
    monkeypatch.setattr(fallbacks, "_recorded", {})
    with caplog.at_level(logging.WARNING, logger="kernels.fallbacks"):
        fallbacks.record("attention_backend", "native cpu kernels unavailable (x): torch backend")
        fallbacks.record("attention_backend", "again")
    assert fallbacks.recorded() == {"attention_backend": "native cpu kernels unavailable (x): torch backend"}
    assert [r.getMessage() for r in caplog.records] == [
        "fallback: attention_backend: native cpu kernels unavailable (x): torch backend"]


def _serve_and_read(s: ServerProc) -> dict:
    """/get_server_info of a ready server, after a generation that must succeed."""
    with s.client() as c:
        info = c.get("/get_server_info").json()
        r = c.post("/generate", json={"text": "The capital of France is",
                                      "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    return info


def test_a_server_whose_kernels_fail_to_build_reports_its_fallbacks(tmp_path):
    s = ServerProc("--max-total-tokens", "2048", "--log-level", "warning",
                   env={"HOME": str(tmp_path), "CXX": "false"})
    try:
        info = _serve_and_read(s.wait_ready(300))
    finally:
        s.stop()
    assert set(info["fallbacks"]) >= {"attention_backend", "elementwise_kernels"}, info["fallbacks"]
    assert "torch backend" in info["fallbacks"]["attention_backend"]
    for part in ("attention_backend", "elementwise_kernels"):
        assert s.output.count(f"fallback: {part}:") == 1, s.output[-3000:]


def test_a_server_whose_kernels_build_reports_none(default_server):
    """The session's default server (its log holds every line since its start-up)."""
    info = _serve_and_read(default_server)
    assert info["fallbacks"] == {} and "fallback:" not in default_server.output
