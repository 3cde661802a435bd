"""RoPE scaling as checkpoints state it (config.json's rope_parameters / rope_scaling, GGUF's
rope.scaling keys), brought to the one form rope.py's tables take: each kind's values as
transformers reads or derives them."""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("radixmesh.worker")

# Phi-3's original context when config.json leaves it out (Phi3Config's default).
_PHI3_ORIGINAL_CONTEXT = 4096


def rope_scaling(
    rope: dict[str, Any], cfg: dict[str, Any], model_type: str
) -> dict[str, Any] | None:
    """A config.json's rope scaling (None for plain RoPE), LongRoPE's as longrope_scaling
    gives it. Its old names are read as transformers reads them: "su" always, and "yarn" in
    a Phi-3 config."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "su" or (model_type == "phi3" and kind == "yarn"):
        kind = "longrope"
    if kind == "yarn":
        return yarn_scaling(rope, cfg.get("max_position_embeddings", 4096))
    if kind != "longrope":
        return rope
    context = cfg.get("max_position_embeddings", 4096)
    if model_type == "phi3":  # its top-level value wins, as in transformers
        original = cfg.get("original_max_position_embeddings", _PHI3_ORIGINAL_CONTEXT)
    else:
        original = rope.get("original_max_position_embeddings") or context
    return longrope_scaling(rope["short_factor"], original, context,
                            rope.get("attention_factor"), rope.get("factor"))


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude factor for a context stretched by `factor` (DeepSeek scales it by
    its mscale / mscale_all_dim `m`)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_scaling(rope: dict[str, Any], context: int) -> dict[str, Any]:
    """YaRN's rope scaling as rope.py takes it, each value as transformers reads or derives
    it: the factor (else `context` over the original context), the attention factor cos and
    sin are scaled by (else from the factor, and DeepSeek's mscale / mscale_all_dim), the
    ramp's ends `beta_fast`/`beta_slow` (32 and 1) and whether they are rounded (`truncate`,
    true unless the file says not: gpt-oss)."""
    original = rope.get("original_max_position_embeddings") or context
    factor = rope.get("factor") or context / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                            else yarn_mscale(factor))
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
        "truncate": bool(rope.get("truncate", True)),
    }


def longrope_scaling(
    short_factor: list[float],
    original_context: int,
    context: int,
    attention_factor: float | None = None,
    factor: float | None = None,
) -> dict[str, Any]:
    """LongRoPE's rope scaling as rope.py takes it: the per-frequency divisors of sequences
    within `original_context` (its short factors) and the factor cos and sin are scaled by;
    without one, that comes from the context's growth as transformers derives it (`context`:
    the uncapped max_position_embeddings).

    Its long factors are left out: transformers rotates a sequence that outgrows the original
    context with them, all of it again (Phi-3's generate drops its KV cache at that step), so
    no per-position table reproduces it, and a token's K would change as its sequence grows,
    which a prefix cache cannot hold. The context is capped to the original one instead (see
    capped_context), within which this is exact."""
    if factor is None:
        factor = context / original_context
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0
            else math.sqrt(1 + math.log(factor) / math.log(original_context))
        )
    return {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in short_factor],
        "original_max_position_embeddings": int(original_context),
        "attention_factor": float(attention_factor),
    }


def capped_context(context: int, rope_scaling: dict[str, Any] | None, name: str) -> int:
    """`context`, capped to a LongRoPE scaling's original context (see longrope_scaling):
    within it the model is exact; the engine's context length never exceeds this value."""
    original = (rope_scaling or {}).get("original_max_position_embeddings", context)
    if (rope_scaling or {}).get("rope_type") == "longrope" and original < context:
        log.warning("%s: longrope rope scaling: context capped to its original %d (its long "
                    "factors, for longer sequences, are not implemented)", name, original)
        context = original
    return int(context)
