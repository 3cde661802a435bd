"""Logprobs from the offline Engine on the bundled SmolLM2-135M-Instruct: of the output,
of the prompt from its start or an offset, with alternatives, and the same in chunks."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import (
    GREEDY,
    Result,
    assert_nothing_held,
    one,
)

from radixmesh.api import Engine

LOGPROB_PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog wakes up and"


def logprobs_from(engine: Engine, start: int, max_new_tokens: int = 1, **kw: Any) -> Result:
    """LOGPROB_PROMPT run greedily, with logprobs from prompt position `start` on."""
    return one(
        engine,
        LOGPROB_PROMPT,
        {"max_new_tokens": max_new_tokens, **GREEDY},
        return_logprob=True,
        logprob_start_len=start,
        **kw,
    )


def all_logprobs(engine: Engine) -> Result:
    """LOGPROB_PROMPT with every prompt and output logprob and the top 3 alternatives."""
    return logprobs_from(engine, 0, max_new_tokens=8, top_logprobs_num=3)


@pytest.fixture(scope="module")
def prompt_logprobs(engine: Engine) -> Result:
    return all_logprobs(engine)


def test_output_logprobs(prompt_logprobs: Result) -> None:
    ids = prompt_logprobs["output_ids"]
    meta = prompt_logprobs["meta_info"]
    out = meta["output_token_logprobs"]
    assert len(ids) == 8 and len(out) == 8
    assert [t for _, t, _ in out] == ids
    assert all(text is None for _, _, text in out)
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in out)
    tops = meta["output_top_logprobs"]
    assert len(tops) == 8
    for (lp, token, _), top in zip(out, tops, strict=True):
        assert len(top) == 3
        values = [v for v, _, _ in top]
        assert values == sorted(values, reverse=True)
        assert len({t for _, t, _ in top}) == 3
        # greedy: the chosen token is the most likely one
        assert top[0][1] == token
        assert lp == pytest.approx(max(values), abs=1e-6)


def test_input_logprobs_from_the_start(engine: Engine, prompt_logprobs: Result) -> None:
    prompt_ids = engine.tokenizer.encode(LOGPROB_PROMPT)
    meta = prompt_logprobs["meta_info"]
    assert meta["prompt_tokens"] == len(prompt_ids) >= 12
    assert meta["cached_tokens"] == 0  # logprobs from position 0 need the whole prompt
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(prompt_ids)
    assert [t for _, t, _ in entries] == prompt_ids
    assert entries[0][0] is None  # nothing predicts the first token
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in entries[1:])
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(prompt_ids) and tops[0] is None
    for (lp, token, _), top in zip(entries[1:], tops[1:], strict=True):
        assert len(top) == 3
        assert lp <= top[0][0] + 1e-6
        for v, t, _ in top:
            if t == token:
                assert lp == pytest.approx(v, abs=1e-6)


def test_input_logprobs_from_an_offset(engine: Engine, prompt_logprobs: Result) -> None:
    full = prompt_logprobs["meta_info"]["input_token_logprobs"]
    n = len(full)
    for k in (1, 5, n - 1):
        out = logprobs_from(engine, k)
        meta = out["meta_info"]
        # the prompt is cached, but position k's logprob needs position k-1 computed
        assert meta["cached_tokens"] == max(k - 1, 0)
        entries = meta["input_token_logprobs"]
        assert len(entries) == meta["prompt_tokens"] - k
        assert [t for _, t, _ in entries] == [t for _, t, _ in full[k:]]
        assert [lp for lp, _, _ in entries] == pytest.approx(
            [lp for lp, _, _ in full[k:]], abs=1e-3
        )
        assert "input_top_logprobs" not in meta
        assert out["output_ids"] == prompt_logprobs["output_ids"][:1]
    # as every front door of the mesh refuses it
    with pytest.raises(ValueError, match=rf"logprob_start_len \({n}\) must be less than"):
        logprobs_from(engine, n)


def test_chunked_prefill_changes_nothing(chunked: Engine, prompt_logprobs: Result) -> None:
    full = prompt_logprobs["meta_info"]["input_token_logprobs"]
    # start inside the third chunk, before anything is cached
    mid = logprobs_from(chunked, 9)
    entries = mid["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in entries] == [t for _, t, _ in full[9:]]
    assert [lp for lp, _, _ in entries] == pytest.approx([lp for lp, _, _ in full[9:]], abs=1e-3)

    out = all_logprobs(chunked)
    meta, ref = out["meta_info"], prompt_logprobs["meta_info"]
    assert out["output_ids"] == prompt_logprobs["output_ids"]
    assert out["text"] == prompt_logprobs["text"]
    got = meta["input_token_logprobs"]
    assert len(got) == len(full) and got[0][0] is None
    assert [t for _, t, _ in got] == [t for _, t, _ in full]
    # every 4th prompt token is predicted from the previous chunk's last position
    assert [lp for lp, _, _ in got[1:]] == pytest.approx([lp for lp, _, _ in full[1:]], abs=1e-3)
    assert [[t for _, t, _ in top] for top in meta["input_top_logprobs"][1:]] == [
        [t for _, t, _ in top] for top in ref["input_top_logprobs"][1:]
    ]
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in ref["output_token_logprobs"]], abs=1e-3
    )
    assert_nothing_held(chunked)
