from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVGeometry(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("engine_id", "geometry", "num_slots", "layout", "storage_page_tokens")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    geometry: KVGeometry
    num_slots: int
    layout: str
    storage_page_tokens: int
    def __init__(self, engine_id: _Optional[str] = ..., geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., num_slots: _Optional[int] = ..., layout: _Optional[str] = ..., storage_page_tokens: _Optional[int] = ...) -> None: ...

class HostPool(_message.Message):
    __slots__ = ("name", "path", "num_slots", "layout", "geometry", "storage")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    num_slots: int
    layout: str
    geometry: KVGeometry
    storage: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., num_slots: _Optional[int] = ..., layout: _Optional[str] = ..., geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., storage: _Optional[str] = ...) -> None: ...

class PagesRequest(_message.Message):
    __slots__ = ("engine_id", "slots")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class PagesReply(_message.Message):
    __slots__ = ("used_slots", "repeated")
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REPEATED_FIELD_NUMBER: _ClassVar[int]
    used_slots: int
    repeated: int
    def __init__(self, used_slots: _Optional[int] = ..., repeated: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("num_slots", "used_slots", "segment_bytes", "repeated")
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPEATED_FIELD_NUMBER: _ClassVar[int]
    num_slots: int
    used_slots: int
    segment_bytes: int
    repeated: int
    def __init__(self, num_slots: _Optional[int] = ..., used_slots: _Optional[int] = ..., segment_bytes: _Optional[int] = ..., repeated: _Optional[int] = ...) -> None: ...

class StoragePage(_message.Message):
    __slots__ = ("key", "slots")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    key: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("engine_id", "pages")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    pages: _containers.RepeatedCompositeFieldContainer[StoragePage]
    def __init__(self, engine_id: _Optional[str] = ..., pages: _Optional[_Iterable[_Union[StoragePage, _Mapping]]] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("engine_id", "keys")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class QueryReply(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    def __init__(self, hits: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("engine_id", "keys", "slots")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchProgress(_message.Message):
    __slots__ = ("arrived",)
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    arrived: int
    def __init__(self, arrived: _Optional[int] = ...) -> None: ...
