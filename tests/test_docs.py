"""README.md and docs/*.md stay true to the tree: the files, pages and anchors they name
exist, the commands they show name real subcommands and flags (read from the real argparse
parsers), every flag they name belongs to a parser, the README stays a front page that
links every page, and its two commands are the ones CI runs."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
from test_sglang_names import FLAGS_NOT_TAKEN

from radixmesh.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARKS = ROOT / "benchmarks"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 260

# Flags of other programs that the pages name outside a command of that program.
FOREIGN_FLAGS = {
    "--no-deps",  # pip
    "--build-arg",  # docker build
    "--profile",  # docker compose
    "--no-repack", "--spec-type", "--embedding", "--pooling",  # llama-server
    # SGLang's flags that radixmesh does not take (docs/sglang_names.md lists them)
    *(flag for flags in FLAGS_NOT_TAKEN.values() for flag in flags),
}
# A command of another program: its flags are that program's business.
FOREIGN_PROGRAMS = {"curl", "docker", "grpcurl", "llama-server", "nats-server", "pip"}
# A file the pages may name without its folder: a source file of the tree.
SOURCE_NAME = re.compile(r"[\w.-]+\.(?:py|proto|cpp|h|sh|toml|yaml|md)")
FLAG = re.compile(r"--[A-Za-z][\w-]*")
ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=")
VARIABLE = re.compile(r"RADIXMESH_[A-Z0-9_]*[A-Z0-9]")


# ---- reading a page ----------------------------------------------------------------------


class Page(NamedTuple):
    path: Path
    prose: str  # the text outside fenced code blocks
    blocks: list[tuple[str, str]]  # (language, body) of each fenced code block


def read_page(path: Path) -> Page:
    prose: list[str] = []
    blocks: list[tuple[str, str]] = []
    fence: str | None = None
    body: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if fence is None:
                fence, body = line[3:].strip(), []
            else:
                blocks.append((fence, "\n".join(body)))
                fence = None
            continue
        (body if fence is not None else prose).append(line)
    assert fence is None, f"{path.name}: a code block is never closed"
    return Page(path, "\n".join(prose), blocks)


def code_spans(page: Page) -> list[str]:
    """Every inline code span of the prose, its line breaks made spaces."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", page.prose)]


def links(page: Page) -> list[str]:
    """Every markdown link's (and image's) target in the prose."""
    return re.findall(r"\]\(([^)\s]+)\)", page.prose)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading's get -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)", read_page(path).prose, re.M):
        seen[slug(heading)] = seen.get(slug(heading), 0) + 1
    return {base if i == 0 else f"{base}-{i}" for base, n in seen.items() for i in range(n)}


def shell_commands(script: str) -> Iterator[list[str]]:
    """The simple commands of a bash block: continuations joined, comments dropped, split at
    line ends (outside quotes) and ; & | && ||, leading variable assignments and `do` taken
    off."""
    script = re.sub(r"(^|\s)#.*", "", script.replace("\\\n", " "), flags=re.M)
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|\n")
    lexer.whitespace, lexer.whitespace_split, lexer.commenters = " \t", True, ""
    command: list[str] = []
    for token in [*lexer, ";"]:
        if set(token) <= set(";&|\n"):
            while command and (ENV_ASSIGNMENT.match(command[0]) or command[0] == "do"):
                command.pop(0)
            if command:
                yield command
            command = []
        else:
            command.append(token)


def span_command(span: str) -> list[str] | None:
    """A span that shows a command of radixmesh's (`radixmesh up ...`, `python -m radixmesh.X`,
    `python benchmarks/x.py ...`, `bench_x.py ...`), as words; None for any other span."""
    words = span.split()
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    if len(words) >= 2 and words[0] == "radixmesh":
        return words
    if words and words[0] in ("python", "python3"):
        return words
    if words and words[0].endswith(".py") and (BENCHMARKS / Path(words[0]).name).is_file():
        return ["python", f"benchmarks/{Path(words[0]).name}", *words[1:]]
    return None


# ---- the parsers -------------------------------------------------------------------------


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _captured(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
    raise _Parsed(self)


def parser_of(main: Callable[[], object]) -> argparse.ArgumentParser:
    """The parser `main()` builds: it is stopped where it parses its arguments (what it
    sets in the environment before that, as the worker's OpenMP spin count, is undone)."""
    with (mock.patch.object(argparse.ArgumentParser, "parse_args", _captured),
          mock.patch.object(argparse.ArgumentParser, "parse_known_args", _captured),
          mock.patch.dict(os.environ)):
        try:
            main()
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{main.__module__}.main() parsed no arguments")


@cache
def script_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `benchmarks/<name>` (its folder on sys.path, as when it runs)."""
    with mock.patch.object(sys, "path", [str(BENCHMARKS), *sys.path]):
        module = importlib.import_module(Path(name).stem)
    return parser_of(module.main)


@cache
def module_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `python -m <name>`."""
    spec = importlib.util.find_spec(name)
    assert spec is not None, f"no module {name}"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        name = f"{name}.__main__"
    return parser_of(importlib.import_module(name).main)


def unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The words of `argv` that name no subcommand or flag of `parser`; a parser with
    subcommands takes its first word that is not a flag as the subcommand."""
    wrong = []
    for word in argv:
        word = word.strip("[]")
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if word.startswith("--"):
            if word.split("=", 1)[0] not in parser._option_string_actions:
                wrong.append(word.split("=", 1)[0])
        elif subcommands and not word.startswith("-"):
            if word not in subcommands[0].choices:
                return [*wrong, f"subcommand {word!r}"]
            parser = subcommands[0].choices[word]
    return wrong


def command_problems(argv: list[str]) -> list[str]:
    """What is wrong with a command of radixmesh's: an unknown script, module, subcommand
    or flag. Other programs' commands are not looked at."""
    if argv[0] == "radixmesh":
        return unknown_flags(build_parser(), argv[1:])
    if argv[0] not in ("python", "python3") or len(argv) < 2:
        return []
    if argv[1] == "-m":
        if not argv[2].startswith("radixmesh") or "<" in argv[2]:
            return []  # another program's module, or a placeholder for any service
        if importlib.util.find_spec(argv[2]) is None:
            return [f"module {argv[2]}"]
        return unknown_flags(module_parser(argv[2]), argv[3:])
    if argv[1].startswith("benchmarks/"):
        if not (ROOT / argv[1]).is_file():
            return [f"script {argv[1]}"]
        return unknown_flags(script_parser(Path(argv[1]).name), argv[2:])
    return []


@cache
def all_parsers() -> tuple[argparse.ArgumentParser, ...]:
    """The parsers of every radixmesh command (subcommands included), service and benchmark
    script."""
    parsers = [build_parser()]
    parsers += [module_parser(f"radixmesh.services.{p.parent.name}")
                for p in (ROOT / "services").glob("*/__main__.py")]
    parsers.append(module_parser("radixmesh.bench.random_model"))
    parsers += [script_parser(p.name) for p in BENCHMARKS.glob("*.py")
                if re.search(r"^def main\(", p.read_text(), re.M)]
    found = []
    while parsers:
        parser = parsers.pop()
        found.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return tuple(found)


@cache
def known_flags() -> frozenset[str]:
    return frozenset(f for parser in all_parsers() for f in parser._option_string_actions)


@cache
def known_variables() -> frozenset[str]:
    """The RADIXMESH_* variables the settings read (their help lines name them) and those
    compose.yaml passes."""
    texts = [a.help or "" for parser in all_parsers() for a in parser._actions]
    texts.append((ROOT / "compose.yaml").read_text())
    return frozenset(VARIABLE.findall("\n".join(texts)))


# ---- files and links ---------------------------------------------------------------------


@cache
def file_names() -> frozenset[str]:
    """The names of the tree's files (outside hidden and generated folders)."""
    names = set()
    for _, folders, files in os.walk(ROOT):
        folders[:] = [f for f in folders if f == ".ci" or not f.startswith(".")
                      and f not in ("__pycache__", "build", "dist") and not f.endswith(".egg-info")]
        names.update(files)
    return frozenset(names)


def missing_path(word: str) -> str | None:
    """`word` when it names a file or folder of the tree that is not there; a path's
    `<placeholder>` matches any name, a bare source file's name any folder."""
    word = word.strip("()[],;:'\"")
    if "://" in word or word.startswith(("/", "~", "$", "./", "../")):
        return None
    if "/" in word:
        if not (ROOT / word.split("/")[0]).exists():
            return None  # not a path of the tree (a checkpoint's file, a repo id)
        pattern = re.sub(r"<[^>]+>", "*", word.rstrip("/"))
        return None if any(ROOT.glob(pattern)) else word
    if SOURCE_NAME.fullmatch(word) and word not in file_names():
        return word
    return None


def test_named_files_exist():
    missing = []
    for page in map(read_page, PAGES):
        words = [w for span in code_spans(page) for w in span.split()]
        words += [w for _, body in page.blocks for w in body.split()]
        missing += [f"{page.path.name}: {w}" for w in words if missing_path(w)]
    assert missing == []


def test_links_reach_files_and_headings():
    broken = []
    for page in map(read_page, PAGES):
        for target in links(page):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            linked = (page.path.parent / path).resolve() if path else page.path
            if not linked.exists():
                broken.append(f"{page.path.name}: {target}")
            elif anchor and anchor not in anchors(linked):
                broken.append(f"{page.path.name}: {target} (no such heading)")
    assert broken == []


def test_commands_in_code_blocks_name_real_scripts_subcommands_and_flags():
    wrong = []
    for page in map(read_page, PAGES):
        commands = [c for lang, body in page.blocks if lang == "bash"
                    for c in shell_commands(body)]
        commands += [c for c in map(span_command, code_spans(page)) if c]
        wrong += [f"{page.path.name}: {' '.join(c)}: {p}"
                  for c in commands for p in command_problems(c)]
    assert wrong == []


def test_flags_and_variables_named_belong_to_a_parser():
    known = known_flags() | FOREIGN_FLAGS
    unknown = []
    for page in map(read_page, PAGES):
        for span in code_spans(page):
            if span_command(span) or span.split()[0] in FOREIGN_PROGRAMS:
                continue
            unknown += [f"{page.path.name}: {f}" for f in FLAG.findall(span) if f not in known]
        text = "\n".join([*code_spans(page), *(body for _, body in page.blocks)])
        unknown += [f"{page.path.name}: {v}" for v in VARIABLE.findall(text)
                    if v not in known_variables()]
    assert unknown == []


# ---- the front page ----------------------------------------------------------------------


def test_readme_is_a_front_page_linking_every_page():
    text = README.read_text()
    assert len(text.splitlines()) < README_MAX_LINES
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(read_page(README))}
    assert {p.resolve() for p in DOCS.glob("*.md")} - linked == set()


def test_readme_flag_table_gives_radixmesh_ups_defaults():
    (up,) = [parser for parser in all_parsers() if parser.prog == "radixmesh up"]
    rows = re.findall(r"^\| `(--[\w-]+)` \| ([^|]+) \|", README.read_text(), re.M)
    assert len(rows) == 10
    for flag, default in rows:
        assert flag in up._option_string_actions, flag
        shown, actual = default.strip().strip("`"), up._option_string_actions[flag].default
        if shown == "none":
            assert not actual, flag
        elif re.fullmatch(r"[\w.:-]+", shown):  # a value, not words about one
            assert shown == str(actual), flag


def ci_commands() -> list[str]:
    """The commands .ci/run runs, one a line, without its quiet flags and pip's upgrade."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    return [c.replace("pip install -q", "pip install") for c in commands
            if c != "pip install -q --upgrade pip"]


def test_readme_commands_are_what_ci_installs_and_runs():
    bash = [body for lang, body in read_page(README).blocks if lang == "bash"]
    *install, test = ci_commands()
    assert bash[0] == " && ".join([*install, "radixmesh up"])
    assert bash[1] == test


@pytest.mark.parametrize("span, expected", [
    ("radixmesh up --dp-sise 2", ["--dp-sise"]),
    ("radixmesh upp", ["subcommand 'upp'"]),
    ("radixmesh bench --dataset random --concurency 4", ["--concurency"]),
    ("python benchmarks/bench_mesh.py --no-such-flag", ["--no-such-flag"]),
    ("bench_host.py --mesh --stream 1", ["--stream"]),
    ("python benchmarks/bench_meshes.py", ["script benchmarks/bench_meshes.py"]),
    ("NATS_URL=x python -m radixmesh.services.worker --hots 1", ["--hots"]),
    ("python -m radixmesh.services.workers", ["module radixmesh.services.workers"]),
    ("python -m radixmesh.bench.random_model lora /tmp/x --sead 1", ["--sead"]),
])
def test_a_misspelt_command_is_caught(span, expected):
    assert command_problems(span_command(span)) == expected


def test_shell_commands_split_as_bash_does():
    script = """for n in a b; do python -m radixmesh.x ${#n}; done  # a comment
X=1 radixmesh up --port 1 \\
  --tp 2 & curl -d '{"a":
  1}' host"""
    assert list(shell_commands(script)) == [
        ["for", "n", "in", "a", "b"], ["python", "-m", "radixmesh.x", "${#n}"], ["done"],
        ["radixmesh", "up", "--port", "1", "--tp", "2"], ["curl", "-d", '{"a":\n  1}', "host"]]


def test_a_renamed_file_or_heading_is_caught(tmp_path):
    assert missing_path("radixmesh/core/setings.py") == "radixmesh/core/setings.py"
    assert missing_path("services/<service>/metric.py") == "services/<service>/metric.py"
    assert missing_path("row_samplng.py") == "row_samplng.py"
    assert missing_path("services/<service>/metrics.py") is None
    assert missing_path("1_Pooling/config.json") is None  # a checkpoint's file
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Eviction policies\n\n## Eviction policies\n")
    assert anchors(page) == {"a-page", "eviction-policies", "eviction-policies-1"}
