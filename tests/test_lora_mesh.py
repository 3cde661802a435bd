"""LoRA adapters through the mesh's front doors on the real SmolLM2 (its GGUF weights, the
adapters on top): /generate's lora_path, OpenAI's model naming an adapter, gRPC Generate,
/v1/models; each answer equals the in-process Engine's with the same adapter."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from process_helpers import running_mesh
from safetensors.torch import save_file

from radixmesh import lang
from radixmesh.api import Engine
from radixmesh.launcher import Mesh
from radixmesh.proto import generate_pb2 as gpb
from radixmesh.proto import generate_pb2_grpc as ggrpc

# SmolLM2-135M's projections: (in, out) features, and its layers.
HIDDEN, INTER, Q, KV, LAYERS = 576, 1536, 9 * 64, 3 * 64, 30
SHAPES = {"q_proj": (HIDDEN, Q), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV),
          "o_proj": (Q, HIDDEN), "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER),
          "down_proj": (INTER, HIDDEN)}
ADAPTERS = {"poet": ("q_proj", "v_proj", "down_proj"), "coder": ("k_proj", "o_proj", "up_proj")}
GREEDY = {"temperature": 0, "max_new_tokens": 12}
PROMPTS = ["The capital of France is", "Write a haiku about the sea:"]


def save_adapter(path: Path, targets: tuple[str, ...], seed: int) -> Path:
    """A rank-8 PEFT adapter strong enough to change what the model writes."""
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for target in targets:
            fan_in, fan_out = SHAPES[target]
            block = "mlp" if target.endswith(("gate_proj", "up_proj", "down_proj")) else \
                "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(8, fan_in, generator=g) * 0.12
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, 8, generator=g) * 0.12
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": list(targets)}))
    return path


@pytest.fixture(scope="module")
def lora_paths(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("adapters")
    return ",".join(f"{name}={save_adapter(root / name, targets, seed)}"
                    for seed, (name, targets) in enumerate(ADAPTERS.items()))


@pytest.fixture(scope="module")
def engine(lora_paths: str) -> Iterator[Engine]:
    with Engine(dtype="float32", max_total_tokens=4096, show_progress=False, enable_lora=True,
                lora_paths=lora_paths) as e:
        yield e


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, lora_paths: str) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("mesh-logs"), dtype="float32",
                      max_total_tokens=4096, enable_lora=True, lora_paths=lora_paths,
                      max_loras_per_batch=2) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mesh.url, timeout=120) as c:
        yield c


def test_generate_runs_each_prompt_with_its_adapter(client, engine):
    adapters = ["poet", "coder", None]
    prompts = [PROMPTS[0]] * len(adapters)
    expected = engine.generate(prompts, GREEDY, lora_path=adapters)
    outputs = [e["output_ids"] for e in expected]
    assert len({tuple(o) for o in outputs}) == 3  # each adapter changes what is written
    got = client.post("/generate", json={"text": prompts, "sampling_params": GREEDY,
                                         "lora_path": adapters})
    assert got.status_code == 200, got.text
    assert [g["output_ids"] for g in got.json()] == outputs
    one = client.post("/generate", json={"text": PROMPTS[1], "sampling_params": GREEDY,
                                         "lora_path": "coder"}).json()
    assert one["text"] == engine.generate(PROMPTS[1], GREEDY, lora_path="coder")["text"]


def test_a_cached_prefix_is_reused_only_under_its_own_adapter(client):
    client.post("/flush_cache")
    body = {"text": PROMPTS[1], "sampling_params": GREEDY}

    def cached(adapter: str | None) -> int:
        out = client.post("/generate", json={**body, "lora_path": adapter}).json()
        return out["meta_info"]["cached_tokens"]

    first = cached("poet")
    assert (first, cached("coder"), cached(None)) == (0, 0, 0)
    prompt_tokens = client.post("/generate", json={**body, "lora_path": "poet"}).json()[
        "meta_info"]["prompt_tokens"]
    assert cached("coder") == prompt_tokens - 1


def test_openai_model_names_an_adapter(client, engine):
    base = client.get("/v1/models").json()["data"][0]["id"]
    listed = client.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [
        (base, None), ("coder", base), ("poet", base)]
    assert client.get("/v1/models/poet").json()["parent"] == base
    expected = engine.generate(PROMPTS[0], GREEDY, lora_path="poet")["text"]
    for model in ("poet", f"{base}:poet"):
        out = client.post("/v1/completions", json={
            "model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["text"] == expected
        assert out.json()["model"] == model


def test_grpc_generate_takes_lora_path(mesh, engine):
    async def run() -> list[int]:
        async with grpc.aio.insecure_channel(mesh.grpc_addrs[0]) as channel:
            request = gpb.GenerateRequest(
                text=PROMPTS[1], lora_path="poet",
                sampling_params=gpb.ClientSamplingParams(max_new_tokens=12, temperature=0))
            replies = [r async for r in ggrpc.GenerateStub(channel).Generate(request)]
            return [t for r in replies for t in r.output_ids]

    expected = engine.generate(PROMPTS[1], GREEDY, lora_path="poet")["output_ids"]
    assert asyncio.run(run()) == expected


def test_unknown_adapters_are_refused_by_every_door(client):
    native = client.post("/generate", json={"text": "Hi", "lora_path": "painter"})
    assert native.status_code == 400 and "unknown LoRA adapter 'painter'" in native.text
    openai = client.post("/v1/completions", json={"model": "painter", "prompt": "Hi"})
    assert openai.status_code == 400 and "coder, poet" in openai.text
    assert client.get("/v1/models/painter").status_code == 404
    info = client.get("/get_model_info").json()
    assert info["lora_adapters"] == ["coder", "poet"]
    ok = client.post("/generate", json={"text": "Hi", "sampling_params": GREEDY,
                                        "lora_path": "poet"})
    assert ok.status_code == 200


def test_adapters_load_and_unload_through_http(client, engine, lora_paths, tmp_path):
    path = save_adapter(tmp_path / "critic", ("q_proj", "up_proj"), seed=7)
    loaded = client.post("/load_lora_adapter", json={"lora_name": "critic",
                                                     "lora_path": str(path)})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["loaded_adapters"] == ["coder", "critic", "poet"]
    engine.load_lora_adapter("critic", str(path))
    expected = engine.generate(PROMPTS[0], GREEDY, lora_path="critic")["output_ids"]
    out = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY,
                                         "lora_path": "critic"})
    assert out.status_code == 200 and out.json()["output_ids"] == expected
    again = client.post("/load_lora_adapter", json={"lora_name": "critic",
                                                    "lora_path": str(path)})
    assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
    missing = client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()[
        "error_message"]
    assert client.post("/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
    gone = client.post("/unload_lora_adapter", json={"lora_name": "critic"})
    assert gone.status_code == 200 and gone.json()["loaded_adapters"] == ["coder", "poet"]
    refused = client.post("/generate", json={"text": "Hi", "lora_path": "critic"})
    assert refused.status_code == 400 and "unknown LoRA adapter 'critic'" in refused.text
    assert [m["id"] for m in client.get("/v1/models").json()["data"]][1:] == ["coder", "poet"]


@lang.function
def capital(s: lang.State) -> None:
    s += PROMPTS[0]
    s += lang.gen("answer", max_tokens=12, temperature=0)


def test_a_program_runs_with_its_backends_adapter(mesh, engine):
    expected = engine.generate(PROMPTS[0], GREEDY, lora_path="coder")["text"]
    assert expected != engine.generate(PROMPTS[0], GREEDY)["text"]
    for backend in (lang.EngineBackend(engine, lora_path="coder"),
                    lang.HttpBackend(mesh.url, lora_path="coder"),
                    lang.GrpcBackend(mesh.grpc_addrs[0], lora_path="coder")):
        assert capital.run(backend)["answer"] == expected, type(backend).__name__
