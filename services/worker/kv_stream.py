"""KV between worker ranks of two engines (prefill/decode disaggregation): the sending side
(`KVSender`: one gRPC PutKV stream per receiving rank) and the receiving side's reading of a
piece (`piece_bytes`). Two backends: grpc streams the bytes, in pieces of at most
PIECE_BYTES, and works across hosts; shm writes them to a file in a tmpfs both workers see
and streams only its name, for engines on one host."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch

from radixmesh.core.hicache import shm_root
from radixmesh.core.step import KVSend, SendOutcome
from radixmesh.engine.model.kv_transfer import KVPorter, head_overlaps
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto import worker_pb2_grpc as wgrpc

log = logging.getLogger("radixmesh.worker")

PIECE_BYTES = 8 << 20  # well under the channels' message limit
SEND_TIMEOUT_S = 120.0
MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def host_id() -> str:
    """This machine, boot and shared-memory mount: workers that report the same one see
    the same files there (two containers on one machine with their own /dev/shm do not)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    mount = os.stat(shm_root())
    return f"{socket.gethostname()}/{boot}/{mount.st_dev}:{mount.st_ino}"


def piece_bytes(piece: wpb.KVPages, nbytes: int) -> bytes:
    """A received piece's bytes: inline, or `nbytes` read from its shared-memory file."""
    if not piece.shm_path:
        return piece.data
    path = Path(piece.shm_path)
    if path.parent != Path(shm_root()) or not path.name.startswith("radixmesh-kv-"):
        raise ValueError(f"{piece.shm_path} is not a KV transfer file")
    with path.open("rb") as f:
        f.seek(piece.offset)
        return f.read(nbytes)


class KVSender:
    """Sends prompts' KV from this rank's pool, each send in its own task."""

    def __init__(self, porter: KVPorter) -> None:
        self.porter = porter
        self._stubs: dict[str, tuple[grpc.aio.Channel, wgrpc.WorkerStub]] = {}
        self._tasks: list[asyncio.Task[SendOutcome]] = []
        self.sent_bytes = 0

    def start(self, send: KVSend, data: torch.Tensor) -> None:
        """Send `data` (this rank's heads of the send's slots, as KVPorter.read gives)."""
        self._tasks.append(asyncio.create_task(self._send(send, data)))

    @property
    def pending(self) -> bool:
        return any(not t.done() for t in self._tasks)

    async def wait(self, timeout: float) -> None:
        """Until one send finishes, at most `timeout` seconds."""
        running = [t for t in self._tasks if not t.done()]
        if running:
            await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    def finished(self) -> list[SendOutcome]:
        """The sends that ended since the last call."""
        done = [t.result() for t in self._tasks if t.done()]
        self._tasks = [t for t in self._tasks if not t.done()]
        return done

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c, _ in self._stubs.values()))

    async def _send(self, send: KVSend, data: torch.Tensor) -> SendOutcome:
        began = time.perf_counter()
        porter = self.porter
        pieces = head_overlaps(porter.total_kv_heads, porter.ranks, len(send.dest_workers),
                               porter.rank)
        try:
            sizes = await asyncio.gather(*(
                self._to_rank(send, send.dest_workers[other], data, a, b)
                for other, a, b in pieces
            ))
        except (grpc.aio.AioRpcError, OSError, ValueError) as exc:
            why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("request %s: KV transfer failed: %s", send.rid, why)
            return SendOutcome(send.rid, f"KV transfer failed: {why}", 0,
                               (time.perf_counter() - began) * 1e3)
        self.sent_bytes += sum(sizes)
        return SendOutcome(send.rid, "", sum(sizes), (time.perf_counter() - began) * 1e3)

    async def _to_rank(self, send: KVSend, addr: str, data: torch.Tensor, a: int, b: int) -> int:
        """Heads [a, b) of `data` to the rank at `addr`; the bytes it took."""
        lo = self.porter.heads[0]
        part = data[:, :, a - lo : b - lo].contiguous()
        head = wpb.KVPages(rid=send.dest_rid, key=send.key, head_start=a, head_end=b,
                           num_layers=self.porter.num_layers,
                           dtype=DTYPE_NAMES[self.porter.dtype])
        stub = self._stub(addr)
        if send.backend == "shm":
            path = Path(shm_root()) / f"radixmesh-kv-{uuid.uuid4().hex}"
            try:
                await asyncio.to_thread(_write_file, path, part)
                piece = wpb.KVPages()
                piece.CopyFrom(head)
                piece.slots.extend(send.dest_slots)
                piece.shm_path = str(path)
                ack = await stub.PutKV(_once(piece), timeout=SEND_TIMEOUT_S)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        else:
            ack = await stub.PutKV(_pieces(head, send.dest_slots, part), timeout=SEND_TIMEOUT_S)
        return ack.bytes

    def _stub(self, addr: str) -> wgrpc.WorkerStub:
        if addr not in self._stubs:
            channel = grpc.aio.insecure_channel(addr, options=_OPTIONS)
            self._stubs[addr] = (channel, wgrpc.WorkerStub(channel))
        return self._stubs[addr][1]


def _write_file(path: Path, part: torch.Tensor) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(part.view(torch.uint8).numpy().tobytes())


async def _once(piece: wpb.KVPages) -> AsyncIterator[wpb.KVPages]:
    yield piece


async def _pieces(head: wpb.KVPages, slots: list[int], part: torch.Tensor
                  ) -> AsyncIterator[wpb.KVPages]:
    """`part` [2 * layers, tokens, heads, head_dim] in pieces of whole tokens."""
    per_token = part[:, :1].numel() * part.element_size()
    step = max(1, PIECE_BYTES // per_token)
    for i in range(0, len(slots), step):
        piece = wpb.KVPages()
        piece.CopyFrom(head)
        piece.slots.extend(slots[i : i + step])
        piece.data = part[:, i : i + step].contiguous().view(torch.uint8).numpy().tobytes()
        yield piece
