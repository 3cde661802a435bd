"""How many tokens the worker's KV pool holds: max_total_tokens when it is set, else a rule
over the model's shape, the engine's limits and the memory the device has (see
KVSettings.max_total_tokens). The runner decides it once, after the weights are on the
device; the scheduler takes the pool's size from the runner (in process) or from the
worker's info (in the mesh), so the two never disagree.

A hybrid linear-attention model's KV pool holds its attention layers alone; its linear
layers' state pool (state_pool.py), a slot per running request and SNAPSHOTS_PER_REQUEST
snapshot slots per running request for the radix cache, comes out of the same memory
first."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixmesh.core.settings import TYPICAL_REQUEST_TOKENS, KVSettings
from radixmesh.engine.model.memory import Memory, device_memory
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.parallel import TensorParallel
from radixmesh.engine.model.state_pool import request_state_bytes

log = logging.getLogger("radixmesh.worker")

# A hybrid model's state slots when the pool is sized in tokens alone (more are added as
# rows past them come).
DEFAULT_STATE_SLOTS = 16
# A hybrid model's snapshot slots per state slot: the radix cache's snapshots of prefixes'
# states (with page_size > 1, a decoding request keeps one of its own too).
SNAPSHOTS_PER_REQUEST = 2


@dataclass(frozen=True)
class PoolSize:
    """The pool's size in tokens, what one token's K and V take in all its attention
    layers, and why; a hybrid model's state pool beside it: its slots (running requests),
    its snapshot slots, and what one request's state takes in all its linear layers."""

    tokens: int
    token_bytes: int
    reason: str
    state_slots: int = 0
    state_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.tokens * self.token_bytes

    @property
    def snapshot_slots(self) -> int:
        return SNAPSHOTS_PER_REQUEST * self.state_slots

    @property
    def state_nbytes(self) -> int:
        return (self.state_slots + self.snapshot_slots) * self.state_bytes

    def __str__(self) -> str:
        kv = (f"KV pool: {self.tokens:,} tokens x {self.token_bytes:,} bytes = "
              f"{self.nbytes / 2**30:.2f} GiB, {self.reason}")
        if not self.state_bytes:
            return kv
        return (f"{kv}; state pool: {self.state_slots:,} requests + {self.snapshot_slots:,} "
                f"snapshots x {self.state_bytes:,} bytes = {self.state_nbytes / 2**30:.2f} GiB")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def auto_pool_size(settings: KVSettings, model_context: int, token_bytes: int, memory: Memory,
                   on_cpu: bool, ranks: int = 1, state_bytes: int = 0) -> PoolSize:
    """The pool's size when max_total_tokens is not set.

    Memory bounds it: with mem_fraction_static f, the weights and the pools may take f of
    the device's memory, so the pool gets what is free now (the weights loaded) less the
    (1 - f) share of the total that stays for activations and everything else, less the
    state pool (`state_bytes` a slot, max_running_requests of them and their snapshot
    slots). `ranks` tensor-parallel ranks share that memory (a CPU host's). On a GPU the
    pool takes all of it; on the CPU no more than max_running_requests requests of
    TYPICAL_REQUEST_TOKENS (or the context, when shorter) need, since its memory is the
    host's. Never less than one request of the whole context and a page."""
    page = settings.page_size
    context = settings.context_limit(model_context)
    states = (1 + SNAPSHOTS_PER_REQUEST) * settings.max_running_requests * state_bytes * ranks
    budget = max(memory.available - int((1 - settings.mem_fraction_static) * memory.total)
                 - states, 0)
    by_memory = budget // (token_bytes * ranks) // page * page
    memory_note = (f"mem_fraction_static {settings.mem_fraction_static:g} leaves "
                   f"{_gib(budget)} of the {_gib(memory.available)} free of {_gib(memory.total)}")
    if states:
        memory_note += f" once the state pool's {_gib(states)} is taken"
    tokens, reason = by_memory, f"bound by memory ({memory_note})"
    if on_cpu:
        each = min(context, TYPICAL_REQUEST_TOKENS)
        by_requests = -(-settings.max_running_requests * each // page) * page
        if by_requests <= by_memory:
            tokens = by_requests
            reason = (f"bound by the requests ({settings.max_running_requests} "
                      f"max_running_requests x {each:,} tokens; memory allows {by_memory:,}: "
                      f"{memory_note})")
    floor = -(-context // page) * page + page
    if tokens < floor:
        tokens, reason = floor, (f"raised to one request of the whole context ({context:,} "
                                 f"tokens) from {tokens:,}, {reason}")
    return PoolSize(tokens, token_bytes, reason, settings.max_running_requests if state_bytes
                    else 0, state_bytes)


def size_pool(sizing: int | KVSettings, shard: ModelConfig, dtype: torch.dtype,
              device: torch.device, tp: TensorParallel | None = None) -> PoolSize:
    """The pool of this rank (its `shard` of the model's KV heads): `sizing` tokens, or as
    the settings say, and a hybrid model's state pool of max_running_requests slots
    (DEFAULT_STATE_SLOTS with `sizing` tokens); logged. The ranks of a group agree on the
    smallest of their sizes."""
    token_bytes = (shard.num_kv_layers * shard.num_kv_heads * sum(shard.kv_cache_dims)
                   * dtype.itemsize)
    state_bytes = request_state_bytes(shard, dtype)
    if isinstance(sizing, int):
        size = PoolSize(sizing, token_bytes, "as given",
                        DEFAULT_STATE_SLOTS if state_bytes else 0, state_bytes)
    elif sizing.max_total_tokens is not None:
        tokens = sizing.max_total_tokens - sizing.max_total_tokens % sizing.page_size
        size = PoolSize(tokens, token_bytes, "set by max_total_tokens",
                        sizing.max_running_requests if state_bytes else 0, state_bytes)
    else:
        on_cpu = device.type != "cuda"
        ranks = tp.size if on_cpu and tp is not None else 1
        size = auto_pool_size(sizing, shard.max_position_embeddings, token_bytes,
                              device_memory(device), on_cpu, ranks, state_bytes)
        agreed = size.tokens if tp is None else tp.smallest(size.tokens)
        if agreed < size.tokens:
            size = PoolSize(agreed, token_bytes, f"the smallest rank's size (this rank's "
                            f"would be {size.tokens:,}, {size.reason})", size.state_slots,
                            state_bytes)
    log.info("%s", size)
    return size
