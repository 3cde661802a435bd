"""Rotary position embedding tables (the rotate-half layout Hugging Face checkpoints use)."""

from __future__ import annotations

import math
from typing import Any

import torch

from radixmesh.kernels import native


def inverse_frequencies(
    dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Per-pair rotation frequencies of `dim` rotated dims, with the checkpoint's rope
    scaling applied."""
    # float32 throughout, as the checkpoints' reference implementation computes it.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "longrope":  # see rope_scaling.longrope_scaling
        assert scaling is not None
        factors = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        if factors.shape != exponents.shape:
            raise ValueError(f"longrope short_factor has {factors.numel()} values; the {dim} "
                             f"rotated dims need {exponents.numel()}")
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":  # see rope_scaling.yarn_scaling
        return yarn_frequencies(inv_freq, dim, theta, scaling)
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


def yarn_frequencies(
    inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those turning more than `beta_fast` times kept, and a
    linear ramp between (over dims, its ends rounded outward with `truncate`)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling["beta_fast"]), dim_of(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency kept as it is
    return inv_freq / factor * (1 - keep) + inv_freq * keep


class RotaryEmbedding:
    """cos/sin tables per position, looked up once per step and shared by every layer, for
    the leading `rotary_dim` dims of each head (all of `head_dim` if not given)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        dtype: torch.dtype,
        scaling: dict[str, Any] | None = None,
        device: torch.device | str = "cpu",
        rotary_dim: int | None = None,
    ) -> None:
        self.dim = rotary_dim or head_dim
        scaling = scaling or {}
        if (scaling.get("rope_type") == "longrope"
                and max_positions > scaling["original_max_position_embeddings"]):
            raise ValueError("longrope past the original context "
                             f"({scaling['original_max_position_embeddings']}) is not "
                             "implemented: cap the context to it (capped_context does)")
        inv_freq = inverse_frequencies(self.dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        # LongRoPE and YaRN scale both (in float32, before the cast, as transformers does).
        attention_factor = scaling.get("attention_factor", 1.0)
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        # Cast like the reference does, so bf16 models rotate in bf16 as they were trained.
        self.cos = cos.to(device, dtype)
        self.sin = sin.to(device, dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, rotary_dim] for the step's token positions [T]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class RotaryStep:
    """One step's rotation at its token positions, shared by every layer: the native kernel
    in place where it is built, else torch over tables looked up once per step."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.rope, self.positions = rope, positions
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated; x itself (rotated in place) on the native path."""
        rotated = self.rope.dim
        if rotated < x.shape[-1]:  # a partial rotary: the native kernel rotates whole heads
            head = apply_rotary(x[..., :rotated], *self._lookup())
            return torch.cat((head, x[..., rotated:]), dim=-1)
        if native.rotary_supported(x, self.rope.cos):
            return native.rotary_(x, self.positions, self.rope.cos, self.rope.sin)
        return apply_rotary(x, *self._lookup())

    def _lookup(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            self._tables = self.rope.tables(self.positions)
        return self._tables


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (q and k heads side by side are fine) by tables from `tables`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
