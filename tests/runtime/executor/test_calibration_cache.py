"""The int8 calibration record on disk: a stored record reads back equal, and one that does not fit the linears,
was altered, or holds bad values is rejected (removed, counted) so calibration runs again. The real model's
round trip (same codes from a cached record) is in tests/runtime/models/test_quant.py."""

from __future__ import annotations

import torch

from runtime.executor.calibration_cache import PAYLOAD, calibration_key, calibration_store, check_record

SHAPES = {"layers.0.w_qkv": 4, "lm_head": 3}


def _record() -> dict[str, torch.Tensor]:
    return {"layers.0.w_qkv": torch.tensor([0.5, 2.0, 0.0, 7.25]), "lm_head": torch.tensor([1.0, 3.0, 4.0])}


def _store(tmp_path):
    model = tmp_path / "model.gguf"
    if not model.exists():
        model.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    return calibration_store(str(model), 32, str(tmp_path / "cache"), 1 << 30)


def test_round_trip(tmp_path) -> None:
    first = _store(tmp_path)
    assert first.load(SHAPES) is None and first.cache.misses == 1
    first.save(_record())
    second = _store(tmp_path)
    got = second.load(SHAPES)
    assert got is not None and second.source == "cache"
    assert all(torch.equal(got[n], t) for n, t in _record().items())


def test_key_names_every_input(tmp_path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" * 64)
    key = calibration_key(str(model), 32)
    assert key != calibration_key(str(model), 64)
    assert {"model", "code", "torch", "cpu", "seeds", "tokens", "classes"} <= set(key)
    model.write_bytes(b"GGUF" * 65)  # another file under the same name
    assert calibration_key(str(model), 32)["model"] != key["model"]


def test_record_that_does_not_fit_is_rejected(tmp_path) -> None:
    _store(tmp_path).save(_record())
    store = _store(tmp_path)
    assert store.load({**SHAPES, "lm_head": 5}) is None
    assert store.cache.rejected == 1 and store.source == "computed"
    assert store.load(SHAPES) is None and store.cache.misses == 1  # the entry is gone


def test_altered_file_is_rejected(tmp_path) -> None:
    store = _store(tmp_path)
    store.save(_record())
    payload = store.cache.entry_dir(store.key) / PAYLOAD
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0x01
    payload.write_bytes(bytes(data))
    assert store.load(SHAPES) is None and store.cache.rejected == 1


def test_bad_values_are_rejected(tmp_path) -> None:
    for bad in (torch.tensor([1.0, float("nan"), 0.0, 1.0]), torch.tensor([1.0, -1.0, 0.0, 1.0]),
                torch.tensor([1.0, 2.0, 0.0, 1.0], dtype=torch.float64)):
        store = _store(tmp_path)
        store.save({**_record(), "layers.0.w_qkv": bad})
        assert store.load(SHAPES) is None and store.cache.rejected == 1
    assert check_record(_record(), SHAPES) is None
    assert "names differ" in (check_record({"lm_head": torch.ones(3)}, SHAPES) or "")


def test_unwritable_cache_warns_and_goes_on(tmp_path, caplog) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" * 64)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    store = calibration_store(str(model), 32, str(blocker / "cache"), 1 << 30)
    store.save(_record())
    assert store.source.startswith("computed; not stored")
    assert any("not stored" in r.getMessage() for r in caplog.records)
