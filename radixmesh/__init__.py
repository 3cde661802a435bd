"""radixmesh: an LLM serving runtime with a radix prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixmesh.api import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    # Lazy, so services that never run a model do not import torch through the package.
    if name == "Engine":
        from radixmesh.api import Engine

        return Engine
    raise AttributeError(f"module 'radixmesh' has no attribute {name!r}")
