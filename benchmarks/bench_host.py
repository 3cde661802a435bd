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

Usage:
    python benchmarks/bench_host.py                  # batches 1, 64, 256
    python benchmarks/bench_host.py --batches 1,256 --repeats 5
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
    prompts = [[(7 * r + 13 * i + 1) % (VOCAB - 1) for i in range(PROMPT)] for r in range(batch)]
    sampling = {**params, "max_new_tokens": new_tokens, "ignore_eos": True}
    model_before = clock.seconds
    began = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=sampling)
    elapsed = time.perf_counter() - began
    assert all(o["meta_info"]["completion_tokens"] == new_tokens for o in out)
    return elapsed, clock.seconds - model_before


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
    args = parser.parse_args()
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
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
