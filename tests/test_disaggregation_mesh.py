"""Prefill/decode disaggregation through `radixmesh up`: one prefill and one decode engine,
the real model in float32, page size 4, 64-token prefill chunks, the host tier on and
tracing on. Every request's tokens equal the in-process engine's (which does both halves in
one engine); the decode engine reports the transfer; aborts leave no slot held on either
side; one request is one trace across both engines; a killed prefill or decode worker under
load hangs nothing and the mesh serves on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from process_helpers import running_mesh

from radixmesh.api import Engine
from radixmesh.launcher import Mesh
from radixmesh.tracing.records import SpanRecord
from radixmesh.tracing.waterfall import rids_of

GREEDY = {"temperature": 0, "max_new_tokens": 16}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(24))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    folder = tmp_path_factory.mktemp("pd-mesh")
    with running_mesh(
        folder / "logs", prefill_dp_size=1, decode_dp_size=1, dtype="float32", page_size=4,
        chunked_prefill_size=64, max_total_tokens=4096, enable_hierarchical_cache=True,
        trace_file=str(folder / "spans.jsonl"), extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    ) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mesh.url, timeout=120) as c:
        yield c


def generate(client: httpx.Client, text: str | list[str], params: dict, **extra) -> dict:
    reply = client.post("/generate", json={"text": text, "sampling_params": params, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def states(client: httpx.Client) -> dict[str, dict]:
    return {s["engine_id"]: s for s in client.get("/server_info").json()["internal_states"]}


def wait_idle(client: httpx.Client, timeout: float = 30) -> dict[str, dict]:
    """Both engines' info once nothing runs there and no request holds a KV slot."""
    deadline = time.monotonic() + timeout
    while True:
        info = states(client)
        if set(info) == {"p0", "d0"} and all(
            s["running"] == 0 and s["waiting"] == 0 and s["held_slots"] == 0
            for s in info.values()
        ):
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def test_outputs_equal_one_engine_doing_both(client, engine: Engine) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", LONG, "List three colors:"]
    expected = engine.generate(prompts, GREEDY)
    alone = generate(client, prompts[0], GREEDY)
    assert alone["output_ids"] == expected[0]["output_ids"]
    batched = generate(client, prompts, GREEDY)
    for got, want in zip(batched, expected, strict=True):
        assert got["output_ids"] == want["output_ids"]
    long = batched[2]["meta_info"]
    assert long["prompt_tokens"] > 4 * 64  # prefilled in several chunks
    moved = long["disaggregation"]
    assert (moved["prefill_engine"], moved["decode_engine"]) == ("p0", "d0")
    assert "fallback" not in moved
    assert moved["transfer_tokens"] == long["prompt_tokens"] - long["cached_tokens"] > 0
    assert moved["transfer_bytes"] == moved["transfer_tokens"] * 30 * 2 * 3 * 64 * 4
    wait_idle(client)


def test_a_json_schema_and_logprobs_cross_with_the_request(client, engine: Engine) -> None:
    params = {**GREEDY, "max_new_tokens": 40, "json_schema": json.dumps(PERSON)}
    prompt = "Describe a person as JSON:"
    want = engine.generate(prompt, params)
    got = generate(client, prompt, params)
    assert got["output_ids"] == want["output_ids"]
    assert set(json.loads(got["text"])) == {"name", "age"}
    extra = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    want = engine.generate("Two plus two is", GREEDY, **extra)["meta_info"]
    got = generate(client, "Two plus two is", GREEDY, **extra)["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [t[1] for t in got[key]] == [t[1] for t in want[key]], key
        for a, b in zip(got[key], want[key], strict=True):
            assert (a[0] is None) == (b[0] is None)
            assert a[0] is None or a[0] == pytest.approx(b[0], abs=1e-3)
    assert [[t[1] for t in top] for top in got["output_top_logprobs"]] == [
        [t[1] for t in top] for top in want["output_top_logprobs"]]


def test_turn_two_finds_its_history_on_the_decode_engine(client, engine: Engine) -> None:
    first_prompt = "User: name a large animal.\nAssistant:"
    first = generate(client, first_prompt, GREEDY)
    second_prompt = first_prompt + first["text"] + "\nUser: and a small one?\nAssistant:"
    second = generate(client, second_prompt, GREEDY)
    assert second["output_ids"] == engine.generate(second_prompt, GREEDY)["output_ids"]
    meta = second["meta_info"]
    # The decode engine holds turn one (to its last whole page): only the rest moved.
    assert meta["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 4 > 0
    moved = meta["disaggregation"]["transfer_tokens"]
    assert moved == meta["prompt_tokens"] - meta["cached_tokens"]


def test_cache_salt_keeps_tenants_apart_on_both_engines(client) -> None:
    prompt = "Tenant notes: the launch is on Tuesday at noon, in room 4."
    first = generate(client, prompt, GREEDY, cache_salt="tenant-a")["meta_info"]
    again = generate(client, prompt, GREEDY, cache_salt="tenant-a")["meta_info"]
    other = generate(client, prompt, GREEDY, cache_salt="tenant-b")["meta_info"]
    assert first["disaggregation"]["transfer_tokens"] == first["prompt_tokens"]
    assert again["cached_tokens"] > 0 and again["disaggregation"]["transfer_tokens"] < 4
    assert other["cached_tokens"] == 0
    assert other["disaggregation"]["transfer_tokens"] == other["prompt_tokens"]


def test_an_abort_mid_stream_frees_both_engines(client) -> None:
    body = {"text": LONG + " Continue:", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                break  # the first tokens came from the decode engine: hang up
    assert wait_idle(client)["d0"]["held_slots"] == 0
    # Hung up while the prompt was still on the prefill engine: nothing held either.
    body["rid"] = "hang-up-early"
    with client.stream("POST", "/generate", json=body):
        pass
    wait_idle(client)


def test_one_request_is_one_trace_across_both_engines(mesh: Mesh, client) -> None:
    generate(client, "Trace me across the mesh", {**GREEDY, "max_new_tokens": 4}, rid="pd-trace")
    assert mesh.spans is not None

    def complete(spans: list[SpanRecord]) -> bool:
        traces = {s.trace_id for s in spans if not s.links and "pd-trace" in rids_of(s)}
        mine = [s for s in spans if s.trace_id in traces]
        engines = {s.attributes.get("radixmesh.engine_id") for s in mine
                   if s.name == "engine request"}
        return ({"kv transfer", "detokenize", "stream out"} <= {s.name for s in mine}
                and engines == {"p0", "d0"}
                and {s.instance for s in mine if s.name == "forward"} == {"worker-0.0",
                                                                          "worker-1.0"})

    spans = mesh.spans.wait_for(complete, timeout=30)
    traces = {s.trace_id for s in spans if not s.links and "pd-trace" in rids_of(s)}
    assert len(traces) == 1
    mine = [s for s in spans if s.trace_id in traces]
    engines = {s.attributes.get("radixmesh.engine_id") for s in mine if s.name == "engine request"}
    assert engines == {"p0", "d0"}
    assert {s.instance for s in mine} >= {"tokenizer-0", "scheduler-0", "scheduler-1",
                                           "worker-0.0", "worker-1.0", "detokenizer-0"}


def test_transfers_show_in_the_schedulers_metrics(mesh: Mesh) -> None:
    def metric(child: str, name: str) -> float:
        url = next(c.health_url for c in mesh.children if c.name == child)
        text = httpx.get(url.replace("/health", "/metrics"), timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{"))

    assert metric("scheduler-0", "radixmesh:kv_transfers_total") > 0  # p0 sent
    assert metric("scheduler-1", "radixmesh:kv_transfers_total") > 0  # d0 received
    assert metric("scheduler-0", "radixmesh:kv_transfer_bytes_total") > 0
    assert metric("worker-1.0", "radixmesh:worker_kv_received_bytes_total") > 0


def _under_load(mesh: Mesh, victim: str, n: int = 6) -> list[dict | str]:
    """n requests at once; the victim is SIGKILLed once they are under way."""
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}

    async def run() -> list[dict | str]:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=120) as c:
            calls = [asyncio.create_task(c.post("/generate", json={
                "text": f"Story {i}: {LONG}", "sampling_params": params})) for i in range(n)]
            await asyncio.sleep(1.0)
            child = next(ch for ch in mesh.children if ch.name == victim)
            os.kill(child.proc.pid, signal.SIGKILL)
            replies = await asyncio.gather(*calls, return_exceptions=True)
        return [type(r).__name__ if isinstance(r, BaseException) else r.json()
                for r in replies]

    started = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - started < 90, "a request hung"
    return results


def _recovered(mesh: Mesh, client: httpx.Client, victim: str) -> None:
    deadline = time.monotonic() + 90
    while mesh.supervisor is not None and mesh.supervisor.restarts()[victim] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    while set(states(client)) != {"p0", "d0"}:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    got = generate(client, "The capital of France is", GREEDY)
    assert got["meta_info"]["finish_reason"]["type"] == "length"
    wait_idle(client, 60)


def test_a_killed_prefill_worker_hangs_nothing(mesh: Mesh, client) -> None:
    """The decode engine prefills what the prefill engine lost: every request completes."""
    results = _under_load(mesh, "worker-0.0")
    assert all(isinstance(r, dict) and r["meta_info"]["completion_tokens"] == 32
               for r in results), results
    _recovered(mesh, client, "worker-0.0")


def test_a_killed_decode_worker_hangs_nothing(mesh: Mesh, client) -> None:
    """Requests with output end with a clear error; those without are retried elsewhere."""
    results = _under_load(mesh, "worker-1.0")
    for r in results:
        assert isinstance(r, dict), results
        finish = r["meta_info"]["finish_reason"]
        assert r["meta_info"]["completion_tokens"] == 32 or (
            finish["type"] == "abort" and "lost its worker" in finish["message"]), r
    _recovered(mesh, client, "worker-1.0")
