"""Sampling by table row: each request-table row's parameters as tensors, set when its
request joins, so that a step's plain rows sample in one batched pass with the same
arithmetic and the same seeded draws as sampling.sample's per-request path."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.engine.model.sampling import (
    RowParams,
    argmax_rows,
    choose,
    has_penalty,
    top_k_of,
)


def _signed(value: int) -> int:
    """The low 64 bits of a Python int as torch's int64 holds them."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_rows(x: torch.Tensor) -> torch.Tensor:
    """_splitmix64 of each element of an int64 tensor (arithmetic wraps as in uint64)."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """uniform(seed, step) of each row, from int64 seeds (as _signed holds them) and steps:
    the same float32 values, with no Python per row."""
    h = _splitmix64_rows(_splitmix64_rows(seeds) ^ steps)
    return _shr(h, 40).to(torch.float32) / (1 << 24)


def is_plain(params: SamplingParams) -> bool:
    """Whether a request samples through RowSampling's batched path: everything but
    min_new_tokens and grammars (and logprobs, which the runner asks of the request)."""
    return params.min_new_tokens == 0 and params.grammar is None


class RowSampling:
    """The sampling parameters of every request-table row as tensors, set once when a
    request joins, so that a step's plain rows sample in one batched pass; `drawn` counts
    each row's draws (the step of its next uniform), `plain` tells the rows that may.

    Penalties keep dense per-row state, made for the rows that have any: each vocabulary
    token's count in the output and whether the prompt holds it, on the logits' device;
    logit_bias a sparse list per row. A step without either pays for neither."""

    def __init__(self, vocab: int, rows: int = 16) -> None:
        self.vocab = vocab
        self.temperature = torch.ones(rows)
        self.top_k = torch.full((rows,), vocab)
        self.top_p = torch.ones(rows)
        self.min_p = torch.zeros(rows)
        self.seed = torch.zeros(rows, dtype=torch.long)
        self.drawn = torch.zeros(rows, dtype=torch.long)
        self.greedy = torch.ones(rows, dtype=torch.bool)
        self.plain = torch.zeros(rows, dtype=torch.bool)
        self.penalised = torch.zeros(rows, dtype=torch.bool)
        self.frequency = torch.zeros(rows)
        self.presence = torch.zeros(rows)
        self.repetition = torch.ones(rows)
        self.counts: torch.Tensor | None = None  # [rows, vocab] output counts, when needed
        self.in_prompt: torch.Tensor | None = None  # [rows, vocab] bool
        self.bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> (ids, values)

    def set(self, row: int, params: SamplingParams, seed: int, plain: bool) -> None:
        """A request takes `row` (plain: it samples here), with no draw yet."""
        if row >= self.seed.numel():
            self._grow(row + 1)
        self.plain[row] = plain
        self.temperature[row] = params.temperature
        self.top_k[row] = top_k_of(params, self.vocab)
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seed[row] = _signed(seed)
        self.drawn[row] = 0
        self.greedy[row] = params.is_greedy
        self.frequency[row] = params.frequency_penalty
        self.presence[row] = params.presence_penalty
        self.repetition[row] = params.repetition_penalty
        self.penalised[row] = plain and has_penalty(params)
        self.bias.pop(row, None)
        if plain and params.logit_bias:
            self.bias[row] = (torch.tensor(list(params.logit_bias), dtype=torch.long),
                              torch.tensor(list(params.logit_bias.values())))

    def start(self, row: int, drawn: int, prompt: Sequence[int] = (),
              output: Sequence[int] = (), device: torch.device | None = None) -> None:
        """A row's first sample since its request joined, `drawn` tokens output before (a
        retracted request's); a penalised row's prompt and output so far go to its
        penalties."""
        self.drawn[row] = drawn
        if not bool(self.penalised[row]):
            return
        device = device or torch.device("cpu")
        if self.counts is None or self.counts.device != device:
            rows = self.seed.numel()
            self.counts = torch.zeros(rows, self.vocab, device=device)
            self.in_prompt = torch.zeros(rows, self.vocab, dtype=torch.bool, device=device)
        assert self.in_prompt is not None
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        if prompt:
            self.in_prompt[row, torch.tensor(prompt, device=device)] = True
        if output:
            ids = torch.tensor(output, device=device)
            self.counts[row].index_add_(0, ids, torch.ones(len(output), device=device))

    def sample(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One token per row of logits [B, V] for table rows [B] (host), on the logits'
        device where every row is greedy; counts each row's draw. Adjusts `logits` in
        place (bias, then penalties, as `sample` does)."""
        if self.bias:
            self._add_bias(logits, rows)
        penalised = self.penalised.index_select(0, rows)
        if bool(penalised.any()):
            self._penalise(logits, rows, penalised)
        greedy = self.greedy.index_select(0, rows)
        if bool(greedy.all()):
            tokens = argmax_rows(logits)
        else:
            # Seeded draws in CPU arithmetic do not depend on the rest of the batch.
            params = RowParams(
                self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows],
                uniforms(self.seed[rows], self.drawn[rows]),
            )
            tokens = choose(logits.cpu(), greedy, params)
            self.drawn.index_add_(0, rows, torch.ones_like(rows))
        if bool(penalised.any()):
            at = penalised.nonzero().flatten()
            self._count(rows[at], tokens.index_select(0, at.to(tokens.device)))
        return tokens

    def record(self, row: int, tokens: Sequence[int]) -> None:
        """Output tokens a row produced outside `sample` (a verified draft's)."""
        if tokens and bool(self.penalised[row]):
            self._count(torch.full((len(tokens),), row), torch.tensor(tokens))

    def _count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        assert self.counts is not None
        device = self.counts.device
        self.counts.index_put_((rows.to(device), tokens.to(device)),
                               torch.ones(rows.numel(), device=device), accumulate=True)

    def _add_bias(self, x: torch.Tensor, rows: torch.Tensor) -> None:
        """Add the logit_bias of the rows that have one (sparse: row by row)."""
        biased = [(i, self.bias[row]) for i, row in enumerate(rows.tolist()) if row in self.bias]
        if not biased:
            return
        owner = torch.cat([torch.full_like(ids, i) for i, (ids, _) in biased])
        ids = torch.cat([ids for _, (ids, _) in biased])
        values = torch.cat([values for _, (_, values) in biased])
        x.index_put_((owner.to(x.device), ids.to(x.device)), values.to(x.device),
                     accumulate=True)

    def _penalise(self, x: torch.Tensor, rows: torch.Tensor, penalised: torch.Tensor) -> None:
        """Frequency and presence (OpenAI), then repetition (CTRL) penalties in place, on
        the tokens each row's prompt or output holds: the per-request path's arithmetic."""
        assert self.counts is not None and self.in_prompt is not None
        at = penalised.nonzero().flatten()
        table = rows[at].to(self.counts.device)
        counts = self.counts.index_select(0, table)
        seen = (counts > 0) | self.in_prompt.index_select(0, table)
        freq = self.frequency[rows[at]].to(x.device)[:, None]
        pres = self.presence[rows[at]].to(x.device)[:, None]
        rep = self.repetition[rows[at]].to(x.device)[:, None]
        index = at.to(x.device)
        vals = x.index_select(0, index) - (freq * counts + pres * (counts > 0))
        vals = torch.where(vals > 0, vals / rep, vals * rep)
        x.index_copy_(0, index, torch.where(seen, vals, x.index_select(0, index)))

    def _grow(self, rows: int) -> None:
        n = self.seed.numel()
        while n < rows:
            n *= 2
        for name, fill in (("temperature", 1.0), ("top_k", self.vocab), ("top_p", 1.0),
                           ("min_p", 0.0), ("seed", 0), ("drawn", 0), ("greedy", True),
                           ("plain", False), ("penalised", False), ("frequency", 0.0),
                           ("presence", 0.0), ("repetition", 1.0)):
            old = getattr(self, name)
            grown = torch.full((n,), fill, dtype=old.dtype)
            grown[: old.numel()] = old
            setattr(self, name, grown)
        for name in ("counts", "in_prompt"):
            old = getattr(self, name)
            if old is not None:
                grown = old.new_zeros(n, self.vocab)
                grown[: old.shape[0]] = old
                setattr(self, name, grown)
