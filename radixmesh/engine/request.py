"""The scheduler's view of one request: token ids, KV slots and progress, never text."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.request import GenerationRequest, cache_namespace
from radixmesh.core.sampling_params import LogprobRequest, SamplingParams
from radixmesh.core.step import NewRequest

if TYPE_CHECKING:
    from radixmesh.engine.disaggregation import Handoff, Transfer
    from radixmesh.engine.storage_tier import PrefetchOutcome

_arrivals = itertools.count()


@dataclass(eq=False)
class Req:
    """A tokenized request as the scheduler tracks it."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    namespace: str | None = None  # radix tree (cache_salt, and its LoRA adapter's name)
    priority: int = 0
    lora: str = ""  # the LoRA adapter it runs with; empty: the base model
    # Embedding: its prompt pooled by this kind (core.pooling) instead of generated from,
    # and the pooled vector once computed.
    pooling: str = ""
    score_ids: list[int] = field(default_factory=list)  # pooling "score": these logits
    embedding: list[float] | None = None
    logprobs: LogprobRequest = field(default_factory=LogprobRequest)
    arrival: int = field(default_factory=lambda: next(_arrivals))
    output_ids: list[int] = field(default_factory=list)
    # KV slots of tokens [0, len(slots)): the first cached_len belong to the radix tree
    # (which the scheduler keeps locked for it), the rest to this request, whose last page
    # may be partial.
    slots: list[int] = field(default_factory=list)
    cached_len: int = 0
    # Slots this request computed for tokens another request cached first; freed with it.
    orphans: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prefix hit when first admitted, reported to the client
    cached_host_tokens: int = 0  # the part of cached_tokens loaded back from the host tier
    cached_storage_tokens: int = 0  # the part of cached_tokens fetched from storage
    storage_tokens: int = 0  # tokens storage added to the tree for it (StorageTier)
    prefetch: PrefetchOutcome | None = None  # how its wait for storage ended, if it waited
    admitted: bool = False
    on_worker: bool = False  # the worker holds state for it
    row: int = -1  # its row of the worker's request table while on the worker
    pending: int = 0  # sampling steps scheduled whose result has not come back
    jumped: bool = False  # output has jump-forward tokens the next decode must feed
    spec_verify_ct: int = 0  # steps that verified a draft of it
    spec_accepted_tokens: int = 0  # draft tokens those steps accepted
    # Disaggregation: where this prefill engine sends its prompt's KV, or (on a decode
    # engine) the prefill engine its prompt's KV comes from.
    handoff: Handoff | None = None
    transfer: Transfer | None = None
    finish: FinishReason | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @classmethod
    def from_request(cls, request: GenerationRequest, seed: int) -> Req:
        """The engine's request for a front door's checked one, sampling from `seed`."""
        return cls(
            rid=request.rid,
            input_ids=request.input_ids,
            params=request.params,
            seed=seed,
            namespace=cache_namespace(request.cache_salt, request.lora_path),
            priority=request.priority,
            logprobs=request.logprobs,
            lora=request.lora_path or "",
            pooling=request.pooling,
            score_ids=list(request.score_ids),
        )

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by the output so far."""
        return self.input_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Length of prompt + output so far."""
        return len(self.input_ids) + len(self.output_ids)

    def remaining_new_tokens(self) -> int:
        """Tokens it may still generate, counting steps already in flight."""
        return self.params.max_new_tokens - len(self.output_ids) - self.pending

    def new_request(self, prefix: int, snapshot: int = -1) -> NewRequest:
        """What the model runner learns of it on (re)admission, its first `prefix` tokens
        cached (and a hybrid model's state after them in snapshot slot `snapshot`)."""
        logprobs = self.logprobs
        if self.admitted:  # readmitted: it already has its prompt logprobs
            logprobs = dataclasses.replace(logprobs, logprob_start_len=-1)
        return NewRequest(
            self.rid,
            self.row,
            self.tokens[:prefix],
            self.slots[:prefix],
            len(self.input_ids),
            self.params,
            self.seed,
            logprobs,
            self.lora,
            self.pooling,
            self.score_ids,
            snapshot,
        )

    @cached_property
    def constrained(self) -> bool:
        """Whether a grammar holds its output."""
        return self.params.grammar is not None

    @cached_property
    def packs(self) -> bool:
        """Whether its decodes travel packed (StepBatch.decode_rows): the runner samples
        them without a grammar's mask or logprobs to report."""
        return not self.constrained and not self.logprobs.return_logprob

    def stop_reason(
        self, token: int, eos_token_ids: tuple[int, ...], context_length: int
    ) -> FinishReason | None:
        """Why the output token just appended ends it, if it does."""
        p = self.params
        if self.constrained and token in eos_token_ids:
            # The grammar allowed its stop token: the constrained answer is complete.
            return FinishReason(FinishKind.STOP, token)
        stops = token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids)
        if stops and len(self.output_ids) > p.min_new_tokens:
            return FinishReason(FinishKind.STOP, token)
        if len(self.output_ids) >= p.max_new_tokens:
            return FinishReason(FinishKind.LENGTH, p.max_new_tokens)
        if self.num_tokens >= context_length:
            return FinishReason(FinishKind.LENGTH, len(self.output_ids))
        return None
