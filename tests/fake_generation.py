"""A GenerationClient without a mesh: deterministic replies, one chunk per token, and a
record of the requests it got and of the streams closed before they finished."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.meta_info import TokenLogprob
from radixmesh.core.request import GenerationRequest
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.generation import GenerationChunk, GenerationError

REPLY = " The answer is 42. Have a nice day!"
EOS_ID = 2


def output_logprob(position: int) -> float:
    """The logprob the fake reports for the output token at `position`."""
    return -0.1 * (position + 1)


PROMPT_LOGPROB = -0.5


def host_part(cached: int) -> int:
    """How much of a prefix hit the fake says came back from the host tier (HiCache)."""
    return cached // 2


class FakeGenerationClient:
    """Replies `reply_for(request)` then EOS, cut by stop strings and max_new_tokens."""

    def __init__(
        self, tokenizer: Tokenizer, model_name: str = "fake/SmolLM2", context_length: int = 2048
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.grammar_backend = "xgrammar"
        self.pooling = None
        self.reranker = None
        self.hidden_size = 0
        self._context_length = context_length
        self.reply_for: Callable[[GenerationRequest], str] = lambda _: REPLY
        self.requests: list[GenerationRequest] = []
        self.finished: list[str] = []
        self.closed: list[str] = []  # rids whose stream was closed before it finished
        self.closed_event = asyncio.Event()
        self.hold_after: int | None = None  # a stream stalls after this many chunks
        self.held = asyncio.Event()  # set when a stream stalls
        self.error: GenerationError | None = None  # what generate() raises
        self.abort_message: str | None = None  # set: the stream ends aborted, with this
        self.abort_after = 0  # ... after this many good chunks
        self._seen: list[list[int]] = []

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def lora_names(self) -> frozenset[str]:
        return frozenset()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def generate(self, request: GenerationRequest, stream: bool = True
                 ) -> AsyncIterator[GenerationChunk]:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        cached = max((_common_prefix(request.input_ids, ids) for ids in self._seen), default=0)
        self._seen.append(list(request.input_ids))
        return self._run(request, min(cached, len(request.input_ids) - 1))

    def output_ids(self, request: GenerationRequest) -> list[int]:
        """Every token the fake would produce for `request` before stop strings."""
        # ignore_eos: the reply over and over, up to the limit.
        reply = self.tokenizer.encode(self.reply_for(request))
        limit = request.params.max_new_tokens
        if request.params.ignore_eos:
            return (reply * (limit // len(reply) + 1))[:limit]
        return (reply + [EOS_ID])[:limit]

    async def _run(self, request: GenerationRequest, cached: int) -> AsyncIterator[GenerationChunk]:
        ids = self.output_ids(request)
        shown = ""
        finish: FinishReason | None = None
        try:
            for k in range(len(ids)):
                if self.hold_after is not None and k >= self.hold_after:
                    self.held.set()
                    await asyncio.Event().wait()
                await asyncio.sleep(0)  # a real stream yields to the loop between chunks
                text = self.tokenizer.decode(ids[: k + 1])
                finish, text = self._finish(request, ids, k, text)
                delta, shown = text[len(shown) :], text
                yield self._chunk(request, ids, k, delta, cached, finish)
                if finish is not None:
                    return
        finally:
            if finish is None:
                self.closed.append(request.rid)
                self.closed_event.set()
            else:
                self.finished.append(request.rid)

    def _finish(
        self, request: GenerationRequest, ids: list[int], k: int, text: str
    ) -> tuple[FinishReason | None, str]:
        """The finish after token k, if any, and the text to show up to it."""
        if self.abort_message is not None and k >= self.abort_after:
            return FinishReason(FinishKind.ABORT, message=self.abort_message), ""
        params = request.params
        hits = [(text.find(stop), stop) for stop in params.stop if stop in text]
        if hits:
            start, stop = min(hits)
            end = start + len(stop) if params.no_stop_trim else start
            return FinishReason(FinishKind.STOP, stop), text[:end]
        if k + 1 < len(ids):
            return None, text[: len(text) - _stop_prefix_len(text, params.stop)]
        if ids[k] == EOS_ID and not params.ignore_eos:
            return FinishReason(FinishKind.STOP, EOS_ID), text
        return FinishReason(FinishKind.LENGTH, params.max_new_tokens), text

    def _chunk(
        self,
        request: GenerationRequest,
        ids: list[int],
        k: int,
        delta: str,
        cached: int,
        finish: FinishReason | None,
    ) -> GenerationChunk:
        chunk = GenerationChunk(
            rid=request.rid,
            text=delta,
            output_ids=[ids[k]],
            prompt_tokens=len(request.input_ids),
            completion_tokens=k + 1,
            cached_tokens=cached,
            finish=finish,
            cached_host_tokens=host_part(cached),
        )
        wanted = request.logprobs
        if not wanted.return_logprob:
            return chunk
        top = wanted.top_logprobs_num
        chunk.output_token_logprobs = [(output_logprob(k), ids[k], None)]
        if top:
            chunk.output_top_logprobs = [self.alternatives(ids[k], output_logprob(k), top)]
        if finish is not None and wanted.logprob_start_len >= 0:
            prompt = request.input_ids[wanted.logprob_start_len :]
            chunk.input_token_logprobs = [
                (None if p == 0 else PROMPT_LOGPROB, t, None) for p, t in enumerate(prompt)
            ]
            if top:
                chunk.input_top_logprobs = [
                    None if p == 0 else self.alternatives(t, PROMPT_LOGPROB, top)
                    for p, t in enumerate(prompt)
                ]
        return chunk

    def alternatives(self, token_id: int, logprob: float, top: int) -> list[TokenLogprob]:
        """The top `top` candidates for a position: the chosen token, then its neighbours."""
        return [(logprob - a, (token_id + a) % self.vocab_size, None) for a in range(top)]


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """How much of the end of `text` might begin a stop string (held back until known)."""
    return max(
        (n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
