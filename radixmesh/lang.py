"""A small frontend language for LLM programs, after SGLang's: a program is a Python
function over a prompt state, built with `+=` from text, `gen` and `select`, that forks
into branches sharing its prefix (the radix cache serves the shared part once).

    from radixmesh import lang

    @lang.function
    def review(s, topic):
        s += f"Write one line about {topic}.\\n"
        s += lang.gen("line", max_tokens=24, stop="\\n")
        s += "\\nIs it positive? " + lang.select("mood", ["yes", "no"])

    state = review.run(topic="tea", backend=lang.EngineBackend(engine))
    state["line"], state["mood"], state.text()

Backends: EngineBackend (an in-process radixmesh.Engine) and HttpBackend (a running mesh's
native /generate). Calls run as they are written; run_batch runs programs on threads, so
the engine batches their requests."""

from __future__ import annotations

import functools
import json
import math
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from radixmesh.api import Engine

Answer = tuple[str, dict[str, Any]]  # generated text and its meta_info
_LOOK_BACK = 4  # prompt tokens before a choice compared for the merge at the boundary


class Backend(Protocol):
    """Where a program's requests run."""

    def generate(self, texts: list[str], params: list[dict[str, Any]], **extra: Any
                 ) -> list[Answer]:
        """One batch of prompts; `extra` holds return_logprob and logprob_start_len."""


class EngineBackend:
    """An in-process Engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def generate(self, texts: list[str], params: list[dict[str, Any]], **extra: Any
                 ) -> list[Answer]:
        outs = self.engine.generate(texts, params, **extra)
        return [(o["text"], o["meta_info"]) for o in outs]


class HttpBackend:
    """A running mesh, through its native /generate."""

    def __init__(self, url: str, timeout: float = 300.0, api_key: str = "") -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def generate(self, texts: list[str], params: list[dict[str, Any]], **extra: Any
                 ) -> list[Answer]:
        body = json.dumps({"text": texts, "sampling_params": params, **extra}).encode()
        request = urllib.request.Request(self.url + "/generate", body, self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                outs = json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise ValueError(f"/generate answered {exc.code}: {exc.read().decode()}") from None
        return [(o["text"], o["meta_info"]) for o in outs]


@dataclass(frozen=True)
class Seq:
    """Text and generations in order: `"Answer: " + gen("x")`."""

    items: tuple[str | Gen, ...]

    def __add__(self, other: str | Gen | Seq) -> Seq:
        return Seq(self.items + _items(other))

    def __radd__(self, other: str) -> Seq:
        return Seq((other, *self.items))


@dataclass(frozen=True)
class Gen:
    """`gen(...)`: generate into the variable `name`."""

    name: str
    params: dict[str, Any]
    choices: tuple[str, ...] = ()

    def __add__(self, other: str | Gen | Seq) -> Seq:
        return Seq((self, *_items(other)))

    def __radd__(self, other: str) -> Seq:
        return Seq((other, self))


def _items(part: str | Gen | Seq) -> tuple[str | Gen, ...]:
    return part.items if isinstance(part, Seq) else (part,)


def gen(
    name: str,
    max_tokens: int = 128,
    stop: str | Sequence[str] | None = None,
    temperature: float = 0.0,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    choices: Sequence[str] | None = None,
) -> Gen:
    """Generate text into `name`: up to `max_tokens`, until a `stop` string, held to a
    `regex` or a `json_schema`, or picked among `choices` (as select does)."""
    params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": temperature}
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if regex is not None:
        params["regex"] = regex
    if json_schema is not None:
        params["json_schema"] = (
            json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        )
    return Gen(name, params, tuple(choices or ()))


def select(name: str, choices: Sequence[str]) -> Gen:
    """Pick one of `choices` into `name`: the one whose tokens the model finds likeliest
    after the prompt so far, by their mean token logprob (SGLang's length-normalized
    score), all choices scored in one batch."""
    if not choices:
        raise ValueError("select needs at least one choice")
    return Gen(name, {}, tuple(choices))


@dataclass
class State:
    """A program's prompt so far, the variables it generated and their meta_info."""

    backend: Backend
    parts: list[str] = field(default_factory=list)
    variables: dict[str, str] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    scores: dict[str, list[float]] = field(default_factory=dict)

    def __iadd__(self, item: str | Gen | Seq) -> State:
        if isinstance(item, Seq):
            for part in item.items:
                self += part
        elif isinstance(item, str):
            self.parts.append(item)
        elif item.choices:
            self._select(item)
        else:
            (text, meta), = self.backend.generate([self.text()], [item.params])
            self._set(item.name, text, meta)
        return self

    def __getitem__(self, name: str) -> str:
        return self.variables[name]

    def text(self) -> str:
        return "".join(self.parts)

    def fork(self, n: int) -> list[State]:
        """n branches that go on from this state's prompt (their requests share it)."""
        return [State(self.backend, list(self.parts), dict(self.variables), dict(self.meta))
                for _ in range(n)]

    def join(self, branches: Sequence[State]) -> None:
        """Take the branches' variables and their meta_info (each branch's own prompt
        stays its own)."""
        for branch in branches:
            for name, value in branch.variables.items():
                if name not in self.variables:
                    self.variables[name] = value
                    self.meta[name] = branch.meta[name]

    def _select(self, item: Gen) -> None:
        prefix = self.text()
        (_, head), = self.backend.generate([prefix], [{"max_new_tokens": 0}])
        # A choice may merge with the prefix's last tokens ("Answer: " + "yes" ends in
        # " yes"): compare the token ids from a few tokens back to find where it starts.
        start = max(head["prompt_tokens"] - _LOOK_BACK, 0)
        texts = [prefix, *(prefix + c for c in item.choices)]
        answers = self.backend.generate(texts, [{"max_new_tokens": 0}] * len(texts),
                                        return_logprob=True, logprob_start_len=start)
        (_, shared), *answers = answers
        shared_ids = [tid for _, tid, _ in shared["input_token_logprobs"]]
        scores = []
        for _, meta in answers:
            entries = meta["input_token_logprobs"]
            same = 0
            while (same < min(len(entries), len(shared_ids))
                   and entries[same][1] == shared_ids[same]):
                same += 1
            same = min(same, len(entries) - 1)  # the choice has at least one token
            logprobs = [lp for lp, _, _ in entries[same:] if lp is not None and math.isfinite(lp)]
            scores.append(sum(logprobs) / max(len(logprobs), 1))
        best = max(range(len(scores)), key=scores.__getitem__)
        self.scores[item.name] = scores
        self._set(item.name, item.choices[best], answers[best][1])

    def _set(self, name: str, text: str, meta: dict[str, Any]) -> None:
        self.parts.append(text)
        self.variables[name] = text
        self.meta[name] = meta


class Function:
    """A program: `fn(state, **arguments)`."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, backend: Backend, **arguments: Any) -> State:
        state = State(backend)
        self.fn(state, **arguments)
        return state

    def run_batch(self, batch: Sequence[dict[str, Any]], backend: Backend,
                  num_threads: int = 16) -> list[State]:
        """Run the program once per arguments dict, at the same time (the engine batches
        their requests); the states in the same order."""
        with ThreadPoolExecutor(max(1, min(num_threads, len(batch)))) as pool:
            return list(pool.map(lambda args: self.run(backend, **args), batch))


def function(fn: Callable[..., None]) -> Function:
    """Make `fn(s, ...)` a program."""
    return Function(fn)
