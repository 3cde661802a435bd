"""Output constraints (a JSON schema, a regex or an EBNF grammar) read and checked without
any model, by either grammar backend: what the front doors run to refuse a bad one with a
400, and what the worker compiles against its vocabulary (radixmesh/engine/model/grammar_mask.py).

Both backends read the same texts. An EBNF grammar is written as SGLang's and xgrammar's
(GBNF: `root ::= ...`); llguidance gets it translated to its Lark dialect. A JSON schema
allows no free whitespace: the separators are json.dumps's ", " and ": " (a small model
left free to add whitespace can fill its budget with newlines); and no properties beyond
those it lists unless it says otherwise."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from radixmesh.core.sampling_params import GRAMMAR_KINDS

if TYPE_CHECKING:
    import xgrammar

# xgrammar's messages start with the time and the C++ file and line that raised them.
_SOURCE = re.compile(r"^\[[\d:]+\] [^:]+:\d+: (Check failed: .*? is false: )?")


def _check_kind(kind: str, text: str) -> None:
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown constraint {kind!r}: expected json_schema, regex or ebnf")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object, got {text!r}")


def parse(kind: str, text: str) -> xgrammar.Grammar:
    """xgrammar's grammar of a constraint; ValueError naming the problem when it has one."""
    import xgrammar  # here: it takes a second and a half to import, and few requests need it

    _check_kind(kind, text)
    build = {
        "json_schema": xgrammar.Grammar.from_json_schema,
        "regex": xgrammar.Grammar.from_regex,
        "ebnf": xgrammar.Grammar.from_ebnf,
    }[kind]
    try:
        return build(text)
    except RuntimeError as exc:
        reason = _SOURCE.sub("", str(exc).strip().splitlines()[0])
        raise ValueError(f"invalid {kind}: {reason}") from None


def llguidance_grammar(kind: str, text: str) -> str:
    """llguidance's grammar of a constraint, checked; ValueError naming the problem."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    _check_kind(kind, text)
    try:
        if kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(_closed(json.loads(text)), defaults={
                "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
            })
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(text)
        else:
            grammar = LLMatcher.grammar_from_lark(gbnf_to_lark(text))
    except Exception as exc:  # the GBNF translation raises plain Exceptions
        raise ValueError(f"invalid {kind}: {exc}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {kind}: {error.strip().splitlines()[0]}")
    return grammar


def _closed(schema: Any) -> Any:
    """The schema with no properties beyond those listed wherever it does not say (what
    xgrammar does by default), so both backends give the same language."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in schema or schema.get("type") == "object":
        closed.setdefault("additionalProperties", False)
    return closed


def import_backend(backend: str) -> None:
    """Import the backend's package now (it takes a second or more), e.g. at start-up."""
    if backend == "llguidance":
        import llguidance  # noqa: F401
    else:
        import xgrammar  # noqa: F401


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
    if backend == "llguidance":
        llguidance_grammar(*constraint)
    else:
        parse(*constraint)
