"""One request's output as the caller sees it: text deltas while it runs, a dict at the end."""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator
from typing import Any

from radixmesh.core.detokenize import RequestText, TextRules
from radixmesh.core.finish import FinishKind
from radixmesh.core.meta_info import CachedTokens, LogprobLists, Speculated, meta_info
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.request import Req


class RequestStream:
    """Fed by the scheduler thread; read by the caller, streaming or all at once."""

    def __init__(self, req: Req, tokenizer: Tokenizer, streaming: bool, interval: int = 1
                 ) -> None:
        self.req = req
        # Only a streaming caller reads chunks; others would pay for a meta dict per step.
        self._streaming = streaming
        params = req.params
        rules = TextRules(
            tuple(params.stop),
            params.no_stop_trim,
            params.skip_special_tokens,
            params.min_new_tokens,
            params.spaces_between_special_tokens,
        )
        # The same text as the detokenizer service gives, from shorter windows: all the
        # request's ids are at hand here.
        self._detok = RequestText(tokenizer.decode, rules, req.input_ids, tokenizer.special_ids,
                                  tokenizer.pieces)
        # Text nobody reads before the finish (no stream, no stop string to look for) is
        # decoded once, at the finish: the same text as update by update.
        self._at_finish = not streaming and not params.stop
        # A stream's chunks after its first: one every `interval` tokens, and the finish.
        # Where stop strings are looked for, every token is.
        self._interval = 1 if params.stop else interval
        # A stop string ends the text: the update of the engine's abort adds none.
        self._stopped = False
        self._seen = 0
        self.text = ""
        self._chunks: queue.Queue[dict[str, Any] | BaseException] = queue.Queue()
        self._done = threading.Event()
        self._result: dict[str, Any] | BaseException | None = None

    def update(self) -> str | None:
        """Take the request's new tokens; returns a stop string if one just matched."""
        req = self.req
        if req.finish is None and (self._at_finish or self._seen and (
                len(req.output_ids) - self._seen < self._interval)):
            return None
        new_ids = req.output_ids[self._seen :]
        self._seen = len(req.output_ids)
        delta, matched = "", None
        if not self._stopped:
            # Like SGLang, the text leaves out a matched stop token (unless no_stop_trim); it
            # is always the last output id and arrives together with the finish.
            trim = bool(new_ids) and self._trims_stop_token()
            window = self._detok.update(new_ids, req.finish is not None, trim)
            delta, matched = window.text, window.matched
            self._stopped = matched is not None
        self.text += delta
        if self._streaming and (req.finish is not None or delta or new_ids):
            self._chunks.put(self._chunk(delta, new_ids))
        if req.finish is not None:
            self._result = self._final()
            self._done.set()
        return matched

    def _trims_stop_token(self) -> bool:
        finish = self.req.finish
        return (
            finish is not None
            and finish.kind is FinishKind.STOP
            and isinstance(finish.matched, int)
            and not self.req.params.no_stop_trim
        )

    def fail(self, error: BaseException) -> None:
        """The request was refused before it ran."""
        self._result = error
        self._chunks.put(error)
        self._done.set()

    def result(self) -> dict[str, Any]:
        """Block until the request finishes; its text, output ids and meta_info."""
        self._done.wait()
        if isinstance(self._result, BaseException):
            raise self._result
        assert self._result is not None
        return self._result

    def chunks(self) -> Iterator[dict[str, Any]]:
        """Stream of {text (new text), output_ids (new ids), meta_info}; the last one finishes."""
        while True:
            item = self._chunks.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item["meta_info"]["finish_reason"] is not None:
                return

    def _chunk(self, delta: str, new_ids: list[int]) -> dict[str, Any]:
        return {"text": delta, "output_ids": new_ids, "meta_info": self._meta()}

    def _final(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "output_ids": list(self.req.output_ids),
            "meta_info": self._meta(),
        }

    def _meta(self) -> dict[str, Any]:
        req = self.req
        logprobs: LogprobLists | None = None
        if req.logprobs.return_logprob:
            start = max(req.logprobs.logprob_start_len, 0)
            tops = bool(req.logprobs.top_logprobs_num)
            # The scheduler keeps (token id, logprob) pairs, NaN for the first prompt token.
            logprobs = LogprobLists(
                input_token=[
                    (None if math.isnan(lp) else lp, tid, None)
                    for lp, tid in zip(req.input_logprobs, req.input_ids[start:], strict=False)
                ],
                output_token=[
                    (lp, tid, None)
                    for lp, tid in zip(req.output_logprobs, req.output_ids, strict=False)
                ],
                input_top=[
                    [(lp, tid, None) for tid, lp in top] or None for top in req.input_top_logprobs
                ] if tops else None,
                output_top=[
                    [(lp, tid, None) for tid, lp in top] for top in req.output_top_logprobs
                ] if tops else None,
            )
        return meta_info(
            req.rid,
            req.finish,
            len(req.input_ids),
            len(req.output_ids),
            CachedTokens.split(
                req.cached_tokens, host=req.cached_host_tokens, storage=req.cached_storage_tokens
            ),
            logprobs=logprobs,
            spec=Speculated(req.spec_verify_ct, req.spec_accepted_tokens),
        )
