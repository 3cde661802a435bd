"""Constrained decoding on the worker: each constraint compiled once against the model's
vocabulary, a matcher per constrained request, and the token mask applied to its logits.

The matcher lives with the sampler (on tensor-parallel rank 0): the worker runs steps in
order and samples every token itself, so the mask for a request's next token is built right
after the token before it was accepted, whether the scheduler overlaps steps or not, and
without a round trip. Constrained and free requests share a batch: only the constrained
rows of the logits are masked.

Compiling runs on a thread of its own, started when the request reaches the worker; its
prompt is prefilled meanwhile, and only its first sample waits for the compiled grammar.
An answer cut by max_new_tokens ends as `length` like any other: the grammar's end is
reached only through its stop token."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from radixmesh.core.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger("radixmesh.worker")

Constraint = tuple[str, str]  # (kind, text): SamplingParams.grammar


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


class Grammars:
    """The constraints of one model: compiled once each, off the step thread. Reading the
    vocabulary for the compiler (about half a second for a 49k vocabulary) starts at once,
    on the same thread, so the first constrained request does not wait for it."""

    def __init__(self, info: Callable[[], xgrammar.TokenizerInfo]) -> None:
        self._info = info
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: dict[Constraint, Future[xgrammar.CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixmesh-grammar")
        self._pool.submit(self._compiler_ready)

    def prepare(self, constraint: Constraint) -> Future[xgrammar.CompiledGrammar]:
        """Start compiling (once per constraint); the future gives the compiled grammar."""
        future = self._compiled.get(constraint)
        if future is None:
            future = self._compiled[constraint] = self._pool.submit(self._compile, constraint)
        return future

    def matcher(self, constraint: Constraint) -> xgrammar.GrammarMatcher:
        """A fresh matcher for one request (waits for the compile if it is still running)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.prepare(constraint).result())

    def _compiler_ready(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        if self._compiler is None:
            self._compiler = xgrammar.GrammarCompiler(self._info(), max_threads=1)
        return self._compiler

    def _compile(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        compiler = self._compiler_ready()
        kind, text = constraint
        if kind == "json_schema":
            # No optional whitespace: a small model left free to add it can fill its budget
            # with newlines (the separators stay json.dumps's ", " and ": ").
            return compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_masks(logits: torch.Tensor, matchers: Sequence[xgrammar.GrammarMatcher | None]
                ) -> None:
    """Forbid, in place, every token a row's matcher does not allow next (rows without a
    matcher are left alone)."""
    import xgrammar

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matcher = matchers[i]
        matcher.fill_next_token_bitmask(bitmask, i)
        if not bitmask[i].any():
            # Nothing can continue (a constraint no text satisfies): end the request with
            # a stop token rather than fail the step for everyone.
            bitmask[i] = 0
            for token in matcher.stop_token_ids:
                bit = 1 << (token % 32)
                bitmask[i, token // 32] |= bit - (1 << 32 if bit >= 1 << 31 else 0)  # int32
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
