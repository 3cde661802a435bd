"""The detokenizer service's one config object."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


def _default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class DetokenizerConfig:
    """A detokenizer replica: token ids in from the schedulers, text out to the tokenizers."""

    nats_url: str = "nats://127.0.0.1:4222"
    model_path: str | None = field(
        default=None, metadata={"help": "GGUF file or Hugging Face directory; none: SmolLM2"}
    )
    host: str = "127.0.0.1"
    metrics_port: int = field(default=0, metadata={"help": "/health and /metrics; 0: any"})
    replica_id: str = field(
        default_factory=_default_replica_id, metadata={"help": "this replica's name"}
    )
    log_level: str = "INFO"
