"""What one user, and a few, get through `radixmesh up` against the engine in process (and
llama.cpp's server when it is built), in one sitting, with each process's CPU per token.

Usage:
    python benchmarks/bench_mesh.py                       # 1, 16 and 64 streams x 128 tokens
    python benchmarks/bench_mesh.py --streams 1 --repeats 5
    python benchmarks/bench_mesh.py --quick               # 1 and 4 streams x 16 tokens, once
    LLAMA_SERVER=/path/to/llama-server python benchmarks/bench_mesh.py   # the peer too

Every side runs the bundled model with its default flags, in a process of its own, one after
the other, on the same token-id prompts (word salad drawn with a fixed seed), greedy with
ignore_eos so every request produces exactly --new-tokens tokens; the sides take turns in each
repeat. For each count of concurrent calls: `streamed` (the mesh's /generate with stream,
llama-server's /completion with stream, the Engine's stream=True from one thread a call) and
`whole` (the same calls answered whole). Per run: output tok/s = all output tokens / wall
time from the first call sent to the last token received; inter-token latency = the gap
between consecutive streamed chunks divided by the tokens the later chunk carries (p50 and
p90 over all gaps); TTFT = first chunk (or the whole answer) - call start. Figures are
medians over repeats; ratios are against the in-process engine, also per repeat (the sides
of a repeat run back to back). Each process's CPU per output token comes from /proc over
the run, the engine's from its own process; the worker's idle share is the part of the run
its torch thread did not spend in steps (the worker's forward-seconds metric). The clients
are aiohttp (as SGLang's bench_serving) for the servers and threads for the Engine: their CPU
is on the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

SEED = 1234
MODES = ("streamed", "whole")
FIGURES = ("output_tok_s", "itl_p50_ms", "itl_p90_ms", "ttft_mean_s")  # the table's rows
# (arrival time, tokens in the chunk) of every chunk with tokens, per call
Chunks = list[list[tuple[float, int]]]


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


def summarize(started: float, streams: Chunks) -> dict[str, float]:
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
        "itl_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else float("nan"),
        "itl_p90_ms": 1000 * gaps[int(len(gaps) * 0.9)] if gaps else float("nan"),
        "ttft_mean_s": statistics.mean(ttft),
        "tokens": total,
    }


def greedy(new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}


# ---- the sides ------------------------------------------------------------------------------


def run_engine(work: list[list[int]], streams: list[int], new_tokens: int) -> dict:
    """The in-process Engine: each run's figures and the process's CPU us per token."""
    from radixmesh.api import Engine

    params = greedy(new_tokens)
    out: dict[str, dict[str, Any]] = {}
    with Engine(show_progress=False) as engine:
        engine.generate(input_ids=work[0], sampling_params=params)  # warm-up
        for count, mode in runs_of(streams):
            engine.flush_cache()
            chunks: Chunks = [[] for _ in range(count)]

            def consume(i: int, chunks: Chunks = chunks, mode: str = mode) -> None:
                if mode == "whole":
                    got = engine.generate(input_ids=work[i], sampling_params=params)
                    chunks[i].append((time.perf_counter(), len(got["output_ids"])))
                    return
                for chunk in engine.generate(input_ids=work[i], sampling_params=params,
                                             stream=True):
                    if chunk["output_ids"]:
                        chunks[i].append((time.perf_counter(), len(chunk["output_ids"])))

            threads = [threading.Thread(target=consume, args=(i,)) for i in range(count)]
            cpu, started = time.process_time(), time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            figures = summarize(started, chunks)
            figures["cpu_us"] = {"engine": (time.process_time() - cpu) / figures["tokens"] * 1e6}
            out[f"{count}/{mode}"] = figures
    return out


async def http_calls(url: str, bodies: list[dict], mode: str, llama: bool) -> Chunks:
    """The calls at once, each on a connection opened before the clock starts."""
    import aiohttp

    chunks: Chunks = [[] for _ in bodies]

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        path = "/completion" if llama else "/generate"
        async with http.post(url + path, json={**bodies[i], "stream": mode == "streamed"}) as r:
            r.raise_for_status()
            if mode == "whole":
                body = await r.json()
                n = body["tokens_predicted"] if llama else body["meta_info"]["completion_tokens"]
                chunks[i].append((time.perf_counter(), n))
                return
            seen = 0
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if llama:  # one token an event; the last one carries only the figures
                    done = seen + (not event.get("stop"))
                else:
                    done = event["meta_info"]["completion_tokens"]
                if done > seen:
                    chunks[i].append((time.perf_counter(), done - seen))
                    seen = done

    async def connect(http: aiohttp.ClientSession) -> None:
        async with http.get(url + "/health") as r:
            await r.read()

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=connector) as http:
        await asyncio.gather(*(connect(http) for _ in bodies))
        await asyncio.gather(*(one(http, i) for i in range(len(bodies))))
    return chunks


def _metric_sum(url: str, name: str) -> float:
    """The sum of every sample of a Prometheus metric at `url`."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text,
                                            re.M))


def _server_runs(url: str, bodies: list[dict], streams: list[int], processes: Any,
                 llama: bool, busy: Any = None) -> dict:
    """Each run's figures through the server at `url`, with its processes' CPU us per token
    and, where `busy()` reads the worker's seconds in steps, the worker's idle share."""
    out: dict[str, dict[str, Any]] = {}
    for count, mode in runs_of(streams):
        if not llama:
            urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"))
        cpu, spent = processes.cpu(), busy() if busy else 0.0
        started = time.perf_counter()
        chunks = asyncio.run(http_calls(url, bodies[:count], mode, llama))
        wall = time.perf_counter() - started
        figures = summarize(started, chunks)
        after = processes.cpu()
        figures["cpu_us"] = {name: (after[name] - cpu[name]) / figures["tokens"] * 1e6
                             for name in after}
        if busy:
            figures["worker_idle"] = 1 - (busy() - spent) / wall
        out[f"{count}/{mode}"] = figures
    out["rss_mib"] = processes.rss_mib()
    return out


def run_mesh(work: list[list[int]], streams: list[int], new_tokens: int) -> dict:
    """`radixmesh up` as a user starts it (ports aside)."""
    from peer_server import Processes

    from radixmesh.launcher import Mesh, MeshArgs

    bodies = [{"input_ids": ids, "sampling_params": greedy(new_tokens)} for ids in work]
    with tempfile.TemporaryDirectory() as logs, Mesh(
        MeshArgs(port=0, grpc_port=0, log_dir=logs)
    ).start() as mesh:
        (worker,) = [c for c in mesh.children if c.service == "worker"]
        metrics = worker.health_url.replace("/health", "/metrics")
        asyncio.run(http_calls(mesh.url, bodies[:1], "streamed", False))  # warm-up
        return _server_runs(
            mesh.url, bodies, streams, Processes.of_mesh(mesh), False,
            lambda: _metric_sum(metrics, "radixmesh:worker_forward_seconds_sum"))


def run_llama(work: list[list[int]], streams: list[int], new_tokens: int) -> dict:
    """llama-server with its default flags, as many slots as the most streams."""
    from peer_server import Processes, llama_server

    # Its default flags, but a slot for every call (a later -np wins over peer_server's 16).
    args = argparse.Namespace(llama_server=os.environ["LLAMA_SERVER"], threads=os.cpu_count(),
                              llama_args=f"-np {max(streams)} {os.environ.get('LLAMA_ARGS', '')}")
    bodies = [{"prompt": ids, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0,
               "cache_prompt": False} for ids in work]
    with llama_server(args) as (url, pid):
        asyncio.run(http_calls(url, bodies[:1], "streamed", True))  # warm-up
        return _server_runs(url, bodies, streams, Processes({"llama-server": [pid]}), True)


SIDES = {"engine": run_engine, "mesh": run_mesh, "llama-server": run_llama}


def runs_of(streams: list[int]) -> list[tuple[int, str]]:
    return [(count, mode) for count in streams for mode in MODES]


def spawn_side(script: str, side: str, args: argparse.Namespace, name: str) -> dict:
    """`script --side <side>` with this run's workload flags, in a process of its own: the
    figures it prints last (one JSON line). Exits naming the `name` side if it fails."""
    cmd = [sys.executable, script, "--side", side, "--streams", args.streams,
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the {name} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over repeats of every figure of every run (CPU per process too)."""
    out: dict[str, Any] = {}
    for run, figures in runs[0].items():
        out[run] = {}
        for key, value in figures.items():
            if isinstance(value, dict):
                out[run][key] = {k: statistics.median(r[run][key][k] for r in runs)
                                 for k in value}
            else:
                out[run][key] = statistics.median(r[run][key] for r in runs)
    return out


def workload(args: argparse.Namespace) -> str:
    return (f"{args.new_tokens} new tokens a call, {args.prompt_len}-token prompts, greedy, "
            f"default flags, median of {args.repeats}")


def report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    from radixmesh.bench.report import cpu_name

    med = {side: medians(rs) for side, rs in runs.items()}
    sides = list(runs)
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {workload(args)}")
    for count, mode in runs_of([int(s) for s in args.streams.split(",")]):
        run = f"{count}/{mode}"
        print(f"\n{count} concurrent call{'s' * (count > 1)}, {mode}")
        print(f"  {'':<16}" + "".join(f"{s:>14}" for s in sides))
        for key in FIGURES:
            print(f"  {key:<16}" + "".join(f"{med[s][run][key]:>14.2f}" for s in sides))
        engine = med["engine"][run]["output_tok_s"]
        print(f"  {'/ in-process':<16}" + "".join(
            f"{med[s][run]['output_tok_s'] / engine:>13.2f}x" for s in sides))
        for s in sides[1:]:
            paired = [r[run]["output_tok_s"] / e[run]["output_tok_s"]
                      for e, r in zip(runs["engine"], runs[s], strict=True)]
            print(f"  {s} / in-process per repeat: " + ", ".join(f"{p:.2f}" for p in paired))
        print("  CPU ms per output token: " + "; ".join(
            f"{s} " + ", ".join(f"{name} {us / 1e3:.2f}" for name, us in
                                med[s][run]["cpu_us"].items()) for s in sides))
        if "worker_idle" in med.get("mesh", {}).get(run, {}):
            print(f"  mesh worker idle: {med['mesh'][run]['worker_idle']:.1%} of the run")
    for s in sides[1:]:
        print(f"\nRSS MiB after the runs, {s}: " + ", ".join(
            f"{name} {mib:.0f}" for name, mib in med[s]["rss_mib"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,16,64", help="concurrent calls, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 and 4 streams x 16 tokens, once")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--side", choices=list(SIDES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.streams, args.new_tokens, args.repeats = "1,4", 16, 1
    streams = [int(s) for s in args.streams.split(",")]
    if args.side:
        work = prompts(max(streams), args.prompt_len)
        print(json.dumps(SIDES[args.side](work, streams, args.new_tokens)))
        return
    sides = ["engine", "mesh"] + (["llama-server"] if os.environ.get("LLAMA_SERVER") else [])
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.repeats):
        for side in sides:
            runs[side].append(spawn_side(__file__, side, args, side))
            print(f"repeat {r + 1} {side} done", file=sys.stderr)
    report(args, runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
