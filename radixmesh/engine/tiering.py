"""The KV tiers behind the device pool, as the scheduler calls them.

`NoTiers` stands in while no host pool is attached: every call does nothing. `HostTiers`
drives the host tier (write policies, loads, the step's copies) and `StorageTiers` adds the
storage tier behind it when the host pool names one. The scheduler calls the same methods
whichever it holds, so batching never asks which tiers are on."""

from __future__ import annotations

from collections.abc import Sequence

from radixmesh.core.hicache import HostPoolSpec, PageKeys
from radixmesh.core.step import KVCopy
from radixmesh.engine.host_tier import HostTier
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.engine.storage_tier import StorageTier
from radixmesh.engine.tree_node import TreeNode


class NoTiers:
    """The device pool alone."""

    host: HostTier | None = None
    storage: StorageTier | None = None

    def ask(self, req: Req) -> None:
        """A request arrived: look for more of its prefix in storage."""

    def waits(self, req: Req) -> bool:
        """Whether a request not admitted yet waits for its prefix from storage."""
        return False

    def forget(self, req: Req) -> None:
        """A request finished: stop waiting on storage for it."""

    def keep_on_evict(self, node: TreeNode) -> bool:
        """Device eviction is about to drop node: True keeps it (backed up instead)."""
        return False

    def has_copies(self) -> bool:
        """Whether copies wait for the next step."""
        return False

    def take_copies(self) -> list[KVCopy]:
        """The device<->host copies to send with the next step."""
        return []

    def load(self, nodes: Sequence[TreeNode], device_slots: list[int]) -> None:
        """Host-only nodes go back to the device, into these fresh slots."""
        raise AssertionError("no host tier holds a prefix to load")

    def admitted(self, node: TreeNode) -> None:
        """An admission hit the device prefix ending at node."""

    def cached(self, node: TreeNode) -> None:
        """The tree just cached the device prefix ending at node."""

    def cached_prefix(self, tokens: list[int], namespace: str | None) -> None:
        """The tree just cached these tokens (a page-aligned prefix) on the device."""

    def done(self, copy_ids: Sequence[int]) -> None:
        """Backups the worker finished."""

    def stats(self, cache: RadixCache) -> dict[str, int]:
        """The tiers' part of /server_info."""
        return {}

    def check_invariants(self, cache: RadixCache) -> None:
        """Every host slot is free, cached or on its way."""


class HostTiers(NoTiers):
    """The host tier behind the device pool."""

    def __init__(self, host: HostTier) -> None:
        self.host = host

    def keep_on_evict(self, node: TreeNode) -> bool:
        return self.host.keep_on_evict(node)

    def has_copies(self) -> bool:
        return self.host.has_copies()

    def take_copies(self) -> list[KVCopy]:
        return self.host.take_copies()

    def load(self, nodes: Sequence[TreeNode], device_slots: list[int]) -> None:
        self.host.load(nodes, device_slots)

    def admitted(self, node: TreeNode) -> None:
        self.host.admitted(node)

    def cached(self, node: TreeNode) -> None:
        self.host.cached(node)

    def cached_prefix(self, tokens: list[int], namespace: str | None) -> None:
        self.host.cached(self.host.cache.match_prefix(tokens, namespace, count_hit=False).node)

    def done(self, copy_ids: Sequence[int]) -> None:
        self.host.done(copy_ids)

    def stats(self, cache: RadixCache) -> dict[str, int]:
        host = self.host
        return {
            "host_slots": host.num_slots,
            "host_free_slots": host.allocator.available(),
            "host_cached_tokens": cache.host_size(),
            "host_pending_backups": cache.pending_backups(),
            "host_backup_tokens": host.stats.backup_tokens,
            "host_load_tokens": host.stats.load_tokens,
        }

    def check_invariants(self, cache: RadixCache) -> None:
        self._check_host_slots(cache, prefetching=0)

    def _check_host_slots(self, cache: RadixCache, prefetching: int) -> None:
        host = self.host
        free, cached = host.allocator.available(), cache.host_size()
        deferred = len(host.allocator.deferred)
        assert free + cached + deferred + prefetching == host.num_slots, (
            f"host slot leak: free {free} + cached {cached} + freed while read {deferred}"
            f" + prefetching {prefetching} != pool {host.num_slots}"
        )


class StorageTiers(HostTiers):
    """The host tier with the storage tier behind it."""

    def __init__(self, host: HostTier, storage: StorageTier) -> None:
        super().__init__(host)
        self.storage = storage

    def ask(self, req: Req) -> None:
        self.storage.ask(req)

    def waits(self, req: Req) -> bool:
        return self.storage.waits(req)

    def forget(self, req: Req) -> None:
        self.storage.forget(req.rid)

    def done(self, copy_ids: Sequence[int]) -> None:
        self.storage.backed_up(self.host.done(copy_ids))

    def stats(self, cache: RadixCache) -> dict[str, int]:
        s = self.storage.stats
        return super().stats(cache) | {
            "storage_pages_stored": s.pages_stored,
            "storage_queries": s.queries,
            "storage_prefetches": s.prefetches,
            "storage_prefetch_pages": s.prefetch_pages,
        }

    def check_invariants(self, cache: RadixCache) -> None:
        self._check_host_slots(cache, prefetching=self.storage.held_slots())


def attached_tiers(cache: RadixCache, spec: HostPoolSpec, config: SchedulerConfig) -> HostTiers:
    """The tiers behind `cache` once the host pool `spec` is attached: the host tier, and
    the storage tier behind it when the pool names one."""
    host = HostTier(cache, spec.num_slots, config.host_write_policy,
                    config.host_write_threshold)
    if not spec.storage:
        return HostTiers(host)
    keys = PageKeys(config.model_fingerprint, spec.geometry, config.storage_page_tokens)
    storage = StorageTier(cache, host, keys, config.prefetch_policy, config.prefetch_timeout,
                          config.prefetch_threshold)
    return StorageTiers(host, storage)
