"""The router's approximate prefix trees and its cache-versus-load choice, without sockets."""

from __future__ import annotations

import pytest

from radixmesh.core.service_settings import RouterSettings
from radixmesh.services.tokenizer.router import PrefixTree, Route, Router


def test_tree_matches_longest_stored_prefix_and_splits_edges():
    tree = PrefixTree(max_tokens=100)
    tree.insert([1, 2, 3, 4, 5])
    assert tree.match([1, 2, 3, 4, 5, 6]) == 5
    assert tree.match([1, 2, 9]) == 2
    assert tree.match([7]) == 0
    tree.insert([1, 2, 7, 8])  # splits the first edge after [1, 2]
    assert tree.size == 7
    assert tree.match([1, 2, 7, 8]) == 4
    assert tree.match([1, 2, 3, 4, 5]) == 5
    tree.insert([1, 2])  # already there: nothing added
    assert tree.size == 7


def test_tree_namespaces_never_share_prefixes():
    tree = PrefixTree(max_tokens=100)
    tree.insert([1, 2, 3], namespace="tenant-a")
    assert tree.match([1, 2, 3], namespace="tenant-a") == 3
    assert tree.match([1, 2, 3]) == 0
    assert tree.match([1, 2, 3], namespace="tenant-b") == 0


def test_tree_stays_bounded_and_evicts_least_recently_used_first():
    tree = PrefixTree(max_tokens=10)
    tree.insert([1] * 4)
    tree.insert([2] * 4)
    tree.match([1] * 4)  # [1]*4 is now more recent than [2]*4
    tree.insert([3] * 4)
    assert tree.size <= 10
    assert tree.match([1] * 4) == 4
    assert tree.match([3] * 4) == 4
    assert tree.match([2] * 4) == 0


def test_tree_eviction_walks_up_to_parents_that_become_leaves():
    tree = PrefixTree(max_tokens=6)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5, 6])  # [1, 2] with two leaves: 6 tokens
    tree.insert([9, 9, 9, 9, 9])  # needs all older tokens gone
    assert tree.match([9, 9, 9, 9, 9]) == 5
    assert tree.match([1, 2]) == 0
    assert tree.size == 5


def test_tree_clear_forgets_everything():
    tree = PrefixTree(max_tokens=100)
    tree.insert([1, 2, 3], namespace="x")
    tree.clear()
    assert tree.size == 0
    assert tree.match([1, 2, 3], namespace="x") == 0


def _router(*engines: str, **config: object) -> Router:
    router = Router(RouterSettings(**config))  # type: ignore[arg-type]
    for engine_id in engines:
        router.update_engine(engine_id, 0)
    return router


def test_route_without_engines_raises():
    with pytest.raises(LookupError):
        Router().route([1, 2, 3])


def test_shared_prefix_follows_the_cache_and_unrelated_prompts_spread():
    router = _router("a", "b")
    prefix = list(range(100, 140))
    first = router.route(prefix + [1, 2])
    assert first.matched_tokens == 0
    second = router.route(prefix + [3, 4])
    assert second == Route(first.engine_id, 40)
    other = router.route(list(range(500, 540)))
    assert other.engine_id != first.engine_id  # least loaded
    assert router.load(first.engine_id) == 2
    assert router.load(other.engine_id) == 1


def test_low_match_ratio_goes_to_least_loaded():
    router = _router("a", "b")
    router.update_engine("a", 5)
    router.record_cached("a", [1, 2, 3, 4])
    route = router.route([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 40 % < 50 % threshold
    assert route == Route("b", 0)


def test_cache_events_steer_routing():
    router = _router("a", "b")
    router.update_engine("a", 3)
    router.record_cached("b", [7, 7, 7, 7])
    router.update_engine("b", 4)
    assert router.route([7, 7, 7, 7, 1]) == Route("b", 4)


def test_imbalance_overrides_the_cache():
    router = _router("a", "b", balance_abs_threshold=4, balance_rel_threshold=1.5)
    router.record_cached("a", [5] * 10)
    router.record_cached("a", [6] * 10)
    router.update_engine("a", 10)
    router.update_engine("b", 2)  # 10 - 2 > 4 and 10 > 1.5 * 2: imbalanced
    assert router.route([5] * 10) == Route("b", 0)
    router.update_engine("b", 7)  # 10 <= 1.5 * 7: balanced again
    assert router.route([6] * 10) == Route("a", 10)


def test_heartbeat_resets_the_count_of_requests_sent_since():
    router = _router("a")
    for _ in range(3):
        router.route([1])
    assert router.load("a") == 3
    router.update_engine("a", 1)
    assert router.load("a") == 1


def test_namespaces_route_independently():
    router = _router("a", "b")
    first = router.route([1] * 20, namespace="salt")
    other = router.route([1] * 20)
    assert other.matched_tokens == 0
    assert other.engine_id != first.engine_id


def test_flush_and_removal():
    router = _router("a", "b")
    router.record_cached("a", [1, 2, 3])
    router.flush("a")
    assert router.tree_size("a") == 0
    router.remove_engine("a")
    assert router.engine_ids == ["b"]
    assert router.route([1, 2, 3]).engine_id == "b"
    router.record_cached("gone", [1])  # events of unknown engines are ignored


def test_an_embedding_is_not_split_over_a_prefill_and_a_decode_engine():
    router = Router()
    router.update_engine("p", 0, "prefill")
    router.update_engine("d", 0, "decode")
    assert router.route([1, 2, 3]) == Route("d", 0, prefill_engine="p")
    assert router.route([4, 5, 6], whole=True) == Route("d", 0)
