"""Embedding models: how a checkpoint pools a prompt's final hidden states into one vector,
and how that vector is finished for a client.

A decoder served as an embedding model computes its prompt once (prefill only) and pools
the final (normed) hidden states: the last token's, their mean, or the first token's (CLS),
as the checkpoint's sentence-transformers config says (`modules.json`, `1_Pooling/
config.json`) or, in a GGUF file, its `pooling_type`; else the last token's. The vector is
L2-normalized when the config lists a Normalize module (always, without a config), after
being cut to the `dimensions` a client asks for (Matryoshka embeddings)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixmesh.core.gguf import read_gguf
from radixmesh.core.model_files import is_gguf
from radixmesh.core.request import RequestError

# What a request's prompt is pooled by (NewRequest.pooling); "" for generation.
POOLING_KINDS = ("last", "mean", "cls")
# sentence-transformers' Pooling flags, and GGUF's pooling_type values, for each kind.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
_GGUF_TYPES = {1: "mean", 2: "cls", 3: "last"}


class PoolingError(ValueError):
    """A checkpoint's pooling that cannot be served."""


@dataclass(frozen=True)
class Pooling:
    """How the served model turns a prompt into its embedding."""

    kind: str = "last"
    normalize: bool = True

    def check_dimensions(self, dimensions: object, hidden_size: int) -> int | None:
        """A client's `dimensions` (None: the model's own), or RequestError naming it."""
        if dimensions is None:
            return None
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not (
                1 <= dimensions <= hidden_size):
            raise RequestError(f"dimensions must be an integer from 1 to {hidden_size} (the "
                               f"model's), got {dimensions!r}", "dimensions")
        return dimensions

    def finish(self, vector: list[float], dimensions: int | None = None) -> list[float]:
        """The client's embedding from the pooled hidden state: its first `dimensions`
        values (all without), L2-normalized when the model normalizes."""
        out = vector[:dimensions] if dimensions else list(vector)
        if self.normalize:
            norm = math.sqrt(math.fsum(v * v for v in out))
            if norm > 0:
                out = [v / norm for v in out]
        return out


def read_pooling(model_path: Path, gguf_metadata: Mapping[str, Any] | None = None
                 ) -> Pooling | None:
    """The pooling the checkpoint at `model_path` declares (None: it declares none, so it is
    not an embedding model by itself). PoolingError for a kind not served (max, weighted)."""
    if gguf_metadata is not None:
        arch = gguf_metadata.get("general.architecture", "")
        value = gguf_metadata.get(f"{arch}.pooling_type")
        if value in (None, 0):
            return None
        if value not in _GGUF_TYPES:
            raise PoolingError(f"GGUF pooling_type {value} is not served (mean, cls or last)")
        return Pooling(_GGUF_TYPES[value])
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in types:
        return None
    config_file = model_path / types["Pooling"].get("path", "1_Pooling") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    chosen = [kind for flag, kind in _ST_MODES.items() if config.get(flag)]
    others = sorted(f for f, on in config.items()
                    if f.startswith("pooling_mode_") and on and f not in _ST_MODES)
    if others or len(chosen) > 1:
        raise PoolingError(f"sentence-transformers pooling {others or chosen} is not served: "
                           "one of last token, mean or CLS")
    return Pooling(chosen[0] if chosen else "last", normalize="Normalize" in types)


def model_pooling(model_path: Path, is_embedding: bool) -> Pooling | None:
    """How the model at `model_path` is served: pooled as its checkpoint declares, or by
    the last token where `is_embedding` asks for embeddings of a model that declares
    nothing; None: it generates."""
    metadata = read_gguf(model_path, tensors=False).metadata if is_gguf(model_path) else None
    declared = read_pooling(model_path, metadata)
    if declared is None and is_embedding:
        return Pooling()
    return declared
