"""The message bus's address: one NATS server, or a comma-separated list of a cluster's, and
what follows from it for the JetStream buckets the mesh keeps."""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import urlsplit


class _Connection(Protocol):
    """What bus_replicas reads of a NATS client: its server pool, and which of it the
    cluster told it of."""

    @property
    def servers(self) -> list[Any]: ...

    @property
    def discovered_servers(self) -> list[Any]: ...


def bus_servers(url: str) -> list[str]:
    """The servers of a NATS URL: one, or a comma-separated list of a cluster's."""
    return [part.strip() for part in url.split(",") if part.strip()]


def bus_redacted(url: str) -> str:
    """A NATS URL (or list of them) without passwords or tokens, for messages."""
    return ",".join(
        f"{u.scheme}://{u.netloc.rpartition('@')[2]}" for u in map(urlsplit, bus_servers(url))
    )


def bus_replicas(nc: _Connection) -> int:
    """Replicas for a JetStream bucket the mesh creates: one per server named in the NATS
    URL, up to 3 (a cluster's R3), so that losing a node loses nothing stored; 1 on a lone
    server."""
    named = len(nc.servers) - len(nc.discovered_servers)
    return max(1, min(3, named))
