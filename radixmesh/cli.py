"""The `radixmesh` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields

from radixmesh.engine import Engine
from radixmesh.engine_args import EngineArgs


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = int if "int" in str(f.type) else str
            parser.add_argument(flag, type=kind, default=f.default)


def _generate(args: argparse.Namespace) -> int:
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `radixmesh` console script."""
    parser = argparse.ArgumentParser(prog="radixmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt with the in-process engine")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--sampling-params", default="{}", help="JSON object of sampling params")
    _engine_flags(gen)
    gen.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
