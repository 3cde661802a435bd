"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (CUDA only)."""

from __future__ import annotations

import logging
import time

import torch

from radixmesh.engine.model.attention import AttentionMetadata, in_order
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.lora import LoraBatch, LoraPool
from radixmesh.engine.model.model import CausalLM
from radixmesh.engine.model.triton_attention import DecodeTables, TritonAttention

log = logging.getLogger("radixmesh.worker")


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to 256 and every 16 past
    it, and max_batch itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, min(max_batch, 257), 8))
    sizes += list(range(272, max_batch, 16))
    return [*(b for b in sizes if b < max_batch), max_batch]


class DecodeGraphs:
    """Runs a decode-only step padded up to the nearest bucket, from fixed input buffers.

    Every bucket's step reads token ids, positions and DecodeTables from the same buffers,
    so a graph captured once per bucket replays any batch that fits. Padding rows write no
    KV (slot -1) and attend to nothing (length 0). With LoRA adapters (attach_lora) each
    bucket has a second graph that also reads each row's adapter slot from a buffer (-1:
    none, as for padding rows). With capture=False (the default off CUDA) the same padded
    step runs eagerly, which is how its correctness is tested."""

    def __init__(
        self,
        model: CausalLM,
        attention: TritonAttention,
        pool: KVPool,
        max_batch: int,
        max_context: int,
        capture: bool | None = None,
    ) -> None:
        device = model.device
        self.model, self.attention, self.pool = model, attention, pool
        self.buckets = batch_buckets(max_batch)
        self.max_context = max_context
        pages = -(-max_context // attention.page_size)
        self.tables = DecodeTables.empty(max_batch, pages, device)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.lora: LoraPool | None = None
        self.lora_slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        # Keyed by (bucket, with adapters).
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self._memory = None  # the graphs' shared memory pool
        if capture is None:
            capture = device.type == "cuda"
        self.capture = capture
        if capture:
            self._capture_all(False)

    def attach_lora(self, pool: LoraPool) -> None:
        """Steps may carry LoRA adapters from now on: capture their graphs too."""
        self.lora = pool
        if self.capture:
            self._capture_all(True)

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether this step can run here: decode only (sequence b at row b), within the
        batch and context caps."""
        if not 0 < meta.num_seqs <= self.buckets[-1]:
            return False
        if meta.decode_only:
            return meta.kv_index.shape[1] <= self.max_context
        return (
            bool((meta.q_lens == 1).all())
            and int(meta.kv_lens.max()) <= self.max_context
            and in_order(meta.q_starts)
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, hidden] of a step that fits (each row's LoRA adapter slot
        in `lora_slots`, if any); valid until the next run."""
        n = meta.num_seqs
        bucket = next(b for b in self.buckets if b >= n)
        for buf, values in ((self.input_ids, input_ids), (self.positions, positions)):
            buf[:n].copy_(values)
            buf[n:bucket].zero_()
        adapters = lora_slots is not None
        if lora_slots is not None:
            self.lora_slots[:n].copy_(lora_slots)
            self.lora_slots[n:bucket].fill_(-1)
        self.attention.write_decode(meta, self.tables.narrow(bucket))
        graph = self._graphs.get((bucket, adapters))
        if graph is None:
            return self._step(bucket, adapters)[:n]
        graph.replay()
        return self._outputs[(bucket, adapters)][:n]

    def _step(self, bucket: int, adapters: bool) -> torch.Tensor:
        self.attention.bind_decode(self.tables.narrow(bucket))
        lora = None
        if adapters:
            assert self.lora is not None
            lora = LoraBatch(self.lora, self.lora_slots[:bucket])
        return self.model.forward(
            self.input_ids[:bucket], self.positions[:bucket], self.attention, self.pool, lora
        )

    def _capture_all(self, adapters: bool) -> None:
        memory = self._memory
        began = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        # Largest first, sharing one memory pool: smaller graphs reuse what it reserved.
        for bucket in reversed(self.buckets):
            # Warm up on a side stream, as capture needs: kernels compile and libraries
            # set up their workspaces outside the graph.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step(bucket, adapters)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                self._outputs[(bucket, adapters)] = self._step(bucket, adapters)
            memory = graph.pool()
            self._graphs[(bucket, adapters)] = graph
        self._memory = memory
        used = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        log.info("captured CUDA graphs for decode batches %s%s in %.1f s (%.0f MiB)",
                 ", ".join(map(str, self.buckets)), " with LoRA adapters" if adapters else "",
                 time.perf_counter() - began, used)
