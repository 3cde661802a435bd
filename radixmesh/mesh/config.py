"""One config object per service, built from CLI flags and the environment.

Every field of a service's config dataclass becomes a flag (`--nats-url`) whose default
comes from the environment (`RADIXMESH_NATS_URL`), else from the dataclass. NATS_URL is
honoured as the standard name for the NATS address."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any, TypeVar, get_type_hints

C = TypeVar("C")

ENV_PREFIX = "RADIXMESH_"
_ALIASES = {"nats_url": "NATS_URL"}


def env_name(field: str) -> str:
    """The environment variable that sets a config field."""
    return ENV_PREFIX + field.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _converter(tp: Any) -> Any:
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    if tp == (str | None):
        return lambda text: text or None
    if tp == (int | None):
        return lambda text: int(text) if text else None
    raise TypeError(f"unsupported config field type {tp!r}")


def build_config(cls: type[C], argv: Sequence[str] | None = None, prog: str | None = None) -> C:
    """Parse argv (default sys.argv[1:]) into `cls`, with environment defaults."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        convert = _converter(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        for name in (env_name(f.name), _ALIASES.get(f.name)):
            if name and name in os.environ:
                default = convert(os.environ[name])
                break
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=convert,
            default=default,
            help=f"{f.metadata.get('help', '')} (env {env_name(f.name)}; default {default!r})",
        )
    return cls(**vars(parser.parse_args(argv)))
