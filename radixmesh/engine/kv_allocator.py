"""Slot allocator of the worker's KV pool, one page at a time."""

from __future__ import annotations

from collections.abc import Collection


class KVAllocator:
    """Hands out KV-cache slots of the worker's pool, a page at a time.

    A freed page is handed out again before any page the pool has not handed out yet (the
    last freed first), and those go in ascending order: the pages in use stay packed at the
    low end of the pool, so a light load touches (and on the CPU commits the memory of) only
    as many pages as it ever held at once, however large the pool.
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
        self._freed: list[int] = []  # pages given back, reused from the end
        self._fresh = 0  # pages [_fresh, _num_pages) not handed out since the last reset
        # One byte per page rather than a set: double frees are caught in O(1) with no hashing.
        self._is_free = bytearray(self._num_pages)
        self.reset()

    def available(self) -> int:
        """Number of free slots."""
        return (len(self._freed) + self._num_pages - self._fresh) * self.page_size

    def alloc(self, num_slots: int) -> list[int] | None:
        """Slots of whole fresh pages covering num_slots, or None (allocating nothing) if short."""
        if num_slots < 0 or num_slots % self.page_size:
            raise ValueError(
                f"can only allocate a multiple of page_size {self.page_size}, got {num_slots}"
            )
        num_pages = num_slots // self.page_size
        freed, is_free = self._freed, self._is_free
        if num_pages > len(freed) + self._num_pages - self._fresh:
            return None
        reused = len(freed) - min(num_pages, len(freed))
        pages = freed[reused:]
        del freed[reused:]
        if len(pages) < num_pages:
            start = self._fresh
            self._fresh += num_pages - len(pages)
            pages.extend(range(start, self._fresh))
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
        # Insertion-ordered dict: dedups a page's several slots and keeps their order.
        pages = dict.fromkeys(slots if page_size == 1 else [s // page_size for s in slots])
        if not pages:
            return
        is_free = self._is_free
        if (min(pages) < 0 or max(pages) >= self._num_pages
                or any(map(is_free.__getitem__, pages))):
            self._refuse(slots)
        for page in pages:
            is_free[page] = 1
        self._freed.extend(pages)

    def _refuse(self, slots: Collection[int]) -> None:
        """Raise for the first slot `free` may not free: outside the pool, or free already."""
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} is outside the pool of {self.num_slots} slots")
            page = slot // self.page_size
            if self._is_free[page]:
                raise ValueError(f"double free: slot {slot} (page {page}) is already free")

    def reset(self) -> None:
        """Marks every page free again, handed out from the lowest."""
        self._freed = []
        self._fresh = 0
        self._is_free[:] = b"\x01" * self._num_pages
