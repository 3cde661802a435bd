"""Stateless windowed detokenization against the stateful RequestStream, real tokenizer."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.detokenize import (
    TextRules,
    Update,
    WindowText,
    detok_context_size,
    window_text,
)
from radixmesh.core.request import FinishKind, FinishReason
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.tokenizer import Tokenizer, _bytes_to_unicode
from radixmesh.request_output import RequestStream
from radixmesh.services.scheduler.request import Req

EOS = 2  # <|im_end|>, the stop token
SPECIALS = range(17)
PROMPTS = ["Hi", "Say something: ", "你好", "x😀", "Write a poem"]
PIECES = [
    "Hello", " world", ",", " the", "\n", "\n\n", "中文", "你好", "😀", "👍🏽", "🦊", "é",
    " naïve", "한국어", "END", "ab", "a", "b", " 😀", "lo w",
]  # fmt: skip
STOPS = [
    "ab", "aba", "bab", "中文", "😀", "😀😀", "\n\n", "END", " the", "<|im_end|>", "é", "a",
    "文😀", "lo w", "🏽", "<|endoftext|>",
]  # fmt: skip

# Output, token by token: (text, matched stop string, completion tokens).
Outcome = tuple[str, str | None, int]


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(None)


@functools.cache
def byte_tokens() -> dict[int, int]:
    """The id of each byte's single-byte token (most bytes have one)."""
    tok = tokenizer()
    ids = {b: tok.token_to_id(ch) for b, ch in _bytes_to_unicode().items()}
    return {b: i for b, i in ids.items() if i is not None}


def as_bytes(text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character split into partial tokens."""
    return [byte_tokens()[b] for b in text.encode()]


def reference(prompt: list[int], out: list[int], rules: TextRules, stop_token: bool) -> Outcome:
    """The in-process engine's stream fed one token at a time, stopped at a stop string."""
    params = SamplingParams(
        max_new_tokens=max(len(out), rules.min_new_tokens),
        min_new_tokens=rules.min_new_tokens,
        stop=list(rules.stop),
        no_stop_trim=rules.no_stop_trim,
        skip_special_tokens=rules.skip_special_tokens,
    )
    req = Req("r", list(prompt), params, seed=0)
    stream = RequestStream(req, tokenizer(), streaming=False)
    matched = None
    for k, token in enumerate(out):
        req.output_ids.append(token)
        if k == len(out) - 1:
            kind, limit = (FinishKind.STOP, token) if stop_token else (FinishKind.LENGTH, k + 1)
            req.finish = FinishReason(kind, limit)
        matched = stream.update()
        if matched is not None:
            if req.finish is None:
                req.finish = FinishReason(FinishKind.STOP, matched)
                stream.update()
            break
    return stream.result()["text"], matched, len(req.output_ids)


def updates(
    prompt: list[int],
    out: list[int],
    sizes: Sequence[int],
    context: int,
    stop_token: bool,
    no_stop_trim: bool = False,
) -> list[Update]:
    """The output in updates of the given sizes (cycled), as the scheduler sends them."""
    result, pos, i = [], 0, 0
    while pos < len(out):
        size = sizes[i % len(sizes)]
        i += 1
        new = out[pos : pos + size]
        last = pos + size >= len(out)
        before = (prompt + out[:pos])[-context:] if context else []
        trim = last and stop_token and not no_stop_trim
        result.append(Update(before, new, pos, last, trim, prompt[-4:]))
        pos += size
    return result


def windowed(
    prompt: list[int],
    out: list[int],
    rules: TextRules,
    stop_token: bool,
    sizes: Sequence[int],
    context: int | None = None,
) -> Outcome:
    """What the request's owner sees: chunk texts up to the first stop."""
    size = detok_context_size(rules.stop) if context is None else context
    text = ""
    for update in updates(prompt, out, sizes, size, stop_token, rules.no_stop_trim):
        result = window_text(tokenizer().decode, rules, update)
        text += result.text
        if result.stop_at is not None:
            return text, result.matched, result.stop_at
    return text, None, len(out)


@st.composite
def outputs(draw: st.DrawFn) -> list[int]:
    """Encoded text, characters split into single-byte tokens, and special tokens."""
    tok = tokenizer()
    ids: list[int] = []
    for kind, piece in draw(
        st.lists(st.tuples(st.sampled_from("tbs"), st.sampled_from(PIECES)), max_size=14)
    ):
        if kind == "t":
            ids += tok.encode(piece)
        elif kind == "b":
            ids += as_bytes(piece)
        else:
            ids.append(draw(st.sampled_from(SPECIALS)))
    return ids


rules_st = st.builds(
    TextRules,
    stop=st.lists(st.sampled_from(STOPS), max_size=3).map(tuple),
    no_stop_trim=st.booleans(),
    skip_special_tokens=st.booleans(),
    min_new_tokens=st.sampled_from([0, 0, 1, 3, 8]),
)
sizes_st = st.lists(st.integers(1, 6), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.sampled_from(PROMPTS),
    out=outputs(),
    rules=rules_st,
    stop_token=st.booleans(),
    sizes=sizes_st,
)
def test_windowed_equals_request_stream(
    prompt: str, out: list[int], rules: TextRules, stop_token: bool, sizes: list[int]
) -> None:
    prompt_ids = tokenizer().encode(prompt)
    out = out + [EOS] if stop_token else out or [EOS]
    expected = reference(prompt_ids, out, rules, stop_token)
    assert windowed(prompt_ids, out, rules, stop_token, sizes) == expected


@settings(max_examples=150, deadline=None)
@given(
    out=st.lists(st.integers(0, 49151), min_size=1, max_size=40),
    rules=rules_st,
    sizes=sizes_st,
)
def test_any_ids_give_the_same_text_however_split(
    out: list[int], rules: TextRules, sizes: list[int]
) -> None:
    tok = tokenizer()
    prompt = tok.encode("Once upon a time")
    one_by_one = windowed(prompt, out, rules, False, [1], context=len(prompt) + len(out))
    assert windowed(prompt, out, rules, False, sizes) == one_by_one
    if not rules.stop:
        skip = rules.skip_special_tokens
        full = tok.decode(prompt + out, skip_special_tokens=skip)
        assert one_by_one[0] == full[len(tok.decode(prompt, skip_special_tokens=skip)) :]


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(st.sampled_from(["😀", "a", "中", "é", "b"]), min_size=1, max_size=12).map(
        "".join
    ),
    stop=st.sampled_from(["😀😀", "a😀中", "中中中", "é😀", "😀b"]),
    sizes=sizes_st,
)
def test_context_size_covers_stops_of_single_byte_tokens(
    text: str, stop: str, sizes: list[int]
) -> None:
    # One byte per token is the most tokens a stop string can span.
    prompt = tokenizer().encode("Go")
    rules = TextRules((stop,))
    out = as_bytes(text)
    assert windowed(prompt, out, rules, False, sizes) == reference(prompt, out, rules, False)


def test_a_shorter_context_misses_a_stop_string() -> None:
    prompt = tokenizer().encode("Go")
    rules = TextRules(("😀😀",))
    out = as_bytes("a😀😀b")
    expected = ("a", "😀😀", 9)
    assert reference(prompt, out, rules, False) == expected
    assert windowed(prompt, out, rules, False, [1]) == expected
    assert windowed(prompt, out, rules, False, [1], context=4) != expected


def test_context_size_grows_with_the_longest_stop_in_bytes() -> None:
    base = detok_context_size([])
    assert base >= 8
    assert detok_context_size(["ab", "abcd"]) == base + 4
    assert detok_context_size(["😀"]) == base + 4


def one(
    rules: TextRules, context: list[int], new: list[int], offset: int, **kw: object
) -> WindowText:
    return window_text(tokenizer().decode, rules, Update(context, new, offset, **kw))


def test_partial_character_waits_for_its_last_byte() -> None:
    prompt = tokenizer().encode("Hi")
    emoji = as_bytes("😀")
    texts = [
        one(TextRules(), prompt + emoji[:k], emoji[k : k + 1], k, finished=False).text
        for k in range(4)
    ]
    assert texts == ["", "", "", "😀"]


def test_finish_releases_an_unfinished_character() -> None:
    prompt = tokenizer().encode("Hi")
    emoji = as_bytes("😀")
    result = one(TextRules(), prompt + emoji[:1], emoji[1:2], 1, finished=True)
    assert result == WindowText("\ufffd")


def test_stop_string_spanning_updates_is_held_then_cut() -> None:
    prompt = tokenizer().encode("Say")
    out = as_bytes(" one END two")
    rules = TextRules(("END",))
    results = [
        one(rules, prompt + out[:start], out[start:end], start, finished=False)
        for start, end in [(0, 6), (6, 7), (7, 10)]
    ]
    assert results == [WindowText(" one "), WindowText(""), WindowText("", 8, "END")]


def test_held_stop_prefix_is_released_when_the_request_finishes() -> None:
    tok = tokenizer()
    prompt = tok.encode("Say")
    rules = TextRules(("ab",))
    out = tok.encode(" xa")
    assert one(rules, prompt, out, 0, finished=False).text == " x"
    assert one(rules, prompt, out, 0, finished=True).text == " xa"


def test_stop_strings_wait_for_min_new_tokens() -> None:
    prompt = tokenizer().encode("Say")
    out = as_bytes("abab")
    found = [
        one(TextRules(("ab",), min_new_tokens=n), prompt, out, 0, finished=False) for n in (0, 1, 3)
    ]
    assert found == [WindowText("", 2, "ab"), WindowText("ab", 4, "ab"), WindowText("abab")]


def test_no_stop_trim_keeps_the_stop_string_and_token() -> None:
    prompt = tokenizer().encode("Say")
    out = as_bytes("xaby")
    kept = one(TextRules(("ab",), no_stop_trim=True), prompt, out, 0, finished=False)
    assert kept == WindowText("xab", 3, "ab")
    eos = [*as_bytes("hi"), EOS]
    shown = TextRules(skip_special_tokens=False, no_stop_trim=True)
    assert one(shown, prompt, eos, 0, finished=True).text == "hi<|im_end|>"
    hidden = TextRules(skip_special_tokens=False)
    assert one(hidden, prompt, eos, 0, finished=True, trim_last=True).text == "hi"


def test_update_after_the_stop_adds_nothing() -> None:
    prompt = tokenizer().encode("Say")
    out = as_bytes("xabyz")
    late = one(TextRules(("ab",)), prompt + out[:4], out[4:], 4, finished=False)
    assert late == WindowText("", 3, "ab")


def test_prompt_tail_stands_in_for_an_empty_context() -> None:
    tok = tokenizer()
    prompt = tok.encode("Hello")
    out = tok.encode(" world")
    with_tail = window_text(tok.decode, TextRules(), Update([], out, 0, True, prompt_tail=prompt))
    assert with_tail.text == " world"
