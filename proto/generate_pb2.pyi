from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClientSamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "stop", "stop_token_ids", "seed", "ignore_eos", "skip_special_tokens", "no_stop_trim", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "spaces_between_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
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
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
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
    json_schema: str
    regex: str
    ebnf: str
    structural_tag: str
    logit_bias: _containers.ScalarMap[int, float]
    spaces_between_special_tokens: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., no_stop_trim: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., structural_tag: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., spaces_between_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid", "cache_salt", "priority", "lora_path")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    text: str
    input_ids: TokenIds
    sampling_params: ClientSamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    rid: str
    cache_salt: str
    priority: int
    lora_path: str
    def __init__(self, text: _Optional[str] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling_params: _Optional[_Union[ClientSamplingParams, _Mapping]] = ..., return_logprob: _Optional[bool] = ..., logprob_start_len: _Optional[int] = ..., top_logprobs_num: _Optional[int] = ..., rid: _Optional[str] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., lora_path: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("text", "input_ids", "dimensions", "rid", "cache_salt", "lora_path")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    text: str
    input_ids: TokenIds
    dimensions: int
    rid: str
    cache_salt: str
    lora_path: str
    def __init__(self, text: _Optional[str] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., dimensions: _Optional[int] = ..., rid: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("rid", "embedding", "prompt_tokens", "cached_tokens", "cached_tokens_details")
    RID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    embedding: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails
    def __init__(self, rid: _Optional[str] = ..., embedding: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_tokens_details: _Optional[_Union[CachedTokensDetails, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("rid", "text", "output_ids", "prompt_tokens", "completion_tokens", "cached_tokens", "cached_tokens_details", "finish", "output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")
    RID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_DETAILS_FIELD_NUMBER: _ClassVar[int]
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
    cached_tokens_details: CachedTokensDetails
    finish: Finish
    output_token_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobEntry]
    output_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobList]
    input_token_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobEntry]
    input_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobList]
    def __init__(self, rid: _Optional[str] = ..., text: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_tokens_details: _Optional[_Union[CachedTokensDetails, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., output_token_logprobs: _Optional[_Iterable[_Union[TokenLogprobEntry, _Mapping]]] = ..., output_top_logprobs: _Optional[_Iterable[_Union[TopLogprobList, _Mapping]]] = ..., input_token_logprobs: _Optional[_Iterable[_Union[TokenLogprobEntry, _Mapping]]] = ..., input_top_logprobs: _Optional[_Iterable[_Union[TopLogprobList, _Mapping]]] = ...) -> None: ...

class CachedTokensDetails(_message.Message):
    __slots__ = ("device", "host", "storage")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    device: int
    host: int
    storage: int
    def __init__(self, device: _Optional[int] = ..., host: _Optional[int] = ..., storage: _Optional[int] = ...) -> None: ...

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
