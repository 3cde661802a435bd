"""Control calls to the engines' schedulers, JSON request/reply on NATS: each engine's
server info, and cache flushes and LoRA loads and unloads on every engine at once, whose
outcome the registry and the router take in without waiting for the next heartbeat."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

from nats.aio.client import Client as NATS

from radixmesh.mesh import subjects
from radixmesh.services.tokenizer.router import EngineRegistry, Router

log = logging.getLogger("radixmesh.tokenizer.mesh")


class EngineControl:
    """The control calls to the engines in `engines`; `timeout_s` for each reply."""

    def __init__(self, nc: NATS, engines: EngineRegistry, router: Router,
                 timeout_s: float) -> None:
        self.engines = engines
        self.router = router
        self._nc = nc
        self._timeout_s = timeout_s

    async def call(self, engine_id: str, op: str, **fields: str) -> dict[str, Any]:
        """One JSON request/reply with an engine's scheduler."""
        reply = await self._nc.request(
            subjects.engine_control(engine_id),
            json.dumps({"op": op, **fields}).encode(),
            timeout=self._timeout_s,
        )
        return json.loads(reply.data)

    async def change_lora(self, load: bool, lora_name: str, lora_path: str = "") -> str:
        """Load (or unload) a LoRA adapter on every engine; the first engine's reason when
        one refuses ("" when all did it). Requests may name it as soon as this returns."""
        ids = self.engines.ids
        if not ids:
            return "no engine is available"
        op = "load_lora" if load else "unload_lora"
        replies = await asyncio.gather(
            *(self.call(e, op, lora_name=lora_name, lora_path=lora_path) for e in ids),
            return_exceptions=True)
        error = ""
        for engine_id, reply in zip(ids, replies, strict=True):
            if isinstance(reply, dict) and reply.get("success"):
                self.engines.served(engine_id, reply.get("lora_names", []))
            else:
                why = reply.get("error") if isinstance(reply, dict) else repr(reply)
                log.warning("engine %s did not %s %r: %s", engine_id, op, lora_name, why)
                error = error or f"engine {engine_id}: {why}"
        return error

    async def flush_cache(self) -> bool:
        """Ask every engine to drop its prefix cache; True when all did."""
        ids = self.engines.ids
        replies = await asyncio.gather(*(self.call(e, "flush") for e in ids),
                                       return_exceptions=True)
        ok = bool(ids)
        for engine_id, reply in zip(ids, replies, strict=True):
            if isinstance(reply, dict) and reply.get("success"):
                self.router.flush(engine_id)
            else:
                log.warning("engine %s did not flush its cache: %s", engine_id, reply)
                ok = False
        return ok

    async def engine_infos(self) -> list[dict[str, Any]]:
        """Each engine's own server info, or its last heartbeat when it does not answer."""
        ids = self.engines.ids
        replies = await asyncio.gather(*(self.call(e, "info") for e in ids),
                                       return_exceptions=True)
        out = []
        for engine_id, reply in zip(ids, replies, strict=True):
            if isinstance(reply, dict):
                out.append(reply)
            elif engine_id in self.engines:
                out.append(dataclasses.asdict(self.engines.status(engine_id)))
        return out
