"""The spans of a request in the tokenizer: "tokenize" (in the front doors), then "generate"
with "route", "stream out" and "abort"; every call does nothing while tracing is off."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from opentelemetry.trace import Span, SpanKind, get_current_span

from radixmesh.core.request import GenerationRequest, cache_namespace
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.generation import GenerationChunk
from radixmesh.services.tokenizer.router import Route, Router
from radixmesh.tracing import attributes as attr
from radixmesh.tracing.propagation import headers
from radixmesh.tracing.spans import current_span, end_span, start_span


def encode_traced(tokenizer: Tokenizer, text: str, rid: str) -> list[int]:
    """Token ids of a prompt, inside a "tokenize" span."""
    with current_span("tokenize", attributes={attr.RID: rid}) as span:
        ids = tokenizer.encode(text)
        if span is not None:
            span.set_attribute(attr.PROMPT_TOKENS, len(ids))
        return ids


@contextlib.contextmanager
def tokenize_span() -> Iterator[Callable[[Sequence[GenerationRequest]], None]]:
    """A "tokenize" span around parsing that yields the requests; call what it yields with
    them to name them on the span."""
    with current_span("tokenize") as span:

        def tokenized(requests: Sequence[GenerationRequest]) -> None:
            if span is not None:
                span.set_attributes(attr.rid_attributes(r.rid for r in requests))
                span.set_attribute(attr.PROMPT_TOKENS, [len(r.input_ids) for r in requests])

        yield tokenized


class RequestTrace:
    """The spans of one request's life in the mesh; every method does nothing while tracing
    is off."""

    __slots__ = ("rid", "_span", "_stream", "_chunks", "_last")

    def __init__(self, request: GenerationRequest) -> None:
        self.rid = request.rid
        self._stream: Span | None = None
        self._chunks = 0
        self._last: GenerationChunk | None = None
        self._span = start_span("generate", attributes={
            attr.RID: request.rid,
            attr.PROMPT_TOKENS: len(request.input_ids),
            attr.MAX_NEW_TOKENS: request.params.max_new_tokens,
            **({attr.LORA: request.lora_path} if request.lora_path else {}),
        }, kind=SpanKind.PRODUCER)
        if self._span is not None:
            attr.tag_rid(get_current_span(), request.rid)  # the HTTP or gRPC call's span

    def route(self, router: Router, request: GenerationRequest) -> Route:
        """Pick the request's engine inside a "route" span; LookupError when none is up."""
        if self._span is None:
            return router.route(request.input_ids, _namespace(request), bool(request.pooling))
        span = start_span("route", self._span, {
            attr.RID: self.rid, attr.ROUTE_ENGINES: len(router.engine_ids)})
        try:
            route = router.route(request.input_ids, _namespace(request), bool(request.pooling))
        except LookupError:
            end_span(span, error="no engine is available")
            raise
        self._span.set_attribute(attr.ENGINE_ID, route.engine_id)
        if span is not None:
            span.set_attributes({attr.ENGINE_ID: route.engine_id,
                                 attr.ROUTE_MATCHED: route.matched_tokens})
            span.end()
        return route

    def headers(self) -> dict[str, str] | None:
        """NATS headers that make the engine's spans children of this request's."""
        return headers(self._span)

    def chunk(self, chunk: GenerationChunk) -> None:
        """A chunk on its way to the client: the first one opens "stream out"."""
        if self._span is None:
            return
        if self._stream is None:
            self._stream = start_span("stream out", self._span, {attr.RID: self.rid})
        self._chunks += 1
        self._last = chunk

    @contextlib.contextmanager
    def aborting(self, reason: str) -> Iterator[dict[str, str] | None]:
        """An "abort" span around telling the engine; yields the headers to send with it."""
        span = start_span("abort", self._span, {attr.RID: self.rid, attr.ABORT_REASON: reason})
        try:
            yield headers(span)
        finally:
            end_span(span)

    def end(self, error: str | None = None) -> None:
        """The request is over (`error`: it never reached an engine)."""
        if self._span is None:
            return
        last = self._last
        if last is not None:
            counts = {attr.CACHED_TOKENS: last.cached_tokens,
                      attr.COMPLETION_TOKENS: last.completion_tokens}
            self._span.set_attributes(counts)
            if last.finish is not None:
                self._span.set_attribute(attr.FINISH, last.finish.kind.value)
            if self._stream is not None:
                self._stream.set_attributes({**counts, attr.STREAM_CHUNKS: self._chunks})
        end_span(self._stream)
        end_span(self._span, error=error)


def _namespace(request: GenerationRequest) -> str:
    """The engines' prefix cache the request's prompt is looked up in."""
    return cache_namespace(request.cache_salt, request.lora_path) or ""
