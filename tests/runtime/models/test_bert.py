"""The BERT encoder and its pooling against references on the real all-MiniLM-L6-v2 weights (float32):
sentence-transformers on 200 sentences of varied length (cosine >= 0.9999 each, packed batches and batch 1),
and transformers' BertModel token states pooled by hand for every pooling mode."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.config import make_config, resolve
from runtime.models import bert
from runtime.models.pooling import PoolingConfig, pool, read_pooling_config
from tests.runtime.models.sentences import sentences

st = pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def model_dir() -> str:
    from runtime.models.registry import ModelNotFoundError, embedding_model_path

    try:
        return embedding_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def runner(model_dir):
    from runtime.executor.embedding_runner import EmbeddingRunner

    return EmbeddingRunner(make_config(model_path=model_dir))


@pytest.fixture(scope="module")
def tok(model_dir):
    from runtime.tokenizer.load import load_tokenizer

    return load_tokenizer(model_dir)


def test_matches_sentence_transformers_on_200_sentences(runner, tok, model_dir):
    sents = sentences()
    ref = st.SentenceTransformer(model_dir, device="cpu").encode(sents, batch_size=64, convert_to_tensor=True)
    assert ref.dtype == torch.float32
    ids = [tok.encode(s) for s in sents]
    assert max(len(x) for x in ids) <= runner.context_len == 256
    packed = torch.cat([runner.embed(ids[i : i + 64]) for i in range(0, len(ids), 64)])
    assert packed.dtype == torch.float32 and packed.shape == ref.shape == (200, 384)
    cos = torch.nn.functional.cosine_similarity(packed, ref)
    print(f"cosine vs sentence-transformers over {len(sents)}: min {cos.min():.7f} mean {cos.mean():.7f}")
    assert (cos >= 0.9999).all(), [(i, float(c)) for i, c in enumerate(cos) if c < 0.9999]
    single = torch.cat([runner.embed([ids[k]]) for k in range(0, 200, 7)])
    assert (torch.nn.functional.cosine_similarity(single, ref[::7]) >= 0.9999).all()
    assert torch.allclose(packed.norm(dim=1), torch.ones(200), atol=1e-5)  # the Normalize module


@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
def test_token_states_and_pooling_match_transformers(runner, tok, model_dir, mode):
    from transformers import BertModel

    hf = BertModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    # longest first, as the runner packs: the two long ones share a padded attention group, "a" runs alone
    sents = ["Zürich ist schön im Frühling, sagt man.", "The quick brown fox jumps over the lazy dog.", "a"]
    ids = [tok.encode(s) for s in sents]
    lens = [len(x) for x in ids]
    L = max(lens)
    batch = torch.tensor([x + [0] * (L - len(x)) for x in ids])
    mask = (torch.arange(L)[None, :] < torch.tensor(lens)[:, None]).long()
    with torch.no_grad():
        states = hf(input_ids=batch, attention_mask=mask).last_hidden_state  # [B, L, H]
    flat = torch.tensor([t for x in ids for t in x])
    pos = torch.cat([torch.arange(n) for n in lens])
    ours = runner.model.forward(flat, pos, lens)
    assert [g.n for g in bert._Padding(lens, pos, torch.device("cpu")).groups] == [2, 1]
    ref_rows = torch.cat([states[b, :n] for b, n in enumerate(lens)])
    assert torch.allclose(ours, ref_rows, atol=1e-4), float((ours - ref_rows).abs().max())
    if mode == "mean":
        want = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    elif mode == "cls":
        want = states[:, 0]
    else:
        want = torch.stack([states[b, n - 1] for b, n in enumerate(lens)])
    got = pool(ours, torch.tensor(lens), mode, normalize=False)
    assert torch.allclose(got, want, atol=1e-4)
    normed = pool(ours, torch.tensor(lens), mode, normalize=True)
    assert torch.allclose(normed, torch.nn.functional.normalize(want, dim=-1), atol=1e-5)


def _st_dir(tmp_path, modules: list[str], pooling: dict | None) -> str:
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    entries = [{"idx": i, "name": str(i), "path": "1_Pooling" if m == "Pooling" else "",
                "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(tmp_path)


def test_pooling_config_reads_what_the_checkpoint_names(tmp_path, model_dir):
    assert read_pooling_config(model_dir) == PoolingConfig("mean", True, 256, ())
    d = _st_dir(tmp_path / "cls", ["Transformer", "Pooling"], {"pooling_mode_cls_token": True})
    assert read_pooling_config(d) == PoolingConfig("cls", False, None, ())
    d = _st_dir(tmp_path / "last", ["Transformer", "Pooling", "Normalize"], {"pooling_mode_lasttoken": True})
    assert read_pooling_config(d) == PoolingConfig("last", True, None, ())
    d = _st_dir(tmp_path / "max", ["Transformer", "Pooling"], {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_pooling_config(d)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "bert", "matryoshka_dimensions": [64, 128]}))
    assert read_pooling_config(str(bare)) == PoolingConfig("cls", True, None, (64, 128))


def test_embedding_mode_is_detected_and_refused_where_it_cannot_run(model_dir, smollm_path):
    cfg = resolve(make_config(model_path=model_dir))
    assert cfg.model.is_embedding is True and cfg.model.dtype == "float32"
    assert resolve(make_config(model_path=smollm_path)).model.is_embedding is False
    with pytest.raises(ValueError, match="not an encoder checkpoint"):
        resolve(make_config(model_path=smollm_path, is_embedding=True))
    with pytest.raises(ValueError, match="serves embeddings only"):
        resolve(make_config(model_path=model_dir, is_embedding=False))
    with pytest.raises(ValueError, match="no decoding to speculate"):
        resolve(make_config(model_path=model_dir, speculative_algorithm="ngram"))
