"""A program's state and how its calls run.

As in SGLang, `+=` only queues a call: each state runs its calls in order on a thread of
its own, so forked branches generate at the same time and the engine batches them. Reading
the state (a variable, its text, forking it) waits for what is queued."""

from __future__ import annotations

import functools
import math
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixmesh.lang.backends import Backend, joined
from radixmesh.lang.chat import Conversation
from radixmesh.lang.program import Gen, Part, RoleMark, Seq
from radixmesh.lang.tools import ToolCall, read_calls, tool_params

_LOOK_BACK = 4  # prompt tokens before a choice compared for the merge at the boundary


class _Stream:
    """Runs a state's calls in order on a thread of its own, started when calls arrive
    and gone when none are left. The first call that fails skips the rest; `sync` raises
    its error."""

    def __init__(self) -> None:
        self._calls: deque[Callable[[], None]] = deque()
        self._idle = threading.Condition()
        self._running = False
        self.error: BaseException | None = None

    def submit(self, call: Callable[[], None]) -> None:
        with self._idle:
            self._calls.append(call)
            if not self._running:
                self._running = True
                threading.Thread(target=self._drain, daemon=True).start()

    def sync(self) -> None:
        """Wait until every queued call ran; raise the error of the one that failed."""
        with self._idle:
            self._idle.wait_for(lambda: not self._running)
        if self.error is not None:
            raise self.error

    def _drain(self) -> None:
        while True:
            with self._idle:
                if not self._calls:
                    self._running = False
                    self._idle.notify_all()
                    return
                call = self._calls.popleft()
            if self.error is None:
                try:
                    call()
                except BaseException as exc:  # noqa: BLE001 - kept for whoever syncs
                    self.error = exc


class _Program:
    """What a run's states share: whether it streams, the text its root state appended
    (for text_iter), and whether it ended."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.events: list[tuple[str | None, str]] = []  # (variable or None, text)
        self.finished = False
        self.error: BaseException | None = None
        self.changed = threading.Condition()

    def emit(self, name: str | None, text: str) -> None:
        with self.changed:
            self.events.append((name, text))
            self.changed.notify_all()

    def moved(self, seen: int) -> bool:
        """Whether there is more than `seen` events, or the run ended."""
        return self.finished or len(self.events) > seen

    def finish(self, error: BaseException | None) -> None:
        with self.changed:
            self.finished, self.error = True, error
            self.changed.notify_all()


class State:
    """A program's prompt so far, the variables it generated and their meta_info."""

    def __init__(self, backend: Backend, program: _Program | None = None) -> None:
        self.backend = backend
        self._program = program or _Program(streaming=False)
        self._stream = _Stream()
        self._root = True  # only the root state's text is the program's text
        self._parts: list[str] = []
        self._variables: dict[str, str] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._scores: dict[str, list[float]] = {}
        self._tool_calls: dict[str, list[ToolCall]] = {}
        self._chat: Conversation | None = None
        self._content_at = 0  # where the open role message's content begins in _parts

    # ---- writing ---------------------------------------------------------------------------

    def __iadd__(self, item: Part | Seq) -> State:
        for part in item.items if isinstance(item, Seq) else (item,):
            self._stream.submit(functools.partial(self._apply, part))
        return self

    # ---- reading (each waits for the queued calls) -----------------------------------------

    def __getitem__(self, name: str) -> str:
        self.sync()
        return self._variables[name]

    def text(self) -> str:
        self.sync()
        return "".join(self._parts)

    @property
    def variables(self) -> dict[str, str]:
        self.sync()
        return dict(self._variables)

    @property
    def meta(self) -> dict[str, dict[str, Any]]:
        self.sync()
        return dict(self._meta)

    @property
    def scores(self) -> dict[str, list[float]]:
        """Each select's scores, in the order of its choices."""
        self.sync()
        return dict(self._scores)

    def tool_calls(self, name: str) -> list[ToolCall]:
        """The tool calls the gen `name` made (its variable holds the text around them)."""
        self.sync()
        return list(self._tool_calls.get(name, []))

    def messages(self) -> list[dict[str, str]]:
        """The role messages so far, as a chat request would send them."""
        self.sync()
        return [dict(m) for m in self._chat.messages] if self._chat else []

    def sync(self) -> None:
        """Wait for every queued call; raise the error of one that failed."""
        self._stream.sync()

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """The program's text as it grows (or the variable `name`'s), chunk by chunk until
        the run ends; joined, the chunks equal `text()` (or the variable's raw output)."""
        program, seen = self._program, 0
        while True:
            with program.changed:
                program.changed.wait_for(functools.partial(program.moved, seen))
                events, done = program.events[seen:], program.finished
            seen += len(events)
            for variable, chunk in events:
                if chunk and (name is None or variable == name):
                    yield chunk
            if done and seen == len(program.events):
                if program.error is not None:
                    raise program.error
                return

    # ---- forks -----------------------------------------------------------------------------

    def fork(self, n: int) -> Forks:
        """n branches that go on from this state's prompt (their requests share it); each
        runs its calls on its own thread, so their gens run at the same time."""
        self.sync()
        branches = Forks(self)
        for _ in range(n):
            branch = State(self.backend, self._program)
            branch._root = False
            branch._parts = list(self._parts)
            branch._variables = dict(self._variables)
            branch._meta = dict(self._meta)
            branch._tool_calls = dict(self._tool_calls)
            branch._chat = self._chat.copy() if self._chat else None
            branch._content_at = self._content_at
            branches.append(branch)
        return branches

    def join(self, branches: Sequence[State]) -> None:
        """Wait for the branches and take their new variables and meta_info (each
        branch's own prompt stays its own)."""
        for branch in branches:
            branch.sync()
        self.sync()
        for branch in branches:
            for name, value in branch._variables.items():
                if name not in self._variables:
                    self._variables[name] = value
                    self._meta[name] = branch._meta[name]
                    if name in branch._tool_calls:
                        self._tool_calls[name] = branch._tool_calls[name]
                    if name in branch._scores:
                        self._scores[name] = branch._scores[name]

    # ---- the calls, on the state's own thread ----------------------------------------------

    def _apply(self, part: Part) -> None:
        if isinstance(part, str):
            self._append(None, part)
        elif isinstance(part, RoleMark):
            self._mark(part)
        elif part.choices:
            self._select(part)
        else:
            self._generate(part)

    def _append(self, name: str | None, text: str) -> None:
        self._parts.append(text)
        if self._root:
            self._program.emit(name, text)

    def _mark(self, mark: RoleMark) -> None:
        if self._chat is None:
            self._chat = Conversation(self.backend.chat_template())
        if mark.begin:
            self._append(None, self._chat.begin(mark.role, mark.tools))
            self._content_at = len(self._parts)
        else:
            content = "".join(self._parts[self._content_at:])
            self._append(None, self._chat.end(mark.role, content))

    def _generate(self, item: Gen) -> None:
        params = tool_params(item.params, item.tools)
        prompt = "".join(self._parts)
        if self._program.streaming and self._root:
            # The chunks go to text_iter as they come; the state takes the whole text.
            text, meta = joined(self.backend.stream(prompt, params),
                                functools.partial(self._program.emit, item.name))
            self._parts.append(text)
        else:
            (text, meta), = self.backend.generate([prompt], [params])
            self._append(item.name, text)
        content, calls = read_calls(text, item.tools)
        self._variables[item.name] = content
        self._meta[item.name] = meta
        if item.tools is not None:
            self._tool_calls[item.name] = calls

    def _select(self, item: Gen) -> None:
        prefix = "".join(self._parts)
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
        self._scores[item.name] = scores
        self._append(item.name, item.choices[best])
        self._variables[item.name] = item.choices[best]
        self._meta[item.name] = answers[best][1]


class Forks(list[State]):
    """A state's branches; `join()` waits for them and takes their variables."""

    def __init__(self, parent: State) -> None:
        super().__init__()
        self.parent = parent

    def join(self) -> None:
        self.parent.join(self)


class Function:
    """A program: `fn(state, **arguments)`."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, backend: Backend, stream: bool = False, **arguments: Any) -> State:
        """Run the program. With `stream`, it runs on a thread of its own and the state
        comes back at once: read it as it grows with `state.text_iter()`."""
        state = State(backend, _Program(streaming=stream))
        if not stream:
            self._finish(state, arguments)
            if state._program.error is not None:
                raise state._program.error
            return state
        threading.Thread(target=self._finish, args=(state, arguments), daemon=True).start()
        return state

    def run_batch(self, batch: Sequence[dict[str, Any]], backend: Backend,
                  num_threads: int = 16) -> list[State]:
        """Run the program once per arguments dict, at the same time (the engine batches
        their requests); the states in the same order."""
        with ThreadPoolExecutor(max(1, min(num_threads, len(batch)))) as pool:
            return list(pool.map(lambda args: self.run(backend, **args), batch))

    def _finish(self, state: State, arguments: dict[str, Any]) -> None:
        error: BaseException | None = None
        try:
            self.fn(state, **arguments)
            state.sync()
        except BaseException as exc:  # noqa: BLE001 - the caller or text_iter raises it
            error = exc
        state._program.finish(error)


def function(fn: Callable[..., None]) -> Function:
    """Make `fn(s, ...)` a program."""
    return Function(fn)
