"""The detokenizer service's one config object."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.settings import (
    DetokenizerSettings,
    ModelSettings,
    NatsSettings,
    ServiceSettings,
    StatusSettings,
)


@dataclass(frozen=True, kw_only=True)
class DetokenizerConfig(
    StatusSettings, NatsSettings, ServiceSettings, DetokenizerSettings, ModelSettings
):
    """A detokenizer replica: token ids in from the schedulers, text out to the tokenizers."""
