"""Slot allocator of the worker's KV pool, one page at a time."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection


class KVAllocator:
    """Hands out KV-cache slots of the worker's pool, a page at a time.

    Free pages are reused first in, first out: at start (and after reset) pages go out in
    ascending order, and a freed page joins the back of the queue, so recently freed KV is
    overwritten last.
    """

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_slots < 1 or num_slots % page_size:
            raise ValueError(
                f"num_slots must be a positive multiple of page_size {page_size}, got {num_slots}"
            )
        self.page_size = page_size
        self.num_slots = num_slots
        self._num_pages = num_slots // page_size
        self._free_pages: deque[int] = deque()
        # One byte per page rather than a set: double frees are caught in O(1) with no hashing.
        self._is_free = bytearray(self._num_pages)
        self.reset()

    def available(self) -> int:
        """Number of free slots."""
        return len(self._free_pages) * self.page_size

    def alloc(self, num_slots: int) -> list[int] | None:
        """Slots of whole fresh pages covering num_slots, or None (allocating nothing) if short."""
        if num_slots < 0 or num_slots % self.page_size:
            raise ValueError(
                f"can only allocate a multiple of page_size {self.page_size}, got {num_slots}"
            )
        num_pages = num_slots // self.page_size
        if num_pages > len(self._free_pages):
            return None
        free, is_free = self._free_pages, self._is_free
        pages = [free.popleft() for _ in range(num_pages)]
        for page in pages:
            is_free[page] = 0
        if self.page_size == 1:
            return pages
        slots: list[int] = []
        for page in pages:
            start = page * self.page_size
            slots.extend(range(start, start + self.page_size))
        return slots

    def free(self, slots: Collection[int]) -> None:
        """Frees every page any of the slots belongs to; all or nothing on error."""
        page_size = self.page_size
        # Insertion-ordered dict: dedups a page's several slots and keeps the reuse order stable.
        pages = dict.fromkeys(slots if page_size == 1 else [s // page_size for s in slots])
        if not pages:
            return
        is_free = self._is_free
        if (min(pages) < 0 or max(pages) >= self._num_pages
                or any(map(is_free.__getitem__, pages))):
            self._refuse(slots)
        for page in pages:
            is_free[page] = 1
        self._free_pages.extend(pages)

    def _refuse(self, slots: Collection[int]) -> None:
        """Raise for the first slot `free` may not free: outside the pool, or free already."""
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} is outside the pool of {self.num_slots} slots")
            page = slot // self.page_size
            if self._is_free[page]:
                raise ValueError(f"double free: slot {slot} (page {page}) is already free")

    def reset(self) -> None:
        """Marks every page free again."""
        self._free_pages = deque(range(self._num_pages))
        self._is_free[:] = b"\x01" * self._num_pages
