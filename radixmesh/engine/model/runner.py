"""The model runner: executes one StepBatch against the model and the KV pool."""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixmesh.core.model_files import resolve_model_path
from radixmesh.core.settings import KVSettings, LoraSettings, RunnerSettings
from radixmesh.core.step import EntryResult, StepBatch, StepResult
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    SeqSpan,
    padded_rows,
)
from radixmesh.engine.model.attention_choice import check_runs_on, make_attention
from radixmesh.engine.model.device import current, resolve_device, upload
from radixmesh.engine.model.draft_tree import draft_rows, grammar_allows
from radixmesh.engine.model.grammar_mask import Grammars, Vocabulary
from radixmesh.engine.model.host_copies import HostCopier
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.launch import PendingStep
from radixmesh.engine.model.lora import (
    LoraBatch,
    LoraError,
    LoraPool,
    load_adapter,
    lora_pool,
    rank_share,
)
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
from radixmesh.engine.model.pool_size import size_pool
from radixmesh.engine.model.req_table import ReqTable
from radixmesh.engine.model.row_sampling import is_plain
from radixmesh.engine.model.state_pool import StatePool
from radixmesh.engine.model.step_sampler import RequestState, StepLayout, StepSampler, TokenRead
from radixmesh.engine.model.torch_attention import TorchAttention

if TYPE_CHECKING:
    from radixmesh.engine.model.cuda_graphs import DecodeGraphs

log = logging.getLogger("radixmesh.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelRunner:
    """Owns the weights, the KV pool and each request's sampling state, on `device`.

    Under tensor parallelism `weights` hold this rank's shards (parallel.shard_weights)
    and the pool only this rank's KV heads; rank 0 samples and the others take its tokens.
    `attention` is a backend or its name (see attention_choice.make_attention). The KV pool
    holds `num_slots` tokens, or as many as the settings say (pool_size.size_pool).

    With the Triton backend on CUDA, decode-only steps of up to `cuda_graph_max_bs`
    requests replay CUDA graphs (cuda_graphs.DecodeGraphs; 0: never; never for a
    mixture-of-experts model). `eager_graphs` runs that padded path eagerly instead, on any
    device: how it is tested without a GPU.

    A step's KVCopy list moves KV between the pool and the engine's host pool
    (host_copies.HostCopier): loads before the forward, backups started after it. A hybrid
    model's linear layers keep each request's state in `states` (state_pool.py)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        num_slots: int | KVSettings,
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
                                config.layer_windows, config.attn_logit_softcap,
                                config.mla.kv_lora_rank if config.mla else 0)
        )
        check_runs_on(self.attention, self.device)
        with current(self.device):
            self.model = CausalLM(shard, weights, dtype, tp, self.device)
            size = size_pool(num_slots, shard, dtype, self.device, tp)
            key_dim, value_dim = shard.kv_cache_dims
            self.pool = KVPool(shard.num_kv_layers, size.tokens, shard.num_kv_heads,
                               key_dim, dtype, self.device, value_dim)
            self.states = StatePool(shard, size.state_slots, dtype, device, size.snapshot_slots)
            self.graphs = self._decode_graphs(cuda_graph_max_bs, eager_graphs, size.tokens)
            rank = 0 if tp is None else tp.rank
            self.host_copies = HostCopier(self.pool, config.num_kv_heads, rank)
        self.graph_steps = 0  # steps that ran through self.graphs
        self.requests: dict[str, RequestState] = {}
        self._by_row: dict[int, RequestState] = {}
        # Each request's slots and tokens by position, and its last token, on the device.
        self.table = ReqTable(self.device)
        self.sampler = StepSampler(self.model, self.pool, self.table, config, tp, self.device,
                                   self._by_row)
        self.lora: LoraPool | None = None  # LoRA adapters (load_runner attaches them)
        # How load_runner loaded the weights (see DeviceSettings.quantization), and from
        # where (a hub repo resolved to its snapshot).
        self.quantization = "bf16"
        self.model_path: Path | None = None

    @property
    def grammars(self) -> Grammars | None:
        """Constrained decoding; load_runner gives the model's vocabulary to compile against."""
        return self.sampler.grammars

    @grammars.setter
    def grammars(self, grammars: Grammars | None) -> None:
        self.sampler.grammars = grammars

    def _decode_graphs(self, max_batch: int, eager: bool, num_slots: int) -> DecodeGraphs | None:
        # A sparse MLP reads how many tokens each expert got back on the host: no graph can
        # hold that; nor a linear-attention layer's steps, which read their rows' states.
        if (max_batch == 0 or isinstance(self.attention, TorchAttention) or self.config.is_moe
                or self.config.is_hybrid):
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

    def forward(self, batch: StepBatch) -> StepResult:
        """Run one step and read its result."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> PendingStep:
        """Run one step: forget released requests, admit new ones, load KV from the host
        pool, compute, sample, start backups to the host pool. A step of plain decodes
        alone comes back before its tokens are read (on a GPU, before its work is done):
        launching the next one first keeps the device busy while the host waits."""
        began = time.perf_counter()
        if batch.step == 1:  # a scheduler (re)started: what the one before sent is gone
            self.requests.clear()
            self._by_row.clear()
            self.states.reset()
            if self.lora is not None:
                self.lora.reset()
        self.states.save_before(batch.saves)
        for rid in batch.release:
            gone = self.requests.pop(rid, None)
            if gone is not None and self._by_row.get(gone.row) is gone:
                del self._by_row[gone.row]
                self.states.release(gone.row)
            if gone is not None and gone.spec.lora and self.lora is not None:
                self.lora.release(int(self.table.lora[gone.row]))
        for spec in batch.new_requests:
            state = RequestState(spec, is_plain(spec.params) and not spec.logprobs.return_logprob)
            with current(self.device):
                self.table.admit(spec.row, spec.prefix_ids, spec.prefix_slots,
                                 self._lora_slot(spec.lora))
                self.states.admit(spec.row, len(spec.prefix_slots), spec.snapshot)
            self.sampler.row_sampling.set(spec.row, spec.params, spec.seed, state.plain)
            self.requests[spec.rid] = self._by_row[spec.row] = state
        result = StepResult(batch.step)
        if self._is_sampler():
            self._compile_asked(batch, result)
        with current(self.device):
            if batch.host_pool is not None:
                self.host_copies.map(batch.host_pool)
            self.host_copies.load([c for c in batch.copies if not c.to_host])
            read = self._run(batch, result) if batch.num_requests else None
            self.host_copies.start_backups([c for c in batch.copies if c.to_host])
        result.copies_done = self.host_copies.finished()
        result.forward_ms = (time.perf_counter() - began) * 1e3
        return PendingStep(result, read)

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` from the next step on."""
        if self.lora is None:
            raise LoraError("this engine was started without enable_lora")
        self.lora.add(rank_share(load_adapter(name, path, self.config), self.tp))

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (requests running with it finish with it)."""
        if self.lora is None:
            raise LoraError("this engine was started without enable_lora")
        self.lora.remove(name)

    def _lora_slot(self, name: str) -> int:
        """The slot holding adapter `name` for one more request (-1: no adapter)."""
        if not name:
            return -1
        if self.lora is None:
            raise ValueError(f"LoRA adapter {name!r} asked of a worker that serves none")
        return self.lora.acquire(name)

    def attach_lora(self, pool: LoraPool) -> None:
        """Serve the LoRA adapters of `pool` (its decode graphs too)."""
        self.lora = pool
        if self.graphs is not None:
            self.graphs.attach_lora(pool)

    def _lora_slots(self, rows: torch.Tensor, entry_tokens: list[tuple[int, int]]
                    ) -> torch.Tensor | None:
        """Each of the step's tokens' adapter slot (-1: none), from its row: the decodes'
        `rows`, then each entry's (row, tokens) in order; None when no token has one."""
        if self.lora is None or not self.lora.in_use():
            return None
        slots = self.table.lora
        entry_rows = torch.tensor([r for r, _ in entry_tokens], dtype=torch.long)
        counts = torch.tensor([n for _, n in entry_tokens], dtype=torch.long)
        token_slots = torch.cat([slots[rows], slots[entry_rows].repeat_interleave(counts)])
        return token_slots if bool((token_slots >= 0).any()) else None

    def _run(self, batch: StepBatch, result: StepResult) -> TokenRead | None:
        table = self.table
        decode_rows = _ints(batch.decode_rows).long()
        step = StepLayout(decode_rows, [], [], [], {}, set())
        ids: list[int] = []  # the entries' fed tokens; -1: the row's last sampled token
        positions: list[int] = []
        slots: list[int] = []
        nodes: list[SeqSpan] = []  # draft nodes: each a sequence of its own
        feeds_last: list[tuple[int, int]] = []  # (index in ids, table row) of each -1
        entry_tokens: list[tuple[int, int]] = []  # each entry's row and tokens in the step
        first = step.num_decodes
        for i, entry in enumerate(batch.entries):
            state = self.requests[entry.rid]
            before = len(ids)
            if state.jumped and not entry.input_ids and entry.sample:
                step.void.add(i)
            state.jumped = False
            new_ids = entry.input_ids or [-1]
            fed = entry.slots[: len(new_ids)] if entry.draft else entry.slots
            if not entry.input_ids:
                feeds_last.append((len(ids), state.row))
            fed_ids = new_ids if entry.input_ids else table.last[state.row : state.row + 1]
            start = table.append(state.row, fed_ids, fed)
            step.states.append(state)
            step.q_starts.append(first + len(ids))
            step.q_lens.append(len(new_ids))
            ids.extend(new_ids)
            positions.extend(range(start, start + len(new_ids)))
            slots.extend(fed)
            if entry.draft:
                # Rank 0 alone holds the grammar: under TP every rank computes every node.
                matcher = self.sampler.matcher(state) if self.tp is None else None
                keep = grammar_allows(entry, matcher)
                step.trees[i] = draft_rows(entry, keep, table.row_slots(state.row).long(), ids,
                                           positions, slots, nodes, first)
            entry_tokens.append((state.row, len(ids) - before))
        input_ids, input_positions, meta = self._inputs(step, ids, feeds_last, positions, slots,
                                                        nodes, _ints(batch.decode_slots))
        lora_slots = self._lora_slots(decode_rows, entry_tokens)
        if self.graphs is not None and self.graphs.fits(meta):
            hidden = self.graphs.run(input_ids, input_positions, meta, lora_slots)
            self.graph_steps += 1
        else:
            self.attention.prepare(meta)
            lora = None if lora_slots is None or self.lora is None else LoraBatch(self.lora,
                                                                                  lora_slots)
            states = self.states.step(step, batch.saves)
            hidden = self.model.forward(input_ids, input_positions, self.attention, self.pool,
                                        lora, states)
        outs = result.results = [EntryResult(e.rid) for e in batch.entries]
        # Every rank broadcasts a token per plain decode and per sampling entry, void ones
        # included (as -1), and after a draft's token the accepted path (see _follow).
        pooled = [i for i, state in enumerate(step.states) if state.spec.pooling]
        sampling = [i for i, e in enumerate(batch.entries)
                    if e.sample and not step.states[i].spec.pooling]
        if self.tp is not None and not self.tp.is_leader:
            self.sampler.follow(self.tp, step, sampling, batch.entries, outs, result)
            return None
        for i in pooled:
            _pool(step.states[i], hidden[step.q_starts[i] : step.q_starts[i] + step.q_lens[i]],
                  batch.entries[i].sample, outs[i], self.model.logits)
        for i, out in enumerate(outs):
            state = step.states[i]
            if state.spec.logprobs.return_logprob and state.spec.logprobs.logprob_start_len >= 0:
                self.sampler.input_logprobs(state, step.q_starts[i], step.q_lens[i], hidden, out)
        return self.sampler.sample(step, sampling, batch.entries, hidden, outs, result)

    def _inputs(
        self, step: StepLayout, ids: list[int], feeds_last: list[tuple[int, int]],
        positions: list[int], slots: list[int], nodes: list[SeqSpan], decode_slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's token ids, positions and attention metadata: the plain decodes' by
        tensor ops over the table, the entries' and draft nodes' from their lists."""
        table, device = self.table, self.device
        rows = step.decode_rows
        decode_positions = table.decode_positions(rows) if rows.numel() else rows.new_empty(0)
        decode_lens = decode_positions + 1
        # The decodes' rows, slots, positions and lengths go to the device in one copy.
        rows_at, slots_at, positions_at, lens_at = upload(
            torch.stack([rows, decode_slots.long(), decode_positions, decode_lens]), device
        ).unbind(0)
        step.device_rows = rows_at
        if rows.numel():
            table.write_decodes(rows_at, positions_at, slots_at)
        if not step.states:  # plain decodes only: a handful of tensor ops whatever the batch
            index = table.index(rows_at, int(decode_lens.max()))
            meta = AttentionMetadata.decodes(slots_at, decode_lens, index, lens_at)
            return table.last.index_select(0, rows_at), positions_at, meta
        entry_rows = torch.tensor([r.row for r in step.states], dtype=torch.long)
        seq_rows = torch.cat([rows, entry_rows])
        entry_ids = torch.tensor(ids, dtype=torch.long, device=device)
        if feeds_last:  # entries that feed their last sampled token
            at, owners = zip(*feeds_last, strict=True)
            entry_ids[torch.tensor(at, device=device)] = table.last[torch.tensor(owners,
                                                                                 device=device)]
        input_ids = torch.cat([table.last.index_select(0, rows_at), entry_ids])
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

def _ints(packed: array[int]) -> torch.Tensor:
    """A packed int32 array as a host tensor (sharing its memory)."""
    if not packed:
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer(packed, dtype=torch.int32)


def load_runner(
    settings: RunnerSettings,
    tp_rank: int = 0,
    tp_size: int = 1,
    dist_init_addr: str | None = None,
    progress: bool = False,
    max_running_requests: int = 0,
    lora: LoraSettings | None = None,
) -> ModelRunner:
    """Load the model onto its device, joining the tensor-parallel group and keeping this
    rank's shards when tp_size > 1 (CUDA graphs up to the engine's `max_running_requests`
    unless the settings say; 0: not known here), with the LoRA adapters `lora` enables.
    Call it on the thread that will run every step: CUDA's current device and OpenMP's
    team are per thread."""
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
        settings,
        attention=settings.attention_backend,
        tp=tp,
        device=where,
        page_size=settings.page_size,
        cuda_graph_max_bs=settings.graph_batch_limit(max_running_requests),
    )
    if lora is not None and lora.enable_lora:
        runner.attach_lora(lora_pool(lora, loaded.config, DTYPES[settings.dtype], where, tp))
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


def _pool(state: RequestState, rows: torch.Tensor, last_chunk: bool, out: EntryResult,
          logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """An embedding request's prompt chunk: its final hidden states `rows` folded into the
    pooled vector; after the last chunk, that vector is the request's result (mean and CLS
    pooling compute the prompt from its first token: schedule_policy.match_key). A scoring
    request's result is its score_ids' logits at the last position."""
    kind = state.spec.pooling
    if kind == "score":
        if last_chunk:
            ids = torch.tensor(state.spec.score_ids, device=rows.device)
            out.embedding = logits(rows[-1:])[0].index_select(0, ids).tolist()
        return
    rows = rows.float()
    if kind == "mean":
        total = rows.sum(0)
        state.pooled = total if state.pooled is None else state.pooled + total
    elif kind == "cls" and state.pooled is None:
        state.pooled = rows[0]
    if last_chunk:
        assert kind == "last" or state.pooled is not None
        vector = rows[-1] if kind == "last" else state.pooled
        out.embedding = (vector / state.spec.prompt_len if kind == "mean" else vector).tolist()


def _vocabulary(model_path: str | None, vocab_size: int, stop_ids: Sequence[int]) -> Vocabulary:
    tokenizer = Tokenizer.from_path(model_path)
    return Vocabulary(
        tokenizer, vocab_size, tuple(dict.fromkeys([*stop_ids, *tokenizer.eos_token_ids]))
    )
