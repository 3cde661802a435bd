"""Constrained decoding in process on the real model (float32): regex, JSON schema and EBNF
outputs hold their constraint, constrained and free requests share batches without
changing each other, overlap scheduling does not change a constrained answer, and a bad
constraint is refused without disturbing the engine."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixmesh.api import Engine

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,3}
"""
# Long fixed keys, short values: jump-forward appends most of its text.
FORM = {
    "type": "object",
    "properties": {
        "customer_account_is_currently_active": {"type": "boolean"},
        "number_of_open_support_tickets": {"type": "integer", "minimum": 0, "maximum": 9},
        "customer_subscription_tier_at_renewal": {"enum": ["basic", "plus", "premium"]},
    },
    "required": ["customer_account_is_currently_active", "number_of_open_support_tickets",
                 "customer_subscription_tier_at_renewal"],
}
# A Python regex for the same language, without the parentheses' nesting limit.
ARITHMETIC_FLAT = re.compile(r"[-+*/()0-9]+")
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "shade": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["color", "shade"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                     "minItems": 1, "maxItems": 3},
        },
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                               "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"],
            },
        },
        "required": ["city", "location"],
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
            "mode": {"enum": ["fast", "slow"]},
        },
        "required": ["ok", "count", "mode"],
    },
]
GREEDY = {"temperature": 0, "max_new_tokens": 48}


def arithmetic(text: str) -> bool:
    """Whether text is an expression of ARITHMETIC (a small recursive-descent parser)."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while pos < len(text) and text[pos] in "*/":
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        match = re.compile(r"[1-9][0-9]{0,3}").match(text, pos)
        if match is None:
            return False
        pos = match.end()
        return True

    return expr() and pos == len(text)


@pytest.fixture(scope="module")
def engine():
    with Engine(dtype="float32", show_progress=False, max_total_tokens=8192) as e:
        yield e


def test_a_regex_output_fully_matches(engine):
    out = engine.generate("Call the pizza place at", {**GREEDY, "regex": PHONE})
    assert re.fullmatch(PHONE, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_sampled_json_validates_against_its_schema(engine, schema):
    params = {"temperature": 0.8, "max_new_tokens": 96, "json_schema": json.dumps(schema)}
    outs = engine.generate(["Answer in JSON."] * 20, [{**params, "seed": s} for s in range(20)])
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


def test_an_ebnf_output_parses(engine):
    out = engine.generate("Write a sum:", {**GREEDY, "ebnf": ARITHMETIC})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert ARITHMETIC_FLAT.fullmatch(out["text"]) and arithmetic(out["text"]), out["text"]


def test_a_constrained_answer_cut_short_ends_as_length(engine):
    schema = {"type": "object", "properties": {"story": {"type": "string"}},
              "required": ["story"]}
    params = {"temperature": 0, "max_new_tokens": 6, "json_schema": json.dumps(schema)}
    out = engine.generate("Tell a story in JSON.", params)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    with pytest.raises(json.JSONDecodeError):
        json.loads(out["text"])


def test_the_grammar_decides_the_end_over_min_new_tokens_and_ignore_eos(engine):
    sampled = {"temperature": 0.8, "max_new_tokens": 24, "regex": PHONE}
    outs = engine.generate(["My phone is"] * 2, [
        {**sampled, "seed": 1, "min_new_tokens": 20},
        {**sampled, "seed": 2, "ignore_eos": True},
    ])
    for out in outs:
        assert re.fullmatch(PHONE, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_a_constraint_nothing_satisfies_ends_its_request_not_the_engine(engine):
    for temperature in (0, 0.8):
        out = engine.generate("x", {"temperature": temperature, "max_new_tokens": 8,
                                    "regex": "[^\\x00-\\U0010FFFF]"})
        assert out["text"] == ""
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(PHONE, engine.generate("Call the pizza place at",
                                               {**GREEDY, "regex": PHONE})["text"])


def test_constrained_and_free_requests_share_a_batch_unchanged(engine):
    prompts = ["The capital of France is", "Call the pizza place at", "List three colors:"]
    alone = engine.generate(prompts[0], GREEDY)["text"]
    constrained = {**GREEDY, "regex": PHONE}
    outs = engine.generate(prompts, [GREEDY, constrained, {**GREEDY, "json_schema":
                                                          json.dumps(SCHEMAS[2])}])
    assert outs[0]["text"] == alone
    assert re.fullmatch(PHONE, outs[1]["text"])
    jsonschema.validate(json.loads(outs[2]["text"]), SCHEMAS[2])
    assert outs[1]["text"] == engine.generate(prompts[1], constrained)["text"]


def test_overlap_scheduling_does_not_change_a_constrained_answer(engine):
    params = [{**GREEDY, "json_schema": json.dumps(s)} for s in [*SCHEMAS, FORM]]
    prompts = [f"Answer {i} in JSON." for i in range(len(params))]
    overlapped = [o["text"] for o in engine.generate(prompts, params)]
    with Engine(dtype="float32", show_progress=False, max_total_tokens=8192,
                disable_overlap_schedule=True) as plain:
        assert [o["text"] for o in plain.generate(prompts, params)] == overlapped


RECORDS = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"], "additionalProperties": False}}
COPY_RECORDS = ('Copy this JSON: [{"name": "Ann", "city": "Oslo"}, {"name": "Bob", "city": '
                '"Rome"}, {"name": "Cy", "city": "Lima"}]')


def test_speculation_does_not_change_a_constrained_answer(engine):
    """Drafts the grammar refuses are not computed, accepted ones advance it, and
    jump-forward still appends what it forces: the answers are those without drafts."""
    params = [{**GREEDY, "json_schema": json.dumps(s)} for s in [*SCHEMAS, FORM]]
    params.append({**GREEDY, "max_new_tokens": 96, "json_schema": json.dumps(RECORDS)})
    params.append({**GREEDY, "regex": PHONE})
    prompts = [*(f"Answer {i} in JSON." for i in range(len(params) - 2)), COPY_RECORDS,
               "Call the pizza place at"]
    plain = [o["text"] for o in engine.generate(prompts, params)]
    with Engine(dtype="float32", show_progress=False, max_total_tokens=8192,
                speculative_algorithm="NGRAM") as drafting:
        assert [o["text"] for o in drafting.generate(prompts, params)] == plain
        copied = drafting.generate(COPY_RECORDS, params[-2])
        info = drafting.server_info()
    assert copied["meta_info"]["spec_accepted_tokens"] > 0
    assert info["forced_tokens"] > 0 and info["held_slots"] == 0
    assert copied["meta_info"]["finish_reason"]["type"] == "stop", copied
    jsonschema.validate(json.loads(copied["text"]), RECORDS)


def test_grammar_backend_none_refuses_constraints():
    from radixmesh.core import grammar

    with pytest.raises(ValueError, match=r"regex needs constrained decoding, which this "
                       r"server has off \(grammar_backend none\)"):
        grammar.check(("regex", "[0-9]+"), "none")
    grammar.check(None, "none")


@pytest.mark.parametrize(("params", "message"), [
    ({"json_schema": "{oops"}, "json_schema is not valid JSON"),
    ({"json_schema": '{"type": "nope"}'}, "invalid json_schema"),
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"ebnf": "root ::= missing_rule"}, "invalid ebnf"),
    ({"regex": "a", "json_schema": "{}"}, "at most one"),
    ({"regex": ""}, "regex must be a non-empty string"),
])
def test_a_bad_constraint_is_refused_and_the_engine_goes_on(engine, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate("x", {"max_new_tokens": 2, **params})
    assert engine.generate("Call the pizza place at", {**GREEDY, "regex": PHONE})["text"]


@pytest.mark.parametrize("backend", ["engine", "llg_engine"])
def test_jump_forward_tokens_are_the_tokenizers_own_at_the_seam(backend, request):
    """The tokens forced after a sampled one are those the tokenizer gives the two texts
    together, less the last (left for the model to merge onward, as ` true`); where the
    tokenizer would merge the sampled token with the forced text, nothing is forced."""
    engine = request.getfixturevalue(backend)
    grammars, raw = engine.runner.grammars, engine.tokenizer.raw
    key = '"customer_account_is_currently_active": '
    [brace] = raw.encode("{", add_special_tokens=False).ids
    [brace_quote] = raw.encode('{"', add_special_tokens=False).ids
    # `{` then `"customer...` tokenizes as `{"`, `customer`...: not this token's seam.
    matcher = grammars.matcher(("json_schema", json.dumps(FORM)))
    assert matcher.accept(brace)
    assert matcher.forced_text() == key
    assert grammars.forced_tokens(matcher, brace) == []
    assert matcher.forced_text() == key  # the matcher took nothing
    # After `{"` the rest of the key is forced, as `{"customer_account...": ` tokenizes.
    matcher = grammars.matcher(("json_schema", json.dumps(FORM)))
    assert matcher.accept(brace_quote)
    forced = grammars.forced_tokens(matcher, brace_quote)
    whole = raw.encode("{" + key, add_special_tokens=False).ids
    assert whole[0] == brace_quote and forced == whole[1:-1] and len(forced) == 10
    assert raw.decode(forced) == key[1:-1]
    assert matcher.forced_text() == " "  # the matcher took them


def test_jump_forward_takes_fewer_steps_for_a_valid_answer(engine):
    params = [{"temperature": t, "max_new_tokens": 96, "json_schema": json.dumps(FORM),
               "seed": i} for i, t in enumerate((0, 0.8, 0.8, 0.8))]
    prompts = ["Fill in the customer record as JSON."] * len(params)
    with Engine(dtype="float32", show_progress=False, max_total_tokens=8192,
                disable_jump_forward=True) as stepping:
        before = stepping.server_info()
        plain = stepping.generate(prompts[:1], params[:1])[0]
        plain_steps = stepping.server_info()["steps"] - before["steps"]
        assert stepping.server_info()["forced_tokens"] == 0
    before = engine.server_info()
    jumped = engine.generate(prompts[:1], params[:1])[0]
    info = engine.server_info()
    forced = info["forced_tokens"] - before["forced_tokens"]
    # The keys' tokens are appended, not decoded: at least 25 of them.
    assert forced >= 25
    assert info["steps"] - before["steps"] <= plain_steps - forced // 2
    for out in [plain, jumped, *engine.generate(prompts[1:], params[1:])]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), FORM)
    assert info["held_slots"] == 0


# ---- the llguidance backend -----------------------------------------------------------------


@pytest.fixture(scope="module")
def llg_engine():
    with Engine(dtype="float32", show_progress=False, max_total_tokens=8192,
                grammar_backend="llguidance") as e:
        yield e


def test_llguidance_regex_schemas_and_ebnf_hold(llg_engine):
    out = llg_engine.generate("Call the pizza place at", {**GREEDY, "regex": PHONE})
    assert re.fullmatch(PHONE, out["text"]), out["text"]
    out = llg_engine.generate("Write a sum:", {**GREEDY, "ebnf": ARITHMETIC})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert ARITHMETIC_FLAT.fullmatch(out["text"]) and arithmetic(out["text"]), out["text"]
    for schema in [SCHEMAS[1], SCHEMAS[3], FORM]:
        params = {"temperature": 0.8, "max_new_tokens": 96, "json_schema": json.dumps(schema)}
        outs = llg_engine.generate(["Answer in JSON."] * 8,
                                   [{**params, "seed": s} for s in range(8)])
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            value = json.loads(out["text"])
            jsonschema.validate(value, schema)
            assert not re.search(r"\s\s|\n", out["text"])  # no free whitespace
    assert llg_engine.server_info()["forced_tokens"] > 0
    assert llg_engine.server_info()["held_slots"] == 0


@pytest.mark.parametrize(("params", "message"), [
    ({"json_schema": "{oops"}, "json_schema is not valid JSON"),
    ({"json_schema": '{"type": "nope"}'}, "invalid json_schema"),
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"ebnf": "root ::= missing_rule"}, "invalid ebnf"),
])
def test_llguidance_refuses_a_bad_constraint(llg_engine, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llg_engine.generate("x", {"max_new_tokens": 2, **params})
    assert re.fullmatch(PHONE, llg_engine.generate("Call the pizza place at",
                                                   {**GREEDY, "regex": PHONE})["text"])
