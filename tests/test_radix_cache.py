"""RadixCache: unit tests of each behaviour, then a stateful test against a naive model."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixmesh.engine.eviction import POLICIES
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.tree_node import TreeNode


class FakeClock:
    """A clock the test sets by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordingAllocator(KVAllocator):
    """Remembers the order in which slots came back, to observe the eviction order."""

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        super().__init__(num_slots, page_size)
        self.freed: list[int] = []

    def free(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        super().free(slots)
        self.freed.extend(slots)


def make_cache(
    num_slots: int = 64, page_size: int = 1, policy: str = "lru"
) -> tuple[RadixCache, RecordingAllocator, FakeClock]:
    allocator = RecordingAllocator(num_slots, page_size)
    clock = FakeClock()
    return RadixCache(allocator, page_size, policy, clock), allocator, clock


def insert_fresh(cache: RadixCache, key: Sequence[int], **kwargs: object) -> list[int]:
    """Inserts key with fresh slots, frees the duplicates as a caller would; returns the slots."""
    slots = cache.allocator.alloc(len(key))
    assert slots is not None
    cached = cache.insert(key, slots, **kwargs)
    cache.allocator.free(slots[:cached])
    return slots


def cache_holding(key: Sequence[int]) -> tuple[RadixCache, list[int]]:
    """A default cache (64 slots, pages of 1, LRU) holding `key` alone, and its slots."""
    cache, _, _ = make_cache()
    return cache, insert_fresh(cache, key)


# --- unit tests -------------------------------------------------------------------------------


def test_empty_cache_matches_nothing():
    cache, _, _ = make_cache()
    result = cache.match_prefix([1, 2, 3])
    assert result.slots == []
    assert result.node.parent is None
    assert cache.total_size() == 0
    cache.check_invariants()


def test_match_splits_inside_an_edge():
    cache, slots = cache_holding([1, 2, 3, 4])
    result = cache.match_prefix([1, 2, 9])
    assert result.slots == slots[:2]
    assert result.node.key == [1, 2]
    assert result.node.slots == slots[:2]
    (lower,) = result.node.children.values()
    assert lower.key == [3, 4]
    assert lower.parent is result.node
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == slots
    assert cache.total_size() == 4
    cache.check_invariants()


def test_match_ending_at_the_key_end_splits_too():
    cache, slots = cache_holding([1, 2, 3, 4])
    result = cache.match_prefix([1, 2, 3])
    assert result.slots == slots[:3]
    assert result.node.key == [1, 2, 3]
    cache.check_invariants()


def test_insert_returns_the_cached_length():
    cache, _, _ = make_cache(16)
    assert cache.insert([1, 2, 3], [0, 1, 2]) == 0
    assert cache.insert([1, 2, 3, 4, 5], [5, 6, 7, 8, 9]) == 3
    assert cache.insert([1, 2], [10, 11]) == 2
    assert cache.insert([1, 2, 7], [12, 13, 14]) == 2
    assert cache.insert([], []) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == [0, 1, 2, 8, 9]
    assert cache.match_prefix([1, 2, 7]).slots == [0, 1, 14]
    assert cache.total_size() == 6
    cache.check_invariants()


def test_insert_validates_its_arguments():
    cache, _, _ = make_cache(page_size=2)
    with pytest.raises(ValueError, match="slots"):
        cache.insert([1, 2], [0])
    with pytest.raises(ValueError, match="multiple"):
        cache.insert([1, 2, 3], [0, 1, 2])
    with pytest.raises(ValueError, match="page"):
        cache.insert([1, 2], [1, 2])
    assert cache.total_size() == 0


def test_namespaces_are_isolated():
    cache, _, _ = make_cache()
    slots = insert_fresh(cache, [1, 2, 3], namespace="tenant-a")
    assert cache.match_prefix([1, 2, 3]).slots == []
    assert cache.match_prefix([1, 2, 3], namespace="tenant-b").slots == []
    assert cache.match_prefix([1, 2, 3], namespace="tenant-a").slots == slots
    # The same tokens under another namespace are new: nothing is reported as cached.
    other = cache.allocator.alloc(3)
    assert other is not None
    assert cache.insert([1, 2, 3], other) == 0
    assert cache.total_size() == 6
    cache.check_invariants()


def test_lock_protects_from_eviction():
    cache, allocator, _ = make_cache(16)
    slots = insert_fresh(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    assert cache.protected_size() == 4
    assert cache.evictable_size() == 0
    assert cache.evict(16) == 0
    assert cache.match_prefix([1, 2, 3, 4]).slots == slots
    cache.unlock(node)
    assert cache.evictable_size() == 4
    assert cache.evict(1) == 4
    assert allocator.available() == 16
    cache.check_invariants()


def test_lock_covers_ancestors_only():
    cache, _, _ = make_cache()
    first = insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 7, 8])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    assert cache.protected_size() == 4
    assert cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 7, 8]).slots == first[:2]
    cache.check_invariants()
    cache.unlock(node)
    assert cache.evict(100) == 4
    cache.check_invariants()


def test_split_keeps_a_locked_node_locked():
    cache, _ = cache_holding([1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    upper = cache.match_prefix([1, 2]).node
    assert upper.lock_ref == 1
    assert node.parent is upper
    cache.check_invariants()
    cache.unlock(node)
    assert upper.lock_ref == 0
    assert cache.evictable_size() == 4
    cache.check_invariants()


def test_unlock_below_zero_raises():
    cache, _ = cache_holding([1, 2])
    node = cache.match_prefix([1, 2]).node
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)
    cache.check_invariants()


def test_locking_an_evicted_node_raises():
    cache, _ = cache_holding([1, 2])
    node = cache.match_prefix([1, 2]).node
    cache.evict(2)
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(node)


def test_root_lock_is_a_no_op():
    cache, _, _ = make_cache()
    root = cache.match_prefix([5]).node
    cache.lock(root)
    cache.unlock(root)
    assert cache.protected_size() == 0


def test_evict_frees_slots_once_and_parents_become_candidates():
    cache, allocator, _ = make_cache(16)
    first = insert_fresh(cache, [1, 2])
    second = insert_fresh(cache, [1, 2, 3, 4])
    allocator.freed.clear()
    assert cache.evict(3) == 4
    # The leaf goes first; its parent only became a candidate once the leaf was gone.
    assert allocator.freed == second[2:] + first
    assert cache.total_size() == 0
    assert allocator.available() == 16
    cache.check_invariants()


def test_evict_stops_once_enough_is_freed():
    cache, _, clock = make_cache()
    for token in range(4):
        clock.now = token
        insert_fresh(cache, [token, token])
    assert cache.evict(3) == 4
    assert cache.total_size() == 4
    assert cache.evict(0) == 0
    assert cache.total_size() == 4


def _eviction_order(cache: RadixCache, allocator: RecordingAllocator) -> list[int]:
    """Every cached slot, in the order eviction freed it."""
    allocator.freed.clear()
    cache.evict(cache.total_size())
    return allocator.freed


def _three_prefixes(policy: str, priorities: tuple[int, int, int] = (0, 0, 0)):
    cache, allocator, clock = make_cache(policy=policy)
    slots = {}
    for name, token, time_, priority in zip("abc", (1, 2, 3), (1, 2, 3), priorities, strict=True):
        clock.now = time_
        slots[name] = insert_fresh(cache, [token], priority=priority)
    return cache, allocator, clock, slots


def test_lru_evicts_the_least_recently_accessed():
    cache, allocator, clock, slots = _three_prefixes("lru")
    clock.now = 4
    cache.match_prefix([1])
    assert _eviction_order(cache, allocator) == slots["b"] + slots["c"] + slots["a"]


def test_lfu_evicts_the_least_hit_then_the_oldest():
    cache, allocator, clock, slots = _three_prefixes("lfu")
    clock.now = 4
    cache.match_prefix([1])
    cache.match_prefix([1])
    cache.match_prefix([2])
    clock.now = 5
    cache.match_prefix([3])
    # b and c have one hit each; b was accessed earlier.
    assert _eviction_order(cache, allocator) == slots["b"] + slots["c"] + slots["a"]


def test_fifo_evicts_in_insertion_order_whatever_the_accesses():
    cache, allocator, clock, slots = _three_prefixes("fifo")
    clock.now = 4
    cache.match_prefix([1])
    assert _eviction_order(cache, allocator) == slots["a"] + slots["b"] + slots["c"]


def test_priority_evicts_the_lowest_priority_then_the_oldest_access():
    cache, allocator, clock, slots = _three_prefixes("priority", priorities=(2, 0, 0))
    clock.now = 4
    cache.match_prefix([2])
    assert _eviction_order(cache, allocator) == slots["c"] + slots["b"] + slots["a"]


def test_priority_of_a_path_is_the_max_inserted():
    cache, _, _ = make_cache(policy="priority")
    insert_fresh(cache, [1, 2], priority=3)
    insert_fresh(cache, [1, 2, 3, 4], priority=1)
    upper = cache.match_prefix([1, 2]).node
    (lower,) = upper.children.values()
    assert (upper.priority, lower.priority) == (3, 1)
    insert_fresh(cache, [1, 2, 3, 4], priority=5)
    assert (upper.priority, lower.priority) == (5, 5)


def test_unknown_policy_raises():
    with pytest.raises(ValueError, match="policy"):
        make_cache(policy="random")


def test_page_size_must_match_the_allocator():
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(KVAllocator(16, page_size=4), page_size=2)


def test_page_size_4_alignment():
    cache, _, _ = make_cache(64, page_size=4)
    slots = insert_fresh(cache, list(range(8)))
    assert cache.match_prefix(list(range(7))).slots == slots[:4]
    assert cache.match_prefix([0, 1, 2]).slots == []
    result = cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 9])
    assert result.slots == slots[:4]
    assert result.node.key == [0, 1, 2, 3]
    (lower,) = result.node.children.values()
    assert list(result.node.children) == [(4, 5, 6, 7)]
    assert lower.key == [4, 5, 6, 7]
    # A branch inside the second page hangs off the page boundary, not the token boundary.
    branch = cache.allocator.alloc(8)
    assert branch is not None
    assert cache.insert([0, 1, 2, 3, 4, 5, 9, 9], branch) == 4
    assert sorted(result.node.children) == [(4, 5, 6, 7), (4, 5, 9, 9)]
    assert cache.total_size() == 12
    cache.check_invariants()


def test_reset_frees_everything_and_refuses_while_locked():
    cache, allocator, _ = make_cache(16)
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [4, 5], namespace="x")
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert cache.total_size() == 0
    assert allocator.available() == 16
    assert cache.match_prefix([1, 2, 3]).slots == []
    with pytest.raises(ValueError):
        cache.lock(node)
    cache.check_invariants()


def test_check_invariants_catches_a_broken_counter():
    cache, _, _ = make_cache()
    insert_fresh(cache, [1, 2])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="evictable"):
        cache.check_invariants()


def test_check_invariants_catches_a_slot_owned_twice():
    cache, _, _ = make_cache()
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [3, 4])
    cache.match_prefix([3, 4]).node.slots[0] = cache.match_prefix([1, 2]).slots[0]
    with pytest.raises(AssertionError, match="owned twice"):
        cache.check_invariants()


# --- stateful property test against a naive model --------------------------------------------

POOL_SLOTS = 48
NAMESPACES = (None, "tenant-a")
# A binary alphabet half the time, so that keys often share prefixes and edges get split.
tokens_st = st.one_of(
    st.lists(st.integers(0, 1), max_size=12), st.lists(st.integers(0, 3), max_size=12)
)
namespace_st = st.sampled_from(NAMESPACES)


@dataclass
class Request:
    """A request in flight: its locked cached prefix and the slots the test still owns."""

    namespace: str | None
    key: list[int]
    prefix: list[int]
    own: list[int]
    node: TreeNode


class RadixCacheMachine(RuleBasedStateMachine):
    """Drives the cache like a scheduler and mirrors it in a dict of prefix -> page slots."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        policy=st.sampled_from(POLICIES),
    )
    def setup(self, page_size, policy):
        self.page_size = page_size
        self.allocator = KVAllocator(POOL_SLOTS, page_size)
        self.time = 0.0
        self.cache = RadixCache(self.allocator, page_size, policy, self._tick)
        # Per namespace: every cached page-aligned prefix -> the KV slots of its last page.
        self.model: dict[str | None, dict[tuple[int, ...], list[int]]] = {
            ns: {} for ns in NAMESPACES
        }
        self.requests: list[Request] = []

    def _tick(self) -> float:
        self.time += 1.0
        return self.time

    def _aligned(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % self.page_size]

    def _expected_match(self, namespace: str | None, tokens: list[int]) -> list[int]:
        model = self.model[namespace]
        slots: list[int] = []
        for end in range(self.page_size, len(tokens) + 1, self.page_size):
            page = model.get(tuple(tokens[:end]))
            if page is None:
                break
            slots.extend(page)
        return slots

    def _record(self, namespace: str | None, key: list[int], slots: list[int], start: int) -> None:
        model = self.model[namespace]
        size = self.page_size
        for end in range(size, start + 1, size):
            assert tuple(key[:end]) in model
        for end in range(start + size, len(key) + 1, size):
            model[tuple(key[:end])] = slots[end - size : end]

    def _alloc(self, num_slots: int) -> list[int] | None:
        slots = self.allocator.alloc(num_slots)
        if slots is None:
            self._evict(num_slots - self.allocator.available())
            slots = self.allocator.alloc(num_slots)
        return slots

    @rule(namespace=namespace_st, tokens=tokens_st)
    def match(self, namespace, tokens):
        result = self.cache.match_prefix(tokens, namespace)
        assert result.slots == self._expected_match(namespace, tokens)
        assert len(result.node.slots) <= len(result.slots)
        if result.slots:
            assert result.node.slots == result.slots[-len(result.node.slots) :]

    @rule(namespace=namespace_st, tokens=tokens_st, priority=st.integers(0, 2))
    def insert(self, namespace, tokens, priority):
        key = self._aligned(tokens)
        slots = self._alloc(len(key))
        if slots is None:
            return
        expected = len(self._expected_match(namespace, key))
        cached = self.cache.insert(key, slots, namespace, priority)
        assert cached == expected
        self.allocator.free(slots[:cached])
        self._record(namespace, key, slots, cached)

    @rule(namespace=namespace_st, tokens=tokens_st)
    def start_request(self, namespace, tokens):
        key = self._aligned(tokens)
        result = self.cache.match_prefix(key, namespace)
        assert result.slots == self._expected_match(namespace, key)
        self.cache.lock(result.node)
        own = self._alloc(len(key) - len(result.slots))
        if own is None:
            self.cache.unlock(result.node)
            return
        self.requests.append(Request(namespace, key, result.slots, own, result.node))

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 7), priority=st.integers(0, 2))
    def finish_request(self, index, priority):
        request = self.requests.pop(index % len(self.requests))
        slots = request.prefix + request.own
        cached = self.cache.insert(request.key, slots, request.namespace, priority)
        # Another request may have cached more of this key meanwhile, never less: it is locked.
        assert cached == len(self._expected_match(request.namespace, request.key))
        assert cached >= len(request.prefix)
        self.allocator.free(slots[len(request.prefix) : cached])
        self._record(request.namespace, request.key, slots, cached)
        self.cache.unlock(request.node)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 7))
    def abort_request(self, index):
        request = self.requests.pop(index % len(self.requests))
        self.allocator.free(request.own)
        self.cache.unlock(request.node)

    @rule(num_slots=st.integers(0, POOL_SLOTS))
    def evict(self, num_slots):
        self._evict(num_slots)

    def _evict(self, num_slots: int) -> None:
        protected = self.cache.protected_size()
        before = self._cached_tokens()
        freed = self.cache.evict(num_slots)
        assert self.cache.protected_size() == protected
        if freed < num_slots:
            assert self.cache.evictable_size() == 0
        for namespace in NAMESPACES:
            self.model[namespace] = self._surviving(namespace)
        assert freed == before - self._cached_tokens()
        for request in self.requests:
            if request.prefix:
                locked = tuple(request.key[: len(request.prefix)])
                assert locked in self.model[request.namespace], "a locked prefix was evicted"

    def _surviving(self, namespace: str | None) -> dict[tuple[int, ...], list[int]]:
        """The part of the model still in the cache, which must be prefix-closed."""
        model = self.model[namespace]
        size = self.page_size
        extended = {prefix[:-size] for prefix in model}
        survivors: dict[tuple[int, ...], list[int]] = {}
        for prefix in model:
            if prefix in extended:
                continue
            slots = self.cache.match_prefix(prefix, namespace).slots
            assert slots == self._expected_match(namespace, list(prefix[: len(slots)]))
            for end in range(size, len(slots) + 1, size):
                survivors[prefix[:end]] = model[prefix[:end]]
        return survivors

    @precondition(lambda self: not self.cache.protected_size())
    @rule()
    def reset(self):
        self.cache.reset()
        self.model = {ns: {} for ns in NAMESPACES}

    def _cached_tokens(self) -> int:
        return sum(len(model) for model in self.model.values()) * self.page_size

    @invariant()
    def accounting_holds(self):
        self.cache.check_invariants()
        cached = self._cached_tokens()
        held = [slot for request in self.requests for slot in request.own]
        cache = self.cache
        assert cache.evictable_size() + cache.protected_size() == cache.total_size() == cached
        assert self.allocator.available() + cached + len(held) == POOL_SLOTS
        owned = [slot for model in self.model.values() for page in model.values() for slot in page]
        owned += held
        assert len(set(owned)) == len(owned)
        locked = sum(len(request.prefix) > 0 for request in self.requests)
        assert (cache.protected_size() > 0) == (locked > 0)


RadixCacheMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_radix_cache_matches_the_model = RadixCacheMachine.TestCase
