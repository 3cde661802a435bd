"""What serving LoRA adapters costs the in-process Engine: `--streams` prompts as one batch
with no adapter, then spread evenly over 1, 4 and 16 adapters (`--adapters`), in one run.

The model is the bundled SmolLM2 (or --model), with random rank-`--rank` adapters on q, k,
v, o, gate, up and down (radixmesh.bench.random_model), as many device slots as adapters.
Each case runs the prompts (16 tokens) to exactly `--new-tokens` tokens (ignore_eos) from an
empty prefix cache, every case once per round; printed: output tok/s per case, median of
--repeats rounds, and the median of each round's ratio to the base model alone in it. The
issue's targets on a CPU: 4 adapters >= 0.7x, 16 >= 0.6x.

Usage:
    python benchmarks/bench_lora.py
    python benchmarks/bench_lora.py --streams 32 --new-tokens 64 --adapters 1,4 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from radixmesh.api import Engine
from radixmesh.bench.random_model import write_random_lora
from radixmesh.bench.report import cpu_name

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--adapters", default="1,4,16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    counts = [int(n) for n in args.adapters.split(",")]
    streams = args.streams
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(max(counts))]
        paths = ",".join(
            f"{name}={write_random_lora(Path(tmp) / name, args.model, args.rank, TARGETS, i)}"
            for i, name in enumerate(names))
        engine = Engine(args.model, dtype=args.dtype, enable_lora=True, lora_paths=paths,
                        max_loras_per_batch=max(counts), max_running_requests=streams,
                        show_progress=False)
        prompts = [[(7 * p + 13 * i + 1) % 1000 + 10 for i in range(16)]
                   for p in range(streams)]
        sampling = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        cases: dict[str, list[str | None]] = {"base model": [None] * streams}
        for n in counts:
            cases[f"{n} adapter{'s' if n > 1 else ''}"] = [names[p % n] for p in range(streams)]
        runs: dict[str, list[float]] = {case: [] for case in cases}
        try:
            engine.generate(input_ids=prompts[:2], sampling_params=sampling, lora_path=None)
            for _ in range(args.repeats):  # every case once per round: noise hits them alike
                for case, adapters in cases.items():
                    engine.flush_cache()
                    began = time.perf_counter()
                    engine.generate(input_ids=prompts, sampling_params=sampling,
                                    lora_path=adapters)
                    runs[case].append(streams * args.new_tokens / (time.perf_counter() - began))
        finally:
            engine.shutdown()
    print(f"LoRA serving, {args.dtype}, {streams} streams x {args.new_tokens} tokens, rank "
          f"{args.rank} on all 7 projections, {torch.get_num_threads()} threads, "
          f"{cpu_name()}; medians of {args.repeats} rounds (ratio: each round's to its base)")
    base = runs["base model"]
    for case, rates in runs.items():
        ratio = statistics.median(r / b for r, b in zip(rates, base, strict=True))
        print(f"  {case:<22} {statistics.median(rates):8.1f} tok/s  {ratio:5.2f}x")

if __name__ == "__main__":
    main()
