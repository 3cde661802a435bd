"""The model runner: executes one StepBatch against the model and the KV pool."""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixmesh.core.model_files import resolve_model_path
from radixmesh.core.sampling_params import LogprobRequest
from radixmesh.core.settings import RunnerSettings
from radixmesh.core.step import (
    EntryResult,
    NewRequest,
    StepBatch,
    StepEntry,
    StepResult,
    int_array,
)
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    SeqSpan,
    padded_rows,
)
from radixmesh.engine.model.attention_choice import check_runs_on, make_attention
from radixmesh.engine.model.device import current, resolve_device
from radixmesh.engine.model.draft_tree import (
    children,
    draft_rows,
    forced_path,
    grammar_allows,
    keep_path,
)
from radixmesh.engine.model.grammar_mask import Grammars, Matcher, Vocabulary, apply_masks
from radixmesh.engine.model.host_copies import HostCopier
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.memory import keep_freed_memory, release_free_memory
from radixmesh.engine.model.model import CausalLM
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.parallel import (
    TensorParallel,
    check_divisible,
    init_tensor_parallel,
    local_config,
    shard_weights,
)
from radixmesh.engine.model.req_table import ReqTable
from radixmesh.engine.model.sampling import RequestSampler, RowSampling, is_plain, sample
from radixmesh.engine.model.torch_attention import TorchAttention

if TYPE_CHECKING:
    from radixmesh.engine.model.cuda_graphs import DecodeGraphs

log = logging.getLogger("radixmesh.worker")

# Rows of prompt logits turned into logprobs at a time: bounds the float32 [rows, vocab] buffer.
_LOGPROB_BLOCK = 256
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class _RequestState:
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

    @property
    def row(self) -> int:
        return self.spec.row


@dataclass
class _Step:
    """One step's sequences as the runner lays them out: the plain decodes (packed), then
    each entry's fed tokens, then the draft nodes' rows."""

    decode_rows: torch.Tensor  # [D] table rows (host)
    reqs: list[_RequestState]  # per entry
    q_starts: list[int]  # per entry: its first token's row in the step
    q_lens: list[int]  # per entry: tokens it feeds
    trees: dict[int, dict[int, int]]  # entries with a draft -> its nodes' rows
    void: set[int]  # entries whose sample a jump-forward made void

    @property
    def num_decodes(self) -> int:
        return self.decode_rows.numel()

    def last_row(self, i: int) -> int:
        """The step row of entry i's last fed token."""
        return self.q_starts[i] + self.q_lens[i] - 1


class ModelRunner:
    """Owns the weights, the KV pool and each request's sampling state, on `device`.

    Under tensor parallelism `weights` hold this rank's shards (parallel.shard_weights)
    and the pool only this rank's KV heads; rank 0 samples and the others take its tokens.
    `attention` is a backend or its name (see attention_choice.make_attention).

    With the Triton backend on CUDA, decode-only steps of up to `cuda_graph_max_bs`
    requests replay CUDA graphs (cuda_graphs.DecodeGraphs; 0: never; never for a
    mixture-of-experts model). `eager_graphs` runs that padded path eagerly instead, on any
    device: how it is tested without a GPU.

    A step's KVCopy list moves KV between the pool and the engine's host pool
    (host_copies.HostCopier): loads before the forward, backups started after it."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        num_slots: int,
        attention: AttentionBackend | str = "auto",
        tp: TensorParallel | None = None,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        cuda_graph_max_bs: int = 0,
        eager_graphs: bool = False,
    ) -> None:
        keep_freed_memory()
        self.config = config
        self.tp = tp
        self.device = torch.device(device)
        shard = config if tp is None else local_config(config, tp.size)
        self.attention = (
            attention
            if isinstance(attention, AttentionBackend)
            else make_attention(attention, config.attention_scale, self.device, page_size,
                                config.layer_windows, config.attn_logit_softcap)
        )
        check_runs_on(self.attention, self.device)
        with current(self.device):
            self.model = CausalLM(shard, weights, dtype, tp, self.device)
            self.pool = KVPool(
                shard.num_layers, num_slots, shard.num_kv_heads, shard.head_dim, dtype, self.device
            )
            self.graphs = self._decode_graphs(cuda_graph_max_bs, eager_graphs, num_slots)
            rank = 0 if tp is None else tp.rank
            self.host_copies = HostCopier(self.pool, config.num_kv_heads, rank)
        self.graph_steps = 0  # steps that ran through self.graphs
        self.requests: dict[str, _RequestState] = {}
        self._by_row: dict[int, _RequestState] = {}
        # Each request's slots and tokens by position, and its last token, on the device;
        # the plain requests' sampling parameters beside them on the host.
        self.table = ReqTable(self.device)
        self.row_sampling = RowSampling(config.vocab_size)
        # Constrained decoding; load_runner gives the model's vocabulary to compile against.
        self.grammars: Grammars | None = None
        # How load_runner loaded the weights (see DeviceSettings.quantization), and from
        # where (a hub repo resolved to its snapshot).
        self.quantization = "bf16"
        self.model_path: Path | None = None

    def _decode_graphs(self, max_batch: int, eager: bool, num_slots: int) -> DecodeGraphs | None:
        # A sparse MLP reads how many tokens each expert got back on the host: no graph can
        # hold that.
        if max_batch == 0 or isinstance(self.attention, TorchAttention) or self.config.is_moe:
            return None
        if self.device.type != "cuda" and not eager:
            return None
        # Imported here: both import triton, which a CPU-only install may lack.
        from radixmesh.engine.model.cuda_graphs import DecodeGraphs
        from radixmesh.engine.model.triton_attention import TritonAttention

        if not isinstance(self.attention, TritonAttention):
            return None
        max_context = min(self.config.max_position_embeddings, num_slots)
        with torch.inference_mode():
            return DecodeGraphs(
                self.model, self.attention, self.pool, max_batch, max_context, capture=not eager
            )

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> StepResult:
        """Run one step: forget released requests, admit new ones, load KV from the host
        pool, compute, sample, start backups to the host pool."""
        began = time.perf_counter()
        if batch.step == 1:  # a scheduler (re)started: what the one before sent is gone
            self.requests.clear()
            self._by_row.clear()
        for rid in batch.release:
            gone = self.requests.pop(rid, None)
            if gone is not None and self._by_row.get(gone.row) is gone:
                del self._by_row[gone.row]
        for spec in batch.new_requests:
            req = _RequestState(spec, is_plain(spec.params) and not spec.logprobs.return_logprob)
            with current(self.device):
                self.table.admit(spec.row, spec.prefix_ids, spec.prefix_slots)
            self.row_sampling.set(spec.row, spec.params, spec.seed, req.plain)
            self.requests[spec.rid] = self._by_row[spec.row] = req
        result = StepResult(batch.step)
        if self._is_sampler():
            self._compile_asked(batch, result)
        with current(self.device):
            if batch.host_pool is not None:
                self.host_copies.map(batch.host_pool)
            self.host_copies.load([c for c in batch.copies if not c.to_host])
            if batch.entries or batch.decode_rows:
                self._run(batch, result)
            self.host_copies.start_backups([c for c in batch.copies if c.to_host])
        result.copies_done = self.host_copies.finished()
        result.forward_ms = (time.perf_counter() - began) * 1e3
        return result

    def _run(self, batch: StepBatch, result: StepResult) -> None:
        table = self.table
        decode_rows = _ints(batch.decode_rows).long()
        step = _Step(decode_rows, [], [], [], {}, set())
        ids: list[int] = []  # the entries' fed tokens; -1: the row's last sampled token
        positions: list[int] = []
        slots: list[int] = []
        nodes: list[SeqSpan] = []  # draft nodes: each a sequence of its own
        feeds_last: list[tuple[int, int]] = []  # (index in ids, table row) of each -1
        first = step.num_decodes
        for i, entry in enumerate(batch.entries):
            req = self.requests[entry.rid]
            if req.jumped and not entry.input_ids and entry.sample:
                step.void.add(i)
            req.jumped = False
            new_ids = entry.input_ids or [-1]
            fed = entry.slots[: len(new_ids)] if entry.draft else entry.slots
            if not entry.input_ids:
                feeds_last.append((len(ids), req.row))
            fed_ids = new_ids if entry.input_ids else table.last[req.row : req.row + 1]
            start = table.append(req.row, fed_ids, fed)
            step.reqs.append(req)
            step.q_starts.append(first + len(ids))
            step.q_lens.append(len(new_ids))
            ids.extend(new_ids)
            positions.extend(range(start, start + len(new_ids)))
            slots.extend(fed)
            if entry.draft:
                # Rank 0 alone holds the grammar: under TP every rank computes every node.
                matcher = self._matcher(req) if self.tp is None else None
                keep = grammar_allows(entry, matcher)
                step.trees[i] = draft_rows(entry, keep, table.row_slots(req.row).long(), ids,
                                           positions, slots, nodes, first)
        input_ids, input_positions, meta = self._inputs(step, ids, feeds_last, positions, slots,
                                                        nodes, _ints(batch.decode_slots))
        if self.graphs is not None and self.graphs.fits(meta):
            hidden = self.graphs.run(input_ids, input_positions, meta)
            self.graph_steps += 1
        else:
            self.attention.prepare(meta)
            hidden = self.model.forward(input_ids, input_positions, self.attention, self.pool)
        outs = result.results = [EntryResult(e.rid) for e in batch.entries]
        # Every rank broadcasts a token per plain decode and per sampling entry, void ones
        # included (as -1), and after a draft's token the accepted path (see _follow).
        sampling = [i for i, e in enumerate(batch.entries) if e.sample]
        if self.tp is not None and not self.tp.is_leader:
            self._follow(self.tp, step, sampling, batch.entries, outs, result)
            return
        for i, out in enumerate(outs):
            req = step.reqs[i]
            if req.spec.logprobs.return_logprob and req.spec.logprobs.logprob_start_len >= 0:
                self._input_logprobs(req, step.q_starts[i], step.q_lens[i], hidden, out)
        self._sample(step, sampling, batch.entries, hidden, outs, result)

    def _inputs(
        self, step: _Step, ids: list[int], feeds_last: list[tuple[int, int]],
        positions: list[int], slots: list[int], nodes: list[SeqSpan], decode_slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's token ids, positions and attention metadata: the plain decodes' by
        tensor ops over the table, the entries' and draft nodes' from their lists."""
        table, device = self.table, self.device
        rows = step.decode_rows
        decode_positions = (table.append_decodes(rows, decode_slots) if rows.numel()
                            else rows.new_empty(0))
        if not step.reqs:  # plain decodes only: a handful of tensor ops whatever the batch
            at = rows.to(device)
            kv_lens = decode_positions + 1
            meta = AttentionMetadata.decodes(decode_slots.to(device, torch.long), kv_lens,
                                             table.index(at, int(kv_lens.max())))
            return table.last.index_select(0, at), decode_positions.to(device), meta
        entry_rows = torch.tensor([r.row for r in step.reqs], dtype=torch.long)
        seq_rows = torch.cat([rows, entry_rows])
        entry_ids = torch.tensor(ids, dtype=torch.long, device=device)
        if feeds_last:  # entries that feed their last sampled token
            at, owners = zip(*feeds_last, strict=True)
            entry_ids[torch.tensor(at, device=device)] = table.last[torch.tensor(owners,
                                                                                 device=device)]
        input_ids = torch.cat([table.last.index_select(0, rows.to(device)), entry_ids])
        input_positions = torch.cat([decode_positions, torch.tensor(positions, dtype=torch.long)])
        out_slots = torch.cat([decode_slots.long(), torch.tensor(slots, dtype=torch.long)])
        kv_lens = torch.cat([decode_positions + 1, table.lens.index_select(0, entry_rows),
                             torch.tensor([n.kv_slots.numel() for n in nodes], dtype=torch.long)])
        width = int(kv_lens.max())
        kv_index = table.index(seq_rows.to(device), width)
        q_starts = torch.cat([torch.arange(rows.numel()),
                              torch.tensor(step.q_starts, dtype=torch.long),
                              torch.tensor([n.q_start for n in nodes], dtype=torch.long)])
        q_lens = torch.cat([torch.ones(rows.numel(), dtype=torch.long),
                            torch.tensor(step.q_lens, dtype=torch.long),
                            torch.ones(len(nodes), dtype=torch.long)])
        if nodes:
            extra = padded_rows([n.kv_slots for n in nodes], device)
            kv_index = torch.cat([kv_index, extra.new_zeros(len(nodes), width)])
            kv_index[seq_rows.numel() :, : extra.shape[1]] = extra
            # Sequences in row order, as a decode-only step (a CUDA graph's) reads them.
            order = q_starts.argsort()
            q_starts, q_lens, kv_lens = q_starts[order], q_lens[order], kv_lens[order]
            kv_index = kv_index[order.to(device)]
        meta = AttentionMetadata(out_slots.to(device), q_starts, q_lens, kv_lens, kv_index)
        return input_ids, input_positions.to(device), meta

    def _sample(
        self,
        step: _Step,
        sampling: list[int],
        entries: list[StepEntry],
        hidden: torch.Tensor,
        outs: list[EntryResult],
        result: StepResult,
    ) -> None:
        """Sample the plain decodes and plain entries in one batched pass, the rest one
        request at a time; then verify the drafts."""
        picked = [i for i in sampling if i not in step.void]
        plain = [i for i in picked if i not in step.trees and step.reqs[i].plain]
        special = [i for i in picked if i not in step.trees and not step.reqs[i].plain]
        for i in plain:
            self._start_sampling(step.reqs[i])
        rows = step.decode_rows
        n = rows.numel()
        decode_plain = self.row_sampling.plain.index_select(0, rows)
        # None: every decode is plain (the usual step: no per-request work at all).
        plain_decodes = None if bool(decode_plain.all()) else decode_plain.nonzero().flatten()
        if not step.reqs and plain_decodes is None:  # the usual step: every row samples
            hidden_rows, table_rows = None, rows
        else:
            hidden_rows = torch.cat([
                torch.arange(n) if plain_decodes is None else plain_decodes,
                torch.tensor([step.last_row(i) for i in plain], dtype=torch.long),
            ])
            table_rows = torch.cat([
                rows if plain_decodes is None else rows[plain_decodes],
                torch.tensor([step.reqs[i].row for i in plain], dtype=torch.long),
            ])
        tokens = torch.empty(0, dtype=torch.long)
        if table_rows.numel():
            last = hidden if hidden_rows is None else hidden.index_select(
                0, hidden_rows.to(hidden.device))
            tokens = self.row_sampling.sample(self.model.logits(last), table_rows)
            self.table.last.index_copy_(0, table_rows.to(self.device), tokens.to(self.device))
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
            reqs = [self._by_row[int(rows[j])] for j in others]
            for j, token in zip(others, self._sample_rows(reqs, others, hidden, extra),
                                strict=True):
                merged[j] = token
            decoded = merged
        result.decode_tokens = int_array(decoded)
        self._sample_rows([step.reqs[i] for i in special], [step.last_row(i) for i in special],
                          hidden, [outs[i] for i in special])
        drafted = [i for i in picked if i in step.trees]
        paths = self._verify(drafted, entries, step, hidden, outs)
        for i in drafted:
            req = step.reqs[i]
            self.table.last[req.row] = outs[i].token_id
            accepted, kept = keep_path(self.pool, entries[i], paths[i])
            self.table.append(req.row, accepted, kept)
        if self.tp is not None:
            flat = list(decoded)
            for i in sampling:
                flat.append(outs[i].token_id if i not in step.void else -1)
                if entries[i].draft:
                    path = paths.get(i, [])
                    flat.extend(path + [-1] * (len(entries[i].draft) - len(path)))
            self.tp.broadcast_tokens(flat)

    def _start_sampling(self, req: _RequestState) -> None:
        """A plain request's first sample since its admission: its draws so far are its
        output so far (a retracted request's, readmitted), which its penalties count."""
        if not req.sampled:
            req.sampled = True
            row, n = req.row, req.spec.prompt_len
            drawn = int(self.table.lens[row]) - n
            if bool(self.row_sampling.penalised[row]):  # its tokens, from the device
                self.row_sampling.start(row, drawn, self.table.row_tokens(row, 0, n),
                                        self.table.row_tokens(row, n), self.device)
            else:
                self.row_sampling.start(row, drawn)

    def _sample_rows(
        self,
        reqs: list[_RequestState],
        hidden_rows: list[int],
        hidden: torch.Tensor,
        outs: list[EntryResult],
    ) -> list[int]:
        """Sample requests that are not plain one by one (penalties, bias, a grammar,
        logprobs): each from its own sampler, under its grammar's mask."""
        if not reqs:
            return []
        logits = self.model.logits(hidden[torch.tensor(hidden_rows, device=hidden.device)])
        samplers = [self._sampler(req) for req in reqs]
        wants = [req.spec.logprobs for req in reqs]
        top_n = [w.top_logprobs_num if w.return_logprob else 0 for w in wants]
        with_logprobs = any(w.return_logprob for w in wants)
        logits = _for_sampling(logits, samplers, with_logprobs)
        matchers = [self._matcher(req) for req in reqs]
        apply_masks(logits, matchers)
        sampled = sample(logits, samplers, top_n, with_logprobs=with_logprobs)
        tokens = sampled.token_ids
        for j, req in enumerate(reqs):
            token, out = tokens[j], outs[j]
            self.table.last[req.row] = out.token_id = token
            samplers[j].record(token)
            if wants[j].return_logprob:
                out.logprob = sampled.logprobs[j]
                out.top_logprobs = sampled.top_logprobs[j]
            self._advance_grammar(req, matchers[j], token, wants[j], out)
        return tokens

    def _verify(
        self,
        drafted: list[int],
        entries: list[StepEntry],
        step: _Step,
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
        reqs, trees = step.reqs, step.trees
        row_of: dict[tuple[int, int], int] = {}  # (entry, node; -1 the fed token) -> logits row
        rows: list[int] = []
        for i in drafted:
            row_of[i, -1] = len(rows)
            rows.append(step.last_row(i))
            for node, row in trees[i].items():
                row_of[i, node] = len(rows)
                rows.append(row)
        logits = self.model.logits(hidden[torch.tensor(rows, device=hidden.device)])
        samplers = {i: self._sampler(reqs[i]) for i in drafted}
        matchers = {i: self._matcher(reqs[i]) for i in drafted}
        wants = {i: reqs[i].spec.logprobs for i in drafted}
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
                forced = self._advance_grammar(reqs[i], matchers[i], token, wants[i], out)
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
                    out.forced_ids, reqs[i].jumped = [], False
                paths[i] += nodes
                at[i] = nodes[-1]
                still.append(i)
            walking = still
        for i in drafted:
            if reqs[i].plain:  # its draws and penalties are counted by its row
                self.row_sampling.drawn[reqs[i].row] = samplers[i].num_output
                self.row_sampling.record(reqs[i].row, [*outs[i].accepted_ids,
                                                       outs[i].token_id])
        return paths

    def _advance_grammar(
        self, req: _RequestState, matcher: Matcher | None, token: int, wants: LogprobRequest,
        out: EntryResult,
    ) -> bool:
        """Feed a sampled token to the request's grammar; True when the grammar forces
        tokens after it (jump-forward: out.forced_ids, recorded by its sampler)."""
        if matcher is None:
            return False
        if not matcher.accept(token):
            log.warning("request %s: token %d is outside its grammar", req.spec.rid, token)
            return False
        if wants.return_logprob:  # a forced token has no logprob to report
            return False
        out.forced_ids = self._grammars().forced_tokens(matcher, token)
        for forced in out.forced_ids:
            self._sampler(req).record(forced)
        req.jumped = bool(out.forced_ids)
        return req.jumped

    def _follow(
        self,
        tp: TensorParallel,
        step: _Step,
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
            token, entry, req = flat[at], entries[i], step.reqs[i]
            path = [k for k in flat[at + 1 : at + 1 + len(entry.draft)] if k >= 0]
            at += 1 + len(entry.draft)
            if token < 0:
                continue
            outs[i].token_id = token
            if entry.draft:
                outs[i].accepted_ids, kept = keep_path(self.pool, entry, path)
                self.table.append(req.row, outs[i].accepted_ids, kept)
            self.table.last[req.row] = token

    def rids(self, batch: StepBatch) -> list[str]:
        """The requests a step (just run) computed for: its packed decodes', its entries'."""
        by_row = self._by_row
        return [*(by_row[row].spec.rid for row in batch.decode_rows if row in by_row),
                *(e.rid for e in batch.entries)]

    def _is_sampler(self) -> bool:
        return self.tp is None or self.tp.is_leader

    def _compile_asked(self, batch: StepBatch, result: StepResult) -> None:
        """Start compiling the constraints the scheduler asks for; report those done (a step
        with nothing to compute waits up to 50 ms for one)."""
        if self.grammars is None:
            result.grammars_failed = [
                (c, "this worker has constrained decoding off (grammar_backend none)")
                for c in batch.grammars
            ]
            return
        for constraint in batch.grammars:
            self.grammars.ask(constraint)
        idle = not batch.entries and not batch.copies
        result.grammars_ready, result.grammars_failed = self.grammars.finished(
            0.05 if idle else 0.0
        )

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            raise ValueError("this worker was not given a vocabulary for constrained decoding")
        return self.grammars

    def _matcher(self, req: _RequestState) -> Matcher | None:
        """The request's grammar matcher, made at its first sample and brought up to date
        with any output it had before (a retracted request's)."""
        constraint = req.spec.params.grammar
        if constraint is None:
            return None
        if req.matcher is None:
            req.matcher = self._grammars().matcher(constraint)
            for token in self.table.row_tokens(req.row, req.spec.prompt_len):
                req.matcher.accept(token)
        # Ended (its stop token accepted): a step the scheduler ran ahead past the finish
        # samples freely; that token is dropped.
        return None if req.matcher.ended else req.matcher

    def _sampler(self, req: _RequestState) -> RequestSampler:
        """The request's sampler: kept for a request that is not plain; for a plain one,
        made at its count of draws (verifying drafts, which walks request by request)."""
        if req.sampler is None or req.plain:
            spec = req.spec
            sampler = RequestSampler(
                spec.params,
                self.table.row_tokens(req.row, 0, spec.prompt_len),
                self.config.vocab_size,
                seed=spec.seed,
                eos_token_ids=self.config.eos_token_ids,
            )
            if sampler.history is not None or not req.plain:
                for token in self.table.row_tokens(req.row, spec.prompt_len):
                    sampler.record(token)
            if req.plain:
                self._start_sampling(req)
                sampler.num_output = int(self.row_sampling.drawn[req.row])
                return sampler
            req.sampler = sampler
        return req.sampler

    def _input_logprobs(
        self, req: _RequestState, q_start: int, q_len: int, hidden: torch.Tensor,
        out: EntryResult,
    ) -> None:
        """Logprobs of the prompt tokens this chunk (q_len tokens from step row q_start)
        holds, from logprob_start_len on."""
        spec = req.spec
        start_len = spec.logprobs.logprob_start_len
        end = int(self.table.lens[req.row])
        first = end - q_len  # prompt position of the chunk's first token
        carry, req.carry_logprobs = req.carry_logprobs, None
        last_row = hidden[q_start + q_len - 1 : q_start + q_len]
        if start_len <= end < spec.prompt_len:
            req.carry_logprobs = torch.log_softmax(self.model.logits(last_row), dim=-1)[0]
        lo, hi = max(start_len, first), min(spec.prompt_len, end)
        if lo >= hi:
            return
        ids = self.table.row_tokens(req.row, 0, hi)
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


def _ints(packed: array[int]) -> torch.Tensor:
    """A packed int32 array as a host tensor (sharing its memory)."""
    if not packed:
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer(packed, dtype=torch.int32)


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


def load_runner(
    settings: RunnerSettings,
    tp_rank: int = 0,
    tp_size: int = 1,
    dist_init_addr: str | None = None,
    progress: bool = False,
    max_running_requests: int = 0,
) -> ModelRunner:
    """Load the model onto its device, joining the tensor-parallel group and keeping this
    rank's shards when tp_size > 1 (CUDA graphs up to the engine's `max_running_requests`
    unless the settings say; 0: not known here). Call it on the thread that will run every
    step: CUDA's current device and OpenMP's team are per thread."""
    where = resolve_device(settings.device, tp_rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    # Resolved once: the weights and the grammars' vocabulary come from the same snapshot.
    model_path = resolve_model_path(settings.model_path, settings.revision)
    loaded = load_model(str(model_path), progress=progress,
                        quantization=settings.quantization, device=where.type,
                        dtype=settings.dtype)
    tp: TensorParallel | None = None
    if tp_size > 1:
        if not dist_init_addr:
            raise ValueError("tp_size > 1 needs dist_init_addr (e.g. tcp://127.0.0.1:29500)")
        check_divisible(loaded.config, tp_size)
        tp = init_tensor_parallel(dist_init_addr, tp_rank, tp_size, where)
        shard_weights(loaded.config, loaded.weights, tp_rank, tp_size)
    runner = ModelRunner(
        loaded.config,
        loaded.weights,
        DTYPES[settings.dtype],
        settings.num_slots,
        attention=settings.attention_backend,
        tp=tp,
        device=where,
        page_size=settings.page_size,
        cuda_graph_max_bs=settings.graph_batch_limit(max_running_requests),
    )
    runner.quantization = loaded.quantization
    runner.model_path = model_path
    stop_ids = loaded.config.eos_token_ids
    del loaded
    release_free_memory()
    if settings.grammar_backend != "none":
        runner.grammars = Grammars(
            lambda: _vocabulary(str(model_path), runner.config.vocab_size, stop_ids),
            backend=settings.grammar_backend,
            jump_forward=not settings.disable_jump_forward,
        )
    return runner


def _vocabulary(model_path: str | None, vocab_size: int, stop_ids: Sequence[int]) -> Vocabulary:
    tokenizer = Tokenizer.from_path(model_path)
    return Vocabulary(
        tokenizer, vocab_size, tuple(dict.fromkeys([*stop_ids, *tokenizer.eos_token_ids]))
    )
