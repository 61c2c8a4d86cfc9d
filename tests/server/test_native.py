"""The native API end to end on the real SmolLM2 server: the session's `default_server` (tests/conftest.py).

(SIGKILL of a real server's scheduler: tests/reliability/test_fault_inject.py; of the model-free one:
tests/server/test_supervision.py.)
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

MAX_TOTAL = 8192  # default_server's --max-total-tokens


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def _internal(c: httpx.Client) -> dict:
    r = c.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()["internal_states"][0]


def _idle_and_no_leak(st: dict) -> bool:
    return (st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0
            and st["kv_free_slots"] + st["kv_evictable_slots"] == st["max_total_num_tokens"])


def _sse(lines) -> list:
    """Parsed `data:` events of an SSE body (lines iterator); '[DONE]' kept as a string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


WORDS = ["alpha", "beta", "gamma", "delta", "river", "mountain", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "story", "tells"]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))


def test_64_concurrent_mixed_requests_then_nothing_leaks(server):
    rng = random.Random(0)
    jobs = [(_prompt(rng), rng.randint(8, 32), k % 2 == 0, rng.choice([0.0, 0.7])) for k in range(64)]

    async def one(client: httpx.AsyncClient, prompt: str, max_new: int, stream: bool, temp: float):
        body = {"text": prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": max_new, "temperature": temp, "ignore_eos": k_ignore(max_new)}}
        if not stream:
            r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return [r.json()]
        async with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            return _sse([line async for line in r.aiter_lines()])

    async def run_all():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
            return await asyncio.gather(*(one(client, *j) for j in jobs))

    results = asyncio.run(run_all())
    for (_, max_new, stream, _), events in zip(jobs, results, strict=True):
        if stream:
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert chunks, "no chunk before [DONE]"
            for a, b in zip(chunks, chunks[1:], strict=False):
                assert b["text"].startswith(a["text"])  # cumulative: chunks add up to the final text
                assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
            final = chunks[-1]
        else:
            final = events[0]
        fr = final["meta_info"]["finish_reason"]
        n_out = len(final["output_ids"])
        assert 1 <= final["meta_info"]["completion_tokens"] == n_out <= max_new
        # the length limit is checked first: a request ends by "length" exactly when it reached max_new, and
        # otherwise only on an EOS token (no stop strings here), which ignore_eos rules out
        assert fr["type"] == ("length" if n_out == max_new else "stop"), fr
        if k_ignore(max_new):
            assert fr == {"type": "length", "length": max_new}, fr
        if fr["type"] == "stop":
            assert type(fr["matched"]) is int, fr
    with server.client() as c:
        deadline = time.monotonic() + 5
        while not _idle_and_no_leak(st := _internal(c)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _idle_and_no_leak(st), st
    # the loop's decode-step timing (the host time per step): every decode step counted, its forward
    # a part of its loop iteration
    assert st["decode_steps_timed"] > 0, st
    assert st["decode_step_s_total"] > st["decode_forward_s_total"] > 0, st
    assert st["decode_host_ms_mean"] > 0, st
    # the loaded model's objects were frozen out of the cyclic GC after start-up (runtime/child.py; a full
    # collection over them costs ~400 ms), and the pauses that remain are counted
    assert st["gc_frozen_objects"] > 100_000, st
    assert st["gc_collections"] >= 0 and st["gc_pause_s_total"] >= 0.0, st


def k_ignore(max_new: int) -> bool:
    return max_new % 3 == 0  # a third run to the full length regardless of EOS


def test_clients_that_go_away_abort_within_a_second(server):
    body = {"text": "Tell me a very long story about a dragon.", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0.8}}

    async def reader(client: httpx.AsyncClient):
        async with client.stream("POST", "/generate", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    return  # leaving the block closes the connection mid-stream

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            await asyncio.gather(*(reader(client) for _ in range(8)))

    asyncio.run(run_all())
    gone = time.monotonic()
    with server.client() as c:
        while True:
            st = _internal(c)
            if _idle_and_no_leak(st) or time.monotonic() - gone > 1.0:
                break
            time.sleep(0.05)
        assert _idle_and_no_leak(st), st
        assert time.monotonic() - gone <= 1.5


def test_non_streaming_client_timeout_aborts(server):
    body = {"text": "Count to a thousand:", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    with server.client(timeout=1.0) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/generate", json=body)
    gone = time.monotonic()
    with server.client() as c:
        while not _idle_and_no_leak(st := _internal(c)) and time.monotonic() - gone < 1.0:
            time.sleep(0.05)
        assert _idle_and_no_leak(st), st


BAD = [
    ("raw", b"{bad"),
    ("raw", b"[]"),
    ("raw", b"42"),
    ("raw", b'{"text": "\\ud800"}'),
    ("raw", b'{"text": "hi", "sampling_params": {"temperature": NaN}}'),
    ("json", {}),
    ("json", {"text": 7}),
    ("json", {"text": ""}),
    ("json", {"input_ids": []}),
    ("json", {"input_ids": [999999]}),
    ("json", {"input_ids": [-1]}),
    ("json", {"text": "hi", "input_ids": [1]}),
    ("json", {"text": "hi", "sampling_params": {"temperature": -1}}),
    ("json", {"text": "hi", "sampling_params": {"temperature": "hot"}}),
    ("json", {"text": "hi", "sampling_params": {"top_p": 0}}),
    ("json", {"text": "hi", "sampling_params": {"top_k": -5}}),
    ("json", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
    ("json", {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}),
    ("json", {"text": "hi", "sampling_params": {"n": 0}}),
    ("json", {"text": "hi", "sampling_params": {"n": 100000}}),
    ("json", {"text": "hi", "sampling_params": {"stop": [""]}}),
    ("json", {"text": "hi", "sampling_params": {"stop": ["x"] * 1000}}),
    ("json", {"text": "hi", "sampling_params": {"logit_bias": {"abc": 1}}}),
    ("json", {"text": "hi", "sampling_params": {"logit_bias": {"1": 1e9}}}),
    ("json", {"text": "hi", "sampling_params": {"presence_penalty": 5}}),
    ("json", {"text": "hi", "sampling_params": {"repetition_penalty": 0}}),
    ("json", {"text": "hi", "sampling_params": {"bogus_param": 1}}),
    ("json", {"text": "hi", "return_logprob": True, "top_logprobs_num": 50}),
    ("json", {"text": "hi", "stream": "yes"}),
    ("json", {"text": ["a", "b"], "sampling_params": [{}, {}, {}]}),
    ("json", {"text": "hi " * 9000}),
]


def test_bad_requests_get_400_envelope_and_server_stays_healthy(server):
    assert len(BAD) >= 20
    with server.client() as c:
        for kind, body in BAD:
            if kind == "raw":
                r = c.post("/generate", content=body, headers={"content-type": "application/json"})
            else:
                r = c.post("/generate", json=body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error" and err["message"]
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 10**9}})
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert c.get("/health_generate").status_code == 200
        assert _idle_and_no_leak(_internal(c))


def test_404_405_and_huge_body_are_json_errors(server):
    with server.client() as c:
        r = c.get("/no/such/route")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = c.delete("/generate")
        assert r.status_code == 405 and "error" in r.json()
        r = c.post("/generate", content=b"x" * (9 * 1024 * 1024), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "error" in r.json()


def test_batch_ids_n_and_logprob_triples(server):
    with server.client() as c:
        r = c.post("/generate", json={"text": ["The sky is", "Water is"], "sampling_params": {"max_new_tokens": 0}})
        assert r.status_code == 200
        out = r.json()
        assert isinstance(out, list) and len(out) == 2
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" and o["output_ids"] == [] for o in out)

        # every sampling key sent, most null (what SGLang's client does)
        keys = ["max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
                "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
                "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "regex",
                "json_schema", "ebnf", "logit_bias", "sampling_seed"]
        sp = dict.fromkeys(keys)
        sp.update(max_new_tokens=3, temperature=0.0)
        r = c.post("/generate", json={"input_ids": [504, 3575, 282, 4649, 314], "sampling_params": sp, "rid": "lp1",
                                      "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                                      "return_text_in_logprobs": True})
        assert r.status_code == 200, r.text
        m = r.json()["meta_info"]
        assert m["id"] == "lp1" and m["prompt_tokens"] == 5
        inp = m["input_token_logprobs"]
        assert len(inp) == 5 and inp[0][0] is None and inp[0][1] == 504 and inp[1][2] == " capital"
        out = m["output_token_logprobs"]
        assert len(out) == 3 and all(isinstance(t[0], float) and isinstance(t[1], int) and isinstance(t[2], str)
                                     for t in out)
        assert len(m["output_top_logprobs"]) == 3 and len(m["output_top_logprobs"][0]) == 2

        r = c.post("/generate", json={"text": "Pick a color:", "rid": "nn",
                                      "sampling_params": {"max_new_tokens": 4, "n": 3, "temperature": 1.0}})
        out = r.json()
        assert len(out) == 3 and {o["meta_info"]["id"] for o in out} == {"nn_0", "nn_1", "nn_2"}


def test_abort_request_by_rid(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            task = asyncio.ensure_future(client.post("/generate", json={
                "text": "Write forever:", "rid": "to-abort",
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}))
            await asyncio.sleep(1.0)
            r = await client.post("/abort_request", json={"rid": "to-abort"})
            assert r.status_code == 200
            return await task

    r = asyncio.run(run())
    assert r.status_code == 200
    assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_info_routes_flush_and_metrics(server):
    with server.client() as c:
        info = c.get("/get_model_info").json()
        assert info["is_generation"] is True and info["max_context_length"] > 0 and info["model_path"]
        si = c.get("/server_info").json()
        assert si["max_running_requests"] == 128 and si["max_total_tokens"] == MAX_TOTAL
        assert si["internal_states"][0]["max_total_num_tokens"] == MAX_TOTAL
        assert c.post("/flush_cache").status_code == 200
        st = _internal(c)
        assert st["kv_free_slots"] == MAX_TOTAL and st["kv_evictable_slots"] == 0
        text = c.get("/metrics").text
        for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate",
                     "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
                     "e2e_request_latency_seconds_sum", "prompt_tokens_total", "generation_tokens_total",
                     "num_retracted_reqs", "gen_throughput", "num_grammar_queue_reqs"):
            assert f"sglang:{name}{{" in text, name  # SGLang's names by default
        assert 'model_name="' in text
