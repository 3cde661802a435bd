"""The requests this tokenizer replica sent and is waiting on, by id: their output as it
comes back on the replica's own subject (`on_output`, the per-token path, into each request's
InFlight), and their ends when the mesh gives up on them. A request whose engine went away
ends at once (its reader retries it elsewhere when it had no output yet); one whose output
has a hole that does not fill, or that had no output for too long, ends and is aborted on its
engine, as is every request still running when the bus is interrupted or the replica stops."""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from radixmesh.core.request import GenerationRequest
from radixmesh.mesh import subjects
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.services.tokenizer.assembler import ChunkAssembler, InFlight, deliver

log = logging.getLogger("radixmesh.tokenizer.mesh")

# How long output may stay out of order before the missing part counts as lost (two
# detokenizer replicas deliver out of order by milliseconds; a dead one never delivers).
GAP_TIMEOUT_S = 5.0


class Flights:
    """Request id -> InFlight, for the requests whose readers are still reading."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._by_rid: dict[str, InFlight] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    def __len__(self) -> int:
        return len(self._by_rid)

    def open(self, request: GenerationRequest, engine_id: str) -> InFlight:
        """Wait on `request`, sent to `engine_id`."""
        flight = self._by_rid[request.rid] = InFlight(engine_id, ChunkAssembler(request))
        return flight

    def close(self, rid: str) -> None:
        """Stop waiting on `rid` (its reader is done): output still coming for it is dropped."""
        del self._by_rid[rid]

    async def on_output(self, msg: Msg) -> None:
        """A TextChunks on this replica's subject: its chunks to their requests."""
        deliver(mpb.TextChunks.FromString(msg.data), self._by_rid, time.monotonic())

    async def abort(self, engine_id: str, rid: str,
                    abort_headers: dict[str, str] | None = None) -> None:
        """Ask `engine_id` to drop `rid` (a bus error is logged, not raised)."""
        try:
            await self._nc.publish(
                subjects.engine_abort(engine_id), mpb.AbortRequest(rid=rid).SerializeToString(),
                headers=abort_headers,
            )
        except NatsError as exc:
            log.warning("could not abort %s on engine %s: %s", rid, engine_id, exc)

    def engine_lost(self, engine_id: str, message: str) -> None:
        """End the requests sent to an engine that is gone (retried when they had no
        output yet)."""
        for flight in self._by_rid.values():
            if flight.engine_id == engine_id:
                flight.end(message, lost=True)

    async def end_stalled(self, stall_timeout_s: float) -> None:
        """End requests whose output has a hole that is not filling (a detokenizer died
        holding part of it), or that had no output for `stall_timeout_s` (0: never)."""
        now = time.monotonic()
        for rid, flight in list(self._by_rid.items()):
            if flight.assembler.finished:
                continue
            if flight.gap_since is not None and now - flight.gap_since > GAP_TIMEOUT_S:
                message = "part of the output was lost on its way (a detokenizer went away)"
            elif stall_timeout_s and now - flight.last_output > stall_timeout_s:
                message = f"no output for {stall_timeout_s:g} s"
            else:
                continue
            log.warning("request %s: %s; ending it", rid, message)
            await self._give_up(rid, flight, message)

    async def end_all(self, message: str) -> None:
        """End every request still running with `message`, each aborted on its engine."""
        for rid, flight in list(self._by_rid.items()):
            if not flight.assembler.finished:
                await self._give_up(rid, flight, message)

    async def _give_up(self, rid: str, flight: InFlight, message: str) -> None:
        flight.end(message)
        await self.abort(flight.engine_id, rid)
