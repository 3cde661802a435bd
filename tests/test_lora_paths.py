"""lora_paths in every form SGLang takes it (PATH, NAME=PATH, JSON objects, several on the
command line, a list or a dict as a keyword or a variable) and radixmesh's comma form: what
each gives, and what is refused by name before any model loads."""

from __future__ import annotations

import json

import pytest

from radixmesh import cli
from radixmesh.core.flags import from_args, parse_config, to_flags
from radixmesh.core.lora_paths import LoraRef, parse_lora_paths
from radixmesh.core.service_settings import WorkerConfig
from radixmesh.core.settings import EngineArgs, LoraSettings
from radixmesh.launcher import MeshArgs

SQL, BOT = LoraRef("sql", "/a"), LoraRef("bot", "/b")
PINNED = '{"lora_name": "sql", "lora_path": "/a", "pinned": true}'


@pytest.fixture(autouse=True)
def _no_lora_paths_in_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("RADIXMESH_LORA_PATHS", raising=False)


@pytest.mark.parametrize(("items", "refs"), [
    ("sql=/a,bot=/b", [SQL, BOT]),  # the comma form
    ("sql=/a, bot=/b,", [SQL, BOT]),
    (["sql=/a", "bot=/b"], [SQL, BOT]),
    (["/x/sql-writer"], [LoraRef("/x/sql-writer", "/x/sql-writer")]),  # named by its path
    ("org/repo", [LoraRef("org/repo", "org/repo")]),
    ([PINNED, "bot=/b"], [LoraRef("sql", "/a", True), BOT]),
    (['{"lora_name": "sql", "lora_path": "/a"}'], [SQL]),
    (['{"sql": "/a", "bot": "/b"}'], [SQL, BOT]),
    ((), []),
    (None, []),
])
def test_every_form_names_its_adapters(items, refs) -> None:
    assert parse_lora_paths(items) == refs


@pytest.mark.parametrize(("items", "refusal"), [
    ("a=/x,a=/y", "adapter 'a' is named twice"),
    (["a=/x", '{"a": "/y"}'], "adapter 'a' is named twice"),
    ("a=", r"expected PATH or NAME=PATH, got 'a='"),
    ("=/x", r"expected PATH or NAME=PATH, got '=/x'"),
    ('{"lora_name": "a"}', "lora_path must be a non-empty string"),
    ('{"lora_name": "a", "lora_path": "/x", "pinned": "yes"}', "pinned must be true or false"),
    ('{"lora_name": "a", "lora_path": "/x", "rank": 8}', r"unknown key\(s\) rank"),
    ('{"a": 3}', r"expected \{NAME: PATH, ...\}"),
    ("{not json}", "is not a JSON object"),
])
def test_what_is_no_form_is_refused_naming_lora_paths(items, refusal) -> None:
    with pytest.raises(ValueError, match=f"lora_paths: .*{refusal}"):
        parse_lora_paths(items)


def _up(*argv: str) -> MeshArgs:
    parser = cli.build_parser()
    return from_args(MeshArgs, parser.parse_args(["up", *argv]))


def test_the_command_line_takes_several_adapters_after_one_flag() -> None:
    args = _up("--enable-lora", "--lora-paths", "sql=/a", "bot=/b", "--port", "1")
    assert args.lora_paths == ("sql=/a", "bot=/b") and args.port == 1
    assert parse_lora_paths(args.lora_paths) == [SQL, BOT]
    assert _up("--lora-paths", "sql=/a,bot=/b").lora_paths == ("sql=/a,bot=/b",)
    assert _up("--lora-paths", "/x/sql-writer").lora_paths == ("/x/sql-writer",)
    assert _up("--lora-paths", PINNED, "bot=/b").lora_paths == (PINNED, "bot=/b")
    assert _up("--lora-paths", "sql=/a", "--lora-paths", "bot=/b").lora_paths == (
        "sql=/a", "bot=/b")  # given again, it adds
    assert _up().lora_paths == ()


def test_a_bad_adapter_on_the_command_line_exits_2_naming_it(capsys) -> None:
    assert cli.main(["up", "--lora-paths", '{"lora_name": "a"}']) == 2
    assert "lora_paths: lora_path must be a non-empty string" in capsys.readouterr().err


def test_the_flag_replaces_what_the_environment_gave(monkeypatch) -> None:
    monkeypatch.setenv("RADIXMESH_LORA_PATHS", "old=/o")
    assert _up().lora_paths == ("old=/o",)
    assert _up("--lora-paths", "sql=/a").lora_paths == ("sql=/a",)
    assert _up("--lora-paths").lora_paths == ()


@pytest.mark.parametrize(("value", "items"), [
    ("sql=/a,bot=/b", ("sql=/a,bot=/b",)),
    (PINNED, (PINNED,)),
    ('{"sql": "/a"}', ('{"sql": "/a"}',)),
    (json.dumps(["sql=/a", {"lora_name": "bot", "lora_path": "/b"}]),
     ("sql=/a", '{"lora_name": "bot", "lora_path": "/b"}')),
    ("", ()),
])
def test_the_variable_takes_one_form_or_a_json_array(monkeypatch, value, items) -> None:
    monkeypatch.setenv("RADIXMESH_LORA_PATHS", value)
    assert parse_config(WorkerConfig, []).lora_paths == items


def test_a_bad_variable_names_it(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RADIXMESH_LORA_PATHS", "[1, 2")
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, [])
    assert "RADIXMESH_LORA_PATHS='[1, 2': not a JSON array" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "refs"), [
    ("sql=/a,bot=/b", [SQL, BOT]),
    (["sql=/a", "bot=/b"], [SQL, BOT]),
    (("sql=/a", "bot=/b"), [SQL, BOT]),
    ({"sql": "/a", "bot": "/b"}, [SQL, BOT]),
    ([{"lora_name": "sql", "lora_path": "/a", "pinned": True}, "bot=/b"],
     [LoraRef("sql", "/a", True), BOT]),
    (None, []),
])
def test_engine_keywords_take_a_list_or_a_dict(value, refs) -> None:
    assert parse_lora_paths(EngineArgs(lora_paths=value).lora_paths) == refs


@pytest.mark.parametrize(("values", "refusal"), [
    ({"lora_paths": [3]}, "lora_paths: expected strings"),
    ({"lora_paths": {"sql": 3}}, r"lora_paths: expected \{NAME: PATH"),
    ({"lora_paths": [PINNED], "max_loras_per_batch": 1},
     r"lora_paths pins 1 adapter\(s\): at most max_loras_per_batch - 1 \(0\)"),
])
def test_bad_engine_keywords_are_refused_naming_lora_paths(values, refusal) -> None:
    with pytest.raises(ValueError, match=refusal):
        LoraSettings(**values)


def test_a_child_process_gets_every_adapter_back() -> None:
    paths = (PINNED, "bot=/b", "/x/c")
    argv = to_flags(WorkerConfig, {"lora_paths": paths, "enable_lora": True})
    assert parse_config(WorkerConfig, argv).lora_paths == paths
    assert parse_config(WorkerConfig, to_flags(WorkerConfig, {"lora_paths": ()})).lora_paths == ()
