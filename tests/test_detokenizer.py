"""Incremental detokenizer and stop-string matcher, checked against real BPE tokenizers."""

import functools
import importlib
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from radixmesh.core.detokenize import StopResult, StopStringMatcher
from radixmesh.services.detokenizer.incremental import DecodeFn, IncrementalDetokenizer

EOS = "<|eos|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 🦊🐶",
    "Café crème brûlée, naïve façade — déjà vu!",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "日本語のテキストも少し入れておきます。こんにちは！",
    "Emoji parade: 😀😃😄😁 👩‍👩‍👧 🏳️‍🌈 🇫🇷 ❤️ 👍🏽",
    "Tabs\tand\nnewlines\r\n  and   spaces.",
    "Ελληνικά και русский текст, עברית, العربية.",
]
SAMPLE_CHARS = list("ab xyz\n\t.,!éüñçø中文字日本語한국어") + [
    "😀", "👍🏽", "🦊", "🏳️‍🌈", "\u200d", "\u0301", " ", "  ", EOS,
]  # fmt: skip
texts = st.lists(
    st.one_of(st.sampled_from(SAMPLE_CHARS), st.characters(codec="utf-8")), max_size=30
).map("".join)


@functools.cache
def byte_level_bpe() -> Tokenizer:
    """A tiny byte-level BPE: emoji and CJK characters span several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer


@functools.cache
def metaspace_bpe() -> Tokenizer:
    """A tiny BPE whose decoder drops the leading space of the first token only."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tokenizer.train_from_iterator(CORPUS[:2] * 4, trainer=trainer)
    return tokenizer


@functools.cache
def project_tokenizer() -> object | None:
    """The project's default tokenizer, or None while that module does not exist yet."""
    name = "radixmesh.core.tokenizer"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None
    return module.Tokenizer.from_path(None)


class CountingDecode:
    """Wraps a decode function and records the longest id list it was given."""

    def __init__(self, decode: DecodeFn) -> None:
        self._decode = decode
        self.longest = 0

    def __call__(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        self.longest = max(self.longest, len(ids))
        return self._decode(ids, skip_special_tokens=skip_special_tokens)


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Splits ids into consecutive chunks of the given sizes (cycled), sizes >= 1."""
    chunks, pos, i = [], 0, 0
    while pos < len(ids):
        size = sizes[i % len(sizes)]
        chunks.append(ids[pos : pos + size])
        pos += size
        i += 1
    return chunks


def run_detok(
    decode: DecodeFn,
    chunks: list[list[int]],
    prompt_tail: Sequence[int] = (),
    skip_special_tokens: bool = True,
) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(decode, prompt_tail, skip_special_tokens)
    deltas = [detok.step(chunk) for chunk in chunks]
    tail = detok.finish()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def check_stream(
    decode: DecodeFn, ids: list[int], sizes: list[int], skip_special_tokens: bool = True
) -> None:
    deltas, tail = run_detok(decode, chunked(ids, sizes), (), skip_special_tokens)
    full = decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + tail == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in delta for delta in deltas + [tail])


# --- incremental detokenizer -------------------------------------------------------------


def test_byte_level_tokenizer_splits_characters() -> None:
    tok = byte_level_bpe()
    for char in ["🦊", "中", "😀", "한"]:
        ids = tok.encode(char).ids
        assert len(ids) > 1
        assert all(tok.decode([i]) != char for i in ids)


def test_emoji_split_over_tokens_is_held_until_complete() -> None:
    tok = byte_level_bpe()
    ids = tok.encode("a😀b").ids
    detok = IncrementalDetokenizer(tok.decode)
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) == "a😀b"
    assert all("\ufffd" not in d for d in deltas)
    assert "😀" in deltas


def test_truncated_character_is_flushed_as_replacement_at_finish() -> None:
    tok = byte_level_bpe()
    ids = tok.encode("x😀").ids
    detok = IncrementalDetokenizer(tok.decode)
    assert "".join(detok.step([i]) for i in ids[:-1]) == "x"
    assert detok.finish() == tok.decode(ids[:-1])[1:]
    assert detok.finish() == ""
    assert detok.text.startswith("x") and detok.text.endswith("\ufffd")


def test_step_after_finish_is_an_error() -> None:
    detok = IncrementalDetokenizer(byte_level_bpe().decode)
    detok.finish()
    with pytest.raises(RuntimeError):
        detok.step([1])


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_one_token_at_a_time_matches_full_decode(text: str) -> None:
    tok = byte_level_bpe()
    check_stream(tok.decode, tok.encode(text).ids, [1])


@settings(max_examples=150, deadline=None)
@given(text=texts, sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_random_chunks_match_full_decode(text: str, sizes: list[int]) -> None:
    tok = byte_level_bpe()
    check_stream(tok.decode, tok.encode(text).ids, sizes)


@settings(max_examples=100, deadline=None)
@given(text=texts, skip=st.booleans())
def test_special_tokens_skipped_or_kept(text: str, skip: bool) -> None:
    tok = byte_level_bpe()
    eos = tok.token_to_id(EOS)
    ids = [i for piece in text.split("b") for i in [*tok.encode(piece).ids, eos]]
    check_stream(tok.decode, ids, [1], skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 319), max_size=40),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_arbitrary_token_sequences_including_invalid_utf8(ids: list[int], sizes: list[int]) -> None:
    tok = byte_level_bpe()
    assert tok.get_vocab_size() == 320
    check_stream(tok.decode, ids, sizes)


# Byte-level symbols of single bytes: UTF-8 lead bytes F0, E4, C3, continuation bytes
# 9F, 98, 80, B8, AD, the never-valid FF, and ASCII "A".
SINGLE_BYTES = ["ð", "ä", "Ã", "Ł", "ĺ", "Ģ", "¸", "Ń", "ÿ", "A"]


@settings(max_examples=300, deadline=None)
@given(
    picks=st.lists(st.sampled_from([*SINGLE_BYTES, EOS]), max_size=60),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    skip=st.booleans(),
)
def test_runs_of_loose_utf8_bytes(picks: list[str], sizes: list[int], skip: bool) -> None:
    tok = byte_level_bpe()
    check_stream(tok.decode, [tok.token_to_id(p) for p in picks], sizes, skip)


@settings(max_examples=100, deadline=None)
@given(prompt=texts, output=texts)
def test_prompt_tail_gives_mid_text_decoding(prompt: str, output: str) -> None:
    tok = byte_level_bpe()
    prompt_ids = tok.encode(prompt).ids
    out_ids = tok.encode(output).ids
    deltas, tail = run_detok(tok.decode, chunked(out_ids, [1]), prompt_ids[-4:])
    expected = tok.decode(prompt_ids[-4:] + out_ids)[len(tok.decode(prompt_ids[-4:])) :]
    assert "".join(deltas) + tail == expected


def test_metaspace_first_token_keeps_its_space_with_prompt_context() -> None:
    tok = metaspace_bpe()
    prompt_ids = tok.encode("The quick").ids
    out_ids = tok.encode(" brown fox jumps").ids
    assert tok.decode(out_ids).startswith("brown")
    deltas, tail = run_detok(tok.decode, chunked(out_ids, [1]), prompt_ids[-3:])
    assert "".join(deltas) + tail == " brown fox jumps"
    deltas, tail = run_detok(tok.decode, chunked(out_ids, [1]))
    assert "".join(deltas) + tail == "brown fox jumps"


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("abc ,.!éà")), max_size=40))
def test_metaspace_stream_matches_full_decode(text: str) -> None:
    tok = metaspace_bpe()
    check_stream(tok.decode, tok.encode(text).ids, [1])


def test_decode_window_stays_small_for_long_outputs() -> None:
    tok = byte_level_bpe()
    ids = tok.encode(" ".join(CORPUS) * 20).ids
    assert len(ids) > 3000
    counting = CountingDecode(tok.decode)
    deltas, tail = run_detok(counting, chunked(ids, [1]))
    assert "".join(deltas) + tail == tok.decode(ids)
    assert counting.longest <= 8


def test_window_stays_small_for_invalid_bytes_and_skipped_tokens() -> None:
    tok = byte_level_bpe()
    lead_byte = tok.token_to_id("ð")  # 0xF0 starts a 4-byte character
    eos = tok.token_to_id(EOS)
    ids = [lead_byte, eos] * 500 + tok.encode("🦊 ok").ids
    counting = CountingDecode(tok.decode)
    deltas, tail = run_detok(counting, chunked(ids, [1]))
    assert "".join(deltas) + tail == tok.decode(ids)
    assert counting.longest <= 16


@settings(max_examples=40, deadline=None)
@given(text=texts, sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_project_default_tokenizer(text: str, sizes: list[int]) -> None:
    tok = project_tokenizer()
    if tok is None:
        pytest.skip("radixmesh.core.tokenizer is not written yet")
    check_stream(tok.decode, list(tok.encode(text)), sizes)


# --- stop strings -------------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, deltas: Sequence[str]) -> tuple[str, str | None]:
    """Feeds deltas until a stop matches; returns all released text and the match."""
    released = []
    for delta in deltas:
        result = matcher.feed(delta)
        released.append(result.text)
        if result.matched is not None:
            return "".join(released), result.matched
    released.append(matcher.flush())
    return "".join(released), None


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("hello") == StopResult("hello", None)
    assert matcher.flush() == ""


def test_stop_spanning_deltas() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </an") == StopResult("42 ", None)
    assert matcher.feed("sw") == StopResult("", None)
    assert matcher.feed("er> trailing") == StopResult("", "</answer>")
    assert matcher.matched == "</answer>"
    assert matcher.feed("more") == StopResult("", None)
    assert matcher.flush() == ""


def test_no_stop_trim_keeps_the_stop() -> None:
    matcher = StopStringMatcher(["END"], no_stop_trim=True)
    assert feed_all(matcher, ["abc E", "N", "Dxyz"]) == ("abc END", "END")


def test_partial_prefix_released_when_it_does_not_continue() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == StopResult("go ", None)
    assert matcher.feed("ART") == StopResult("START", None)
    assert matcher.feed("ST") == StopResult("", None)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_earliest_match_wins_over_list_order() -> None:
    matcher = StopStringMatcher(["zzz", "b"])
    assert matcher.feed("a b zzz") == StopResult("a ", "b")


def test_longest_wins_at_same_position() -> None:
    assert StopStringMatcher(["ab", "abc"]).feed("xabcd") == StopResult("x", "abc")
    trimmed = StopStringMatcher(["ab", "abc"], no_stop_trim=True)
    assert trimmed.feed("xabcd") == StopResult("xabc", "abc")


def test_duplicate_and_overlapping_stops() -> None:
    matcher = StopStringMatcher(["aab", "aab", "ab"])
    assert feed_all(matcher, ["a", "a", "a", "b"]) == ("a", "aab")


def reference_stop(
    deltas: Sequence[str], stops: Sequence[str], no_stop_trim: bool
) -> tuple[str, str | None]:
    """Stops at the first delta after which the text contains a stop string."""
    text = ""
    for delta in deltas:
        text += delta
        hits = [(text.find(s), -len(s), s) for s in stops if s in text]
        if hits:
            start, _, stop = min(hits)
            return text[: start + len(stop) if no_stop_trim else start], stop
    return text, None


stop_alphabet = st.sampled_from(list("ab\n😀中"))


@settings(max_examples=300, deadline=None)
@given(
    deltas=st.lists(st.text(stop_alphabet, max_size=4), max_size=12),
    stops=st.lists(st.text(stop_alphabet, min_size=1, max_size=4), max_size=3),
    no_stop_trim=st.booleans(),
)
def test_matcher_agrees_with_reference(
    deltas: list[str], stops: list[str], no_stop_trim: bool
) -> None:
    released, matched = feed_all(StopStringMatcher(stops, no_stop_trim), deltas)
    assert (released, matched) == reference_stop(deltas, stops, no_stop_trim)
    if matched is None:
        assert released == "".join(deltas)
        assert not any(stop in released for stop in stops)
    elif no_stop_trim:
        assert released.endswith(matched)
        assert not any(stop in released[: -len(matched)] for stop in stops)
    else:
        assert not any(stop in released for stop in stops)


@settings(max_examples=200, deadline=None)
@given(
    deltas=st.lists(st.text(stop_alphabet, max_size=4), max_size=12),
    stops=st.lists(st.text(stop_alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_holds_back_exactly_what_could_still_become_a_stop(
    deltas: list[str], stops: list[str]
) -> None:
    matcher = StopStringMatcher(stops)
    text = released = ""
    for delta in deltas:
        text += delta
        result = matcher.feed(delta)
        if result.matched is not None:
            break
        released += result.text
        held = text[len(released) :]
        assert text.startswith(released)
        assert held == "" or any(stop.startswith(held) for stop in stops)
        for start in range(len(released)):
            assert not any(stop.startswith(text[start:]) for stop in stops)
