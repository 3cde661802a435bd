"""How a step's tokens come out of its hidden states: the plain rows sampled in one batched
pass, the other requests one by one (their penalties, grammars, logprobs), drafts verified,
prompt logprobs, and a tensor-parallel rank other than 0 taking rank 0's tokens. It also
holds what the runner remembers of each request between steps, beside its table row."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixmesh.core.sampling_params import LogprobRequest
from radixmesh.core.step import EntryResult, NewRequest, StepEntry, StepResult, int_array
from radixmesh.engine.model.draft_tree import children, forced_path, keep_path
from radixmesh.engine.model.grammar_mask import Grammars, Matcher, apply_masks
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.model import CausalLM
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.parallel import TensorParallel
from radixmesh.engine.model.req_table import ReqTable
from radixmesh.engine.model.row_sampling import RowSampling
from radixmesh.engine.model.sampling import RequestSampler, sample

log = logging.getLogger("radixmesh.worker")

# Rows of prompt logits turned into logprobs at a time: bounds the float32 [rows, vocab] buffer.
_LOGPROB_BLOCK = 256


@dataclass
class RequestState:
    """What the worker remembers of a request between steps, beside its table row."""

    spec: NewRequest
    plain: bool  # samples through RowSampling: no min_new_tokens, grammar or logprobs
    sampled: bool = False  # has sampled since it was (re)admitted
    sampler: RequestSampler | None = None  # a request that is not plain, from its first sample
    matcher: Matcher | None = None  # with a constraint, from the first sample
    # Jump-forward: tokens were forced after its last token. The step the scheduler already
    # ran ahead for it (no input_ids) feeds that token but must not sample: the forced
    # tokens come first, in the request's next entry.
    jumped: bool = False
    # log-softmax of the last computed position, kept for the first token of the next chunk
    carry_logprobs: torch.Tensor | None = None
    # Embedding: the final hidden states pooled so far (a sum for mean pooling, the first
    # token's for CLS), float32
    pooled: torch.Tensor | None = None

    @property
    def row(self) -> int:
        return self.spec.row


@dataclass
class StepLayout:
    """One step's sequences as the runner lays them out: the plain decodes (packed), then
    each entry's fed tokens, then the draft nodes' rows."""

    decode_rows: torch.Tensor  # [D] table rows (host)
    states: list[RequestState]  # per entry
    q_starts: list[int]  # per entry: its first token's row in the step
    q_lens: list[int]  # per entry: tokens it feeds
    trees: dict[int, dict[int, int]]  # entries with a draft -> its nodes' rows
    void: set[int]  # entries whose sample a jump-forward made void
    device_rows: torch.Tensor | None = None  # decode_rows on the runner's device

    @property
    def num_decodes(self) -> int:
        return self.decode_rows.numel()

    def last_row(self, i: int) -> int:
        """The step row of entry i's last fed token."""
        return self.q_starts[i] + self.q_lens[i] - 1


class StepSampler:
    """Picks each step's tokens for a runner: its model, pool and request table, its rank
    (tp), and each row's request (`by_row`, which the runner keeps)."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        table: ReqTable,
        config: ModelConfig,
        tp: TensorParallel | None,
        device: torch.device,
        by_row: dict[int, RequestState],
    ) -> None:
        self.model, self.pool, self.table, self.config = model, pool, table, config
        self.tp, self.device, self.by_row = tp, device, by_row
        self.row_sampling = RowSampling(config.vocab_size)
        # Constrained decoding; load_runner gives the model's vocabulary to compile against.
        self.grammars: Grammars | None = None

    def sample(
        self,
        step: StepLayout,
        sampling: list[int],
        entries: list[StepEntry],
        hidden: torch.Tensor,
        outs: list[EntryResult],
        result: StepResult,
    ) -> TokenRead | None:
        """Sample the plain decodes and plain entries in one batched pass, the rest one
        request at a time; then verify the drafts. A step of plain decodes alone on one rank
        returns what reads its tokens into `result` later (the copy is queued behind the
        step's work), so that the next step can be launched first."""
        picked = [i for i in sampling if i not in step.void]
        plain = [i for i in picked if i not in step.trees and step.states[i].plain]
        special = [i for i in picked if i not in step.trees and not step.states[i].plain]
        for i in plain:
            self._start_sampling(step.states[i])
        rows = step.decode_rows
        n = rows.numel()
        decode_plain = self.row_sampling.plain.index_select(0, rows)
        # None: every decode is plain (the usual step: no per-request work at all).
        plain_decodes = None if bool(decode_plain.all()) else decode_plain.nonzero().flatten()
        if not step.states and plain_decodes is None:  # the usual step: every row samples
            hidden_rows, table_rows = None, rows
        else:
            hidden_rows = torch.cat([
                torch.arange(n) if plain_decodes is None else plain_decodes,
                torch.tensor([step.last_row(i) for i in plain], dtype=torch.long),
            ])
            table_rows = torch.cat([
                rows if plain_decodes is None else rows[plain_decodes],
                torch.tensor([step.states[i].row for i in plain], dtype=torch.long),
            ])
        tokens = torch.empty(0, dtype=torch.long)
        if table_rows.numel():
            last = hidden if hidden_rows is None else hidden.index_select(
                0, hidden_rows.to(hidden.device))
            tokens = self.row_sampling.sample(self.model.logits(last), table_rows)
            on_device = step.device_rows if table_rows is rows else None
            if on_device is None:
                on_device = table_rows.to(self.device)
            self.table.last.index_copy_(0, on_device, tokens.to(self.device))
            if not step.states and plain_decodes is None and self.tp is None:
                return TokenRead(tokens, result)
        picked_tokens = tokens.tolist()  # the step's one device-to-host copy of plain tokens
        decoded = picked_tokens[: len(picked_tokens) - len(plain)]
        for i, token in zip(plain, picked_tokens[len(decoded) :], strict=True):
            outs[i].token_id = token
        if plain_decodes is not None:  # decodes of requests that are not plain
            others = (~decode_plain).nonzero().flatten().tolist()
            merged = [-1] * n
            for j, token in zip(plain_decodes.tolist(), decoded, strict=True):
                merged[j] = token
            extra = [EntryResult("") for _ in others]
            states = [self.by_row[int(rows[j])] for j in others]
            for j, token in zip(others, self._sample_rows(states, others, hidden, extra),
                                strict=True):
                merged[j] = token
            decoded = merged
        result.decode_tokens = int_array(decoded)
        self._sample_rows([step.states[i] for i in special], [step.last_row(i) for i in special],
                          hidden, [outs[i] for i in special])
        drafted = [i for i in picked if i in step.trees]
        paths = self._verify(drafted, entries, step, hidden, outs)
        for i in drafted:
            state = step.states[i]
            self.table.last[state.row] = outs[i].token_id
            accepted, kept = keep_path(self.pool, entries[i], paths[i])
            self.table.append(state.row, accepted, kept)
        if self.tp is not None:
            flat = list(decoded)
            for i in sampling:
                flat.append(outs[i].token_id if i not in step.void else -1)
                if entries[i].draft:
                    path = paths.get(i, [])
                    flat.extend(path + [-1] * (len(entries[i].draft) - len(path)))
            self.tp.broadcast_tokens(flat)
        return None

    def _start_sampling(self, state: RequestState) -> None:
        """A plain request's first sample since its admission: its draws so far are its
        output so far (a retracted request's, readmitted), which its penalties count."""
        if not state.sampled:
            state.sampled = True
            row, n = state.row, state.spec.prompt_len
            drawn = int(self.table.lens[row]) - n
            if bool(self.row_sampling.penalised[row]):  # its tokens, from the device
                self.row_sampling.start(row, drawn, self.table.row_tokens(row, 0, n),
                                        self.table.row_tokens(row, n), self.device)
            else:
                self.row_sampling.start(row, drawn)

    def _sample_rows(
        self,
        states: list[RequestState],
        hidden_rows: list[int],
        hidden: torch.Tensor,
        outs: list[EntryResult],
    ) -> list[int]:
        """Sample requests that are not plain one by one (penalties, bias, a grammar,
        logprobs): each from its own sampler, under its grammar's mask."""
        if not states:
            return []
        logits = self.model.logits(hidden[torch.tensor(hidden_rows, device=hidden.device)])
        samplers = [self._sampler(state) for state in states]
        wants = [state.spec.logprobs for state in states]
        top_n = [w.top_logprobs_num if w.return_logprob else 0 for w in wants]
        with_logprobs = any(w.return_logprob for w in wants)
        logits = _for_sampling(logits, samplers, with_logprobs)
        matchers = [self.matcher(state) for state in states]
        apply_masks(logits, matchers)
        sampled = sample(logits, samplers, top_n, with_logprobs=with_logprobs)
        tokens = sampled.token_ids
        for j, state in enumerate(states):
            token, out = tokens[j], outs[j]
            self.table.last[state.row] = out.token_id = token
            samplers[j].record(token)
            if wants[j].return_logprob:
                out.logprob = sampled.logprobs[j]
                out.top_logprobs = sampled.top_logprobs[j]
            self._advance_grammar(state, matchers[j], token, wants[j], out)
        return tokens

    def _verify(
        self,
        drafted: list[int],
        entries: list[StepEntry],
        step: StepLayout,
        hidden: torch.Tensor,
        outs: list[EntryResult],
    ) -> dict[int, list[int]]:
        """Walk each draft tree from its fed token: sample the model's token there, exactly as
        a decode step would (same sampler state, grammar mask and draw); where a child carries
        that token (and the tokens jump-forward forces after it, if any), accept them and
        sample again below; else the sampled token ends the walk, followed by what is forced.
        Every output token is so the model's own, and greedy output equals decoding without
        drafts. Returns each entry's accepted draft nodes."""
        if not drafted:
            return {}
        states, trees = step.states, step.trees
        row_of: dict[tuple[int, int], int] = {}  # (entry, node; -1 the fed token) -> logits row
        rows: list[int] = []
        for i in drafted:
            row_of[i, -1] = len(rows)
            rows.append(step.last_row(i))
            for node, row in trees[i].items():
                row_of[i, node] = len(rows)
                rows.append(row)
        logits = self.model.logits(hidden[torch.tensor(rows, device=hidden.device)])
        samplers = {i: self._sampler(states[i]) for i in drafted}
        matchers = {i: self.matcher(states[i]) for i in drafted}
        wants = {i: states[i].spec.logprobs for i in drafted}
        logits = _for_sampling(logits, list(samplers.values()),
                               any(w.return_logprob for w in wants.values()))
        kids = {i: children(entries[i], trees[i]) for i in drafted}
        at = dict.fromkeys(drafted, -1)  # the node each walk stands on
        paths: dict[int, list[int]] = {i: [] for i in drafted}
        walking = list(drafted)
        while walking:
            index = torch.tensor([row_of[i, at[i]] for i in walking], device=logits.device)
            here = logits.index_select(0, index)
            apply_masks(here, [matchers[i] for i in walking])
            top_n = [w.top_logprobs_num if w.return_logprob else 0 for w in map(wants.get, walking)]
            sampled = sample(here, [samplers[i] for i in walking], top_n,
                             with_logprobs=any(wants[i].return_logprob for i in walking))
            still = []
            for j, i in enumerate(walking):
                token, out = sampled.token_ids[j], outs[i]
                samplers[i].record(token)
                forced = self._advance_grammar(states[i], matchers[i], token, wants[i], out)
                nodes = forced_path(kids[i], at[i], [token, *out.forced_ids])
                if nodes is None:
                    out.token_id = token
                    if wants[i].return_logprob:
                        out.logprob, out.top_logprobs = sampled.logprobs[j], sampled.top_logprobs[j]
                    continue
                # The tree carries the token, and every token jump-forward forced after it:
                # all are accepted, their K/V computed, and the walk goes on below them.
                out.accepted_ids += [token, *out.forced_ids]
                if wants[i].return_logprob:
                    out.accepted_logprobs.append(sampled.logprobs[j])
                    out.accepted_top_logprobs.append(sampled.top_logprobs[j])
                if forced:
                    out.forced_ids, states[i].jumped = [], False
                paths[i] += nodes
                at[i] = nodes[-1]
                still.append(i)
            walking = still
        for i in drafted:
            if states[i].plain:  # its draws and penalties are counted by its row
                self.row_sampling.drawn[states[i].row] = samplers[i].num_output
                self.row_sampling.record(states[i].row, [*outs[i].accepted_ids,
                                                       outs[i].token_id])
        return paths

    def _advance_grammar(
        self, state: RequestState, matcher: Matcher | None, token: int, wants: LogprobRequest,
        out: EntryResult,
    ) -> bool:
        """Feed a sampled token to the request's grammar; True when the grammar forces
        tokens after it (jump-forward: out.forced_ids, recorded by its sampler)."""
        if matcher is None:
            return False
        if not matcher.accept(token):
            log.warning("request %s: token %d is outside its grammar", state.spec.rid, token)
            return False
        if wants.return_logprob:  # a forced token has no logprob to report
            return False
        out.forced_ids = self._grammars().forced_tokens(matcher, token)
        for forced in out.forced_ids:
            self._sampler(state).record(forced)
        state.jumped = bool(out.forced_ids)
        return state.jumped

    def follow(
        self,
        tp: TensorParallel,
        step: StepLayout,
        sampling: list[int],
        entries: list[StepEntry],
        outs: list[EntryResult],
        result: StepResult,
    ) -> None:
        """A rank other than 0 takes rank 0's tokens (and accepted draft paths) instead of
        computing logits, so every rank feeds the same tokens next step (sampling state
        lives on rank 0 only). Forced tokens reach these ranks as the input_ids of the
        request's next entry."""
        n = step.num_decodes
        size = n + sum(1 + len(entries[i].draft) for i in sampling)
        if not size:
            return
        flat = tp.broadcast_tokens([0] * size)
        if n:
            tokens = torch.tensor(flat[:n], dtype=torch.long, device=self.device)
            self.table.last.index_copy_(0, step.decode_rows.to(self.device), tokens)
            result.decode_tokens = int_array(flat[:n])
        at = n
        for i in sampling:
            token, entry, state = flat[at], entries[i], step.states[i]
            path = [k for k in flat[at + 1 : at + 1 + len(entry.draft)] if k >= 0]
            at += 1 + len(entry.draft)
            if token < 0:
                continue
            outs[i].token_id = token
            if entry.draft:
                outs[i].accepted_ids, kept = keep_path(self.pool, entry, path)
                self.table.append(state.row, outs[i].accepted_ids, kept)
            self.table.last[state.row] = token

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            raise ValueError("this worker was not given a vocabulary for constrained decoding")
        return self.grammars

    def matcher(self, state: RequestState) -> Matcher | None:
        """The request's grammar matcher, made at its first sample and brought up to date
        with any output it had before (a retracted request's)."""
        constraint = state.spec.params.grammar
        if constraint is None:
            return None
        if state.matcher is None:
            state.matcher = self._grammars().matcher(constraint)
            for token in self.table.row_tokens(state.row, state.spec.prompt_len):
                state.matcher.accept(token)
        # Ended (its stop token accepted): a step the scheduler ran ahead past the finish
        # samples freely; that token is dropped.
        return None if state.matcher.ended else state.matcher

    def _sampler(self, state: RequestState) -> RequestSampler:
        """The request's sampler: kept for a request that is not plain; for a plain one,
        made at its count of draws (verifying drafts, which walks request by request)."""
        if state.sampler is None or state.plain:
            spec = state.spec
            sampler = RequestSampler(
                spec.params,
                self.table.row_tokens(state.row, 0, spec.prompt_len),
                self.config.vocab_size,
                seed=spec.seed,
                eos_token_ids=self.config.eos_token_ids,
            )
            if sampler.history is not None or not state.plain:
                for token in self.table.row_tokens(state.row, spec.prompt_len):
                    sampler.record(token)
            if state.plain:
                self._start_sampling(state)
                sampler.num_output = int(self.row_sampling.drawn[state.row])
                return sampler
            state.sampler = sampler
        return state.sampler

    def input_logprobs(
        self, state: RequestState, q_start: int, q_len: int, hidden: torch.Tensor,
        out: EntryResult,
    ) -> None:
        """Logprobs of the prompt tokens this chunk (q_len tokens from step row q_start)
        holds, from logprob_start_len on."""
        spec = state.spec
        start_len = spec.logprobs.logprob_start_len
        end = int(self.table.lens[state.row])
        first = end - q_len  # prompt position of the chunk's first token
        carry, state.carry_logprobs = state.carry_logprobs, None
        last_row = hidden[q_start + q_len - 1 : q_start + q_len]
        if start_len <= end < spec.prompt_len:
            state.carry_logprobs = torch.log_softmax(self.model.logits(last_row), dim=-1)[0]
        lo, hi = max(start_len, first), min(spec.prompt_len, end)
        if lo >= hi:
            return
        ids = self.table.row_tokens(state.row, 0, hi)
        out.input_logprobs_start = lo
        top_n = spec.logprobs.top_logprobs_num
        if lo == first:
            # Predicted by the previous chunk's last position; nothing predicts position 0.
            if carry is None:
                out.input_logprobs.append(float("nan"))
                out.input_top_logprobs.append([])
            else:
                _add_logprobs(out, carry.unsqueeze(0), [ids[lo]], top_n)
            lo += 1
        for b in range(lo, hi, _LOGPROB_BLOCK):
            e = min(b + _LOGPROB_BLOCK, hi)
            rows = torch.arange(b - 1, e - 1, device=hidden.device) - first + q_start
            logprobs = torch.log_softmax(self.model.logits(hidden[rows]), dim=-1)
            _add_logprobs(out, logprobs, ids[b:e], top_n)



class TokenRead:
    """Reads a step's plain tokens into result.decode_tokens. On a GPU their copy to pinned
    host memory is queued at once; ready() tells whether it has landed, and the read waits
    for it."""

    def __init__(self, tokens: torch.Tensor, result: StepResult) -> None:
        self._result = result
        self._copied: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            tokens = host
        self._tokens = tokens

    def ready(self) -> bool:
        return self._copied is None or self._copied.query()

    def __call__(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        self._result.decode_tokens = int_array(self._tokens.tolist())


def _for_sampling(
    logits: torch.Tensor, samplers: Sequence[RequestSampler], with_logprobs: bool
) -> torch.Tensor:
    """Logits where they are sampled: only greedy picks stay on the device, since the
    sampler's seeded draws and sums do not depend on the rest of the batch in CPU
    arithmetic (see sampling.py)."""
    if logits.device.type != "cpu" and (
        with_logprobs or not all(s.params.is_greedy for s in samplers)
    ):
        return logits.cpu()
    return logits


def _add_logprobs(
    out: EntryResult, logprobs: torch.Tensor, targets: list[int], top_n: int
) -> None:
    """Append each target's logprob (and the top-n alternatives) to the entry result."""
    index = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
    picked = logprobs.gather(1, index).squeeze(1)
    out.input_logprobs.extend(picked.tolist())
    if top_n:
        values, indices = logprobs.topk(top_n, dim=-1)
        out.input_top_logprobs.extend(
            list(zip(ids, vals, strict=True))
            for vals, ids in zip(values.tolist(), indices.tolist(), strict=True)
        )
    else:
        out.input_top_logprobs.extend([] for _ in targets)


