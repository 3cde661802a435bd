"""One stream against llama.cpp's own `llama-server` on the same GGUF file and context.

Three sides, one after another in one sitting, each in a process of its own holding a
4,096-token context (`--context`):
  llama.cpp        llama-server -np 1 -c 4096 -t 2 (built as the peer build describes),
                   its /completion endpoint with token-id prompts, prompt cache off
  radixmesh        the in-process Engine, quantization auto (the file's own types)
  radixmesh-bf16   the in-process Engine, quantization=bf16 (dequantized at load)
Figures: one-stream decode tok/s = (n - 1) / (t_end - t_first_token) over --new-tokens
greedy tokens (end of sequence ignored) after a 32-token prompt; the prefill of a fresh
--prefill-tokens prompt (one new token), tok/s; the process's RSS after the runs and its
peak (VmHWM). Medians of --repeats runs after a warm-up. Prints the table with the ratios
radixmesh / each other side.

Usage:
    python benchmarks/bench_llama_server.py --llama-server PATH/llama-server
    python benchmarks/bench_llama_server.py --sides radixmesh,radixmesh-bf16
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
import urllib.request
from pathlib import Path
from typing import Any

SIDES = ("llama.cpp", "radixmesh", "radixmesh-bf16")
SEED = 1234


def memory(pid: int) -> dict[str, float]:
    """RSS now and at its peak, MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    field = {ln.split(":")[0]: ln.split()[1] for ln in status.splitlines() if ln.startswith("Vm")}
    return {"rss_mib": int(field["VmRSS"]) / 1024, "peak_rss_mib": int(field["VmHWM"]) / 1024}


def prompts(args: argparse.Namespace) -> dict[str, Any]:
    from radixmesh.bench.workloads import word_pool
    from radixmesh.core.tokenizer import Tokenizer

    pool = word_pool(Tokenizer.from_path(None))
    rng = random.Random(SEED)
    runs = args.repeats + 1  # a warm-up, then the timed runs; every prompt is fresh
    return {
        "stream": [[rng.choice(pool) for _ in range(32)] for _ in range(runs)],
        "prefill": [[rng.choice(pool) for _ in range(args.prefill_tokens)] for _ in range(runs)],
    }


# ---- llama.cpp -------------------------------------------------------------------------


def post_stream(url: str, body: dict[str, Any]) -> tuple[float, float, int]:
    """(t_first_token, t_end, tokens) of one streamed /completion."""
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start, first, n = time.perf_counter(), None, 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("stop"):
                n = int(chunk.get("tokens_predicted", n))
                break
            n += 1
            if first is None:
                first = time.perf_counter() - start
    assert first is not None
    return first, time.perf_counter() - start, n


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Any) -> None:
    """Until llama-server's /health answers 200; its log's tail if it dies or takes 120 s."""
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise SystemExit(f"llama-server did not start:\n{log.read()[-2000:]!r}")
        time.sleep(0.25)


def run_llama(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    from radixmesh.core.model_files import resolve_model_path
    from radixmesh.mesh.nats_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [args.llama_server, "-m", str(resolve_model_path(None)), "--host", "127.0.0.1",
           "--port", str(port), "-c", str(args.context), "-np", "1", "-t", str(args.threads),
           "-tb", str(args.threads), "--no-warmup", *args.llama_args.split()]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, proc, log)
            base = {"temperature": 0, "ignore_eos": True, "cache_prompt": False, "stream": True}

            def stream(ids: list[int]) -> dict[str, float]:
                first, end, n = post_stream(url, {**base, "prompt": ids,
                                                   "n_predict": args.new_tokens})
                assert n == args.new_tokens, n
                return {"decode_tok_s": (n - 1) / (end - first), "ttft_ms": first * 1e3}

            def prefill(ids: list[int]) -> dict[str, float]:
                _, end, _ = post_stream(url, {**base, "prompt": ids, "n_predict": 1})
                return {"prefill_tok_s": len(ids) / end}

            res = measure(stream, prefill, data)
            return res | memory(proc.pid) | {"command": " ".join(cmd)}
        finally:
            proc.terminate()
            proc.wait(timeout=30)


# ---- radixmesh -------------------------------------------------------------------------


def run_radixmesh(args: argparse.Namespace, data: dict[str, Any], quantization: str) -> dict:
    from radixmesh.api import Engine

    engine = Engine(max_total_tokens=args.context, show_progress=False,
                    quantization=quantization)
    greedy = {"temperature": 0, "ignore_eos": True}

    def stream(ids: list[int]) -> dict[str, float]:
        start, first, n = time.perf_counter(), None, 0
        params = {**greedy, "max_new_tokens": args.new_tokens}
        for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
            if first is None and chunk["output_ids"]:
                first = time.perf_counter() - start
            n += len(chunk["output_ids"])
        end = time.perf_counter() - start
        assert first is not None and n == args.new_tokens, n
        return {"decode_tok_s": (n - 1) / (end - first), "ttft_ms": first * 1e3}

    def prefill(ids: list[int]) -> dict[str, float]:
        start = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={**greedy, "max_new_tokens": 1})
        return {"prefill_tok_s": len(ids) / (time.perf_counter() - start)}

    res = measure(stream, prefill, data)
    res |= memory(os.getpid()) | {"quantization": engine.runner.quantization}
    engine.shutdown()
    return res


def measure(stream: Any, prefill: Any, data: dict[str, Any]) -> dict[str, Any]:
    """A warm-up of each, then the medians of the timed runs."""
    runs: list[dict[str, float]] = []
    for i, (s, p) in enumerate(zip(data["stream"], data["prefill"], strict=True)):
        figures = stream(s) | prefill(p)
        if i:
            runs.append(figures)
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {
        "decode_runs": [round(r["decode_tok_s"], 1) for r in runs]
    }


# ---- the parent ------------------------------------------------------------------------

ROWS = [
    ("decode_tok_s", "one stream, decode tok/s", "{:.1f}"),
    ("ttft_ms", "one stream, TTFT (ms)", "{:.1f}"),
    ("prefill_tok_s", "prefill tok/s", "{:.0f}"),
    ("rss_mib", "RSS after the runs (MiB)", "{:.0f}"),
    ("peak_rss_mib", "peak RSS (MiB)", "{:.0f}"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                   help="the llama-server binary (default: $LLAMA_SERVER)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"a subset of {SIDES}")
    p.add_argument("--context", type=int, default=4096, help="context / KV pool tokens")
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    p.add_argument("--llama-args", default="",
                   help="more llama-server flags, e.g. --no-repack where its AMX kernels "
                   "stop on SIGILL (a CPU that lists AMX its virtual machine does not enable)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        data = json.loads(Path(args.data).read_text())
        if args.side == "llama.cpp":
            res = run_llama(args, data)
        else:
            res = run_radixmesh(args, data, "bf16" if args.side == "radixmesh-bf16" else "auto")
        print(json.dumps(res))
        return
    sides = args.sides.split(",")
    if any(s not in SIDES for s in sides):
        p.error(f"--sides takes a comma-separated subset of {SIDES}")
    if "llama.cpp" in sides and not args.llama_server:
        p.error("the llama.cpp side needs --llama-server (or $LLAMA_SERVER)")
    print(f"# {' '.join([sys.executable, *sys.argv])}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.json"
        path.write_text(json.dumps(prompts(args)))
        for side in sides:
            cmd = [sys.executable, __file__, "--side", side, "--data", str(path)]
            cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                    ("context", "new_tokens", "prefill_tokens", "repeats", "threads",
                     "llama_args")]
            if args.llama_server:
                cmd.append(f"--llama-server={args.llama_server}")
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
            results[side] = json.loads(out.splitlines()[-1])
            print(f"# {side}: {results[side]}", flush=True)
    names = list(results)
    others = [n for n in names if n != "radixmesh"] if "radixmesh" in results else []
    header = f"{'figure':<28}" + "".join(f" {n:>15}" for n in names)
    header += "".join(f" {'rm/' + n:>19}" for n in others)
    print(header + "\n" + "-" * len(header))
    for key, label, fmt in ROWS:
        cells = "".join(f" {fmt.format(results[n][key]):>15}" for n in names)
        cells += "".join(f" {results['radixmesh'][key] / results[n][key]:>18.2f}x"
                         for n in others)
        print(f"{label:<28}{cells}")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "results": results}, indent=2))


if __name__ == "__main__":
    main()
