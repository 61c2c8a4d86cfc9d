"""The hierarchical cache on the real SmolLM2 model (CPU, float32): KV loaded from the file tier equals the
recomputed KV bit for bit and greedy output is identical; a restarted tier (new store and scheduler over the
same directory and identity) serves a document's question without recomputing the document, and a changed
identity (another dtype) never sees those entries."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.config import make_config
from runtime.scheduler.hicache import HiCache
from runtime.scheduler.process import _hicache
from tests.runtime.scheduler.driver import Driver, chat

DOC = " ".join(f"Note {i}: the archive keeps record {i * 7} in drawer {i % 5}." for i in range(25))


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


def tier(runner, path, **over) -> HiCache:
    cfg = make_config(model_path=str(runner.model_path), dtype="float32", enable_hierarchical_cache=True,
                      hicache_dir=str(path), max_total_tokens=runner.pool.num_slots)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **over)) if over else cfg
    hc = _hicache(cfg, runner)
    assert hc is not None
    return hc


def empty_pool(d: Driver) -> None:
    """Drop the pool's cache but keep the tier (what a pool under pressure or a restart leaves)."""
    assert d.sched.kv.tree is not None
    d.sched.kv.tree.reset()
    d.sched.kv.allocator.reset()


def test_loaded_kv_is_bit_identical_and_greedy_output_unchanged(smollm_runner, tok, tmp_path):
    ids = chat(tok, "Which drawer holds record 70?", system=DOC)
    hc = tier(smollm_runner, tmp_path)
    d = Driver(smollm_runner, tok, hicache=hc)
    try:
        d.submit("a", ids, 12, ignore_eos=True)
        d.run()
        computed = d.ids("a")
        hc.store.flush()
        tree = d.sched.kv.tree
        assert tree is not None
        m = tree.match_prefix(ids, record=False)
        n = len(ids) // hc.chunk * hc.chunk
        reference = smollm_runner.pool.gather(m.slots[:n])
        empty_pool(d)
        d.submit("b", ids, 12, ignore_eos=True)
        d.run()
        assert d.final("b").cached_tokens == n and hc.state()["prefetched_tokens_total"] == n
        assert d.ids("b") == computed
        loaded = smollm_runner.pool.gather(tree.match_prefix(ids, record=False).slots[:n])
        assert loaded.dtype == torch.float32 and torch.equal(loaded, reference)
    finally:
        d.close()
        hc.store.close()


def test_restarted_tier_serves_the_document_and_a_changed_identity_does_not(smollm_runner, tok, tmp_path):
    first = chat(tok, "Summarize the notes.", system=DOC)
    question = chat(tok, "Which drawer holds record 70?", system=DOC)
    hc = tier(smollm_runner, tmp_path)
    d = Driver(smollm_runner, tok, hicache=hc)
    d.submit("doc", first, 1)
    d.run()
    hc.store.flush()
    hc.store.close()
    empty_pool(d)
    hc2 = tier(smollm_runner, tmp_path)  # the restart: the index is rebuilt from the directory
    assert hc2.store.entries() > 0 and hc2.store.stats.rejected_entries == 0
    d.sched.kv.hicache = hc2
    d.submit("q", question, 8)
    d.run()
    shared = next(i for i, (a, b) in enumerate(zip(first, question, strict=False)) if a != b)
    assert d.final("q").cached_tokens >= shared // hc2.chunk * hc2.chunk > 250
    assert hc2.state()["hicache_hits_total"] == 1
    other = tier(smollm_runner, tmp_path, dtype="bfloat16")  # another identity: another directory
    assert other.store.entries() == 0 and other.store.dir != hc2.store.dir
    d.close()
    assert hc2.store.entries() == 0  # /flush_cache empties the tier too
    hc2.store.close()
