from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("num_slots", "vocab_size", "max_position_embeddings", "eos_token_ids", "model_path", "dtype", "tp_rank", "tp_size", "num_layers", "num_kv_heads", "head_dim", "quantization", "architecture", "num_experts", "num_experts_per_tok", "host_id", "lora_names", "max_loras_per_batch", "hidden_size", "pinned_loras", "state_snapshots")
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    PINNED_LORAS_FIELD_NUMBER: _ClassVar[int]
    STATE_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    num_slots: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_path: str
    dtype: str
    tp_rank: int
    tp_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quantization: str
    architecture: str
    num_experts: int
    num_experts_per_tok: int
    host_id: str
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    max_loras_per_batch: int
    hidden_size: int
    pinned_loras: _containers.RepeatedScalarFieldContainer[str]
    state_snapshots: int
    def __init__(self, num_slots: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_path: _Optional[str] = ..., dtype: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., quantization: _Optional[str] = ..., architecture: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ..., host_id: _Optional[str] = ..., lora_names: _Optional[_Iterable[str]] = ..., max_loras_per_batch: _Optional[int] = ..., hidden_size: _Optional[int] = ..., pinned_loras: _Optional[_Iterable[str]] = ..., state_snapshots: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "stop_token_ids", "seed", "ignore_eos", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "max_new_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    min_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    json_schema: str
    regex: str
    ebnf: str
    structural_tag: str
    logit_bias: _containers.ScalarMap[int, float]
    max_new_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., structural_tag: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("rid", "row", "prefix_ids", "prefix_slots", "prompt_len", "sampling", "top_logprobs_num", "return_logprob", "logprob_start_len", "lora", "pooling", "score_ids", "snapshot")
    RID_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    rid: str
    row: int
    prefix_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_slots: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    sampling: SamplingParams
    top_logprobs_num: int
    return_logprob: bool
    logprob_start_len: int
    lora: str
    pooling: str
    score_ids: _containers.RepeatedScalarFieldContainer[int]
    snapshot: int
    def __init__(self, rid: _Optional[str] = ..., row: _Optional[int] = ..., prefix_ids: _Optional[_Iterable[int]] = ..., prefix_slots: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., top_logprobs_num: _Optional[int] = ..., return_logprob: _Optional[bool] = ..., logprob_start_len: _Optional[int] = ..., lora: _Optional[str] = ..., pooling: _Optional[str] = ..., score_ids: _Optional[_Iterable[int]] = ..., snapshot: _Optional[int] = ...) -> None: ...

class StateSave(_message.Message):
    __slots__ = ("row", "after", "slot")
    ROW_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    row: int
    after: int
    slot: int
    def __init__(self, row: _Optional[int] = ..., after: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class StepEntry(_message.Message):
    __slots__ = ("rid", "input_ids", "slots", "sample", "draft", "draft_parents")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    draft: _containers.RepeatedScalarFieldContainer[int]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., draft: _Optional[_Iterable[int]] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class KVCopy(_message.Message):
    __slots__ = ("copy_id", "to_host", "device_slots", "host_slots")
    COPY_ID_FIELD_NUMBER: _ClassVar[int]
    TO_HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    copy_id: int
    to_host: bool
    device_slots: _containers.RepeatedScalarFieldContainer[int]
    host_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, copy_id: _Optional[int] = ..., to_host: _Optional[bool] = ..., device_slots: _Optional[_Iterable[int]] = ..., host_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class HostPool(_message.Message):
    __slots__ = ("name", "path", "num_slots", "layout", "num_layers", "num_kv_heads", "head_dim", "dtype", "page_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    num_slots: int
    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., num_slots: _Optional[int] = ..., layout: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("step", "new_requests", "entries", "release", "copies", "host_pool", "grammars", "sends", "expects", "decode_rows", "decode_slots", "traceparent", "saves")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_FIELD_NUMBER: _ClassVar[int]
    SENDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ROWS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    SAVES_FIELD_NUMBER: _ClassVar[int]
    step: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    entries: _containers.RepeatedCompositeFieldContainer[StepEntry]
    release: _containers.RepeatedScalarFieldContainer[str]
    copies: _containers.RepeatedCompositeFieldContainer[KVCopy]
    host_pool: HostPool
    grammars: _containers.RepeatedCompositeFieldContainer[Constraint]
    sends: _containers.RepeatedCompositeFieldContainer[KVSend]
    expects: _containers.RepeatedCompositeFieldContainer[KVExpect]
    decode_rows: bytes
    decode_slots: bytes
    traceparent: str
    saves: _containers.RepeatedCompositeFieldContainer[StateSave]
    def __init__(self, step: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., entries: _Optional[_Iterable[_Union[StepEntry, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ..., copies: _Optional[_Iterable[_Union[KVCopy, _Mapping]]] = ..., host_pool: _Optional[_Union[HostPool, _Mapping]] = ..., grammars: _Optional[_Iterable[_Union[Constraint, _Mapping]]] = ..., sends: _Optional[_Iterable[_Union[KVSend, _Mapping]]] = ..., expects: _Optional[_Iterable[_Union[KVExpect, _Mapping]]] = ..., decode_rows: _Optional[bytes] = ..., decode_slots: _Optional[bytes] = ..., traceparent: _Optional[str] = ..., saves: _Optional[_Iterable[_Union[StateSave, _Mapping]]] = ...) -> None: ...

class KVSend(_message.Message):
    __slots__ = ("rid", "slots", "dest_slots", "dest_workers", "key", "backend", "dest_rid")
    RID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEST_WORKERS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEST_RID_FIELD_NUMBER: _ClassVar[int]
    rid: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    dest_slots: _containers.RepeatedScalarFieldContainer[int]
    dest_workers: _containers.RepeatedScalarFieldContainer[str]
    key: str
    backend: str
    dest_rid: str
    def __init__(self, rid: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., dest_slots: _Optional[_Iterable[int]] = ..., dest_workers: _Optional[_Iterable[str]] = ..., key: _Optional[str] = ..., backend: _Optional[str] = ..., dest_rid: _Optional[str] = ...) -> None: ...

class KVExpect(_message.Message):
    __slots__ = ("rid", "slots", "key")
    RID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    rid: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    key: str
    def __init__(self, rid: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., key: _Optional[str] = ...) -> None: ...

class SendOutcome(_message.Message):
    __slots__ = ("rid", "error", "bytes", "ms")
    RID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    error: str
    bytes: int
    ms: float
    def __init__(self, rid: _Optional[str] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class KVPages(_message.Message):
    __slots__ = ("rid", "key", "slots", "head_start", "head_end", "num_layers", "dtype", "data", "shm_path", "offset")
    RID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    rid: str
    key: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    head_start: int
    head_end: int
    num_layers: int
    dtype: str
    data: bytes
    shm_path: str
    offset: int
    def __init__(self, rid: _Optional[str] = ..., key: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ..., shm_path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class KVPagesAck(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class GrammarFailure(_message.Message):
    __slots__ = ("constraint", "error")
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    constraint: Constraint
    error: str
    def __init__(self, constraint: _Optional[_Union[Constraint, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, items: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class EntryResult(_message.Message):
    __slots__ = ("rid", "token_id", "logprob", "top_logprobs", "input_logprobs_start", "input_logprobs", "input_top_logprobs", "forced_ids", "accepted_ids", "accepted_logprobs", "accepted_top_logprobs", "embedding")
    RID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORCED_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    rid: str
    token_id: int
    logprob: float
    top_logprobs: TopLogprobs
    input_logprobs_start: int
    input_logprobs: _containers.RepeatedScalarFieldContainer[float]
    input_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    forced_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_logprobs: _containers.RepeatedScalarFieldContainer[float]
    accepted_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rid: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ..., input_logprobs_start: _Optional[int] = ..., input_logprobs: _Optional[_Iterable[float]] = ..., input_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., forced_ids: _Optional[_Iterable[int]] = ..., accepted_ids: _Optional[_Iterable[int]] = ..., accepted_logprobs: _Optional[_Iterable[float]] = ..., accepted_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step", "results", "forward_ms", "copies_done", "grammars_ready", "grammars_failed", "sends_done", "decode_tokens")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    COPIES_DONE_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_READY_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_FAILED_FIELD_NUMBER: _ClassVar[int]
    SENDS_DONE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    step: int
    results: _containers.RepeatedCompositeFieldContainer[EntryResult]
    forward_ms: float
    copies_done: _containers.RepeatedScalarFieldContainer[int]
    grammars_ready: _containers.RepeatedCompositeFieldContainer[Constraint]
    grammars_failed: _containers.RepeatedCompositeFieldContainer[GrammarFailure]
    sends_done: _containers.RepeatedCompositeFieldContainer[SendOutcome]
    decode_tokens: bytes
    def __init__(self, step: _Optional[int] = ..., results: _Optional[_Iterable[_Union[EntryResult, _Mapping]]] = ..., forward_ms: _Optional[float] = ..., copies_done: _Optional[_Iterable[int]] = ..., grammars_ready: _Optional[_Iterable[_Union[Constraint, _Mapping]]] = ..., grammars_failed: _Optional[_Iterable[_Union[GrammarFailure, _Mapping]]] = ..., sends_done: _Optional[_Iterable[_Union[SendOutcome, _Mapping]]] = ..., decode_tokens: _Optional[bytes] = ...) -> None: ...
