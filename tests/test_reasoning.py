"""Reasoning parsers on the texts each model writes, whole and streamed in every split."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixmesh.core.harmony import HarmonyReader, marker_tail, read_header
from radixmesh.core.reasoning import (
    REASONING_PARSERS,
    THINK_TAG_PARSERS,
    ReasoningParser,
    check_kind,
    reasoning_parser,
    thinking_enabled,
)

# Qwen3 writes `<think>` itself; the others are prompted with the block already open.
QWEN3_TEXTS = {
    "<think>\nLet me add.\n</think>\n\nThe sum is 4.": ("Let me add.", "The sum is 4."),
    "<think>2+2</think>4": ("2+2", "4"),
    "The sum is 4.": (None, "The sum is 4."),
    "  Just an answer.\n": (None, "  Just an answer.\n"),
    "<think>\nFirst, 2+2 is": ("First, 2+2 is", ""),
    "<think>\n\n</think>\n\nHi": (None, "Hi"),
    "<think></think>Hi": (None, "Hi"),
    "<think>is x < y? </b> <thi</think>\nyes: a </ b < c": (
        "is x < y? </b> <thi",
        "yes: a </ b < c",
    ),
    "Use <b> or </think> in HTML.": (None, "Use <b> or </think> in HTML."),
    "<thinking about it": (None, "<thinking about it"),
    "<thi": (None, "<thi"),
    "\n<think>a</think>b": ("a", "b"),
    "": (None, ""),
}
R1_TEXTS = {
    "Let me add.\n</think>\n\nThe sum is 4.": ("Let me add.", "The sum is 4."),
    "<think>\nLet me add.\n</think>\n\nThe sum is 4.": ("Let me add.", "The sum is 4."),
    "\nOkay, so 2+2 is": ("Okay, so 2+2 is", ""),
    "<think>\nOkay, so": ("Okay, so", ""),
    "</think>The sum is 4.": (None, "The sum is 4."),
    "<think>\n\n</think>\n\nHi": (None, "Hi"),
    "x < y and </b> </thi": ("x < y and </b> </thi", ""),
    "a <b></think>c </ d": ("a <b>", "c </ d"),
    "<thi": ("<thi", ""),
    "": (None, ""),
}
CASES = [(kind, text, want) for kind in ("qwen3",) for text, want in QWEN3_TEXTS.items()] + [
    (kind, text, want)
    for kind in ("deepseek-r1", "qwen3-thinking", "deepseek-v3")
    for text, want in R1_TEXTS.items()
]
ALL_TEXTS = [*QWEN3_TEXTS, *R1_TEXTS]


def stream(kind: str, chunks: list[str], thinking: bool = True) -> tuple[str, str]:
    parser = reasoning_parser(kind, thinking)
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def expected_stream(kind: str, text: str, thinking: bool = True) -> tuple[str, str]:
    reasoning, content = reasoning_parser(kind, thinking).parse(text)
    return reasoning or "", content


@pytest.mark.parametrize(("kind", "text", "want"), CASES)
def test_parse(kind, text, want):
    assert ReasoningParser(kind).parse(text) == want


@pytest.mark.parametrize("kind", THINK_TAG_PARSERS)
@pytest.mark.parametrize("text", ALL_TEXTS)
def test_thinking_off_is_all_content(kind, text):
    parser = ReasoningParser(kind, thinking=False)
    assert parser.parse(text) == (None, text)
    assert not parser.in_reasoning_at_start
    assert stream(kind, [text], thinking=False) == ("", text)


@pytest.mark.parametrize("kind", THINK_TAG_PARSERS)
@pytest.mark.parametrize("text", ALL_TEXTS)
def test_stream_matches_parse_at_every_split(kind, text):
    want = expected_stream(kind, text)
    for cut in range(len(text) + 1):
        assert stream(kind, [text[:cut], text[cut:]]) == want, cut
    assert stream(kind, list(text)) == want


def test_partial_tags_are_held_and_the_rest_sent_at_once():
    parser = ReasoningParser("qwen3")
    assert parser.feed("<thi").reasoning == ""
    assert parser.feed("nk>\nStep one").reasoning == "Step one"
    assert parser.feed(" then </thi").reasoning == " then"
    assert parser.feed("s and x<y").reasoning == " </this and x<y"
    assert parser.feed("</think>\n\nDone").content == "Done"
    assert parser.feed(" </thi").content == " </thi"
    assert parser.finish().content == ""


def test_answer_without_reasoning_streams_unchanged():
    parser = ReasoningParser("qwen3")
    assert parser.feed("Hello").content == "Hello"
    assert parser.feed(" <think>").content == " <think>"


def test_deepseek_r1_cut_off_is_all_reasoning():
    parser = ReasoningParser("deepseek-r1")
    assert parser.feed("Okay, 2+2 </th").reasoning == "Okay, 2+2"
    assert parser.finish().reasoning == " </th"


FRAGMENTS = ["<think>", "</think>", "<", "</", "<thi", "</thi", ">", "\n", " ", "a", "b c", "x<y"]


@given(
    kind=st.sampled_from(THINK_TAG_PARSERS),
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=6),
)
def test_stream_matches_parse_for_any_chunking(kind, pieces, cuts):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert stream(kind, chunks) == expected_stream(kind, text)


def test_tags():
    for kind in THINK_TAG_PARSERS:
        assert ReasoningParser(kind).end_tag == "</think>"
    assert not ReasoningParser("qwen3").in_reasoning_at_start
    assert ReasoningParser("deepseek-r1").in_reasoning_at_start
    assert ReasoningParser("qwen3-thinking").in_reasoning_at_start
    assert ReasoningParser("deepseek-v3").in_reasoning_at_start


def test_unknown_kind():
    with pytest.raises(ValueError, match="qwen3"):
        check_kind("qwen")
    with pytest.raises(ValueError, match="deepseek-r1"):
        ReasoningParser("deepseek")
    with pytest.raises(ValueError, match="unknown.*gpt-oss"):
        thinking_enabled("harmony", {})
    with pytest.raises(ValueError, match="not a reasoning parser of <think> blocks"):
        ReasoningParser("gpt-oss")


# ---- gpt-oss: harmony messages ---------------------------------------------------------------

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
TO_WEATHER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
# (answer as the model writes it, (reasoning, content)); the content keeps a tool call's
# message as harmony text, for the gpt-oss tool-call parser.
HARMONY_TEXTS = {
    f"{ANALYSIS}Two plus two.<|end|>{FINAL}It is 4.": ("Two plus two.", "It is 4."),
    f"{ANALYSIS}Two plus two.<|end|>{FINAL}It is 4.<|return|>": ("Two plus two.", "It is 4."),
    f"{ANALYSIS}Need the weather.<|end|><|start|>assistant{TO_WEATHER}"
    '{"city": "Paris"}<|call|>': (
        "Need the weather.", f'{TO_WEATHER}{{"city": "Paris"}}<|call|>'),
    # The recipient may come before the channel; the header is written back in one form.
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{}': (
        None, f"{TO_WEATHER}{{}}<|call|>"),
    # Commentary for the user is content; messages of one kind are a blank line apart.
    f"{ANALYSIS}a<|end|><|start|>assistant<|channel|>commentary<|message|>Looking it up."
    f"<|end|>{ANALYSIS}b<|end|>{FINAL}Done.": ("a\n\nb", "Looking it up.\n\nDone."),
    f"{ANALYSIS}x < y <| and <|end of it": ("x < y <| and <|end of it", ""),
    f"{ANALYSIS}cut inside <|en": ("cut inside <|en", ""),
    "A model that ignores the format.": (None, "A model that ignores the format."),
    "<|channel|>final but no message marker": (None, "<|channel|>final but no message marker"),
    f"{ANALYSIS}<|end|>{FINAL}": (None, ""),
    "": (None, ""),
}


@pytest.mark.parametrize(("text", "want"), HARMONY_TEXTS.items())
def test_harmony_parse(text, want):
    assert reasoning_parser("gpt-oss").parse(text) == want


@pytest.mark.parametrize("text", HARMONY_TEXTS)
def test_harmony_stream_matches_parse_at_every_split(text):
    want = expected_stream("gpt-oss", text)
    for cut in range(len(text) + 1):
        assert stream("gpt-oss", [text[:cut], text[cut:]]) == want, cut
    assert stream("gpt-oss", list(text)) == want


HARMONY_FRAGMENTS = ["<|channel|>", "analysis", "final", "<|message|>", "<|end|>", "<|start|>",
                     "assistant", "<|", "<|e", " ", "a", "x<y", "to=functions.f", "<|call|>"]


@given(pieces=st.lists(st.sampled_from(HARMONY_FRAGMENTS), max_size=14),
       cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=6))
def test_harmony_stream_matches_parse_for_any_chunking(pieces, cuts):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert stream("gpt-oss", chunks) == expected_stream("gpt-oss", text)


def test_harmony_reasoning_streams_as_it_arrives():
    parser = reasoning_parser("gpt-oss")
    assert parser.feed("<|channel|>analy").reasoning == ""
    assert parser.feed("sis<|message|>Step one <|").reasoning == "Step one "
    assert parser.feed("end|><|start|>assistant<|channel|>final<|message|>Hi").content == "Hi"
    assert parser.finish() == parser.feed("")
    assert thinking_enabled("gpt-oss", {}) and not parser.in_reasoning_at_start


def test_harmony_headers_and_markers():
    assert read_header("<|start|>assistant<|channel|>commentary to=functions.f "
                       "<|constrain|>json").function == "f"
    header = read_header("<|channel|>commentary to=browser.search json")
    assert (header.channel, header.recipient, header.content_type, header.function) == (
        "commentary", "browser.search", "json", None)
    assert read_header("<|channel|>final").render() == "<|channel|>final<|message|>"
    assert [marker_tail(t) for t in ("ab<", "ab<|", "ab<|st", "ab<|x", "<|end|>", "a<")] == [
        1, 2, 4, 0, 0, 1]
    reader = HarmonyReader()
    pieces = reader.feed(f"{ANALYSIS}a<|end|>{FINAL}b") + reader.finish()
    assert [(p.index, p.header.channel, p.text, p.opens, p.closes) for p in pieces] == [
        (0, "analysis", "", True, False), (0, "analysis", "a", False, True),
        (1, "final", "", True, False), (1, "final", "b", False, False),
        (1, "final", "", False, True)]
    for kind in REASONING_PARSERS:
        check_kind(kind)


@pytest.mark.parametrize(
    ("kind", "kwargs", "want"),
    [
        ("qwen3", {}, True),
        ("qwen3", {"enable_thinking": True}, True),
        ("qwen3", {"enable_thinking": False}, False),
        ("qwen3", {"thinking": False}, True),
        ("qwen3-thinking", {"enable_thinking": False}, True),
        ("deepseek-r1", {}, True),
        ("deepseek-r1", {"thinking": False, "enable_thinking": False}, True),
        ("deepseek-v3", {}, False),
        ("deepseek-v3", {"thinking": True}, True),
        ("deepseek-v3", {"thinking": False}, False),
        ("deepseek-v3", {"enable_thinking": True}, False),
    ],
)
def test_thinking_enabled(kind, kwargs, want):
    assert thinking_enabled(kind, kwargs) is want
