"""The knobs of one engine replica's scheduler: its KV pool's capacity and page, its
policies, and the tiers and speculation it runs with."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from radixmesh.core.model_info import HYBRID_FAMILIES, LATENT_FAMILIES
from radixmesh.core.settings import ReplicaSettings, SpeculativeSettings


@dataclass(frozen=True)
class SchedulerConfig:
    """Capacity and policy knobs of one engine replica's scheduler."""

    num_slots: int
    page_size: int = 1
    max_running_requests: int = 64
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"
    eviction_policy: str = "lru"
    slru_protected_ratio: float = 0.8
    context_length: int = 8192
    eos_token_ids: tuple[int, ...] = ()
    # Fraction of the running requests' remaining output budget kept free when admitting
    # new prompts; retraction covers the rest when the guess is too low.
    decode_reserve_ratio: float = 0.25
    host_write_policy: str = "write_through"  # with the host tier (attach_host)
    host_write_threshold: int = 2
    # With a storage tier behind the host tier (the host pool names one).
    storage_page_tokens: int = 64
    prefetch_policy: str = "timeout"
    prefetch_timeout: float = 2.0
    prefetch_threshold: int = 256
    model_fingerprint: str = ""  # names the weights in storage page keys
    speculative: SpeculativeSettings = SpeculativeSettings()  # drafts (off by default)
    # Disaggregation: seconds a decode engine waits for a prompt's KV before prefilling it.
    transfer_timeout: float = 60.0
    # Priority scheduling (radixmesh.engine.priority): off, the schedule policy alone.
    enable_priority_scheduling: bool = False
    low_priority_values_first: bool = False
    preemption_threshold: int = 10
    # LoRA: the adapters the runners serve, how many the running requests may use at once
    # (the runners' device slots), and those that hold a slot for good.
    lora_names: frozenset[str] = frozenset()
    max_loras_per_batch: int = 8
    lora_pinned: frozenset[str] = frozenset()
    # A hybrid linear-attention model: a request starts from a cached prefix only where the
    # radix tree keeps a snapshot of the linear layers' state at its end, in one of the
    # worker's `state_snapshots` slots (state_snapshots.py).
    hybrid: bool = False
    state_snapshots: int = 0

    @classmethod
    def from_settings(
        cls,
        settings: ReplicaSettings,
        page_size: int,
        num_slots: int,
        max_position_embeddings: int,
        eos_token_ids: Iterable[int],
        model_fingerprint: str = "",
        architecture: str = "",
        disaggregation_mode: str = "null",
        state_snapshots: int = 0,
    ) -> SchedulerConfig:
        """An engine's scheduler: its settings on the model (of family `architecture`) and
        KV pool (and a hybrid model's `state_snapshots` slots) it got, in its disaggregation
        role; raises ValueError for a combination it cannot serve (check_family)."""
        check_family(architecture, settings, disaggregation_mode)
        hybrid = architecture in HYBRID_FAMILIES
        return cls(
            num_slots=num_slots,
            page_size=page_size,
            max_running_requests=settings.max_running_requests,
            chunked_prefill_size=settings.chunked_prefill_size,
            schedule_policy=settings.schedule_policy,
            eviction_policy=settings.radix_eviction_policy,
            slru_protected_ratio=settings.radix_slru_protected_ratio,
            context_length=settings.context_limit(max_position_embeddings),
            eos_token_ids=tuple(dict.fromkeys(eos_token_ids)),
            host_write_policy=settings.hicache_write_policy,
            host_write_threshold=settings.hicache_write_through_threshold,
            storage_page_tokens=settings.hicache_storage_page_size,
            prefetch_policy=settings.hicache_storage_prefetch_policy,
            prefetch_timeout=settings.hicache_storage_prefetch_timeout,
            prefetch_threshold=settings.hicache_storage_prefetch_threshold,
            model_fingerprint=model_fingerprint,
            speculative=settings,
            enable_priority_scheduling=settings.enable_priority_scheduling,
            low_priority_values_first=settings.schedule_low_priority_values_first,
            preemption_threshold=settings.priority_scheduling_preemption_threshold,
            hybrid=hybrid,
            state_snapshots=state_snapshots,
        )


def check_family(architecture: str, settings: ReplicaSettings,
                 disaggregation_mode: str) -> None:
    """Refuse what a family cannot run with yet. A hybrid linear-attention model's linear
    layers keep a state, in the worker's state pool and its snapshot slots alone, that would
    have to be rolled back (speculative decoding's rejected drafts) or travel with the KV
    (prefill/decode disaggregation, the hierarchical cache's tiers). A latent-attention
    model's pool holds one latent per token, where those tiers and the KV sent between
    prefill and decode engines are laid out as K and V per head."""
    hybrid = architecture in HYBRID_FAMILIES
    if not hybrid and architecture not in LATENT_FAMILIES:
        return
    refused = [name for name, on in (
        (f"speculative_algorithm {settings.speculative_algorithm}",
         hybrid and settings.speculative_algorithm is not None),
        (f"disaggregation_mode {disaggregation_mode}", disaggregation_mode != "null"),
        ("enable_hierarchical_cache", settings.enable_hierarchical_cache),
    ) if on]
    if refused:
        combination = " or ".join(refused)
        raise ValueError(
            f"{architecture} is a hybrid linear-attention model: it cannot run with "
            f"{combination}" if hybrid else
            f"{architecture} caches latents (multi-head latent attention): it cannot run "
            f"with {combination} yet")
