"""The in-process radixmesh Engine against Hugging Face transformers `generate`, and against
itself with the GGUF file's weights dequantized.

Every side runs the same model (default: the bundled SmolLM2-135M-Instruct GGUF) in the same
precision on the same token-id prompts, each in its own subprocess (so that each has its own
peak RSS and its own torch thread pool). Sides: radixmesh (quantization auto: in bfloat16 on
the CPU, the file's own quantized types), radixmesh-bf16 (quantization=bf16: dequantized at
load) and hf. The parent prints a table with the ratios of the first radixmesh side to each
other side.

Usage:
    python benchmarks/bench_engine.py                      # full sizes, bfloat16
    python benchmarks/bench_engine.py --quick              # smoke run, small sizes
    python benchmarks/bench_engine.py --dtype float32 --repeats 5 --json out.json
    python benchmarks/bench_engine.py --sides radixmesh    # one side only
    python benchmarks/bench_engine.py --sides radixmesh,radixmesh-bf16   # quantized vs not
    python benchmarks/bench_engine.py --sides radixmesh-bf16,hf   # the same weights as HF

Figures (greedy, exact output lengths: ignore_eos on radixmesh, min_new_tokens on HF):
  1. batch: N concurrent requests x M new tokens -> aggregate output tok/s
     (HF: one batched `generate`, left padding with pad = eos).
  2. stream: one request; TTFT and decode tok/s = (n - 1) / (t_total - t_first_token).
     radixmesh: t_first_token = time to the first streamed chunk; HF: a separate
     max_new_tokens=1 `generate` on the same prompt.
  3. prefill: a fresh P-token prompt with max_new_tokens=1 -> P / wall time.
  4. shared prefix (radixmesh only): K requests sharing an S-token system prompt, each with its
     own Q-token question. TTFT of the cold first request vs the median TTFT of the K-1 cached
     follow-ups run one at a time; prefix hit rate = sum(cached_tokens) / ((K-1) * S); then
     the K requests as one batch on a flushed cache.
  5. peak RSS (ru_maxrss) of each side's process, its RSS at the end, and the minor page
     faults taken during the timed runs (many faults: memory freed to the OS every step).
Figures 2 and 3 are medians of --repeats timed runs, 1 and 4 of --long-repeats; every timed
run follows a warm-up and, on radixmesh, starts from an empty prefix cache.
Both sides inherit the environment (OMP_*, MALLOC_*, ...); --threads sets torch's threads.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from engine_sides import Sizes, run_side  # this script's folder is on sys.path

SIDES = ("radixmesh", "radixmesh-bf16", "hf")
SEED = 1234
# Ordinary lower-case word tokens with a leading space: prompts of them are plain word salad.
WORD_TOKEN = re.compile(r"^Ġ[a-z]{3,12}$")


FULL = Sizes(32, (64, 128), 128, 32, 128, 2048, 16, 1024, 64, 32)
QUICK = Sizes(4, (16, 32), 16, 16, 16, 256, 4, 256, 16, 8)


# ---- prompts (parent) ----


def word_tokens() -> list[int]:
    """Ids of ordinary word tokens in the default model's vocabulary."""
    from radixmesh.core.tokenizer import Tokenizer

    tok = Tokenizer.from_path(None)
    ids = [i for i in range(tok.vocab_size) if WORD_TOKEN.match(tok.id_to_token(i) or "")]
    if len(ids) < 1000:
        raise RuntimeError(f"only {len(ids)} word tokens found in the vocabulary")
    return ids


def make_prompts(sizes: Sizes, repeats: int, long_repeats: int) -> dict[str, Any]:
    """Every prompt either side runs, as token ids; fresh ones for each timed run."""
    rng = random.Random(SEED)
    pool = word_tokens()

    def ids(n: int) -> list[int]:
        return rng.choices(pool, k=n)

    lo, hi = sizes.batch_prompt_len
    return {
        "sizes": asdict(sizes),
        "repeats": repeats,
        "long_repeats": long_repeats,
        "batch": [ids(rng.randint(lo, hi)) for _ in range(sizes.batch_requests)],
        # [0] is the warm-up, [1:] the timed runs
        "stream": [ids(sizes.stream_prompt_len) for _ in range(repeats + 1)],
        "prefill": [ids(sizes.prefill_len) for _ in range(repeats + 1)],
        "prefix_system": [ids(sizes.prefix_len) for _ in range(2)],  # warm-up, timed
        "prefix_questions": [ids(sizes.question_len) for _ in range(sizes.prefix_requests)],
    }


# ---- the parent ----

# (key, label, format); higher is better for every tok/s figure and the TTFT ratio.
ROWS = [
    ("load_s", "model load (s)", "{:.1f}"),
    ("batch_tok_s", "batch: output tok/s", "{:.1f}"),
    ("batch_s", "batch: wall time (s)", "{:.2f}"),
    ("stream_ttft_ms", "stream: TTFT (ms)", "{:.1f}"),
    ("stream_decode_tok_s", "stream: decode tok/s", "{:.1f}"),
    ("stream_same_as_hf", "stream: greedy tokens as HF's", "{:.0%}"),
    ("prefill_tok_s", "prefill: tok/s", "{:.1f}"),
    ("prefix_cold_ttft_ms", "prefix: cold TTFT (ms)", "{:.1f}"),
    ("prefix_cached_ttft_ms", "prefix: cached TTFT, median (ms)", "{:.1f}"),
    ("prefix_ttft_ratio", "prefix: cold / cached TTFT (>= 8)", "{:.1f}x"),
    ("prefix_hit_rate", "prefix: hit rate (>= 0.90)", "{:.3f}"),
    ("prefix_batch_s", "prefix: all as one batch (s)", "{:.2f}"),
    ("prefix_batch_tok_s", "prefix: batch output tok/s", "{:.1f}"),
    ("prefix_batch_cached_tokens", "prefix: batch cached tokens", "{:.0f}"),
    ("peak_rss_mib", "peak RSS (MiB)", "{:.0f}"),
    ("end_rss_mib", "RSS at the end (MiB)", "{:.0f}"),
    ("timed_minor_faults_k", "minor page faults, timed (1000s)", "{:.1f}"),
]


def spawn_side(side: str, args: argparse.Namespace, prompts_path: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--side", side, "--prompts", prompts_path]
    cmd += ["--dtype", args.dtype] + (["--threads", str(args.threads)] if args.threads else [])
    print(f"# running: {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.splitlines()
    for line in lines[:-1]:
        print(f"[{side} stdout] {line}", file=sys.stderr)
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise SystemExit(f"the {side} side failed (exit code {proc.returncode})")
    return json.loads(lines[-1])


def greedy_match(results: dict[str, dict[str, Any]]) -> None:
    """The share of stream tokens radixmesh decodes like HF before the first difference.

    1.0 in float32; in bfloat16 near-ties on these word-salad prompts can flip an argmax."""
    lead = _lead(results)
    if lead is None or "hf" not in results:
        return
    ours, ref = results[lead]["stream_ids"], results["hf"]["stream_ids"]
    same = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in zip(ours, ref, strict=True)
    ]
    results[lead]["stream_same_as_hf"] = sum(same) / sum(len(a) for a in ours)
    results[lead]["stream_same_as_hf_per_run"] = same


def _lead(results: dict[str, dict[str, Any]]) -> str | None:
    """The radixmesh side the others are compared with: the first one run."""
    return next((name for name in results if name.startswith("radixmesh")), None)


def print_table(results: dict[str, dict[str, Any]], sizes: Sizes) -> None:
    s = sizes
    print(
        f"\n# batch: {s.batch_requests} requests x {s.batch_new_tokens} new tokens, prompts of "
        f"{s.batch_prompt_len[0]}-{s.batch_prompt_len[1]} tokens | stream: "
        f"{s.stream_prompt_len}-token prompt, {s.stream_new_tokens} new tokens, decode tok/s = "
        f"(n-1)/(t_total - t_first) | prefill: {s.prefill_len} tokens | prefix: "
        f"{s.prefix_requests} requests, {s.prefix_len}-token system prompt + {s.question_len}"
        f"-token question, {s.prefix_new_tokens} new tokens"
    )
    names = list(results)
    lead = _lead(results)
    others = [n for n in names if n != lead] if lead is not None else []
    short = {"radixmesh": "rm", "radixmesh-bf16": "rm-bf16", "hf": "HF"}
    header = f"{'figure':<36}" + "".join(f" {n:>14}" for n in names)
    mine_label = short[lead] if lead is not None else ""
    header += "".join(f" {mine_label + '/' + short[n]:>10}" for n in others)
    print(header + "\n" + "-" * len(header))
    for key, label, fmt in ROWS:
        values = [results[n].get(key) for n in names]
        if all(v is None for v in values):
            continue
        cells = "".join(f" {fmt.format(v) if v is not None else '-':>14}" for v in values)
        mine = results[lead].get(key) if lead is not None else None
        for n in others:
            theirs = results[n].get(key)
            cells += f" {f'{mine / theirs:.2f}x' if mine is not None and theirs else '-':>10}"
        print(f"{label:<36}{cells}")
    for name, res in results.items():
        print(f"# {name}: {res['info']}")


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return getattr(importlib.import_module(name), "__version__", "unknown")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of stream and prefill")
    p.add_argument("--long-repeats", type=int, default=1, help="timed runs of batch and prefix")
    p.add_argument("--sides", default="radixmesh,hf", help="comma-separated: radixmesh,hf")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each side")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side
    p.add_argument("--prompts", help=argparse.SUPPRESS)  # internal: the prompts file
    args = p.parse_args(argv)
    if args.repeats < 1 or args.long_repeats < 1:
        p.error("--repeats and --long-repeats must be at least 1")
    if any(s not in SIDES for s in args.sides.split(",")):
        p.error(f"--sides takes a comma-separated subset of {SIDES}")
    return args


def main() -> None:
    args = parse_args()
    if args.side:
        prompts = json.loads(Path(args.prompts).read_text())
        print(json.dumps(run_side(args.side, args.dtype, args.threads, prompts)), flush=True)
        return
    versions = {p: package_version(p) for p in ("torch", "transformers", "radixmesh")}
    sys.stdout.reconfigure(line_buffering=True)
    print(f"# {shlex.join([sys.executable, *sys.argv])}")
    print(f"# versions: {versions}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    sizes = QUICK if args.quick else FULL
    prompts = make_prompts(sizes, args.repeats, args.long_repeats)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prompts.json")
        Path(path).write_text(json.dumps(prompts))
        for side in args.sides.split(","):
            results[side] = spawn_side(side, args, path)
    greedy_match(results)
    print_table(results, sizes)
    if args.json:
        payload = {"argv": sys.argv, "versions": versions, "dtype": args.dtype}
        payload |= {"sizes": asdict(sizes), "results": results}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
