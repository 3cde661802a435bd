"""Several generation streams run at once and read as one, in arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

from radixmesh.services.tokenizer.generation import (
    GenerationChunk,
    GenerationClient,
    GenerationRequest,
)

# A queue item: the request's index and its next chunk, its failure, or None once it ends.
_Item = tuple[int, GenerationChunk | BaseException | None]


class ClientGone(Exception):
    """The HTTP client went away before its answer was complete."""


class GenerationFanout:
    """Runs requests concurrently and yields (index, chunk) as chunks arrive."""

    def __init__(self, client: GenerationClient, requests: Sequence[GenerationRequest]) -> None:
        self._client = client
        self._requests = list(requests)
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0

    async def __aenter__(self) -> GenerationFanout:
        self._tasks = [
            asyncio.create_task(self._pump(index, request))
            for index, request in enumerate(self._requests)
        ]
        self._running = len(self._tasks)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # A cancelled pump closes its stream, which aborts the request in the mesh.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def client_gone(self) -> None:
        """Make the reader raise ClientGone at its next read."""
        self._queue.put_nowait((-1, ClientGone()))

    def __aiter__(self) -> GenerationFanout:
        return self

    async def __anext__(self) -> tuple[int, GenerationChunk]:
        while self._running:
            index, item = await self._queue.get()
            if item is None:
                self._running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    async def _pump(self, index: int, request: GenerationRequest) -> None:
        try:
            stream = self._client.generate(request)
            try:
                async for chunk in stream:
                    self._queue.put_nowait((index, chunk))
            finally:
                await _close(stream)
        except Exception as exc:
            # The reader raises it; a cancellation (BaseException) just ends the pump.
            self._queue.put_nowait((index, exc))
        self._queue.put_nowait((index, None))


async def _close(stream: AsyncIterator[GenerationChunk]) -> None:
    """Close a stream that may have stopped early: the mesh aborts the request."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
