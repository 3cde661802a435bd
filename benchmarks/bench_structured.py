"""Constrained decoding in process: what the grammar mask costs per token, and what
jump-forward saves on a schema with long fixed keys.

Usage:
    python benchmarks/bench_structured.py              # both parts, 3 repeats
    python benchmarks/bench_structured.py --part mask --repeats 5 --max-new-tokens 96
    python benchmarks/bench_structured.py --part jump

Mask: each side sends the same prompts (greedy, bf16 by default) as one batch of --batch
requests: free, and constrained by a simple JSON schema whose one string field has no length
limit, so both sides decode for long runs. Figures are output tokens per second over the
whole batch (output tokens / wall time), and the ratio constrained / free against the
target of at least 0.9 at batch 16.

Jump: the same requests constrained by a schema of long keys with short values, on two
engines, one with --disable-jump-forward. Figures are the wall time of a batch, the engine
steps it took, the tokens jump-forward appended, and the speedup (target: at least 1.5x).

Constraints are compiled once before timing (as a served schema is after its first
request); medians over --repeats with the sides alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

from radixmesh.api import Engine

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
    "required": ["title", "story"],
}


# A form with long fixed keys and short values: most of its text is forced.
FORM = {
    "type": "object",
    "properties": {
        "customer_account_is_currently_active": {"type": "boolean"},
        "customer_prefers_electronic_statements": {"type": "boolean"},
        "number_of_open_support_tickets_this_quarter": {"type": "integer", "minimum": 0,
                                                        "maximum": 9},
        "customer_subscription_tier_at_renewal": {"enum": ["basic", "plus", "premium"]},
        "customer_has_opted_into_marketing_emails": {"type": "boolean"},
        "account_flagged_for_manual_fraud_review": {"type": "boolean"},
    },
}
FORM["required"] = list(FORM["properties"])


@dataclass
class Side:
    """One batch on one engine."""

    seconds: float
    tokens: int  # output tokens
    steps: int  # engine steps
    forced: int  # tokens jump-forward appended
    answers: list[str]


def run_side(engine: Engine, prompts: list[str], params: dict) -> Side:
    before = engine.server_info()
    start = time.perf_counter()
    outs = engine.generate(prompts, [params] * len(prompts))
    seconds = time.perf_counter() - start
    after = engine.server_info()
    return Side(
        seconds,
        sum(o["meta_info"]["completion_tokens"] for o in outs),
        after["steps"] - before["steps"],
        after["forced_tokens"] - before["forced_tokens"],
        [o["text"] for o in outs],
    )


def mask_cost(args: argparse.Namespace) -> None:
    free = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    constrained = {**free, "json_schema": json.dumps(SCHEMA)}
    with Engine(dtype=args.dtype, show_progress=False, disable_jump_forward=True) as engine:
        engine.generate("warm up", constrained)  # compiles the schema once
        print(f"# mask: {args.dtype}, {args.max_new_tokens} new tokens, greedy, medians of "
              f"{args.repeats}")
        print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'json / free':>12}")
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [f"Write story number {i} as JSON." for i in range(batch)]
            rates: dict[str, list[float]] = {"free": [], "json": []}
            for r in range(args.repeats):
                order = [("free", free), ("json", constrained)]
                for name, params in order if r % 2 == 0 else order[::-1]:
                    side = run_side(engine, prompts, params)
                    rates[name].append(side.tokens / side.seconds)
            f, j = statistics.median(rates["free"]), statistics.median(rates["json"])
            print(f"{batch:>5} {f:>11.1f} {j:>11.1f} {j / f:>11.2f}x")


def jump_forward(args: argparse.Namespace) -> None:
    params = {"temperature": 0, "max_new_tokens": 256, "json_schema": json.dumps(FORM)}
    with (
        Engine(dtype=args.dtype, show_progress=False) as jumping,
        Engine(dtype=args.dtype, show_progress=False, disable_jump_forward=True) as stepping,
    ):
        sides = {"jump": jumping, "step": stepping}
        for engine in sides.values():
            engine.generate("warm up", params)
        print(f"# jump-forward: {args.dtype}, a {len(FORM['properties'])}-key form, greedy, "
              f"medians of {args.repeats}; same: answers that parse to the same JSON")
        print(f"{'batch':>5} {'step s':>7} {'tokens':>7} {'steps':>6} {'jump s':>7} "
              f"{'tokens':>7} {'steps':>6} {'forced':>7} {'same':>6} {'speedup':>8}")
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [f"Fill in customer record {i} as JSON." for i in range(batch)]
            runs: dict[str, list[Side]] = {"jump": [], "step": []}
            for r in range(args.repeats):
                names = ["step", "jump"] if r % 2 == 0 else ["jump", "step"]
                for name in names:
                    runs[name].append(run_side(sides[name], prompts, params))
            step_s = statistics.median(s.seconds for s in runs["step"])
            jump_s = statistics.median(s.seconds for s in runs["jump"])
            step, jump = runs["step"][0], runs["jump"][0]
            same = sum(json.loads(a) == json.loads(b)
                       for a, b in zip(step.answers, jump.answers, strict=True))
            print(f"{batch:>5} {step_s:>7.2f} {step.tokens:>7} {step.steps:>6} {jump_s:>7.2f} "
                  f"{jump.tokens:>7} {jump.steps:>6} {jump.forced:>7} {same:>3}/{batch:<2} "
                  f"{step_s / jump_s:>7.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", default="both", choices=("both", "mask", "jump"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64, help="for the mask part")
    args = p.parse_args()
    if args.part in ("both", "mask"):
        mask_cost(args)
    if args.part in ("both", "jump"):
        jump_forward(args)


if __name__ == "__main__":
    main()
