"""Speculative decoding (n-gram drafts) on and off, and llama.cpp's server beside them, on
workloads whose answers repeat their context and on one that has nothing to copy.

Sides, one after another in one sitting, each in a process of its own:
  off        the in-process Engine, quantization auto (the bundled GGUF's own types)
  ngram      the same with --speculative-algorithm NGRAM (the defaults otherwise)
  llama.cpp  llama-server -np 1 -c 8192 -t 2 with its default flags (--llama-server PATH)
  llama.cpp-ngram  the same with its own n-gram drafts (--llama-spec-args, default
             --spec-type ngram-simple)
Workloads (chat-templated prompts, token ids made once in the parent, greedy):
  copy    "Repeat the following text word for word:" and a ~500-token text; 256 new tokens
  json    20 records given as lines of text, asked back as JSON under a json_schema (an array
          of 20 objects with name, city, age, job); to the end of the array
  free    "Write a story about ..." (nothing to copy); 256 new tokens
  copy16  16 copy prompts at once (radixmesh sides): aggregate output tok/s
One-stream figures: decode tok/s = (n - 1) / (t_end - t_first_token), every run a fresh
text (nothing already in the n-gram store); the mean accept length (tokens a verify step
produced) from meta_info. The sides run --rounds times, in alternating order, each time
with a warm-up and --repeats timed runs; figures are medians over all of a side's runs.
Prints one table with ngram / off and ngram / the faster llama.cpp side.

Usage:
    python benchmarks/bench_speculative.py --llama-server PATH/llama-server
    python benchmarks/bench_speculative.py --sides off,ngram --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_llama_server import post_stream, wait_healthy  # this script's folder is on sys.path

SIDES = ("off", "ngram", "llama.cpp", "llama.cpp-ngram")
WORKLOADS = ("copy", "json", "free", "copy16")
SEED = 7
NAMES = ["Ana", "Ben", "Carla", "Dmitri", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas",
         "Kira", "Liam", "Maya", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sami", "Tara"]
CITIES = ["Lisbon", "Oslo", "Lima", "Cairo", "Kyoto", "Quito", "Dublin", "Perth", "Tunis", "Riga"]
JOBS = ["baker", "pilot", "nurse", "teacher", "farmer", "painter", "driver", "chemist"]
ADJ = ["quiet", "old", "bright", "small", "busy", "green", "cold", "famous", "narrow", "warm"]
NOUN = ["river", "market", "garden", "bridge", "library", "harbor", "village", "forest",
        "station", "museum", "school", "mountain"]
VERB = ["opens", "closes", "shines", "waits", "grows", "changes", "sleeps", "returns"]
TOPICS = ["a lighthouse keeper", "a lost robot", "a dragon who bakes bread", "two rival chefs",
          "a city under the sea", "a clockmaker's apprentice", "a fox in winter"]
RECORDS = {"type": "array", "minItems": 20, "maxItems": 20, "items": {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                   "age": {"type": "integer"}, "job": {"type": "string"}},
    "required": ["name", "city", "age", "job"], "additionalProperties": False}}


def text(rng: random.Random, sentences: int) -> str:
    """Plain sentences of a seeded kind, ~12 tokens each."""
    out = []
    for _ in range(sentences):
        a, b = rng.sample(NOUN, 2)
        out.append(f"The {rng.choice(ADJ)} {a} near the {b} {rng.choice(VERB)} every "
                   f"{rng.choice(['morning', 'evening', 'winter', 'day'])}.")
    return " ".join(out)


def chat(tokenizer: Any, message: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}])
    return tokenizer.encode(text)


def workloads(repeats: int) -> dict[str, Any]:
    from radixmesh.core.tokenizer import Tokenizer

    tok = Tokenizer.from_path(None)
    rng = random.Random(SEED)
    runs = repeats + 1  # a warm-up, then the timed runs; every prompt fresh

    def copy() -> list[int]:
        return chat(tok, "Repeat the following text word for word:\n\n" + text(rng, 40))

    def records() -> list[int]:
        people = [f"{n} lives in {rng.choice(CITIES)}, is {rng.randint(20, 70)} and works "
                  f"as a {rng.choice(JOBS)}." for n in rng.sample(NAMES, 20)]
        return chat(tok, "Write these 20 people as a JSON list of objects with the keys "
                    "name, city, age and job, in this order:\n" + "\n".join(people))

    return {
        "copy": [copy() for _ in range(runs)],
        "json": [records() for _ in range(runs)],
        "free": [chat(tok, f"Write a story about {rng.choice(TOPICS)}.") for _ in range(runs)],
        "copy16": [[copy() for _ in range(16)] for _ in range(runs)],
    }


# ---- radixmesh ---------------------------------------------------------------------------


def run_radixmesh(args: argparse.Namespace, data: dict[str, Any], ngram: bool) -> dict[str, Any]:
    from radixmesh.api import Engine

    extra = {"speculative_algorithm": "NGRAM"} if ngram else {}
    engine = Engine(max_total_tokens=args.context, show_progress=False, **extra)
    fixed = {"temperature": 0, "ignore_eos": True, "max_new_tokens": args.new_tokens}
    schema = {"temperature": 0, "max_new_tokens": 1024, "json_schema": json.dumps(RECORDS)}

    def stream(ids: list[int], params: dict[str, Any]) -> dict[str, float]:
        start, first, n, meta = time.perf_counter(), None, 0, {}
        for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
            if first is None and chunk["output_ids"]:
                first = time.perf_counter()
            n += len(chunk["output_ids"])
            meta = chunk["meta_info"]
        end = time.perf_counter()
        assert first is not None and n > 1
        out = {"decode_tok_s": (n - 1) / (end - first), "tokens": n,
               "ttft_ms": (first - start) * 1e3}
        if meta.get("spec_verify_ct"):
            out["accept_length"] = meta["spec_accept_length"]
        return out

    def batch(prompts: list[list[int]]) -> dict[str, float]:
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=fixed)
        wall = time.perf_counter() - start
        n = sum(len(o["output_ids"]) for o in outs)
        verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        accepted = sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)
        out = {"decode_tok_s": n / wall, "tokens": n}
        if verify:
            out["accept_length"] = (accepted + verify) / verify
        return out

    plans = {
        "copy": lambda: [lambda ids=ids: stream(ids, fixed) for ids in data["copy"]],
        "json": lambda: [lambda ids=ids: stream(ids, schema) for ids in data["json"]],
        "free": lambda: [lambda ids=ids: stream(ids, fixed) for ids in data["free"]],
        "copy16": lambda: [lambda p=p: batch(p) for p in data["copy16"]],
    }
    result: dict[str, Any] = {w: measure(plans[w]()) for w in args.workloads if w in plans}
    result["quantization"] = engine.runner.quantization
    engine.shutdown()
    return result


# ---- llama.cpp ---------------------------------------------------------------------------


def run_llama(args: argparse.Namespace, data: dict[str, Any], spec: bool) -> dict[str, Any]:
    from radixmesh.core.model_files import resolve_model_path
    from radixmesh.mesh.nats_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [args.llama_server, "-m", str(resolve_model_path(None)), "--host", "127.0.0.1",
           "--port", str(port), "-c", str(args.context), "-np", "1", "-t", "2", "-tb", "2",
           "--no-warmup", *args.llama_args.split(), *(args.llama_spec_args.split() if spec else [])]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, proc, log)
            base = {"temperature": 0, "cache_prompt": False, "stream": True}

            def stream(body: dict[str, Any]) -> dict[str, float]:
                first, end, n = post_stream(url, {**base, **body})
                return {"decode_tok_s": (n - 1) / (end - first), "tokens": n,
                        "ttft_ms": first * 1e3}

            fixed = {"ignore_eos": True, "n_predict": args.new_tokens}
            schema = {"n_predict": 1024, "json_schema": RECORDS}
            bodies = {"copy": fixed, "json": schema, "free": fixed}  # one stream: no copy16
            result: dict[str, Any] = {
                w: measure([lambda p=p, b=bodies[w]: stream({**b, "prompt": p}) for p in data[w]])
                for w in args.workloads if w in bodies
            }
            return result | {"command": " ".join(cmd)}
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def measure(runs: list[Any]) -> dict[str, Any]:
    """The first run warms up; medians of the rest, and every run's decode rate."""
    timed = [run() for run in runs][1:]
    keys = set.intersection(*(set(r) for r in timed))
    return {k: statistics.median(r[k] for r in timed) for k in sorted(keys)} | {
        "runs": [round(r["decode_tok_s"], 1) for r in timed]}


# ---- the parent --------------------------------------------------------------------------


def pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A side's rounds as one: per workload the median of every timed run's decode rate,
    and the median accept length."""
    out: dict[str, Any] = {"rounds": rounds}
    for w in WORKLOADS:
        got = [r[w] for r in rounds if w in r]
        if not got:
            continue
        out[w] = {"decode_tok_s": statistics.median(x for g in got for x in g["runs"]),
                  "runs": [x for g in got for x in g["runs"]]}
        if all("accept_length" in g for g in got):
            out[w]["accept_length"] = statistics.median(g["accept_length"] for g in got)
    return out


def _ratio(ngram: dict[str, Any], base: float | None) -> str:
    return f"{ngram['decode_tok_s'] / base:.2f}x" if ngram and base else ""


def report(results: dict[str, dict[str, Any]]) -> str:
    sides = list(results)
    lines = [f"{'workload, decode tok/s':<26}" + "".join(f"{s:>12}" for s in sides)
             + f"{'ngram/off':>11}{'ngram/llama':>13}{'accept len':>12}"]
    for w in WORKLOADS:
        row = [results[s].get(w, {}).get("decode_tok_s") for s in sides]
        if all(v is None for v in row):
            continue
        cells = "".join(f"{v:>12.1f}" if v is not None else f"{'':>12}" for v in row)
        ng = results.get("ngram", {}).get(w, {})
        off = results.get("off", {}).get(w, {}).get("decode_tok_s")
        llama = max((results.get(s, {}).get(w, {}).get("decode_tok_s") or 0
                     for s in ("llama.cpp", "llama.cpp-ngram")), default=0)
        accept = f"{ng['accept_length']:.2f}" if "accept_length" in ng else ""
        lines.append(f"{w:<26}{cells}{_ratio(ng, off):>11}{_ratio(ng, llama):>13}{accept:>12}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                   help="the llama-server binary (default: $LLAMA_SERVER; none: skip it)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"a subset of {SIDES}")
    p.add_argument("--context", type=int, default=8192, help="context / KV pool tokens")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="passes over the sides, alternating")
    p.add_argument("--workloads", type=lambda v: v.split(","), default=list(WORKLOADS),
                   help=f"a subset of {', '.join(WORKLOADS)}")
    p.add_argument("--llama-args", default="", help="more llama-server flags")
    p.add_argument("--llama-spec-args", default="--spec-type ngram-simple",
                   help="llama-server's flags for its own drafts (the llama.cpp-ngram side)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        data = json.loads(Path(args.data).read_text())
        if args.side.startswith("llama.cpp"):
            result = run_llama(args, data, spec=args.side == "llama.cpp-ngram")
        else:
            result = run_radixmesh(args, data, args.side == "ngram")
        print(json.dumps(result))
        return
    sides = [s for s in args.sides.split(",") if s]
    if not args.llama_server:
        print("skipping llama.cpp: no --llama-server", file=sys.stderr)
        sides = [s for s in sides if not s.startswith("llama.cpp")]
    rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        data_path = Path(tmp) / "data.json"
        data_path.write_text(json.dumps(workloads(args.repeats)))
        order = [s for r in range(args.rounds) for s in (sides if r % 2 == 0 else sides[::-1])]
        for side in order:
            cmd = [sys.executable, __file__, "--side", side, "--data", str(data_path),
                   "--context", str(args.context), "--new-tokens", str(args.new_tokens),
                   "--workloads", ",".join(args.workloads),
                   f"--llama-args={args.llama_args}", f"--llama-spec-args={args.llama_spec_args}"]
            if args.llama_server:
                cmd += ["--llama-server", args.llama_server]
            print(f"# {side}", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
            rounds[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"# {side}: {json.dumps(rounds[side][-1])}", file=sys.stderr, flush=True)
    results = {side: pooled(runs) for side, runs in rounds.items()}
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
