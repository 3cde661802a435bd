"""The in-process engine on a GPU, in one table: a Llama-3.2-1B-shaped model with random
weights (bf16: hidden 2048, 16 layers, 32 query / 8 KV heads, vocabulary 128,256).

Figures (greedy, ignore_eos, exact lengths; each a median of --repeats runs):
  stream      one request, 256-token prompt: decode tok/s (step time from the difference
              of a short and a long run, so the prefill cancels)
  batch B     B requests of 256-token prompts x 256 new tokens: output tok/s of the whole
              run, and the decode step time as above, for B in 1, 32, 64, 128, 256
  prefill     16 fresh 2,048-token prompts, one new token each: prompt tok/s
  shared      64 requests sharing a 1,024-token prefix (cached by a first request) plus
              64 tokens of their own, 64 new tokens each: output tok/s
  GPU busy    the share of a batch-256 decode run's wall time the GPU spends inside the
              runner's steps (CUDA events around each step)
  mesh        the same model behind `radixmesh up` on the same device, 256 concurrent
              /generate calls as the batch-256 run (answered whole, then streamed):
              output tok/s and its ratio to the in-process batch-256 figure
Each decode figure's share of the card's limit: the bytes a step must read (weights + the
batch's KV) at --bandwidth; the prefill's at --flops. It finishes within 6 minutes on an
H200 with the default sizes; --quick runs a smoke version anywhere (--device cpu too).

Usage:
    python benchmarks/bench_gpu.py                       # on cuda:0
    python benchmarks/bench_gpu.py --cuda-graph-max-bs 32  # compare a graph setting
    python benchmarks/bench_gpu.py --quick --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixmesh.bench.random_model import LlamaShape, write_random_llama

SHAPES = {
    "llama-1b": LlamaShape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                           head_dim=64, vocab=128_256),
    "tiny": LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16,
                       vocab=1024),
}


class Bench:
    """One engine and the runs the table is made of."""

    def __init__(self, engine: Any, vocab: int, sync: Callable[[], None]) -> None:
        self.engine, self.vocab, self.sync = engine, vocab, sync
        self.prompt_seed = 0

    def prompts(self, n: int, length: int, prefix: list[int] | None = None) -> list[list[int]]:
        """Fresh prompts (never cached before), after `prefix` when given."""
        self.prompt_seed += 1
        out = []
        for r in range(n):
            seed = self.prompt_seed * 100_003 + r * 7919
            own = [(seed + 31 * i * i + 17 * i) % (self.vocab - 2) for i in range(length)]
            out.append([*(prefix or []), *own])
        return out

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, dict]:
        """Seconds to run the prompts together to exactly `new_tokens` each."""
        params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
        self.sync()
        began = time.perf_counter()
        out = self.engine.generate(input_ids=prompts, sampling_params=params)
        self.sync()
        elapsed = time.perf_counter() - began
        assert all(o["meta_info"]["completion_tokens"] == new_tokens for o in out)
        return elapsed, out[0]["meta_info"]

    def decode_step(self, batch: int, prompt: int, short: int, long: int) -> tuple[float, float]:
        """(decode step seconds, whole-run output tok/s) of `batch` requests."""
        t_short, _ = self.run(self.prompts(batch, prompt), short)
        t_long, _ = self.run(self.prompts(batch, prompt), long)
        return (t_long - t_short) / (long - short), batch * long / t_long


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shape and sizes: a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None,
                        help="as the engine's flag; default: the engine's default")
    parser.add_argument("--bandwidth", type=float, default=4.2e12, help="bytes/s (H200)")
    parser.add_argument("--flops", type=float, default=7.9e14, help="bf16 dense FLOP/s (H200)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-mesh", action="store_true", help="no mesh rows")
    args = parser.parse_args()
    shape = "tiny" if args.quick else "llama-1b"
    prompt, short, long = (16, 4, 12) if args.quick else (256, 32, 256)
    batches = [1, 4, 8] if args.quick else [1, 32, 64, 128, 256]
    prefill_n, prefill_len = (2, 64) if args.quick else (16, 2048)
    shared_n, shared_len, own_len = (4, 32, 8) if args.quick else (64, 1024, 64)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from radixmesh.api import Engine

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        began = time.perf_counter()
        model = Path(tmp) / "model"
        weight_bytes = write_random_llama(model, SHAPES[shape], torch.bfloat16, args.device)
        kwargs: dict[str, Any] = {"dtype": "bfloat16", "device": args.device,
                                  "max_running_requests": max(batches),
                                  "max_total_tokens": max(batches) * (prompt + long) + 8192 * 4,
                                  "show_progress": False}
        if args.cuda_graph_max_bs is not None:
            kwargs["cuda_graph_max_bs"] = args.cuda_graph_max_bs
        engine = Engine(str(model), **kwargs)
        print(f"model written and loaded in {time.perf_counter() - began:.0f} s "
              f"({weight_bytes / 1e9:.2f} GB of weights)", flush=True)
        bench = Bench(engine, SHAPES[shape].vocab, sync)
        kv_token = SHAPES[shape].kv_bytes_per_token()
        try:
            # Warm-up: kernels, graphs, and the grammar compiler loading in the background.
            engine.generate(input_ids=[1, 2, 3], sampling_params={"regex": "t[0-9]+",
                                                                  "max_new_tokens": 2})
            bench.run(bench.prompts(max(batches), prompt), 4)
            for batch in batches:
                steps, rates = zip(*(bench.decode_step(batch, prompt, short, long)
                                     for _ in range(args.repeats)), strict=True)
                step = statistics.median(steps)
                # What one decode step must read: every weight once, each request's KV.
                need = (weight_bytes + batch * (prompt + (short + long) / 2) * kv_token)
                name = "stream" if batch == 1 else f"batch {batch}"
                rows.append({"figure": name, "value": statistics.median(rates) if batch > 1
                             else 1 / step, "unit": "out tok/s" if batch > 1 else "decode tok/s",
                             "step_ms": step * 1e3,
                             "limit_share": need / args.bandwidth / step})
            times = [bench.run(bench.prompts(prefill_n, prefill_len), 1)[0]
                     for _ in range(args.repeats)]
            prefill = statistics.median(times)
            flops = 2 * weight_bytes / 2 * prefill_n * prefill_len
            rows.append({"figure": f"prefill {prefill_n} x {prefill_len}",
                         "value": prefill_n * prefill_len / prefill, "unit": "prompt tok/s",
                         "step_ms": None, "limit_share": flops / args.flops / prefill})
            (prefix,) = bench.prompts(1, shared_len)
            rates, hits = [], []
            for _ in range(args.repeats):
                engine.flush_cache()
                bench.run([prefix], 1)
                elapsed, meta = bench.run(bench.prompts(shared_n, own_len, prefix), own_len)
                rates.append(shared_n * own_len / elapsed)
                hits.append(meta["cached_tokens"])
            rows.append({"figure": f"shared prefix {shared_n} x ({shared_len} + {own_len})",
                         "value": statistics.median(rates), "unit": "out tok/s",
                         "step_ms": None, "limit_share": None,
                         "cached_tokens": statistics.median(hits)})
            if cuda:
                rows.append(gpu_busy(engine, bench, max(batches), prompt, long))
        finally:
            engine.shutdown()
        if not args.skip_mesh:
            batch = next(r for r in rows if r["figure"] == f"batch {max(batches)}")
            rows += mesh_rows(model, kwargs, bench.prompts(max(batches), prompt), long,
                              args.repeats, batch["value"])
    print(f"\n{shape} bf16 on {device_name(args.device)}, cuda_graph_max_bs "
          f"{args.cuda_graph_max_bs if args.cuda_graph_max_bs is not None else 'default'}; "
          f"medians of {args.repeats}")
    print(f"{'figure':<40} {'value':>12} {'unit':<13} {'step ms':>8} {'of limit':>9}")
    for r in rows:
        step = f"{r['step_ms']:.2f}" if r.get("step_ms") else ""
        share = f"{100 * r['limit_share']:.0f}%" if r.get("limit_share") else ""
        print(f"{r['figure']:<40} {r['value']:>12,.0f} {r['unit']:<13} {step:>8} {share:>9}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def mesh_rows(model: Path, engine_kwargs: dict[str, Any], calls: list[list[int]],
              new_tokens: int, repeats: int, in_process: float) -> list[dict[str, Any]]:
    """The mesh serving `calls` concurrently (answered whole, then streamed): output tok/s
    and its share of the in-process engine's on the same batch."""
    import asyncio
    import dataclasses

    from bench_host import call_all  # this script's folder is on sys.path

    from radixmesh.launcher import Mesh, MeshArgs

    names = {f.name for f in dataclasses.fields(MeshArgs)}
    args = MeshArgs(port=0, grpc_port=0, model_path=str(model),
                    **{k: v for k, v in engine_kwargs.items() if k in names})
    rows = []
    with tempfile.TemporaryDirectory() as logs, Mesh(dataclasses.replace(args, log_dir=logs)
                                                     ) as mesh:
        asyncio.run(call_all(mesh.url, calls, 4, stream=False))  # warm-up
        for stream in (False, True):
            rate = statistics.median(
                asyncio.run(call_all(mesh.url, calls, new_tokens, stream)).rate
                for _ in range(repeats))
            kind = "streamed" if stream else "answered whole"
            rows.append({"figure": f"mesh, {len(calls)} calls {kind} ({rate / in_process:.2f}x)",
                         "value": rate, "unit": "out tok/s", "step_ms": None,
                         "limit_share": None})
    return rows


def gpu_busy(engine: Any, bench: Bench, batch: int, prompt: int, long: int) -> dict[str, Any]:
    """The share of a decode run's wall time the GPU spends between CUDA events recorded
    before and after each step's launch: in stream order, so the spans never overlap, and
    the gaps between them are the host's."""
    runner = engine.runner
    launch = runner.launch
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(step: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pending = launch(step)
        end.record()
        spans.append((start, end))
        return pending

    runner.launch = timed
    try:
        elapsed, _ = bench.run(bench.prompts(batch, prompt), long)
    finally:
        runner.launch = launch
    torch.cuda.synchronize()
    busy = sum(s.elapsed_time(e) for s, e in spans) / 1e3
    return {"figure": f"GPU busy, batch {batch} run", "value": 100 * busy / elapsed,
            "unit": "% of wall", "step_ms": None, "limit_share": None}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    from radixmesh.bench.report import cpu_name

    return cpu_name()


if __name__ == "__main__":
    main()
