"""Reading a Hugging Face model directory: config.json and (sharded) safetensors."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixmesh.engine.model.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

    from radixmesh.engine.model.linear import Weight

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers some checkpoints carry that are not parameters.
_DROPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def config_from_hf_dir(model_dir: str | Path) -> ModelConfig:
    """ModelConfig from config.json, with eos ids from generation_config.json merged in."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json")
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    config = ModelConfig.from_hf_dict(cfg, name=model_dir.name)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text(encoding="utf-8"))
        eos = list(config.eos_token_ids)
        eos += [i for i in _eos_list(gen.get("eos_token_id")) if i not in eos]
        bos = config.bos_token_id if config.bos_token_id is not None else gen.get("bos_token_id")
        config = dataclasses.replace(config, eos_token_ids=tuple(eos), bos_token_id=bos)
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those named by the index, or every *.safetensors."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    return files


def load_hf_dir(
    model_dir: str | Path,
    progress: bool = True,
    convert: Callable[[str, torch.Tensor], Weight] | None = None,
) -> tuple[ModelConfig, dict[str, Weight]]:
    """Read config and weights from a Hugging Face directory; weights converted to float32,
    then passed through `convert` (name, tensor) one by one if given."""
    import torch
    from safetensors import safe_open
    from tqdm import tqdm

    model_dir = Path(model_dir)
    config = config_from_hf_dir(model_dir)
    files = safetensors_files(model_dir)
    weights: dict[str, Weight] = {}
    bar = tqdm(desc=f"loading {model_dir.name}", unit="tensor", disable=not progress)
    with bar:
        for file in files:
            with safe_open(str(file), framework="pt") as fh:
                keys = list(fh.keys())
                bar.total = (bar.total or 0) + len(keys)
                bar.refresh()
                for key in keys:
                    if key.endswith(_DROPPED_SUFFIXES):
                        continue
                    t = fh.get_tensor(key)
                    t = t.to(torch.float32).contiguous()
                    weights[key] = t if convert is None else convert(key, t)
                    bar.update()
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{model_dir}: untied embeddings but no lm_head.weight in the checkpoint")
    return config, weights
