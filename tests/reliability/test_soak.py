"""A 1-minute run of bench/soak.py: load at 70 % of measured capacity with client kills, bad inputs and one
scheduler SIGKILL + restart; everything served or shed cleanly, and no leak at the end."""

from __future__ import annotations

from bench.soak import main


def test_one_minute_soak(tmp_path):
    out = tmp_path / "soak.md"
    res = main(["--minutes", "1", "--max-new", "8", "--out", str(out), "--label", "test run"])
    assert res["served"] >= 10, res
    assert res["leak_ok"], res["state"]
    assert res["restart_ok"], res
    errs = res["errors"]
    assert not [k for k in errs if "WRONG" in k or (k.startswith("http_5") and k != "http_503")], errs
    assert errs.get("bad_input_ok (4xx)", 0) >= 3, errs
    # only requests in flight when the scheduler was killed may fail
    lost = sum(v for k, v in errs.items() if k == "stream_error" or k.startswith("transport_"))
    assert lost <= 16, errs
    assert "| minute |" in out.read_text()
