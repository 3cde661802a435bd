"""The engine's host cost per decode step, with a model whose forward is nearly free.

A 1-layer, 64-wide Llama with random weights (vocabulary 1,024, the engine's default
bfloat16) makes the model's own work small, so what a decode step costs is mostly the
host's: scheduling, the runner's bookkeeping, sampling, folding the result back,
publishing. The in-process Engine runs `batch` requests (16-token prompts, ignore_eos)
twice, to `short` and to `long` new tokens; the difference cancels the prefill and
start-up, leaving `long - short` decode steps of the whole batch.

The model is not free at large batches (a CPU reads every request's KV each step), so the
runner's model calls (forward and logits) are timed too: host time = step time - model
time. Printed per batch size: the step time, the model's share of it, the host time per
request per step and the output tokens per second. The targets of the host-path work: at
most 10 us of host time per request per step at batch 256, a batch-1 step at most 0.4 ms.

Then the scheduler's own pass alone, without a model: schedule() and process_result() for
a batch of plain decodes, per request per step, at page sizes 1 and 16.

With --mesh, the same model behind `radixmesh up` (every service its own process) serves
`--streams` concurrent /generate calls, against the in-process Engine running the same
prompts as one batch, in the same run: output tok/s on both sides (prefill included, the
same on both), their ratio, every service's CPU time per output token and its RSS after
the run. Two kinds of calls take turns: streamed, and answered whole (the engine then
sends a request's output every 64 tokens rather than every token). The client reads a
stream as raw chunks and parses only its last event, so that its own CPU (on the same
cores) takes little from the mesh; its CPU is printed too, and with it the ceiling the
cores allow (cores / every process's CPU per token, the client's included). Last, the
floor under any streaming front door on aiohttp: a bare aiohttp server's CPU per event,
streaming fixed events of a /generate chunk's size to the same client and streams.

Usage:
    python benchmarks/bench_host.py                  # batches 1, 64, 256
    python benchmarks/bench_host.py --batches 1,256 --repeats 5
    python benchmarks/bench_host.py --mesh           # 256 calls, mesh vs in-process
    python benchmarks/bench_host.py --mesh --stream-interval 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from peer_server import proc_stat  # this script's folder is on sys.path

from radixmesh.bench.random_model import LlamaShape, write_random_llama
from radixmesh.bench.report import cpu_name

SHAPE = LlamaShape(hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, head_dim=16,
                   vocab=1024)
VOCAB = SHAPE.vocab
PROMPT = 16


class ModelClock:
    """Seconds the runner spends in the model's forward and logits calls."""

    def __init__(self, model: Any) -> None:
        self.seconds = 0.0
        for name in ("forward", "logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began
        return timed


def timed_batch(engine: Any, clock: ModelClock, batch: int, new_tokens: int,
                params: dict) -> tuple[float, float]:
    """Seconds to run `batch` fresh prompts to exactly `new_tokens` tokens each, and the
    model's seconds of them."""
    engine.flush_cache()
    sampling = {**params, "max_new_tokens": new_tokens, "ignore_eos": True}
    model_before = clock.seconds
    began = time.perf_counter()
    out = engine.generate(input_ids=prompts(batch), sampling_params=sampling)
    elapsed = time.perf_counter() - began
    assert all(o["meta_info"]["completion_tokens"] == new_tokens for o in out)
    return elapsed, clock.seconds - model_before


def prompts(batch: int) -> list[list[int]]:
    return [[(7 * r + 13 * i + 1) % (VOCAB - 1) for i in range(PROMPT)] for r in range(batch)]


class EngineFigures(NamedTuple):
    rates: list[float]  # output tok/s per repeat
    cpu_us: float  # the process's CPU us per output token over the repeats


def engine_rate(model: Path, streams: int, new_tokens: int, repeats: int) -> EngineFigures:
    """In-process output tok/s over `streams` prompts run as one batch, per repeat, and
    the CPU it took per output token."""
    from radixmesh.api import Engine

    sampling = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    rates = []
    with Engine(str(model), max_running_requests=streams,
                max_total_tokens=streams * (PROMPT + new_tokens + 16),
                show_progress=False) as engine:
        engine.generate(input_ids=prompts(streams), sampling_params={**sampling,
                                                                     "max_new_tokens": 4})
        cpu = 0.0
        for _ in range(repeats):
            engine.flush_cache()
            before, began = proc_stat(os.getpid())[0], time.perf_counter()
            engine.generate(input_ids=prompts(streams), sampling_params=sampling)
            rates.append(streams * new_tokens / (time.perf_counter() - began))
            cpu += proc_stat(os.getpid())[0] - before
    return EngineFigures(rates, cpu / (streams * new_tokens * repeats) * 1e6)


MODES = ("streamed", "whole")  # streaming /generate calls; calls answered whole


class Calls(NamedTuple):
    rate: float  # output tok/s
    client_cpu_s: float  # the client's own CPU time (its thread's), on the same cores
    events: int  # server-sent events read (streams only)


async def call_all(url: str, calls: list[list[int]], new_tokens: int, stream: bool = True
                   ) -> Calls:
    """Concurrent /generate calls, one per prompt of `calls` (token ids), streamed or
    answered whole, each on a connection opened before the clock starts (kept alive, as a
    load generator's pool keeps them). A stream is read as raw chunks and only its last
    event is parsed."""
    import aiohttp

    sampling = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}

    async def opened(http: aiohttp.ClientSession) -> None:
        async with http.get(url + "/health") as r:
            await r.read()

    async def one(http: aiohttp.ClientSession, ids: list[int]) -> tuple[int, int]:
        body = {"input_ids": ids, "sampling_params": sampling, "stream": stream}
        async with http.post(url + "/generate", json=body) as r:
            r.raise_for_status()
            if not stream:
                return int((await r.json())["meta_info"]["completion_tokens"]), 0
            read = [data async for data in r.content.iter_any()]
        events = b"".join(read)
        last = events[events.rindex(b"data: {") + 6:]
        meta = json.loads(last[:last.index(b"\n")])["meta_info"]
        return int(meta["completion_tokens"]), events.count(b"data: {")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        async with http.post(url + "/flush_cache") as r:
            r.raise_for_status()
        await asyncio.gather(*(opened(http) for _ in calls))
        cpu, began = time.thread_time(), time.perf_counter()
        done = await asyncio.gather(*(one(http, ids) for ids in calls))
        elapsed, cpu = time.perf_counter() - began, time.thread_time() - cpu
    assert all(n == new_tokens for n, _ in done), done
    return Calls(sum(n for n, _ in done) / elapsed, cpu, sum(e for _, e in done))


def _sse_server(port: int, new_tokens: int, tick_s: float) -> None:
    """The floor under a streaming front door: a bare aiohttp server on uvloop whose
    /generate streams `new_tokens` fixed events (a mid-stream /generate chunk's size), one
    per stream every `tick_s`, as decode steps would."""
    import uvloop
    from aiohttp import web

    meta = {"id": "0" * 32, "finish_reason": None, "prompt_tokens": PROMPT,
            "completion_tokens": new_tokens, "cached_tokens": 0, "e2e_latency": 0.1}
    event = b"data: " + json.dumps({"text": " word" * (new_tokens // 2),
                                    "output_ids": list(range(new_tokens // 2)),
                                    "meta_info": meta}).encode() + b"\n\n"

    async def serve() -> None:
        tick = asyncio.Event()

        async def generate(request: web.Request) -> web.StreamResponse:
            await request.read()
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(new_tokens):
                await tick.wait()
                await response.write(event)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

        async def ok(request: web.Request) -> web.Response:
            return web.Response()

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/flush_cache", ok)
        app.router.add_get("/health", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        while True:
            await asyncio.sleep(tick_s)
            tick.set()  # wakes every stream waiting; the next ones wait for the next tick
            tick.clear()

    uvloop.run(serve())


def sse_floor(streams: int, new_tokens: int, repeats: int, tick_s: float = 0.005) -> float:
    """A bare aiohttp server's CPU microseconds per server-sent event, written to
    `streams` concurrent streams read by this benchmark's client: what any Python front
    door built on it pays per streamed event before doing anything of its own."""
    import multiprocessing

    from radixmesh.launcher import healthy
    from radixmesh.mesh.nats_server import free_port

    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=_sse_server, args=(port, new_tokens, tick_s), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not healthy(url + "/health"):
            if time.monotonic() > deadline or not server.is_alive():
                raise RuntimeError("the bare aiohttp server did not start")
            time.sleep(0.05)
        asyncio.run(call_all(url, prompts(streams), new_tokens))  # warm-up
        spent, events = 0.0, 0
        for _ in range(repeats):
            before = proc_stat(server.pid)[0]
            events += asyncio.run(call_all(url, prompts(streams), new_tokens)).events
            spent += proc_stat(server.pid)[0] - before
    finally:
        server.kill()
    return spent / events * 1e6


class MeshFigures(NamedTuple):
    rates: dict[str, list[float]]  # output tok/s per repeat, by mode
    # CPU us per output token, by mode and process (the benchmark's own client as "client")
    cpu: dict[str, dict[str, float]]
    rss: dict[str, float]  # MiB after every repeat, by process
    events: float  # server-sent events per output token, streamed


def mesh_figures(model: Path, streams: int, new_tokens: int, repeats: int,
                 stream_interval: int, incremental: bool) -> MeshFigures:
    """The mesh's output tok/s per repeat of each mode (the modes take turns); each
    process's CPU microseconds per output token over a mode's repeats, and its RSS after
    them all."""
    from radixmesh.launcher import Mesh, MeshArgs

    args = MeshArgs(model_path=str(model), port=0, grpc_port=0, max_running_requests=streams,
                    max_total_tokens=streams * (PROMPT + new_tokens + 16),
                    stream_interval=stream_interval, incremental_streaming_output=incremental)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    spent: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
    events = 0
    with tempfile.TemporaryDirectory() as logs, Mesh(replace(args, log_dir=logs)) as mesh:
        pids = {c.service: c.proc.pid for c in mesh.children}
        if mesh.nats is not None and mesh.nats.pid is not None:
            pids["nats"] = mesh.nats.pid
        asyncio.run(call_all(mesh.url, prompts(streams), 4))  # warm-up
        for _ in range(repeats):
            for mode in MODES:
                before = {name: proc_stat(pid)[0] for name, pid in pids.items()}
                calls = asyncio.run(
                    call_all(mesh.url, prompts(streams), new_tokens, mode == "streamed"))
                rates[mode].append(calls.rate)
                events += calls.events
                used = {name: proc_stat(pid)[0] - before[name] for name, pid in pids.items()}
                for name, cpu in [*used.items(), ("client", calls.client_cpu_s)]:
                    spent[mode][name] = spent[mode].get(name, 0.0) + cpu
        tokens = streams * new_tokens * repeats
        cpu = {mode: {name: used / tokens * 1e6 for name, used in by_name.items()}
               for mode, by_name in spent.items()}
        rss = {name: proc_stat(pid)[1] for name, pid in pids.items()}
    return MeshFigures(rates, cpu, rss, events / tokens)


def mesh_main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "host-model"
        write_random_llama(model, SHAPE)
        engine = engine_rate(model, args.streams, args.new_tokens, args.repeats)
        mesh = mesh_figures(model, args.streams, args.new_tokens, args.repeats,
                            args.stream_interval, args.incremental_streaming_output)
    floor = sse_floor(args.streams, args.new_tokens, args.repeats)
    e = statistics.median(engine.rates)
    m = {mode: statistics.median(rates) for mode, rates in mesh.rates.items()}
    print(f"mesh vs in-process, {args.streams} concurrent /generate calls x {args.new_tokens} "
          f"new tokens ({PROMPT}-token prompts), stream_interval {args.stream_interval}"
          f"{', incremental streaming output' if args.incremental_streaming_output else ''}, "
          f"{cpu_name()}; medians of {args.repeats}")
    print(f"in-process {e:,.0f} out tok/s, {engine.cpu_us:.1f} CPU us per output token")
    print(f"{'':<22}" + "".join(f"{mode:>12}" for mode in MODES))
    print(f"{'mesh out tok/s':<22}" + "".join(f"{m[mode]:>12,.0f}" for mode in MODES))
    print(f"{'mesh / in-process':<22}" + "".join(f"{m[mode] / e:>11.2f}x" for mode in MODES))
    names = list(mesh.rss)
    services = [n for n in names if n != "worker"]
    print("CPU us per output token, and RSS MiB after the run:")
    for name in [*services, "worker"]:
        print(f"  {name:<20}" + "".join(f"{mesh.cpu[mode][name]:>12.1f}" for mode in MODES)
              + f"{mesh.rss[name]:>10.0f}")
    print(f"  {'services':<20}" + "".join(
        f"{sum(mesh.cpu[mode][n] for n in services):>12.1f}" for mode in MODES)
        + "   (all but the worker)")
    print(f"  {'client':<20}" + "".join(f"{mesh.cpu[mode]['client']:>12.1f}" for mode in MODES)
          + "   (this benchmark's HTTP calls)")
    # What the cores allow: the mesh cannot outrun its processes' and its client's CPU.
    cores = os.cpu_count() or 1
    ceiling = {mode: cores * 1e6 / sum(mesh.cpu[mode].values()) for mode in MODES}
    print(f"{'CPU ceiling, tok/s':<22}" + "".join(f"{ceiling[mode]:>12,.0f}" for mode in MODES)
          + f"   ({cores} cores / all processes' CPU per token, client included)")
    print(f"{'mesh / ceiling':<22}" + "".join(f"{m[mode] / ceiling[mode]:>11.2f}x"
                                              for mode in MODES))
    # A reader that falls behind gets what arrived meanwhile as one event.
    print(f"streamed: {mesh.events:.2f} events per output token; the tokenizer "
          f"{mesh.cpu['streamed']['tokenizer'] / mesh.events:.1f} CPU us per event, a bare "
          f"aiohttp server {floor:.1f} (the same client and streams, fixed events)")
    if args.json:
        args.json.write_text(json.dumps({"engine_tok_s": engine.rates,
                                         "engine_cpu_us_per_token": engine.cpu_us,
                                         "mesh_tok_s": mesh.rates,
                                         "events_per_token": mesh.events,
                                         "sse_floor_us_per_event": floor,
                                         "cpu_us_per_token": mesh.cpu, "rss_mib": mesh.rss},
                                        indent=2))


def scheduler_pass(batch: int, page: int, steps: int = 200) -> float:
    """Seconds per request per decode step of the scheduler's pass alone: schedule(), then
    process_result() with the step before's tokens (as with overlap), then drain_updates()."""
    from radixmesh.core.sampling_params import SamplingParams
    from radixmesh.core.step import EntryResult, StepResult, int_array
    from radixmesh.engine.request import Req
    from radixmesh.engine.scheduler import ScheduledBatch, Scheduler
    from radixmesh.engine.scheduler_config import SchedulerConfig

    def result(b: ScheduledBatch) -> StepResult:
        out = StepResult(b.batch.step, decode_tokens=int_array([7] * len(b.batch.decode_rows)))
        out.results = [EntryResult("", token_id=7 if e.sample else -1) for e in b.batch.entries]
        return out

    slots = -(-batch * (PROMPT + steps + 16) // page) * page
    sched = Scheduler(SchedulerConfig(num_slots=slots, page_size=page, eos_token_ids=(2,),
                                      max_running_requests=batch))
    for r, ids in enumerate(prompts(batch)):
        sched.add_request(Req(rid=f"r{r}", input_ids=ids, seed=0,
                              params=SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)))
    while sched.waiting:
        b = sched.schedule()
        assert b is not None
        sched.process_result(b, result(b))
    last = sched.schedule()
    began = time.perf_counter()
    for _ in range(steps):
        b = sched.schedule()
        assert last is not None and b is not None
        sched.process_result(last, result(last))
        sched.drain_updates()
        last = b
    return (time.perf_counter() - began) / steps / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=72)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sampled", action="store_true",
                        help="temperature 0.8, top_p 0.9 instead of greedy")
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--mesh", action="store_true",
                        help="the mesh against the in-process engine (see above)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the mesh's --stream-interval")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="the mesh's --incremental-streaming-output")
    args = parser.parse_args()
    if args.mesh:
        mesh_main(args)
        return
    batches = [int(b) for b in args.batches.split(",")]

    from radixmesh.api import Engine

    params = {"temperature": 0.8, "top_p": 0.9} if args.sampled else {"temperature": 0}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "host-model"
        write_random_llama(model, SHAPE)
        engine = Engine(
            str(model), max_running_requests=max(batches),
            max_total_tokens=max(batches) * (PROMPT + args.long + 16), show_progress=False,
            disable_overlap_schedule=args.disable_overlap_schedule,
        )
        clock = ModelClock(engine.runner.model)
        try:
            # Warm-up; a constrained request waits for the grammar compiler, which loads
            # in the background at start and would take CPU from the first timed runs.
            engine.generate(input_ids=[1, 2, 3], sampling_params={"regex": "t[0-9]+",
                                                                  "max_new_tokens": 2})
            timed_batch(engine, clock, max(batches), 4, params)
            for batch in batches:
                steps, models = [], []
                for _ in range(args.repeats):
                    short, short_model = timed_batch(engine, clock, batch, args.short, params)
                    long, long_model = timed_batch(engine, clock, batch, args.long, params)
                    steps.append((long - short) / (args.long - args.short))
                    models.append((long_model - short_model) / (args.long - args.short))
                step, model = statistics.median(steps), statistics.median(models)
                rows.append({"batch": batch, "step_ms": step * 1e3, "model_ms": model * 1e3,
                             "host_us_per_request_step": (step - model) / batch * 1e6,
                             "out_tok_s": batch / step})
        finally:
            engine.shutdown()
    print(f"host path, {'sampled' if args.sampled else 'greedy'}, "
          f"overlap {'off' if args.disable_overlap_schedule else 'on'}, "
          f"{torch.get_num_threads()} threads, {cpu_name()}; medians of {args.repeats}")
    print(f"{'batch':>6} {'step ms':>9} {'model ms':>9} {'host us/req/step':>17} "
          f"{'out tok/s':>10}")
    for r in rows:
        print(f"{r['batch']:>6} {r['step_ms']:>9.3f} {r['model_ms']:>9.3f} "
              f"{r['host_us_per_request_step']:>17.1f} {r['out_tok_s']:>10.0f}")
    print("the scheduler's pass alone (no model), us per request per step:")
    for page in (1, 16):
        figures = [statistics.median(scheduler_pass(b, page) for _ in range(args.repeats))
                   for b in batches]
        print(f"  page {page:>2}: " + ", ".join(
            f"batch {b} {f * 1e6:.2f}" for b, f in zip(batches, figures, strict=True)))
        rows.append({"scheduler_pass_page": page, **{
            f"batch_{b}_us": f * 1e6 for b, f in zip(batches, figures, strict=True)}})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
