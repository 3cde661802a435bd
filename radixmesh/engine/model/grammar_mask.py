"""Constrained decoding on the worker: each constraint compiled once against the model's
vocabulary by the grammar backend (xgrammar or llguidance), a matcher per constrained
request, and the token mask applied to its logits.

The matcher lives with the sampler (on tensor-parallel rank 0): the worker runs steps in
order and samples every token itself, so the mask for a request's next token is built right
after the token before it was accepted, whether the scheduler overlaps steps or not, and
without a round trip. Constrained and free requests share a batch: only the constrained
rows of the logits are masked. Both backends fill the same bit-packed mask.

Compiling runs on a thread of its own. The scheduler asks for a constraint when a request
that carries it arrives and admits the request once a step's result reports it compiled,
so a slow compile holds up that request alone. Compiled grammars are kept, the least
recently used dropped past 512.

An answer cut by max_new_tokens ends as `length` like any other: the grammar's end is
reached only through its stop token.

Jump-forward: where the grammar allows a single continuation after a sampled token (a
schema's fixed keys and punctuation), those tokens are appended at once instead of one
decode step each. They are the tokens the tokenizer gives the sampled token's text followed
by the forced text, so the model sees its own tokenization at the seam; the last one is
left to the model, which may merge it with what follows."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixmesh.core.grammar import (
    check_kind,
    llguidance_grammar,
    structural_tag,
    xgrammar_error,
)
from radixmesh.core.step import Constraint
from radixmesh.core.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance
    import xgrammar

log = logging.getLogger("radixmesh.worker")

_KEPT = 512  # compiled grammars kept


class Matcher(ABC):
    """One request's place in its grammar."""

    def __init__(self, stop_token_ids: Sequence[int]) -> None:
        self.stop_token_ids = list(stop_token_ids)
        self.ended = False  # its stop token was accepted: nothing more is constrained

    def accept(self, token: int) -> bool:
        """Advance past a token; False (and no change) if the grammar does not allow it."""
        if not self._accept(token):
            return False
        self.ended = token in self.stop_token_ids
        return True

    @abstractmethod
    def _accept(self, token: int) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (none of them a stop token)."""

    @abstractmethod
    def forced_text(self) -> str:
        """The text the grammar allows as the only continuation from here ('' if none)."""

    @abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Set row `row` of an int32 bit-packed mask to the tokens allowed next."""


class _XGrammarMatcher(Matcher):
    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar

        self._m = xgrammar.GrammarMatcher(compiled)
        super().__init__(self._m.stop_token_ids)

    def _accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def forced_text(self) -> str:
        return self._m.find_jump_forward_string()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


class _LLGuidanceMatcher(Matcher):
    def __init__(self, template: llguidance.LLMatcher, stop_token_ids: Sequence[int]) -> None:
        super().__init__(stop_token_ids)
        self._m = template.deep_copy()

    def _accept(self, token: int) -> bool:
        if token in self.stop_token_ids:  # allowed once the grammar is satisfied
            return self._m.is_accepting() and self._m.consume_token(token)
        # llguidance's errors are sticky: try the token first.
        return self._m.try_consume_tokens([token]) == 1

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def forced_text(self) -> str:
        forced = self._m.compute_ff_bytes()
        while forced:  # up to a whole character
            try:
                return forced.decode()
            except UnicodeDecodeError:
                forced = forced[:-1]
        return ""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]
                   ) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the model's vocabulary: every token's bytes as the tokenizer
    encodes them, padded to the model's `vocab_size` (padding is never allowed)."""
    import xgrammar

    raw = tokenizer.raw
    vocab = raw.get_vocab(with_added_tokens=True)
    encoded = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        encoded[index] = token
    if type(raw.decoder).__name__ == "ByteLevel":
        kind = xgrammar.VocabType.BYTE_LEVEL
    elif "<0x0A>" in vocab:
        kind = xgrammar.VocabType.BYTE_FALLBACK
    else:
        kind = xgrammar.VocabType.RAW
    return xgrammar.TokenizerInfo(
        encoded, kind, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
    )


@dataclass(frozen=True)
class Vocabulary:
    """The model's tokenizer, its vocabulary size and stop tokens."""

    tokenizer: Tokenizer
    vocab_size: int
    stop_ids: tuple[int, ...]


class Grammars:
    """The constraints of one model: compiled once each, off the step thread. Reading the
    vocabulary for the compiler (about half a second for a 49k vocabulary) starts at once,
    on the same thread, so the first constrained request does not wait for it."""

    def __init__(
        self,
        vocabulary: Callable[[], Vocabulary],
        backend: str = "xgrammar",
        jump_forward: bool = True,
    ) -> None:
        if backend not in ("xgrammar", "llguidance"):
            raise ValueError(f"unknown grammar backend {backend!r}")
        self._load = vocabulary
        self.backend = backend
        self.jump_forward = jump_forward
        self._vocabulary: Vocabulary | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler or llguidance.LLTokenizer
        self._compiled: OrderedDict[Constraint, Future[Any]] = OrderedDict()
        self._asked: dict[Constraint, Future[Any]] = {}  # to report
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixmesh-grammar")
        self._pool.submit(self._compiler_ready)

    def prepare(self, constraint: Constraint) -> Future[Any]:
        """Start compiling (once per constraint); the future gives the compiled grammar."""
        future = self._compiled.get(constraint)
        if future is None:
            future = self._compiled[constraint] = self._pool.submit(self._compile, constraint)
            if len(self._compiled) > _KEPT:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        return future

    def ask(self, constraint: Constraint) -> None:
        """Prepare a constraint the scheduler waits for; `finished` reports it."""
        self._asked[constraint] = self.prepare(constraint)

    def finished(self, timeout: float = 0.0
                 ) -> tuple[list[Constraint], list[tuple[Constraint, str]]]:
        """Asked constraints whose compile has ended since the last call: those compiled,
        and those that failed with the error. With `timeout`, wait up to that long for one
        to end when none has."""
        if timeout and self._asked and not any(f.done() for f in self._asked.values()):
            wait(self._asked.values(), timeout, FIRST_COMPLETED)
        ready: list[Constraint] = []
        failed: list[tuple[Constraint, str]] = []
        for constraint, future in list(self._asked.items()):
            if not future.done():
                continue
            del self._asked[constraint]
            error = future.exception()
            if error is None:
                ready.append(constraint)
            else:
                failed.append((constraint, _refusal(constraint, error)))
                self._compiled.pop(constraint, None)
        return ready, failed

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for one request (waits for the compile if it is still running)."""
        compiled = self.prepare(constraint).result()
        if self.backend == "llguidance":
            return _LLGuidanceMatcher(compiled, self._vocabulary_ready().stop_ids)
        return _XGrammarMatcher(compiled)

    def forced_tokens(self, matcher: Matcher, token: int) -> list[int]:
        """Jump-forward after `token`, which the matcher has just accepted: the tokens its
        grammar forces next, accepted by the matcher too ([] when nothing is forced)."""
        if not self.jump_forward or matcher.ended:
            return []
        text = matcher.forced_text()
        if not text:
            return []
        raw = self._vocabulary_ready().tokenizer.raw
        head = raw.decode([token], skip_special_tokens=False)
        if not head or "\ufffd" in head:
            return []  # part of a character: no text to tokenize the seam with
        ids = raw.encode(head + text, add_special_tokens=False).ids
        if len(ids) < 3 or ids[0] != token:
            return []  # the sampled token and the forced text would tokenize as one
        forced = ids[1:-1]
        for accepted, forced_id in enumerate(forced):
            if not matcher.accept(forced_id):
                matcher.rollback(accepted)
                return []
        return forced

    def _vocabulary_ready(self) -> Vocabulary:
        if self._vocabulary is None:
            self._vocabulary = self._load()
        return self._vocabulary

    def _compiler_ready(self) -> Any:
        if self._compiler is not None:
            return self._compiler
        vocab = self._vocabulary_ready()
        if self.backend == "llguidance":
            import llguidance

            self._compiler = llguidance.LLTokenizer(
                vocab.tokenizer.raw.to_str(), n_vocab=vocab.vocab_size,
                eos_token=list(vocab.stop_ids),
            )
        else:
            import xgrammar

            info = tokenizer_info(vocab.tokenizer, vocab.vocab_size, vocab.stop_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, constraint: Constraint) -> Any:
        """A constraint that does not parse is refused in the words of the in-process
        engine's check before queueing (grammar.check)."""
        kind, text = constraint
        check_kind(kind, text)
        compiler = self._compiler_ready()
        if self.backend == "llguidance":
            import llguidance

            template = llguidance.LLMatcher(compiler, llguidance_grammar(kind, text))
            if template.is_error():
                raise ValueError(template.get_error())
            return template
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(structural_tag(text))
            return compiler.compile_grammar(text)
        except RuntimeError as exc:
            raise xgrammar_error(kind, exc) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _refusal(constraint: Constraint, error: BaseException) -> str:
    """Why a constraint was refused: a check's words as they are, else the compiler's."""
    if isinstance(error, ValueError):
        return str(error)
    return f"the {constraint[0]} could not be compiled: {type(error).__name__}: {error}"


def apply_masks(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> None:
    """Forbid, in place, every token a row's matcher does not allow next (rows without a
    matcher are left alone)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import xgrammar  # not before a step needs it: importing it takes seconds

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_mask(bitmask, i)
        if not bitmask[i].any():
            # Nothing can continue (a constraint no text satisfies): end the request with
            # a stop token rather than fail the step for everyone.
            bitmask[i] = 0
            for token in matcher.stop_token_ids:
                bit = 1 << (token % 32)
                bitmask[i, token // 32] |= bit - (1 << 32 if bit >= 1 << 31 else 0)  # int32
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
