"""select over the native API: wire format, token-healing boundary, and the three choice methods."""

from __future__ import annotations

import pytest

import frontend_lang as fl
from frontend_lang.backend.runtime_endpoint import choice_triples
from tests.frontend_lang.fake_server import default_logprob

CHOICES = [" cat", " dog", " bird", " fish"]


def _mean_lp(choice: str) -> float:
    return sum(default_logprob("", c) for c in choice) / len(choice)


def test_select_wire_format_and_choice(fake, backend):
    @fl.function
    def prog(s):
        s += "Animal:"
        s += fl.select("animal", choices=CHOICES)

    st = prog.run(backend=backend)
    assert st.error() is None
    expected = max(CHOICES, key=_mean_lp)
    assert st["animal"] == expected
    assert st.text() == "Animal:" + expected
    first, second = fake.bodies("/generate")
    assert first == {"text": "Animal:", "sampling_params": {"max_new_tokens": 0}}
    assert second["text"] == ["Animal:" + c for c in CHOICES]
    assert second["sampling_params"]["max_new_tokens"] == 0
    assert second["return_logprob"] is True and second["return_text_in_logprobs"] is True
    assert second["logprob_start_len"] == len("Animal:") - 2
    meta = st.get_meta_info("animal")
    assert [len(t) for t in meta["input_token_logprobs"]] == [len(c) for c in CHOICES]
    assert meta["normalized_prompt_logprobs"] == pytest.approx([_mean_lp(c) for c in CHOICES])


def test_gen_with_choices_is_select(fake, backend):
    @fl.function
    def prog(s):
        s += "Pick:"
        s += fl.gen("x", choices=["A", "B"])

    st = prog.run(backend=backend)
    assert st["x"] == max(["A", "B"], key=_mean_lp)
    assert isinstance(fake.bodies("/generate")[-1]["text"], list)


def test_select_rejects_temperature():
    with pytest.raises(ValueError):
        fl.select("x", ["a"], temperature=0.7)
    with pytest.raises(ValueError):
        fl.select("x", [])


def test_unconditional_sends_choice_token_ids(fake, backend):
    @fl.function
    def prog(s):
        s += "Q:"
        s += fl.select("x", choices=["ab", "cd"], choices_method=fl.unconditional_likelihood_normalized)

    st = prog.run(backend=backend)
    assert st.error() is None
    third = fake.bodies("/generate")[2]
    assert third["input_ids"] == [[ord("a"), ord("b")], [ord("c"), ord("d")]]
    assert third["sampling_params"]["max_new_tokens"] == 0 and third["return_logprob"] is True
    assert "unconditional_token_logprobs" in st.get_meta_info("x")


def test_choice_triples_keeps_straddling_token():
    # prefix "Answer:" ends in token ":"; the choice " yes" was merged as ": y" + "es" (token healing).
    triples = [[-0.1, 1, "er"], [-0.2, 2, ": y"], [-0.3, 3, "es"]]
    assert choice_triples(triples, " yes", "Answer:") == triples[1:]
    plain = [[-0.1, 1, "er"], [-0.2, 2, ":"], [-0.3, 3, " yes"]]
    assert choice_triples(plain, " yes", "Answer:") == plain[2:]
    # Without token texts: SGLang's rule, drop the first triple when the prefix ends with its text.
    no_text = [[-0.1, 1, ":"], [-0.2, 2, None]]
    assert choice_triples(no_text, " yes", "Answer:") == no_text[1:]


def _t(*lps):
    return [[lp, i, "x"] for i, lp in enumerate(lps)]


def test_token_length_normalized_picks_best_mean():
    d = fl.token_length_normalized(choices=["a", "b"], normalized_prompt_logprobs=[-2.0, -1.0],
                                   input_token_logprobs=[_t(-2.0), _t(-1.0)], output_token_logprobs=[[], []])
    assert d.decision == "b"


def test_greedy_token_selection_differs_from_mean():
    # Choice 0 wins the first token but has a terrible tail; greedy picks it, the mean does not.
    lp = [_t(-0.1, -5.0, -5.0), _t(-0.2, -0.2, -0.2)]
    means = [sum(x[0] for x in t) / len(t) for t in lp]
    kw = dict(choices=["a", "b"], normalized_prompt_logprobs=means, input_token_logprobs=lp,
              output_token_logprobs=[[], []])
    assert fl.greedy_token_selection(**kw).decision == "a"
    assert fl.token_length_normalized(**kw).decision == "b"
    # Tie on the first token: the second decides; a shorter choice is padded with its mean.
    lp = [_t(-0.1), _t(-0.1, -0.01)]
    d = fl.greedy_token_selection(choices=["short", "long"], normalized_prompt_logprobs=[-0.1, -0.055],
                                  input_token_logprobs=lp, output_token_logprobs=[[], []])
    assert d.decision == "long" and d.meta_info["greedy_logprob_matrix"][0] == [-0.1, -0.1]


def test_unconditional_likelihood_normalized():
    cond = [_t(-1.0, -1.0), _t(-0.5, -0.5)]
    uncond = [[[None, 0, "x"], [-3.0, 1, "x"]], [[None, 0, "x"], [-0.4, 1, "x"]]]
    d = fl.unconditional_likelihood_normalized(choices=["rare", "common"], normalized_prompt_logprobs=[-1.0, -0.5],
                                               input_token_logprobs=cond, output_token_logprobs=[[], []],
                                               unconditional_token_logprobs=uncond)
    assert d.decision == "rare"  # -1 - (-3) = 2 beats -0.5 - (-0.4) = -0.1
    with pytest.raises(ValueError):
        fl.unconditional_likelihood_normalized(choices=["a"], normalized_prompt_logprobs=[0.0],
                                               input_token_logprobs=[_t(-1.0)], output_token_logprobs=[[]])


def test_select_falls_back_to_one_request_per_choice_when_batches_are_refused(fake, backend):
    """sglang-router answers a batched `text` with 422: select then sends one request per choice (and keeps
    doing so, without retrying the batch), with the same decision and logprobs as the batched path."""
    @fl.function
    def prog(s):
        s += "Animal:"
        s += fl.select("animal", choices=CHOICES)
        s += " and"
        s += fl.select("other", choices=CHOICES)

    batched = prog.run(backend=backend)
    assert batched.error() is None and not backend.batch_refused
    fake.requests.clear()
    fake.refuse_batch = {"text"}
    single = prog.run(backend=backend)
    assert single.error() is None and backend.batch_refused
    assert (single["animal"], single["other"]) == (batched["animal"], batched["other"])
    for name in ("animal", "other"):
        assert single.get_meta_info(name)["normalized_prompt_logprobs"] == pytest.approx(
            batched.get_meta_info(name)["normalized_prompt_logprobs"])
    texts = [b["text"] for b in fake.bodies("/generate")]
    refused = [t for t in texts if isinstance(t, list)]
    assert refused == [["Animal:" + c for c in CHOICES]]  # one refused batch, then never again
    first = "Animal:" + single["animal"] + " and"
    assert [t for t in texts if not isinstance(t, list)] == ["Animal:", *("Animal:" + c for c in CHOICES),
                                                             first, *(first + c for c in CHOICES)]
    for b in fake.bodies("/generate")[2:]:
        if b["text"] != first:
            assert b["return_logprob"] is True and b["sampling_params"]["max_new_tokens"] == 0


def test_unconditional_select_falls_back_for_input_ids_too(fake, backend):
    fake.refuse_batch = {"text", "input_ids"}

    @fl.function
    def prog(s):
        s += "Q:"
        s += fl.select("x", choices=["ab", "cd"], choices_method=fl.unconditional_likelihood_normalized)

    st = prog.run(backend=backend)
    assert st.error() is None
    ids = [b["input_ids"] for b in fake.bodies("/generate") if "input_ids" in b]
    assert ids == [[97, 98], [99, 100]]  # refused once (the text batch): no batch is tried again
    assert len(st.get_meta_info("x")["unconditional_token_logprobs"]) == 2


def test_select_raises_other_refusals(fake, backend):
    """Only 422 means "no batches here"; any other error is the program's error, not a fallback."""
    fake.script = lambda prompt, params: "x"
    original = fake.generate

    def refuse_400(body):
        if isinstance(body.get("text"), list):
            from tests.frontend_lang.fake_server import FakeError
            raise FakeError(400, "bad")
        return original(body)

    fake.generate = refuse_400

    @fl.function
    def prog(s):
        s += "Q:"
        s += fl.select("x", choices=["a", "b"])

    st = prog.run(backend=backend)
    assert "answered 400" in str(st.error()) and not backend.batch_refused
