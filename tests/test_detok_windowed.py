"""Windowed detokenization, as a replica that sees each update alone and in process,
against the text of whole-request decodes, real tokenizer."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from radixmesh.core.detokenize import (
    MAX_PENDING_TOKENS,
    RequestText,
    TextRules,
    Update,
    WindowText,
    detok_context_size,
    window_text,
)
from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.tokenizer import Tokenizer, _bytes_to_unicode
from radixmesh.engine.request import Req
from radixmesh.request_output import RequestStream

EOS = 2  # <|im_end|>, the stop token
SPECIALS = range(17)
PROMPTS = ["Hi", "Say something: ", "你好", "x😀", "Write a poem", "<|im_start|>assistant\n"]
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


class WholeText:
    """A request's text as the detokenize module specifies it, from decodes of the whole
    request up to each output token: no window, nothing carried from one token to the next.

    `released[k]` is the text released once k output tokens exist, `released[n + 1]` at the
    finish of n; a stop string cuts the list at the first boundary that completes one.
    """

    def __init__(
        self, prompt: list[int], out: list[int], rules: TextRules, stop_token: bool
    ) -> None:
        tok = tokenizer()
        skip = rules.skip_special_tokens
        # Like SGLang, a matched stop token is counted but shown without text.
        shown = out[:-1] if stop_token and not rules.no_stop_trim else out
        spaced = rules.spaces_between_special_tokens
        decoded = [
            tok.decode(prompt + shown[:k], skip_special_tokens=skip,
                       spaces_between_special_tokens=spaced)
            for k in range(len(shown) + 1)
        ]
        prompt_chars = len(decoded[0])

        def whole(k: int) -> str:
            """Up to the last boundary, at most MAX_PENDING_TOKENS back, that ends whole."""
            for j in range(k, max(k - MAX_PENDING_TOKENS, 0) - 1, -1):
                if not decoded[j].endswith("\ufffd"):
                    return decoded[j][prompt_chars:]
            return decoded[k][prompt_chars:-1]

        texts = [whole(k) for k in range(len(shown) + 1)] + [decoded[-1][prompt_chars:]]
        stops = [s for s in rules.stop if s]
        self.released: list[str] = []
        self.matched: str | None = None
        self.completion = len(out)
        for k, text in enumerate(texts):
            # Stop strings count only in text that tokens past min_new_tokens release.
            armed = len(texts[min(k, rules.min_new_tokens, len(shown))])
            counted = text[armed:]
            hits = [(counted.find(s), -len(s), s) for s in stops if s in counted]
            if hits:
                start, _, self.matched = min(hits)
                end = start + len(self.matched) if rules.no_stop_trim else start
                self.released.append(text[: armed + end])
                self.completion = min(k, len(out))
                return
            finish = k > len(shown)
            held = 0 if finish else max(
                (n for n in range(1, len(counted) + 1)
                 if any(len(s) > n and s.startswith(counted[-n:]) for s in stops)),
                default=0,
            )  # fmt: skip
            self.released.append(text[: len(text) - held])

    @property
    def outcome(self) -> Outcome:
        return self.released[-1], self.matched, self.completion

    def added(self, start: int, end: int, finished: bool) -> str:
        """The text that output tokens start..end add, the finish too if `finished`."""
        last = len(self.released) - 1 if finished else min(end, len(self.released) - 1)
        return self.released[last][len(self.released[min(start, last)]) :]


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
    expected: WholeText | None = None,
) -> Outcome:
    """What the request's owner sees from replicas that see each update alone: chunk texts
    up to the first stop, each checked against `expected` if given; the same from the ids'
    own texts where they can be (Tokenizer.pieces)."""
    size = detok_context_size(rules.stop) if context is None else context
    text = ""
    for update in updates(prompt, out, sizes, size, stop_token, rules.no_stop_trim):
        result = window_text(tokenizer().decode, rules, update)
        assert window_text(tokenizer().decode, rules, update, tokenizer().pieces) == result
        if expected is not None:
            end = update.offset + len(update.new)
            assert result.text == expected.added(update.offset, end, update.finished)
        text += result.text
        if result.stop_at is not None:
            return text, result.matched, result.stop_at
    return text, None, len(out)


def in_process(
    prompt: list[int],
    out: list[int],
    rules: TextRules,
    stop_token: bool,
    sizes: Sequence[int] = (1,),
    expected: WholeText | None = None,
    streaming: bool = True,
) -> Outcome:
    """The in-process engine's stream, fed the given numbers of tokens (cycled) per step and
    stopped as the engine stops it; each step's text checked against `expected` if given
    (not streaming, a stream without stop strings decodes only at the finish)."""
    params = SamplingParams(
        max_new_tokens=max(len(out), rules.min_new_tokens),
        min_new_tokens=rules.min_new_tokens,
        stop=list(rules.stop),
        no_stop_trim=rules.no_stop_trim,
        skip_special_tokens=rules.skip_special_tokens,
        spaces_between_special_tokens=rules.spaces_between_special_tokens,
    )
    req = Req("r", list(prompt), params, seed=0)
    stream = RequestStream(req, tokenizer(), streaming=streaming)
    matched, step = None, 0
    while len(req.output_ids) < len(out):
        start = len(req.output_ids)
        req.output_ids += out[start : start + sizes[step % len(sizes)]]
        step += 1
        end = len(req.output_ids)
        if end == len(out):
            kind, limit = (FinishKind.STOP, out[-1]) if stop_token else (FinishKind.LENGTH, end)
            req.finish = FinishReason(kind, limit)
        before = stream.text
        matched = stream.update()
        if expected is not None:
            added = expected.added(start, end, req.finish is not None)
            assert stream.text[len(before) :] == added
        if matched is not None:
            if req.finish is None:
                req.finish = FinishReason(FinishKind.STOP, matched)
                stream.update()
            break
    return stream.result()["text"], matched, len(req.output_ids)


def step_end(tokens: int, sizes: Sequence[int], total: int) -> int:
    """Output tokens at the end of the step, of the given sizes (cycled) in an output of
    `total`, that holds the `tokens`-th: the engine counts all of a step's tokens, the
    stop string's too."""
    end, step = 0, 0
    while end < tokens:
        end += sizes[step % len(sizes)]
        step += 1
    return min(end, total)


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
    min_new_tokens=st.sampled_from([0, 0, 1, 3, 8, 12]),
    spaces_between_special_tokens=st.booleans(),
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
def test_replicas_and_the_engine_give_the_whole_text(
    prompt: str, out: list[int], rules: TextRules, stop_token: bool, sizes: list[int]
) -> None:
    ids = tokenizer().encode(prompt)
    out = out + [EOS] if stop_token else out or [EOS]
    expected = WholeText(ids, out, rules, stop_token)
    assert windowed(ids, out, rules, stop_token, sizes, expected=expected) == expected.outcome
    assert in_process(ids, out, rules, stop_token, expected=expected) == expected.outcome
    text, matched, completion = in_process(ids, out, rules, stop_token, sizes, expected=expected)
    assert (text, matched) == expected.outcome[:2]
    whole = in_process(ids, out, rules, stop_token, sizes, streaming=False)
    assert whole[:2] == expected.outcome[:2]
    assert completion == step_end(expected.completion, sizes, len(out))


@settings(max_examples=150, deadline=None)
@given(
    out=st.lists(st.integers(0, 49151), min_size=1, max_size=40),
    rules=rules_st,
    sizes=sizes_st,
)
# A replacement character pending when min_new_tokens is reached after a run of skipped
# special tokens: the engine's window must reach back past them all.
@example(out=[0, 0, 0, 0, 0, 0, 111, 0, 0], rules=TextRules(min_new_tokens=3), sizes=[1])
def test_any_ids_give_the_same_text_however_split(
    out: list[int], rules: TextRules, sizes: list[int]
) -> None:
    tok = tokenizer()
    prompt = tok.encode("Once upon a time")
    expected = WholeText(prompt, out, rules, False)
    one_by_one = windowed(prompt, out, rules, False, [1], context=len(prompt) + len(out))
    assert one_by_one == expected.outcome
    assert windowed(prompt, out, rules, False, sizes, expected=expected) == expected.outcome
    text, matched, completion = in_process(prompt, out, rules, False, sizes, expected=expected)
    assert (text, matched) == expected.outcome[:2]
    assert completion == step_end(expected.completion, sizes, len(out))
    if not rules.stop:
        flags = {"skip_special_tokens": rules.skip_special_tokens,
                 "spaces_between_special_tokens": rules.spaces_between_special_tokens}
        full = tok.decode(prompt + out, **flags)
        assert one_by_one[0] == full[len(tok.decode(prompt, **flags)) :]


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
    expected = WholeText(prompt, out, rules, False)
    assert windowed(prompt, out, rules, False, sizes, expected=expected) == expected.outcome
    assert in_process(prompt, out, rules, False, expected=expected) == expected.outcome


def test_a_shorter_context_misses_a_stop_string() -> None:
    prompt = tokenizer().encode("Go")
    rules = TextRules(("😀😀",))
    out = as_bytes("a😀😀b")
    expected = ("a", "😀😀", 9)
    assert WholeText(prompt, out, rules, False).outcome == expected
    assert windowed(prompt, out, rules, False, [1]) == expected
    assert in_process(prompt, out, rules, False) == expected
    assert windowed(prompt, out, rules, False, [1], context=4) != expected


@pytest.mark.parametrize("stop", ["ab", "ba", "bab"])
@pytest.mark.parametrize("min_new_tokens", range(0, 26, 3))
def test_stop_strings_armed_anywhere_in_a_long_output(stop: str, min_new_tokens: int) -> None:
    # Stop strings before min_new_tokens do not count, whichever window the engine has
    # when that boundary passes.
    prompt = tokenizer().encode("Go")
    out = as_bytes("ab" * 14)
    rules = TextRules((stop,), min_new_tokens=min_new_tokens)
    expected = WholeText(prompt, out, rules, False)
    assert expected.matched == stop
    assert windowed(prompt, out, rules, False, [1], expected=expected) == expected.outcome
    assert in_process(prompt, out, rules, False, expected=expected) == expected.outcome


def test_in_process_windows_stay_short() -> None:
    # The engine decodes about once per token, and a few ids, not detok_context_size of
    # them: the ids pending, 4 before them to resynchronize UTF-8, and what the window has
    # grown by since it began.
    tok = tokenizer()
    lengths: list[int] = []

    def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        lengths.append(len(ids))
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    out = tok.encode("Plain text, some 中文 and 😀 in it, and more plain text. " * 20)
    text = RequestText(decode, TextRules(), tok.encode("Hi"), tok.special_ids)
    streamed = "".join(text.update([token], finished=False).text for token in out)
    assert streamed == tok.decode(out)
    assert max(lengths) <= 16 < detok_context_size([])
    assert len(lengths) < 1.2 * len(out)


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
    assert one(shown, prompt, eos, 0, finished=True).text == "hi <|im_end|>"
    unspaced = TextRules(skip_special_tokens=False, no_stop_trim=True,
                         spaces_between_special_tokens=False)
    assert one(unspaced, prompt, eos, 0, finished=True).text == "hi<|im_end|>"
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


@pytest.mark.parametrize(("stop", "sizes"), [([], [1, 3, 3, 3, 2]), (["zzz"], [1] * 12)])
def test_a_stream_with_an_interval_chunks_every_interval_tokens(stop: list[str],
                                                                 sizes: list[int]) -> None:
    """Engine(stream_interval=3): a stream's first token at once, then a chunk every third,
    and the finish; every token where stop strings are looked for. The text is the same."""
    tok = tokenizer()
    out = tok.encode(" Hello world, caf\u00e9 \U0001f600 and the rest of it all, once more")[:12]
    assert len(out) == 12
    req = Req("r", tok.encode("Say:"), SamplingParams(max_new_tokens=12, stop=stop), seed=0)
    stream = RequestStream(req, tok, streaming=True, interval=3)
    for token in out:
        req.output_ids.append(token)
        if len(req.output_ids) == len(out):
            req.finish = FinishReason(FinishKind.LENGTH, len(out))
        assert stream.update() is None
    chunks = list(stream.chunks())
    assert [len(c["output_ids"]) for c in chunks] == sizes
    assert "".join(c["text"] for c in chunks) == tok.decode(out) == stream.result()["text"]
