"""The scheduler's host KV tier against a model-free worker: write policies, loads back,
late acknowledgements, losing the tier, and the slot invariants of both tiers."""

from __future__ import annotations

import random

import pytest
from fake_worker import FakeWorker, reference_output
from test_scheduler import make_req, run

from radixmesh.core.hicache import HostPoolSpec, KVGeometry
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig

DEVICE, HOST = 256, 2048


def spec(num_slots: int = HOST) -> HostPoolSpec:
    geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")
    return HostPoolSpec(
        name="fake", path="/dev/null", num_slots=num_slots, layout="layer_first",
        geometry=geometry,
    )


def engine(
    policy: str = "write_through",
    threshold: int = 2,
    ack_delay: int = 0,
    page_size: int = 1,
    device: int = DEVICE,
    host: int = HOST,
) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(
        num_slots=device, page_size=page_size, chunked_prefill_size=64,
        host_write_policy=policy, host_write_threshold=threshold,
    )
    sched = Scheduler(config)
    sched.attach_host(spec(host))
    return sched, FakeWorker(device, host_slots=host, ack_delay=ack_delay)


def conversations(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50) for _ in range(length)] for _ in range(n)]


def serve(sched: Scheduler, worker: FakeWorker, prompt: list[int], rid: str, overlap: bool):
    req = make_req(rid, prompt, max_new=4)
    sched.add_request(req)
    run(sched, worker, overlap)
    assert req.output_ids == reference_output(prompt, 4)
    return req


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("ack_delay", [0, 3])
def test_an_evicted_prefix_comes_back_from_the_host_tier(overlap, page_size, ack_delay):
    sched, worker = engine(ack_delay=ack_delay, page_size=page_size)
    prompts = conversations(6, 120)  # 6 x 124 tokens: far more than the 256-slot pool
    for i, prompt in enumerate(prompts):
        serve(sched, worker, prompt, f"r{i}", overlap)
    again = serve(sched, worker, prompts[0], "again", overlap)
    aligned = 119 - 119 % page_size  # all but the last prompt token, in whole pages
    assert again.cached_tokens == aligned
    assert again.cached_host_tokens == aligned  # all of it from the host: the device had none
    assert worker.copied["to_device"] == aligned


def test_write_through_backs_up_everything_it_caches_once():
    sched, worker = engine("write_through")
    prompts = conversations(3, 50)
    for i, prompt in enumerate(prompts):
        serve(sched, worker, prompt, f"r{i}", overlap=False)
    # Each conversation: its 50 prompt tokens and 3 of its 4 output tokens (the last is
    # never fed back), cached once and backed up once.
    assert sched.tiers.host.stats.backup_tokens == 3 * 53
    assert sched.cache.host_size() == 3 * 53
    assert sched.cache.pending_backups() == 0


def test_write_back_copies_only_what_eviction_would_drop():
    sched, worker = engine("write_back")
    prompts = conversations(2, 60)
    for i, prompt in enumerate(prompts):
        serve(sched, worker, prompt, f"r{i}", overlap=False)
    assert sched.tiers.host.stats.backups == 0  # the pool had room: nothing evicted
    big = conversations(1, 200, seed=9)[0]
    serve(sched, worker, big, "big", overlap=False)
    # Making room for 203 tokens evicted both 63-token conversations, each backed up first.
    assert sched.tiers.host.stats.backup_tokens == 2 * 63
    again = serve(sched, worker, prompts[1], "again", overlap=False)
    assert again.cached_host_tokens == 59


def test_write_through_selective_backs_up_after_the_threshold():
    sched, worker = engine("write_through_selective", threshold=2)
    shared = conversations(1, 40)[0]
    serve(sched, worker, shared + [1], "a", overlap=False)
    assert sched.tiers.host.stats.backups == 0
    serve(sched, worker, shared + [2], "b", overlap=False)  # first admission to hit it
    assert sched.tiers.host.stats.backups == 0
    serve(sched, worker, shared + [3], "c", overlap=False)  # second: over the threshold
    assert sched.tiers.host.stats.backup_tokens == 40


def test_looking_at_the_queue_is_not_a_hit():
    sched, worker = engine("write_through_selective", threshold=1)
    shared = conversations(1, 40)[0]
    serve(sched, worker, shared + [1], "a", overlap=False)
    for _ in range(5):  # lpm orders the waiting queue by matching it against the tree
        sched.policy.order([make_req("x", shared + [9])])
    assert sched.tiers.host.stats.backups == 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_backup_in_flight_keeps_its_device_slots(policy):
    """The worker acknowledges each backup five steps late and copies only then; requests
    keep the pool full meanwhile. A freed or reused slot would load the wrong KV back."""
    sched, worker = engine(policy, ack_delay=5, device=192)
    prompts = conversations(8, 70, seed=3)
    for i, prompt in enumerate(prompts):
        sched.add_request(make_req(f"r{i}", prompt, max_new=4))
    run(sched, worker, overlap=True)
    assert not sched.requests
    for i in (0, 3, 5):
        again = serve(sched, worker, prompts[i], f"again{i}", overlap=True)
        assert again.cached_tokens == 69


def test_a_full_host_tier_evicts_its_coldest_prefixes():
    sched, worker = engine(host=256)
    prompts = conversations(8, 60, seed=4)
    for i, prompt in enumerate(prompts):
        serve(sched, worker, prompt, f"r{i}", overlap=False)
    assert sched.cache.host_size() <= 256
    last = serve(sched, worker, prompts[-1], "last", overlap=False)
    assert last.cached_tokens == 59  # the newest is still cached


def test_losing_the_host_tier_keeps_serving_from_the_device():
    sched, worker = engine(ack_delay=2)
    prompts = conversations(6, 120, seed=5)
    for i, prompt in enumerate(prompts[:4]):
        serve(sched, worker, prompt, f"r{i}", overlap=True)
    assert sched.cache.host_size() > 0
    sched.detach_host()
    sched.check_invariants()
    assert sched.cache.host_size() == 0 and sched.tiers.host is None
    again = serve(sched, worker, prompts[0], "again", overlap=True)
    assert again.cached_host_tokens == 0
    sched.attach_host(spec())  # cachectl is back: a fresh, empty host pool
    worker.host = [None] * HOST
    for i, prompt in enumerate(prompts[4:]):
        serve(sched, worker, prompt, f"s{i}", overlap=True)
    assert sched.cache.host_size() > 0


def test_flush_empties_both_tiers():
    sched, worker = engine()
    for i, prompt in enumerate(conversations(4, 80, seed=6)):
        serve(sched, worker, prompt, f"r{i}", overlap=False)
    assert sched.flush_cache()
    sched.check_invariants()
    assert sched.cache.total_size() == 0 and sched.cache.host_size() == 0
    assert sched.tiers.host.allocator.available() == HOST


def test_the_first_step_carries_the_host_pool_and_only_the_first():
    sched, worker = engine()
    first = sched.schedule()
    assert first is not None and first.batch.host_pool == spec()
    assert not first.batch.entries
    worker.forward(first.batch)
    sched.add_request(make_req("a", [1, 2, 3], max_new=2))
    second = sched.schedule()
    assert second is not None and second.batch.host_pool is None


def test_a_request_out_of_room_waits_for_backups_instead_of_ending():
    """A and B run together; when A finishes, its tokens are cached and their backups
    (acknowledged 4 steps late) pin them, while B, now alone, needs their slots to go on
    decoding: B waits for the backups, then A's prefix moves to the host and B finishes
    whole instead of being cut short as "KV pool full"."""
    sched, worker = engine(ack_delay=4, device=96)
    a, b = conversations(2, 40, seed=7)
    short, long = make_req("a", a, max_new=8), make_req("b", b, max_new=30)
    sched.add_request(short)
    sched.add_request(long)
    run(sched, worker, overlap=True)
    assert short.output_ids == reference_output(a, 8)
    assert long.output_ids == reference_output(b, 30)
    assert long.finish.message is None


def test_a_host_hit_waits_for_room_rather_than_recomputing():
    sched, worker = engine(device=128)
    first, second = conversations(2, 70, seed=8)
    serve(sched, worker, first, "first", overlap=False)
    serve(sched, worker, second, "second", overlap=False)  # pushes "first" to the host
    # A long request takes most of the pool before "first" returns: its host hit waits
    # for that room instead of being recomputed.
    hog = make_req("hog", conversations(1, 100, seed=9)[0], max_new=10)
    sched.add_request(hog)
    step = sched.schedule()
    sched.process_result(step, worker.forward(step.batch))
    again = make_req("again", first, max_new=4)
    sched.add_request(again)
    run(sched, worker, overlap=False)
    assert again.output_ids == reference_output(first, 4)
    assert again.cached_host_tokens > 0 and again.cached_tokens == 69
