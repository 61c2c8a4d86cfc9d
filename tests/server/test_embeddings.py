"""Embedding mode end to end: a real `radixgen serve` on all-MiniLM-L6-v2 (auto-detected as an encoder) on
127.0.0.1, reached with the `openai` client (float and base64), LangChain's OpenAIEmbeddings, SGLang's /encode
shape and raw HTTP; results against sentence-transformers on the same weights. Bad inputs each get a 4xx with
the error envelope and the server keeps serving."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.runtime.models.sentences import sentences
from tests.server.harness import ServerProc

st = pytest.importorskip("sentence_transformers")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir() -> str:
    from runtime.models.registry import ModelNotFoundError, embedding_model_path

    try:
        return embedding_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def server(model_dir):
    s = ServerProc("--model-path", model_dir, "--num-threads", "2")
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir):
    model = st.SentenceTransformer(model_dir, device="cpu")
    return lambda texts: model.encode(texts, batch_size=64, convert_to_numpy=True)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


def _cos(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_openai_client_float_and_base64_match_sentence_transformers(client, reference, http):
    texts = sentences()[::4]  # 50 of varied length
    ref = reference(texts)
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the client asks base64, decodes
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    raw = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="base64")
    for resp in (default, floats):
        got = np.array([d.embedding for d in resp.data])
        assert got.shape == (50, 384) and [d.index for d in resp.data] == list(range(50))
        assert (_cos(got, ref) >= 0.9999).all()
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data])
    assert np.allclose(decoded, np.array([d.embedding for d in floats.data], dtype=np.float32), atol=1e-6, rtol=0)
    tokens = http.post("/tokenize", json={"prompt": texts}).json()["count"]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(tokens)
    assert floats.model == "all-MiniLM-L6-v2" and floats.object == "list"


def test_token_id_inputs_equal_text_inputs(http):
    texts = ["hello world", "token ids are embedded as given"]
    ids = http.post("/tokenize", json={"prompt": texts}).json()["tokens"]
    by_text = http.post("/v1/embeddings", json={"input": texts}).json()["data"]
    by_ids = http.post("/v1/embeddings", json={"input": ids}).json()["data"]
    one = http.post("/v1/embeddings", json={"input": ids[0]}).json()["data"]
    assert len(one) == 1
    for a, b in zip(by_text, by_ids, strict=True):
        assert _cos(a["embedding"], b["embedding"]) > 0.99999
    assert _cos(one[0]["embedding"], by_text[0]["embedding"]) > 0.99999


def test_sglang_encode_shape(http, reference):
    one = http.post("/encode", json={"text": "The capital of France is Paris."}).json()
    assert set(one) == {"embedding", "meta_info"} and one["meta_info"]["prompt_tokens"] == 9
    assert _cos(one["embedding"], reference(["The capital of France is Paris."])[0]) >= 0.9999
    batch = http.post("/encode", json={"text": ["a", "b c"], "rid": "enc1"}).json()
    assert [b["meta_info"]["id"] for b in batch] == ["enc1_0", "enc1_1"]
    ids = http.post("/tokenize", json={"prompt": "a"}).json()["tokens"]
    by_ids = http.post("/encode", json={"input_ids": ids}).json()
    assert _cos(by_ids["embedding"], batch[0]["embedding"]) > 0.99999


def test_langchain_openai_embeddings(server, reference):
    lc = pytest.importorskip("langchain_openai")
    emb = lc.OpenAIEmbeddings(model="all-MiniLM-L6-v2", base_url=server.url + "/v1", api_key="unused",
                              check_embedding_ctx_length=False)  # no tiktoken: the server tokenizes
    docs = ["LangChain embeds documents.", "And queries, one at a time."]
    got = np.array(emb.embed_documents(docs))
    assert (_cos(got, reference(docs)) >= 0.9999).all()
    assert _cos(emb.embed_query(docs[1]), reference([docs[1]])[0]) >= 0.9999


def test_truncate_cuts_to_the_limit_as_sentence_transformers_does(http, reference):
    long = " ".join(["word"] * 400)
    r = http.post("/v1/embeddings", json={"input": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "256" in r.json()["error"]["message"]
    r = http.post("/v1/embeddings", json={"input": [long, "short"], "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256 + 3
    assert _cos(r.json()["data"][0]["embedding"], reference([long])[0]) >= 0.9999  # ST cuts at 256 too


BAD = [
    ({"input": ""}, 400, "input"),
    ({"input": ["ok", ""]}, 400, "input[1]"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": {"text": "a"}}, 400, "input"),
    ({"input": [1.5, 2]}, 400, "input"),
    ({"input": ["a", 1]}, 400, "input"),
    ({"input": [[101, 102], "a"]}, 400, "input"),
    ({"input": [10**9]}, 400, "input"),
    ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "a", "dimensions": 128}, 400, "dimensions"),
    ({"input": "a", "truncate": "yes"}, 400, "truncate"),
    ({"input": "a", "temperature": 1}, 400, "temperature"),
    ({}, 400, "input"),
    ({"input": "a", "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_inputs_get_the_error_envelope_and_the_server_keeps_serving(http, body, status, param):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    ok = http.post("/v1/embeddings", json={"input": "still serving"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384


def test_malformed_json_and_encode_errors(http):
    r = http.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http.post("/encode", json={"text": "a", "input_ids": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"
    r = http.post("/encode", json={"input_ids": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type"


def test_dimensions_equal_to_the_model_width_is_accepted(http):
    r = http.post("/v1/embeddings", json={"input": "a", "dimensions": 384})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


def test_generation_routes_are_refused_on_an_embedding_server(http):
    for path, body in (("/generate", {"text": "a"}), ("/v1/completions", {"prompt": "a"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
                       ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [1]})):
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] == "model_not_generative" and "embedding" in r.json()["error"]["message"]


def test_concurrent_requests_batch_and_stay_correct(http, reference):
    texts = sentences()[1::5][:32]
    before = http.get("/get_server_info").json()["internal_states"][0]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: http.post("/v1/embeddings", json={"input": t}).json()["data"][0]["embedding"],
                            texts))
    assert (_cos(np.array(got), reference(texts)) >= 0.9999).all()
    after = http.get("/get_server_info").json()["internal_states"][0]
    assert after["embedded_inputs"] - before["embedded_inputs"] == 32
    assert after["forward_steps"] - before["forward_steps"] <= 32


def test_server_info_metrics_and_health_cover_embedding_mode(http):
    info = http.get("/get_server_info").json()
    assert info["is_embedding"] is True and info["context_length"] == 256
    assert info["internal_states"][0]["is_embedding"] is True
    assert http.get("/get_model_info").json()["is_generation"] is False
    assert http.get("/health_generate").status_code == 200
    text = http.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("sglang:prompt_tokens_total"))
    assert float(line.split()[-1]) > 0
    assert http.get("/v1/models").json()["data"][0]["id"] == "all-MiniLM-L6-v2"


def test_frontend_lang_encode(server, reference):
    import frontend_lang as fl

    be = fl.RuntimeEndpoint(server.url)
    one = be.encode("frontend_lang reaches the embedding server")
    assert _cos(one["embedding"], reference(["frontend_lang reaches the embedding server"])[0]) >= 0.9999
    assert len(be.encode(["a", "b"])) == 2


def test_dimensions_cut_only_to_widths_the_model_was_trained_for():
    """`dimensions` against a model info that lists matryoshka widths (MiniLM lists none): cut + re-normalized."""
    from types import SimpleNamespace

    from runtime.tokenizer.embedding import Embedded
    from runtime.tokenizer.generate_input import RequestError
    from server.openai.embeddings import _dimensions, _vector

    tm = SimpleNamespace(info=SimpleNamespace(embedding_dim=8, matryoshka_dims=(2, 4)))
    assert _dimensions({"dimensions": 8}, tm) is None and _dimensions({}, tm) is None
    assert _dimensions({"dimensions": 4}, tm) == 4
    for bad in (3, 0, "4", 16):
        with pytest.raises(RequestError) as e:
            _dimensions({"dimensions": bad}, tm)
        assert e.value.param == "dimensions"
    v = np.arange(1, 9, dtype="<f4")
    cut = _vector(Embedded((v / np.linalg.norm(v)).astype("<f4").tobytes(), 8), 4)
    assert np.allclose(cut, v[:4] / np.linalg.norm(v[:4]), atol=1e-6)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_an_encoder_resolves_to_float32_on_any_cpu_and_stays_resolved(model_dir, monkeypatch, native_bf16):
    """dtype auto is float32 for an encoder on CPU, and its KV cache dtype follows; each child process resolves
    the config it is sent again, which must change nothing (on a bf16 CPU the cache once stayed bfloat16)."""
    from runtime import config

    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native_bf16)
    cfg = config.resolve(config.make_config(model_path=model_dir, device="cpu"))
    assert (cfg.model.is_embedding, cfg.model.dtype, cfg.model.kv_cache_dtype) == (True, "float32", "float32")
    assert config.resolve(cfg) == cfg
