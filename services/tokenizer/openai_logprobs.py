"""Logprobs in OpenAI's two shapes: the legacy completion one and the chat one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.generation import TokenLogprob

# OpenAI's stand-in for a logprob JSON cannot carry (-inf).
_FLOOR = -9999.0


def _finite(logprob: float | None) -> float:
    return logprob if logprob is not None and math.isfinite(logprob) else _FLOOR


def token_text(tokenizer: Tokenizer, entry: TokenLogprob) -> str:
    """The text of a logprob entry's token, special tokens included."""
    _, token_id, text = entry
    return text if text is not None else tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer,
    tokens: Sequence[TokenLogprob],
    tops: Sequence[Sequence[TokenLogprob] | None],
    offset: int,
) -> dict[str, list[Any]]:
    """The completion shape, with text offsets counted from `offset`."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for k, entry in enumerate(tokens):
        text = token_text(tokenizer, entry)
        # A prompt's first token has no logprob, nor alternatives.
        logprob = None if entry[0] is None else _finite(entry[0])
        top: dict[str, float] | None = None
        if logprob is not None:
            alternatives = (tops[k] if k < len(tops) else None) or ()
            top = {token_text(tokenizer, alt): _finite(alt[0]) for alt in alternatives}
            # OpenAI always lists the sampled token among the alternatives.
            top.setdefault(text, logprob)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def join_completion_logprobs(
    first: dict[str, list[Any]], second: dict[str, list[Any]]
) -> dict[str, list[Any]]:
    """Two completion-shape logprobs one after the other (an echoed prompt, then the output)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(
    tokenizer: Tokenizer,
    tokens: Sequence[TokenLogprob],
    tops: Sequence[Sequence[TokenLogprob]],
) -> list[dict[str, Any]]:
    """The chat shape: one entry per token with its bytes and its top alternatives."""
    content = []
    for k, entry in enumerate(tokens):
        alternatives = tops[k] if k < len(tops) else ()
        content.append(
            {
                **_chat_token(tokenizer, entry),
                "top_logprobs": [_chat_token(tokenizer, alt) for alt in alternatives],
            }
        )
    return content


def _chat_token(tokenizer: Tokenizer, entry: TokenLogprob) -> dict[str, Any]:
    text = token_text(tokenizer, entry)
    return {"token": text, "logprob": _finite(entry[0]), "bytes": list(text.encode("utf-8"))}
