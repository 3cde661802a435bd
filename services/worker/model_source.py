"""Loading a model's config and weights from a GGUF file or a Hugging Face directory."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from radixmesh.core.model_files import is_gguf, resolve_model_path
from radixmesh.services.worker.model_config import ModelConfig

if TYPE_CHECKING:
    import torch


class LoadedModel(NamedTuple):
    config: ModelConfig
    weights: dict[str, torch.Tensor]


def load_model(path: str | None, progress: bool = True) -> LoadedModel:
    """Load a model's config and float32 weights, keyed by Hugging Face parameter names."""
    resolved = resolve_model_path(path)
    if is_gguf(resolved):
        from radixmesh.services.worker.weights_gguf import load_gguf

        config, weights = load_gguf(resolved, progress=progress)
    else:
        from radixmesh.services.worker.weights_hf import load_hf_dir

        config, weights = load_hf_dir(resolved, progress=progress)
    return LoadedModel(config, weights)
