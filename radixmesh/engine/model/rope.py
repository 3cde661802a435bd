"""Rotary position embedding tables (the rotate-half layout Hugging Face checkpoints use)."""

from __future__ import annotations

import math
from typing import Any

import torch

from radixmesh.kernels import native


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Per-pair rotation frequencies, with the checkpoint's rope scaling applied."""
    # float32 throughout, as the checkpoints' reference implementation computes it.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, scaled)
        return torch.where(wavelen < old_ctx / high, inv_freq, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding:
    """cos/sin tables per position, looked up once per step and shared by every layer."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        dtype: torch.dtype,
        scaling: dict[str, Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        angles = torch.cat((angles, angles), dim=-1)
        # Cast like the reference does, so bf16 models rotate in bf16 as they were trained.
        self.cos = angles.cos().to(device, dtype)
        self.sin = angles.sin().to(device, dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for the step's token positions [T]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class RotaryStep:
    """One step's rotation at its token positions, shared by every layer: the native kernel
    in place where it is built, else torch over tables looked up once per step."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.rope, self.positions = rope, positions
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated; x itself (rotated in place) on the native path."""
        if native.rotary_supported(x, self.rope.cos):
            return native.rotary_(x, self.positions, self.rope.cos, self.rope.sin)
        if self._tables is None:
            self._tables = self.rope.tables(self.positions)
        return apply_rotary(x, *self._tables)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (q and k heads side by side are fine) by tables from `tables`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
