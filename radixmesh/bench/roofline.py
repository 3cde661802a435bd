"""The least time a serving workload could take on this machine, and a run's share of it.

The machine's ceilings are measured at start: the GEMM rate of each path (bf16, and int8 dot
products: the quantized GEMM over GGUF weights and torch's int8 matmul, where they run) on a
prefill-sized shape, and the rate at which the cores read memory. A workload's least time is
then
  prefill  every token a perfect prefix cache would still have to compute (prompts as a trie:
           a token shared by several prompts counted once), its FLOPs through the layers and
           its attention over the tokens before it, and the first output token's logits,
           at the best GEMM rate;
  decode   the other output tokens in steps of `concurrency` requests: each step reads every
           weight once and each token's cached K/V, and computes the same FLOPs as a prefill
           token plus the logits; the steps take at least the bytes at the read rate and at
           least the FLOPs at the GEMM rate, whichever is more.
Prefill and decode are counted one after the other, as steps of each kind: the bound holds
for an engine that does not hide decode's reads under prefill's arithmetic."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixmesh.bench.workloads import Workload

if TYPE_CHECKING:
    from radixmesh.engine.model.model_config import ModelConfig


@dataclass(frozen=True)
class ModelCost:
    """What one token costs the model."""

    layer_flops: float  # through the decoder layers' matrices: 2 x their parameters
    head_flops: float  # the logits of one token: 2 x vocab x hidden
    pair_flops: float  # attention of one (query, key) pair over every layer and head
    weight_bytes: float  # every weight as served, read once by a decode step
    kv_bytes: float  # one cached token's K and V over every layer

    @classmethod
    def of(cls, config: ModelConfig, weight_bytes: float, kv_element_bytes: int = 2) -> ModelCost:
        """From a ModelConfig and the served weights' size."""
        h, d = config.hidden_size, config.head_dim
        q, kv = config.num_heads * d, config.num_kv_heads * d
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
        return cls(
            layer_flops=2.0 * per_layer * config.num_layers,
            head_flops=2.0 * config.vocab_size * h,
            pair_flops=4.0 * d * config.num_heads * config.num_layers,
            weight_bytes=float(weight_bytes),
            kv_bytes=2.0 * kv * config.num_layers * kv_element_bytes,
        )


@dataclass(frozen=True)
class Ceilings:
    """The machine's measured limits."""

    gemm_flops: dict[str, float]  # path -> FLOP/s (int8 paths: integer operations/s)
    read_bytes: float  # bytes/s

    @property
    def best_flops(self) -> float:
        return max(self.gemm_flops.values())


@dataclass(frozen=True)
class LeastTime:
    """A workload's least time and what it is made of."""

    prefill_tokens: int
    prefill_flops: float
    decode_tokens: int
    decode_steps: int
    decode_flops: float
    decode_bytes: float
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def share(self, duration_s: float) -> float:
        """The fraction of this bound that a run of `duration_s` reached."""
        return self.total_s / duration_s if duration_s > 0 else 0.0


def prefill_positions(workload: Workload) -> list[int]:
    """The position of every token a perfect prefix cache still has to prefill: first
    turns as one trie (a token shared by several prompts once), later turns whole (they
    follow each conversation's own answers)."""
    trie: dict[int, Any] = {}
    positions: list[int] = []
    for conversation in workload.conversations:
        node, pos = trie, 0
        for i, turn in enumerate(conversation.turns):
            for token in turn.new_ids:
                if i == 0 and token in node:
                    node = node[token]
                else:
                    if i == 0:
                        node[token] = {}
                        node = node[token]
                    positions.append(pos)
                pos += 1
            pos += turn.output_len
    return positions


def least_time(workload: Workload, cost: ModelCost, ceilings: Ceilings,
               concurrency: int) -> LeastTime:
    """The workload's least time at `concurrency` requests at once (module docstring)."""
    positions = prefill_positions(workload)
    requests = workload.num_requests
    # Each position p attends over p + 1 keys (itself and everything before it).
    prefill_flops = (len(positions) * cost.layer_flops + requests * cost.head_flops
                     + sum(p + 1 for p in positions) * cost.pair_flops)
    decode_tokens, keys = 0, 0
    for conversation in workload.conversations:
        pos = 0
        for turn in conversation.turns:
            pos += len(turn.new_ids)
            # Output token j (j >= 1) is decoded at position pos + j - 1 over pos + j keys.
            decode_tokens += turn.output_len - 1
            keys += sum(pos + j for j in range(1, turn.output_len))
            pos += turn.output_len
    steps = -(-decode_tokens // concurrency)
    decode_flops = decode_tokens * (cost.layer_flops + cost.head_flops) + keys * cost.pair_flops
    decode_bytes = steps * cost.weight_bytes + keys * cost.kv_bytes
    rate = ceilings.best_flops
    return LeastTime(
        prefill_tokens=len(positions), prefill_flops=prefill_flops,
        decode_tokens=decode_tokens, decode_steps=steps, decode_flops=decode_flops,
        decode_bytes=decode_bytes, prefill_s=prefill_flops / rate,
        decode_s=max(decode_bytes / ceilings.read_bytes, decode_flops / rate),
    )


# ---- measuring the ceilings (torch and the native kernels) ----------------------------------


def _rate(fn: Callable[[], Any], work: float, seconds: float = 1.0) -> float:
    """work per second of fn: the best of 5 timed stretches after a warm-up (a ceiling is
    what the machine can do; other work on the cores only ever lowers a stretch)."""
    fn()
    rates = []
    for _ in range(5):
        start, reps = time.perf_counter(), 0
        while time.perf_counter() - start < seconds / 5:
            fn()
            reps += 1
        rates.append(work * reps / (time.perf_counter() - start))
    return max(rates)


def measure_ceilings(threads: int, m: int = 512, k: int = 1536, n: int = 1536) -> Ceilings:
    """Each GEMM path's rate on an [m, k] x [k, n] product, and the read rate, with
    `threads` threads."""
    import torch

    from radixmesh.kernels import native, native_quant

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    flops = 2.0 * m * k * n
    rates = {"bf16 torch": _rate(lambda: x @ w.T, flops)}
    if native.library() is not None and native.gemm_supported(w):
        packed = native.pack_gemm_weight(w)
        rates["bf16 native"] = _rate(lambda: native.gemm(x, packed, n, None), flops)
    if native_quant.supported():
        q8 = native_quant.QuantizedWeight.quantize_q8_0(w.float())
        rates[f"int8 quantized GEMM ({native_quant.isa()})"] = _rate(
            lambda: native_quant.linear(x, [q8]), flops)
    xi = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    wi = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)
    with contextlib.suppress(RuntimeError):  # no int8 matmul in this build of torch
        rates["int8 torch"] = _rate(lambda: torch._int_mm(xi, wi), flops)
    big = torch.ones(128 * 2**20, dtype=torch.float32)  # 512 MiB, far past the caches
    read = _rate(lambda: big.sum(), float(big.numel() * 4), seconds=2.0)
    return Ceilings(gemm_flops=rates, read_bytes=read)
