"""The scheduler's side of cachectl (the owner of its engine's host KV tier) over gRPC: a
radixmesh.core.hicache.HostTierClient.

Every call has a short deadline, so a dead cachectl shows up within `timeout` seconds as a
CachectlUnavailable (a ConnectionError) rather than a stalled scheduling loop; a request
cachectl rejects as malformed raises ValueError, as the in-process LocalCachectl does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import NamedTuple, TypeVar

import grpc

from radixmesh.core.hicache import HostPoolSpec, KVGeometry
from radixmesh.proto import cache_pb2 as cpb
from radixmesh.proto import cache_pb2_grpc as cgrpc
from radixmesh.proto.convert import (
    geometry_to_proto,
    segment_from_proto,
)

DEFAULT_TIMEOUT_S = 3.0

R = TypeVar("R")


class CachectlUnavailable(ConnectionError):
    """cachectl did not answer within the timeout, could not be reached, could not create
    the segment, or no longer holds this engine's segment (it restarted): the host tier is
    gone until an open succeeds."""


class HostTierStats(NamedTuple):
    """The engine's segment as cachectl sees it."""

    num_slots: int
    used_slots: int
    segment_bytes: int
    repeated: int  # slots recorded while in use or forgotten while free, since open


class CachectlClient:
    """One engine's scheduler talking to its cachectl at `addr` (host:port)."""

    def __init__(self, addr: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.addr = addr
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(addr)
        self._stub = cgrpc.CachectlStub(self._channel)
        self._engine_id: str | None = None

    async def open(
        self,
        engine_id: str,
        geometry: KVGeometry,
        num_slots: int,
        layout: str,
        storage_page_tokens: int = 0,
    ) -> HostPoolSpec:
        """A fresh segment for `engine_id`, which later calls are about."""
        request = cpb.OpenRequest(
            engine_id=engine_id,
            geometry=geometry_to_proto(geometry),
            num_slots=num_slots,
            layout=layout,
            storage_page_tokens=storage_page_tokens,
        )
        # cachectl may still be starting beside the scheduler: wait for it, within the timeout.
        reply = await self._call("Open", self._stub.Open(
            request, timeout=self.timeout, wait_for_ready=True
        ))
        self._engine_id = engine_id
        return segment_from_proto(reply)

    async def record(self, slots: list[int]) -> None:
        request = cpb.PagesRequest(engine_id=self._opened(), slots=slots)
        await self._call("Record", self._stub.Record(request, timeout=self.timeout))

    async def forget(self, slots: list[int]) -> None:
        request = cpb.PagesRequest(engine_id=self._opened(), slots=slots)
        await self._call("Forget", self._stub.Forget(request, timeout=self.timeout))

    async def stats(self) -> HostTierStats:
        request = cpb.StatsRequest(engine_id=self._opened())
        reply = await self._call("GetStats", self._stub.GetStats(request, timeout=self.timeout))
        return HostTierStats(reply.num_slots, reply.used_slots, reply.segment_bytes,
                             reply.repeated)

    async def store(self, pages: Sequence[tuple[str, Sequence[int]]]) -> int:
        request = cpb.StoreRequest(
            engine_id=self._opened(),
            pages=[cpb.StoragePage(key=key, slots=slots) for key, slots in pages],
        )
        reply = await self._call("Store", self._stub.Store(request, timeout=self.timeout))
        return reply.accepted

    async def query(self, keys: Sequence[str]) -> int:
        request = cpb.QueryRequest(engine_id=self._opened(), keys=keys)
        reply = await self._call("Query", self._stub.Query(request, timeout=self.timeout))
        return reply.hits

    async def prefetch(self, keys: Sequence[str], slots: Sequence[int]) -> AsyncIterator[int]:
        """No deadline: cachectl bounds each storage read itself, and the scheduler must
        see the stream end before it reuses the slots."""
        request = cpb.PrefetchRequest(engine_id=self._opened(), keys=keys, slots=slots)
        stream = self._stub.Prefetch(request)
        try:
            async for progress in stream:
                yield progress.arrived
        except grpc.aio.AioRpcError as exc:
            raise CachectlUnavailable(
                f"cachectl at {self.addr}: Prefetch failed ({exc.code().name}): {exc.details()}"
            ) from exc

    async def close(self) -> None:
        """Close the channel; the segment stays cachectl's until the next open or its stop."""
        self._engine_id = None
        await self._channel.close()

    def _opened(self) -> str:
        if self._engine_id is None:
            raise RuntimeError("the host tier is not open")
        return self._engine_id

    async def _call(self, rpc: str, call: Awaitable[R]) -> R:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"cachectl at {self.addr}: {exc.details()}") from None
            raise CachectlUnavailable(
                f"cachectl at {self.addr}: {rpc} failed ({exc.code().name}): {exc.details()}"
            ) from exc
