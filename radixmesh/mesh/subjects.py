"""NATS subject names of the mesh, in one place."""

from __future__ import annotations

ENGINES = "rm.engines"  # EngineStatus heartbeats
DETOK = "rm.detok"  # TokenStep, consumed by the detokenizer queue group
DETOK_QUEUE = "detokenizers"


def engine_generate(engine_id: str) -> str:
    """EngineRequest for one engine replica (its schedulers form one queue group)."""
    return f"rm.engine.{engine_id}.generate"


def engine_abort(engine_id: str) -> str:
    """AbortRequest for one engine replica."""
    return f"rm.engine.{engine_id}.abort"


def engine_kv(engine_id: str) -> str:
    """KVCommit from prefill engines to one decode engine (disaggregation)."""
    return f"rm.engine.{engine_id}.kv"


def engine_control(engine_id: str) -> str:
    """JSON request/reply: {"op": "info"} or {"op": "flush"}."""
    return f"rm.engine.{engine_id}.control"


def engine_queue(engine_id: str) -> str:
    """Queue group of one engine replica's scheduler."""
    return f"engine-{engine_id}"


def cache_events(engine_id: str) -> str:
    """CacheEvent of one engine; routers subscribe to rm.cache.*."""
    return f"rm.cache.{engine_id}"


CACHE_EVENTS_ALL = "rm.cache.*"


def tokenizer_out(replica_id: str) -> str:
    """TextChunks for the tokenizer replica that owns the requests."""
    return f"rm.tokenizer.{replica_id}.out"
