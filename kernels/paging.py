"""Page tables: how the attention kernels find a request's tokens in the KV pool."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def table_slots(row: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """Slots of the first n tokens named by one page-table row."""
    pos = torch.arange(n, device=row.device)
    return row[pos // page_size].long() * page_size + pos % page_size


def page_table(
    slots: Sequence[torch.Tensor], page_size: int, width: int | None = None
) -> torch.Tensor:
    """Each request's token slots -> an int32 [B, width] table, zero padded.

    With page_size > 1 every page must be whole and in order (slot = page * page_size +
    offset), which is how the scheduler allocates pages; anything else is an error."""
    rows = [_pages(s, page_size) for s in slots]
    width = max((r.numel() for r in rows), default=0) if width is None else width
    table = torch.zeros(len(rows), max(width, 1), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : r.numel()] = r
    return table


def _pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    if page_size == 1:
        return slots
    pages = slots[::page_size] // page_size
    if not torch.equal(table_slots(pages, slots.numel(), page_size), slots.long()):
        raise ValueError(f"slots are not whole pages of {page_size} in order")
    return pages
