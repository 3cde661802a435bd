"""Every service's /metrics on the real mesh (SmolLM2, bfloat16) after a known workload:
the counters equal exactly what was sent, and the gauges show an idle engine."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import httpx
import pytest
from process_helpers import running_mesh
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.launcher import Mesh

MODEL = {"model_name": "SmolLM2-135M-Instruct.Q4_1"}
ENGINE = {**MODEL, "engine_id": "e0"}
RANK = {**MODEL, "tp_rank": "0"}
NEW_TOKENS = 6
# Token-id prompts: their lengths are exact and they share no prefix.
PROMPT_A = list(range(1000, 1020))
PROMPT_B = list(range(2000, 2013))
WORKLOAD = [PROMPT_A, PROMPT_B, PROMPT_A]  # the repeat hits all of A but its last token

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


STREAM_INTERVAL = 3  # a stream's chunks after its first: every third token, and the finish


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    log_dir = tmp_path_factory.mktemp("mesh-logs")
    with running_mesh(log_dir, dtype="bfloat16", max_total_tokens=4096,
                      stream_interval=STREAM_INTERVAL) as m:
        yield m


def scrape(mesh: Mesh, service: str) -> Samples:
    """Every sample on a service's /metrics, served next to its /health."""
    child = next(c for c in mesh.children if c.name == service)
    url = child.health_url.removesuffix("/health") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, labels: dict[str, str]) -> float:
    return samples[(name, frozenset(labels.items()))]


def generate(client: httpx.Client, prompt: list[int]) -> int:
    """Stream one request to its end; returns the tokens its first output chunk carried."""
    body = {"input_ids": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0}}
    counts = []
    with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                meta = json.loads(line[len("data: "):])["meta_info"]
                counts.append(meta["completion_tokens"])
    assert counts[-1] == NEW_TOKENS
    return next(c for c in counts if c > 0)


def settled(mesh: Mesh, timeout: float = 30) -> tuple[Samples, Samples, Samples]:
    """The tokenizer's, the scheduler's and the worker's samples once every answer is
    counted and the engine is idle: HTTP answers are counted just after they are sent, and
    a step that only releases finished requests may still be on its way to the worker."""
    deadline = time.monotonic() + timeout
    while True:
        tok, sched = scrape(mesh, "tokenizer-0"), scrape(mesh, "scheduler-0")
        worker = scrape(mesh, "worker-0.0")
        answered = sample(tok, "radixmesh:tokenizer_api_requests_total",
                          {"endpoint": "/generate", "status": "200"})
        idle = sample(sched, "radixmesh:num_running_reqs", ENGINE) == 0
        # Every round trip the scheduler timed is a step the worker ran, and back.
        steps = (sample(sched, "radixmesh:scheduler_forward_seconds_count", ENGINE),
                 sample(worker, "radixmesh:worker_forward_seconds_count", RANK))
        if answered == len(WORKLOAD) and idle and steps[0] == steps[1]:
            return tok, sched, worker
        assert time.monotonic() < deadline, (answered, idle, steps)
        time.sleep(0.1)


def test_counters_equal_the_workload_on_every_service(mesh: Mesh) -> None:
    with httpx.Client(base_url=mesh.url, timeout=120) as client:
        first_chunks = [generate(client, prompt) for prompt in WORKLOAD]
    prompt_tokens = sum(len(p) for p in WORKLOAD)
    output_tokens = NEW_TOKENS * len(WORKLOAD)
    cached = len(PROMPT_A) - 1
    tok, sched, worker = settled(mesh)

    assert sample(tok, "radixmesh:prompt_tokens_total", MODEL) == prompt_tokens
    assert sample(tok, "radixmesh:generation_tokens_total", MODEL) == output_tokens
    assert sample(tok, "radixmesh:cached_tokens_total", {**MODEL, "tier": "device"}) == cached
    assert sample(tok, "radixmesh:cached_tokens_total", {**MODEL, "tier": "host"}) == 0
    assert sample(tok, "radixmesh:num_requests_total", MODEL) == len(WORKLOAD)
    assert sample(tok, "radixmesh:num_aborted_requests_total", MODEL) == 0
    assert sample(tok, "radixmesh:tokenizer_num_in_flight_reqs", MODEL) == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert sample(tok, f"radixmesh:{histogram}_count", MODEL) == len(WORKLOAD)
    # One observation per token after each request's first chunk.
    later = output_tokens - sum(first_chunks)
    assert sample(tok, "radixmesh:inter_token_latency_seconds_count", MODEL) == later

    assert sample(sched, "radixmesh:scheduler_prompt_tokens_total", ENGINE) == prompt_tokens
    assert sample(sched, "radixmesh:scheduler_generation_tokens_total", ENGINE) == output_tokens
    tier = {**ENGINE, "tier": "device"}
    assert sample(sched, "radixmesh:scheduler_cached_tokens_total", tier) == cached
    assert sample(sched, "radixmesh:cache_hit_rate", ENGINE) == pytest.approx(
        cached / prompt_tokens
    )
    finished = {**ENGINE, "finish_reason": "length"}
    assert sample(sched, "radixmesh:scheduler_finished_requests_total", finished) == 3
    assert sample(sched, "radixmesh:num_queue_reqs", ENGINE) == 0
    pool = sample(sched, "radixmesh:max_total_num_tokens", ENGINE)
    used = sample(sched, "radixmesh:num_used_tokens", ENGINE)
    # Idle, the pool holds only the prefix cache: both prompts and their fed-back outputs.
    assert used == sample(sched, "radixmesh:scheduler_cache_tokens", tier)
    assert used >= len(PROMPT_A) + len(PROMPT_B) + 2 * (NEW_TOKENS - 1)
    assert sample(sched, "radixmesh:token_usage", ENGINE) == pytest.approx(used / pool)

    # The requests ran one after another: one request per step, a prefill then decodes;
    # the repeat computes only its last prompt token.
    steps = len(WORKLOAD) * NEW_TOKENS
    computed = len(PROMPT_A) + len(PROMPT_B) + 1 + len(WORKLOAD) * (NEW_TOKENS - 1)
    for samples, prefix, labels in ((sched, "scheduler", ENGINE), (worker, "worker", RANK)):
        assert sample(samples, f"radixmesh:{prefix}_batch_reqs_count", labels) == steps
        assert sample(samples, f"radixmesh:{prefix}_batch_reqs_sum", labels) == steps
        assert sample(samples, f"radixmesh:{prefix}_batch_tokens_sum", labels) == computed
    assert sample(worker, "radixmesh:worker_kv_pool_tokens", RANK) == pool

    detok = scrape(mesh, "detokenizer-0")
    assert sample(detok, "radixmesh:detokenizer_tokens_total", {}) == output_tokens
    # Each stream's updates: its first token, then tokens 2-4 (the interval), then 5-6 with
    # the finish.
    assert first_chunks == [1] * len(WORKLOAD)
    assert sample(detok, "radixmesh:detokenizer_updates_total", {}) == 3 * len(WORKLOAD)
    assert sample(detok, "radixmesh:detokenizer_finished_requests_total", {}) == 3
    assert sample(detok, "radixmesh:detokenizer_errors_total", {}) == 0


def test_an_answer_read_whole_costs_two_updates_unless_stop_strings_are_looked_for(
        mesh: Mesh) -> None:
    """A request whose caller waits for the whole answer: the engine sends its first token
    and its finish (20 tokens, under the 64 between updates and well within the 5 s any
    tokens wait at most); with a stop string to look for, every token; streamed, its first
    token and every third. The answers are equal."""
    sampling = {"max_new_tokens": 20, "ignore_eos": True, "temperature": 0}

    def updates() -> float:
        return sample(scrape(mesh, "detokenizer-0"), "radixmesh:detokenizer_updates_total", {})

    def settled_updates(before: float, expected: int) -> float:
        deadline = time.monotonic() + 10
        while (count := updates() - before) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return count

    texts, counts = [], []
    with httpx.Client(base_url=mesh.url, timeout=120) as client:
        for extra in ({}, {"stop": ["never said"]}):
            before = updates()
            out = client.post("/generate", json={
                "input_ids": PROMPT_B, "sampling_params": {**sampling, **extra}})
            assert out.status_code == 200, out.text
            texts.append(out.json()["text"])
            counts.append(settled_updates(before, 20 if extra else 2))
        before = updates()
        body = {"input_ids": PROMPT_B, "stream": True, "sampling_params": sampling}
        with client.stream("POST", "/generate", json=body) as response:
            events = [json.loads(line[len("data: "):])
                      for line in response.iter_lines() if line.startswith("data: {")]
        counts.append(settled_updates(before, 8))
    # Tokens 1, 2-4, ..., 17-19, 20 (with the finish); the tokenizer may join chunks that
    # arrive before the client reads.
    assert counts == [2, 20, 1 + 6 + 1]
    assert all(e["meta_info"]["completion_tokens"] % STREAM_INTERVAL == 1
               for e in events[:-1])
    assert events[-1]["meta_info"]["completion_tokens"] == 20
    assert texts == [events[-1]["text"]] * 2  # each event holds the text so far
