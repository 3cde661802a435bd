"""The `radixmesh` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict

from radixmesh.bench import cli as bench_cli
from radixmesh.core.flags import add_arguments, from_args
from radixmesh.core.settings import EngineArgs
from radixmesh.launcher import MeshArgs, serve
from radixmesh.tracing.cli import add_trace_command


def _generate(args: argparse.Namespace) -> int:
    engine_args = from_args(EngineArgs, args)  # bad values fail here, before torch loads
    from radixmesh.api import Engine

    sampling = json.loads(args.sampling_params)
    sampling.setdefault("max_new_tokens", args.max_new_tokens)
    with Engine(**asdict(engine_args)) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        for chunk in engine.generate(prompt, sampling, stream=True):
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
            meta = chunk["meta_info"]
        sys.stdout.write("\n")
        print(json.dumps(meta), file=sys.stderr)
    return 0


def _up(args: argparse.Namespace) -> int:
    return serve(from_args(MeshArgs, args))


def build_parser() -> argparse.ArgumentParser:
    """The parser of every `radixmesh` command."""
    parser = argparse.ArgumentParser(prog="radixmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt with the in-process engine",
                         description="Generate from one prompt with the in-process engine.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64,
                     help="most tokens to generate, unless --sampling-params sets "
                     "max_new_tokens (default %(default)s)")
    gen.add_argument("--sampling-params", default="{}", help="JSON object of sampling params")
    add_arguments(gen, EngineArgs)
    gen.set_defaults(func=_generate)
    up = sub.add_parser("up", help="run the whole mesh on loopback with an embedded NATS",
                        description=MeshArgs.__doc__)
    add_arguments(up, MeshArgs)
    up.set_defaults(func=_up)
    bench = sub.add_parser("bench", help="benchmark a serving endpoint (or --launch the mesh)")
    bench_cli.add_arguments(bench)
    bench.set_defaults(func=bench_cli.run)
    add_trace_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `radixmesh` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, PermissionError) as exc:  # bad flags, no model
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
