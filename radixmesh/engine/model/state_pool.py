"""The linear-attention layers' per-request state (hybrid families: Qwen3-Next, Qwen3.5),
beside the KV pool that holds the attention layers' keys and values.

Each Gated DeltaNet layer (linear_attention.py) keeps, per running request, its
convolution's last `conv_kernel - 1` input columns (in the model's dtype) and its recurrent
state [num_v_heads, k_head_dim, v_head_dim] (float32). A request's slot is its row of the
runner's request table (req_table.py): the scheduler hands rows out, the runner zeroes the
slot when the request starts and frees it when the scheduler releases the request. Unlike a
token's KV, the state after token N sums up every token before it: it cannot be cut back to
a shorter prefix, so a request always starts from a zero state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.model.memory import lazy_zeros
from radixmesh.engine.model.model_config import ModelConfig

if TYPE_CHECKING:
    from radixmesh.engine.model.step_sampler import StepLayout

# The recurrent state's dtype, whatever the activations': it accumulates every token.
RECURRENT_DTYPE = torch.float32


def request_state_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """The bytes one request's state takes in every linear layer (0: no linear layer)."""
    shape = config.linear
    if shape is None:
        return 0
    conv = shape.conv_dim * (shape.conv_kernel - 1) * dtype.itemsize
    recurrent = (shape.num_v_heads * shape.k_head_dim * shape.v_head_dim
                 * RECURRENT_DTYPE.itemsize)
    return len(config.linear_layers) * (conv + recurrent)


class StatePool:
    """Conv and recurrent state of `config`'s linear layers for `slots` requests, grown by
    doubling if a row past them comes (a model without linear layers holds none and only
    counts its slots). On the CPU its memory is committed as slots are first used
    (memory.lazy_zeros)."""

    def __init__(self, config: ModelConfig, slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.conv: list[torch.Tensor] = []  # per linear layer [slots, conv_dim, kernel - 1]
        self.recurrent: list[torch.Tensor] = []  # per linear layer [slots, Hv, Dk, Dv]
        self.num_slots = 0
        self._used: set[int] = set()
        self._grow(max(slots, 1))

    @property
    def free_slots(self) -> int:
        """Slots no running request holds."""
        return self.num_slots - len(self._used)

    def admit(self, row: int, prefix: int = 0) -> None:
        """Start request-table row `row`'s state from zero, for a request whose first
        `prefix` tokens are cached (none can be, in a model with linear layers)."""
        if prefix and self.conv:
            raise ValueError(f"a request cannot start from a cached prefix ({prefix} tokens) "
                             "on a hybrid linear-attention model: its state is not cached")
        if row >= self.num_slots:
            self._grow(row + 1)
        for conv, recurrent in zip(self.conv, self.recurrent, strict=True):
            conv[row].zero_()
            recurrent[row].zero_()
        self._used.add(row)

    def release(self, row: int) -> None:
        """Row `row`'s request is gone: its slot is free."""
        self._used.discard(row)

    def reset(self) -> None:
        """Every slot free (a scheduler started over)."""
        self._used.clear()

    def _grow(self, slots: int) -> None:
        size = max(slots, 2 * self.num_slots)
        shape = self.config.linear
        if shape is not None:
            layers = len(self.config.linear_layers)
            conv = (size, shape.conv_dim, shape.conv_kernel - 1)
            recurrent = (size, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim)
            self.conv = [_grown(self.conv[i] if self.conv else None, conv, self.dtype,
                                self.device) for i in range(layers)]
            self.recurrent = [_grown(self.recurrent[i] if self.recurrent else None, recurrent,
                                     RECURRENT_DTYPE, self.device) for i in range(layers)]
        self.num_slots = size


def _grown(old: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    new = lazy_zeros(shape, dtype, device)
    if old is not None:
        new[: old.shape[0]] = old
    return new


@dataclass(frozen=True)
class StateStep:
    """Which request rows a step's tokens advance: `singles` (token indices, rows; device
    tensors) for the requests that feed one token, `runs` (first token, tokens, row) for
    those that feed a prompt chunk."""

    pool: StatePool
    singles: tuple[torch.Tensor, torch.Tensor] | None
    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def decodes(cls, pool: StatePool, rows: torch.Tensor) -> StateStep:
        """A step of one-token decodes of `rows` (device), token i of row rows[i]."""
        at = torch.arange(rows.numel(), device=rows.device)
        return cls(pool, (at, rows), ())

    @classmethod
    def of_layout(cls, pool: StatePool, step: StepLayout) -> StateStep:
        """The rows a runner's step advances: its plain decodes' (a token each, first), then
        each entry's (its fed tokens)."""
        if step.trees:
            raise ValueError("draft tokens cannot be verified on a hybrid linear-attention "
                             "model: its state cannot be rolled back past a rejected one")
        if not step.states:
            assert step.device_rows is not None
            return cls.decodes(pool, step.device_rows)
        decodes = step.num_decodes
        return cls.of(pool, [*step.decode_rows.tolist(), *(state.row for state in step.states)],
                      [*range(decodes), *step.q_starts], [*(1,) * decodes, *step.q_lens],
                      pool.device)

    @classmethod
    def of(cls, pool: StatePool, rows: Sequence[int], starts: Sequence[int],
           lens: Sequence[int], device: torch.device) -> StateStep:
        """A step whose sequence i is lens[i] tokens from token starts[i] on, of row rows[i]."""
        single = [(start, row) for row, start, n in zip(rows, starts, lens, strict=True)
                  if n == 1]
        runs = tuple((start, n, row) for row, start, n in zip(rows, starts, lens, strict=True)
                     if n > 1)
        if not single:
            return cls(pool, None, runs)
        at, single_rows = (torch.tensor(column, dtype=torch.long, device=device)
                           for column in zip(*single, strict=True))
        return cls(pool, (at, single_rows), runs)
