"""Copies of KV between the worker's device pool and the engine's host (L2) pool.

The host pool is a file cachectl created in a tmpfs directory (radixmesh.core.hicache): it is
mapped shared, so the scheduler, cachectl and the other tensor-parallel ranks see the bytes
this rank writes. Each rank copies only its own KV heads of every host slot.

A load runs on the step's thread before the forward. A backup starts after the forward and
finishes on a copy thread while the next steps run: on the CPU that thread does the whole
copy; on CUDA a side stream, ordered after the step's kernels by an event, gathers the slots
into pinned memory and the copy thread waits for that stream and writes the host slots. The
step never waits for a backup; each result lists the backups that finished since the last.

What the scheduler guarantees: it reads back only host slots whose backup it was told is
done, and reuses a device slot only once the backups reading it are done.

Both pools are addressed as rows of machine words: one row is one slot's heads of one layer's
K or V. Index kernels copy element by element, so the widest word that divides a head is
several times faster than the KV dtype itself; moving whole words changes no bit."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from radixmesh.core.hicache import DTYPE_BYTES, LAYOUTS, HostPoolSpec
from radixmesh.core.step import KVCopy
from radixmesh.engine.model.kv_pool import KVPool

# Widest first: 16, 8, 4 and 2 bytes.
_WORDS = (torch.complex128, torch.int64, torch.int32, torch.int16)


@dataclass(frozen=True)
class _Mapping:
    """A mapped host pool."""

    spec: HostPoolSpec
    rows: torch.Tensor  # [rows, words]: this rank's heads of each (slot, layer, K or V)


class HostCopier:
    """Runs a step's KVCopy list against `pool`, whose heads are this rank's share
    [rank * h, (rank + 1) * h) of the model's `total_kv_heads`."""

    def __init__(self, pool: KVPool, total_kv_heads: int, rank: int = 0) -> None:
        first = pool.k[0]
        self.device = first.device
        self.dtype = first.dtype
        self.num_layers = len(pool.k)
        self.num_slots = pool.num_slots
        heads, self.head_dim = first.shape[1], first.shape[2]
        self.total_kv_heads = total_kv_heads
        self.heads = (rank * heads, (rank + 1) * heads)
        head_bytes = self.head_dim * first.element_size()
        self._word = next(w for w in _WORDS if head_bytes % w.itemsize == 0)
        # Each layer's K then V: the order of a slot's rows in the host pool (a latent
        # attention pool keeps no V: its K alone).
        self._device_rows = [
            t.view(self.num_slots, -1).view(self._word)
            for kv in zip(pool.k, pool.v, strict=True)
            for t in kv if t.shape[-1]
        ]
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._mapping: _Mapping | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, Future[None]]] = []  # backups, in the order started

    def map(self, spec: HostPoolSpec) -> None:
        """Map `spec`'s segment in place of the one mapped. Backups still running into the old
        one are finished first and reported as usual: every backup is reported exactly once,
        and the scheduler that sent the new pool knows which pool they went to."""
        self._check(spec)
        self.wait()
        size = os.stat(spec.path).st_size
        if size != spec.nbytes:
            # from_file would silently grow a short file instead of failing.
            raise ValueError(f"host pool {spec.path} holds {size} bytes, its spec {spec.nbytes}")
        flat = torch.from_file(
            spec.path, shared=True, size=spec.nbytes // DTYPE_BYTES[spec.geometry.dtype],
            dtype=self.dtype,
        )
        # Either layout is a sequence of rows of every head, one per (slot, layer, K or V).
        rows = flat.view(spec.shape()).view(-1, self.total_kv_heads * self.head_dim)
        lo, hi = (h * self.head_dim for h in self.heads)
        self._mapping = _Mapping(spec, rows[:, lo:hi].view(self._word))
        if self._thread is None:
            self._thread = _copy_thread()

    def _check(self, spec: HostPoolSpec) -> None:
        g = spec.geometry
        ours = (self.num_layers, self.total_kv_heads, self.head_dim, self.dtype)
        theirs = (g.num_layers, g.num_kv_heads, g.head_dim, getattr(torch, g.dtype, None))
        if g.dtype not in DTYPE_BYTES or theirs != ours:
            raise ValueError(
                f"host pool geometry {g} does not fit this model's KV: {self.num_layers} layers, "
                f"{self.total_kv_heads} KV heads of {self.head_dim}, {self.dtype}"
            )
        if spec.layout not in LAYOUTS or spec.num_slots % g.page_size:
            raise ValueError(f"host pool {spec.name}: bad layout or size in {spec}")

    def load(self, copies: list[KVCopy]) -> None:
        """Copy host slots into device slots, ahead of this step's forward on its stream."""
        for copy in copies:
            mapping = self._mapped()
            rows, device_slots = self._indices(copy, mapping.spec)
            # On the CPU one buffer serves every layer (each is scattered before the next is
            # gathered); a copy to CUDA from pinned memory runs later, so each needs its own.
            parts = len(self._device_rows) if self._cuda else 1
            staged = self._empty(parts, len(device_slots), pinned=self._cuda)
            device_slots = device_slots.to(self.device)
            for j, dst in enumerate(self._device_rows):
                buf = staged[j % parts]
                torch.index_select(mapping.rows, 0, rows[j], out=buf)
                dst.index_copy_(0, device_slots, buf.to(self.device, non_blocking=True))

    def start_backups(self, copies: list[KVCopy]) -> None:
        """Start copying device slots into host slots, after the step's work so far."""
        for copy in copies:
            mapping = self._mapped()
            rows, device_slots = self._indices(copy, mapping.spec)
            if self._stream is None:
                job = self._backup_on_cpu(mapping, rows, device_slots)
            else:
                job = self._backup_on_cuda(self._stream, mapping, rows, device_slots)
            assert self._thread is not None  # started with the first mapping
            self._pending.append((copy.copy_id, self._thread.submit(job)))

    def _backup_on_cpu(
        self, mapping: _Mapping, rows: torch.Tensor, device_slots: torch.Tensor
    ) -> Callable[[], None]:
        @torch.inference_mode()  # a pool mapped during a step is an inference tensor
        def job() -> None:
            buf = self._empty(1, len(device_slots), pinned=False)[0]
            for j, src in enumerate(self._device_rows):
                torch.index_select(src, 0, device_slots, out=buf)
                mapping.rows.index_copy_(0, rows[j], buf)

        return job

    def _backup_on_cuda(
        self,
        stream: torch.cuda.Stream,
        mapping: _Mapping,
        rows: torch.Tensor,
        device_slots: torch.Tensor,
    ) -> Callable[[], None]:
        ready = torch.cuda.Event()
        ready.record()  # on the step's stream, after its kernels
        staged = self._empty(len(self._device_rows), len(device_slots), pinned=True)
        copied = torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            # From pinned memory: a copy from pageable memory would wait for the forward.
            device_slots = device_slots.pin_memory().to(self.device, non_blocking=True)
            gathered = torch.empty(staged.shape, dtype=self._word, device=self.device)
            for j, src in enumerate(self._device_rows):
                torch.index_select(src, 0, device_slots, out=gathered[j])
            staged.copy_(gathered, non_blocking=True)
            copied.record()

        @torch.inference_mode()  # a pool mapped during a step is an inference tensor
        def job() -> None:
            copied.synchronize()  # blocks the copy thread only
            for j in range(len(self._device_rows)):
                mapping.rows.index_copy_(0, rows[j], staged[j])

        return job

    def finished(self) -> list[int]:
        """Ids of the backups that finished since the last call; a failed one raises."""
        done: list[int] = []
        running: list[tuple[int, Future[None]]] = []
        for copy_id, future in self._pending:
            if future.done():
                future.result()
                done.append(copy_id)
            else:
                running.append((copy_id, future))
        self._pending = running
        return done

    def wait(self) -> None:
        """Block until every backup started has finished (finished() still reports them)."""
        for _, future in self._pending:
            future.result()

    def _mapped(self) -> _Mapping:
        if self._mapping is None:
            raise RuntimeError("a KV copy came before any host pool was mapped")
        return self._mapping

    def _indices(self, copy: KVCopy, spec: HostPoolSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """The host pool rows [2 * layers, n] and the device slots [n] of a copy (on the CPU)."""
        host = _slots(copy.host_slots, spec.num_slots, "host")
        device = _slots(copy.device_slots, self.num_slots, "device")
        if len(host) != len(device):
            raise ValueError(
                f"copy {copy.copy_id}: {len(device)} device slots but {len(host)} host slots"
            )
        if spec.layout == "layer_first":
            first, stride = host, spec.num_slots
        else:
            size = spec.geometry.page_size
            first, stride = host // size * (2 * self.num_layers * size) + host % size, size
        return first + stride * torch.arange(len(self._device_rows)).unsqueeze(1), device

    def _empty(self, parts: int, slots: int, pinned: bool) -> torch.Tensor:
        words = self._device_rows[0].shape[1]
        return torch.empty((parts, slots, words), dtype=self._word, pin_memory=pinned)


def _slots(slots: list[int], limit: int, pool: str) -> torch.Tensor:
    """`slots` as an index tensor; an out-of-range slot would land in another layer's rows."""
    index = torch.tensor(slots, dtype=torch.long)
    if len(slots) and (min(slots) < 0 or max(slots) >= limit):
        raise IndexError(f"{pool} slots must be in [0, {limit}), got {min(slots)}..{max(slots)}")
    return index


def _one_thread() -> None:
    # A thread takes the process-wide default on its first torch call: take it before
    # setting our own, which sets that default too (the caller gives it back).
    torch.get_num_threads()
    torch.set_num_threads(1)


def _copy_thread() -> ThreadPoolExecutor:
    """The backup thread. Its torch calls use one thread, so it starts no second OpenMP team
    competing with the model's."""
    threads = torch.get_num_threads()
    executor = ThreadPoolExecutor(1, "radixmesh-host-copy", initializer=_one_thread)
    executor.submit(int).result()  # runs the initializer now
    torch.set_num_threads(threads)
    return executor
