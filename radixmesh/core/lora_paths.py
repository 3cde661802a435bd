"""The LoRA adapters a server starts with (the lora_paths setting), in every form SGLang
takes them and radixmesh's comma form: checked where the settings are built, before any
model loads, and read by the model runner.

Each item of lora_paths is one of:
- `PATH`: an adapter named by its path (requests ask for it by that path, as in SGLang);
- `NAME=PATH`;
- several of those two separated by commas (`a=/x,b=/y`);
- a JSON object `{"lora_name": NAME, "lora_path": PATH, "pinned": BOOL}`: a pinned adapter
  keeps a device slot of its own from the start, so a request for it never waits for a slot
  or copies it in (at most max_loras_per_batch - 1 adapters may be pinned);
- a JSON object `{NAME: PATH, ...}`: several adapters by name."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NamedTuple

_REF_KEYS = ("lora_name", "lora_path", "pinned")


class LoraRef(NamedTuple):
    """One adapter: the name requests ask for it by, its PEFT folder (a path or a Hugging
    Face repo), and whether it holds a device slot for good."""

    name: str
    path: str
    pinned: bool = False


def parse_lora_paths(items: Iterable[str] | str | None) -> list[LoraRef]:
    """The adapters `items` name (see the module's docstring), in their order; ValueError
    naming lora_paths for an item that is none of its forms or a name given twice."""
    refs: list[LoraRef] = []
    for item in [items] if isinstance(items, str) else items or ():
        text = item.strip()
        refs += _json_refs(text) if text.startswith("{") else _listed_refs(text)
    names = [ref.name for ref in refs]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"lora_paths: adapter {name!r} is named twice")
    return refs


def _listed_refs(text: str) -> list[LoraRef]:
    """PATH, NAME=PATH, or several of them separated by commas."""
    refs = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, path = part.partition("=")
        name, path = (name.strip(), path.strip()) if eq else (part, part)
        if not name or not path:
            raise ValueError(f"lora_paths: expected PATH or NAME=PATH, got {part!r}")
        refs.append(LoraRef(name, path))
    return refs


def _json_refs(text: str) -> list[LoraRef]:
    """{"lora_name": ..., "lora_path": ..., "pinned": ...}, or {NAME: PATH, ...}."""
    try:
        obj: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"lora_paths: {text!r} is not a JSON object ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"lora_paths: {text!r} is not a JSON object")
    if "lora_name" not in obj and "lora_path" not in obj:
        for name, path in obj.items():
            if not isinstance(path, str) or not name.strip() or not path.strip():
                raise ValueError(f"lora_paths: expected {{NAME: PATH, ...}} with non-empty "
                                 f"strings, got {name!r}: {path!r}")
        return [LoraRef(name.strip(), path.strip()) for name, path in obj.items()]
    unknown = sorted(set(obj) - set(_REF_KEYS))
    if unknown:
        raise ValueError(f"lora_paths: unknown key(s) {', '.join(unknown)} in {text!r}; an "
                         f"adapter's object takes {', '.join(_REF_KEYS)}")
    name, path, pinned = obj.get("lora_name"), obj.get("lora_path"), obj.get("pinned", False)
    for key, value in (("lora_name", name), ("lora_path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"lora_paths: {key} must be a non-empty string in {text!r}")
    if not isinstance(pinned, bool):
        raise ValueError(f"lora_paths: pinned must be true or false in {text!r}")
    return [LoraRef(name.strip(), path.strip(), pinned)]
