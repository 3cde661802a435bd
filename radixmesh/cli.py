"""The `radixmesh` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import fields

from radixmesh.bench import cli as bench_cli
from radixmesh.engine_args import EngineArgs
from radixmesh.launcher import MeshArgs, serve
from radixmesh.tracing.cli import add_trace_command


def _flags(parser: argparse.ArgumentParser, config: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of a config dataclass, typed after its annotation."""
    for f in fields(config):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = int if "int" in str(f.type) else str
            parser.add_argument(flag, type=kind, default=f.default)


def _generate(args: argparse.Namespace) -> int:
    from radixmesh.engine import Engine  # torch loads only for this command

    engine_kwargs = {f.name: getattr(args, f.name) for f in fields(EngineArgs)}
    sampling = json.loads(args.sampling_params)
    sampling.setdefault("max_new_tokens", args.max_new_tokens)
    with Engine(**engine_kwargs) as engine:
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
    values = {f.name: getattr(args, f.name) for f in fields(MeshArgs) if f.name != "extra_env"}
    values["nats_url"] = values["nats_url"] or os.environ.get("NATS_URL")
    return serve(MeshArgs(**values))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `radixmesh` console script."""
    parser = argparse.ArgumentParser(prog="radixmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt with the in-process engine")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--sampling-params", default="{}", help="JSON object of sampling params")
    _flags(gen, EngineArgs)
    gen.set_defaults(func=_generate)
    up = sub.add_parser("up", help="run the whole mesh on loopback with an embedded NATS")
    _flags(up, MeshArgs, skip=("extra_env",))
    up.set_defaults(func=_up)
    bench = sub.add_parser("bench", help="benchmark a serving endpoint (or --launch the mesh)")
    bench_cli.add_arguments(bench)
    bench.set_defaults(func=bench_cli.run)
    add_trace_command(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
