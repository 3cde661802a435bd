"""Structured generation as the scheduler sees it: constraints compiled before admission,
and jump-forward.

A request whose constraint (json_schema, regex, ebnf) the worker has not compiled yet stays
in the queue, so a slow compile holds up only the requests that need it; the step batch
carries the constraints to compile and its result the ones that compiled or failed. When
the grammar forces the tokens after a sampled one, they are appended at once (jump-forward)
and the next decode feeds them all in one step."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from radixmesh.core.finish import FinishReason
from radixmesh.core.step import Constraint
from radixmesh.engine.request import Req

KEPT = 512  # constraints remembered as compiled (the worker keeps as many)


class Constraints:
    """Which constraints are compiled, which are compiling, and the tokens grammars forced."""

    def __init__(self) -> None:
        self.forced_tokens = 0  # output tokens appended by jump-forward, ever
        self.reset()

    def reset(self) -> None:
        """Fresh workers: nothing is compiled."""
        self._compiled: OrderedDict[Constraint, None] = OrderedDict()
        self._compiling: set[Constraint] = set()
        self._to_compile: list[Constraint] = []

    def ask(self, req: Req) -> None:
        """A request arrived: have its constraint compiled unless it is already."""
        grammar = req.params.grammar
        if grammar in self._compiled:
            self._compiled.move_to_end(grammar)
        elif grammar is not None and grammar not in self._compiling:
            self._compiling.add(grammar)
            self._to_compile.append(grammar)

    def ready(self, req: Req) -> bool:
        """Whether the request may be admitted: no constraint, or a compiled one."""
        return req.params.grammar is None or req.params.grammar in self._compiled

    @property
    def compiling(self) -> bool:
        """Whether a compile is asked for and not reported yet."""
        return bool(self._compiling)

    def take(self) -> list[Constraint]:
        """The constraints to ask the worker to compile with the next step."""
        asked, self._to_compile = self._to_compile, []
        return asked

    def ended(self, ready: list[Constraint], failed: list[tuple[Constraint, str]]) -> None:
        """Fold a step's compile reports in."""
        for grammar in ready:
            self._compiling.discard(grammar)
            self._compiled[grammar] = None
            self._compiled.move_to_end(grammar)
            if len(self._compiled) > KEPT:
                self._compiled.popitem(last=False)
        for grammar, _ in failed:
            self._compiling.discard(grammar)

    def jump_forward(self, req: Req, forced: list[int],
                     check_finish: Callable[[Req, int], FinishReason | None]
                     ) -> FinishReason | None:
        """Append the tokens the request's grammar forced after its sampled token, until
        one finishes it. A step already in flight for it feeds the sampled token and
        samples nothing (the runner knows), so it no longer counts."""
        if req.pending:
            req.pending -= 1
        req.jumped = True
        for token in forced:
            req.output_ids.append(token)
            self.forced_tokens += 1
            reason = check_finish(req, token)
            if reason is not None:
                return reason
        return None
