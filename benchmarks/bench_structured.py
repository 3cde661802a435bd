"""Constrained against free decoding in process: what the grammar mask costs per token.

Usage:
    python benchmarks/bench_structured.py              # batch 1 and 16, 3 repeats
    python benchmarks/bench_structured.py --repeats 5 --max-new-tokens 96

Each side sends the same prompts (greedy, bf16 by default) as one batch of --batch requests:
free, and constrained by a simple JSON schema whose one string field has no length limit,
so both sides decode for long runs. The constraint is compiled once before timing (as a
served schema is after its first request). Figures are output tokens per second over the
whole batch (output tokens / wall time), medians over --repeats with the sides alternating,
and the ratio constrained / free against the target of at least 0.9 at batch 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from radixmesh.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
    "required": ["title", "story"],
}


def run_side(engine: Engine, prompts: list[str], params: dict) -> tuple[float, int]:
    """Seconds and output tokens of one batch."""
    start = time.perf_counter()
    outs = engine.generate(prompts, [params] * len(prompts))
    seconds = time.perf_counter() - start
    return seconds, sum(o["meta_info"]["completion_tokens"] for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    free = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    constrained = {**free, "json_schema": json.dumps(SCHEMA)}
    with Engine(dtype=args.dtype, show_progress=False) as engine:
        engine.generate("warm up", constrained)  # compiles the schema once
        print(f"# {args.dtype}, {args.max_new_tokens} new tokens, greedy, medians of "
              f"{args.repeats}")
        print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'json / free':>12}")
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [f"Write story number {i} as JSON." for i in range(batch)]
            rates: dict[str, list[float]] = {"free": [], "json": []}
            for r in range(args.repeats):
                order = [("free", free), ("json", constrained)]
                for name, params in order if r % 2 == 0 else order[::-1]:
                    seconds, tokens = run_side(engine, prompts, params)
                    rates[name].append(tokens / seconds)
            f, j = statistics.median(rates["free"]), statistics.median(rates["json"])
            print(f"{batch:>5} {f:>11.1f} {j:>11.1f} {j / f:>11.2f}x")


if __name__ == "__main__":
    main()
