"""The flags and flow of `radixmesh bench`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixmesh.core import flags, settings

if TYPE_CHECKING:
    from radixmesh.bench.workloads import Workload

DATASETS = ("random", "shared-prefix", "multi-turn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `radixmesh bench`."""
    target = p.add_argument_group("target")
    target.add_argument("--backend", choices=("radixmesh", "openai"), default="radixmesh",
                        help="radixmesh: native /generate; openai: any /v1/completions server")
    target.add_argument("--base-url", default="http://127.0.0.1:30000")
    target.add_argument("--model", help="model name for --backend openai (default: the "
                        "server's first in /v1/models)")
    target.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                        help="--backend openai: send token ids, or their text to servers "
                        "that take only text")
    target.add_argument("--extra-body", default="{}",
                        help="JSON object merged into every /v1/completions body")
    target.add_argument("--launch", action="store_true",
                        help="start the whole mesh on free ports, benchmark it, stop it")

    # The model's settings as the mesh declares them: the tokenizer for the prompts, and
    # with --launch the mesh's model and precision.
    flags.add_arguments(p, settings.ModelSettings)
    flags.add_arguments(p, settings.DeviceSettings, only=("dtype",))

    data = p.add_argument_group("workload")
    data.add_argument("--dataset", choices=DATASETS, default="random")
    data.add_argument("--num-prompts", type=int, default=64, help="random: prompts")
    data.add_argument("--random-input-len", type=int, default=256)
    data.add_argument("--random-output-len", type=int, default=64)
    data.add_argument("--random-range-ratio", type=float, default=1.0,
                      help="random: lengths drawn from [len x ratio, len]")
    data.add_argument("--gsp-num-groups", type=int, default=4,
                      help="shared-prefix: system prompts")
    data.add_argument("--gsp-prompts-per-group", type=int, default=8)
    data.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    data.add_argument("--gsp-question-len", type=int, default=64)
    data.add_argument("--gsp-output-len", type=int, default=64)
    data.add_argument("--mt-conversations", type=int, default=8, help="multi-turn: chats")
    data.add_argument("--mt-turns", type=int, default=4)
    data.add_argument("--mt-first-len", type=int, default=1024,
                      help="multi-turn: tokens of each chat's first message")
    data.add_argument("--mt-question-len", type=int, default=64,
                      help="multi-turn: tokens of every later message")
    data.add_argument("--mt-output-len", type=int, default=64)

    load = p.add_argument_group("load")
    load.add_argument("--concurrency", default="8",
                      help="max requests in flight; a comma list sweeps (1,2,4,8); 0: no bound")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="conversations started per second, Poisson (default: all at once)")
    load.add_argument("--warmup-requests", type=int, default=2)
    load.add_argument("--seed", type=int, default=1)

    out = p.add_argument_group("output")
    out.add_argument("--output", help="write the results as JSON here")
    out.add_argument("--plot", help="write a PNG of throughput and TTFT against concurrency "
                     "(default with a sweep and --output: next to the JSON)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_concurrency(text: str) -> list[int | None]:
    """"1,2,4" -> [1, 2, 4]; 0 means no bound (None)."""
    levels: list[int | None] = []
    for part in text.split(","):
        value = int(part)
        if value < 0:
            raise ValueError(f"--concurrency must not be negative, got {value}")
        levels.append(value or None)
    return levels


def build_workload(args: argparse.Namespace, pool: list[int]) -> Workload:
    """The workload the flags describe."""
    from radixmesh.bench import workloads as w

    if args.dataset == "random":
        return w.random_workload(pool, args.seed, args.num_prompts, args.random_input_len,
                                 args.random_output_len, args.random_range_ratio)
    if args.dataset == "shared-prefix":
        return w.shared_prefix_workload(pool, args.seed, args.gsp_num_groups,
                                        args.gsp_prompts_per_group, args.gsp_system_prompt_len,
                                        args.gsp_question_len, args.gsp_output_len)
    return w.multi_turn_workload(pool, args.seed, args.mt_conversations, args.mt_turns,
                                 args.mt_first_len, args.mt_question_len, args.mt_output_len)


@contextmanager
def _target(args: argparse.Namespace) -> Iterator[str]:
    """The base URL to benchmark: --base-url, or a mesh started for the run."""
    if not args.launch:
        yield args.base_url
        return
    from radixmesh.launcher import Mesh, MeshArgs

    with tempfile.TemporaryDirectory(prefix="radixmesh-bench-") as logs:
        mesh_args = MeshArgs(model_path=args.model_path, dtype=args.dtype, port=0, grpc_port=0,
                             log_dir=logs)
        print(f"starting the mesh ({args.dtype}); service logs in {logs}", file=sys.stderr)
        with Mesh(mesh_args).start() as mesh:
            yield mesh.url


async def _run(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    from radixmesh.bench.backends import Backend, OpenAIBackend, RadixmeshBackend
    from radixmesh.bench.runner import Load, run_loads
    from radixmesh.bench.workloads import word_pool
    from radixmesh.core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(args.model_path)
    pool = word_pool(tokenizer)
    workload = build_workload(args, pool)
    extra = json.loads(args.extra_body)
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    backend: Backend
    if args.backend == "radixmesh":
        backend = RadixmeshBackend(base_url, tokenizer)
    else:
        backend = OpenAIBackend(base_url, tokenizer, args.model, args.prompt_format, extra)
    loads = [Load(c, args.request_rate, args.seed) for c in parse_concurrency(args.concurrency)]
    try:
        runs = await run_loads(backend, workload, loads, pool, args.warmup_requests,
                               progress=not args.no_progress)
    finally:
        await backend.close()
    return {
        "backend": args.backend,
        "base_url": "launched" if args.launch else base_url,
        "model": getattr(backend, "model", None) or tokenizer.source,
        "seed": args.seed,
        "workload": {"name": workload.name, "requests": workload.num_requests,
                     **workload.params},
        "warmup_requests": args.warmup_requests,
        "runs": runs,
    }


def run(args: argparse.Namespace) -> int:
    """Run `radixmesh bench` with parsed flags; the exit code."""
    from radixmesh.bench.report import format_run, format_sweep

    with _target(args) as base_url:
        result = asyncio.run(_run(args, base_url))
    runs = result["runs"]
    for r in runs:
        print(format_run(r))
    if len(runs) > 1:
        print(format_sweep(runs))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot or (args.output and len(runs) > 1):
        _plot(result, args.plot or str(Path(args.output).with_suffix(".png")), bool(args.plot))
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _plot(result: dict[str, Any], path: str, asked: bool) -> None:
    """Draw the sweep; without matplotlib only an explicit --plot is an error."""
    from radixmesh.bench.plot import plot_sweep

    try:
        plot_sweep({result["backend"]: result["runs"]}, path, result["workload"]["name"])
    except ModuleNotFoundError:
        if asked:
            raise
        print("no plot: matplotlib is not installed (pip install 'radixmesh[bench]')",
              file=sys.stderr)
        return
    print(f"plot: {path}", file=sys.stderr)
