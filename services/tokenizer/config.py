"""The tokenizer service's one config object."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.settings import (
    ModelSettings,
    NatsSettings,
    RouterSettings,
    ServiceSettings,
    TokenizerSettings,
)
from radixmesh.services.tokenizer.router import RouterConfig


@dataclass(frozen=True, kw_only=True)
class TokenizerServiceConfig(
    NatsSettings, ServiceSettings, RouterSettings, TokenizerSettings, ModelSettings
):
    """A tokenizer replica: the HTTP and gRPC front doors, routing requests to engines."""

    @property
    def router(self) -> RouterConfig:
        """The routing knobs."""
        return RouterConfig(
            cache_threshold=self.cache_threshold,
            balance_abs_threshold=self.balance_abs_threshold,
            balance_rel_threshold=self.balance_rel_threshold,
            max_tree_tokens=self.max_tree_tokens,
        )
