"""Admission order of the waiting queue under each policy."""

from __future__ import annotations

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.schedule_policy import CACHE_AWARE_QUEUE_LIMIT, SchedulePolicy


def req(rid: str, tokens: list[int]) -> Req:
    return Req(rid=rid, input_ids=tokens, params=SamplingParams(), seed=0)


def cache_with(*prefixes: list[int]) -> RadixCache:
    cache = RadixCache(KVAllocator(1024))
    for p in prefixes:
        slots = cache.allocator.alloc(len(p))
        assert slots is not None
        cache.allocator.free(slots[: cache.insert(p, slots)])
    return cache


def test_lpm_puts_the_longest_cached_prefix_first() -> None:
    cache = cache_with(list(range(20)), [100, 101, 102])
    queue = [req("none", [7, 7, 7]), req("short", [100, 101, 102, 5]), req("long", [*range(20), 9])]
    order = SchedulePolicy("lpm", cache).order(queue)
    assert [r.rid for r in order] == ["long", "short", "none"]


def test_fcfs_keeps_arrival_order() -> None:
    cache = cache_with(list(range(20)))
    queue = [req("a", [5, 5]), req("b", [*range(20), 1])]
    assert [r.rid for r in SchedulePolicy("fcfs", cache).order(queue)] == ["a", "b"]


def test_lpm_gives_way_to_fcfs_on_a_long_queue() -> None:
    cache = cache_with(list(range(20)))
    queue = [req(f"r{i}", [1000 + i, 1]) for i in range(CACHE_AWARE_QUEUE_LIMIT)]
    queue.append(req("cached", [*range(20), 3]))
    order = SchedulePolicy("lpm", cache).order(queue)
    assert len(queue) > CACHE_AWARE_QUEUE_LIMIT
    assert order[-1].rid == "cached"
    shorter = SchedulePolicy("lpm", cache).order(queue[-CACHE_AWARE_QUEUE_LIMIT:])
    assert shorter[0].rid == "cached"


def test_dfs_weight_runs_the_heaviest_subtree_first_and_keeps_groups_together() -> None:
    cache = cache_with([1, 2, 3, 4], [9, 8, 7, 6])
    light = [req(f"light{i}", [1, 2, 3, 4, 50 + i]) for i in range(2)]
    heavy = [req(f"heavy{i}", [9, 8, 7, 6, 60 + i]) for i in range(3)]
    queue = [light[0], heavy[0], light[1], heavy[1], heavy[2]]
    order = [r.rid for r in SchedulePolicy("dfs-weight", cache).order(queue)]
    assert order == ["heavy0", "heavy1", "heavy2", "light0", "light1"]
