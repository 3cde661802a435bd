"""What serving LoRA adapters costs the in-process Engine: one batch of prompts with no
adapter, all under one adapter, and spread over several adapters and the base, in one run.

The model is the bundled SmolLM2 (or --model), with random rank-`--rank` adapters on q, k,
v, o, gate, up and down (radixmesh.bench.random_model). Each case runs `--batch` prompts of
16 tokens to exactly `--new-tokens` tokens (ignore_eos) from an empty prefix cache; printed:
output tok/s per case, median of --repeats, and its ratio to the case without adapters.

Usage:
    python benchmarks/bench_lora.py
    python benchmarks/bench_lora.py --batch 32 --new-tokens 64 --adapters 4 --dtype float32
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
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(args.adapters)]
        paths = ",".join(
            f"{name}={write_random_lora(Path(tmp) / name, args.model, args.rank, TARGETS, i)}"
            for i, name in enumerate(names))
        engine = Engine(args.model, dtype=args.dtype, enable_lora=True, lora_paths=paths,
                        max_loras_per_batch=args.adapters, show_progress=False)
        prompts = [[(7 * p + 13 * i + 1) % 1000 + 10 for i in range(16)]
                   for p in range(args.batch)]
        sampling = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        cases = {
            "no adapter": [None] * args.batch,
            "one adapter": [names[0]] * args.batch,
            f"{args.adapters} adapters + base": [
                ([*names, None])[p % (args.adapters + 1)] for p in range(args.batch)],
        }
        rates: dict[str, float] = {}
        try:
            engine.generate(input_ids=prompts[:2], sampling_params=sampling, lora_path=None)
            for case, adapters in cases.items():
                runs = []
                for _ in range(args.repeats):
                    engine.flush_cache()
                    began = time.perf_counter()
                    engine.generate(input_ids=prompts, sampling_params=sampling,
                                    lora_path=adapters)
                    runs.append(args.batch * args.new_tokens / (time.perf_counter() - began))
                rates[case] = statistics.median(runs)
        finally:
            engine.shutdown()
    print(f"LoRA serving, {args.dtype}, batch {args.batch} x {args.new_tokens} tokens, rank "
          f"{args.rank} on all 7 projections, {torch.get_num_threads()} threads, "
          f"{cpu_name()}; medians of {args.repeats}")
    base = rates["no adapter"]
    for case, rate in rates.items():
        print(f"  {case:<22} {rate:8.1f} tok/s  {rate / base:5.2f}x")


if __name__ == "__main__":
    main()
