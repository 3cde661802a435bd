"""One model step as the scheduler hands it to the model runner, and what comes back.

The scheduler sends only what changed since the last step: requests the runner has not
seen, the new tokens of each request in the step with their KV slots, and the requests to
forget. Plain decodes (the bulk of a busy step) travel as packed arrays of table rows and
slots, and their tokens come back as one array: no object per request. In-process these
objects pass by direct call; in the mesh they travel as worker.proto's StepBatch /
StepResult, converted once at each end."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from radixmesh.core.hicache import HostPoolSpec
from radixmesh.core.sampling_params import LogprobRequest, SamplingParams

# A token's top alternatives: (token id, logprob), most likely first.
TopLogprobs = list[tuple[int, float]]
# An output constraint: (kind, text), as SamplingParams.grammar gives it.
Constraint = tuple[str, str]


@dataclass(slots=True)
class NewRequest:
    """A request the runner has not seen yet, or sees again after it was retracted."""

    rid: str
    # Its row of the runner's request table (ReqTable) until it is released; the
    # scheduler hands rows out and takes them back.
    row: int
    # Tokens whose KV is already in the pool (a cached prefix) and their slots.
    prefix_ids: list[int]
    prefix_slots: list[int]
    # How many of the request's tokens are prompt; the rest are its earlier output.
    prompt_len: int
    params: SamplingParams
    seed: int
    logprobs: LogprobRequest = field(default_factory=LogprobRequest)
    lora: str = ""  # the LoRA adapter it runs with; empty: the base model
    # Embedding: how its prompt's final hidden states are pooled (core.pooling's kinds),
    # returned instead of a sampled token; empty: generation.
    pooling: str = ""
    score_ids: list[int] = field(default_factory=list)  # pooling "score": these logits
    # A hybrid linear-attention model: the snapshot slot its linear layers' state after
    # prefix_ids starts from (StateSave put it there); -1: a zero state (no prefix).
    snapshot: int = -1


@dataclass(slots=True)
class StateSave:
    """A hybrid linear-attention model: copy the linear layers' state of request-table row
    `row` into snapshot slot `slot` once the row has fed `after` of this step's tokens
    (after 0: the state the row has when the step starts, before the step releases
    anyone, as a request that finished or was retracted leaves it)."""

    row: int
    after: int
    slot: int


@dataclass(slots=True)
class StepEntry:
    """One request's part of a step."""

    rid: str
    # Tokens whose KV this step computes. Empty for a decode: the runner feeds the token
    # it sampled last for this request (so the scheduler can run a step ahead). After a
    # jump-forward, the sampled and forced tokens the scheduler knows to be still unfed.
    input_ids: list[int]
    slots: list[int]  # one KV slot per new token (one for a decode)
    sample: bool  # sample the next token after this entry (false for a non-final chunk)
    # Speculative decoding: a tree of guesses at the tokens after the fed one, verified in
    # this step. draft[i]'s parent is draft[draft_parents[i]], or the fed token where it is
    # -1 (parents come first). The entry then has one slot per fed and draft token, for
    # the positions that follow in order; the accepted path's KV ends up in the first ones.
    draft: list[int] = field(default_factory=list)
    draft_parents: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVCopy:
    """Copy tokens' KV between the device pool and the host pool, slot i to slot i.

    A load (to_host False) completes before the step's forward, so the step's attention
    reads it. A backup (to_host True) starts after the step's forward (the step may compute
    what it copies) and runs beside the next steps; a later result reports it done."""

    copy_id: int
    to_host: bool
    device_slots: list[int]
    host_slots: list[int]


def kv_key(tokens: list[int], start: int, namespace: str | None) -> str:
    """Names the KV of tokens[start:] after tokens[:start] (KV depends on the whole prefix)
    in a namespace: a decode engine accepts a prefill engine's KV only under the key it
    expects."""
    digest = hashlib.blake2b(array("i", tokens).tobytes(), digest_size=12)
    digest.update(f"{start}:{namespace or ''}".encode())
    return digest.hexdigest()


@dataclass(slots=True)
class KVSend:
    """Prefill/decode disaggregation, on the prefill side: send a request's prompt KV to the
    decode engine's worker ranks. It starts after the step's forward (which may compute what
    it sends); a later result reports it in sends_done."""

    rid: str
    slots: list[int]  # this engine's slots of the tokens sent, in order
    dest_slots: list[int]  # the decode engine's slots for them
    dest_workers: list[str]  # the decode engine's worker ranks (host:port), rank 0 first
    key: str  # kv_key of the tokens
    backend: str  # "grpc" or "shm"
    dest_rid: str  # the request's id on the decode engine


@dataclass(slots=True)
class KVExpect:
    """On the decode side: accept a prefill engine's KV for these slots, under this key,
    until the request is released."""

    rid: str
    slots: list[int]
    key: str


@dataclass(slots=True)
class SendOutcome:
    """How a KVSend ended: every byte arrived (no error), or why not."""

    rid: str
    error: str = ""
    bytes: int = 0
    ms: float = 0.0


def int_array(values: Iterable[int] = ()) -> array[int]:
    """A packed array of 32-bit ints (token ids, slots, table rows)."""
    return array("i", values)


@dataclass(slots=True)
class StepBatch:
    """Everything the runner needs for one step; steps count 1, 2, 3...

    The step's sequences are its plain decodes, then its entries. A plain decode feeds the
    token its request sampled last, into one new KV slot, and samples greedily or from the
    request's own parameters (no grammar, logprobs or draft: those come as entries)."""

    step: int
    new_requests: list[NewRequest] = field(default_factory=list)
    entries: list[StepEntry] = field(default_factory=list)
    release: list[str] = field(default_factory=list)  # forget these before the step
    copies: list[KVCopy] = field(default_factory=list)
    # A host pool to map from this step on (the first step with the host tier, or a new
    # segment after cachectl restarted); None: keep the one mapped.
    host_pool: HostPoolSpec | None = None
    # Constraints to compile before the requests that carry them are admitted (each sent
    # once); a step without entries waits a little for one to finish.
    grammars: list[Constraint] = field(default_factory=list)
    sends: list[KVSend] = field(default_factory=list)
    expects: list[KVExpect] = field(default_factory=list)
    decode_rows: array[int] = field(default_factory=int_array)  # request-table rows
    decode_slots: array[int] = field(default_factory=int_array)  # one new KV slot each
    saves: list[StateSave] = field(default_factory=list)  # state snapshots to take

    @property
    def num_requests(self) -> int:
        """Requests that compute in this step."""
        return len(self.decode_rows) + len(self.entries)

    @property
    def num_tokens(self) -> int:
        """KV slots this step writes (a decode's one, every draft node's too)."""
        return len(self.decode_slots) + sum(len(e.slots) for e in self.entries)


@dataclass(slots=True)
class EntryResult:
    """What one entry produced: a sampled token and, when asked, logprobs."""

    rid: str
    token_id: int = -1  # -1: the entry did not sample
    logprob: float = 0.0
    top_logprobs: TopLogprobs = field(default_factory=list)
    # Logprobs of the prompt tokens this entry computed, from prompt position
    # input_logprobs_start on (NaN for position 0, which nothing predicts).
    input_logprobs_start: int = 0
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Jump-forward: tokens the grammar forces after token_id (output too, KV not computed).
    forced_ids: list[int] = field(default_factory=list)
    # Speculative decoding: the draft tokens the model accepted, in order; they come
    # before token_id in the output and their KV is computed (the entry's first slots after
    # the fed token's). With their logprobs when asked.
    accepted_ids: list[int] = field(default_factory=list)
    accepted_logprobs: list[float] = field(default_factory=list)
    accepted_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Embedding: the prompt's pooled final hidden state (float32), after its last chunk.
    embedding: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """One EntryResult per entry of the step, in the same order, and each plain decode's
    token in decode_tokens."""

    step: int
    results: list[EntryResult] = field(default_factory=list)
    forward_ms: float = 0.0
    copies_done: list[int] = field(default_factory=list)  # backups finished since the last result
    # Constraints compiled since the last result, and those that failed with their error.
    grammars_ready: list[Constraint] = field(default_factory=list)
    grammars_failed: list[tuple[Constraint, str]] = field(default_factory=list)
    sends_done: list[SendOutcome] = field(default_factory=list)
    decode_tokens: array[int] = field(default_factory=int_array)
