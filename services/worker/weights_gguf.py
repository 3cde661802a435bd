"""Reading GGUF files: metadata, a ModelConfig, and tensors as float32 under Hugging Face names.

The metadata parser here is our own and only touches the bytes it needs, so the tokenizer
service can read a GGUF's vocabulary in a few tens of milliseconds without importing torch
(``gguf.GGUFReader`` takes ~2 s on the SmolLM2 file because it builds an object per string).
Dequantization of quantized tensors is delegated to ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from radixmesh.services.worker.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GGUF metadata value types -> (struct format, numpy dtype) for the fixed-size ones.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_TYPE_STRING = 8
_TYPE_ARRAY = 9

# ggml tensor types whose float32 conversion needs no block decoding.
_GGML_F32, _GGML_F16, _GGML_BF16 = 0, 1, 30


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's place in the file. ``shape`` is in row-major (numpy / torch) order."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo] = field(default_factory=dict)


class _Cursor:
    """Sequential little-endian reader over a buffer."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: Any, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        raw = bytes(self.buf[start : start + n])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _TYPE_STRING:
            return self.string()
        if vtype == _TYPE_ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if etype == _TYPE_STRING:
                return self._string_array(count)
            if etype == _TYPE_ARRAY:
                return [self.value(_TYPE_ARRAY) for _ in range(count)]
            if etype not in _SCALAR_TYPES:
                raise ValueError(f"unknown GGUF array element type {etype}")
            dtype = np.dtype(_SCALAR_TYPES[etype][1])
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return arr.tolist()
        if vtype not in _SCALAR_TYPES:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.unpack(_SCALAR_TYPES[vtype][0])

    def _string_array(self, count: int) -> list[str]:
        buf, pos = self.buf, self.pos
        unpack_len = struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (n,) = unpack_len(buf, pos)
            pos += 8
            raw = buf[pos : pos + n]
            pos += n
            try:
                append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                append(bytes(raw).decode("utf-8", errors="replace"))
        self.pos = pos
        return out


def read_gguf(path: str | Path, *, tensors: bool = True) -> GGUFFile:
    """Parse a GGUF file's header: all metadata and (optionally) the tensor directory."""
    path = Path(path)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        cur = _Cursor(mm, 4)
        version = cur.unpack("<I")
        if version < 2 or version > 3:
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        out = GGUFFile(path=path, version=version, metadata=metadata)
        if not tensors:
            return out
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", mm, cur.pos)
            cur.pos += 8 * n_dims
            ggml_type = cur.unpack("<I")
            rel = cur.unpack("<Q")
            raw_infos.append((name, dims, ggml_type, rel))
        align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (cur.pos + align - 1) // align * align
        for name, dims, ggml_type, rel in raw_infos:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            n_elem = int(np.prod(dims, dtype=np.int64)) if dims else 1
            nbytes = n_elem // block * type_size
            offset = data_start + rel
            if offset + nbytes > len(mm):
                raise ValueError(f"{path}: tensor {name} runs past the end of the file")
            out.tensors[name] = GGUFTensorInfo(
                name=name,
                shape=tuple(int(d) for d in reversed(dims)),
                ggml_type=ggml_type,
                offset=offset,
                nbytes=nbytes,
            )
        return out


def _f32(value: Any) -> float:
    """GGUF stores floats as float32; give back the shortest decimal that rounds to it."""
    return float(str(np.float32(value)))


def gguf_eos_token_ids(metadata: dict[str, Any]) -> tuple[int, ...]:
    """Token ids that end a generation: eos, eot, eom and, for ChatML, ``<|im_end|>``."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or []
    template = metadata.get("tokenizer.chat_template") or ""
    if "<|im_end|>" in template and "<|im_end|>" in tokens:
        im_end = tokens.index("<|im_end|>")
        if im_end < len(types) and types[im_end] == TOKEN_TYPE_CONTROL and im_end not in ids:
            ids.append(im_end)
    return tuple(ids)


def config_from_gguf(gf: GGUFFile, name: str | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata (llama / qwen2 / qwen3 keys) and the tensor directory."""
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

    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": _f32(key("rope.scaling.factor", 1.0))}
        orig = key("rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)

    bos = md.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=gguf_eos_token_ids(md),
        name=name or gf.path.name.removesuffix(".gguf"),
    )


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
}
# Tensors llama.cpp adds that have no Hugging Face parameter (precomputed RoPE factors).
_IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def hf_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to the Hugging Face parameter name."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


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


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs -> HF rotate_half halves).

    llama.cpp stores, within each head, row ``2*j + p`` = HF row ``p*half + j``.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    rest = w.shape[1:]
    return w.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def load_gguf(
    path: str | Path, progress: bool = True, name: str | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a GGUF model: its ModelConfig and float32 weights under Hugging Face names."""
    import torch
    from tqdm import tqdm

    gf = read_gguf(path)
    config = config_from_gguf(gf, name=name)
    permuted = config.architecture == "llama"
    weights: dict[str, torch.Tensor] = {}
    with open(gf.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        infos = [i for i in gf.tensors.values() if i.name not in _IGNORED]
        for info in tqdm(
            infos, desc=f"loading {gf.path.name}", unit="tensor", disable=not progress
        ):
            tensor = torch.from_numpy(dequantize_tensor(mm, info))
            parts = info.name.split(".")
            if permuted and len(parts) == 4 and parts[2] in ("attn_q", "attn_k"):
                n_head = config.num_heads if parts[2] == "attn_q" else config.num_kv_heads
                tensor = unpermute_rows(tensor, n_head)
            weights[hf_name(info.name)] = tensor
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights
