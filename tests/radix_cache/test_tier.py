"""TierStore: round trip, restart index, rejected entries (corrupt, truncated, foreign, torn), the size limit,
fail-soft I/O (ENOSPC injected, a real read-only directory) and SIGKILL in the middle of a write."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from radix_cache.tier import TierStore, chunk_keys

ID = {"model": "m", "dtype": "float32", "page_size": 1}


def kv(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 2, 3, 4, generator=torch.Generator().manual_seed(seed))


def stored(tmp_path, n_entries: int = 3, limit: int = 1 << 30, identity=ID) -> tuple[TierStore, list]:
    s = TierStore(str(tmp_path), identity, limit)
    ids = list(range(8 * n_entries))
    keys = chunk_keys(ids, 8, s.digest)
    items = [(k, i * 8, ids[i * 8 : i * 8 + 8], kv(8, i)) for i, k in enumerate(keys)]
    for k, start, toks, t in items:
        assert s.put(k, start, toks, t.clone())
    s.flush()
    return s, items


def test_keys_name_the_whole_path_and_the_identity():
    a = chunk_keys([1, 2, 3, 4], 2, "d")
    assert len(a) == 2 and a[0] == chunk_keys([1, 2], 2, "d")[0]
    assert chunk_keys([9, 2, 3, 4], 2, "d")[1] != a[1]  # same chunk tokens, other prefix
    assert chunk_keys([1, 2, 3, 4], 2, "e") != a
    assert chunk_keys([1, 2, 3], 2, "d") == a[:1]  # a partial chunk has no key


def test_round_trip_bit_exact_and_found_again_after_restart(tmp_path):
    s, items = stored(tmp_path)
    for k, start, toks, t in items:
        got = s.get(k, start, toks)
        assert got is not None and torch.equal(got, t)
    s.close()
    s2 = TierStore(str(tmp_path), ID, 1 << 30)
    assert s2.entries() == 3 and s2.stats.rejected_entries == 0
    for k, start, toks, t in items:
        assert torch.equal(s2.get(k, start, toks), t)
    assert s2.stats.loaded_tokens == 24


def test_bfloat16_round_trip(tmp_path):
    s = TierStore(str(tmp_path), ID, 1 << 30)
    t = kv(8).to(torch.bfloat16)
    s.put("k", 0, list(range(8)), t)
    s.flush()
    s.close()
    assert torch.equal(TierStore(str(tmp_path), ID, 1 << 30).get("k", 0, list(range(8))), t)


def _file(s: TierStore, key: str) -> str:
    return os.path.join(s.dir, key + ".kv")


def test_corrupt_truncated_and_torn_entries_are_rejected_counted_and_deleted(tmp_path):
    s, items = stored(tmp_path)
    s.close()
    (k0, _, _, _), (k1, _, _, _), (k2, st2, toks2, _) = items
    with open(_file(s, k0), "r+b") as f:  # truncated: found at start-up (length check)
        f.truncate(os.path.getsize(_file(s, k0)) - 5)
    with open(_file(s, k2), "r+b") as f:  # a flipped payload byte: found at load (checksum)
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(_file(s, k1) + ".tmp", "wb") as f:  # a torn write
        f.write(b"RGKVT001partial")
    s2 = TierStore(str(tmp_path), ID, 1 << 30)
    assert s2.stats.rejected_entries == 2 and s2.entries() == 2
    assert not os.path.exists(_file(s, k0)) and not os.path.exists(_file(s, k1) + ".tmp")
    assert s2.get(k2, st2, toks2) is None
    assert s2.stats.rejected_entries == 3 and not os.path.exists(_file(s, k2))
    assert s2.get(k1, items[1][1], items[1][2]) is not None


def test_foreign_and_stale_entries_are_never_served(tmp_path):
    s, items = stored(tmp_path)
    s.close()
    other = TierStore(str(tmp_path), {**ID, "dtype": "bfloat16"}, 1 << 30)
    assert other.entries() == 0 and other.dir != s.dir  # another identity: another directory
    # an entry copied into this identity's directory from another identity's: header identity differs
    k, start, toks, t = items[0]
    foreign = TierStore(str(tmp_path / "x"), {**ID, "model": "other"}, 1 << 30)
    foreign.put(k, start, toks, t)
    foreign.flush()
    foreign.close()
    os.replace(_file(foreign, k), _file(s, k))
    s2 = TierStore(str(tmp_path), ID, 1 << 30)
    assert s2.stats.rejected_entries == 1 and s2.entries() == 2
    # right identity, but asked for other tokens under the key (a collision or a stale index): refused
    k1, st1, toks1, _ = items[1]
    assert s2.get(k1, st1, [t + 1 for t in toks1]) is None and s2.stats.rejected_entries == 2


def test_size_limit_holds_with_lru_order(tmp_path):
    one = os.path.getsize(_file(*(lambda s, it: (s, it[0][0]))(*stored(tmp_path / "probe", 1))))
    s, items = stored(tmp_path, 3, limit=2 * one + one // 2)
    assert s.used_bytes <= s.limit_bytes and s.entries() == 2
    assert s.get(items[0][0], items[0][1], items[0][2]) is None  # the oldest went first
    s.get(items[1][0], items[1][1], items[1][2])  # touch 1: now 2 is the least recently used
    ids = list(range(100, 108))
    s.put("new", 0, ids, kv(8, 9))
    s.flush()
    assert s.contains(items[1][0]) and not s.contains(items[2][0]) and s.contains("new")
    assert s.stats.evicted_entries == 2


def test_full_disk_drops_the_write_with_one_warning(tmp_path, caplog):
    s = TierStore(str(tmp_path), ID, 1 << 30)

    def enospc(path, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    s.write_file = enospc
    for i in range(3):
        assert s.put(f"k{i}", 0, list(range(8)), kv(8))
    s.flush()
    assert s.stats.write_errors == 3 and s.stats.dropped_writes == 3 and s.entries() == 0
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    assert s.get("k0", 0, list(range(8))) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod")
def test_read_only_directory_turns_the_tier_off_with_one_warning(tmp_path, caplog):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        s = TierStore(str(ro), ID, 1 << 30)
        assert not s.enabled and not s.put("k", 0, [1], kv(1)) and s.get("k", 0, [1]) is None
        assert sum("not writable" in r.getMessage() for r in caplog.records) == 1
    finally:
        ro.chmod(0o700)


def test_queue_full_drops_instead_of_blocking(tmp_path):
    s = TierStore(str(tmp_path), ID, 1 << 30, max_queue=1)
    gate = []

    def slow(path, parts):
        while not gate:
            time.sleep(0.01)

    s.write_file = slow
    results = [s.put(f"k{i}", 0, [i], kv(1)) for i in range(5)]
    assert results[0] and not all(results) and s.stats.dropped_writes >= 3
    gate.append(1)
    s.flush()


WRITER = """
import sys, time, torch
from radix_cache import tier
s = tier.TierStore(sys.argv[1], {"model": "m"}, 1 << 34)
big = torch.ones(256, 2, 30, 3, 64)
for i in range(2):
    s.put(f"k{i}", 0, [i], big)
    s.flush()
print("done", flush=True)


class Stalled(list):
    def __iter__(self):  # the header is written, then the writer stalls inside the payload
        yield self[0]
        yield self[1]
        print("mid", flush=True)
        time.sleep(60)
        yield from self[2:]


s.write_file = lambda path, parts: tier._write_atomic(path, Stalled(parts))
s.put("k2", 0, [2], big)
time.sleep(60)
"""


def test_sigkill_mid_write_loses_only_that_entry(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == b"done"
        assert p.stdout.readline().strip() == b"mid"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        p.kill()
        p.wait(10)
    s = TierStore(str(tmp_path), {"model": "m"}, 1 << 34)
    assert s.stats.rejected_entries == 1  # the torn k2.kv.tmp, deleted
    assert not any(n.endswith(".tmp") for n in os.listdir(s.dir))
    for i in range(2):
        got = s.get(f"k{i}", 0, [i])
        assert got is not None and bool((got == 1).all())
    assert not s.contains("k2") and s.entries() == 2


def test_unwritable_directory_even_for_root_turns_the_tier_off(caplog):
    s = TierStore("/proc/self/hicache", ID, 1 << 30)  # procfs refuses new files for every user
    assert not s.enabled and not s.put("k", 0, [1], kv(1))
    assert sum("not writable" in r.getMessage() for r in caplog.records) == 1
