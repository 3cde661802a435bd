"""Reading a Hugging Face model directory: config.json and (sharded) safetensors."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixmesh.engine.model.model_config import GEMMA, LinearAttentionShape, ModelConfig
from radixmesh.engine.model.moe import expert_weight_name

if TYPE_CHECKING:
    import torch

    from radixmesh.engine.model.linear import Weight

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers some checkpoints carry that are not parameters.
_DROPPED_SUFFIXES = ("rotary_emb.inv_freq",)
# A multimodal Gemma 3 checkpoint's text model under the text-only names; its vision parts
# are not read. A base model saved alone (an embedding checkpoint: Qwen3-Embedding,
# gte-Qwen2) under the causal LM's names.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("embed_tokens.", "model.embed_tokens."),
                  ("layers.", "model.layers."), ("norm.", "model.norm."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.", "model.visual.", "visual.")
# Qwen3-Next's and Qwen3.5's multi-token-prediction head, which serving does not read.
_UNREAD_PREFIXES = ("mtp.", "model.mtp.")
# The hybrids' linear-attention output norm scales by its weight; their other norms by
# 1 + weight, which the loader stores as Gemma's are.
_PLAIN_NORM = ".linear_attn.norm.weight"
# Mixtral's per-expert projections (w1 gate, w3 up, w2 down) under moe.py's names.
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


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


def expert_tensors(key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint tensor under the names the model takes: expert weights one per expert
    (moe.expert_weight_name), everything else as it is.

    transformers 5 writes experts one by one by default (Qwen3-MoE
    `mlp.experts.{e}.{gate,up,down}_proj.weight`; Mixtral
    `block_sparse_moe.experts.{e}.w1/w3/w2.weight`, router `block_sparse_moe.gate.weight`),
    and fused 3-D tensors with save_original_format=False or from its own runtime layout:
    `mlp.experts.gate_up_proj` [E, 2I, hidden] (gate rows first) and `mlp.experts.down_proj`
    [E, hidden, I]."""
    key = key.replace(".block_sparse_moe.", ".mlp.")
    head, _, last = key.rpartition(".experts.")
    if not head:
        yield key, tensor
        return
    parts = last.split(".")
    if tensor.dim() == 3 and last in ("gate_up_proj", "down_proj"):
        for e, weight in enumerate(tensor.unbind(0)):
            if last == "down_proj":
                yield expert_weight_name(head, e, "down_proj"), weight
            else:
                gate, up = weight.chunk(2, dim=0)
                yield expert_weight_name(head, e, "gate_proj"), gate
                yield expert_weight_name(head, e, "up_proj"), up
    elif len(parts) == 3 and parts[1] in _MIXTRAL_EXPERT:
        yield expert_weight_name(head, int(parts[0]), _MIXTRAL_EXPERT[parts[1]]), tensor
    else:
        yield key, tensor


def checkpoint_tensors(
    key: str, tensor: torch.Tensor, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint tensor under the names the model takes: Phi-3's fused projections split
    (`self_attn.qkv_proj` into q/k/v_proj, rows q | k | v; `mlp.gate_up_proj` into
    gate/up_proj, gate rows first), experts one by one (expert_tensors), the rest as it is.

    One layout for every family keeps one model and one tensor-parallel sharding, which
    splits q/k/v and gate/up by name; the model fuses them again into one matmul each.

    Gemma's norms scale by 1 + weight: the weight is stored plus one (as llama.cpp's files
    hold it), so every family's norm is the same product; the hybrid families' norms too
    (all but their linear attention's). A multimodal Gemma 3 or Qwen3.5 file gives its text
    model's tensors under the text model's names, nothing of its vision parts. Qwen3-Next's
    linear-attention projections are reordered as Qwen3.5 lays them out (linear_tensors)."""
    if key.startswith(_VISION_PREFIXES + _UNREAD_PREFIXES):
        return
    for old, new in _TEXT_PREFIXES:
        if key.startswith(old):
            key = new + key.removeprefix(old)
    zero_centred = config.architecture in GEMMA or (
        config.is_hybrid and not key.endswith(_PLAIN_NORM))
    if zero_centred and key.endswith("norm.weight"):
        yield key, tensor + 1
        return
    if config.linear is not None and ".linear_attn.in_proj_" in key:
        yield from linear_tensors(key, tensor, config.linear)
        return
    if config.expert_bias and ".mlp." in key:
        yield from gpt_oss_tensors(key, tensor)
        return
    head, _, last = key.rpartition(".")
    if head.endswith(".self_attn.qkv_proj"):
        prefix = head.removesuffix("qkv_proj")
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        parts = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    elif head.endswith(".mlp.gate_up_proj") and tensor.dim() == 2:
        prefix = head.removesuffix("gate_up_proj")
        parts = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    else:
        yield from expert_tensors(key, tensor)
        return
    if tensor.shape[0] != sum(parts.values()):
        raise ValueError(f"{key}: {tensor.shape[0]} rows, expected "
                         f"{' + '.join(f'{n} {r}' for n, r in parts.items())}")
    for name, part in zip(parts, tensor.split(list(parts.values())), strict=True):
        yield f"{prefix}{name}.{last}", part


# MXFP4 (OCP microscaling FP4, as gpt-oss's checkpoints store their experts): 4-bit E2M1
# values, two a byte (low nibble first), in blocks of 32 that share a power-of-two scale
# (an E8M0 byte, exponent + 127).
_MXFP4_PARTS = ("_blocks", "_scales")
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An MXFP4 tensor in float32: blocks [E, out, groups, 16] uint8 and scales [E, out,
    groups] uint8 -> [E, groups * 32, out], the layout the checkpoint's dense form has
    (gpt-oss multiplies x @ W)."""
    import torch

    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} "
                         "do not match ([..., groups, 16] and [..., groups])")
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.long)
    values = torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).transpose(1, 2).contiguous()


def gpt_oss_tensors(key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss MLP tensor under the names the model takes: the router as `gate`, and its
    experts' fused tensors one expert at a time. gpt-oss multiplies x @ W with gate_up_proj
    [E, hidden, 2I], gate and up columns interleaved (gate first), and down_proj [E, I,
    hidden]; each expert's weights come out as [out, in] rows like every other Linear's,
    their biases (gate_up_proj_bias [E, 2I], down_proj_bias [E, hidden]) beside them."""
    head, _, last = key.rpartition(".")
    if head.endswith(".mlp.router"):
        yield f"{head.removesuffix('router')}gate.{last}", tensor
        return
    mlp, _, name = key.rpartition(".experts.")
    if not mlp:
        yield key, tensor
        return
    bias = name.endswith("_bias")
    for e, part in enumerate(tensor.unbind(0)):
        def named(projection: str, e: int = e) -> str:
            weight = expert_weight_name(mlp, e, projection)
            return weight.removesuffix("weight") + "bias" if bias else weight

        if name.startswith("gate_up_proj"):
            gate, up = part[..., 0::2], part[..., 1::2]
            yield named("gate_proj"), gate if bias else gate.t().contiguous()
            yield named("up_proj"), up if bias else up.t().contiguous()
        elif name.startswith("down_proj"):
            yield named("down_proj"), part if bias else part.t().contiguous()
        else:
            raise ValueError(f"{key}: not a gpt-oss expert tensor")


def linear_tensors(
    key: str, tensor: torch.Tensor, shape: LinearAttentionShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """A linear-attention input projection under Qwen3.5's names and layout: in_proj_qkv
    (q of every k head, then k, then v of every v head), in_proj_z, in_proj_b, in_proj_a.

    Qwen3-Next groups its rows by k head instead: in_proj_qkvz holds, for each k head, its q,
    its k, then the v and z of the v heads it serves; in_proj_ba, for each k head, the b and
    then the a of those v heads."""
    import torch

    head, _, name = key.rpartition(".in_proj_")
    if name not in ("qkvz.weight", "ba.weight"):
        yield key, tensor
        return
    group = shape.num_v_heads // shape.num_k_heads
    if name == "ba.weight":
        parts = {"b": group, "a": group}
    else:
        parts = {"q": shape.k_head_dim, "k": shape.k_head_dim,
                 "v": group * shape.v_head_dim, "z": group * shape.v_head_dim}
    per_head = tensor.view(shape.num_k_heads, sum(parts.values()), tensor.shape[-1])
    split = dict(zip(parts, per_head.split(list(parts.values()), dim=1), strict=True))
    flat = {part: rows.reshape(-1, tensor.shape[-1]) for part, rows in split.items()}
    if name == "ba.weight":
        yield f"{head}.in_proj_b.weight", flat["b"]
        yield f"{head}.in_proj_a.weight", flat["a"]
        return
    yield f"{head}.in_proj_qkv.weight", torch.cat([flat["q"], flat["k"], flat["v"]])
    yield f"{head}.in_proj_z.weight", flat["z"]


def load_hf_dir(
    model_dir: str | Path,
    progress: bool = True,
    convert: Callable[[str, torch.Tensor], Weight] | None = None,
) -> tuple[ModelConfig, dict[str, Weight]]:
    """Read config and weights from a Hugging Face directory; weights converted to float32
    (fused projections split and experts one by one, see checkpoint_tensors), then passed
    through `convert` (name, tensor) one by one if given."""
    import torch
    from safetensors import safe_open
    from tqdm import tqdm

    model_dir = Path(model_dir)
    config = config_from_hf_dir(model_dir)
    files = safetensors_files(model_dir)
    weights: dict[str, Weight] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 tensors waiting for their other part
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
                    if key.endswith(_MXFP4_PARTS):  # dequantized once both parts are read
                        base, _, part_name = key.rpartition("_")
                        parts = packed.setdefault(base, {})
                        parts[part_name] = fh.get_tensor(key)
                        if len(parts) < 2:
                            bar.update()
                            continue
                        key, t = base, mxfp4_dequantize(parts["blocks"], parts["scales"])
                        del packed[base]
                    else:
                        t = fh.get_tensor(key).to(torch.float32)
                    for name, part in checkpoint_tensors(key, t, config):
                        part = part.contiguous()
                        weights[name] = part if convert is None else convert(name, part)
                    bar.update()
    if packed:
        raise ValueError(f"{model_dir}: MXFP4 tensors without their other part: "
                         f"{', '.join(sorted(packed))}")
    if "lm_head.weight" not in weights and (model_dir / "modules.json").is_file():
        # A sentence-transformers checkpoint of the base model alone: it embeds, and its
        # logits (unused) come from the embeddings.
        config = dataclasses.replace(config, tie_word_embeddings=True)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{model_dir}: untied embeddings but no lm_head.weight in the checkpoint")
    return config, weights
