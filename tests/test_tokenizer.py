"""The tokenizer built from the bundled GGUF, checked against transformers' GGUF tokenizer, and
llama.cpp where the two disagree."""

from __future__ import annotations

import time

import pytest

from radixmesh.core.model_files import resolve_model_path
from radixmesh.core.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x ** 2  # comment\n\nprint(square(3))\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "12345",
    " 12345 and 6789.01, pi=3.14159",
    "x=42;y=-7",
    "multiple     spaces   here",
    "line one\nline two\n\n\nline five\r\n\ttabbed",
    "  leading and trailing  ",
    "I'm sure they've said we'll go, but it's John's.",
    "héllo wörld — naïve café, Ünïcödé ∑ ∞",
    "emoji 🤖🎉👍🏽 and 💩💩",
    "日本語のテキストと中文文本，한국어도。",
    "Привет, мир! Γειά σου κόσμε.",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "",
    "\n",
]

# A space before a digit (any Unicode number, like "½"): SmolLM2's own pre-tokenizer (and
# llama.cpp's "smollm") isolates each digit first, so "a  1" keeps "  " whole and " ½" splits
# as " " + "½"; transformers' GGUF conversion skips the digit split and cuts these differently.
# We follow the model's own tokenizer, with llama.cpp as the reference for these strings.
DIGIT_CASES = {
    "a  1": [81, 256, 33],
    "x   42": [104, 333, 36, 34],
    "a ½": [81, 216, 16738],
}

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
]
USER_ONLY = [{"role": "user", "content": "Hello! Who are you?"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(None)


@pytest.fixture(scope="module")
def hf_tok():
    path = resolve_model_path(None)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_loads_fast():
    Tokenizer.from_path(None)  # warm the page cache and imports
    t0 = time.perf_counter()
    Tokenizer.from_path(None)
    assert time.perf_counter() - t0 < 1.0


def test_properties(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.special_ids == frozenset(range(17))  # the 17 control tokens
    assert tok.raw.get_vocab_size() == 49152


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("text", TEXTS + list(DIGIT_CASES))
def test_roundtrip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    if "<|" not in text:
        assert tok.decode(ids) == text


def test_digit_split_follows_the_model(tok):
    for text, ids in DIGIT_CASES.items():
        assert tok.encode(text) == ids
    assert tok.encode("12345") == [33, 34, 35, 36, 37]


def test_digit_split_matches_llama_cpp(tok):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(resolve_model_path(None)), vocab_only=True, verbose=False)
    for text in TEXTS + list(DIGIT_CASES):
        expected = llm.tokenize(text.encode(), add_bos=False, special=True) if text else []
        assert tok.encode(text) == expected, text


def test_no_bos_and_special_tokens(tok):
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.encode("<|im_start|>") == [1]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("messages", [SYSTEM_CHAT, USER_ONLY], ids=["system", "user-only"])
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, gen):
    ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    assert tok.encode(ours) == hf_tok.encode(theirs)


def test_chat_template_default_system_prompt(tok):
    out = tok.apply_chat_template(USER_ONLY)
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert out.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful" not in tok.apply_chat_template(SYSTEM_CHAT)


@pytest.mark.parametrize(
    "bad",
    [
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": None}],
        [{"role": 3, "content": "hi"}],
        ["hello"],
    ],
)
def test_chat_template_rejects_bad_messages(tok, bad):
    with pytest.raises(ValueError):
        tok.apply_chat_template(bad)


def test_hf_directory(tmp_path, tok, hf_tok):
    hf_tok.save_pretrained(str(tmp_path))
    assert (tmp_path / "tokenizer.json").is_file()
    t = Tokenizer.from_path(str(tmp_path))
    assert t.vocab_size == tok.vocab_size
    assert t.bos_token_id == 1 and t.eos_token_ids == (2,)
    assert t.special_ids == tok.special_ids
    for text in TEXTS:
        assert t.encode(text) == hf_tok.encode(text)
    for messages in (SYSTEM_CHAT, USER_ONLY):
        assert t.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_explicit_gguf_file_path(tok):
    t = Tokenizer.from_path(str(resolve_model_path(None)))
    assert t.encode(TEXTS[2]) == tok.encode(TEXTS[2])
