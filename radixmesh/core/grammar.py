"""Output constraints (a JSON schema, a regex or an EBNF grammar) read and checked with
xgrammar, without any model: what the front doors run to refuse a bad one with a 400, and
what the worker compiles against its vocabulary (services/worker/grammar.py)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

# xgrammar's messages start with the time and the C++ file and line that raised them.
_SOURCE = re.compile(r"^\[[\d:]+\] [^:]+:\d+: (Check failed: .*? is false: )?")


def parse(kind: str, text: str) -> xgrammar.Grammar:
    """The grammar of a constraint; ValueError naming the problem when it has one."""
    import xgrammar  # here: it takes a second and a half to import, and few requests need it

    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object, got {text!r}")
        build = xgrammar.Grammar.from_json_schema
    elif kind == "regex":
        build = xgrammar.Grammar.from_regex
    elif kind == "ebnf":
        build = xgrammar.Grammar.from_ebnf
    else:
        raise ValueError(f"unknown constraint {kind!r}: expected json_schema, regex or ebnf")
    try:
        return build(text)
    except RuntimeError as exc:
        reason = _SOURCE.sub("", str(exc).strip().splitlines()[0])
        raise ValueError(f"invalid {kind}: {reason}") from None


def check(constraint: tuple[str, str] | None, backend: str = "xgrammar") -> None:
    """Raise ValueError unless the (kind, text) constraint, if any, parses and `backend`
    (the grammar_backend setting) can run it."""
    if constraint is None:
        return
    if backend == "none":
        raise ValueError(
            f"{constraint[0]} needs constrained decoding, which this server has off "
            "(grammar_backend none)"
        )
    parse(*constraint)
