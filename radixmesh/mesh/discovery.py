"""Workers and schedulers find each other through NATS, so engines scale without a list of
addresses (`docker compose up --scale worker=2 --scale scheduler=2`, or services started by
hand beside a running mesh).

Two JetStream key-value buckets whose entries expire unless renewed:
- `radixmesh_workers`: each announcing worker rank puts `<group>.<rank>` -> where it
  listens, every RENEW_S. The ranks of one tensor-parallel group share the group name.
- `radixmesh_claims`: a scheduler without worker addresses claims a group whose every rank
  is announced by creating `<group>` -> its engine id (create fails where the key exists,
  so two schedulers never drive one group), and renews the claim while it lives. A claim
  held under the same engine id is taken over at once: a restarted scheduler gets its
  workers back without waiting for the old claim to expire.

Prefill/decode disaggregation: a rank announces its disaggregation_mode and a scheduler
claims only groups announced in its own mode, so a prefill engine never drives decode
workers (nor a mode-less "null" engine either). An announcement without the field, from a
worker that predates it, reads as "null".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)
from nats.js.kv import KeyValue

from radixmesh.core.bus import bus_replicas
from radixmesh.mesh.service import connect_bus

log = logging.getLogger("radixmesh.discovery")

WORKERS_BUCKET = "radixmesh_workers"
CLAIMS_BUCKET = "radixmesh_claims"
TTL_S = 10.0  # an announcement or a claim not renewed for this long is gone
RENEW_S = 2.0
POLL_S = 0.5  # how often a scheduler looks again while no group is free
NO_ROLE = "null"  # disaggregation_mode of an engine doing both prefill and decode


def key_part(text: str) -> str:
    """`text` as one token of a key (letters, digits, '-', '_' and '=' only)."""
    return re.sub(r"[^A-Za-z0-9_=-]", "_", text)


@dataclass(frozen=True)
class WorkerRank:
    """One announced worker rank."""

    group: str  # the ranks of one tensor-parallel group share it
    rank: int
    tp_size: int
    addr: str  # host:port of its gRPC Worker service
    # Only a scheduler of the same mode claims it; the default keeps announcements from
    # before the field readable.
    disaggregation_mode: str = NO_ROLE

    @property
    def key(self) -> str:
        return f"{key_part(self.group)}.{self.rank}"

    @classmethod
    def from_json(cls, value: bytes) -> WorkerRank:
        """An announcement as stored. Fields this version does not know are dropped, so a
        newer worker's announcement does not stop an older scheduler from reading the rest."""
        data: dict[str, Any] = json.loads(value)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Claim:
    """A worker group a scheduler drives: its ranks' addresses, rank 0 first."""

    group: str
    addrs: list[str]


async def bucket(nc: NATS, name: str) -> KeyValue:
    """The bucket, created (with the expiry, replicated over a cluster: bus_replicas) by
    whoever comes first."""
    js = nc.jetstream()
    try:
        return await js.key_value(name)
    except BucketNotFoundError:
        return await js.create_key_value(bucket=name, ttl=TTL_S, history=1,
                                         replicas=bus_replicas(nc))


class Announcer:
    """A worker rank keeps its entry alive until closed; NATS may come and go meanwhile."""

    def __init__(self, nats_url: str, rank: WorkerRank) -> None:
        self.nats_url = nats_url
        self.rank = rank
        self._nc: NATS | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        value = json.dumps(asdict(self.rank)).encode()
        said = False
        while True:
            try:
                if self._nc is None:
                    self._nc = await connect_bus(self.nats_url, f"worker-{self.rank.key}")
                await (await bucket(self._nc, WORKERS_BUCKET)).put(self.rank.key, value)
                if not said:
                    log.info("announced worker rank %s", self.rank)
                    said = True
            except Exception as exc:  # NATS away: try again next round
                log.warning("announcing worker rank %s failed: %s", self.rank.key, exc)
            await asyncio.sleep(RENEW_S)

    async def close(self) -> None:
        """Withdraw the announcement (schedulers stop claiming this rank at once)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await (await bucket(self._nc, WORKERS_BUCKET)).delete(self.rank.key)
            await self._nc.close()
            self._nc = None


async def announced(nc: NATS) -> dict[str, dict[int, WorkerRank]]:
    """Every announced rank, by group and rank."""
    kv = await bucket(nc, WORKERS_BUCKET)
    groups: dict[str, dict[int, WorkerRank]] = {}
    try:
        keys = await kv.keys()
    except NoKeysError:
        return groups
    for key in keys:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue
        if entry.value:
            rank = WorkerRank.from_json(entry.value)
            groups.setdefault(rank.group, {})[rank.rank] = rank
    return groups


async def take(kv: KeyValue, group: str, engine_id: str) -> bool:
    """Claim `group` for `engine_id`: yes where it was free or already ours."""
    key, mine = key_part(group), engine_id.encode()
    try:
        await kv.create(key, mine)
        return True
    except KeyWrongLastSequenceError:
        pass
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return False  # expired meanwhile: the next round may create it
    if entry.value != mine:
        return False
    try:
        await kv.update(key, mine, last=entry.revision)
    except KeyWrongLastSequenceError:
        return False
    return True


async def claim_workers(nc: NATS, engine_id: str, prefer: str | None = None,
                        disaggregation_mode: str = NO_ROLE) -> Claim:
    """Wait for a group whose every rank is announced in `disaggregation_mode` and claim it
    (`prefer` first, when it is of that mode)."""
    waited = False
    while True:
        try:
            claims = await bucket(nc, CLAIMS_BUCKET)
            groups = await announced(nc)
            for group in sorted(groups, key=lambda g: (g != prefer, g)):
                ranks = groups[group]
                # Every rank, not just rank 0: a group whose ranks disagree (restarted with
                # another mode part way) is nobody's until they agree again.
                if any(r.disaggregation_mode != disaggregation_mode for r in ranks.values()):
                    continue
                size = next(iter(ranks.values())).tp_size
                if sorted(ranks) == list(range(size)) and await take(claims, group, engine_id):
                    claim = Claim(group, [ranks[r].addr for r in range(size)])
                    log.info("engine %s claimed %s worker group %s at %s", engine_id,
                             disaggregation_mode, group, ",".join(claim.addrs))
                    return claim
        except Exception as exc:  # NATS away: look again
            log.warning("engine %s: looking for workers failed: %s", engine_id, exc)
        if not waited:
            log.info("engine %s: waiting for a free %s worker group on NATS", engine_id,
                     disaggregation_mode)
            waited = True
        await asyncio.sleep(POLL_S)


async def keep_claim(nc: NATS, claim: Claim, engine_id: str) -> None:
    """Renew the claim until cancelled (then release it)."""
    try:
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                await (await bucket(nc, CLAIMS_BUCKET)).put(key_part(claim.group),
                                                            engine_id.encode())
            except Exception as exc:
                log.warning("engine %s: renewing its claim failed: %s", engine_id, exc)
    finally:
        with contextlib.suppress(Exception):
            await (await bucket(nc, CLAIMS_BUCKET)).delete(key_part(claim.group))
