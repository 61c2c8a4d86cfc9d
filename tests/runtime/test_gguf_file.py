"""runtime/gguf_file.py: the fast metadata reader gives what gguf.GGUFReader gives, and both are parsed once."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest

from runtime import gguf_file


def test_metadata_equals_ggufreader_contents(smollm_path) -> None:
    fields = gguf.GGUFReader(smollm_path).fields
    meta = gguf_file.metadata(smollm_path)
    keys = [k for k in fields if not k.startswith("GGUF.")]  # the reader's pseudo-fields of the header
    assert sorted(meta) == sorted(keys)
    for k in keys:
        assert meta[k] == fields[k].contents(), k
    assert len(meta["tokenizer.ggml.tokens"]) == 49152


def test_cached_until_the_file_changes(tmp_path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_uint32("x.count", 7)
    w.add_string("x.name", "héllo")
    w.add_array("x.ids", [1, 2, 3])
    w.add_array("x.words", ["a", "bc", ""])
    w.add_float32("x.eps", 0.5)
    w.add_bool("x.flag", True)
    w.add_tensor("t", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = str(tmp_path / "a.gguf")
    meta = gguf_file.metadata(path)
    assert meta["x.count"] == 7 and meta["x.name"] == "héllo" and meta["x.ids"] == [1, 2, 3]
    assert meta["x.words"] == ["a", "bc", ""] and meta["x.eps"] == 0.5 and meta["x.flag"] is True
    assert gguf_file.metadata(path) is meta and gguf_file.reader(path) is gguf_file.reader(path)
    other = tmp_path / "b.gguf"
    shutil.copy(path, other)
    with open(other, "r+b") as f:  # another value, same size: the mtime tells
        data = f.read()
        f.seek(data.index(b"h\xc3\xa9llo"))
        f.write(b"world!")  # as many bytes as "héllo"
    os.utime(other, ns=(0, 1))
    os.replace(other, path)
    assert gguf_file.metadata(path)["x.name"] == "world!"


def test_not_a_gguf_file_is_refused(tmp_path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_file.metadata(str(p))


def test_tensors_equal_ggufreader_tensors(smollm_path) -> None:
    ref = gguf.GGUFReader(smollm_path).tensors
    mine = gguf_file.tensors(smollm_path)
    assert [t.name for t in mine] == [t.name for t in ref] and len(mine) == 272
    for a, b in zip(mine, ref, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    assert not mine[0].data.flags.writeable


def test_tensor_past_the_end_is_refused(tmp_path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = str(tmp_path / "a.gguf")
    (t,) = gguf_file.tensors(path)
    assert t.data.tolist() == np.arange(64, dtype=np.float32).reshape(2, 32).tolist() and t.shape == (32, 2)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(ValueError, match="past the end"):
        gguf_file.tensors(path)
