"""The worker's side of the host (L2) KV tier: mapping the shared segment, backups and loads
through ModelRunner (float32, the tiny random model), their wire format, and under tensor
parallelism each rank's heads and the scheduler's count of ranks that finished a backup."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_model import HEAD_DIM, KV_HEADS, LAYERS, save_tiny_model

from radixmesh.core.hicache import HostPoolSpec, KVGeometry
from radixmesh.core.sampling_params import LogprobRequest, SamplingParams
from radixmesh.core.step import (
    EntryResult,
    KVCopy,
    NewRequest,
    StepBatch,
    StepEntry,
    StepResult,
)
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.parallel import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    shard_weights,
)
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.mesh.nats_server import free_port
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto.convert import (
    batch_from_proto,
    batch_to_proto,
    result_from_proto,
    result_to_proto,
)
from radixmesh.services.scheduler.worker_link import BackupTally, WorkerClient

GREEDY = SamplingParams(temperature=0)
PROMPT = [(13 * i + 7) % 250 for i in range(12)]
HOST_SLOTS = 64
LAYOUT_PAGES = [("layer_first", 1), ("layer_first", 4), ("page_first", 1), ("page_first", 4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def make_runner(model_dir: Path, page_size: int = 1) -> ModelRunner:
    loaded = load_model(str(model_dir), progress=False)
    return ModelRunner(loaded.config, loaded.weights, torch.float32, 256, page_size=page_size)


def make_segment(
    directory: Path, layout: str = "layer_first", page_size: int = 1, name: str = "pool"
) -> HostPoolSpec:
    """A host pool file as cachectl makes one: spec.nbytes of zeros."""
    geometry = KVGeometry(LAYERS, KV_HEADS, HEAD_DIM, "float32", page_size)
    spec = HostPoolSpec(name, str(directory / name), HOST_SLOTS, layout, geometry)
    with open(spec.path, "wb") as f:
        f.truncate(spec.nbytes)
    return spec


def host_kv(spec: HostPoolSpec, layer: int, kv: int, slots: list[int]) -> torch.Tensor:
    """Host slots' K (kv 0) or V (kv 1) of one layer [n, heads, head_dim], read through a
    mapping of our own, as another process would see them."""
    host = np.memmap(spec.path, dtype=np.float32, mode="r", shape=spec.shape())
    index = np.array(slots)
    if spec.layout == "layer_first":
        rows = host[layer, kv, index]
    else:
        size = spec.geometry.page_size
        rows = host[index // size, layer, kv, index % size]
    return torch.from_numpy(np.array(rows))


def device_kv(runner: ModelRunner, layer: int, kv: int, slots: list[int]) -> torch.Tensor:
    return (runner.pool.k, runner.pool.v)[kv][layer][torch.tensor(slots)]


def assert_host_holds(
    spec: HostPoolSpec, host_slots: list[int], runner: ModelRunner, device_slots: list[int]
) -> None:
    for layer in range(LAYERS):
        for kv in (0, 1):
            assert torch.equal(
                host_kv(spec, layer, kv, host_slots), device_kv(runner, layer, kv, device_slots)
            ), (layer, kv)


class Steps:
    """Numbers a runner's steps and keeps every backup it reports done."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step = 0
        self.done: list[int] = []

    def __call__(self, **fields: object) -> StepResult:
        self.step += 1
        result = self.runner.forward(StepBatch(self.step, **fields))
        self.done.extend(result.copies_done)
        return result

    def wait_backups(self, *copy_ids: int) -> None:
        """Steps with no work until each backup is reported (they report nonetheless)."""
        for _ in range(1000):
            if set(copy_ids) <= set(self.done):
                return
            self()
            threading.Event().wait(0.005)
        raise AssertionError(f"backups {copy_ids} never reported; got {self.done}")


def prefill(rid: str, ids: list[int], slots: list[int]) -> dict[str, object]:
    return {
        "new_requests": [NewRequest(rid, 0, [], [], len(ids), GREEDY, 0)],
        "entries": [StepEntry(rid, ids, slots, True)],
    }


def page_slots(pages: list[int], size: int) -> list[int]:
    return [p * size + i for p in pages for i in range(size)]


@pytest.mark.parametrize(("layout", "page_size"), LAYOUT_PAGES)
def test_backups_copy_the_device_kv_into_the_host_slots(
    model_dir, tmp_path, layout, page_size
) -> None:
    runner = make_runner(model_dir, page_size)
    spec = make_segment(tmp_path, layout, page_size)
    steps = Steps(runner)
    # Backed up in the step that computes the KV: the copy starts after the forward.
    host_a = page_slots([9, 2, 14], 4)
    steps(host_pool=spec, copies=[KVCopy(1, True, list(range(12)), host_a)],
          **prefill("a", PROMPT, list(range(12))))
    host_b = [50, 3, 33, 60]
    steps(**prefill("b", PROMPT[:4], [100, 101, 102, 103]))
    steps(copies=[KVCopy(2, True, [100, 101, 102, 103], host_b)])
    steps.wait_backups(1, 2)
    assert torch.count_nonzero(runner.pool.k[0][:12]) > 0
    assert_host_holds(spec, host_a, runner, list(range(12)))
    assert_host_holds(spec, host_b, runner, [100, 101, 102, 103])
    untouched = sorted(set(range(HOST_SLOTS)) - set(host_a) - set(host_b))
    for layer in range(LAYERS):
        assert not host_kv(spec, layer, 0, untouched).any()
        assert not host_kv(spec, layer, 1, untouched).any()


@pytest.mark.parametrize(("layout", "page_size"), LAYOUT_PAGES)
def test_a_load_restores_the_slots_and_decoding_goes_on_alike(
    model_dir, tmp_path, layout, page_size
) -> None:
    runner = make_runner(model_dir, page_size)
    spec = make_segment(tmp_path, layout, page_size)
    steps = Steps(runner)
    host = page_slots([5, 1, 12], 4)
    first = steps(host_pool=spec, copies=[KVCopy(7, True, list(range(12)), host)],
                  **prefill("orig", PROMPT, list(range(12))))
    steps.wait_backups(7)
    loaded = list(range(40, 52))
    only_copies = steps(copies=[KVCopy(8, False, loaded, host)])  # no entries
    assert only_copies.results == [] and only_copies.copies_done == []
    for layer in range(LAYERS):
        for kv in (0, 1):
            assert torch.equal(
                device_kv(runner, layer, kv, loaded), device_kv(runner, layer, kv, list(range(12)))
            )
    # "copy" holds the prompt in the loaded slots; both decode from the same token on.
    token = first.results[0].token_id
    got = steps(
        new_requests=[NewRequest("copy", 1, PROMPT, loaded, len(PROMPT), GREEDY, 0)],
        entries=[StepEntry("orig", [], [12], True), StepEntry("copy", [token], [60], True)],
    )
    decoded = [[r.token_id for r in got.results]]
    for i in range(4):
        got = steps(entries=[StepEntry("orig", [], [13 + i], True),
                             StepEntry("copy", [], [61 + i], True)])
        decoded.append([r.token_id for r in got.results])
    assert all(orig == copy for orig, copy in decoded), decoded


@pytest.mark.parametrize(("layout", "page_size"), [("layer_first", 1), ("page_first", 4)])
def test_a_load_in_the_step_of_the_prefill_that_reads_it(
    model_dir, tmp_path, layout, page_size
) -> None:
    """The prefix comes back from the host pool in the very step whose prefill attends to
    it: the same tokens and logprobs as with the prefix still in the device pool."""
    spec = make_segment(tmp_path, layout, page_size)
    logprobs = LogprobRequest(True, 3, 0)
    runs: dict[bool, list[EntryResult]] = {}
    for from_host in (False, True):
        runner = make_runner(model_dir, page_size)
        steps = Steps(runner)
        host = page_slots([3, 10], 4)
        warm = {"entries": [StepEntry("warm", PROMPT[:8], list(range(8)), False)],
                "new_requests": [NewRequest("warm", 0, [], [], 8, GREEDY, 0)]}
        steps(host_pool=spec, copies=[KVCopy(1, True, list(range(8)), host)], **warm)
        steps.wait_backups(1)
        prefix_slots = list(range(100, 108)) if from_host else list(range(8))
        copies = [KVCopy(2, False, prefix_slots, host)] if from_host else []
        request = NewRequest("r", 1, PROMPT[:8], prefix_slots, 12, GREEDY, 0, logprobs)
        results = [steps(copies=copies, new_requests=[request],
                         entries=[StepEntry("r", PROMPT[8:], [200, 201, 202, 203], True)])]
        results += [steps(entries=[StepEntry("r", [], [204 + i], True)]) for i in range(4)]
        runs[from_host] = [r.results[0] for r in results]
    assert [r.token_id for r in runs[True]] == [r.token_id for r in runs[False]]
    assert [r.logprob for r in runs[True]] == [r.logprob for r in runs[False]]
    assert runs[True][0].input_logprobs[1:] == runs[False][0].input_logprobs[1:]


def test_backups_are_reported_once_and_never_hold_up_a_step(model_dir, tmp_path) -> None:
    runner = make_runner(model_dir)
    spec = make_segment(tmp_path)
    steps = Steps(runner)
    steps(host_pool=spec, **prefill("a", PROMPT, list(range(12))))
    # Hold the copy thread: the next steps must run and report nothing yet.
    release = threading.Event()
    runner.host_copies._thread.submit(release.wait)
    held = steps(copies=[KVCopy(1, True, [0, 1, 2], [0, 1, 2]),
                         KVCopy(2, True, [3, 4], [10, 11])])
    decode = steps(entries=[StepEntry("a", [], [12], True)])
    assert held.copies_done == [] and decode.copies_done == []
    assert decode.results[0].token_id >= 0
    release.set()
    steps(copies=[KVCopy(3, True, [12], [20])])
    steps.wait_backups(1, 2, 3)
    for _ in range(3):
        steps()
    assert sorted(steps.done) == [1, 2, 3]
    assert_host_holds(spec, [0, 1, 2, 10, 11, 20], runner, [0, 1, 2, 3, 4, 12])


def test_the_copy_thread_runs_torch_on_one_thread(model_dir, tmp_path) -> None:
    runner = make_runner(model_dir)
    threads = torch.get_num_threads()
    Steps(runner)(host_pool=make_segment(tmp_path))
    assert runner.host_copies._thread.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == threads
    # The process-wide default that new threads start from is left as it was.
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen == [threads]


def test_a_new_pool_replaces_the_old_after_its_backups(model_dir, tmp_path) -> None:
    runner = make_runner(model_dir)
    old, new = make_segment(tmp_path, name="old"), make_segment(tmp_path, name="new")
    steps = Steps(runner)
    steps(host_pool=old, copies=[KVCopy(1, True, list(range(12)), list(range(12)))],
          **prefill("a", PROMPT, list(range(12))))
    steps(host_pool=new, copies=[KVCopy(2, True, list(range(12)), list(range(20, 32)))])
    steps.wait_backups(1, 2)
    assert sorted(steps.done) == [1, 2]
    assert_host_holds(old, list(range(12)), runner, list(range(12)))
    assert_host_holds(new, list(range(20, 32)), runner, list(range(12)))
    assert not host_kv(new, 0, 0, list(range(12))).any()


def test_bad_pools_and_copies_are_refused(model_dir, tmp_path) -> None:
    runner = make_runner(model_dir)
    with pytest.raises(RuntimeError, match="before any host pool"):
        runner.forward(StepBatch(1, copies=[KVCopy(1, False, [0], [0])]))
    spec = make_segment(tmp_path)
    wrong_heads = HostPoolSpec("x", spec.path, HOST_SLOTS, "layer_first",
                               KVGeometry(LAYERS, 2 * KV_HEADS, HEAD_DIM, "float32"))
    with pytest.raises(ValueError, match="does not fit"):
        runner.forward(StepBatch(1, host_pool=wrong_heads))
    short = HostPoolSpec("x", spec.path, 2 * HOST_SLOTS, "layer_first", spec.geometry)
    with pytest.raises(ValueError, match="bytes"):
        runner.forward(StepBatch(1, host_pool=short))
    runner.forward(StepBatch(1, host_pool=spec))
    with pytest.raises(IndexError, match="host slots"):
        runner.forward(StepBatch(2, copies=[KVCopy(1, True, [0], [HOST_SLOTS])]))
    with pytest.raises(ValueError, match="1 device slots but 2 host slots"):
        runner.forward(StepBatch(3, copies=[KVCopy(1, False, [0], [0, 1])]))


def test_the_wire_format_round_trips(tmp_path) -> None:
    spec = HostPoolSpec(
        "radixmesh-hicache-e1", "/dev/shm/radixmesh-hicache-e1", 4096, "page_first",
        KVGeometry(30, 3, 64, "bfloat16", 16),
    )
    batch = StepBatch(
        7,
        new_requests=[NewRequest("r", 0, [1, 2], [5, 6], 3, GREEDY, 42)],
        entries=[StepEntry("r", [3], [7], True)],
        release=["gone"],
        copies=[KVCopy(11, False, [5, 6], [1 << 33, 0]), KVCopy(12, True, [7], [3])],
        host_pool=spec,
    )
    back = batch_from_proto(wpb.StepBatch.FromString(batch_to_proto(batch).SerializeToString()))
    # The sampling parameters come back whole (max_new_tokens included), with the seed.
    assert back.new_requests[0].params == replace(GREEDY, seed=42)
    back.new_requests[0].params = GREEDY
    assert back == batch
    plain = StepBatch(8, entries=[StepEntry("r", [], [8], True)])
    assert batch_from_proto(batch_to_proto(plain)) == plain
    result = StepResult(7, [EntryResult("r", 9)], 1.5, copies_done=[12, 3])
    assert result_from_proto(result_to_proto(result)) == result


# ---- tensor parallelism ---------------------------------------------------------------------


def _rank_main(rank: int, addr: str, model_dir: str, spec: HostPoolSpec, out: str) -> None:
    """One of two ranks: prefill, back the KV up into the shared pool, load it back into
    other slots; save this rank's KV of those slots and whether the load matched."""
    torch.set_num_threads(1)
    tp = init_tensor_parallel(addr, rank, 2)
    try:
        loaded = load_model(model_dir, progress=False)
        shard_weights(loaded.config, loaded.weights, rank, 2)
        runner = ModelRunner(loaded.config, loaded.weights, torch.float32, 256, tp=tp)
        steps = Steps(runner)
        steps(host_pool=spec, copies=[KVCopy(1, True, list(range(12)), TP_HOST_SLOTS)],
              **prefill("a", PROMPT, list(range(12))))
        steps.wait_backups(1)
        steps(copies=[KVCopy(2, False, list(range(30, 42)), TP_HOST_SLOTS)])
        pools = (runner.pool.k, runner.pool.v)
        kv = torch.stack([torch.stack([p[i][:12] for p in pools]) for i in range(LAYERS)])
        again = torch.stack([torch.stack([p[i][30:42] for p in pools]) for i in range(LAYERS)])
        torch.save({"kv": kv, "loaded_equal": torch.equal(kv, again)}, Path(out) / f"{rank}.pt")
    finally:
        destroy_tensor_parallel()


TP_HOST_SLOTS = [40 + i for i in range(12)]


def test_two_ranks_each_copy_their_heads_of_one_pool(model_dir, tmp_path) -> None:
    spec = make_segment(tmp_path, "page_first", 4)
    np.memmap(spec.path, dtype=np.float32, mode="r+", shape=spec.shape())[:] = -7.0
    ctx = multiprocessing.get_context("spawn")
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=_rank_main, args=(rank, addr, str(model_dir), spec, str(tmp_path)))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    half = KV_HEADS // 2
    for rank in range(2):
        saved = torch.load(tmp_path / f"{rank}.pt")
        assert saved["loaded_equal"], f"rank {rank}: the load did not restore its KV"
        assert saved["kv"].shape[2:] == (12, half, HEAD_DIM)
        for layer in range(LAYERS):
            for kv in (0, 1):
                heads = host_kv(spec, layer, kv, TP_HOST_SLOTS)[:, rank * half : (rank + 1) * half]
                assert torch.equal(heads, saved["kv"][layer, kv]), (rank, layer, kv)
    untouched = [s for s in range(HOST_SLOTS) if s not in TP_HOST_SLOTS]
    assert (host_kv(spec, 0, 0, untouched) == -7.0).all()


def test_a_backup_is_done_once_every_rank_reported_it() -> None:
    tally = BackupTally(2)
    assert tally.add([[1, 2], [2]]) == [2]
    assert tally.add([[3], []]) == []
    assert tally.add([[], [1, 3]]) == [1, 3]
    assert tally.add([[], []]) == []


class _FakeRank:
    """A worker rank's stream of steps that answers the given copies_done, one list a step."""

    failed = None

    def __init__(self, done: list[list[int]]) -> None:
        self.done = iter(done)

    async def step(self, msg: wpb.StepBatch) -> wpb.StepResult:
        return wpb.StepResult(step=msg.step, copies_done=next(self.done))

    async def close(self) -> None:
        pass


def test_the_worker_client_reports_a_backup_after_both_ranks() -> None:
    async def run() -> list[list[int]]:
        client = WorkerClient(["127.0.0.1:1", "127.0.0.1:2"])
        client._streams = [_FakeRank([[5], [], [6]]), _FakeRank([[], [5, 6], []])]
        try:
            return [(await client.forward(StepBatch(s))).copies_done for s in (1, 2, 3)]
        finally:
            await client.close()

    assert asyncio.run(run()) == [[], [5], [6]]
