"""The body of SGLang's POST /generate, read into typed items: one per prompt.

Every problem raises ValueError with a message naming the field. Fields SGLang knows but
this server does not implement are accepted only with a value that changes nothing."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _empty(value: object) -> bool:
    return value is None or value in ("", [], {}, False)


# Top-level fields SGLang clients may send, and the values that ask for nothing.
_NEUTRAL_FIELDS: dict[str, Callable[[Any], bool]] = {
    "lora_path": _empty,
    "image_data": _empty,
    "video_data": _empty,
    "audio_data": _empty,
    "modalities": _empty,
    "input_embeds": _empty,
    "session_params": _empty,
    "custom_logit_processor": _empty,
    "return_hidden_states": _empty,
    "token_ids_logprob": _empty,
    "bootstrap_host": _empty,
    "bootstrap_port": _empty,
    "bootstrap_room": _empty,
    "data_parallel_rank": _empty,
    "log_metrics": lambda v: isinstance(v, bool),
}
# Sampling parameters of SGLang without an effect here (byte-level BPE tokenizers put no
# spaces between special tokens), or not implemented: only their neutral values pass.
_NEUTRAL_SAMPLING: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v is None or v == 1,
    "spaces_between_special_tokens": lambda v: v is None or isinstance(v, bool),
    "regex": _empty,
    "json_schema": _empty,
    "ebnf": _empty,
    "structural_tag": _empty,
    "stop_regex": _empty,
    "logit_bias": _empty,
    "custom_params": _empty,
}
_PER_ITEM = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
             "rid", "cache_salt", "priority")
_FIELDS = {"text", "input_ids", "stream", "return_text_in_logprobs", *_PER_ITEM}


@dataclass(frozen=True)
class NativeItem:
    """One prompt of a /generate call, not yet tokenized or checked against the model."""

    text: str | None
    input_ids: list[int] | None
    sampling: dict[str, Any]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    rid: str
    cache_salt: str | None
    priority: int


@dataclass(frozen=True)
class NativeRequest:
    """A whole /generate call: one prompt or a batch of them."""

    items: list[NativeItem]
    batch: bool
    stream: bool
    return_text_in_logprobs: bool


def parse_generate(body: Any) -> NativeRequest:
    """Read a decoded JSON body; raises ValueError naming the first bad field."""
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in _FIELDS:
            continue
        neutral = _NEUTRAL_FIELDS.get(key)
        if neutral is None:
            raise ValueError(f"unknown field {key!r}")
        if not neutral(value):
            raise ValueError(f"{key} is not supported by this server")
    prompts, batch = _prompts(body.get("text"), body.get("input_ids"))
    n = len(prompts)
    per_item = {key: _spread(body, key, n, batch) for key in _PER_ITEM}
    items = []
    for i, (text, ids) in enumerate(prompts):
        raw = {key: values[i] for key, values in per_item.items()}
        items.append(
            NativeItem(
                text=text,
                input_ids=ids,
                sampling=_sampling(raw["sampling_params"]),
                return_logprob=_bool(raw["return_logprob"], "return_logprob"),
                logprob_start_len=_int(raw["logprob_start_len"], "logprob_start_len", -1),
                top_logprobs_num=_int(raw["top_logprobs_num"], "top_logprobs_num", 0),
                rid=_str(raw["rid"], "rid") or uuid.uuid4().hex,
                cache_salt=_str(raw["cache_salt"], "cache_salt"),
                priority=_int(raw["priority"], "priority", 0),
            )
        )
    rids = [item.rid for item in items]
    if len(set(rids)) != len(rids):
        raise ValueError("rid: the ids of a batch must differ")
    return NativeRequest(
        items=items,
        batch=batch,
        stream=_bool(body.get("stream"), "stream"),
        return_text_in_logprobs=_bool(body.get("return_text_in_logprobs"),
                                      "return_text_in_logprobs"),
    )


def _prompts(text: Any, input_ids: Any) -> tuple[list[tuple[str | None, list[int] | None]], bool]:
    """[(text, ids)] per prompt, and whether the call was a batch."""
    if text is not None and input_ids is not None:
        raise ValueError("give either text or input_ids, not both")
    if text is not None:
        if isinstance(text, str):
            return [(text, None)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [(t, None) for t in text], True
        raise ValueError("text must be a string or a non-empty list of strings")
    if input_ids is not None:
        if isinstance(input_ids, list) and input_ids and all(
            isinstance(ids, list) for ids in input_ids
        ):
            return [(None, _ids(ids)) for ids in input_ids], True
        return [(None, _ids(input_ids))], False
    raise ValueError("text or input_ids is required")


def _ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise ValueError("input_ids must be a list of integers or a non-empty list of such lists")
    return value


def _spread(body: dict[str, Any], key: str, n: int, batch: bool) -> list[Any]:
    """A per-prompt field: one value for all prompts, or (in a batch) one per prompt."""
    value = body.get(key)
    # A list of values per prompt; stop lists and the like live inside sampling_params.
    if batch and isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{key} has {len(value)} entries for {n} prompts")
        return value
    if batch and key == "rid" and value is not None:
        raise ValueError("rid must be a list with one id per prompt in a batch")
    return [value] * n


def _sampling(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"sampling_params must be an object, got {type(value).__name__}")
    out = {}
    for key, item in value.items():
        neutral = _NEUTRAL_SAMPLING.get(key)
        if neutral is not None:
            if not neutral(item):
                raise ValueError(f"sampling_params.{key} is not supported by this server")
        elif item is not None:  # null means the default, as SGLang's clients send it
            out[key] = item
    return out


def _bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    return value


def _int(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not -(2**31) <= value < 2**31:
        raise ValueError(f"{name} must fit in 32 bits, got {value}")
    return value


def _str(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value or None
