"""`--model-path ORG/NAME[:FILE.gguf | :QUANT]`: models of the Hugging Face Hub, resolved from
a cache laid out by hand as huggingface_hub lays it out, offline (these machines never reach
the hub): snapshots, revisions, GGUF selection, the errors, the launcher's pinning, and the
in-process engine and the CLI on a hub model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from huggingface_hub import constants

from radixmesh.core import model_hub
from radixmesh.core.model_files import default_model_path, resolve_model_path, served_name
from radixmesh.launcher import MeshArgs, pin_model

QUANTS = {"m.Q4_K_M.gguf": b"q4km", "m.Q4_K_S.gguf": b"q4ks", "m.Q8_0.gguf": b"q80"}
SAFETENSORS = {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors": b"w"}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache of this test's own, offline. huggingface_hub reads both
    settings once, at import, into `constants` (which its functions read at each call): they
    are patched there, and in the environment for child processes."""
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root


def cache_commit(
    cache: Path, repo_id: str, files: dict[str, bytes | Path], refs: tuple[str, ...] = ("main",)
) -> Path:
    """One commit of `repo_id` as huggingface_hub caches it: content-addressed blobs (a Path's
    blob links to that file), the snapshot's relative symlinks to them, and each ref (a
    branch or tag) holding the commit's hash. The snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repr((repo_id, sorted(files), refs)).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if isinstance(content, Path):
            blob = repo / "blobs" / hashlib.sha256(str(content).encode()).hexdigest()
            blob.symlink_to(content)
        else:
            blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
            blob.write_bytes(content)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_a_cached_safetensors_repo_is_its_snapshot_directory_named_after_the_repo(cache):
    snapshot = cache_commit(cache, "test-org/Tiny-Instruct", SAFETENSORS)
    path = resolve_model_path("test-org/Tiny-Instruct")
    assert path == snapshot
    assert served_name(path) == "Tiny-Instruct"


def test_the_revision_picks_a_branch_tag_or_commit(cache):
    main = cache_commit(cache, "test-org/Tiny", SAFETENSORS)
    tagged = cache_commit(cache, "test-org/Tiny", {**SAFETENSORS, "model.safetensors": b"v1"},
                          refs=("v1.0",))
    assert resolve_model_path("test-org/Tiny") == main
    assert resolve_model_path("test-org/Tiny", revision="v1.0") == tagged
    assert resolve_model_path("test-org/Tiny", revision=tagged.name) == tagged
    assert resolve_model_path("test-org/Tiny", revision="main") == main


def test_a_file_name_or_a_quant_tag_picks_one_gguf_file(cache):
    snapshot = cache_commit(cache, "test-org/M-GGUF", QUANTS)
    assert resolve_model_path("test-org/M-GGUF:m.Q8_0.gguf") == snapshot / "m.Q8_0.gguf"
    picked = resolve_model_path("test-org/M-GGUF:q4_k_m")
    assert picked == snapshot / "m.Q4_K_M.gguf"
    assert picked.read_bytes() == b"q4km"
    assert served_name(picked) == "m.Q4_K_M"
    single = cache_commit(cache, "test-org/One-GGUF", {"one.Q4_0.gguf": b"q40"})
    assert resolve_model_path("test-org/One-GGUF") == single / "one.Q4_0.gguf"


@pytest.mark.parametrize("name, says", [
    ("test-org/M-GGUF", "has 3 .gguf files: pick one"),
    ("test-org/M-GGUF:Q5_K_M", "no .gguf file matching 'Q5_K_M'"),
    ("test-org/M-GGUF:Q4_K", "no .gguf file matching 'Q4_K'"),  # a tag, not a prefix
    ("test-org/M-GGUF:other.gguf", "no .gguf file matching 'other.gguf'"),
])
def test_no_single_gguf_file_lists_the_files(cache, name, says):
    cache_commit(cache, "test-org/M-GGUF", QUANTS)
    with pytest.raises(ValueError, match=says) as raised:
        resolve_model_path(name)
    assert all(file in str(raised.value) for file in QUANTS)
    assert "test-org/M-GGUF (revision main)" in str(raised.value)


def test_a_repo_without_safetensors_weights_is_read_for_its_gguf_file(cache):
    snapshot = cache_commit(cache, "test-org/Mixed", {"config.json": b"{}", "m.Q8_0.gguf": b"q"})
    assert resolve_model_path("test-org/Mixed") == snapshot / "m.Q8_0.gguf"
    cache_commit(cache, "test-org/Docs", {"README.md": b"# none"})
    with pytest.raises(ValueError, match="neither config.json with .safetensors weights nor"):
        resolve_model_path("test-org/Docs")


def test_a_repo_or_revision_not_in_the_cache_is_named_with_the_cache(cache):
    cache_commit(cache, "test-org/Tiny", SAFETENSORS)
    for name, revision in (("test-org/Missing", None), ("test-org/Tiny", "v9")):
        with pytest.raises(FileNotFoundError) as raised:
            resolve_model_path(name, revision)
        message = str(raised.value)
        assert f"{name} (revision {revision or 'main'})" in message
        assert f"not in the cache at {cache}" in message
        assert "HF_HUB_OFFLINE is set" in message


def test_a_local_path_wins_over_a_repo_id_of_the_same_spelling(cache, tmp_path, monkeypatch):
    cache_commit(cache, "test-org/Tiny", SAFETENSORS)
    local = tmp_path / "test-org" / "Tiny"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("test-org/Tiny") == Path("test-org/Tiny")
    assert served_name(Path("test-org/Tiny")) == "Tiny"


def test_only_what_the_engine_reads_is_fetched(cache, monkeypatch):
    """Listed by the hub: the config and tokenizer files, and the weights the index names;
    no README, no consolidated copy of the weights, nothing in a subfolder."""
    weights = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.dumps({"weight_map": {"a": weights[0], "b": weights[1], "c": weights[1]}})
    snapshot = cache_commit(cache, "test-org/Sharded", {
        "config.json": b"{}", "tokenizer.json": b"{}", "generation_config.json": b"{}",
        "model.safetensors.index.json": index.encode(),
        **{w: w.encode() for w in weights},
    })
    listed = [*(p.name for p in snapshot.iterdir()), "README.md", "consolidated.safetensors",
              "original/model.safetensors", "tokenizer_config.json"]
    info = SimpleNamespace(sha=snapshot.name,
                           siblings=[SimpleNamespace(rfilename=f) for f in listed])
    hub = SimpleNamespace(model_info=lambda repo_id, revision: info)
    monkeypatch.setattr(model_hub, "HfApi", lambda: hub)
    asked: list[str] = []
    fetch = model_hub.snapshot_download

    def recorded(repo_id: str, **kwargs: Any) -> str:
        asked.extend(kwargs["allow_patterns"])
        return fetch(repo_id, **kwargs)  # the files are cached: answered offline

    monkeypatch.setattr(model_hub, "snapshot_download", recorded)
    assert resolve_model_path("test-org/Sharded") == snapshot
    assert sorted(asked) == sorted([
        "config.json", "generation_config.json", "model.safetensors.index.json",
        "tokenizer.json", "tokenizer_config.json", *weights,
    ])


def test_the_launcher_hands_every_service_the_snapshot_it_resolved(cache):
    cache_commit(cache, "test-org/Tiny", SAFETENSORS)
    tagged = cache_commit(cache, "test-org/Tiny", {**SAFETENSORS, "model.safetensors": b"v1"},
                          refs=("v1.0",))
    pinned = pin_model(MeshArgs(model_path="test-org/Tiny", revision="v1.0"))
    assert (pinned.model_path, pinned.revision) == (str(tagged), None)
    assert served_name(Path(pinned.model_path)) == "Tiny"
    assert pin_model(MeshArgs()) == MeshArgs()  # the bundled model: each service finds it


def test_up_refuses_a_repo_it_cannot_get_in_one_line(cache):
    """Before anything starts: the launcher resolves the model first."""
    done = subprocess.run(
        [sys.executable, "-m", "radixmesh.cli", "up", "--model-path", "test-org/Missing"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode != 0
    assert done.stderr.splitlines() == [
        f"radixmesh: failed to start: Hugging Face repo test-org/Missing (revision main) is "
        f"not in the cache at {cache}, and the hub could not be reached (HF_HUB_OFFLINE is set)"
    ]


def test_the_engine_runs_a_gguf_repo_as_it_runs_the_file(cache):
    """The bundled GGUF as the only file of a hub repo: the same greedy tokens."""
    from radixmesh.api import Engine

    local = default_model_path()
    cache_commit(cache, "test-org/SmolLM2-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": local})
    settings = {"max_total_tokens": 256, "grammar_backend": "none", "show_progress": False}
    greedy = {"max_new_tokens": 6, "temperature": 0}
    outputs = []
    for model_path in (str(local), "test-org/SmolLM2-GGUF"):
        with Engine(model_path=model_path, **settings) as engine:
            outputs.append(engine.generate("The capital of France is", greedy)["output_ids"])
    assert len(outputs[0]) == 6
    assert outputs[1] == outputs[0]


def test_a_lora_adapter_repo_is_fetched_through_the_same_cache(cache, tmp_path):
    from test_lora import _config, save_adapter

    from radixmesh.core.model_files import resolve_adapter_path
    from radixmesh.engine.model.lora import load_adapter

    local = save_adapter(tmp_path / "local", {"r": 2, "lora_alpha": 4}, {"q_proj": 2}, 0)
    snapshot = cache_commit(cache, "test-org/tiny-lora", {
        "adapter_config.json": local / "adapter_config.json",
        "adapter_model.safetensors": local / "adapter_model.safetensors",
        "README.md": b"not fetched",
    })
    assert resolve_adapter_path("test-org/tiny-lora") == snapshot
    assert load_adapter("tiny", "test-org/tiny-lora", _config()).targets == {"q_proj"}
    assert resolve_adapter_path(str(local)) == local
    with pytest.raises(FileNotFoundError, match="test-org/other-lora"):
        resolve_adapter_path("test-org/other-lora")
