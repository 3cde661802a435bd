"""How a request ends, one type from the engine to every front door."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FinishKind(StrEnum):
    """Why a request stopped, named as the APIs report it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class FinishReason:
    """The kind of finish and what matched (a stop token id or stop string), if anything."""

    kind: FinishKind
    matched: int | str | None = None
    message: str | None = None

    def to_dict(self) -> dict[str, object]:
        """The finish_reason object of SGLang's meta_info."""
        out: dict[str, object] = {"type": self.kind.value}
        if self.kind is FinishKind.LENGTH:
            out["length"] = self.matched
        else:
            out["matched"] = self.matched
        if self.message:
            out["message"] = self.message
        return out
