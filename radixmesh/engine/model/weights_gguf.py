"""Loading GGUF weights: a ModelConfig from the metadata, and tensors under Hugging Face
names, each either kept in its quantized type (packed for the native kernels) or as float32.
Dequantization to float32 is delegated to ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from radixmesh.core.gguf import GGUFFile, GGUFTensorInfo, gguf_eos_token_ids, read_gguf
from radixmesh.engine.model.model_config import (
    GEMMA2_SOFTCAPS,
    GEMMA3_THETA,
    GEMMA_WINDOW_PERIOD,
    ModelConfig,
    gemma_fields,
    windowed_every,
)
from radixmesh.engine.model.moe import expert_weight_name
from radixmesh.engine.model.rope_scaling import capped_context, longrope_scaling, yarn_scaling
from radixmesh.kernels.native_quant import QUANT_TYPES, QuantizedWeight

if TYPE_CHECKING:
    import torch

    from radixmesh.engine.model.linear import Weight

_Rows = TypeVar("_Rows", np.ndarray, "torch.Tensor")
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3")
# llama.cpp's name for an architecture where Hugging Face's differs (Mixtral is "llama" with
# experts: see config_from_gguf).
_HF_ARCHITECTURE = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
_HF_GEMMA = {"gemma2": "gemma2", "gemma3": "gemma3_text"}  # llama.cpp's Gemma names
_SOFTMAX_GATING = 1  # gguf.ExpertGatingFuncType.SOFTMAX: the only routing served
# Architectures whose `attention.sliding_window` transformers would apply (Mistral's files are
# "llama"; llama.cpp's converter writes the window for Phi-3, 0 for none).
_WINDOWED = ("llama", "phi3")
# Gemma 2's window where the file gives none, as llama.cpp takes it (its converter writes
# the window and the soft caps; model_config holds the other defaults both loaders share).
_GEMMA2_WINDOW = 4096
# The layer counts of Gemma 2 27B and Gemma 3 27B: see _gemma_fields.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# ggml tensor types whose float32 conversion needs no block decoding.
_GGML_F32, _GGML_F16, _GGML_BF16 = 0, 1, 30


def _f32(value: Any) -> float:
    """GGUF stores floats as float32; give back the shortest decimal that rounds to it."""
    return float(str(np.float32(value)))


def config_from_gguf(gf: GGUFFile, name: str | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata (llama / qwen2 / qwen3 / qwen3moe / phi3 / gemma2 /
    gemma3 keys) and the tensor directory (with LongRoPE's factors, read from their
    tensors)."""
    md = gf.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gf.path}: unsupported GGUF architecture {arch!r}")

    def key(k: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{k}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv") or heads
    if isinstance(kv_heads, list):  # per-layer list in some files
        kv_heads = kv_heads[0]
    head_dim = int(key("attention.key_length") or hidden // heads)

    embd = gf.tensors.get("token_embd.weight")
    vocab = key("vocab_size")
    if vocab is None:
        vocab = embd.shape[0] if embd is not None else len(md["tokenizer.ggml.tokens"])

    context = int(key("context_length", 4096))
    layers = int(key("block_count"))
    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if "rope_factors_short.weight" in gf.tensors:  # LongRoPE (Phi-3 128k), as llama.cpp stores it
        attention_factor = key("rope.scaling.attn_factor")
        rope_scaling = longrope_scaling(
            _read_floats(gf, "rope_factors_short.weight"),
            int(key("rope.scaling.original_context_length")),
            context,
            None if attention_factor is None else _f32(attention_factor),
        )
    elif scaling_type == "yarn":
        yarn = {"factor": key("rope.scaling.factor"),
                "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                "attention_factor": key("rope.scaling.attn_factor"),
                "beta_fast": key("rope.scaling.yarn_beta_fast"),
                "beta_slow": key("rope.scaling.yarn_beta_slow")}
        rope_scaling = yarn_scaling({k: v for k, v in yarn.items() if v is not None}, context)
    elif scaling_type and scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": _f32(key("rope.scaling.factor", 1.0))}
        orig = key("rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)

    bos = md.get("tokenizer.ggml.bos_token_id")
    experts = int(key("expert_count", 0))
    architecture = "mixtral" if arch == "llama" and experts else _HF_ARCHITECTURE.get(arch, arch)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=capped_context(context, rope_scaling, name or gf.path.name),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=gguf_eos_token_ids(md),
        name=name or gf.path.name.removesuffix(".gguf"),
        **_moe_shape(gf, arch, experts),
        rotary_dim=int(key("rope.dimension_count") or head_dim),
        layer_windows=_layer_windows(md, arch, context, layers),
        **_gemma_fields(md, arch, hidden, heads, head_dim, layers),
    )


def _layer_windows(md: dict[str, Any], arch: str, context: int, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: none) as llama.cpp applies the file's: on every layer
    of the _WINDOWED architectures; for Gemma on the layers `attention.sliding_window_pattern`
    marks (a period, all but its last layer windowed, or one flag per layer), else on those
    of GEMMA_WINDOW_PERIOD. Empty where no window can bind."""
    window = md.get(f"{arch}.attention.sliding_window")
    if arch == "gemma2" and window is None:
        window = _GEMMA2_WINDOW
    if not window or window >= context:
        return ()
    if arch not in _HF_GEMMA:
        return (int(window),) * layers if arch in _WINDOWED else ()
    pattern = md.get(f"{arch}.attention.sliding_window_pattern",
                     GEMMA_WINDOW_PERIOD[_HF_GEMMA[arch]])
    if isinstance(pattern, list):
        windowed = [bool(flag) for flag in pattern]
    else:  # llama.cpp's set_swa_pattern: a period of 0 windows every layer
        windowed = windowed_every(pattern, layers)
    if len(windowed) != layers:
        raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(windowed)} "
                         f"flags for {layers} layers")
    return tuple(int(window) if w else 0 for w in windowed)


def _gemma_fields(
    md: dict[str, Any], arch: str, hidden: int, heads: int, head_dim: int, layers: int
) -> dict[str, Any]:
    """The ModelConfig fields only Gemma sets (none for the other architectures), as llama.cpp
    reads them: Gemma 2's soft caps, Gemma 3's final cap if any and the base of its windowed
    layers (which the global layers' linear scaling, if any, leaves alone).

    A GGUF carries no query_pre_attn_scalar: llama.cpp scales attention by head_dim^-0.5,
    except for the 27B models, where Gemma scales by (hidden / heads)^-0.5. It tells those
    apart by the layer count alone (46: Gemma 2 27B, 62: Gemma 3 27B), and so does this."""
    if arch not in _HF_GEMMA:
        return {}

    def key(k: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{k}", default)

    if arch == "gemma2":
        attn_cap = _f32(key("attn_logit_softcapping", GEMMA2_SOFTCAPS[0]))
        final_cap = _f32(key("final_logit_softcapping", GEMMA2_SOFTCAPS[1]))
        local_theta = 0.0
    else:
        attn_cap, final_cap = 0.0, _f32(key("final_logit_softcapping", 0.0))
        local_theta = _f32(key("rope.freq_base_swa", GEMMA3_THETA[1]))
    scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    return {"local_rope_theta": local_theta,
            **gemma_fields(hidden, scalar, attn_cap, final_cap)}


def _read_floats(gf: GGUFFile, name: str) -> list[float]:
    """A small float tensor's values, read straight from the file."""
    info = gf.tensors[name]
    with open(gf.path, "rb") as fh:
        fh.seek(info.offset)
        raw = fh.read(info.nbytes)
    return dequantize_tensor(raw, dataclasses.replace(info, offset=0)).ravel().tolist()


def _moe_shape(gf: GGUFFile, arch: str, experts: int) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts GGUF (none for a dense one). The
    sparse layers are those with a router (`blk.N.ffn_gate_inp`); llama.cpp renormalizes
    the top-k weights for both qwen3moe and Mixtral unless `expert_weights_norm` says not."""
    if not experts:
        return {}
    md = gf.metadata

    def key(k: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{k}", default)

    if key("expert_gating_func", _SOFTMAX_GATING) != _SOFTMAX_GATING:
        raise ValueError(f"{gf.path}: only softmax expert routing is supported, not "
                         f"{arch}.expert_gating_func={key('expert_gating_func')}")
    if key("expert_shared_count", 0):
        raise ValueError(f"{gf.path}: shared experts ({arch}.expert_shared_count) are not "
                         "supported")
    layers = int(key("block_count"))
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(
            key("expert_feed_forward_length") or key("feed_forward_length")
        ),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
        "sparse_layers": tuple(
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in gf.tensors
        ),
    }


_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Gemma's norms around the attention and the MLP: its `ffn_norm` is the MLP's pre-norm.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Experts stacked into one 3-D tensor [experts, rows, inputs] per projection.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Tensors llama.cpp adds that have no Hugging Face parameter (precomputed RoPE factors).
_IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name of an `arch` file to the Hugging Face parameter name. Old
    Mixtral files name each expert's tensor (`blk.N.ffn_gate.E.weight`); see expert_names
    for the stacked ones."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    blocks = _GEMMA_BLOCK_NAMES if arch in _HF_GEMMA else _BLOCK_NAMES
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in blocks:
        return f"model.layers.{parts[1]}.{blocks[parts[2]]}.{parts[3]}"
    if (len(parts) == 5 and parts[0] == "blk" and parts[1].isdigit() and parts[3].isdigit()
            and parts[2] in ("ffn_gate", "ffn_up", "ffn_down") and parts[4] == "weight"):
        projection = _EXPERT_NAMES[f"{parts[2]}_exps"]
        return expert_weight_name(f"model.layers.{parts[1]}.mlp", int(parts[3]), projection)
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def expert_names(gguf_name: str, experts: int) -> list[str] | None:
    """The per-expert Hugging Face names of a stacked expert tensor, in its order along
    dim 0, or None if `gguf_name` is no such tensor."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _EXPERT_NAMES:
        return None
    if not experts:
        raise ValueError(f"{gguf_name}: stacked experts in a file without an expert_count")
    prefix = f"model.layers.{parts[1]}.mlp"
    return [expert_weight_name(prefix, e, _EXPERT_NAMES[parts[2]]) for e in range(experts)]


def dequantize_tensor(mm: Any, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor as a fresh, writable float32 array of ``info.shape``."""
    raw = np.frombuffer(mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    if info.ggml_type == _GGML_F32:
        arr = raw.view(np.float32).copy()
    elif info.ggml_type == _GGML_F16:
        arr = raw.view(np.float16).astype(np.float32)
    elif info.ggml_type == _GGML_BF16:
        arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        arr = dequantize(raw.reshape(rows, -1), GGMLQuantizationType(info.ggml_type))
        arr = np.ascontiguousarray(arr, dtype=np.float32)
    return arr.reshape(info.shape)


def unpermute_rows(w: _Rows, n_head: int) -> _Rows:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs -> HF rotate_half halves).

    llama.cpp stores, within each head, row ``2*j + p`` = HF row ``p*half + j``.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    rest = w.shape[1:]
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def stacked_parts(
    info: GGUFTensorInfo, config: ModelConfig, tensors: dict[str, GGUFTensorInfo]
) -> list[tuple[str, int]] | None:
    """The Hugging Face weights a GGUF tensor stacks along its rows, in order, each with its
    row count; None for a tensor that is one weight. Stacked experts [experts, rows, inputs]
    hold one weight per expert; Phi-3's fused `attn_qkv` holds q | k | v, and its fused
    `ffn_up` (a layer without `ffn_gate`) gate | up: llama.cpp's SwiGLU takes the gate from
    the first half, as transformers' Phi-3 MLP does."""
    names = expert_names(info.name, config.num_experts)
    if names is not None:
        return [(name, info.shape[1]) for name in names]
    parts = info.name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
        return None
    layer = f"model.layers.{parts[1]}"
    if parts[2] == "attn_qkv":
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [(f"{layer}.self_attn.{p}_proj.weight", rows)
                for p, rows in (("q", q), ("k", kv), ("v", kv))]
    if parts[2] == "ffn_up" and f"blk.{parts[1]}.ffn_gate.weight" not in tensors:
        width = config.intermediate_size
        return [(f"{layer}.mlp.gate_proj.weight", width), (f"{layer}.mlp.up_proj.weight", width)]
    return None


def _split_rows(
    mm: Any,
    info: GGUFTensorInfo,
    parts: list[tuple[str, int]],
    keep_quantized: bool,
    pages: _Pages,
    convert: Callable[[str, torch.Tensor], Weight] | None,
) -> Iterator[tuple[str, Weight]]:
    """A tensor stacking weights along its rows (leading dims flattened; see stacked_parts)
    as one weight each. Each weight's rows are contiguous in the file, so a quantized one
    splits into whole rows of blocks without decoding."""
    import torch

    inputs = info.shape[-1]
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    if rows != sum(n for _, n in parts):
        raise ValueError(f"{info.name}: {rows} rows, expected "
                         f"{' + '.join(str(n) for _, n in parts)}")
    bounds = np.cumsum([n for _, n in parts])[:-1]
    if keep_quantized and info.ggml_type in QUANT_TYPES:
        raw = np.frombuffer(mm, np.uint8, count=info.nbytes, offset=info.offset)
        for (name, n), part in zip(parts, np.split(raw.reshape(rows, -1), bounds), strict=True):
            yield name, QuantizedWeight.from_gguf(part, info.ggml_type, n, inputs,
                                                  done=pages.drop)
        return
    array = dequantize_tensor(mm, info).reshape(rows, inputs)
    for (name, _), part in zip(parts, np.split(array, bounds), strict=True):
        tensor = torch.from_numpy(part)
        yield name, tensor if convert is None else convert(name, tensor)


class _Pages:
    """Drops the file's pages from this process's memory as tensors are read in file order:
    a file the size of the weights is not held twice while loading. Everything before the
    read position goes each time (the kernel maps pages around each one read, behind it
    too)."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        view = np.frombuffer(mm, np.uint8, count=1)
        self.base = view.ctypes.data
        del view

    def drop(self, part: np.ndarray) -> None:
        """Drop the pages up to the end of `part`, if it is a view of the map."""
        start = part.ctypes.data - self.base
        if 0 <= start < len(self.mm):
            self.drop_to(start + part.nbytes)

    def drop_to(self, end: int) -> None:
        self.mm.madvise(mmap.MADV_DONTNEED, 0, min(len(self.mm), end))


def load_gguf(
    path: str | Path,
    progress: bool = True,
    name: str | None = None,
    keep_quantized: bool = False,
    convert: Callable[[str, torch.Tensor], Weight] | None = None,
) -> tuple[ModelConfig, dict[str, Weight]]:
    """Read a GGUF model: its ModelConfig and weights under Hugging Face names. Quantized
    matrices (and stacked ones, one matrix per weight: experts, Phi-3's fused q/k/v and
    gate/up; never routers) of a type the native kernels take stay quantized with
    `keep_quantized` (read straight from the file into their packed form); every other tensor
    is float32, passed through `convert` (name, tensor) if given."""
    import torch
    from tqdm import tqdm

    gf = read_gguf(path)
    config = config_from_gguf(gf, name=name)
    arch = gf.metadata["general.architecture"]
    permuted = arch == "llama"  # Mixtral's files too
    weights: dict[str, Weight] = {}
    with open(gf.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pages = _Pages(mm)
        infos = [i for i in gf.tensors.values() if i.name not in _IGNORED]
        for info in tqdm(
            infos, desc=f"loading {gf.path.name}", unit="tensor", disable=not progress
        ):
            parts = info.name.split(".")
            n_head = None
            if permuted and len(parts) == 4 and parts[2] in ("attn_q", "attn_k"):
                n_head = config.num_heads if parts[2] == "attn_q" else config.num_kv_heads
            stacked = stacked_parts(info, config, gf.tensors)
            if stacked is not None:
                weights.update(_split_rows(mm, info, stacked, keep_quantized, pages, convert))
            elif (keep_quantized and info.ggml_type in QUANT_TYPES and len(info.shape) == 2
                  and parts[2:3] != ["ffn_gate_inp"]):  # routers stay float: see moe.py
                raw = np.frombuffer(mm, np.uint8, count=info.nbytes, offset=info.offset)
                raw = raw.reshape(info.shape[0], -1)
                if n_head is not None:  # whole rows of blocks move (a copy)
                    raw = unpermute_rows(raw, n_head)
                weights[hf_name(info.name, arch)] = QuantizedWeight.from_gguf(
                    raw, info.ggml_type, *info.shape, done=pages.drop
                )
                del raw  # a view of the map, which cannot close while one is alive
            else:
                array = dequantize_tensor(mm, info)
                if n_head is not None:
                    array = unpermute_rows(array, n_head)
                tensor = torch.from_numpy(array)
                key = hf_name(info.name, arch)
                weights[key] = tensor if convert is None else convert(key, tensor)
            pages.drop_to(info.offset + info.nbytes)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights
