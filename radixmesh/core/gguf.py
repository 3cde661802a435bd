"""Reading a GGUF file's header: metadata and the tensor directory.

The parser is our own and only touches the bytes it needs, so the tokenizer can read a
GGUF's vocabulary in a few tens of milliseconds without importing torch
(``gguf.GGUFReader`` takes ~2 s on the SmolLM2 file because it builds an object per string).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GGUF metadata value types -> struct format, for the fixed-size ones.
_SCALAR_TYPES: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
    12: "d",
}
_TYPE_STRING = 8
_TYPE_ARRAY = 9



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
        return self.unpack_all(fmt)[0]

    def unpack_all(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

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
            return list(self.unpack_all(f"<{count}{_SCALAR_TYPES[etype]}"))
        if vtype not in _SCALAR_TYPES:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.unpack("<" + _SCALAR_TYPES[vtype])

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
            n_elem = math.prod(dims)
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


END_OF_TURN_MARKERS = ("<|im_end|>", "<|end|>", "<end_of_turn>")


def gguf_eos_token_ids(metadata: dict[str, Any]) -> tuple[int, ...]:
    """Token ids that end a generation: eos, eot, eom and the end-of-turn marker the chat
    template writes (ChatML's ``<|im_end|>``, Phi-3's ``<|end|>``, Gemma's
    ``<end_of_turn>``), where it is a control token: GGUF files often name only eos."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or []
    template = metadata.get("tokenizer.chat_template") or ""
    for marker in END_OF_TURN_MARKERS:
        if marker not in template or marker not in tokens:
            continue
        index = tokens.index(marker)
        if index < len(types) and types[index] == TOKEN_TYPE_CONTROL and index not in ids:
            ids.append(index)
    return tuple(ids)
