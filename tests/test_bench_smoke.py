"""`radixmesh bench` for a few seconds against the real mesh (SmolLM2), checked via its JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from process_helpers import running_mesh

from radixmesh.cli import main
from radixmesh.launcher import Mesh

QUIET = ["--no-progress", "--warmup-requests", "1"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("mesh-logs"), max_total_tokens=8192) as m:
        yield m


def bench(mesh: Mesh, out: Path, *flags: str) -> dict:
    assert main(["bench", "--base-url", mesh.url, "--output", str(out), *QUIET, *flags]) == 0
    return json.loads(out.read_text())


def test_shared_prefix_counts_exact_lengths_and_hits(mesh, tmp_path):
    result = bench(mesh, tmp_path / "sp.json", "--dataset", "shared-prefix",
                   "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2",
                   "--gsp-system-prompt-len", "64", "--gsp-question-len", "8",
                   "--gsp-output-len", "4", "--concurrency", "4")
    assert result["workload"] | {"name": "shared-prefix", "requests": 4} == result["workload"]
    (run,) = result["runs"]
    assert (run["completed"], run["failed"], run["max_concurrency"]) == (4, 0, 4)
    assert run["input_tokens"] == 4 * 72
    assert run["output_tokens"] == run["expected_output_tokens"] == 16
    assert run["exact_output_lengths"]
    assert run["cache_hit_rate"] > 0
    assert run["ttft_ms"]["p50"] > 0 and run["itl_ms"]["p50"] > 0
    assert run["output_throughput"] > 0


def test_multi_turn_reports_each_turn(mesh, tmp_path):
    result = bench(mesh, tmp_path / "mt.json", "--dataset", "multi-turn",
                   "--mt-conversations", "2", "--mt-turns", "2", "--mt-first-len", "32",
                   "--mt-question-len", "8", "--mt-output-len", "4", "--concurrency", "2")
    (run,) = result["runs"]
    assert (run["completed"], run["failed"]) == (4, 0)
    assert run["output_tokens"] == 16 and run["exact_output_lengths"]
    assert run["input_tokens"] == 2 * 32 + 2 * (32 + 4 + 8)
    assert set(run["ttft_by_turn_ms"]) == {"1", "2"}
    assert run["ttft_by_turn_ms"]["2"]["mean"] > 0
    # Turn 2 resends turn 1's prompt and answer: at least that prompt is a cache hit.
    assert run["cache_hit_rate_by_turn"]["2"] >= 32 / 44


def test_openai_backend_sweep(mesh, tmp_path):
    result = bench(mesh, tmp_path / "oa.json", "--backend", "openai", "--dataset", "random",
                   "--num-prompts", "2", "--random-input-len", "16",
                   "--random-output-len", "3", "--concurrency", "1,2")
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert (run["completed"], run["output_tokens"], run["input_tokens"]) == (2, 6, 32)
        assert run["cache_hit_rate"] == 0.0  # reported by usage, and nothing shared
    assert result["model"]  # taken from /v1/models
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return
    assert (tmp_path / "oa.png").stat().st_size > 0  # a sweep with --output draws its plot
