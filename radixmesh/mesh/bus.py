"""The message bus's address: one NATS server, or a comma-separated list of a cluster's, and
what follows from it for the JetStream buckets the mesh keeps."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS


def bus_servers(url: str) -> list[str]:
    """The servers of a NATS URL: one, or a comma-separated list of a cluster's."""
    return [part.strip() for part in url.split(",") if part.strip()]


def bus_redacted(url: str) -> str:
    """A NATS URL (or list of them) without passwords or tokens, for messages."""
    return ",".join(
        f"{u.scheme}://{u.netloc.rpartition('@')[2]}" for u in map(urlsplit, bus_servers(url))
    )


def bus_replicas(nc: NATS) -> int:
    """Replicas for a JetStream bucket the mesh creates: one per server named in the NATS
    URL, up to 3 (a cluster's R3), so that losing a node loses nothing stored; 1 on a lone
    server."""
    named = len(nc.servers) - len(nc.discovered_servers)
    return max(1, min(3, named))
