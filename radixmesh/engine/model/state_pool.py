"""The linear-attention layers' per-request state (hybrid families: Qwen3-Next, Qwen3.5),
beside the KV pool that holds the attention layers' keys and values.

Each Gated DeltaNet layer (linear_attention.py) keeps, per running request, its
convolution's last `conv_kernel - 1` input columns (in the model's dtype) and its recurrent
state [num_v_heads, k_head_dim, v_head_dim] (float32). A request's slot is its row of the
runner's request table (req_table.py): the scheduler hands rows out, the runner zeroes the
slot when the request starts and frees it when the scheduler releases the request.

Unlike a token's KV, the state after token N sums up every token before it: it cannot be
cut back to a shorter prefix. So the pool also keeps snapshot slots of the same shapes,
which the scheduler's radix tree fills and reads (engine/state_snapshots.py): a step's
StateSave copies a row's state into one once the row has fed so many of the step's tokens
(the linear layers split a prompt chunk there), and a request that starts from a cached
prefix starts from the snapshot of the state at its end instead of a zero state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixmesh.core.step import StateSave
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
    doubling if a row past them comes, and `snapshots` snapshot slots of the same shapes (a
    model without linear layers holds none and only counts its slots). On the CPU its
    memory is committed as slots are first used (memory.lazy_zeros)."""

    def __init__(self, config: ModelConfig, slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", snapshots: int = 0) -> None:
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.conv: list[torch.Tensor] = []  # per linear layer [slots, conv_dim, kernel - 1]
        self.recurrent: list[torch.Tensor] = []  # per linear layer [slots, Hv, Dk, Dv]
        self.num_slots = 0
        self._used: set[int] = set()
        self._grow(max(slots, 1))
        shape = config.linear
        self.num_snapshots = snapshots if shape is not None else 0
        # Per linear layer, as conv and recurrent: the snapshot slots' states.
        self.saved_conv: list[torch.Tensor] = []
        self.saved_recurrent: list[torch.Tensor] = []
        if shape is not None and snapshots:
            for _ in config.linear_layers:
                self.saved_conv.append(lazy_zeros((snapshots, *self.conv[0].shape[1:]),
                                                  dtype, self.device))
                self.saved_recurrent.append(lazy_zeros(
                    (snapshots, *self.recurrent[0].shape[1:]), RECURRENT_DTYPE, self.device))

    @property
    def free_slots(self) -> int:
        """Slots no running request holds."""
        return self.num_slots - len(self._used)

    def admit(self, row: int, prefix: int = 0, snapshot: int = -1) -> None:
        """Start request-table row `row`'s state, for a request whose first `prefix` tokens
        are cached: from snapshot slot `snapshot`, the state after them, or (-1) from zero
        (with linear layers, only a request without a cached prefix may)."""
        if prefix and self.conv and snapshot < 0:
            raise ValueError(f"a request cannot start from a cached prefix ({prefix} tokens) "
                             "without a snapshot of its linear layers' state")
        if row >= self.num_slots:
            self._grow(row + 1)
        for i, (conv, recurrent) in enumerate(zip(self.conv, self.recurrent, strict=True)):
            if snapshot < 0:
                conv[row].zero_()
                recurrent[row].zero_()
            else:
                conv[row] = self.saved_conv[i][snapshot]
                recurrent[row] = self.saved_recurrent[i][snapshot]
        self._used.add(row)

    def save(self, row: int, slot: int) -> None:
        """Copy row `row`'s state into snapshot slot `slot`."""
        if not 0 <= slot < self.num_snapshots:
            raise ValueError(f"snapshot slot {slot} outside the pool's {self.num_snapshots}")
        for i, (conv, recurrent) in enumerate(zip(self.conv, self.recurrent, strict=True)):
            self.saved_conv[i][slot] = conv[row]
            self.saved_recurrent[i][slot] = recurrent[row]

    def save_before(self, saves: Sequence[StateSave]) -> None:
        """Take a step's saves of the state rows have as it starts (`after` 0), before it
        releases anyone."""
        for save in saves:
            if save.after == 0:
                self.save(save.row, save.slot)

    def release(self, row: int) -> None:
        """Row `row`'s request is gone: its slot is free."""
        self._used.discard(row)

    def reset(self) -> None:
        """Every slot free (a scheduler started over)."""
        self._used.clear()

    def step(self, layout: StepLayout, saves: Sequence[StateSave]) -> StateStep | None:
        """The rows a runner's step advances, and the snapshots it takes on the way (see
        StateStep.of_layout); None for a model without linear layers."""
        return StateStep.of_layout(self, layout, saves) if self.conv else None

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


class Run(NamedTuple):
    """A row that feeds `length` of a step's tokens from token `start` on, and the snapshots
    to take of its state on the way: (tokens fed, snapshot slot), in order, 0 < fed <=
    length."""

    start: int
    length: int
    row: int
    saves: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class StateStep:
    """Which request rows a step's tokens advance: `singles` (token indices, rows; device
    tensors) for the requests that feed one token, `runs` for those that feed more; and
    `kept` (rows, snapshot slots; device tensors): the singles whose state after their token
    is saved. The linear layers take each snapshot as they go."""

    pool: StatePool
    singles: tuple[torch.Tensor, torch.Tensor] | None
    runs: tuple[Run, ...]
    kept: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of_layout(cls, pool: StatePool, step: StepLayout,
                  saves: Sequence[StateSave] = ()) -> StateStep:
        """The rows a runner's step advances: its plain decodes' (a token each, first), then
        each entry's (its fed tokens); with the step's `saves` past its first token."""
        if step.trees:
            raise ValueError("draft tokens cannot be verified on a hybrid linear-attention "
                             "model: its state cannot be rolled back past a rejected one")
        inside = [save for save in saves if save.after]
        if any(not 0 <= save.slot < pool.num_snapshots for save in inside):
            raise ValueError(f"snapshot slots past the pool's {pool.num_snapshots}: {inside}")
        if not step.states:
            assert step.device_rows is not None
            rows = step.device_rows
            if any(save.after != 1 for save in inside):
                raise ValueError(f"a decode-only step feeds each row one token: {inside}")
            at = torch.arange(rows.numel(), device=rows.device)
            return cls(pool, (at, rows), (), _kept([(s.row, s.slot) for s in inside],
                                                   rows.device))
        decodes = step.num_decodes
        return cls.of(pool, [*step.decode_rows.tolist(), *(state.row for state in step.states)],
                      [*range(decodes), *step.q_starts], [*(1,) * decodes, *step.q_lens],
                      pool.device, inside)

    @classmethod
    def of(cls, pool: StatePool, rows: Sequence[int], starts: Sequence[int],
           lens: Sequence[int], device: torch.device, saves: Sequence[StateSave] = ()
           ) -> StateStep:
        """A step whose sequence i is lens[i] tokens from token starts[i] on, of row rows[i];
        each of `saves` once its row has fed `after` of them (0 < after <= lens[i])."""
        asked: dict[int, list[tuple[int, int]]] = {}
        for save in saves:
            asked.setdefault(save.row, []).append((save.after, save.slot))
        single: list[tuple[int, int]] = []
        kept: list[tuple[int, int]] = []
        runs: list[Run] = []
        for row, start, n in zip(rows, starts, lens, strict=True):
            mine = tuple(sorted(asked.pop(row, ())))
            if any(not 0 < after <= n for after, _ in mine):
                raise ValueError(f"row {row} feeds {n} tokens: no state after {mine}")
            if n == 1:
                single.append((start, row))
                kept.extend((row, slot) for _, slot in mine)
            else:
                runs.append(Run(start, n, row, mine))
        if asked:
            raise ValueError(f"state saves for rows {sorted(asked)}, which feed no token")
        if not single:
            return cls(pool, None, tuple(runs))
        at, single_rows = (torch.tensor(column, dtype=torch.long, device=device)
                           for column in zip(*single, strict=True))
        return cls(pool, (at, single_rows), tuple(runs), _kept(kept, device))


def _kept(saves: list[tuple[int, int]], device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, snapshot slots) as device tensors; None for none."""
    if not saves:
        return None
    rows, slots = (torch.tensor(column, dtype=torch.long, device=device)
                   for column in zip(*saves, strict=True))
    return rows, slots
