"""The scheduler's side of gRPC Forward: one channel per worker rank, the same batch to
every rank (converted to protobuf once), rank 0's result back, with the backups every rank
has finished."""

from __future__ import annotations

import asyncio
import time

import grpc

from radixmesh.core.step import StepBatch, StepResult
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto import worker_pb2_grpc as wgrpc
from radixmesh.proto.convert import batch_to_proto, result_from_proto

MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class BackupTally:
    """Which backups every rank has finished. Each rank copies its own KV heads and reports a
    backup once, in whichever step it finished there, so one rank's report is not enough."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._reports: dict[int, int] = {}  # copy id -> ranks that reported it so far

    def add(self, per_rank: list[list[int]]) -> list[int]:
        """One step's copies_done of each rank; the backups now done on every rank."""
        done: list[int] = []
        for copy_ids in per_rank:
            for copy_id in copy_ids:
                seen = self._reports.get(copy_id, 0) + 1
                if seen == self.ranks:
                    del self._reports[copy_id]
                    done.append(copy_id)
                else:
                    self._reports[copy_id] = seen
        return done


class WorkerClient:
    """Drives the worker ranks of one engine replica."""

    def __init__(self, addrs: list[str]) -> None:
        self._channels: list[grpc.aio.Channel] = []
        self._open(addrs)

    def _open(self, addrs: list[str]) -> None:
        self._channels = [grpc.aio.insecure_channel(a, options=_OPTIONS) for a in addrs]
        self._stubs = [wgrpc.WorkerStub(c) for c in self._channels]
        self.addrs = addrs
        self._backups = BackupTally(len(addrs))

    async def retarget(self, addrs: list[str]) -> None:
        """Drive the ranks at `addrs` from now on (a worker group found anew)."""
        if addrs != self.addrs:
            await self.close()
            self._open(addrs)

    async def connect(self, timeout: float) -> wpb.WorkerInfo:
        """Wait for every rank to answer; rank 0's info (ranks are reordered by tp_rank)."""
        if not self.addrs:
            raise ValueError("at least one worker address is needed")
        deadline = time.monotonic() + timeout
        infos = await asyncio.gather(*(self._info(s, deadline) for s in self._stubs))
        order = sorted(range(len(infos)), key=lambda i: infos[i].tp_rank)
        self._stubs = [self._stubs[i] for i in order]
        infos = [infos[i] for i in order]
        sizes = {i.tp_size for i in infos}
        if sizes != {len(infos)} or [i.tp_rank for i in infos] != list(range(len(infos))):
            raise RuntimeError(
                f"workers report tp ranks {[i.tp_rank for i in infos]} of sizes {sorted(sizes)}; "
                f"expected ranks 0..{len(infos) - 1}, one address per rank"
            )
        return infos[0]

    @staticmethod
    async def _info(stub: wgrpc.WorkerStub, deadline: float) -> wpb.WorkerInfo:
        while True:
            try:
                return await stub.GetInfo(wpb.WorkerInfoRequest(), timeout=5, wait_for_ready=True)
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def ping(self, timeout: float = 2.0) -> None:
        """Raise grpc.aio.AioRpcError unless every rank answers."""
        await asyncio.gather(*(s.GetInfo(wpb.WorkerInfoRequest(), timeout=timeout)
                               for s in self._stubs))

    async def forward(
        self, batch: StepBatch, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> StepResult:
        """Run one step on every rank; they stay in lockstep, rank 0 answers, and a backup
        is done once every rank has reported it. `metadata` goes with each call (the step's
        trace context)."""
        msg = batch_to_proto(batch)
        if len(self._stubs) == 1:
            return result_from_proto(await self._stubs[0].Forward(msg, metadata=metadata))
        results = await asyncio.gather(*(s.Forward(msg, metadata=metadata)
                                         for s in self._stubs))
        result = result_from_proto(results[0])
        result.copies_done = self._backups.add([list(r.copies_done) for r in results])
        return result

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))
