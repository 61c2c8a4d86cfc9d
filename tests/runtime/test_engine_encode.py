"""The offline Engine in embedding mode (all-MiniLM-L6-v2, auto-detected): encode through the same tokenizer
manager and scheduler process as the server, against sentence-transformers; generation refused."""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime.tokenizer.generate_input import RequestError

st = pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def model_dir() -> str:
    from runtime.models.registry import ModelNotFoundError, embedding_model_path

    try:
        return embedding_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def test_engine_encode(model_dir):
    texts = ["The capital of France is Paris.", "Embeddings for retrieval.", "a"]
    ref = st.SentenceTransformer(model_dir, device="cpu").encode(texts)
    with runtime.Engine(model_dir, num_threads=2) as eng:
        one = eng.encode(texts[0])
        assert one["meta_info"]["prompt_tokens"] == 9 and len(one["embedding"]) == 384
        many = eng.encode(texts, rid="batch")
        assert [m["meta_info"]["id"] for m in many] == ["batch_0", "batch_1", "batch_2"]
        got = np.array([m["embedding"] for m in many])
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        assert (cos >= 0.9999).all()
        by_ids = eng.encode(input_ids=eng.tokenizer.encode(texts[2]))
        assert np.allclose(by_ids["embedding"], got[2], atol=1e-5)
        with pytest.raises(RequestError, match="does not generate"):
            eng.generate("hello", {"max_new_tokens": 1})
        with pytest.raises(RequestError, match="empty string"):
            eng.encode("")
        assert eng.get_server_info()["internal_states"][0]["embedded_inputs"] == 5
