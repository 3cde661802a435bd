"""The same streaming workload through the full mesh (HTTP /generate, NATS, gRPC, every
service its own process) and through the in-process Engine, in one run.

Usage:
    python benchmarks/bench_mesh.py                 # 32 concurrent x 128 new tokens, bf16
    python benchmarks/bench_mesh.py --quick
    python benchmarks/bench_mesh.py --json out.json

Each side runs in its own process, one after the other, on the same token-id prompts
(word salad drawn with a fixed seed), greedy with ignore_eos so every request produces
exactly --new-tokens tokens. Per side and repeat: output tok/s = all output tokens / wall
time from the first request sent to the last token received; inter-token latency = the gap
between consecutive streamed chunks divided by the tokens the later chunk carries (p50 and
p90 over all gaps); TTFT = first chunk - request start. Figures are medians over repeats;
the ratios are mesh / in-process, also per repeat (the two sides of a repeat run back to
back). The mesh's client is aiohttp, as in SGLang's bench_serving: on two cores the
client's own CPU is taken from the mesh under test, and httpx's took 2.5x aiohttp's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SEED = 1234


def prompts(n: int, length: int) -> list[list[int]]:
    from radixmesh.core.model_files import resolve_model_path
    from radixmesh.core.tokenizer import Tokenizer

    tok = Tokenizer.from_path(str(resolve_model_path(None)))
    words = [
        "time", "person", "year", "way", "day", "thing", "world", "life", "hand", "part",
        "child", "eye", "woman", "place", "work", "week", "case", "point", "number", "group",
    ]
    rng = random.Random(SEED)
    out = []
    for _ in range(n):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(length * 2)))
        out.append(ids[:length])
    return out


def summarize(started: float, streams: list[list[tuple[float, int]]]) -> dict[str, float]:
    """streams: per request, (arrival time, tokens in chunk) of every chunk with tokens."""
    gaps: list[float] = []
    ttft: list[float] = []
    total = 0
    end = started
    for chunks in streams:
        ttft.append(chunks[0][0] - started)
        total += sum(n for _, n in chunks)
        end = max(end, chunks[-1][0])
        for (t0, _), (t1, n) in zip(chunks, chunks[1:], strict=False):
            gaps.extend([(t1 - t0) / n] * n)
    gaps.sort()
    return {
        "output_tok_s": total / (end - started),
        "itl_p50_ms": 1000 * gaps[len(gaps) // 2],
        "itl_p90_ms": 1000 * gaps[int(len(gaps) * 0.9)],
        "ttft_mean_s": statistics.mean(ttft),
        "tokens": total,
    }


def run_engine(work: list[list[int]], new_tokens: int, dtype: str) -> dict[str, float]:
    from radixmesh.api import Engine

    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    with Engine(dtype=dtype, show_progress=False) as engine:
        engine.generate(input_ids=work[0], sampling_params=params)  # warm-up
        engine.flush_cache()
        streams: list[list[tuple[float, int]]] = [[] for _ in work]

        def consume(i: int) -> None:
            for chunk in engine.generate(input_ids=work[i], sampling_params=params, stream=True):
                if chunk["output_ids"]:
                    streams[i].append((time.perf_counter(), len(chunk["output_ids"])))

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(work))]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return summarize(started, streams)


async def _mesh_run(url: str, work: list[list[int]], new_tokens: int) -> dict[str, float]:
    # aiohttp, as SGLang's bench_serving: on two cores httpx's parsing took 0.17 ms of CPU
    # per token from the mesh under test, aiohttp's 0.06.
    import aiohttp

    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    streams: list[list[tuple[float, int]]] = [[] for _ in work]
    seen = [0] * len(work)

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        body = {"input_ids": work[i], "sampling_params": params, "stream": True}
        async with http.post(url + "/generate", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                done = json.loads(line[6:])["meta_info"]["completion_tokens"]
                if done > seen[i]:
                    streams[i].append((time.perf_counter(), done - seen[i]))
                    seen[i] = done

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        await one(http, 0)
        async with http.post(url + "/flush_cache") as r:
            r.raise_for_status()
        streams[0], seen[0] = [], 0
        started = time.perf_counter()
        await asyncio.gather(*(one(http, i) for i in range(len(work))))
    return summarize(started, streams)


def run_mesh(work: list[list[int]], new_tokens: int, dtype: str) -> dict[str, float]:
    from radixmesh.launcher import Mesh, MeshArgs

    with tempfile.TemporaryDirectory() as logs, Mesh(
        MeshArgs(dtype=dtype, port=0, grpc_port=0, log_dir=logs)
    ).start() as mesh:
        return asyncio.run(_mesh_run(mesh.url, work, new_tokens))


def side_main(args: argparse.Namespace) -> None:
    work = prompts(args.requests, args.prompt_len)
    run = run_engine if args.side == "engine" else run_mesh
    print(json.dumps(run(work, args.new_tokens, args.dtype)))


def spawn_side(script: str, side: str, args: argparse.Namespace, name: str) -> dict[str, float]:
    """`script --side <side>` with this run's workload flags, in a process of its own: the
    figures it prints last (one JSON line). Exits naming the `name` side if it fails."""
    cmd = [sys.executable, script, "--side", side, "--requests", str(args.requests),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--dtype", args.dtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the {name} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


FIGURES = ("output_tok_s", "itl_p50_ms", "itl_p90_ms", "ttft_mean_s")  # the table's rows


def medians(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each side's median of every figure over its runs."""
    return {side: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
            for side, rs in runs.items()}


def workload(args: argparse.Namespace) -> str:
    return (f"workload: {args.requests} concurrent streams x {args.new_tokens} new tokens, "
            f"{args.prompt_len}-token prompts, {args.dtype}, median of {args.repeats}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="8 requests x 16 tokens, 1 repeat")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--side", choices=("engine", "mesh"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side_main(args)
        return
    if args.quick:
        args.requests, args.new_tokens, args.repeats = 8, 16, 1
    runs: dict[str, list[dict[str, float]]] = {"engine": [], "mesh": []}
    for r in range(args.repeats):
        for side in ("engine", "mesh"):
            runs[side].append(spawn_side(__file__, side, args, side))
            print(f"repeat {r + 1} {side}: {json.dumps(runs[side][-1])}", file=sys.stderr)
    med = medians(runs)
    e, m = med["engine"], med["mesh"]
    print(workload(args))
    print(f"{'figure':<22}{'in-process':>12}{'mesh':>12}{'mesh/in-process':>18}")
    for key in FIGURES:
        print(f"{key:<22}{e[key]:>12.2f}{m[key]:>12.2f}{m[key] / e[key]:>18.2f}")
    print(f"added inter-token latency p50: {m['itl_p50_ms'] - e['itl_p50_ms']:.2f} ms")
    # The machine's speed drifts between runs: each repeat's back-to-back pair is the
    # steadier ratio.
    paired = [mr["output_tok_s"] / er["output_tok_s"]
              for er, mr in zip(runs["engine"], runs["mesh"], strict=True)]
    print("output tok/s, mesh/in-process per repeat: "
          + ", ".join(f"{r:.2f}" for r in paired)
          + f"; median {statistics.median(paired):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "median": med}, f, indent=2)


if __name__ == "__main__":
    main()
