from radixmesh.proto import forward_pb2 as _forward_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("num_slots", "vocab_size", "max_position_embeddings", "eos_token_ids", "model_path", "dtype", "tp_rank", "tp_size")
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_slots: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_path: str
    dtype: str
    tp_rank: int
    tp_size: int
    def __init__(self, num_slots: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_path: _Optional[str] = ..., dtype: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class DetokSpec(_message.Message):
    __slots__ = ("stop", "no_stop_trim", "skip_special_tokens", "min_new_tokens", "prompt_tail")
    STOP_FIELD_NUMBER: _ClassVar[int]
    NO_STOP_TRIM_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TAIL_FIELD_NUMBER: _ClassVar[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    no_stop_trim: bool
    skip_special_tokens: bool
    min_new_tokens: int
    prompt_tail: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stop: _Optional[_Iterable[str]] = ..., no_stop_trim: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ..., prompt_tail: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("rid", "input_ids", "sampling", "max_new_tokens", "cache_salt", "priority", "return_logprob", "top_logprobs_num", "logprob_start_len", "reply_to", "detok", "detok_context")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    DETOK_FIELD_NUMBER: _ClassVar[int]
    DETOK_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _forward_pb2.SamplingParams
    max_new_tokens: int
    cache_salt: str
    priority: int
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    reply_to: str
    detok: DetokSpec
    detok_context: int
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_forward_pb2.SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., logprob_start_len: _Optional[int] = ..., reply_to: _Optional[str] = ..., detok: _Optional[_Union[DetokSpec, _Mapping]] = ..., detok_context: _Optional[int] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("kind", "token_id", "text", "message")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    token_id: int
    text: str
    message: str
    def __init__(self, kind: _Optional[str] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rid", "finish")
    RID_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    rid: str
    finish: Finish
    def __init__(self, rid: _Optional[str] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class TokenUpdate(_message.Message):
    __slots__ = ("rid", "reply_to", "seq", "offset", "context_ids", "new_ids", "detok", "finish", "prompt_tokens", "cached_tokens", "output_logprobs", "output_top_logprobs", "input_logprobs_offset", "input_logprobs", "input_top_logprobs", "engine_id", "traceparent")
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
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
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
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    output_top_logprobs: _containers.RepeatedCompositeFieldContainer[_forward_pb2.TopLogprobs]
    input_logprobs_offset: int
    input_logprobs: _containers.RepeatedScalarFieldContainer[float]
    input_top_logprobs: _containers.RepeatedCompositeFieldContainer[_forward_pb2.TopLogprobs]
    engine_id: str
    traceparent: str
    def __init__(self, rid: _Optional[str] = ..., reply_to: _Optional[str] = ..., seq: _Optional[int] = ..., offset: _Optional[int] = ..., context_ids: _Optional[_Iterable[int]] = ..., new_ids: _Optional[_Iterable[int]] = ..., detok: _Optional[_Union[DetokSpec, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., output_top_logprobs: _Optional[_Iterable[_Union[_forward_pb2.TopLogprobs, _Mapping]]] = ..., input_logprobs_offset: _Optional[int] = ..., input_logprobs: _Optional[_Iterable[float]] = ..., input_top_logprobs: _Optional[_Iterable[_Union[_forward_pb2.TopLogprobs, _Mapping]]] = ..., engine_id: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class TokenStep(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[TokenUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[TokenUpdate, _Mapping]]] = ...) -> None: ...

class TextChunk(_message.Message):
    __slots__ = ("rid", "seq", "text", "output_ids", "finish", "prompt_tokens", "cached_tokens", "completion_tokens", "output_logprobs", "output_top_logprobs", "input_logprobs_offset", "input_logprobs", "input_top_logprobs")
    RID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    seq: int
    text: str
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    finish: Finish
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    output_top_logprobs: _containers.RepeatedCompositeFieldContainer[_forward_pb2.TopLogprobs]
    input_logprobs_offset: int
    input_logprobs: _containers.RepeatedScalarFieldContainer[float]
    input_top_logprobs: _containers.RepeatedCompositeFieldContainer[_forward_pb2.TopLogprobs]
    def __init__(self, rid: _Optional[str] = ..., seq: _Optional[int] = ..., text: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., output_top_logprobs: _Optional[_Iterable[_Union[_forward_pb2.TopLogprobs, _Mapping]]] = ..., input_logprobs_offset: _Optional[int] = ..., input_logprobs: _Optional[_Iterable[float]] = ..., input_top_logprobs: _Optional[_Iterable[_Union[_forward_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class TextChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TextChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TextChunk, _Mapping]]] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "running", "waiting", "num_slots", "free_slots", "cached_tokens", "context_length", "vocab_size", "model_path", "uptime_s")
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
    def __init__(self, engine_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., num_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., model_path: _Optional[str] = ..., uptime_s: _Optional[float] = ...) -> None: ...

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

class ClientSamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "stop", "stop_token_ids", "seed", "ignore_eos", "skip_special_tokens", "no_stop_trim")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NO_STOP_TRIM_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    min_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., no_stop_trim: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid", "cache_salt", "priority")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    text: str
    input_ids: TokenIds
    sampling_params: ClientSamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    rid: str
    cache_salt: str
    priority: int
    def __init__(self, text: _Optional[str] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling_params: _Optional[_Union[ClientSamplingParams, _Mapping]] = ..., return_logprob: _Optional[bool] = ..., logprob_start_len: _Optional[int] = ..., top_logprobs_num: _Optional[int] = ..., rid: _Optional[str] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobEntry(_message.Message):
    __slots__ = ("logprob", "token_id", "has_logprob")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    token_id: int
    has_logprob: bool
    def __init__(self, logprob: _Optional[float] = ..., token_id: _Optional[int] = ..., has_logprob: _Optional[bool] = ...) -> None: ...

class TopLogprobList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TokenLogprobEntry]
    def __init__(self, items: _Optional[_Iterable[_Union[TokenLogprobEntry, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("rid", "text", "output_ids", "prompt_tokens", "completion_tokens", "cached_tokens", "finish", "output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")
    RID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    text: str
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish: Finish
    output_token_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobEntry]
    output_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobList]
    input_token_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobEntry]
    input_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobList]
    def __init__(self, rid: _Optional[str] = ..., text: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., output_token_logprobs: _Optional[_Iterable[_Union[TokenLogprobEntry, _Mapping]]] = ..., output_top_logprobs: _Optional[_Iterable[_Union[TopLogprobList, _Mapping]]] = ..., input_token_logprobs: _Optional[_Iterable[_Union[TokenLogprobEntry, _Mapping]]] = ..., input_top_logprobs: _Optional[_Iterable[_Union[TopLogprobList, _Mapping]]] = ...) -> None: ...
