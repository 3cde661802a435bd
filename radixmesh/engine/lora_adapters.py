"""The scheduler's view of LoRA adapters: which ones the runners serve, and how many the
running requests may use at once (the runners' device slots, max_loras_per_batch, less the
ones pinned adapters hold for good)."""

from __future__ import annotations

from collections.abc import Iterable

from radixmesh.engine.request import Req


class LoraAdapters:
    """The adapters an engine takes requests for, and its admission by adapter slots."""

    def __init__(self, names: Iterable[str], slots: int, pinned: Iterable[str] = ()) -> None:
        self.names = set(names)
        self.slots = slots
        self.pinned = set(pinned)

    def check(self, req: Req) -> None:
        """ValueError unless the runners serve the request's adapter (if it has one)."""
        if req.lora and req.lora not in self.names:
            raise ValueError(f"lora_path: this engine does not serve LoRA adapter {req.lora!r}")

    def fits(self, req: Req, running: Iterable[Req]) -> bool:
        """Whether its adapter, if any, can run beside the running requests': a pinned one,
        theirs, or one more while a slot that no pinned adapter holds is free."""
        if not req.lora or req.lora in self.pinned:
            return True
        held = {r.lora for r in running if r.lora and r.lora not in self.pinned}
        return req.lora in held or len(held) < self.slots - len(self.pinned)

    def serve(self, name: str) -> None:
        """The runners serve adapter `name` from now on."""
        self.names.add(name)

    def stop(self, name: str, requests: Iterable[Req]) -> None:
        """Take no more requests for adapter `name`; ValueError (nothing changed) while one
        of `requests` that has not finished uses it."""
        users = sum(1 for r in requests if r.lora == name and r.finish is None)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} request(s)")
        self.names.discard(name)
        self.pinned.discard(name)
