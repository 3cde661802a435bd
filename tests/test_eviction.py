"""The slru eviction policy in the radix cache: promotion, demotion, eviction order, splits,
resistance to one-off scans, and its bookkeeping under random operations on both tiers."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest
from test_radix_cache import FakeClock, RecordingAllocator, insert_fresh, make_cache

from radixmesh.engine.eviction import POLICIES, PROBATIONARY, PROTECTED, eviction_policy
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.tree_node import TreeNode


def slru_cache(
    num_slots: int = 64, protected_ratio: float = 0.8
) -> tuple[RadixCache, RecordingAllocator, FakeClock]:
    allocator = RecordingAllocator(num_slots)
    clock = FakeClock()
    return RadixCache(allocator, 1, "slru", clock, protected_ratio), allocator, clock


def node_of(cache: RadixCache, key: list[int]) -> TreeNode:
    node = cache.match_prefix(key, count_hit=False).node
    assert node.depth + len(node.key) == len(key)
    return node


def evicted_in_order(cache: RadixCache, allocator: RecordingAllocator) -> list[int]:
    allocator.freed.clear()
    cache.evict(cache.total_size())
    cache.check_invariants()
    return allocator.freed


def serve(cache: RadixCache, tokens: list[int]) -> int:
    """One request as the scheduler runs it (match, lock, allocate the rest evicting as
    needed, cache it all, unlock); returns the prompt tokens it found cached."""
    match = cache.match_prefix(tokens)
    cache.lock(match.node)
    fresh = cache.allocator.alloc(len(tokens) - len(match.slots))
    if fresh is None:
        cache.evict(len(tokens) - len(match.slots) - cache.allocator.available())
        fresh = cache.allocator.alloc(len(tokens) - len(match.slots))
    assert fresh is not None
    slots = match.slots + fresh
    cached = cache.insert(tokens, slots)
    cache.allocator.free(slots[len(match.slots) : cached])
    cache.unlock(match.node)
    cache.check_invariants()
    return len(match.slots)


def test_a_hit_after_caching_promotes_and_a_look_does_not():
    cache, _, _ = slru_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    node = node_of(cache, [1, 2, 3, 4])
    assert node.segment == PROBATIONARY
    cache.match_prefix([1, 2, 3, 4], count_hit=False)
    assert node.segment == PROBATIONARY
    cache.match_prefix([1, 2, 3, 4, 5])
    assert node.segment == PROTECTED
    assert cache._eviction.protected_tokens == 4
    cache.check_invariants()


def test_protected_overflow_demotes_its_least_recent_to_the_probationary_front():
    cache, allocator, _ = slru_cache(16, protected_ratio=0.5)
    slots = {name: insert_fresh(cache, [token] * 4) for token, name in enumerate("abcd", 1)}
    for token in (1, 2, 3):  # 12 protected tokens would exceed half of the 16-slot pool
        cache.match_prefix([token] * 4)
    a = node_of(cache, [1] * 4)
    assert a.segment == PROBATIONARY
    assert cache._eviction.protected_tokens == 8
    cache.check_invariants()
    # d was never hit; a, demoted after it, sorts as the most recent probationary node.
    assert evicted_in_order(cache, allocator) == slots["d"] + slots["a"] + slots["b"] + slots["c"]


@pytest.mark.parametrize("policy", ["lru", "slru"])
def test_probationary_leaves_go_before_protected_ones(policy):
    cache, allocator, clock = make_cache(policy=policy)
    hot, old = insert_fresh(cache, [1] * 4), insert_fresh(cache, [2] * 4)
    clock.now = 1
    cache.match_prefix([1] * 4)
    clock.now = 2
    new = insert_fresh(cache, [3] * 4) + insert_fresh(cache, [4] * 4)
    # lru: the hot prefix was used before the new ones were cached; slru: it was used again.
    expected = old + hot + new if policy == "lru" else old + new + hot
    assert evicted_in_order(cache, allocator) == expected


@pytest.mark.parametrize(("policy", "hot_hit"), [("lru", 0), ("slru", 16)])
def test_a_scan_of_one_off_prompts_keeps_a_protected_hot_prefix(policy, hot_hit):
    cache, _, clock = make_cache(64, policy=policy)
    hot = list(range(100, 116))
    requests = [hot + [1] * 4, hot + [2] * 4]
    requests += [[1000 + 100 * i + t for t in range(16)] for i in range(4)]  # 64 scan tokens
    hits = []
    for tick, tokens in enumerate(requests):
        clock.now = tick
        hits.append(serve(cache, tokens))
    assert hits == [0, 16, 0, 0, 0, 0]
    clock.now = len(requests)
    assert serve(cache, hot + [3] * 4) == hot_hit


def test_a_split_keeps_the_segment_on_both_parts():
    cache, _, _ = slru_cache()
    insert_fresh(cache, list(range(8)))
    insert_fresh(cache, [9] * 16)
    cache.match_prefix(list(range(8)))
    lower = node_of(cache, list(range(8)))
    upper = cache.match_prefix(list(range(4)), count_hit=False).node
    assert lower.parent is upper
    assert (upper.segment, lower.segment) == (PROTECTED, PROTECTED)
    assert cache._eviction.protected_tokens == 8
    cold = node_of(cache, [9] * 16)
    upper_cold = cache.match_prefix([9] * 10, count_hit=False).node
    assert (upper_cold.segment, cold.segment) == (PROBATIONARY, PROBATIONARY)
    cache.check_invariants()


def test_eviction_past_the_probationary_segment_takes_protected_leaves():
    cache, allocator, _ = slru_cache()
    hot = insert_fresh(cache, [1] * 8)
    cold = insert_fresh(cache, [2] * 8)
    cache.match_prefix([1] * 8)
    assert cache._eviction.protected_tokens == 8
    allocator.freed.clear()
    assert cache.evict(12) == 16  # the 8 cold tokens are not enough: the hot ones go too
    assert allocator.freed == cold + hot
    assert cache._eviction.protected_tokens == 0
    cache.check_invariants()


def test_check_invariants_catches_broken_slru_bookkeeping():
    cache, _, _ = slru_cache()
    insert_fresh(cache, [1] * 4)
    insert_fresh(cache, [2] * 8)
    cache.match_prefix([1] * 4)
    cache._eviction.protected_tokens += 1
    with pytest.raises(AssertionError, match="SLRU's protected counter"):
        cache.check_invariants()
    cache._eviction.protected_tokens -= 1
    node_of(cache, [2] * 8).segment = PROTECTED
    with pytest.raises(AssertionError, match="protected set"):
        cache.check_invariants()


@pytest.mark.parametrize("ratio", [0.0, 1.0, 1.5, -0.2])
def test_the_protected_ratio_is_inside_0_and_1(ratio):
    with pytest.raises(ValueError, match="protected_ratio"):
        eviction_policy("slru", 16, ratio)
    with pytest.raises(ValueError, match="protected_ratio"):
        RadixCache(KVAllocator(16), policy="slru", protected_ratio=ratio)


# --- random operations on both tiers, every invariant after each ------------------------------

POOL, HOST_POOL, STEPS = 48, 64, 400


def tree_nodes(cache: RadixCache) -> Iterator[TreeNode]:
    stack = [cache.match_prefix([], count_hit=False).node]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is not None:
            yield node


class Driver:
    """Drives a cache with a host tier as the scheduler and its host tier would, at random."""

    def __init__(self, policy: str, page_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.page_size = page_size
        self.allocator = KVAllocator(POOL, page_size)
        self.host = KVAllocator(HOST_POOL, page_size)
        self.clock = FakeClock()
        ratio = self.rng.choice([0.1, 0.3, 0.8])
        self.cache = RadixCache(self.allocator, page_size, policy, self.clock, ratio)
        self.cache.attach_host(self.host)
        # In flight: key, its cached prefix's slots, the slots it owns, the node it locks.
        self.running: list[tuple[list[int], list[int], list[int], TreeNode]] = []
        self.copies: list[int] = []
        self.copy_ids = itertools.count(1)

    def step(self) -> None:
        self.clock.now += 1
        operation = self.rng.choice(
            [self.admit, self.admit, self.finish, self.abort, self.look, self.evict,
             self.back_up, self.finish_backup, self.evict_host, self.lose_host]
        )
        operation()
        self.check()

    def check(self) -> None:
        cache = self.cache
        cache.check_invariants()
        in_flight = sum(len(own) for _, _, own, _ in self.running)
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
        assert self.allocator.available() + cache.total_size() + in_flight == POOL
        assert self.host.available() + cache.host_size() == HOST_POOL

    def _key(self) -> list[int]:
        tokens = [self.rng.randrange(2) for _ in range(self.rng.randrange(25))]
        return tokens[: len(tokens) - len(tokens) % self.page_size]

    def _keep(self, node: TreeNode) -> bool:
        """Write-back: a leaf about to be dropped is copied to the host instead, sometimes."""
        if self.rng.random() < 0.5:
            return False
        host_slots = self.host.alloc(len(node.key))
        if host_slots is None:
            return False
        copy_id = next(self.copy_ids)
        self.cache.start_backup(node, host_slots, copy_id)
        self.copies.append(copy_id)
        return True

    def _alloc(self, num_slots: int) -> list[int] | None:
        fresh = self.allocator.alloc(num_slots)
        if fresh is None:
            self.cache.evict(num_slots - self.allocator.available(), self._keep)
            fresh = self.allocator.alloc(num_slots)
        return fresh

    def admit(self) -> None:
        key = self._key()
        match = self.cache.match_prefix(key)
        node, prefix = match.node, list(match.slots)
        self.cache.lock(node)
        if match.host_nodes and self.rng.random() < 0.7:
            fresh = self._alloc(match.host_len)
            if fresh is not None:
                self.cache.load_host(match.host_nodes, fresh)
                self.cache.lock(match.host_nodes[-1])
                self.cache.unlock(node)
                node, prefix = match.host_nodes[-1], prefix + fresh
        own = self._alloc(len(key) - len(prefix))
        if own is None:
            self.cache.unlock(node)
            return
        self.running.append((key, prefix, own, node))

    def _pop(self) -> tuple[list[int], list[int], list[int], TreeNode] | None:
        if not self.running:
            return None
        return self.running.pop(self.rng.randrange(len(self.running)))

    def finish(self) -> None:
        request = self._pop()
        if request is None:
            return
        key, prefix, own, node = request
        slots = prefix + own
        cached = self.cache.insert(key, slots)
        self.allocator.free(slots[len(prefix) : cached])
        self.cache.unlock(node)

    def abort(self) -> None:
        request = self._pop()
        if request is not None:
            self.allocator.free(request[2])
            self.cache.unlock(request[3])

    def look(self) -> None:
        self.cache.match_prefix(self._key(), count_hit=False)

    def evict(self) -> None:
        self.cache.evict(self.rng.randrange(POOL), self._keep)

    def back_up(self) -> None:
        candidates = [
            n for n in tree_nodes(self.cache) if n.slots is not None and n.host_slots is None
        ]
        if not candidates:
            return
        node = self.rng.choice(candidates)
        host_slots = self.host.alloc(len(node.key))
        if host_slots is None:
            self.cache.evict_host(len(node.key))
            host_slots = self.host.alloc(len(node.key))
        if host_slots is not None:
            copy_id = next(self.copy_ids)
            self.cache.start_backup(node, host_slots, copy_id)
            self.copies.append(copy_id)

    def finish_backup(self) -> None:
        if self.copies:
            self.cache.finish_backup(self.copies.pop(self.rng.randrange(len(self.copies))))

    def evict_host(self) -> None:
        self.cache.evict_host(self.rng.randrange(HOST_POOL))

    def lose_host(self) -> None:
        if self.rng.random() < 0.2:  # rare: the host tier's memory is gone, a fresh one comes
            self.host = KVAllocator(HOST_POOL, self.page_size)
            self.cache.attach_host(self.host)
            self.copies.clear()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_random_operations_on_both_tiers_keep_every_invariant(policy, page_size, seed):
    driver = Driver(policy, page_size, seed)
    for _ in range(STEPS):
        driver.step()
    while driver.running:
        driver.finish()
    while driver.copies:
        driver.finish_backup()
    cached = driver.cache.total_size()
    assert driver.cache.evict(POOL) == cached
    driver.check()
    assert driver.allocator.available() == POOL
