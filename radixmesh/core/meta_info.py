"""SGLang's meta_info: the dict that comes with a request's text and output ids.

The in-process engine and the tokenizer's native HTTP API both answer with it; building it
in one place keeps their keys, order and logprob shapes from drifting apart."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixmesh.core.finish import FinishReason

# A token's logprob as SGLang reports it: (logprob or None, token id, token text or None).
TokenLogprob = tuple[float | None, int, str | None]
# A token's text, for clients that asked to see it beside each logprob.
TokenText = Callable[[int], str]


@dataclass(frozen=True)
class LogprobLists:
    """The logprobs of a request that asked for them; the top lists stay None unless it
    asked for alternatives too (an input position without any is None)."""

    input_token: Sequence[TokenLogprob]
    output_token: Sequence[TokenLogprob]
    input_top: Sequence[Sequence[TokenLogprob] | None] | None = None
    output_top: Sequence[Sequence[TokenLogprob]] | None = None


@dataclass(frozen=True)
class CachedTokens:
    """A request's prefix-cache hit by the tier its KV came from (SGLang's
    cached_tokens_details): the device pool, the host tier (HiCache) or a storage tier."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @classmethod
    def split(cls, total: int, host: int = 0, storage: int = 0) -> CachedTokens:
        """A hit of `total` tokens, `host` and `storage` of them loaded back from those tiers."""
        return cls(total - host - storage, host, storage)

    @property
    def total(self) -> int:
        """meta_info's cached_tokens."""
        return self.device + self.host + self.storage

    def to_dict(self) -> dict[str, int]:
        """meta_info's cached_tokens_details."""
        return {"device": self.device, "host": self.host, "storage": self.storage}


@dataclass(frozen=True)
class Speculated:
    """What speculative decoding did for a request: verify steps, draft tokens accepted."""

    verify_ct: int = 0
    accepted_tokens: int = 0

    def to_dict(self) -> dict[str, float]:
        """meta_info's spec_verify_ct, spec_accepted_tokens and spec_accept_length (the
        tokens a verify step produced on average: its accepted drafts and its own)."""
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_accept_length": round((self.accepted_tokens + self.verify_ct)
                                        / self.verify_ct, 4),
        }


@dataclass(frozen=True)
class Disaggregated:
    """Where a request ran with prefill/decode disaggregation: the engine that prefilled
    it, the one that decoded it, and the prompt KV that went between them."""

    prefill_engine: str
    decode_engine: str
    transfer_tokens: int = 0
    transfer_bytes: int = 0
    transfer_ms: float = 0.0
    fallback: str = ""  # why the decode engine prefilled the prompt itself

    def to_dict(self) -> dict[str, Any]:
        """meta_info's disaggregation object."""
        out: dict[str, Any] = {
            "prefill_engine": self.prefill_engine,
            "decode_engine": self.decode_engine,
            "transfer_tokens": self.transfer_tokens,
            "transfer_bytes": self.transfer_bytes,
            "transfer_ms": round(self.transfer_ms, 3),
        }
        if self.fallback:
            out["fallback"] = self.fallback
        return out


def meta_info(
    rid: str,
    finish: FinishReason | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached: CachedTokens,
    e2e_latency: float | None = None,
    logprobs: LogprobLists | None = None,
    token_text: TokenText | None = None,
    spec: Speculated | None = None,
    disaggregated: Disaggregated | None = None,
) -> dict[str, Any]:
    """meta_info in SGLang's key order; `token_text` fills in each logprob's token text;
    the speculative decoding figures where the request verified drafts; where its prompt
    was prefilled on another engine, a "disaggregation" object.

    Every list is a fresh copy, so a caller may keep appending to what it passed in."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish.to_dict() if finish else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached.total,
        "cached_tokens_details": cached.to_dict(),
    }
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    if spec is not None and spec.verify_ct:
        meta.update(spec.to_dict())
    if disaggregated is not None:
        meta["disaggregation"] = disaggregated.to_dict()
    if logprobs is None:
        return meta
    meta["input_token_logprobs"] = _named(logprobs.input_token, token_text)
    meta["output_token_logprobs"] = _named(logprobs.output_token, token_text)
    if logprobs.input_top is not None:
        meta["input_top_logprobs"] = [
            None if top is None else _named(top, token_text) for top in logprobs.input_top
        ]
    if logprobs.output_top is not None:
        meta["output_top_logprobs"] = [_named(top, token_text) for top in logprobs.output_top]
    return meta


def _named(entries: Sequence[TokenLogprob], token_text: TokenText | None) -> list[TokenLogprob]:
    if token_text is None:
        return list(entries)
    return [(lp, tid, token_text(tid)) for lp, tid, _ in entries]
