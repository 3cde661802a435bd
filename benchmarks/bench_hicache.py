"""HiCache off and on: the same multi-turn workload through two fresh meshes whose device KV
pool is too small for every conversation, one of them with a host (L2) tier that holds them all.

Usage:
    python benchmarks/bench_hicache.py                  # 16 chats x 4 turns, concurrency 4
    python benchmarks/bench_hicache.py --repeats 1 --json hicache.json
    python benchmarks/bench_hicache.py --max-total-tokens 16384 --hicache-ratio 2

The workload is `radixmesh bench`'s multi-turn one (radixmesh.bench.workloads, fixed seed):
each conversation opens with a --first-len-token message and goes on with --question-len-token
ones; every turn resends the conversation so far with its answers and asks for exactly
--output-len tokens (greedy, ignore_eos). All conversations start at once and at most
--concurrency requests are in flight, so every turn 1 runs before the first turn 2: by the
time a conversation comes back, the others have gone through the device pool
(--max-total-tokens, default 8192, against ~1.5k tokens a conversation). Without HiCache its
prefix was evicted and is computed again; with it, it comes back from the host tier
(--hicache-ratio x the device pool, default 4: room for all of them).

Each side runs in a mesh of its own (the bundled model, bf16 by default), started fresh for
every repeat, warmed up with two requests and flushed; the order alternates over --repeats
(off, on, on, off, ...) so the machine's noise hits both. Figures pool every repeat: TTFT of
turn 1 and of the later turns (mean, p50), output tok/s = output tokens / time from the first
request to the last token, the prefix hit per tier from each answer's
meta_info.cached_tokens_details (tokens per run), the later turns' tokens computed and those
turns with no hit at all, and the host tier's /server_info counters. The ratios are on / off,
against the targets: later turns' TTFT at most 0.4x, output throughput at least 1.3x. Last,
the host tier's copy bandwidth (benchmarks/bench_host_copies.py, SmolLM2's KV geometry)
beside a plain memcpy. --json writes all of it, every request included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from radixmesh.bench.backends import RadixmeshBackend
from radixmesh.bench.runner import Load, run_workload, warm_up
from radixmesh.bench.stats import RequestResult, distribution, summarize
from radixmesh.bench.workloads import multi_turn_workload, word_pool
from radixmesh.core.hicache import WRITE_POLICIES
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.launcher import Mesh, MeshArgs

SIDES = ("off", "on")
TIERS = ("device", "host", "storage")
TTFT_LATER_TARGET = 0.4  # on / off, at most
THROUGHPUT_TARGET = 1.3  # on / off, at least


def server_state(url: str) -> dict[str, Any]:
    """The engine's pool, cache and host-tier counters (/server_info)."""
    with urllib.request.urlopen(url + "/server_info", timeout=30) as resp:
        return json.load(resp)["internal_states"][0]


async def drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, flush, run the workload once: every request, the run's summary, and the
    server's state before and after."""
    tokenizer = Tokenizer.from_path(args.model_path)
    pool = word_pool(tokenizer)
    workload = multi_turn_workload(pool, args.seed, args.conversations, args.turns,
                                   args.first_len, args.question_len, args.output_len)
    backend = RadixmeshBackend(url, tokenizer)
    try:
        await warm_up(backend, workload, pool, requests=2, seed=args.seed)  # ends flushed
        before = server_state(url)
        run = await run_workload(backend, workload, Load(args.concurrency or None, seed=args.seed),
                                 progress=not args.no_progress)
        after = server_state(url)
    finally:
        await backend.close()
    return {"duration_s": run.duration, "server_before": before, "server_after": after,
            "summary": summarize(run.results, run.duration),
            "requests": [asdict(r) for r in run.results]}


def run_side(side: str, args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    """One run of the workload against a fresh mesh with HiCache `side`."""
    mesh_args = MeshArgs(
        model_path=args.model_path, dtype=args.dtype, port=0, grpc_port=0, log_dir=log_dir,
        max_total_tokens=args.max_total_tokens, enable_hierarchical_cache=side == "on",
        hicache_ratio=args.hicache_ratio, hicache_write_policy=args.hicache_write_policy,
    )
    with Mesh(mesh_args).start(timeout=300) as mesh:
        return asyncio.run(drive(mesh.url, args))


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures over all its runs."""
    results = [RequestResult(**r) for run in runs for r in run["requests"]]
    done = [r for r in results if r.ok]
    first = [r.ttft for r in done if r.turn == 1 and r.ttft is not None]
    later = [r.ttft for r in done if r.turn > 1 and r.ttft is not None]
    by_turn = {t: distribution([r.ttft for r in done if r.turn == t and r.ttft is not None])
               for t in sorted({r.turn for r in done})}
    hits = {tier: sum((r.cached_tokens_details or {}).get(tier, 0) for r in done) / len(runs)
            for tier in TIERS}
    later_prompt = sum(r.prompt_tokens or r.sent_tokens for r in done if r.turn > 1)
    later_hit = sum(r.cached_tokens or 0 for r in done if r.turn > 1)
    grown = {k: sum(run["server_after"].get(k, 0) - run["server_before"].get(k, 0)
                    for run in runs) / len(runs)
             for k in ("host_backup_tokens", "host_load_tokens", "num_retractions")}
    return {
        "failed": len(results) - len(done),
        "ttft_turn1_ms": distribution(first),
        "ttft_later_ms": distribution(later),
        "ttft_by_turn_ms": by_turn,
        "output_throughput": sum(r.output_tokens for r in done)
        / sum(run["duration_s"] for run in runs),
        "exact_output_lengths": all(r.output_tokens == r.requested_tokens for r in done),
        "hit_tokens_per_run": hits,
        "later_turns_hit_rate": later_hit / later_prompt if later_prompt else None,
        "later_turns_computed_per_run": (later_prompt - later_hit) / len(runs),
        "later_turns_missed_per_run": sum(1 for r in done if r.turn > 1 and not r.cached_tokens)
        / len(runs),
        "server_per_run": grown,  # /server_info counters, after - before
        "duration_s": [run["duration_s"] for run in runs],
    }


def host_copy_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    """bench_host_copies' measurement on the device the mesh used."""
    import torch
    from bench_host_copies import measure, parse_args  # this script's folder is on sys.path

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype in ("bfloat16", "float32") else "bfloat16"
    copies, memcpy = measure(parse_args(["--tokens", str(args.copy_tokens), "--device", device,
                                         "--dtype", dtype]))
    return {"device": device, "dtype": dtype, "tokens": args.copy_tokens,
            "copies": [{"layout": layout, "slots": slots, "backup_gb_s": b, "load_gb_s": ld}
                       for layout, slots, b, ld in copies],
            "memcpy": [{"what": what, "gb_s": rate} for what, rate in memcpy]}


def _row(name: str, off: float, on: float, target: str = "", fmt: str = ".1f") -> str:
    ratio = f"{on / off:.2f}" if off else "-"
    return f"{name:<28}{off:>10{fmt}}{on:>10{fmt}}{ratio:>8}  {target}"


def report(args: argparse.Namespace, fig: dict[str, dict[str, Any]]) -> str:
    off, on = fig["off"], fig["on"]
    n = args.turns
    later = f"turns 2-{n}" if n > 2 else "turn 2"
    ttft_ratio = on["ttft_later_ms"]["mean"] / off["ttft_later_ms"]["mean"]
    tput_ratio = on["output_throughput"] / off["output_throughput"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines = [
        f"workload: {args.conversations} conversations x {n} turns, {args.first_len}-token "
        f"first message, {args.question_len}-token follow-ups, {args.output_len} output "
        f"tokens, concurrency {args.concurrency}; device pool {args.max_total_tokens} tokens, "
        f"host tier {args.hicache_ratio:g}x ({args.hicache_write_policy}); {args.dtype}; "
        f"{args.repeats} repeat(s) a side",
        f"{'':<28}{'off':>10}{'on':>10}{'on/off':>8}  target",
        _row("TTFT turn 1 mean (ms)", off["ttft_turn1_ms"]["mean"], on["ttft_turn1_ms"]["mean"]),
        _row("TTFT turn 1 p50 (ms)", off["ttft_turn1_ms"]["p50"], on["ttft_turn1_ms"]["p50"]),
        _row(f"TTFT {later} mean (ms)", off["ttft_later_ms"]["mean"],
             on["ttft_later_ms"]["mean"],
             f"<= {TTFT_LATER_TARGET}: {verdict(ttft_ratio <= TTFT_LATER_TARGET)}"),
        _row(f"TTFT {later} p50 (ms)", off["ttft_later_ms"]["p50"], on["ttft_later_ms"]["p50"]),
    ]
    lines += [_row(f"  TTFT turn {t} mean (ms)", off["ttft_by_turn_ms"][t]["mean"],
                   on["ttft_by_turn_ms"][t]["mean"]) for t in range(2, n + 1)]
    lines.append(_row("output tok/s", off["output_throughput"], on["output_throughput"],
                      f">= {THROUGHPUT_TARGET}: {verdict(tput_ratio >= THROUGHPUT_TARGET)}"))
    lines += [_row(f"prefix hit, {tier} (tok/run)", off["hit_tokens_per_run"][tier],
                   on["hit_tokens_per_run"][tier], fmt=".0f") for tier in TIERS]
    lines.append(_row(f"{later} computed (tok/run)", off["later_turns_computed_per_run"],
                      on["later_turns_computed_per_run"], fmt=".0f"))
    lines.append(_row(f"{later} with no hit (/run)", off["later_turns_missed_per_run"],
                      on["later_turns_missed_per_run"], fmt=".1f"))
    lines.append(_row("run time (s, mean)", sum(off["duration_s"]) / len(off["duration_s"]),
                      sum(on["duration_s"]) / len(on["duration_s"]), fmt=".2f"))
    server = on["server_per_run"]
    lines.append(f"server_info, on, per run: {server['host_backup_tokens']:.0f} tokens backed "
                 f"up, {server['host_load_tokens']:.0f} loaded; retractions: off "
                 f"{off['server_per_run']['num_retractions']:.1f}, on "
                 f"{server['num_retractions']:.1f}")
    for side in SIDES:
        if fig[side]["failed"] or not fig[side]["exact_output_lengths"]:
            lines.append(f"WARNING {side}: {fig[side]['failed']} failed requests; exact "
                         f"output lengths: {fig[side]['exact_output_lengths']}")
    return "\n".join(lines)


def report_copies(copies: dict[str, Any]) -> str:
    lines = [f"host tier copies of {copies['tokens']} tokens ({copies['dtype']}, device "
             f"{copies['device']}), GB/s:",
             f"  {'host layout':<12} {'slots':<10} {'backup':>8} {'load':>8}"]
    lines += [f"  {c['layout']:<12} {c['slots']:<10} {c['backup_gb_s']:>8.2f} "
              f"{c['load_gb_s']:>8.2f}" for c in copies["copies"]]
    lines += [f"  plain memcpy, {m['what']}: {m['gb_s']:.2f}" for m in copies["memcpy"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=1024, help="tokens of the first message")
    p.add_argument("--question-len", type=int, default=64, help="tokens of every later one")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=8192, help="device KV pool")
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--hicache-write-policy", choices=WRITE_POLICIES, default="write_through")
    p.add_argument("--repeats", type=int, default=2, help="runs a side, alternating order")
    p.add_argument("--model-path", help="default: the bundled SmolLM2-135M-Instruct GGUF")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--copy-tokens", type=int, default=4096,
                   help="tokens a copy moves in the host copy measurement; 0: skip it")
    p.add_argument("--log-dir", help="keep the services' logs here (default: discarded)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", help="write the figures, every run and request here")
    args = p.parse_args()
    if args.turns < 2:
        p.error("--turns must be at least 2: the later turns are what the host tier serves")

    began = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-hicache-") as tmp:
        for r in range(args.repeats):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                log_dir = str(Path(args.log_dir or tmp) / f"{side}-{r + 1}")
                run = run_side(side, args, log_dir)
                runs[side].append(run)
                s = run["summary"]
                print(f"repeat {r + 1} hicache {side}: {run['duration_s']:.1f} s, "
                      f"output {s['output_throughput']:.1f} tok/s, "
                      f"{s['failed']} failed", file=sys.stderr)
    fig = {side: figures(runs[side]) for side in SIDES}
    print(report(args, fig))
    copies = host_copy_bandwidth(args) if args.copy_tokens > 0 else None
    if copies:
        print(report_copies(copies))
    wall = time.perf_counter() - began
    print(f"wall time: {wall:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "figures": fig, "host_copies": copies, "wall_s": wall,
             "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
