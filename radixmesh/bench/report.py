"""Human-readable text of run summaries (the JSON is the summaries themselves)."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

_LATENCIES = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"),
              ("E2E", "e2e_latency_ms"))


def _ms(dist: dict[str, float] | None) -> str:
    if dist is None:
        return "n/a"
    return "  ".join(f"{k} {v:.1f}" for k, v in dist.items())


def _rate(value: float | None) -> str:
    return "not reported" if value is None else f"{value:.1%}"


def format_run(run: dict[str, Any]) -> str:
    """Several lines describing one run."""
    c = run.get("max_concurrency") or "no bound"
    rate = run["request_rate"] or "inf"
    lines = [
        f"{run['workload']}: concurrency {c}, request rate {rate}/s; "
        f"{run['completed']} done, {run['failed']} failed in {run['duration_s']:.2f} s",
        f"  throughput: {run['request_throughput']:.2f} req/s, "
        f"output {run['output_throughput']:.1f} tok/s, total {run['total_throughput']:.1f} tok/s",
        f"  output tokens: {run['output_tokens']} of {run['expected_output_tokens']} asked"
        f"{'' if run['exact_output_lengths'] else ' (NOT exact)'}",
    ]
    lines += [f"  {label:<5} ms: {_ms(run[key])}" for label, key in _LATENCIES]
    lines.append(f"  prefix cache hit rate: {_rate(run['cache_hit_rate'])}")
    for turn, dist in run.get("ttft_by_turn_ms", {}).items():
        hit = run["cache_hit_rate_by_turn"][turn]
        lines.append(f"  turn {turn}: TTFT {_ms(dist)}; hit rate {_rate(hit)}")
    lines += [f"  error: {e}" for e in run["errors"]]
    return "\n".join(lines)


def format_sweep(runs: list[dict[str, Any]]) -> str:
    """One line per run of a concurrency sweep."""
    head = (f"{'concurrency':>11} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} "
            f"{'TTFT mean':>10} {'TTFT p99':>9} {'ITL p50':>8} {'hit rate':>9}")
    rows = [head]
    for run in runs:
        ttft, itl = run["ttft_ms"] or {}, run["itl_ms"] or {}
        hit = run["cache_hit_rate"]
        rows.append(
            f"{run.get('max_concurrency') or 'inf':>11} {run['request_throughput']:>8.2f} "
            f"{run['output_throughput']:>10.1f} {run['total_throughput']:>12.1f} "
            f"{ttft.get('mean', float('nan')):>10.1f} {ttft.get('p99', float('nan')):>9.1f} "
            f"{itl.get('p50', float('nan')):>8.1f} {'-' if hit is None else f'{hit:.1%}':>9}"
        )
    return "\n".join(rows)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform says: benchmarks name
    the machine their figures come from."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
