"""/v1/score on a real generative server (SmolLM2-135M, exact float32 path) on 127.0.0.1: SGLang's request and
response shape, probabilities equal to what `select` (frontend_lang over the same server) measures for the
same query, items and single-token choices, the query prefix-cached across items, and bad inputs refused
with the error envelope. Embedding routes on this server are a 400 that says why."""

from __future__ import annotations

import math

import pytest

import frontend_lang as fl

pytestmark = pytest.mark.slow
QUERY = "Q: What color is grass?\nA: green\nQ: What color is snow?\nA: white\nQ: "
ITEMS = ["What color is the clear daytime sky?\nA:", "What color is a ripe banana?\nA:",
         "What color is a stop sign?\nA:"]
LABELS = [" red", " blue", " green", " yellow"]


@pytest.fixture(scope="module")
def server(float32_server):
    """The shared float32 server (--dtype float32 resolves the GGUF to dense weights: the exact path)."""
    return float32_server


@pytest.fixture(scope="module")
def http(server):
    with server.client(timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def label_ids(http) -> list[int]:
    ids = http.post("/tokenize", json={"prompt": LABELS, "add_special_tokens": False}).json()["tokens"]
    assert all(len(x) == 1 for x in ids), ids  # single-token labels
    for item in ITEMS:  # and the prompt's tokens end where the label begins, as select tokenizes it
        whole = http.post("/tokenize", json={"prompt": [QUERY + item + c for c in LABELS]}).json()["tokens"]
        head = http.post("/tokenize", json={"prompt": QUERY + item}).json()["tokens"]
        assert all(w == head + x for w, x in zip(whole, ids, strict=True))
    return [x[0] for x in ids]


def _score(http, **body):
    r = http.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_probabilities_equal_selects(server, http, label_ids):
    out = _score(http, query=QUERY, items=ITEMS, label_token_ids=label_ids)
    assert out["object"] == "scoring" and len(out["scores"]) == len(ITEMS)
    assert out["usage"]["prompt_tokens"] > 0 and out["usage"]["completion_tokens"] == 0

    @fl.function
    def pick(s, item):
        s += QUERY + item
        s += fl.select("label", choices=LABELS)

    be = fl.RuntimeEndpoint(server.url)
    for item, row in zip(ITEMS, out["scores"], strict=True):
        st = pick.run(item=item, backend=be)
        assert st.error() is None
        lps = st.get_meta_info("label")["normalized_prompt_logprobs"]  # one token each: its logprob
        want = [math.exp(x) for x in lps]
        assert row == pytest.approx(want, rel=1e-4, abs=1e-7), (item, row, want)
        assert st["label"] == LABELS[row.index(max(row))]
    via_frontend = be.score(QUERY, ITEMS, label_ids)  # frontend_lang's call
    assert sum(via_frontend, []) == pytest.approx(sum(out["scores"], []), rel=1e-4)
    assert 0 < sum(out["scores"][0]) < 1  # next-token probabilities over the whole vocabulary


def test_softmax_token_ids_and_item_first(http, label_ids):
    text = _score(http, query=QUERY, items=ITEMS[:2], label_token_ids=label_ids)["scores"]
    soft = _score(http, query=QUERY, items=ITEMS[:2], label_token_ids=label_ids, apply_softmax=True)["scores"]
    for p, s in zip(text, soft, strict=True):
        assert sum(s) == pytest.approx(1.0) and s == pytest.approx([x / sum(p) for x in p], rel=1e-4)
    q = http.post("/tokenize", json={"prompt": QUERY}).json()["tokens"]
    items = http.post("/tokenize", json={"prompt": ITEMS[:2], "add_special_tokens": False}).json()["tokens"]
    by_ids = _score(http, query=q, items=items, label_token_ids=label_ids)["scores"]
    whole = http.post("/tokenize", json={"prompt": [QUERY + i for i in ITEMS[:2]]}).json()["tokens"]
    if all(w == q + i for w, i in zip(whole, items, strict=True)):  # the same tokens: the same probabilities
        assert by_ids == pytest.approx(text, rel=1e-4)
    # item_first puts the item before the query: score(A, [B]) and score(B, [A], item_first) read the same text
    flipped = _score(http, query=ITEMS[0], items=[QUERY], label_token_ids=label_ids, item_first=True)["scores"]
    assert flipped[0] == pytest.approx(text[0], rel=1e-4)


def test_the_query_is_prefix_cached_across_items(http, label_ids):
    http.post("/flush_cache")
    before = http.get("/get_server_info").json()["internal_states"][0]["prefill_tokens"]
    items = [f"Item number {i}: what color is it?\nA:" for i in range(6)]
    _score(http, query=QUERY * 3, items=items, label_token_ids=label_ids[:2])
    computed = http.get("/get_server_info").json()["internal_states"][0]["prefill_tokens"] - before
    q = len(http.post("/tokenize", json={"prompt": QUERY * 3}).json()["tokens"])
    each = [len(x) for x in http.post("/tokenize", json={"prompt": items, "add_special_tokens": False}).json()["tokens"]]
    assert computed <= q + sum(each) + 4 * len(items) * 2, (computed, q, each)  # query once, then items + labels
    assert computed < q * len(items)  # without the cache every item would recompute the query


@pytest.mark.parametrize(("body", "param"), [
    ({"query": "a", "items": ["b"]}, "label_token_ids"),
    ({"query": "a", "items": ["b"], "label_token_ids": []}, "label_token_ids"),
    ({"query": "a", "items": ["b"], "label_token_ids": [10**9]}, "label_token_ids"),
    ({"query": "a", "items": ["b"], "label_token_ids": ["x"]}, "label_token_ids"),
    ({"query": "a", "items": [], "label_token_ids": [1]}, "items"),
    ({"query": "a", "items": [[1, 2]], "label_token_ids": [1]}, "items"),
    ({"query": [1, 2], "items": ["b"], "label_token_ids": [1]}, "items"),
    ({"items": ["b"], "label_token_ids": [1]}, "query"),
    ({"query": "a", "items": ["b"], "label_token_ids": [1], "apply_softmax": "yes"}, "apply_softmax"),
    ({"query": "a", "items": ["b"], "label_token_ids": [1], "top_k": 3}, "top_k"),
])
def test_bad_score_requests(http, body, param):
    r = http.post("/v1/score", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert http.post("/v1/score", json={"query": "a", "items": ["b"], "label_token_ids": [1]}).status_code == 200


def test_embedding_routes_are_refused_on_a_generative_server(http):
    for path, body in (("/v1/embeddings", {"input": "a"}), ("/encode", {"text": "a"})):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding", r.text
        assert "generative" in r.json()["error"]["message"]
    assert http.get("/get_server_info").json()["is_embedding"] is False
