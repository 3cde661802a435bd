"""Output constraints (a JSON schema, a regex, an EBNF grammar or a structural tag) read and
checked without any model, by either grammar backend: what the front doors run to refuse a bad
one with a 400, and what the worker compiles against its vocabulary
(radixmesh/engine/model/grammar_mask.py); and the structural tags the chat route builds for
tool calls in auto mode and for an answer that follows the model's reasoning.

Both backends read the same texts. An EBNF grammar is written as SGLang's and xgrammar's
(GBNF: `root ::= ...`); llguidance gets it translated to its Lark dialect. A JSON schema
allows no free whitespace: the separators are json.dumps's ", " and ": " (a small model
left free to add whitespace can fill its budget with newlines); and no properties beyond
those it lists unless it says otherwise.

A structural tag (xgrammar's format, `{"type": "structural_tag", "format": {...}}`, or SGLang's
older `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`) leaves the output free
except where it says: after a trigger the text must be one of the tags to its end. Its JSON
parts allow one blank between two tokens unless they set max_whitespace_cnt themselves
(xgrammar's default is no bound). Only xgrammar runs them."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from radixmesh.core.sampling_params import GRAMMAR_KINDS

if TYPE_CHECKING:
    import xgrammar
    from jsonschema.protocols import Validator

# xgrammar's messages start with the time and the C++ file and line that raised them.
_SOURCE = re.compile(r"^\[[\d:]+\] [^:]+:\d+: (Check failed: .*? is false: )?")
# Whitespace a JSON part of a structural tag may put between two tokens: one, so a small model
# cannot fill its budget with newlines (the json_schema constraint allows none beyond its
# separators; a structural tag's JSON cannot be held to those).
_JSON_WHITESPACE = 1
# What may come between the end of a model's thinking and its answer: what chat templates
# write there (Qwen3 "\n\n", DeepSeek-V3.1 nothing). Bounded and ASCII: under `\s*` a small
# model filled its whole budget with U+205F and never started the answer.
_ANSWER_LEAD = r"[ \n]{0,2}"


def check_kind(kind: str, text: str) -> None:
    """Raise ValueError unless the kind is known and the text has its outer shape (a
    structural tag's, a JSON schema's JSON)."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown constraint {kind!r}: expected {', '.join(GRAMMAR_KINDS)}")
    if kind == "structural_tag":
        structural_tag(text)
    elif kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object, got {text!r}")


def parse(kind: str, text: str) -> xgrammar.Grammar:
    """xgrammar's grammar of a constraint; ValueError naming the problem when it has one."""
    import xgrammar  # here: it takes a second and a half to import, and few requests need it

    check_kind(kind, text)
    build = {
        "json_schema": xgrammar.Grammar.from_json_schema,
        "regex": xgrammar.Grammar.from_regex,
        "ebnf": xgrammar.Grammar.from_ebnf,
        "structural_tag": lambda t: xgrammar.Grammar.from_structural_tag(structural_tag(t)),
    }[kind]
    try:
        return build(text)
    except RuntimeError as exc:  # xgrammar's errors, InvalidStructuralTagError among them
        raise xgrammar_error(kind, exc) from None


def xgrammar_error(kind: str, error: RuntimeError) -> ValueError:
    """An error xgrammar raised parsing or compiling a constraint, as a refusal naming it."""
    reason = _SOURCE.sub("", str(error).strip().splitlines()[0])
    return ValueError(f"invalid {kind}: {reason}")


def llguidance_grammar(kind: str, text: str) -> str:
    """llguidance's grammar of a constraint, checked; ValueError naming the problem."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    check_kind(kind, text)
    if kind == "structural_tag":
        raise ValueError("structural_tag needs the xgrammar grammar backend")
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


def _check_form(kind: str, text: str, backend: str) -> None:
    check_kind(kind, text)
    if kind == "structural_tag" and backend == "llguidance":
        raise ValueError("structural_tag needs the xgrammar grammar backend")
    if kind == "json_schema":
        try:
            schema_validator(text)
        except ValueError as exc:
            raise ValueError(f"invalid json_schema: {exc}") from None


@lru_cache(maxsize=256)
def schema_validator(schema_text: str) -> Validator:
    """The validator of a JSON schema, the schema checked against its meta-schema once
    (ValueError saying why it fails): checking costs about a millisecond, and every answer
    of a request with tools builds a tool parser."""
    from jsonschema import validators  # here: few requests need it, and it weighs 8 MiB
    from jsonschema.exceptions import SchemaError

    schema = json.loads(schema_text)
    validator = validators.validator_for(schema)
    try:
        validator.check_schema(schema)
    except SchemaError as exc:
        raise ValueError(exc.message) from None
    return validator(schema)


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


def check(
    constraint: tuple[str, str] | None, backend: str = "xgrammar", compile: bool = True
) -> None:
    """Raise ValueError unless the (kind, text) constraint, if any, parses and `backend`
    (the grammar_backend setting) can run it. With `compile` false, only its form is checked
    and no grammar library is loaded (xgrammar brings torch): the kind, a structural tag's
    shape, a JSON schema's JSON against the JSON Schema meta-schema; the engine's compile
    finds the rest."""
    if constraint is None:
        return
    if backend == "none":
        raise ValueError(
            f"{constraint[0]} needs constrained decoding, which this server has off "
            "(grammar_backend none)"
        )
    if not compile:
        _check_form(*constraint, backend)
    elif backend == "llguidance":
        llguidance_grammar(*constraint)
    else:
        parse(*constraint)


# ---- structural tags -------------------------------------------------------------------------


def structural_tag(text: str) -> str:
    """A structural tag's text in xgrammar's current format (SGLang's older shape converted),
    its JSON parts' whitespace bounded; ValueError when it is neither."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise ValueError(f"structural_tag must be a JSON object, got {text!r}")
    if "format" in tag:
        return json.dumps({**tag, "format": _bounded(tag["format"])})
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not all(
        isinstance(s, dict) and {"begin", "schema", "end"} <= s.keys() for s in structures
    ):
        raise ValueError("structural_tag must have a format, or structures (each with begin, "
                         "schema and end) and triggers")
    tags = [_tag(s["begin"], _json(s["schema"]), s["end"]) for s in structures]
    return _tag_text({"type": "triggered_tags", "triggers": triggers, "tags": tags})


def tool_calls_tag(trigger: str, calls: Sequence[tuple[str, Mapping[str, Any], str]],
                   required: bool = False, single: bool = False) -> tuple[str, str]:
    """The constraint of an answer that may call tools: free text, except that once `trigger`
    is written the text must be one of `calls` (begin, the arguments' JSON schema, end) to its
    end. `required`: at least one call; `single`: nothing follows the first call."""
    tags = [_tag(begin, _json(schema), end) for begin, schema, end in calls]
    form = {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
            "at_least_one": required, "stop_after_first": single}
    return "structural_tag", _tag_text(form)


def after_reasoning(constraint: tuple[str, str] | None, start: str, end: str,
                    budget: int | None = None) -> tuple[str, str] | None:
    """`constraint` moved past a reasoning model's thinking: free text between `start` and
    `end` and the few blanks a chat template writes after it, then the constrained answer (or
    free text). Where the model opens the block itself (`start` given) it may answer without
    one, as a model that decides not to think does; where the prompt opened it (`start` "")
    the thinking is there to be closed. `budget`: the most tokens the thinking may take, after
    which only `end` may follow. None where there is neither a constraint nor a budget."""
    if constraint is None and budget is None:
        return None
    # Free text, when there is no constraint, may not open the block again: it would be
    # thinking that no budget bounds.
    answer = _format(*constraint) if constraint is not None else {
        "type": "any_text", "excludes": [start] if start else []}
    thinking_text: dict[str, Any] = {"type": "any_text"}
    if budget is not None:
        thinking_text["max_tokens"] = budget
    # The blanks go with the block, as the reasoning parser reads them: an answer without
    # one starts at once, so the content is the constrained answer exactly.
    thinking = {"type": "sequence", "elements": [
        _tag(start, thinking_text, end), {"type": "regex", "pattern": _ANSWER_LEAD}]}
    if start:
        thinking = {"type": "optional", "content": thinking}
    return "structural_tag", _tag_text({"type": "sequence", "elements": [thinking, answer]})


def _format(kind: str, text: str) -> dict[str, Any]:
    """A constraint as a part of a structural tag."""
    if kind == "json_schema":
        return _json(json.loads(text))
    if kind == "regex":
        return {"type": "regex", "pattern": text}
    if kind == "ebnf":
        return {"type": "grammar", "grammar": text}
    return json.loads(structural_tag(text))["format"]


def _bounded(form: Any) -> Any:
    """A structural tag's format with each JSON part that does not bound its whitespace held
    to _JSON_WHITESPACE (JSON schemas inside are left as they are)."""
    if isinstance(form, list):
        return [_bounded(item) for item in form]
    if not isinstance(form, dict):
        return form
    if form.get("type") == "json_schema":
        return {"max_whitespace_cnt": _JSON_WHITESPACE, **form}
    return {key: value if key == "json_schema" else _bounded(value)
            for key, value in form.items()}


def _tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _json(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": _JSON_WHITESPACE}


def _tag_text(form: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": form})
