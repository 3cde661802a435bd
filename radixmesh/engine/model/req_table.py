"""The runner's request table: each running request's KV slots and token ids by position,
its length, the token it sampled last and its LoRA adapter's slot, one row per request.

A step writes what it adds (a scatter of its new slots and tokens) and the attention
kernels read their rows from here; nothing is rebuilt per step. The scheduler hands rows
out (NewRequest.row) and takes them back when it releases a request."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ReqTable:
    """Rows of [slot, token] by position, grown by doubling in both directions."""

    def __init__(
        self, device: torch.device | str = "cpu", rows: int = 16, width: int = 256
    ) -> None:
        self.device = torch.device(device)
        self.slots = self._ints(rows, width)  # KV slot of each position (req_to_token)
        self.tokens = self._ints(rows, width)  # token id of each position
        self.last = torch.zeros(rows, dtype=torch.long, device=self.device)  # last sampled
        self.lens = torch.zeros(rows, dtype=torch.long)  # positions filled, on the host
        self.lora = torch.full((rows,), -1, dtype=torch.long)  # LoRA slot (-1: none), host

    @property
    def width(self) -> int:
        return self.slots.shape[1]

    def admit(self, row: int, ids: Sequence[int], slots: Sequence[int], lora: int = -1
              ) -> None:
        """Start a row over with a request's cached prefix (and its LoRA slot, if any)."""
        self._fit(row + 1, 0)
        self.lens[row] = 0
        self.lora[row] = lora
        self.append(row, ids, slots)

    def append(self, row: int, ids: Sequence[int] | torch.Tensor, slots: Sequence[int]) -> int:
        """Add tokens (ids: a host list, or a device tensor) and their slots after the
        row's last position; returns the first new position."""
        self._fit(row + 1, 0)
        start = int(self.lens[row])
        end = start + len(slots)
        self._fit(0, end)
        if end > start:
            self.slots[row, start:end] = self._tensor(slots)
            tokens = ids if isinstance(ids, torch.Tensor) else self._tensor(ids)
            self.tokens[row, start:end] = tokens
        self.lens[row] = end
        return start

    def decode_positions(self, rows: torch.Tensor) -> torch.Tensor:
        """One decode per row (host rows [B]): the positions they write (host), each the row's
        next, now counted in its length; write_decodes fills them."""
        positions = self.lens.index_select(0, rows)
        self._fit(int(rows.max()) + 1, int(positions.max()) + 1)
        self.lens.index_copy_(0, rows, positions + 1)
        return positions

    def write_decodes(self, rows: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor) -> None:
        """Each row's new slot at its position, and its last sampled token, which it feeds
        (all on the device)."""
        at = (rows, positions)
        self.slots.index_put_(at, slots.to(torch.int32))
        self.tokens.index_put_(at, self.last.index_select(0, rows).to(torch.int32))

    def index(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The first `width` slots of each of `rows` (device) as an int32 [B, width] tensor."""
        self._fit(0, width)
        return self.slots[:, :width].index_select(0, rows)

    def row_slots(self, row: int) -> torch.Tensor:
        """Every filled slot of one row."""
        return self.slots[row, : int(self.lens[row])]

    def row_tokens(self, row: int, start: int = 0, end: int | None = None) -> list[int]:
        """Token ids of one row's positions [start, end) (end: its length)."""
        stop = int(self.lens[row]) if end is None else end
        return self.tokens[row, start:stop].tolist()

    def truncate(self, row: int, length: int) -> None:
        """Forget a row's positions past `length` (rejected draft nodes)."""
        self.lens[row] = length

    def _fit(self, rows: int, width: int) -> None:
        """Grow to at least `rows` rows of `width` positions, keeping what is there."""
        have_rows, have_width = self.slots.shape
        if rows <= have_rows and width <= have_width:
            return
        new_rows, new_width = have_rows, have_width
        while new_rows < rows:
            new_rows *= 2
        while new_width < width:
            new_width *= 2
        for name in ("slots", "tokens"):
            old = getattr(self, name)
            grown = self._ints(new_rows, new_width)
            grown[:have_rows, :have_width] = old
            setattr(self, name, grown)
        if new_rows > have_rows:
            self.last = torch.cat([self.last, self.last.new_zeros(new_rows - have_rows)])
            self.lens = torch.cat([self.lens, self.lens.new_zeros(new_rows - have_rows)])
            self.lora = torch.cat([self.lora, self.lora.new_full((new_rows - have_rows,), -1)])

    def _ints(self, rows: int, width: int) -> torch.Tensor:
        return torch.zeros(rows, width, dtype=torch.int32, device=self.device)

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)
