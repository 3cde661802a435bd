"""KVAllocator: whole pages, freed pages reused first, double frees caught."""

import pytest

from radixmesh.engine.kv_allocator import KVAllocator


def test_alloc_hands_out_ascending_slots_then_none_when_short():
    allocator = KVAllocator(8)
    assert allocator.available() == 8
    assert allocator.alloc(3) == [0, 1, 2]
    assert allocator.alloc(5) == [3, 4, 5, 6, 7]
    assert allocator.available() == 0
    assert allocator.alloc(1) is None
    assert allocator.alloc(0) == []


def test_alloc_none_allocates_nothing():
    allocator = KVAllocator(8, page_size=2)
    assert allocator.alloc(6) == [0, 1, 2, 3, 4, 5]
    assert allocator.alloc(4) is None
    assert allocator.available() == 2
    assert allocator.alloc(2) == [6, 7]


def test_pages_are_whole_and_consecutive():
    allocator = KVAllocator(16, page_size=4)
    assert allocator.alloc(8) == [0, 1, 2, 3, 4, 5, 6, 7]
    allocator.free([4])
    allocator.free([0, 1, 2, 3])
    assert allocator.available() == 16
    # Freed pages first (the last freed first), then the lowest of those never handed out.
    assert allocator.alloc(4) == [0, 1, 2, 3]
    assert allocator.alloc(12) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


def test_a_light_load_stays_in_the_low_pages():
    """Requests that come and go reuse the slots the last ones gave back: the highest slot
    ever handed out is the most ever held at once, not the pool's end."""
    allocator = KVAllocator(1 << 16)
    highest = 0
    for length in [5, 17, 3, 40, 9] * 20:
        slots = allocator.alloc(length)
        assert slots is not None
        highest = max(highest, *slots)
        allocator.free(slots)
    assert highest == 39
    assert allocator.available() == 1 << 16
    again = allocator.alloc(40)
    assert again is not None and sorted(again) == list(range(40))
    assert allocator.alloc(1) == [40]


def test_free_of_a_partial_page_frees_the_page():
    allocator = KVAllocator(8, page_size=4)
    slots = allocator.alloc(8)
    assert slots is not None
    allocator.free([5, 6])
    assert allocator.available() == 4
    with pytest.raises(ValueError, match="slot 7"):
        allocator.free([7])


def test_double_free_raises_naming_the_slot():
    allocator = KVAllocator(4)
    allocator.alloc(4)
    allocator.free([2])
    with pytest.raises(ValueError, match="slot 2"):
        allocator.free([2])


def test_failed_free_frees_nothing():
    allocator = KVAllocator(4)
    allocator.alloc(4)
    allocator.free([3])
    with pytest.raises(ValueError, match="slot 3"):
        allocator.free([0, 1, 3])
    assert allocator.available() == 1
    allocator.free([0, 1])
    assert allocator.available() == 3


def test_free_rejects_slots_outside_the_pool():
    allocator = KVAllocator(4)
    allocator.alloc(4)
    with pytest.raises(ValueError, match="slot 4"):
        allocator.free([4])
    with pytest.raises(ValueError, match="slot -1"):
        allocator.free([-1])


def test_alloc_rejects_partial_pages():
    allocator = KVAllocator(8, page_size=4)
    with pytest.raises(ValueError):
        allocator.alloc(3)
    with pytest.raises(ValueError):
        allocator.alloc(-4)


@pytest.mark.parametrize(("num_slots", "page_size"), [(0, 1), (6, 4), (8, 0), (-4, 2)])
def test_constructor_validates(num_slots, page_size):
    with pytest.raises(ValueError):
        KVAllocator(num_slots, page_size)


def test_reset_frees_everything_in_ascending_order():
    allocator = KVAllocator(6, page_size=2)
    allocator.alloc(4)
    allocator.free([0])
    allocator.reset()
    assert allocator.available() == 6
    assert allocator.alloc(6) == [0, 1, 2, 3, 4, 5]
