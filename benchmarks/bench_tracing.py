"""What tracing costs: the mesh's streaming throughput with tracing off and on (every
service exporting every span over OTLP/HTTP to the launcher's receiver, which writes the
spans file); the scheduler's CPU per step with tracing on and off (in-process, against a
model-free worker, spans OTLP-encoded: a figure machine noise barely moves); and the
per-request cost of the tracing hooks while tracing is off.

Usage:
    python benchmarks/bench_tracing.py              # 16 concurrent x 64 new tokens, 4 repeats
    python benchmarks/bench_tracing.py --quick      # 8 x 16, 2 repeats

The sides alternate (off, on, on, off, ...) in fresh processes on the same token-id
prompts, greedy with ignore_eos; the workload and the figures are bench_mesh.py's.
A repeat runs both sides back to back, in alternating order, with a pause before each run
(on a small machine the run after another is slower while the last one's processes wind
down). Figures are medians over repeats; the paired ratio is the geometric mean of each
repeat's on / off throughput, which cancels most of what other work on the machine does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_mesh import FIGURES, greedy, http_calls, prompts, summarize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def run_side(traced: bool, work: list[list[int]], new_tokens: int, dtype: str) -> dict:
    from radixmesh.launcher import Mesh, MeshArgs

    with tempfile.TemporaryDirectory() as folder:
        spans = str(Path(folder) / "spans.jsonl") if traced else None
        args = MeshArgs(dtype=dtype, port=0, grpc_port=0, log_dir=folder, trace_file=spans)
        bodies = [{"input_ids": ids, "sampling_params": greedy(new_tokens)} for ids in work]
        with Mesh(args).start() as mesh:
            asyncio.run(http_calls(mesh.url, bodies[:1], "streamed", False))  # warm-up
            started = time.perf_counter()
            figures = summarize(started,
                                asyncio.run(http_calls(mesh.url, bodies, "streamed", False)))
            received = mesh.spans
        figures["spans"] = len(received.spans) if received is not None else 0
        return figures


def hook_cost(n: int = 20000, chunks: int = 16) -> dict[str, float]:
    """Microseconds per request of the tokenizer's and scheduler's hooks, tracing off."""
    from radixmesh.core.request import GenerationRequest
    from radixmesh.core.sampling_params import SamplingParams
    from radixmesh.engine.request import Req
    from radixmesh.services.scheduler.request_traces import RequestTraces
    from radixmesh.services.tokenizer.generation import GenerationChunk
    from radixmesh.services.tokenizer.request_trace import RequestTrace
    from radixmesh.services.tokenizer.router import Router

    router = Router()
    router.update_engine("e0", 0)
    request = GenerationRequest("r", list(range(64)), SamplingParams(max_new_tokens=chunks))
    chunk = GenerationChunk("r", "x", [1], 64, 1, 0)
    engine_request = Req(rid="r", input_ids=request.input_ids, params=request.params, seed=0)
    traces = RequestTraces("e0")

    def with_hooks() -> None:
        trace = RequestTrace(request)
        trace.route(router, request)
        trace.headers()
        traces.received(engine_request, None)
        for _ in range(chunks):
            trace.chunk(chunk)
            traces.sent("r", 1, None, 0)
        trace.end()

    def without() -> None:
        router.route(request.input_ids, "")
        for _ in range(chunks):
            pass

    out = {}
    for name, fn in (("hooks_us", with_hooks), ("bare_us", without)):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - started) / n * 1e6
    return out


def step_cost(traced: bool, requests: int = 8, new_tokens: int = 32, rounds: int = 20) -> float:
    """Scheduler CPU microseconds per step, driven as its loop drives it."""
    from fake_worker import FakeWorker
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    from radixmesh.core.sampling_params import SamplingParams
    from radixmesh.engine.request import Req
    from radixmesh.engine.scheduler import Scheduler
    from radixmesh.engine.scheduler_config import SchedulerConfig
    from radixmesh.proto import mesh_pb2 as mpb
    from radixmesh.services.scheduler.mesh_io import UpdateBuilder
    from radixmesh.services.scheduler.request_traces import RequestTraces
    from radixmesh.tracing import install

    class Encoding(SpanExporter):
        def export(self, spans):
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    provider = TracerProvider() if traced else None
    if provider is not None:
        provider.add_span_processor(BatchSpanProcessor(Encoding()))
    install(provider)
    cpu, steps = 0.0, 0
    for _ in range(rounds):
        sched, worker = Scheduler(SchedulerConfig(num_slots=4096)), FakeWorker(4096)
        builder, traces = UpdateBuilder("e0"), RequestTraces("e0")
        for i in range(requests):
            req = Req(rid=f"r{i}", input_ids=list(range(i, i + 128)), seed=0,
                      params=SamplingParams(max_new_tokens=new_tokens))
            traces.received(req, None)
            builder.register(req, mpb.EngineRequest(reply_to="reply", detok_context=1))
            sched.add_request(req)
        started = time.process_time()
        while sched.has_work():
            began = time.time_ns()
            batch = sched.schedule()
            if batch is not None:
                traces.scheduled(batch, began, time.time_ns())
                with traces.forward(batch):
                    result = worker.forward(batch.batch)
                sched.process_result(batch, result)
            for r in sched.drain_updates():
                builder.build(r, traces.sent(r.rid, len(r.output_ids), r.finish, r.cached_tokens))
            steps += 1
        cpu += time.process_time() - started
    if provider is not None:
        provider.shutdown()  # encodes what is left, counted
        install(None)
    return cpu / steps * 1e6


def spawn_side(side: str, args: argparse.Namespace) -> dict[str, float]:
    """This script's `side` in a process of its own: the figures it prints last."""
    cmd = [sys.executable, __file__, "--side", side, "--requests", str(args.requests),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--dtype", args.dtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the tracing-{side} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4, help="an even number balances order")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds before each run")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="8 requests x 16 tokens, 2 repeats")
    parser.add_argument("--side", choices=("off", "on"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        work = prompts(args.requests, args.prompt_len)
        print(json.dumps(run_side(args.side == "on", work, args.new_tokens, args.dtype)))
        return
    if args.quick:
        args.requests, args.new_tokens, args.repeats = 8, 16, 2
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for r in range(args.repeats):
        for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
            time.sleep(args.pause)
            runs[side].append(spawn_side(side, args))
            print(f"repeat {r + 1} tracing {side}: {json.dumps(runs[side][-1])}",
                  file=sys.stderr)
    off, on = ({k: statistics.median(run[k] for run in runs[side]) for k in runs[side][0]}
               for side in ("off", "on"))
    print(f"workload: {args.requests} concurrent streams x {args.new_tokens} new tokens, "
          f"{args.prompt_len}-token prompts, {args.dtype}, median of {args.repeats}")
    print(f"{'figure':<16}{'tracing off':>13}{'tracing on':>13}{'on/off':>9}")
    for key in FIGURES:
        print(f"{key:<16}{off[key]:>13.2f}{on[key]:>13.2f}{on[key] / off[key]:>9.3f}")
    pairs = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs["on"], runs["off"],
                                                                   strict=True)]
    paired = math.exp(statistics.mean(math.log(x) for x in pairs))
    print(f"paired on/off throughput: {paired:.3f} (per repeat: "
          f"{', '.join(f'{x:.3f}' for x in pairs)})")
    print(f"spans exported with tracing on: {on['spans']:.0f}")
    on_cpu, off_cpu = step_cost(True), step_cost(False)
    print(f"scheduler CPU per step (8 requests, model-free worker): off {off_cpu:.0f} us, "
          f"on {on_cpu:.0f} us (+{on_cpu - off_cpu:.0f} us)")
    cost = hook_cost()
    print(f"hooks while tracing is off: {cost['hooks_us'] - cost['bare_us']:.2f} us per "
          f"request of 16 chunks (tokenizer + scheduler request hooks)")


if __name__ == "__main__":
    main()
