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
    # An abort the request itself caused, as an HTTP status (400: its constraint does not
    # compile): a front door answers with it when nothing was generated; 0: none.
    status: int = 0

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
