"""Prefill/decode disaggregation against co-located engines: decode streams' inter-token
latency while long prompts arrive, one layout after the other in one sitting.

Usage:
    python benchmarks/bench_disaggregation.py                     # both layouts, 60 s each
    python benchmarks/bench_disaggregation.py --quick             # 20 s each
    python benchmarks/bench_disaggregation.py --layouts colocated --interval 2 --json out.json

Layouts, each a fresh mesh (`radixmesh up`'s processes on free ports) with the bundled model
and the mesh's defaults, the same router, the same threads in total (the launcher splits the
cores between the engines' workers):
  colocated  dp_size=2: two engines, each doing prefill and decode
  pd         prefill_dp_size=1, decode_dp_size=1: every request is prefilled by the prefill
             engine, which hands its KV to the decode engine

Workload, the same token ids in both layouts (random whole-word prompts, fixed seed, greedy,
ignore_eos so every output has exactly the length asked for):
  decode streams  --streams streams, each sending a --decode-prompt-len-token prompt for
                  --decode-tokens tokens and its next request as soon as one ends; the first
                  request of stream i (0-based) asks for (i + 1) / streams of that, so the
                  streams' request boundaries are spread out as independent users' would be
  long prompts    a --long-prompt-len-token prompt for --long-new-tokens tokens every
                  --interval seconds (at the middle of each interval), every one distinct
                  so none is served from the prefix cache
Each mesh is warmed up with a few requests (and its cache flushed), the streams start, and
after --settle seconds the window opens; it lasts --duration seconds, or until the last long
prompt has finished if that is later. The streams go on until the window closes, then their
requests in flight finish; only what arrived inside the window counts.

Measured through the native streaming /generate:
  ITL          the gap between consecutive streamed chunks of one decode request, divided
               by the tokens the later chunk carries (one gap per token; bench_serving's
               convention; a request's first token has none); the gaps of tokens that
               arrived in the window, p50 / p99 / max
  throughput   decode-stream tokens that arrived in the window / the window's length
  TTFT         of the long prompts: request sent to first token, p50 and max
The table gives PD / co-located and the targets: ITL p99 <= 0.5x, ITL p50 <= 1.0x,
throughput >= 0.9x. The client runs on the same cores as the mesh, in both layouts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from radixmesh.bench.backends import Completion, RadixmeshBackend
from radixmesh.bench.report import cpu_name
from radixmesh.bench.runner import warm_up
from radixmesh.bench.stats import distribution, percentile
from radixmesh.bench.streams import TokenClock
from radixmesh.bench.workloads import Conversation, Turn, Workload, word_pool
from radixmesh.core.tokenizer import Tokenizer

SEED = 1234
LAYOUTS: dict[str, dict[str, int]] = {
    "colocated": {"dp_size": 2},
    "pd": {"prefill_dp_size": 1, "decode_dp_size": 1},
}
LABELS = {"colocated": "co-located", "pd": "PD"}
# (figure key, label, target ratio PD / co-located, whether the ratio must be at most it)
ROWS: tuple[tuple[str, str, float | None, bool], ...] = (
    ("itl_p50_ms", "decode ITL p50 (ms)", 1.0, True),
    ("itl_p99_ms", "decode ITL p99 (ms)", 0.5, True),
    ("itl_max_ms", "decode ITL max (ms)", None, True),
    ("output_tok_s", "decode output tok/s", 0.9, False),
    ("ttft_p50_ms", "long-prompt TTFT p50 (ms)", None, True),
    ("ttft_max_ms", "long-prompt TTFT max (ms)", None, True),
)


def log(message: str) -> None:
    print(f"[bench-pd] {message}", file=sys.stderr, flush=True)


def arrivals(clock: TokenClock) -> list[float]:
    """When each of a stream's tokens arrived: the first chunk's at its time, each later one
    at the previous token's plus its gap (a chunk's last token lands on the chunk's time)."""
    if clock.first is None:
        return []
    times = [clock.first] * (clock.tokens - len(clock.itls))
    t = clock.first
    for gap in clock.itls:
        t += gap
        times.append(t)
    return times


def long_prompt_offsets(args: argparse.Namespace) -> list[float]:
    """When the long prompts are sent, in seconds from the window's start."""
    count = max(1, int(args.duration / args.interval))
    return [(k + 0.5) * args.interval for k in range(count)]


async def decode_stream(
    backend: RadixmeshBackend, args: argparse.Namespace, pool: list[int], index: int,
    stop: asyncio.Event, out: list[tuple[int, Completion]],
) -> None:
    """One stream: a request at a time until `stop` is set; (asked, completion) into out."""
    rng = random.Random(SEED * 1000 + index)
    asked = max(1, args.decode_tokens * (index + 1) // args.streams)
    while not stop.is_set():
        done = await backend.complete(rng.choices(pool, k=args.decode_prompt_len), asked)
        out.append((asked, done))
        asked = args.decode_tokens
        if done.error is not None:
            await asyncio.sleep(0.5)  # a failing mesh: no busy loop of errors


async def long_prompt(
    backend: RadixmeshBackend, prompt: list[int], new_tokens: int, at: float
) -> tuple[Completion, float]:
    """Send `prompt` at perf_counter time `at`; its completion and when it ended."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    done = await backend.complete(prompt, new_tokens)
    return done, time.perf_counter()


async def measure(url: str, tok: Tokenizer, pool: list[int], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """Warm up, run the workload, and the figures of its window."""
    rng = random.Random(SEED)
    longs = [rng.choices(pool, k=args.long_prompt_len) for _ in long_prompt_offsets(args)]
    backend = RadixmeshBackend(url, tok)
    try:
        shape = Workload("warm-up", [
            Conversation([Turn(longs[0], args.long_new_tokens)]),
            Conversation([Turn(rng.choices(pool, k=args.decode_prompt_len), 8)]),
        ])
        await warm_up(backend, shape, pool, args.warmup_requests, SEED)
        stop = asyncio.Event()
        streamed: list[tuple[int, Completion]] = []
        streams = [asyncio.create_task(decode_stream(backend, args, pool, i, stop, streamed))
                   for i in range(args.streams)]
        opens = time.perf_counter() + args.settle
        sent = await asyncio.gather(*(
            long_prompt(backend, prompt, args.long_new_tokens, opens + offset)
            for prompt, offset in zip(longs, long_prompt_offsets(args), strict=True)))
        closes = max(opens + args.duration, max(end for _, end in sent))
        await asyncio.sleep(max(0.0, closes - time.perf_counter()))
        stop.set()
        await asyncio.gather(*streams)
    finally:
        await backend.close()
    return figures(streamed, [done for done, _ in sent], opens, closes, args)


def figures(
    streamed: list[tuple[int, Completion]], longs: list[Completion], opens: float,
    closes: float, args: argparse.Namespace,
) -> dict[str, Any]:
    """The window's figures: decode ITL and throughput, long-prompt TTFT, and checks."""
    gaps: list[float] = []
    tokens = 0
    for _, done in streamed:
        times = arrivals(done.clock)
        tokens += sum(opens <= t <= closes for t in times)
        # times[-len(itls):] are the arrivals the gaps end at.
        ends = times[len(times) - len(done.clock.itls):]
        gaps += [g for g, t in zip(done.clock.itls, ends, strict=True) if opens <= t <= closes]
    failed = [done.error for _, done in streamed if done.error is not None]
    inexact = sum(done.output_tokens != asked for asked, done in streamed if done.error is None)
    ttfts = [done.clock.ttft for done in longs
             if done.error is None and done.clock.ttft is not None]
    long_errors = [done.error for done in longs if done.error is not None]
    itl = distribution(gaps)
    window = closes - opens
    return {
        "window_s": window,
        "itl_p50_ms": itl["p50"] if itl else None,
        "itl_p99_ms": itl["p99"] if itl else None,
        "itl_max_ms": max(gaps) * 1e3 if gaps else None,
        "output_tok_s": tokens / window,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3 if ttfts else None,
        "ttft_max_ms": max(ttfts) * 1e3 if ttfts else None,
        "itl_gaps": len(gaps),
        "decode_tokens_in_window": tokens,
        "decode_requests": len(streamed),
        "decode_failed": len(failed),
        "decode_inexact_lengths": inexact,
        "long_prompts": len(longs),
        "long_failed": len(long_errors),
        "long_cached_tokens": sum(done.cached_tokens or 0 for done in longs),
        "long_prompt_tokens": [done.prompt_tokens for done in longs],
        "errors": sorted(set(failed + long_errors))[:5],
    }


@contextmanager
def log_dir(args: argparse.Namespace, layout: str) -> Iterator[str]:
    """--log-dir/<layout> when given (kept), else a temporary directory."""
    if args.log_dir:
        path = Path(args.log_dir) / layout
        path.mkdir(parents=True, exist_ok=True)
        yield str(path)
    else:
        with tempfile.TemporaryDirectory(prefix=f"bench-pd-{layout}-") as tmp:
            yield tmp


def run_layout(layout: str, tok: Tokenizer, pool: list[int], args: argparse.Namespace
               ) -> dict[str, Any]:
    """Start the layout's mesh, measure it, stop it."""
    from radixmesh.launcher import Mesh, MeshArgs

    load = os.getloadavg()[0]
    with log_dir(args, layout) as logs:
        mesh_args = MeshArgs(dtype=args.dtype, port=0, grpc_port=0, log_dir=logs,
                             **LAYOUTS[layout])
        log(f"{layout}: starting the mesh ({mesh_args.engine_roles})")
        started = time.monotonic()
        with Mesh(mesh_args) as mesh:
            log(f"{layout}: up in {time.monotonic() - started:.0f} s; measuring")
            result = asyncio.run(measure(mesh.url, tok, pool, args))
            mesh.check_alive()
    result["load_average_before"] = load
    result["mesh"] = {**LAYOUTS[layout], "engine_roles": mesh_args.engine_roles,
                      "dtype": mesh_args.dtype,
                      "chunked_prefill_size": mesh_args.chunked_prefill_size,
                      "schedule_policy": mesh_args.schedule_policy,
                      "disable_overlap_schedule": mesh_args.disable_overlap_schedule}
    if result["decode_failed"] or result["long_failed"] or result["decode_inexact_lengths"]:
        log(f"warning: {layout}: {result['decode_failed']} decode and {result['long_failed']} "
            f"long requests failed, {result['decode_inexact_lengths']} inexact lengths; "
            f"{result['errors']}")
    log(f"{layout}: {json.dumps({k: v for k, v in result.items() if k != 'mesh'})}")
    return result


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def table(results: dict[str, dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The printed table's lines, and each row's ratio and verdict."""
    base, pd = results.get("colocated"), results.get("pd")
    lines = [f"{'metric':<28}{'co-located':>12}{'PD':>12}{'PD/co-located':>15}  target"]
    checks = []
    for key, label, target, at_most in ROWS:
        a = base[key] if base else None
        b = pd[key] if pd else None
        ratio = b / a if a and b is not None else None
        goal = "-" if target is None else f"{'<=' if at_most else '>='} {target:.1f}x"
        verdict = ""
        if target is not None and ratio is not None:
            met = ratio <= target if at_most else ratio >= target
            verdict = "  met" if met else "  NOT met"
            checks.append({"metric": key, "ratio": ratio, "target": goal, "met": met})
        lines.append(f"{label:<28}{_cell(a):>12}{_cell(b):>12}"
                     f"{'-' if ratio is None else f'{ratio:.2f}x':>15}  {goal}{verdict}")
    return lines, checks


def parameters(args: argparse.Namespace) -> str:
    return (f"{args.streams} decode streams x {args.decode_tokens} tokens "
            f"({args.decode_prompt_len}-token prompts); a {args.long_prompt_len}-token prompt "
            f"x {args.long_new_tokens} tokens every {args.interval:g} s "
            f"({len(long_prompt_offsets(args))} in all); window {args.duration:g} s after "
            f"{args.settle:g} s settling; {args.dtype}, bundled model, greedy, ignore_eos")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="colocated,pd",
                   help="comma list of " + ", ".join(LAYOUTS) + " (run in that order)")
    p.add_argument("--streams", type=int, default=8, help="concurrent decode streams")
    p.add_argument("--decode-tokens", type=int, default=256, help="tokens per decode request")
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--long-prompt-len", type=int, default=2048)
    p.add_argument("--long-new-tokens", type=int, default=8)
    p.add_argument("--interval", type=float, default=4.0, help="seconds between long prompts")
    p.add_argument("--duration", type=float, help="the window in seconds (default 60)")
    p.add_argument("--quick", action="store_true", help="a 20 s window")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds the streams run before the window opens")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--log-dir", help="keep the meshes' logs here (default: a temporary dir)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    args.duration = args.duration or (20.0 if args.quick else 60.0)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = set(layouts) - set(LAYOUTS)
    if unknown or not layouts:
        p.error(f"--layouts takes {', '.join(LAYOUTS)}; got {args.layouts!r}")
    for name in ("streams", "decode_tokens", "decode_prompt_len", "long_prompt_len",
                 "long_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.interval <= 0 or args.duration <= 0 or args.settle < 0:
        p.error("--interval and --duration must be positive, --settle not negative")
    if os.getloadavg()[0] > 0.5:
        log(f"warning: the machine is busy (load average {os.getloadavg()[0]:.1f}); "
            "other work on the cores skews every figure")
    tok = Tokenizer.from_path(None)
    pool = word_pool(tok)
    results = {name: run_layout(name, tok, pool, args) for name in LAYOUTS if name in layouts}
    lines, checks = table(results)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores")
    print(f"run: {parameters(args)}")
    print("windows: " + ", ".join(f"{LABELS[n]} {r['window_s']:.1f} s, {r['itl_gaps']} gaps, "
                                  f"{r['decode_requests']} decode requests, load average "
                                  f"{r['load_average_before']:.1f} before"
                                  for n, r in results.items()))
    print("\n".join(lines))
    if args.json:
        meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                "parameters": parameters(args)}
        out = {"meta": meta, "args": vars(args), "results": results, "checks": checks}
        Path(args.json).write_text(json.dumps(out, indent=2))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
