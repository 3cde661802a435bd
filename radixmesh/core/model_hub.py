"""Models on the Hugging Face Hub, fetched through huggingface_hub into its cache: the library
itself reads HF_HOME / HF_HUB_CACHE (where), HF_HUB_OFFLINE (cache only) and HF_TOKEN (gated
and private repos). Only the files the engine loads are fetched."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"
# What the engine reads of a safetensors repo beside the weights (weights_hf, the tokenizer).
HF_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json", SAFETENSORS_INDEX,
})


# What a PEFT LoRA adapter is made of.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class Listing(NamedTuple):
    """A repo's files at the commit a revision names; `cached`: read from the cache, the hub
    being out of reach, so nothing else is asked of it."""

    commit: str
    files: list[str]
    cached: bool


def fetch_model(repo_id: str, select: str = "", revision: str | None = None) -> Path:
    """The local path of the model repo `repo_id` at `revision` (a branch, tag or commit;
    None: main), fetched into the cache unless it is there. A repo with config.json and
    safetensors weights: its snapshot directory. Else, or with a selection, one of its .gguf
    files: the one `select` names (a file name, or a quant tag such as Q4_K_M in any case),
    without a selection its only one. When the hub cannot be reached, the cache alone
    answers."""
    label = f"Hugging Face repo {repo_id} (revision {revision or constants.DEFAULT_REVISION})"
    try:
        listing = _listing(label, repo_id, revision)
        top = [f for f in listing.files if "/" not in f]
        safetensors = "config.json" in top and any(f.endswith(".safetensors") for f in top)
        if select or not safetensors:
            gguf = _pick_gguf(label, repo_id, listing.files, select)
            return Path(hf_hub_download(repo_id, gguf, revision=listing.commit,
                                        local_files_only=listing.cached))
        return _fetch_snapshot(repo_id, listing, top)
    except LocalEntryNotFoundError as exc:
        raise _not_cached(label, exc.__cause__ or exc) from exc
    except GatedRepoError as exc:
        raise PermissionError(f"{label} is gated: accept its conditions on huggingface.co and "
                              "set HF_TOKEN to a token of that account") from exc
    except RepositoryNotFoundError as exc:
        raise FileNotFoundError(f"model path not found: {repo_id} is neither a local path nor "
                                "a model repo on the Hugging Face Hub (a private one needs "
                                "HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise FileNotFoundError(f"{label}: the repo has no such branch, tag or commit") from exc
    except EntryNotFoundError as exc:
        raise FileNotFoundError(f"{label}: {exc}") from exc


def fetch_adapter(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of the PEFT adapter repo `repo_id` (its adapter_config.json
    and adapter_model.safetensors), fetched into the cache unless it is there; the cache
    alone answers when the hub cannot be reached."""
    label = f"Hugging Face repo {repo_id} (revision {revision or constants.DEFAULT_REVISION})"
    try:
        listing = _listing(label, repo_id, revision)
        return Path(snapshot_download(repo_id, revision=listing.commit,
                                      allow_patterns=list(ADAPTER_FILES),
                                      local_files_only=listing.cached))
    except LocalEntryNotFoundError as exc:
        raise _not_cached(label, exc.__cause__ or exc) from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise FileNotFoundError(f"{label}: no such adapter repo or revision") from exc


def _listing(label: str, repo_id: str, revision: str | None) -> Listing:
    """The commit `revision` names and the repo's files there: as the hub lists them, or,
    when it cannot be asked (offline, unreachable, down), as far as the cache holds them."""
    try:
        info = HfApi().model_info(repo_id, revision=revision)
        return Listing(str(info.sha), [s.rfilename for s in info.siblings or ()], cached=False)
    except (OfflineModeIsEnabled, httpx2.TransportError) as exc:
        unreachable: Exception = exc
    except HfHubHTTPError as exc:
        if exc.response.status_code < 500:
            raise  # the hub answered: no such repo or revision, or no access
        unreachable = exc
    try:
        # No patterns: only the snapshot directory is asked for, however few files it holds.
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=[],
                                          local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise _not_cached(label, unreachable) from exc
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    return Listing(snapshot.name, files, cached=True)


def _not_cached(label: str, why: BaseException) -> FileNotFoundError:
    """The error for a repo the cache lacks while the hub is out of reach (`why`)."""
    reason = ("HF_HUB_OFFLINE is set" if constants.is_offline_mode()
              else f"{type(why).__name__}: {why}")
    return FileNotFoundError(f"{label} is not in the cache at "
                             f"{constants.HF_HUB_CACHE}, and the hub could not be reached "
                             f"({reason})")


def _pick_gguf(label: str, repo_id: str, files: list[str], select: str) -> str:
    """The .gguf file `select` names: a file name, or a quant tag that stands between
    characters other than letters and digits (Q4_K is not Q4_K_M, F16 not BF16); with no
    selection, the only .gguf file. ValueError listing the .gguf files otherwise."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if not select:
        chosen = ggufs
    elif select.lower().endswith(".gguf"):
        chosen = [f for f in ggufs if select.lower() in (f.lower(), Path(f).name.lower())]
    else:
        tag = re.compile(rf"(?<![a-z0-9]){re.escape(select.lower())}(?![a-z0-9_])")
        chosen = [f for f in ggufs if tag.search(Path(f).name.lower())]
    if len(chosen) == 1:
        return chosen[0]
    if not ggufs and not select:
        raise ValueError(f"{label} holds no model radixmesh loads: neither config.json with "
                         ".safetensors weights nor a .gguf file")
    if not chosen:
        raise ValueError(f"{label} has no .gguf file matching {select!r}; its .gguf files: "
                         + (", ".join(ggufs) or "none"))
    matching = f" matching {select!r}" if select else ""
    raise ValueError(f"{label} has {len(chosen)} .gguf files{matching}: pick one with "
                     f"{repo_id}:QUANT (such as :Q4_K_M) or {repo_id}:FILE.gguf; "
                     + ", ".join(chosen))


def _fetch_snapshot(repo_id: str, listing: Listing, top: list[str]) -> Path:
    """A safetensors repo's snapshot directory with what the engine reads: `HF_FILES`, then
    the weights its index names (without an index, every .safetensors file at its top
    level, `top`)."""
    snapshot = Path(snapshot_download(repo_id, revision=listing.commit,
                                      allow_patterns=[f for f in top if f in HF_FILES],
                                      local_files_only=listing.cached))
    index = snapshot / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        weights = sorted(set(weight_map.values()))
    else:
        weights = [f for f in top if f.endswith(".safetensors")]
    snapshot_download(repo_id, revision=listing.commit, allow_patterns=weights,
                      local_files_only=listing.cached)
    return snapshot
