"""The runner's host path: the request table against a per-request reference, batched
sampling against per-request sampling, and packed decode steps against entries."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import pytest
import torch
from tiny_model import forward_script, save_tiny_model, tokens

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.step import StepBatch, StepEntry, StepResult, int_array
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.req_table import ReqTable
from radixmesh.engine.model.row_sampling import RowSampling, is_plain, uniforms
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.engine.model.sampling import RequestSampler, sample, uniform

# ---------------------------------------------------------------- the request table


def test_table_matches_per_request_lists() -> None:
    """Admits, chunks, packed decodes and truncations in random order: every row reads back
    as the lists a per-request runner kept, through growth in both directions."""
    rng = random.Random(5)
    table = ReqTable(rows=2, width=4)
    ref: dict[int, tuple[list[int], list[int]]] = {}  # row -> (token ids, slots)
    last: dict[int, int] = {}
    next_slot = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_slot
        next_slot += n
        return list(range(next_slot - n, next_slot))

    for _ in range(400):
        op = rng.random()
        if op < 0.15 or not ref:
            row = rng.randrange(40)
            ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 30))]
            slots = fresh(len(ids))
            table.admit(row, ids, slots)
            ref[row] = (list(ids), list(slots))
        elif op < 0.4:
            row = rng.choice(list(ref))
            ids = [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            slots = fresh(len(ids))
            assert table.append(row, ids, slots) == len(ref[row][0])
            ref[row][0].extend(ids)
            ref[row][1].extend(slots)
        elif op < 0.9:
            rows = rng.sample(list(ref), rng.randrange(1, len(ref) + 1))
            for row in rows:
                last[row] = rng.randrange(1000)
                table.last[row] = last[row]
            slots = fresh(len(rows))
            at = torch.tensor(rows)
            positions = table.decode_positions(at)
            table.write_decodes(at, positions, torch.tensor(slots))
            assert positions.tolist() == [len(ref[r][0]) for r in rows]
            for row, slot in zip(rows, slots, strict=True):
                ref[row][0].append(last[row])
                ref[row][1].append(slot)
        else:
            row = rng.choice(list(ref))
            keep = rng.randrange(len(ref[row][0]) + 1)
            table.truncate(row, keep)
            del ref[row][0][keep:], ref[row][1][keep:]
        rows = list(ref)
        width = max(len(ref[r][1]) for r in rows) or 1
        index = table.index(torch.tensor(rows), width)
        for i, row in enumerate(rows):
            ids, slots = ref[row]
            assert table.row_tokens(row) == ids
            assert table.row_slots(row).tolist() == slots
            assert index[i, : len(slots)].tolist() == slots
    assert table.slots.shape[0] >= 40 and table.width > 4


# ---------------------------------------------------------------- batched sampling


def test_vectorized_uniforms_equal_per_request_draws() -> None:
    rng = random.Random(1)
    seeds = [rng.getrandbits(64) for _ in range(300)] + [0, 1, (1 << 63) - 1, 1 << 63]
    steps = [rng.randrange(1 << 20) for _ in seeds]
    signed = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds])
    got = uniforms(signed, torch.tensor(steps)).tolist()
    assert got == [uniform(s, k) for s, k in zip(seeds, steps, strict=True)]


PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.95, min_p=0.02),
    SamplingParams(top_k=1),
    SamplingParams(temperature=0, logit_bias={3: 50.0, 7: -100.0}),
    SamplingParams(temperature=0.8, logit_bias={5: 4.0}, frequency_penalty=0.7),
    SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=-0.4),
    SamplingParams(temperature=1.1, top_k=20, frequency_penalty=1.5, presence_penalty=0.5),
]


@pytest.mark.parametrize("greedy_only", [False, True])
def test_row_sampling_equals_per_request_sampling(greedy_only: bool) -> None:
    """Rows in any order and any mixture draw the tokens each request's own sampler draws,
    step after step (each row counts its draws and, for its penalties, its tokens); a row
    that joins with output of its own (readmitted) counts that too."""
    vocab, rng = 300, random.Random(2)
    params = [p for p in PARAMS if p.is_greedy] if greedy_only else PARAMS
    rows = list(range(24))
    chosen = {row: rng.choice(params) for row in rows}
    seeds = {row: rng.getrandbits(63) for row in rows}
    table = RowSampling(vocab, rows=4)
    samplers = {}
    for row in rows:
        assert is_plain(chosen[row])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        table.set(row, chosen[row], seeds[row], plain=True)
        table.start(row, len(output), prompt, output, torch.device("cpu"))
        samplers[row] = RequestSampler(chosen[row], prompt, vocab, seeds[row])
        for token in output:
            samplers[row].record(token)
    for step in range(8):
        picked = rng.sample(rows, rng.randrange(1, len(rows)))
        logits = torch.randn(len(picked), vocab) * 3
        want = sample(logits, [samplers[r] for r in picked], with_logprobs=False).token_ids
        got = table.sample(logits, torch.tensor(picked)).tolist()
        assert got == want, f"step {step}"
        for row, token in zip(picked, want, strict=True):
            samplers[row].record(token)


def test_only_plain_parameters_take_the_batched_path() -> None:
    for params in (SamplingParams(temperature=0.5, top_k=3, seed=4),
                   SamplingParams(frequency_penalty=0.5), SamplingParams(logit_bias={1: 2.0}),
                   SamplingParams(repetition_penalty=1.1)):
        assert is_plain(params)
    for params in (SamplingParams(min_new_tokens=2), SamplingParams(regex="[0-9]+")):
        assert not is_plain(params)


# ---------------------------------------------------------------- packed decode steps


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path: Path = tmp_path_factory.mktemp("tiny") / "llama"
    return load_model(str(save_tiny_model(path)), progress=False)


def packed(batch: StepBatch) -> StepBatch:
    """The same step with its plain decodes packed as the scheduler sends them."""
    rows = {n.rid: n.row for n in batch.new_requests} | {"a": 0, "b": 1}
    decodes = [e for e in batch.entries if not e.input_ids and not e.draft]
    return StepBatch(
        batch.step, batch.new_requests, [e for e in batch.entries if e not in decodes],
        decode_rows=int_array(rows[e.rid] for e in decodes),
        decode_slots=int_array(e.slots[0] for e in decodes),
    )


def decode_tokens(results: list[StepResult]) -> list[list[int]]:
    return [[*r.decode_tokens, *(e.token_id for e in r.results)] for r in results]


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_packed_decodes_equal_entries(tiny: Any, attention: str) -> None:
    """A greedy request and a seeded, top-k one: the tokens of packed steps equal those of
    the same steps sent as entries, on both backends (triton under the interpreter)."""
    def runner() -> ModelRunner:
        return ModelRunner(tiny.config, tiny.weights, torch.float32, 256, attention=attention)

    script = forward_script(decode_steps=8)
    plain, compact = runner(), runner()
    expected = tokens([plain.forward(b) for b in script])
    assert decode_tokens([compact.forward(packed(b)) for b in script]) == expected


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=20, frequency_penalty=1.5, logit_bias={7: 3.0}),
    SamplingParams(temperature=0.8, top_k=20, min_new_tokens=4),  # not plain: its own sampler
], ids=["penalties-and-bias", "min-new-tokens"])
def test_packed_decodes_with_penalties_bias_or_min_new_tokens(
    tiny: Any, params: SamplingParams
) -> None:
    """Packed or as entries, a request with penalties and logit_bias (batched), or with
    min_new_tokens (its own sampler, beside plain rows), draws the same tokens."""
    def run(pack: bool) -> list[list[int]]:
        runner = ModelRunner(tiny.config, tiny.weights, torch.float32, 256)
        script = forward_script(decode_steps=6)
        script[0].new_requests[1].params = params
        return decode_tokens([runner.forward(packed(b) if pack else b) for b in script])

    assert run(True) == run(False)


def test_rows_are_reused_after_release(tiny: Any) -> None:
    """A released row taken by a new request starts over: no slot or token of the old one."""
    runner = ModelRunner(tiny.config, tiny.weights, torch.float32, 256)
    results = [runner.forward(b) for b in forward_script(decode_steps=2)]
    a_tokens = [r.results[0].token_id for r in results]
    again = forward_script(decode_steps=2)
    again[0].step = 5
    again[0].release = ["a", "b"]
    for batch in again[1:]:
        batch.step += 4
    more = [runner.forward(b) for b in again]
    assert [r.results[0].token_id for r in more] == a_tokens
    assert runner.table.row_slots(0).tolist() == list(range(15))  # prompt + 3 decodes


def test_entries_that_feed_their_last_token_beside_packed_ones(tiny: Any) -> None:
    """An entry with no input ids (a decode sent as an entry) reads its row's last token on
    the device, as a packed decode does."""
    runner = ModelRunner(tiny.config, tiny.weights, torch.float32, 256)
    reference = ModelRunner(tiny.config, tiny.weights, torch.float32, 256)
    script = forward_script(decode_steps=3)
    expected = tokens([reference.forward(b) for b in script])
    got = []
    for batch in script:
        if batch.step >= 3:  # "a" packed, "b" as an entry
            batch = StepBatch(batch.step, entries=[StepEntry("b", [], batch.entries[1].slots,
                                                             True)],
                              decode_rows=int_array([0]),
                              decode_slots=int_array(batch.entries[0].slots))
        got.append(runner.forward(batch))
    assert decode_tokens(got) == expected


# ---------------------------------------------------------------- launch before read


class _Pending:
    """A launched step whose tokens land on the host after three looks."""

    def __init__(self, events: list[str], name: str) -> None:
        self.events, self.name = events, name
        self.looks = 0

    def ready(self) -> bool:
        self.looks += 1
        return self.looks > 3

    def result(self) -> StepResult:
        self.events.append(f"read {self.name}")
        return StepResult(int(self.name))


class _LaunchingRunner:
    """Records each launch and read; step 9 fails to launch."""

    lora = None  # serves no LoRA adapters

    def __init__(self) -> None:
        self.events: list[str] = []

    def launch(self, batch: StepBatch) -> _Pending:
        if batch.step == 9:
            raise RuntimeError("step 9 failed")
        self.events.append(f"launch {batch.step}")
        return _Pending(self.events, str(batch.step))


def test_in_process_steps_launch_before_the_one_before_is_read() -> None:
    """The next step is launched before the host reads the last one's tokens; a step with
    none behind it is read when its caller waits; a failed launch fails only its step."""
    from concurrent.futures import ThreadPoolExecutor

    from radixmesh.api import _DirectExecutor
    from radixmesh.engine.scheduler import ScheduledBatch

    async def drive(executor: _DirectExecutor) -> list[int]:
        got = []
        first = executor.submit(ScheduledBatch(StepBatch(1)))
        second = executor.submit(ScheduledBatch(StepBatch(2)))
        got.append((await first).step)  # as the overlapped loop does: N+1 is in before N
        got.append((await second).step)  # nothing behind it: read when awaited
        third = executor.submit(ScheduledBatch(StepBatch(3)))
        failing = executor.submit(ScheduledBatch(StepBatch(9)))
        got.append((await third).step)
        with pytest.raises(RuntimeError, match="step 9 failed"):
            await failing
        return got

    runner = _LaunchingRunner()
    with ThreadPoolExecutor(1) as thread:
        executor = _DirectExecutor(runner, thread)  # type: ignore[arg-type]
        assert asyncio.run(drive(executor)) == [1, 2, 3]
    assert runner.events == ["launch 1", "launch 2", "read 1", "read 2", "launch 3", "read 3"]


def test_worker_service_launches_a_step_before_reading_the_one_before() -> None:
    """Over gRPC too: the worker launches step N+1, which the overlapped scheduler sends
    while N runs, before it reads N's tokens; the stream answers each step in order."""
    from radixmesh.core.service_settings import WorkerConfig
    from radixmesh.proto import worker_pb2 as wpb
    from radixmesh.proto.convert import batch_to_proto
    from radixmesh.services.worker.server import WorkerService

    runner = _LaunchingRunner()
    runner.rids = lambda batch: []  # type: ignore[attr-defined]
    gate = threading.Event()

    async def drive() -> list[int]:
        service = WorkerService(WorkerConfig())
        service.runner = runner  # type: ignore[assignment]
        service.porter = object()  # type: ignore[assignment]
        service.sender = SimpleNamespace(pending=False, finished=list)  # type: ignore[assignment]
        service.metrics.loaded("fake", 0)
        # Hold the torch thread so that both steps are queued before either launches.
        held = service._torch.submit(gate.wait)

        async def steps() -> AsyncIterator[wpb.StepBatch]:
            for step in (1, 2):
                yield batch_to_proto(StepBatch(step))
            await asyncio.sleep(0.05)  # both queued before either launches
            gate.set()

        answers = [result.step async for result in service.Steps(steps(), None)]
        held.result()
        service._torch.shutdown()
        return answers

    assert asyncio.run(drive()) == [1, 2]
    assert runner.events == ["launch 1", "launch 2", "read 1", "read 2"]
