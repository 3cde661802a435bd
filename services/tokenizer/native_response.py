"""One prompt's answer in SGLang's /generate shape, built up from its GenerationChunks.

Like SGLang, every answer (and every streamed event) carries the text and output ids so
far, not just the new part; its clients slice off what they already have."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from radixmesh.services.tokenizer.generation import GenerationChunk, TokenLogprob
from radixmesh.services.tokenizer.native_request import NativeItem

TokenText = Callable[[int], str]


class NativeOutput:
    """Accumulates one request's chunks; `body()` is its answer so far."""

    def __init__(self, item: NativeItem, started: float, token_text: TokenText | None) -> None:
        self.item = item
        self.started = started
        self._token_text = token_text
        self.text = ""
        self.output_ids: list[int] = []
        self.last: GenerationChunk | None = None
        self._output_logprobs: list[TokenLogprob] = []
        self._output_top: list[list[TokenLogprob]] = []

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish is not None

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

    def _meta(self) -> dict[str, Any]:
        last = self.last
        meta: dict[str, Any] = {
            "id": self.item.rid,
            "finish_reason": last.finish if last else None,
            "prompt_tokens": last.prompt_tokens if last else 0,
            "completion_tokens": last.completion_tokens if last else 0,
            "cached_tokens": last.cached_tokens if last else 0,
            "e2e_latency": time.monotonic() - self.started,
        }
        if self.item.return_logprob:
            done = self.finished and last is not None
            meta["input_token_logprobs"] = self._named(last.input_token_logprobs if done else [])
            meta["output_token_logprobs"] = self._named(self._output_logprobs)
            if self.item.top_logprobs_num > 0:
                tops = last.input_top_logprobs if done else []
                meta["input_top_logprobs"] = [
                    None if top is None else self._named(top) for top in tops
                ]
                meta["output_top_logprobs"] = [self._named(top) for top in self._output_top]
        return meta

    def _named(self, entries: list[TokenLogprob]) -> list[TokenLogprob]:
        """Fill in each token's text when the client asked for it."""
        if self._token_text is None:
            return list(entries)
        return [(lp, tid, self._token_text(tid)) for lp, tid, _ in entries]
