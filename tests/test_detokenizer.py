"""Detokenization and stop strings, checked against real BPE tokenizers: in process
(RequestText, which keeps each request's window) and as a replica that sees each update
alone (window_text with detok_context_size ids of context), which must agree."""

import functools
from collections.abc import Sequence, Set

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from radixmesh.core.detokenize import (
    DecodeFn,
    RequestText,
    StopResult,
    StopStringMatcher,
    TextRules,
    Update,
    WindowText,
    detok_context_size,
    window_text,
)
from radixmesh.core.tokenizer import Tokenizer as ProjectTokenizer

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


def specials_of(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of a tokenizer's special tokens, which skip_special_tokens leaves out."""
    return frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)


@functools.cache
def project_tokenizer() -> ProjectTokenizer:
    return ProjectTokenizer.from_path(None)


@functools.cache
def _pieces(owner: Tokenizer | ProjectTokenizer) -> tuple[str | None, ...] | None:
    project = owner if isinstance(owner, ProjectTokenizer) else ProjectTokenizer(owner)
    return project.pieces


def pieces_of(decode: DecodeFn) -> Sequence[str | None] | None:
    """The ids' own texts (Tokenizer.pieces) of the tokenizer whose decode this is."""
    owner = getattr(decode, "__self__", None)
    return _pieces(owner) if isinstance(owner, Tokenizer | ProjectTokenizer) else None


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


def run_updates(
    decode: DecodeFn,
    chunks: Sequence[Sequence[int]],
    specials: Set[int],
    prompt: Sequence[int] = (),
    rules: TextRules | None = None,
) -> tuple[list[str], str]:
    """Each chunk's text as an update, then the text of an update that only finishes, in
    process (told which ids are skipped special tokens, which carry no bytes); a replica
    that sees each update alone must give each the same, with the ids' own texts too where
    the tokenizer has them."""
    rules = rules or TextRules()
    pieces = pieces_of(decode)
    in_process = RequestText(decode, rules, prompt, specials)
    with_pieces = RequestText(decode, rules, prompt, specials, pieces) if pieces else None
    size = detok_context_size(rules.stop)
    ids = list(prompt)
    texts = []
    for k, chunk in enumerate([*chunks, []]):
        update = Update(
            ids[-size:], chunk, len(ids) - len(prompt), k == len(chunks), prompt_tail=prompt[-4:]
        )
        got = in_process.update(chunk, update.finished)
        if with_pieces is not None:
            assert with_pieces.update(chunk, update.finished) == got
        assert got == window_text(decode, rules, update)
        if pieces is not None:
            assert got == window_text(decode, rules, update, pieces)
        texts.append(got.text)
        ids += chunk
    return texts[:-1], texts[-1]


def check_stream(
    decode: DecodeFn,
    ids: list[int],
    sizes: list[int],
    specials: Set[int],
    skip_special_tokens: bool = True,
) -> None:
    # As `decode` gives it: a bare tokenizers decode cannot set special tokens apart.
    rules = TextRules(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)
    deltas, tail = run_updates(decode, chunked(ids, sizes), specials, rules=rules)
    full = decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + tail == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in delta for delta in deltas + [tail])


# --- text of token ids ----------------------------------------------------------------


def test_byte_level_tokenizer_splits_characters() -> None:
    tok = byte_level_bpe()
    for char in ["🦊", "中", "😀", "한"]:
        ids = tok.encode(char).ids
        assert len(ids) > 1
        assert all(tok.decode([i]) != char for i in ids)


def test_emoji_split_over_tokens_is_held_until_complete() -> None:
    tok = byte_level_bpe()
    ids = tok.encode("a😀b").ids
    deltas, tail = run_updates(tok.decode, chunked(ids, [1]), specials_of(tok))
    assert "".join(deltas) == "a😀b" and tail == ""
    assert all("\ufffd" not in d for d in deltas)
    assert "😀" in deltas


def test_truncated_character_is_flushed_as_replacement_at_finish() -> None:
    tok = byte_level_bpe()
    ids = tok.encode("x😀").ids
    deltas, tail = run_updates(tok.decode, chunked(ids[:-1], [1]), specials_of(tok))
    assert "".join(deltas) == "x"
    assert tail == tok.decode(ids[:-1])[1:]
    assert tail.endswith("\ufffd")


def test_update_after_finish_is_an_error() -> None:
    tok = byte_level_bpe()
    text = RequestText(tok.decode, TextRules(), tok.encode("Hi").ids, frozenset())
    text.update(tok.encode(" there").ids, finished=True)
    with pytest.raises(RuntimeError):
        text.update([1], finished=False)


@settings(max_examples=150, deadline=None)
@given(text=texts)
# A skipped special token right after a 4-byte character: the in-process window must reach
# back past it to the character's first byte.
@example(text="aaa𐀀<|eos|>")
def test_one_token_at_a_time_matches_full_decode(text: str) -> None:
    tok = byte_level_bpe()
    check_stream(tok.decode, tok.encode(text).ids, [1], specials_of(tok))


@settings(max_examples=150, deadline=None)
@given(text=texts, sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_random_chunks_match_full_decode(text: str, sizes: list[int]) -> None:
    tok = byte_level_bpe()
    check_stream(tok.decode, tok.encode(text).ids, sizes, specials_of(tok))


@settings(max_examples=100, deadline=None)
@given(text=texts, skip=st.booleans())
def test_special_tokens_skipped_or_kept(text: str, skip: bool) -> None:
    tok = byte_level_bpe()
    eos = tok.token_to_id(EOS)
    ids = [i for piece in text.split("b") for i in [*tok.encode(piece).ids, eos]]
    check_stream(tok.decode, ids, [1], specials_of(tok), skip)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 319), max_size=40),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_arbitrary_token_sequences_including_invalid_utf8(ids: list[int], sizes: list[int]) -> None:
    tok = byte_level_bpe()
    assert tok.get_vocab_size() == 320
    check_stream(tok.decode, ids, sizes, specials_of(tok))


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
    ids = [tok.token_to_id(p) for p in picks]
    check_stream(tok.decode, ids, sizes, specials_of(tok), skip)


@settings(max_examples=100, deadline=None)
@given(prompt=texts, output=texts)
@example(prompt="\ufffd", output="")  # a prompt that really ends in U+FFFD is not pending
@example(prompt="ok \ufffd", output=" then")
def test_prompt_gives_mid_text_decoding(prompt: str, output: str) -> None:
    tok = byte_level_bpe()
    prompt_ids = tok.encode(prompt).ids
    out_ids = tok.encode(output).ids
    chunks = chunked(out_ids, [1])
    deltas, tail = run_updates(tok.decode, chunks, specials_of(tok), prompt_ids)
    expected = tok.decode(prompt_ids + out_ids)[len(tok.decode(prompt_ids)) :]
    assert "".join(deltas) + tail == expected


def test_metaspace_first_token_keeps_its_space_with_prompt_context() -> None:
    tok = metaspace_bpe()
    prompt_ids = tok.encode("The quick").ids
    out_ids = tok.encode(" brown fox jumps").ids
    assert tok.decode(out_ids).startswith("brown")
    deltas, tail = run_updates(tok.decode, chunked(out_ids, [1]), specials_of(tok), prompt_ids)
    assert "".join(deltas) + tail == " brown fox jumps"
    deltas, tail = run_updates(tok.decode, chunked(out_ids, [1]), specials_of(tok))
    assert "".join(deltas) + tail == "brown fox jumps"


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("abc ,.!éà")), max_size=40))
def test_metaspace_stream_matches_full_decode(text: str) -> None:
    tok = metaspace_bpe()
    check_stream(tok.decode, tok.encode(text).ids, [1], specials_of(tok))


def in_process_texts(
    decode: DecodeFn, ids: list[int], specials: Set[int]
) -> tuple[list[str], str]:
    """The text of each id as an update, in process, then of the finish."""
    text = RequestText(decode, TextRules(), [], specials)
    deltas = [text.update([i], finished=False).text for i in ids]
    return deltas, text.update([], finished=True).text


def test_decode_window_stays_small_for_long_outputs() -> None:
    tok = byte_level_bpe()
    ids = tok.encode(" ".join(CORPUS) * 20).ids
    assert len(ids) > 3000
    counting = CountingDecode(tok.decode)
    deltas, tail = in_process_texts(counting, ids, specials_of(tok))
    assert "".join(deltas) + tail == tok.decode(ids)
    # 4 ids to resynchronize UTF-8, up to 3 of a character's bytes pending, 8 more before
    # a new window, the new id.
    assert counting.longest <= 16


def test_window_stays_small_for_invalid_bytes_and_skipped_tokens() -> None:
    tok = byte_level_bpe()
    lead_byte = tok.token_to_id("ð")  # 0xF0 starts a 4-byte character
    eos = tok.token_to_id(EOS)
    ids = [lead_byte, eos] * 500 + tok.encode("🦊 ok").ids
    counting = CountingDecode(tok.decode)
    deltas, tail = in_process_texts(counting, ids, specials_of(tok))
    assert "".join(deltas) + tail == tok.decode(ids)
    # As above, with up to 8 ids pending and a skipped special token after each byte.
    assert counting.longest <= 25


@settings(max_examples=40, deadline=None)
@given(text=texts, sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_project_default_tokenizer(text: str, sizes: list[int]) -> None:
    tok = project_tokenizer()
    check_stream(tok.decode, tok.encode(text), sizes, tok.special_ids)


# --- stop strings -------------------------------------------------------------------------


class Pieces:
    """Decodes ids that each stand for one whole piece of text, so that stop strings meet
    the text cut exactly as the updates cut it."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(dict.fromkeys(pieces))
        self.ids = [self.pieces.index(piece) for piece in pieces]
        # An empty piece carries no byte, as a skipped special token.
        self.specials = frozenset(i for i, piece in enumerate(self.pieces) if not piece)

    def __call__(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return "".join(self.pieces[i] for i in ids)


def stream_stops(
    deltas: Sequence[str], stops: Sequence[str], no_stop_trim: bool = False
) -> tuple[list[str], str | None]:
    """Each delta's update until a stop string matches, then the finish's if none did: the
    text of each and the stop."""
    pieces = Pieces(deltas)
    rules = TextRules(tuple(stops), no_stop_trim)
    texts, tail = [], []
    in_process = RequestText(pieces, rules, [], pieces.specials)
    size = detok_context_size(stops)
    for k, new in enumerate([*pieces.ids, None]):
        finished = new is None
        chunk = [] if new is None else [new]
        update = Update(pieces.ids[:k][-size:], chunk, k, finished)
        got = in_process.update(chunk, finished)
        assert got == window_text(pieces, rules, update)
        (tail if finished else texts).append(got.text)
        if got.matched is not None:
            assert got.stop_at == k + 1
            return texts, got.matched
    return texts + tail, None


def released(
    deltas: Sequence[str], stops: Sequence[str], no_stop_trim: bool = False
) -> tuple[str, str | None]:
    """All text the deltas release and the stop string that ended them, if any."""
    texts, matched = stream_stops(deltas, stops, no_stop_trim)
    return "".join(texts), matched


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_no_stops_passes_text_through() -> None:
    assert StopStringMatcher([]).release("hello") == StopResult("hello", None)
    assert stream_stops(["hel", "lo"], []) == (["hel", "lo", ""], None)


def test_stop_spanning_deltas() -> None:
    deltas = ["42 </an", "sw", "er> trailing", "more"]
    assert stream_stops(deltas, ["</answer>"]) == (["42 ", "", ""], "</answer>")
    # An update after the stop adds no text and tells the same stop again.
    pieces = Pieces(deltas)
    rules = TextRules(("</answer>",))
    late = window_text(pieces, rules, Update(pieces.ids[:3], pieces.ids[3:], 3, False))
    assert late == WindowText("", 3, "</answer>")
    in_process = RequestText(pieces, rules, [], pieces.specials)
    results = [in_process.update([i], finished=False) for i in pieces.ids]
    assert results[2:] == [WindowText("", 3, "</answer>")] * 2


def test_no_stop_trim_keeps_the_stop() -> None:
    assert released(["abc E", "N", "Dxyz"], ["END"], no_stop_trim=True) == ("abc END", "END")


def test_partial_prefix_released_when_it_does_not_continue() -> None:
    texts, matched = stream_stops(["go ST", "ART", "ST"], ["STOP"])
    assert (texts, matched) == (["go ", "START", "", "ST"], None)


def test_earliest_match_wins_over_list_order() -> None:
    assert StopStringMatcher(["zzz", "b"]).release("a b zzz") == StopResult("a ", "b")
    assert released(["a b zzz"], ["zzz", "b"]) == ("a ", "b")


def test_longest_wins_at_same_position() -> None:
    assert StopStringMatcher(["ab", "abc"]).release("xabcd") == StopResult("x", "abc")
    trimmed = StopStringMatcher(["ab", "abc"], no_stop_trim=True)
    assert trimmed.release("xabcd") == StopResult("xabc", "abc")
    assert released(["xabcd"], ["ab", "abc"]) == ("x", "abc")
    assert released(["xabcd"], ["ab", "abc"], no_stop_trim=True) == ("xabc", "abc")


def test_duplicate_and_overlapping_stops() -> None:
    assert released(["a", "a", "a", "b"], ["aab", "aab", "ab"]) == ("a", "aab")


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
def test_stop_strings_agree_with_reference(
    deltas: list[str], stops: list[str], no_stop_trim: bool
) -> None:
    text, matched = released(deltas, stops, no_stop_trim)
    assert (text, matched) == reference_stop(deltas, stops, no_stop_trim)
    if matched is None:
        assert text == "".join(deltas)
        assert not any(stop in text for stop in stops)
    elif no_stop_trim:
        assert text.endswith(matched)
        assert not any(stop in text[: -len(matched)] for stop in stops)
    else:
        assert not any(stop in text for stop in stops)


@settings(max_examples=200, deadline=None)
@given(
    deltas=st.lists(st.text(stop_alphabet, max_size=4), max_size=12),
    stops=st.lists(st.text(stop_alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_holds_back_exactly_what_could_still_become_a_stop(
    deltas: list[str], stops: list[str]
) -> None:
    texts, matched = stream_stops(deltas, stops)
    # The last text, of the update a stop string ends or of the finish, holds nothing back.
    text = released_text = ""
    for delta, update_text in zip(deltas, texts[:-1], strict=False):
        text += delta
        released_text += update_text
        held = text[len(released_text) :]
        assert text.startswith(released_text)
        assert held == "" or any(stop.startswith(held) for stop in stops)
        for start in range(len(released_text)):
            assert not any(stop.startswith(text[start:]) for stop in stops)


def test_pieces_are_whole_characters_of_byte_level_tokens_only() -> None:
    tok = ProjectTokenizer(byte_level_bpe())
    pieces = tok.pieces
    assert pieces is not None and len(pieces) == tok.vocab_size
    assert pieces[tok.token_to_id(EOS)] is None  # a special token
    fox = tok.encode("🦊")
    assert len(fox) > 1 and all(pieces[i] is None for i in fox)  # bytes of one character
    ids = tok.encode("The quick brown fox")
    assert "".join(pieces[i] for i in ids) == "The quick brown fox"
    assert ProjectTokenizer(metaspace_bpe()).pieces is None  # its decoder drops a space
