"""The scheduler's view of one request: token ids, KV slots and progress, never text."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixmesh.core.finish import FinishReason
from radixmesh.core.request import GenerationRequest
from radixmesh.core.sampling_params import LogprobRequest, SamplingParams

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
    namespace: str | None = None
    priority: int = 0
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
            namespace=request.cache_salt,
            priority=request.priority,
            logprobs=request.logprobs,
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
