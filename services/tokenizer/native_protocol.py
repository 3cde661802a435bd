"""SGLang's native /generate body and answer: the body read into one GeneratePrompt per
prompt (fields SGLang knows but this server does not implement are accepted only with a
value that changes nothing; one this server names otherwise, by either name), and each
prompt's answer built up from its GenerationChunks.
Like SGLang, every answer (and every streamed event) carries the text and output ids so
far, not just the new part; its clients slice off what they already have."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixmesh.core.meta_info import (
    CachedTokens,
    LogprobLists,
    Speculated,
    TokenLogprob,
    TokenText,
    meta_info,
)
from radixmesh.core.request import (
    is_int,
)
from radixmesh.services.tokenizer.generation import (
    GenerationChunk,
)

# ---- the /generate body ----------------------------------------------------------------------


def _empty(value: object) -> bool:
    return value is None or value in ("", [], {}, False)


# Top-level fields SGLang clients may send, and the values that ask for nothing.
_NEUTRAL_FIELDS: dict[str, Callable[[Any], bool]] = {
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
    "lora_id": _empty,
    "bootstrap_pair_key": _empty,
    "validation_time": _empty,
    "background": _empty,
    "conversation_id": _empty,
    "no_logs": _empty,
    "custom_labels": _empty,
    "return_bytes": _empty,
    "return_entropy": _empty,
}
# Top-level fields SGLang names otherwise: its name -> ours.
_ALIASES = {"extra_key": "cache_salt"}
# Sampling parameters of SGLang not implemented here: only their neutral values pass.
_NEUTRAL_SAMPLING: dict[str, Callable[[Any], bool]] = {
    "stop_regex": _empty,
    "custom_params": _empty,
}
MAX_N = 128  # samples per prompt (sampling_params.n), as the OpenAI routes allow
_PER_ITEM = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
             "rid", "cache_salt", "priority", "lora_path")
_FIELDS = {"text", "input_ids", "stream", "return_text_in_logprobs", *_PER_ITEM}


@dataclass(frozen=True)
class GeneratePrompt:
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
    lora_path: str | None = None  # the LoRA adapter it runs with


@dataclass(frozen=True)
class GenerateCall:
    """A whole /generate call: one prompt or a batch of them."""

    items: list[GeneratePrompt]
    batch: bool
    stream: bool
    return_text_in_logprobs: bool
    n: int = 1  # samples of each prompt

    @property
    def listed(self) -> bool:
        """Whether the answer is a list (and stream events carry an index): a batch, or
        n samples of one prompt, as SGLang answers."""
        return self.batch or self.n > 1


def parse_generate(body: Any) -> GenerateCall:
    """Read a decoded JSON body; raises ValueError naming the first bad field."""
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
    body = _unaliased(body)
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
    samples = set()
    for i, (text, ids) in enumerate(prompts):
        raw = {key: values[i] for key, values in per_item.items()}
        sampling = _sampling(raw["sampling_params"])
        samples.add(_n(sampling.pop("n", None)))
        items.append(
            GeneratePrompt(
                text=text,
                input_ids=ids,
                sampling=sampling,
                return_logprob=_bool(raw["return_logprob"], "return_logprob"),
                logprob_start_len=_int(raw["logprob_start_len"], "logprob_start_len", -1),
                top_logprobs_num=_int(raw["top_logprobs_num"], "top_logprobs_num", 0),
                rid=_str(raw["rid"], "rid") or uuid.uuid4().hex,
                cache_salt=_str(raw["cache_salt"], "cache_salt"),
                priority=_int(raw["priority"], "priority", 0),
                lora_path=_str(raw["lora_path"], "lora_path"),
            )
        )
    rids = [item.rid for item in items]
    if len(set(rids)) != len(rids):
        raise ValueError("rid: the ids of a batch must differ")
    if len(samples) > 1:
        raise ValueError("sampling_params.n must be the same for every prompt of a batch")
    return GenerateCall(
        items=items,
        batch=batch,
        stream=_bool(body.get("stream"), "stream"),
        return_text_in_logprobs=_bool(body.get("return_text_in_logprobs"),
                                      "return_text_in_logprobs"),
        n=samples.pop(),
    )


def _unaliased(body: dict[str, Any]) -> dict[str, Any]:
    """The body with SGLang's names of fields (_ALIASES) under ours; both names with two
    values are refused."""
    out = dict(body)
    for alias, name in _ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if out.get(name) is not None and value is not None and out[name] != value:
            raise ValueError(f"{alias} ({value!r}) and {name} ({out[name]!r}) are one field "
                             "under two names: give one, or the same value")
        if value is not None:
            out[name] = value
    return out


def _n(value: Any) -> int:
    if value is None:
        return 1
    if not is_int(value) or not 1 <= value <= MAX_N:
        raise ValueError(f"sampling_params.n must be an integer in [1, {MAX_N}], got {value!r}")
    return value


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
    if not isinstance(value, list) or not all(is_int(t) for t in value):
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
    if not is_int(value):
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


# ---- one prompt's answer ---------------------------------------------------------------------


class NativeOutput:
    """Accumulates one request's chunks; `body()` is its answer so far, `event()` what a
    stream sends of it next: the same, or with `incremental` (SGLang's incremental
    streaming output) the text, output ids and output logprobs added since the last event."""

    def __init__(self, item: GeneratePrompt, started: float, token_text: TokenText | None,
                 incremental: bool = False) -> None:
        self.item = item
        self.started = started
        self._token_text = token_text
        self._incremental = incremental
        self.text = ""
        self.output_ids: list[int] = []
        self.last: GenerationChunk | None = None
        self._output_logprobs: list[TokenLogprob] = []
        self._output_top: list[list[TokenLogprob]] = []
        self._sent_text = self._sent_ids = 0  # what the events so far carried

    def add(self, chunk: GenerationChunk) -> None:
        """Take the next chunk of this request."""
        self.text += chunk.text
        self.output_ids += chunk.output_ids
        self._output_logprobs += chunk.output_token_logprobs
        self._output_top += chunk.output_top_logprobs
        self.last = chunk

    def body(self) -> dict[str, Any]:
        """{"text", "output_ids", "meta_info"} as SGLang answers."""
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self._meta()}

    def event(self) -> dict[str, Any]:
        """The body of the stream's next event."""
        if not self._incremental:
            return self.body()
        text, ids = self._sent_text, self._sent_ids
        self._sent_text, self._sent_ids = len(self.text), len(self.output_ids)
        return {"text": self.text[text:], "output_ids": self.output_ids[ids:],
                "meta_info": self._meta(ids)}

    def _meta(self, since: int = 0) -> dict[str, Any]:
        """meta_info, its output logprobs those of the output ids from `since` on."""
        last = self.last
        logprobs: LogprobLists | None = None
        if self.item.return_logprob:
            # The prompt's logprobs come whole with the last chunk.
            final = last if last is not None and last.finish is not None else None
            tops = self.item.top_logprobs_num > 0
            logprobs = LogprobLists(
                input_token=final.input_token_logprobs if final else [],
                output_token=self._output_logprobs[since:],
                input_top=(final.input_top_logprobs if final else []) if tops else None,
                output_top=self._output_top[since:] if tops else None,
            )
        return meta_info(
            self.item.rid,
            last.finish if last else None,
            last.prompt_tokens if last else 0,
            last.completion_tokens if last else 0,
            last.cached_tokens_details if last else CachedTokens(),
            e2e_latency=time.monotonic() - self.started,
            logprobs=logprobs,
            token_text=self._token_text,
            spec=Speculated(last.spec_verify_ct, last.spec_accepted_tokens) if last else None,
            disaggregated=last.disaggregated if last else None,
        )
