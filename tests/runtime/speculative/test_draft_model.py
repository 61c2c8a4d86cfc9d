"""Speculative decoding with a draft model on real models (CPU, float32), through the scheduler in-process.

Greedy output with speculation equals without, token for token: a tiny random Llama target with (a) an
unrelated tiny random Llama as draft (acceptance near 0) and (b) a perturbed copy of the target (acceptance in
between), 30 prompts each; SmolLM2 as its own draft (weights shared, own KV pool: acceptance ~100 %); and
constrained requests stay valid. Every run ends with the strict check of both KV pools (Driver.run).
"""

from __future__ import annotations

import json

import pytest
import torch

from runtime.config import make_config
from runtime.executor.model_runner import create_model_runner
from tests.runtime.models.tiny import TINY
from tests.runtime.scheduler.driver import Driver, chat, person_schema_backend

SPEC = {"speculative_algorithm": "draft", "speculative_num_draft_tokens": 4}


def tiny_llama(path: str, seed: int, base: str | None = None, noise: float = 0.0) -> str:
    """A tiny random Llama saved at `path` (seed `seed`), or the one at `base` with Gaussian noise added."""
    import transformers as tf

    torch.manual_seed(seed)
    if base is None:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False))
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # peaked enough to have clear greedy choices
    else:
        model = tf.LlamaForCausalLM.from_pretrained(base)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def runner_for(path: str, slots: int = 4096):
    return create_model_runner(make_config(model_path=path, dtype="float32", max_total_tokens=slots,
                                           max_running_requests=32, disable_compile=True), progress=False)


def path_of(runner) -> str:
    return runner.model_path


def spec_cfg(draft) -> dict:
    return {**SPEC, "speculative_draft_model_path": path_of(draft)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_draft")
    target = tiny_llama(str(d / "target"), 0)
    return {"target": runner_for(target), "other": runner_for(tiny_llama(str(d / "other"), 1)),
            "noisy": runner_for(tiny_llama(str(d / "noisy"), 2, base=target, noise=0.3))}


@pytest.mark.parametrize("draft", ["other", "noisy"])
def test_tiny_greedy_equal_with_and_without_a_draft(tiny, draft):
    g = torch.Generator().manual_seed(7)
    prompts = {f"p{i}": torch.randint(0, TINY["vocab_size"], (int(n),), generator=g).tolist()
               for i, n in enumerate(torch.randint(4, 60, (30,), generator=g))}
    d = Driver(tiny["target"], None, draft_runner=tiny[draft], **spec_cfg(tiny[draft]))
    try:
        for rid, ids in prompts.items():
            d.submit(f"off_{rid}", ids, 24, ignore_eos=True, disable_speculation=True)
        d.run()
        for rid, ids in prompts.items():
            d.submit(rid, ids, 24, ignore_eos=True)
        d.run()
        diff = [rid for rid in prompts if d.ids(rid) != d.ids(f"off_{rid}")]
        assert not diff, f"outputs differ with speculation on: {diff}"
        st = d.sched.internal_state()
        print(f"tiny draft {draft}: accept rate {st['spec_accept_rate']:.3f}, accept length "
              f"{st['spec_accept_length']:.2f} over {st['spec_verify_ct']} verify steps")
        assert st["spec_verify_ct"] > 0
        if draft == "other":
            assert st["spec_accept_rate"] < 0.3
        else:
            assert 0.05 < st["spec_accept_rate"] < 0.95
    finally:
        d.close()


@pytest.fixture(scope="module")
def smol_draft(smollm_runner):
    """SmolLM2 as its own draft: the session runner's weights, a KV pool of its own."""
    return smollm_runner.sibling(num_slots=2048)


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


QUESTIONS = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?",
             "Write a haiku about rain.", "What do bees make?", "Who wrote Hamlet?"]


def test_smollm2_as_its_own_draft_accepts_nearly_everything(smollm_runner, smol_draft, tok):
    d = Driver(smollm_runner, tok, draft_runner=smol_draft, **spec_cfg(smol_draft))
    try:
        for i, q in enumerate(QUESTIONS):
            d.submit(f"off{i}", chat(tok, q), 16, ignore_eos=True, disable_speculation=True)
        d.run()
        for i, q in enumerate(QUESTIONS):
            d.submit(f"on{i}", chat(tok, q), 16, ignore_eos=True)
        d.run()
        assert all(d.ids(f"on{i}") == d.ids(f"off{i}") for i in range(len(QUESTIONS)))
        st = d.sched.internal_state()
        print(f"SmolLM2 self-draft: accept rate {st['spec_accept_rate']:.3f}, accept length "
              f"{st['spec_accept_length']:.2f} over {st['spec_verify_ct']} verify steps")
        assert st["spec_accept_rate"] > 0.9 and st["spec_accept_length"] > 4.0
    finally:
        d.close()
    assert smol_draft.allocator.available() == smol_draft.allocator.num_slots


def test_constrained_and_draft_speculative_outputs_stay_valid(smollm_runner, smol_draft, tok):
    be, schema = person_schema_backend(tok)
    ask = chat(tok, 'Give me a JSON object for Ada Lovelace with her name and age.')
    outs = {}
    try:
        for mode, cfg in (("off", {}), ("on", spec_cfg(smol_draft))):
            d = Driver(smollm_runner, tok, grammar_backend=be, draft_runner=smol_draft if cfg else None, **cfg)
            try:
                d.submit("j0", ask, 40, json_schema=schema)
                d.submit("j1", ask, 40, json_schema=schema, temperature=0.7, sampling_seed=3)
                d.run()
                outs[mode] = {rid: d.ids(rid) for rid in ("j0", "j1")}
                if mode == "on":
                    assert d.final("j0").spec_verify_ct > 0 and d.final("j1").spec_verify_ct > 0
            finally:
                d.close()
    finally:
        be.close()
    for mode in outs:
        for rid in ("j0", "j1"):
            obj = json.loads(tok.decode(outs[mode][rid]))
            assert set(obj) == {"name", "age"} and isinstance(obj["age"], int), (mode, rid)
    assert outs["on"]["j0"] == outs["off"]["j0"]  # greedy: the same tokens


def _word_tokenizer(path: str, swap: bool = False) -> None:
    """A WordLevel tokenizer.json of TINY's 300 tokens at `path` (`swap`: tokens 5 and 6 trade ids)."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"w{i}": i for i in range(TINY["vocab_size"])}
    if swap:
        vocab["w5"], vocab["w6"] = 6, 5
    t = tokenizers.Tokenizer(WordLevel(vocab, unk_token="w0"))
    t.pre_tokenizer = Whitespace()
    t.save(f"{path}/tokenizer.json")


def test_startup_refuses_an_incompatible_draft(tiny, tmp_path):
    """One clear error each: another tokenizer, no tokenizer, another vocabulary size."""
    from runtime.config import resolve
    from runtime.executor.draft import create_draft_runner
    from runtime.tokenizer.load import load_tokenizer

    target = tiny["target"]
    _word_tokenizer(path_of(target))
    tok = load_tokenizer(path_of(target))
    cases = {"swapped": "its tokenizer differs from the model's (token 5 is b'w6' instead of b'w5')",
             "none": "cannot load its tokenizer", "wide": "vocabulary of 301 logits instead of the model's 300"}
    for name, why in cases.items():
        d = tmp_path / name
        if name == "wide":
            import transformers as tf

            tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "vocab_size": 301})).save_pretrained(str(d))
        else:
            tiny_llama(str(d), 3)
        if name != "none":
            _word_tokenizer(str(d), swap=name == "swapped")
        cfg = resolve(make_config(model_path=path_of(target), dtype="float32", max_total_tokens=4096,
                                  disable_compile=True, **{**SPEC, "speculative_draft_model_path": str(d)}))
        with pytest.raises(ValueError, match="^--speculative-draft-model-path .*" + why.replace("(", r"\(")
                           .replace(")", r"\)")):
            create_draft_runner(cfg, target, tok)


def test_engine_serves_smollm2_as_its_own_draft(smollm_path):
    """The launch path: --speculative-algorithm draft with the model's own path (shared weights), greedy
    tokens and float32 logprobs equal to an opted-out request, the figures in meta_info and server info."""
    import runtime

    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        runtime.Engine(speculative_algorithm="draft")
    eng = runtime.Engine(max_total_tokens=2048, dtype="float32", speculative_draft_model_path=smollm_path, **SPEC)
    try:
        text = "List the days of the week: Monday, Tuesday,"
        params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        on = eng.generate(text, params, return_logprob=True)
        off = eng.generate(text, {**params, "disable_speculation": True}, return_logprob=True)
        assert on["output_ids"] == off["output_ids"]
        lp_on = [x[0] for x in on["meta_info"]["output_token_logprobs"]]
        lp_off = [x[0] for x in off["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lp_on, lp_off, strict=True)) < 1e-3
        assert on["meta_info"]["spec_verify_ct"] > 0 and on["meta_info"]["spec_accept_length"] > 3.0
        st = eng.get_server_info()["internal_states"][0]
        assert st["spec_accept_rate"] > 0.9 and st["kv_free_slots"] + st["kv_evictable_slots"] == 2048
    finally:
        eng.shutdown()
