from radixmesh.proto import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DetokSpec(_message.Message):
    __slots__ = ("stop", "no_stop_trim", "skip_special_tokens", "min_new_tokens", "prompt_tail", "spaces_between_special_tokens")
    STOP_FIELD_NUMBER: _ClassVar[int]
    NO_STOP_TRIM_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TAIL_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    no_stop_trim: bool
    skip_special_tokens: bool
    min_new_tokens: int
    prompt_tail: _containers.RepeatedScalarFieldContainer[int]
    spaces_between_special_tokens: bool
    def __init__(self, stop: _Optional[_Iterable[str]] = ..., no_stop_trim: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ..., prompt_tail: _Optional[_Iterable[int]] = ..., spaces_between_special_tokens: _Optional[bool] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("rid", "input_ids", "sampling", "cache_salt", "priority", "return_logprob", "top_logprobs_num", "logprob_start_len", "reply_to", "detok", "detok_context", "prefill_engine", "handoff", "lora_path", "pooling", "score_ids", "stream")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    DETOK_FIELD_NUMBER: _ClassVar[int]
    DETOK_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _worker_pb2.SamplingParams
    cache_salt: str
    priority: int
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    reply_to: str
    detok: DetokSpec
    detok_context: int
    prefill_engine: str
    handoff: KVHandoff
    lora_path: str
    pooling: str
    score_ids: _containers.RepeatedScalarFieldContainer[int]
    stream: bool
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_worker_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., logprob_start_len: _Optional[int] = ..., reply_to: _Optional[str] = ..., detok: _Optional[_Union[DetokSpec, _Mapping]] = ..., detok_context: _Optional[int] = ..., prefill_engine: _Optional[str] = ..., handoff: _Optional[_Union[KVHandoff, _Mapping]] = ..., lora_path: _Optional[str] = ..., pooling: _Optional[str] = ..., score_ids: _Optional[_Iterable[int]] = ..., stream: _Optional[bool] = ...) -> None: ...

class KVHandoff(_message.Message):
    __slots__ = ("decode_engine", "start", "dest_slots", "dest_workers", "dest_host", "key")
    DECODE_ENGINE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DEST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEST_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEST_HOST_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    decode_engine: str
    start: int
    dest_slots: _containers.RepeatedScalarFieldContainer[int]
    dest_workers: _containers.RepeatedScalarFieldContainer[str]
    dest_host: str
    key: str
    def __init__(self, decode_engine: _Optional[str] = ..., start: _Optional[int] = ..., dest_slots: _Optional[_Iterable[int]] = ..., dest_workers: _Optional[_Iterable[str]] = ..., dest_host: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class KVCommit(_message.Message):
    __slots__ = ("rid", "prefill_engine", "error", "output_ids", "logprobs", "finish", "transfer_tokens", "transfer_bytes", "transfer_ms", "prefill_cached_tokens")
    RID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    prefill_engine: str
    error: str
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: Logprobs
    finish: Finish
    transfer_tokens: int
    transfer_bytes: int
    transfer_ms: float
    prefill_cached_tokens: int
    def __init__(self, rid: _Optional[str] = ..., prefill_engine: _Optional[str] = ..., error: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., transfer_tokens: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., prefill_cached_tokens: _Optional[int] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("kind", "token_id", "text", "message", "engine_lost", "status")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LOST_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    token_id: int
    text: str
    message: str
    engine_lost: bool
    status: int
    def __init__(self, kind: _Optional[str] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., message: _Optional[str] = ..., engine_lost: _Optional[bool] = ..., status: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rid", "finish")
    RID_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    rid: str
    finish: Finish
    def __init__(self, rid: _Optional[str] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("output", "output_top", "input_offset", "input", "input_top")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOP_FIELD_NUMBER: _ClassVar[int]
    INPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOP_FIELD_NUMBER: _ClassVar[int]
    output: _containers.RepeatedScalarFieldContainer[float]
    output_top: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TopLogprobs]
    input_offset: int
    input: _containers.RepeatedScalarFieldContainer[float]
    input_top: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TopLogprobs]
    def __init__(self, output: _Optional[_Iterable[float]] = ..., output_top: _Optional[_Iterable[_Union[_worker_pb2.TopLogprobs, _Mapping]]] = ..., input_offset: _Optional[int] = ..., input: _Optional[_Iterable[float]] = ..., input_top: _Optional[_Iterable[_Union[_worker_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class TokenUpdate(_message.Message):
    __slots__ = ("rid", "reply_to", "seq", "offset", "context_ids", "new_ids", "detok", "finish", "prompt_tokens", "cached_tokens", "cached_host_tokens", "cached_storage_tokens", "spec_verify_ct", "spec_accepted_tokens", "logprobs", "engine_id", "traceparent", "transfer")
    RID_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_IDS_FIELD_NUMBER: _ClassVar[int]
    DETOK_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_STORAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFY_CT_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    rid: str
    reply_to: str
    seq: int
    offset: int
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    new_ids: _containers.RepeatedScalarFieldContainer[int]
    detok: DetokSpec
    finish: Finish
    prompt_tokens: int
    cached_tokens: int
    cached_host_tokens: int
    cached_storage_tokens: int
    spec_verify_ct: int
    spec_accepted_tokens: int
    logprobs: Logprobs
    engine_id: str
    traceparent: str
    transfer: Transfer
    def __init__(self, rid: _Optional[str] = ..., reply_to: _Optional[str] = ..., seq: _Optional[int] = ..., offset: _Optional[int] = ..., context_ids: _Optional[_Iterable[int]] = ..., new_ids: _Optional[_Iterable[int]] = ..., detok: _Optional[_Union[DetokSpec, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_host_tokens: _Optional[int] = ..., cached_storage_tokens: _Optional[int] = ..., spec_verify_ct: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., engine_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("prefill_engine", "tokens", "bytes", "ms", "fallback")
    PREFILL_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    prefill_engine: str
    tokens: int
    bytes: int
    ms: float
    fallback: str
    def __init__(self, prefill_engine: _Optional[str] = ..., tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., ms: _Optional[float] = ..., fallback: _Optional[str] = ...) -> None: ...

class PackedUpdates(_message.Message):
    __slots__ = ("rids", "seqs", "offsets", "routes", "context_lens", "context_ids", "new_lens", "new_ids", "reply_to", "detok")
    RIDS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LENS_FIELD_NUMBER: _ClassVar[int]
    NEW_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    DETOK_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[str]
    seqs: bytes
    offsets: bytes
    routes: bytes
    context_lens: bytes
    context_ids: bytes
    new_lens: bytes
    new_ids: bytes
    reply_to: _containers.RepeatedScalarFieldContainer[str]
    detok: _containers.RepeatedCompositeFieldContainer[DetokSpec]
    def __init__(self, rids: _Optional[_Iterable[str]] = ..., seqs: _Optional[bytes] = ..., offsets: _Optional[bytes] = ..., routes: _Optional[bytes] = ..., context_lens: _Optional[bytes] = ..., context_ids: _Optional[bytes] = ..., new_lens: _Optional[bytes] = ..., new_ids: _Optional[bytes] = ..., reply_to: _Optional[_Iterable[str]] = ..., detok: _Optional[_Iterable[_Union[DetokSpec, _Mapping]]] = ...) -> None: ...

class TokenStep(_message.Message):
    __slots__ = ("updates", "packed", "engine_id")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[TokenUpdate]
    packed: PackedUpdates
    engine_id: str
    def __init__(self, updates: _Optional[_Iterable[_Union[TokenUpdate, _Mapping]]] = ..., packed: _Optional[_Union[PackedUpdates, _Mapping]] = ..., engine_id: _Optional[str] = ...) -> None: ...

class TextChunk(_message.Message):
    __slots__ = ("rid", "seq", "text", "output_ids", "finish", "prompt_tokens", "cached_tokens", "cached_host_tokens", "cached_storage_tokens", "spec_verify_ct", "spec_accepted_tokens", "completion_tokens", "logprobs", "engine_id", "transfer", "embedding")
    RID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_STORAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFY_CT_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    rid: str
    seq: int
    text: str
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    finish: Finish
    prompt_tokens: int
    cached_tokens: int
    cached_host_tokens: int
    cached_storage_tokens: int
    spec_verify_ct: int
    spec_accepted_tokens: int
    completion_tokens: int
    logprobs: Logprobs
    engine_id: str
    transfer: Transfer
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rid: _Optional[str] = ..., seq: _Optional[int] = ..., text: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_host_tokens: _Optional[int] = ..., cached_storage_tokens: _Optional[int] = ..., spec_verify_ct: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., engine_id: _Optional[str] = ..., transfer: _Optional[_Union[Transfer, _Mapping]] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class PackedChunks(_message.Message):
    __slots__ = ("rids", "seqs", "texts", "id_lens", "ids", "completion_tokens")
    RIDS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    ID_LENS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[str]
    seqs: bytes
    texts: _containers.RepeatedScalarFieldContainer[str]
    id_lens: bytes
    ids: bytes
    completion_tokens: bytes
    def __init__(self, rids: _Optional[_Iterable[str]] = ..., seqs: _Optional[bytes] = ..., texts: _Optional[_Iterable[str]] = ..., id_lens: _Optional[bytes] = ..., ids: _Optional[bytes] = ..., completion_tokens: _Optional[bytes] = ...) -> None: ...

class TextChunks(_message.Message):
    __slots__ = ("chunks", "packed")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TextChunk]
    packed: PackedChunks
    def __init__(self, chunks: _Optional[_Iterable[_Union[TextChunk, _Mapping]]] = ..., packed: _Optional[_Union[PackedChunks, _Mapping]] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "running", "waiting", "num_slots", "free_slots", "cached_tokens", "context_length", "vocab_size", "model_path", "uptime_s", "down", "instance", "architecture", "num_experts", "num_experts_per_tok", "role", "lora_names", "hidden_size")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    running: int
    waiting: int
    num_slots: int
    free_slots: int
    cached_tokens: int
    context_length: int
    vocab_size: int
    model_path: str
    uptime_s: float
    down: bool
    instance: str
    architecture: str
    num_experts: int
    num_experts_per_tok: int
    role: str
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    hidden_size: int
    def __init__(self, engine_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., num_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., model_path: _Optional[str] = ..., uptime_s: _Optional[float] = ..., down: _Optional[bool] = ..., instance: _Optional[str] = ..., architecture: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ..., role: _Optional[str] = ..., lora_names: _Optional[_Iterable[str]] = ..., hidden_size: _Optional[int] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("engine_id", "inserted", "flushed")
    class Sequence(_message.Message):
        __slots__ = ("cache_salt", "token_ids")
        CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        cache_salt: str
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, cache_salt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INSERTED_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    inserted: _containers.RepeatedCompositeFieldContainer[CacheEvent.Sequence]
    flushed: bool
    def __init__(self, engine_id: _Optional[str] = ..., inserted: _Optional[_Iterable[_Union[CacheEvent.Sequence, _Mapping]]] = ..., flushed: _Optional[bool] = ...) -> None: ...
