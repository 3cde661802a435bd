"""The tokenizer service's one config object."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from radixmesh.services.tokenizer.router import RouterConfig


@dataclass(frozen=True)
class TokenizerServiceConfig:
    """A tokenizer replica: the HTTP and gRPC front doors, routing requests to engines."""

    nats_url: str = "nats://127.0.0.1:4222"
    model_path: str | None = field(
        default=None, metadata={"help": "GGUF file or Hugging Face directory; none: SmolLM2"}
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "the name clients use; none: the model file's stem"}
    )
    host: str = "127.0.0.1"
    port: int = field(default=30000, metadata={"help": "HTTP; 0: any free port"})
    grpc_port: int = field(default=0, metadata={"help": "gRPC Generate; 0: any, -1: off"})
    replica_id: str = field(
        default_factory=lambda: uuid.uuid4().hex[:12],
        metadata={"help": "names this replica's output subject; default: random"},
    )
    cache_threshold: float = field(
        default=0.5, metadata={"help": "prompt share that must match to follow the cache"}
    )
    balance_abs_threshold: int = field(
        default=32, metadata={"help": "load gap (requests) still counted as balanced"}
    )
    balance_rel_threshold: float = field(
        default=1.5, metadata={"help": "load ratio still counted as balanced"}
    )
    max_tree_tokens: int = field(
        default=1 << 20, metadata={"help": "tokens of each engine's routing tree"}
    )
    engine_timeout: float = field(
        default=3.0, metadata={"help": "seconds without a heartbeat before an engine is gone"}
    )
    shutdown_grace: float = field(
        default=10.0, metadata={"help": "seconds in-flight requests get to finish on SIGTERM"}
    )
    log_level: str = "INFO"

    @property
    def router(self) -> RouterConfig:
        """The routing knobs."""
        return RouterConfig(
            cache_threshold=self.cache_threshold,
            balance_abs_threshold=self.balance_abs_threshold,
            balance_rel_threshold=self.balance_rel_threshold,
            max_tree_tokens=self.max_tree_tokens,
        )
