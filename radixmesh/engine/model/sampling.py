"""Batched, seed-deterministic token sampling over one model step's logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.kernels import native

_MASK64 = (1 << 64) - 1
# top_k/top_p thresholds are read from this many top weights; a row that needs more
# (a wide nucleus on a flat distribution, or a large top_k) reads _CANDIDATE_GROWTH
# times as many, and so on up to the whole row.
_CANDIDATES = 256
_CANDIDATE_GROWTH = 16


def _splitmix64(x: int) -> int:
    """One splitmix64 step: a well-mixed 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, step)."""
    h = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    # 24 bits, so the value is exact in float32 and stays strictly below 1.
    return (h >> 40) / (1 << 24)


def has_penalty(params: SamplingParams) -> bool:
    """Whether any frequency, presence or repetition penalty is active."""
    return (params.frequency_penalty != 0 or params.presence_penalty != 0
            or params.repetition_penalty != 1)


class _TokenHistory:
    """The distinct tokens of one request's prompt and output, with output counts.

    Sparse, so applying penalties costs O(distinct tokens) rather than O(vocab).
    """

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        distinct = list(dict.fromkeys(int(t) for t in prompt_ids))
        self._slot = {t: i for i, t in enumerate(distinct)}
        capacity = len(distinct) + 64
        self._ids = torch.zeros(capacity, dtype=torch.long)
        self._ids[: len(distinct)] = torch.tensor(distinct, dtype=torch.long)
        self._counts = torch.zeros(capacity, dtype=torch.float32)  # output occurrences

    @property
    def ids(self) -> torch.Tensor:
        """Distinct token ids seen in the prompt or the output."""
        return self._ids[: len(self._slot)]

    @property
    def counts(self) -> torch.Tensor:
        """How often each of `ids` appeared in the output (0 for prompt-only tokens)."""
        return self._counts[: len(self._slot)]

    def add(self, token_id: int) -> None:
        """Count one output token."""
        slot = self._slot.get(token_id)
        if slot is None:
            slot = len(self._slot)
            if slot == self._ids.numel():
                self._grow()
            self._slot[token_id] = slot
            self._ids[slot] = token_id
        self._counts[slot] += 1

    def _grow(self) -> None:
        """Double the capacity (amortised O(1) appends)."""
        n = self._ids.numel()
        self._ids = torch.cat([self._ids, torch.zeros(n, dtype=torch.long)])
        self._counts = torch.cat([self._counts, torch.zeros(n, dtype=torch.float32)])


class RequestSampler:
    """Sampling state one request carries across decode steps."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        seed: int,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        params.validate(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        self.seed = seed
        self.num_output = 0
        self.history: _TokenHistory | None = None
        if self.has_penalty:
            self.history = _TokenHistory(prompt_ids)
        end_ids = sorted(set(params.stop_token_ids) | set(eos_token_ids))
        self.end_ids = torch.tensor(end_ids, dtype=torch.long)
        self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        self.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)

    @property
    def has_penalty(self) -> bool:
        """Whether any frequency, presence or repetition penalty is active."""
        return has_penalty(self.params)

    @property
    def blocks_end(self) -> bool:
        """Whether end tokens must be suppressed this step (min_new_tokens not reached). A
        constrained request's grammar decides when it may end: never suppressed."""
        return (
            self.num_output < self.params.min_new_tokens
            and self.end_ids.numel() > 0
            and self.params.grammar is None
        )

    @property
    def needs_filter(self) -> bool:
        """Whether top_k, top_p or min_p can drop tokens for this request."""
        p = self.params
        return 1 < p.top_k < self.vocab_size or p.top_p < 1 or p.min_p > 0

    def uniform(self) -> float:
        """This step's uniform draw."""
        return uniform(self.seed, self.num_output)

    def record(self, token_id: int) -> None:
        """Account for a token the request just produced."""
        if self.history is not None:
            self.history.add(token_id)
        self.num_output += 1


class RowParams(NamedTuple):
    """Each row's draw parameters as tensors on the logits' device (see _draw)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; the vocabulary size where top_k is off
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    uniform: torch.Tensor  # float32: this step's draw

    @classmethod
    def of(cls, samplers: Sequence[RequestSampler], vocab: int, device: torch.device) -> RowParams:
        """The parameters of per-request samplers, this step's draws included."""
        p = [r.params for r in samplers]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            floats([q.temperature for q in p]),
            torch.tensor([top_k_of(q, vocab) for q in p], device=device),
            floats([q.top_p for q in p]),
            floats([q.min_p for q in p]),
            floats([r.uniform() for r in samplers]),
        )

    def select(self, rows: torch.Tensor) -> RowParams:
        return RowParams(*(t.index_select(0, rows) for t in self))


class SampleOutput(NamedTuple):
    """One sampled token per row with its log-probability and the row's top alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


def sample(
    logits: torch.Tensor,
    samplers: Sequence[RequestSampler],
    top_logprobs_nums: Sequence[int] | None = None,
    vocab_mask: torch.Tensor | None = None,
    with_logprobs: bool = True,
) -> SampleOutput:
    """Pick one token per row of `logits` [B, V], row i following `samplers[i]`.

    With `with_logprobs=False` the logprobs list is empty (saves a pass over the vocab)."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits must be [{len(samplers)}, V], got {list(logits.shape)}")
    if top_logprobs_nums is not None and len(top_logprobs_nums) != len(samplers):
        raise ValueError("top_logprobs_nums must have one entry per row")
    x = _adjusted_logits(logits, samplers, vocab_mask)
    if not with_logprobs and all(r.params.is_greedy for r in samplers):
        return SampleOutput(argmax_rows(x).tolist(), [], [[] for _ in samplers])
    lse = torch.logsumexp(x, dim=-1)
    bad = (~torch.isfinite(lse)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"logits rows {bad} have no allowed finite token")
    tokens = _choose(x, samplers)
    chosen = x.gather(1, tokens[:, None]).squeeze(1) - lse
    top = _top_logprobs(x, lse, top_logprobs_nums or [0] * len(samplers))
    return SampleOutput(tokens.tolist(), chosen.tolist(), top)


def _adjusted_logits(
    logits: torch.Tensor, samplers: Sequence[RequestSampler], vocab_mask: torch.Tensor | None
) -> torch.Tensor:
    """Float32 logits after logit_bias, penalties, min_new_tokens and the vocab mask; never
    edits the input. The bias comes first, so greedy picks see it and nothing it raises
    escapes a mask."""
    biased = [i for i, r in enumerate(samplers) if r.bias_ids.numel()]
    penalised = [i for i, r in enumerate(samplers) if r.history is not None]
    blocked = [i for i, r in enumerate(samplers) if r.blocks_end]
    x = logits.to(torch.float32, copy=bool(biased or penalised or blocked))
    if biased:
        _add_bias(x, samplers, biased)
    if penalised:
        _penalise(x, samplers, penalised)
    if blocked:
        ends = [samplers[i].end_ids for i in blocked]
        rows = torch.cat([torch.full_like(e, i) for i, e in zip(blocked, ends, strict=True)])
        x[rows.to(x.device), torch.cat(ends).to(x.device)] = float("-inf")
    if vocab_mask is not None:
        x = torch.where(vocab_mask, x, float("-inf"))
    return x


def _add_bias(x: torch.Tensor, samplers: Sequence[RequestSampler], rows: list[int]) -> None:
    """Add each of `rows`' logit_bias to its logits in place."""
    ids = [samplers[i].bias_ids for i in rows]
    owner = torch.cat([torch.full_like(t, i) for i, t in zip(rows, ids, strict=True)])
    values = torch.cat([samplers[i].bias_values for i in rows])
    x.index_put_((owner.to(x.device), torch.cat(ids).to(x.device)), values.to(x.device),
                 accumulate=True)


def _penalise(x: torch.Tensor, samplers: Sequence[RequestSampler], rows: list[int]) -> None:
    """Penalise `rows` of `x` in place: frequency/presence (OpenAI), then repetition (CTRL)."""
    histories = [h for i in rows if (h := samplers[i].history) is not None]
    params = [samplers[i].params for i in rows]
    ids = torch.cat([h.ids for h in histories]).to(x.device)
    counts = torch.cat([h.counts for h in histories]).to(x.device)
    sizes = torch.tensor([h.ids.numel() for h in histories], device=x.device)
    owner = torch.repeat_interleave(torch.arange(len(rows), device=x.device), sizes)
    freq = _floats([p.frequency_penalty for p in params], x)[owner]
    pres = _floats([p.presence_penalty for p in params], x)[owner]
    rep = _floats([p.repetition_penalty for p in params], x)[owner]
    at = (torch.tensor(rows, device=x.device)[owner], ids)
    # Only tokens in a history change; prompt-only ones have count 0, so just `rep` applies.
    vals = x[at] - (freq * counts + pres * (counts > 0))
    x[at] = torch.where(vals > 0, vals / rep, vals * rep)


def _floats(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """A float32 vector on `like`'s device."""
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index of the largest value): native where built, else torch."""
    return native.argmax(x) if native.argmax_supported(x) else x.argmax(dim=-1)


def _choose(x: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """Argmax for greedy rows, a seeded draw for the rest."""
    greedy = torch.tensor([r.params.is_greedy for r in samplers])
    if bool(greedy.all()):
        return argmax_rows(x)
    return choose(x, greedy, RowParams.of(samplers, x.shape[1], x.device))


def choose(x: torch.Tensor, greedy: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Argmax for the greedy rows (a host bool per row), a draw from `params` for the
    rest; one pass over each group whatever the batch."""
    if bool(greedy.all()):
        return argmax_rows(x)
    if not bool(greedy.any()):
        return _draw(x, params)
    g_idx = greedy.nonzero().flatten().to(x.device)
    s_idx = (~greedy).nonzero().flatten().to(x.device)
    tokens = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    tokens[g_idx] = argmax_rows(x.index_select(0, g_idx))
    tokens[s_idx] = _draw(x.index_select(0, s_idx), params.select(s_idx))
    return tokens


def _draw(x: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Sample each row from softmax(x / T) filtered by top_k, top_p and min_p."""
    # Unnormalised weights with each row's top token at exactly 1: the filters and the
    # draw only need ratios, in-place ops keep this to one float [rows, vocab] buffer,
    # and subtracting the max first means no temperature, however small, can overflow.
    w = (x - x.amax(dim=-1, keepdim=True)).div_(params.temperature[:, None]).exp_()
    floor = _keep_floor(w, params)
    if floor is not None:
        w.masked_fill_(w < floor[:, None], 0.0)
    # Inverse CDF in vocabulary order: the result is independent of how ties sort.
    cdf = w.cumsum_(dim=-1)
    total = cdf[:, -1:]
    u = params.uniform[:, None]
    # Strictly below the total, so the first cdf entry above it has positive mass.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _keep_floor(w: torch.Tensor, params: RowParams) -> torch.Tensor | None:
    """Per-row weight below which a token is dropped, or None if no row filters."""
    vocab = w.shape[1]
    top_k_top_p = (params.top_k < vocab) | (params.top_p < 1)
    if not bool((top_k_top_p | (params.min_p > 0)).any()):
        return None
    # The top weight is exactly 1, so min_p is the floor itself (and never drops the top).
    floor = params.min_p.clone()
    if not bool(top_k_top_p.any()):
        return floor
    if bool(top_k_top_p.all()):
        return _top_k_top_p_floor(w, params.top_k, params.top_p, floor)
    idx = top_k_top_p.nonzero().flatten()
    floor[idx] = _top_k_top_p_floor(w.index_select(0, idx), params.top_k[idx],
                                    params.top_p[idx], floor[idx])
    return floor


def top_k_of(params: SamplingParams, vocab: int) -> int:
    """Effective top_k: the whole vocabulary when disabled."""
    return params.top_k if 1 <= params.top_k < vocab else vocab


def _top_k_top_p_floor(
    w: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, lower: torch.Tensor
) -> torch.Tensor:
    """Smallest weight kept by top_k, top_p and the floor `lower` (from min_p)."""
    # Read a few top weights, then many more only for rows that need them: a partial
    # topk is far cheaper than a sort. A row's floor comes out the same whichever round
    # settles it (topk values do not depend on tie order, and a CPU cumsum prefix does
    # not depend on how far the sum runs), so its draw ignores the rest of the batch.
    vocab = w.shape[1]
    n_vals = int(torch.where(k < vocab, k, _CANDIDATES).clamp(max=_CANDIDATES).max())
    floor = lower.clone()
    todo = torch.arange(k.numel(), device=w.device)
    rows = w
    while todo.numel():
        n_vals = min(n_vals, vocab)
        vals = rows.topk(n_vals, dim=-1).values
        found, unresolved = _nucleus_floor(rows, vals, k[todo], top_p[todo])
        # An unresolved floor lies below every value read, so a `lower` at or above
        # the last one already decides the row.
        done = ~unresolved | (lower[todo] >= vals[:, -1])
        settled = todo[done]
        floor[settled] = torch.maximum(found[done], lower[settled])
        todo = todo[~done]
        rows = w.index_select(0, todo)
        n_vals *= _CANDIDATE_GROWTH
    return floor


def _nucleus_floor(
    w: torch.Tensor, vals: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Floors from the descending top weights `vals`, and which rows needed more of them."""
    n_vals, vocab = vals.shape[1], w.shape[1]
    last = k - 1  # index in `vals` of the smallest kept weight
    if bool((top_p < 1).any()):
        cum = vals.cumsum(dim=-1)
        # top_p is a share of the mass top_k kept.
        k_mass = cum.gather(1, last.clamp(max=n_vals - 1)[:, None]).squeeze(1)
        mass = torch.where(k < vocab, k_mass, w.sum(dim=-1))
        end = torch.searchsorted(cum, (top_p * mass)[:, None]).squeeze(1)
        last = torch.where(top_p < 1, torch.minimum(end, last), last)
    unresolved = (last >= n_vals) | ((k < vocab) & (k > n_vals))
    floor = vals.gather(1, last.clamp(max=n_vals - 1)[:, None]).squeeze(1)
    return floor, unresolved


def _top_logprobs(
    x: torch.Tensor, lse: torch.Tensor, nums: Sequence[int]
) -> list[list[tuple[int, float]]]:
    """Each row's `nums[i]` most likely (token id, logprob) pairs, most likely first."""
    out: list[list[tuple[int, float]]] = [[] for _ in nums]
    rows = [i for i, n in enumerate(nums) if n > 0]
    if not rows:
        return out
    idx = torch.tensor(rows, device=x.device)
    n_max = min(max(nums), x.shape[1])
    vals, ids = x.index_select(0, idx).topk(n_max, dim=-1)
    logprobs = (vals - lse.index_select(0, idx)[:, None]).tolist()
    ids_list = ids.tolist()
    for j, i in enumerate(rows):
        n = min(nums[i], n_max)
        out[i] = list(zip(ids_list[j][:n], logprobs[j][:n], strict=True))
    return out
