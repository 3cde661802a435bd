"""LoRA adapters served over one base model: each request's output equals the adapter
merged into the weights by `peft`, adapters and the base mixed in one batch, the prefix cache kept
apart per adapter, and what cannot be served refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_model import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    LAYERS,
    VOCAB,
    save_tiny_model,
    save_word_tokenizer,
)

from radixmesh.api import Engine
from radixmesh.engine.lora_adapters import LoraAdapters
from radixmesh.engine.model.lora import LoraAdapter, LoraError, LoraPool, load_adapter
from radixmesh.engine.model.model_config import ModelConfig

SHAPES = {"q_proj": (HIDDEN, HEADS * HEAD_DIM), "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
          "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, HIDDEN),
          "gate_proj": (HIDDEN, INTERMEDIATE), "up_proj": (HIDDEN, INTERMEDIATE),
          "down_proj": (INTERMEDIATE, HIDDEN)}
# Each adapter: its config and, per target, its rank. "beta" has ranks of its own per
# module, rsLoRA scaling and an alpha of its own for up_proj.
ADAPTERS = {
    "alpha": ({"r": 4, "lora_alpha": 8}, {"q_proj": 4, "v_proj": 4, "o_proj": 4,
                                           "gate_proj": 4, "down_proj": 4}),
    "beta": ({"r": 8, "lora_alpha": 16, "use_rslora": True, "alpha_pattern": {"up_proj": 4},
              "rank_pattern": {"k_proj": 2}}, {"k_proj": 2, "up_proj": 8}),
}
PROMPTS = [[(5 * i + 3 * k + 1) % (VOCAB - 1) for i in range(10)] for k in range(3)]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _block(target: str) -> str:
    return "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def save_adapter(path: Path, config: dict, ranks: dict[str, int], seed: int) -> Path:
    """A PEFT adapter folder with random A and B (B is trained away from zero)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for target, rank in ranks.items():
            fan_in, fan_out = SHAPES[target]
            key = f"base_model.model.model.layers.{layer}.{_block(target)}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.3
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "target_modules": sorted(ranks), "bias": "none", **config}))
    return path


def save_merged(base: Path, adapter: Path, path: Path) -> Path:
    """The base model with the adapter merged into its weights by `peft`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(str(path))
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(root / "base")
    save_word_tokenizer(base)
    out = {"base": base}
    for seed, (name, (config, ranks)) in enumerate(ADAPTERS.items()):
        out[name] = save_adapter(root / name, config, ranks, seed + 1)
        out[f"merged-{name}"] = save_merged(base, out[name], root / f"merged-{name}")
    return out


def _engine(path: Path, **kwargs: object) -> Engine:
    return Engine(str(path), dtype="float32", max_total_tokens=2048, show_progress=False,
                  **kwargs)


@pytest.fixture(scope="module")
def references(models: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """Each prompt's greedy output under each adapter merged (None: the base model)."""
    out: dict[str | None, list[list[int]]] = {}
    for name, path in [(None, models["base"]), *((n, models[f"merged-{n}"]) for n in ADAPTERS)]:
        with _engine(path) as engine:
            results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        out[name] = [r["output_ids"] for r in results]
    return out


@pytest.fixture(scope="module")
def lora_engine(models: dict[str, Path]) -> Iterator[Engine]:
    """Both adapters, given as SGLang's Engine takes them: a list, "beta" pinned."""
    paths = [f"alpha={models['alpha']}",
             {"lora_name": "beta", "lora_path": str(models["beta"]), "pinned": True}]
    with _engine(models["base"], enable_lora=True, lora_paths=paths) as engine:
        yield engine


def test_a_pinned_adapter_holds_its_slot_in_the_runner_and_the_scheduler(lora_engine):
    assert lora_engine.runner.lora.pinned == {"beta"}
    assert lora_engine.scheduler.adapters.pinned == {"beta"}
    assert lora_engine.server_info()["lora_adapters"] == ["alpha", "beta"]


def test_each_adapter_gives_what_its_merged_weights_give(lora_engine: Engine, references):
    assert references["alpha"] != references[None] and references["beta"] != references[None]
    for name in [None, *ADAPTERS]:
        results = lora_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY,
                                       lora_path=name)
        assert [r["output_ids"] for r in results] == references[name], name


def test_adapters_and_the_base_mix_in_one_batch(lora_engine: Engine, references):
    lora_engine.flush_cache()
    adapters = ["alpha", "beta", None, "beta", "alpha", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(adapters))]
    results = lora_engine.generate(input_ids=prompts, sampling_params=GREEDY,
                                   lora_path=adapters)
    for i, (name, result) in enumerate(zip(adapters, results, strict=True)):
        assert result["output_ids"] == references[name][i % len(PROMPTS)], (i, name)


def test_adapters_with_chunked_prefill_and_pages(models, references):
    paths = ",".join(f"{name}={models[name]}" for name in ADAPTERS)
    with _engine(models["base"], enable_lora=True, lora_paths=paths, chunked_prefill_size=4,
                 page_size=4) as engine:
        adapters = ["alpha", None, "beta"]
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY,
                                  lora_path=adapters)
        for i, (name, result) in enumerate(zip(adapters, results, strict=True)):
            assert result["output_ids"] == references[name][i], name


def test_one_slot_runs_the_adapters_one_after_another(models, references):
    paths = ",".join(f"{name}={models[name]}" for name in ADAPTERS)
    with _engine(models["base"], enable_lora=True, lora_paths=paths,
                 max_loras_per_batch=1) as engine:
        adapters = ["alpha", "beta", "alpha", None, "beta"]
        results = engine.generate(input_ids=[PROMPTS[0]] * len(adapters),
                                  sampling_params=GREEDY, lora_path=adapters)
        assert [r["output_ids"] for r in results] == [references[n][0] for n in adapters]
        engine.scheduler.check_invariants()
        pool = engine.runner.lora
        assert pool.slot_loads >= 2 and pool.slot_evictions == pool.slot_loads - 1
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="beta")
        loads, evictions = pool.slot_loads, pool.slot_evictions
        # One slot: another adapter puts the one in it out; the same one again costs nothing.
        for name in ("alpha", "alpha", "beta"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path=name)
        assert (pool.slot_loads - loads, pool.slot_evictions - evictions) == (2, 2)


def test_a_prefix_is_never_shared_across_adapters(lora_engine: Engine):
    lora_engine.flush_cache()
    prompt = PROMPTS[1]

    def cached(name: str | None) -> int:
        out = lora_engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
        return out["meta_info"]["cached_tokens"]

    assert cached("alpha") == 0
    assert cached("beta") == 0
    assert cached(None) == 0
    assert cached("alpha") == len(prompt) - 1
    assert cached("beta") == len(prompt) - 1


def test_requests_for_adapters_that_are_not_served_are_refused(lora_engine: Engine, models):
    with pytest.raises(ValueError, match="unknown LoRA adapter 'gamma'; served: alpha, beta"):
        lora_engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="gamma")
    with pytest.raises(ValueError, match="lora_path must be an adapter's name"):
        lora_engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path=3)
    with _engine(models["base"]) as plain, pytest.raises(
            ValueError, match="unknown LoRA adapter 'alpha'; this server serves none"):
        plain.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="alpha")
    # Nothing leaked: the engine still serves.
    out = lora_engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="alpha")
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


def _config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=HIDDEN,
                       intermediate_size=INTERMEDIATE, num_layers=LAYERS, num_heads=HEADS,
                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


@pytest.mark.parametrize(("change", "refusal"), [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "trained biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_what_cannot_be_served_is_refused_at_load(tmp_path: Path, change: dict, refusal: str):
    folder = save_adapter(tmp_path / "a", {"r": 2, "lora_alpha": 4, **change}, {"q_proj": 2}, 0)
    with pytest.raises(LoraError, match=refusal):
        load_adapter("a", folder, _config())


def test_lora_on_the_lm_head_or_a_wrong_shape_is_refused(tmp_path: Path):
    folder = save_adapter(tmp_path / "a", {"r": 2, "lora_alpha": 4}, {"q_proj": 2}, 0)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    head = {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(2, HIDDEN)}
    save_file(head, str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="LM head"):
        load_adapter("a", folder, _config())
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({**tensors, key: torch.zeros(2, HIDDEN + 1)},
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="layer 0 q_proj: lora_A"):
        load_adapter("a", folder, _config())


def test_an_engine_refuses_an_adapter_its_runners_do_not_serve():
    """What a scheduler takes from the mesh is checked against its workers' adapters too."""
    from radixmesh.core.sampling_params import SamplingParams
    from radixmesh.engine.request import Req
    from radixmesh.engine.scheduler import Scheduler
    from radixmesh.engine.scheduler_config import SchedulerConfig

    sched = Scheduler(SchedulerConfig(num_slots=256, lora_names=frozenset({"alpha"})))
    sched.add_request(Req("ok", [1, 2], SamplingParams(), 0, lora="alpha"))
    with pytest.raises(ValueError, match="does not serve LoRA adapter 'beta'"):
        sched.add_request(Req("no", [1, 2], SamplingParams(), 0, lora="beta"))
    assert list(sched.requests) == ["ok"]


def test_adapters_load_and_unload_while_serving(models, references):
    with _engine(models["base"], enable_lora=True, max_lora_rank=8, lora_target_modules="all",
                 max_loaded_loras=1) as engine:
        assert engine.server_info()["lora_adapters"] == []
        engine.load_lora_adapter("alpha", str(models["alpha"]))
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path="alpha")
        assert [o["output_ids"] for o in out] == references["alpha"]
        with pytest.raises(ValueError, match=r"max_loaded_loras \(1\)"):
            engine.load_lora_adapter("beta", str(models["beta"]))
        # A request running with it holds it: unloading is refused until it is done.
        stream = engine.generate(input_ids=PROMPTS[0], lora_path="alpha", stream=True,
                                 sampling_params={**GREEDY, "max_new_tokens": 64})
        next(stream)
        with pytest.raises(ValueError, match="in use by 1 request"):
            engine.unload_lora_adapter("alpha")
        for _ in stream:
            pass
        engine.unload_lora_adapter("alpha")
        with pytest.raises(ValueError, match="unknown LoRA adapter 'alpha'"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="alpha")
        engine.load_lora_adapter("beta", str(models["beta"]))
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path="beta")
        assert [o["output_ids"] for o in out] == references["beta"]
        assert engine.model_info()["lora_adapters"] == ["beta"]
        engine.scheduler.check_invariants()


def test_an_adapter_must_fit_the_slots_it_was_started_with(models):
    with _engine(models["base"], enable_lora=True, max_lora_rank=4,
                 lora_target_modules="q_proj,v_proj,o_proj,gate_proj,down_proj") as engine:
        with pytest.raises(ValueError, match="rank 8, above max_lora_rank 4"):
            engine.load_lora_adapter("beta", str(models["beta"]))
        engine.load_lora_adapter("alpha", str(models["alpha"]))
        with pytest.raises(ValueError, match="already loaded"):
            engine.load_lora_adapter("alpha", str(models["alpha"]))
    with pytest.raises(ValueError, match="needs max_lora_rank and lora_target_modules"):
        _engine(models["base"], enable_lora=True)


def test_requests_slot_loads_and_evictions_are_counted():
    """The scheduler service counts each adapter's requests (a capped label); a worker its
    pool's slot loads and evictions."""
    from prometheus_client import REGISTRY

    from radixmesh.core.sampling_params import SamplingParams
    from radixmesh.engine.request import Req
    from radixmesh.services.scheduler.metrics import SchedulerMetrics
    from radixmesh.services.worker.metrics import WorkerMetrics

    metrics = SchedulerMetrics("lora-e0")
    for i, name in enumerate(["poet", "poet", "coder", ""]):
        metrics.queued(Req(f"r{i}", [1], SamplingParams(), 0, lora=name))

    def value(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    engine = {"model_name": "", "engine_id": "lora-e0"}
    assert value("radixmesh:lora_requests_total", **engine, adapter="poet") == 2
    assert value("radixmesh:lora_requests_total", **engine, adapter="coder") == 1

    class Pool:
        slot_loads, slot_evictions = 3, 1

    worker = WorkerMetrics(tp_rank=7)
    worker.lora(Pool())  # type: ignore[arg-type]
    Pool.slot_loads = 5
    worker.lora(Pool())  # type: ignore[arg-type]
    rank = {"model_name": "", "tp_rank": "7"}
    assert value("radixmesh:worker_lora_slot_loads_total", **rank) == 5
    assert value("radixmesh:worker_lora_slot_evictions_total", **rank) == 1


@pytest.mark.parametrize("quantization", ["bf16", "q8_0"])
def test_the_native_layers_add_adapters_as_the_python_layers_do(models, quantization):
    """bfloat16 serving runs whole layers natively (cpu/layer.cpp), LoRA included
    (cpu/lora.cpp): the same tokens and, to bf16 noise, the same logprobs as the Python
    layers' torch path, a mixed batch's adapters each where it belongs."""
    with Engine(str(models["base"]), dtype="bfloat16", quantization=quantization,
                enable_lora=True, lora_paths=f"alpha={models['alpha']},beta={models['beta']}",
                max_total_tokens=2048, show_progress=False) as engine:
        if engine.runner.model.native_layers is None:
            pytest.skip("the native CPU layers do not run on this CPU")
        adapters = ["alpha", None, "beta", "alpha"]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(adapters))]

        def run() -> list[dict]:
            engine.flush_cache()
            return engine.generate(input_ids=prompts, sampling_params=GREEDY,
                                   lora_path=adapters, return_logprob=True)

        native = run()
        engine.runner.model.native_layers = None
        python = run()
    for ours, theirs in zip(native, python, strict=True):
        assert ours["output_ids"] == theirs["output_ids"]
        torch.testing.assert_close(
            [lp for lp, _, _ in ours["meta_info"]["output_token_logprobs"]],
            [lp for lp, _, _ in theirs["meta_info"]["output_token_logprobs"]],
            atol=0.05, rtol=0)


def _pool(slots: int, pinned: list[str], names: str = "pab") -> LoraPool:
    """A pool of one-layer q_proj adapters (rank 2), one per letter of `names`."""
    g = torch.Generator().manual_seed(0)
    adapters = {n: LoraAdapter(n, {(0, "q_proj"): (torch.randn(2, HIDDEN, generator=g),
                                                   torch.randn(HEADS * HEAD_DIM, 2, generator=g))})
                for n in names}
    return LoraPool(adapters, _config(), slots, 0, torch.float32, torch.device("cpu"),
                    pinned=pinned)


def test_a_pinned_adapter_keeps_its_slot_while_the_others_take_turns():
    pool = _pool(2, ["p"])
    assert pool.pinned == {"p"} and pool.slot_loads == 1  # copied in at once
    slot = pool.acquire("p")
    pool.release(slot)
    for name in ("a", "b", "a", "b"):  # one slot left for two adapters
        pool.release(pool.acquire(name))
    assert (pool.slot_loads, pool.slot_evictions) == (5, 3)
    assert pool.acquire("p") == slot and pool.slot_loads == 5  # never put out
    pool.remove("p")
    assert pool.pinned == set()
    pool.release(slot)
    pool.release(pool.acquire("a"))
    pool.release(pool.acquire("b"))  # the slot "p" held is free for the others now
    assert pool.slot_evictions == 4


def test_one_slot_at_least_stays_unpinned():
    with pytest.raises(LoraError, match="'b' cannot be pinned: 2 of the 3 slots are"):
        _pool(3, ["p", "a", "b"])


def test_the_scheduler_counts_pinned_adapters_apart():
    from radixmesh.core.sampling_params import SamplingParams
    from radixmesh.engine.request import Req

    def req(lora: str) -> Req:
        return Req(lora, [1, 2], SamplingParams(), 0, lora=lora)

    adapters = LoraAdapters({"p", "a", "b"}, 2, pinned={"p"})
    running = [req("a"), req("p")]
    assert adapters.fits(req("p"), [])
    assert adapters.fits(req("a"), running)
    assert not adapters.fits(req("b"), running)  # "a" has the one slot "p" leaves
    assert adapters.fits(req("b"), [req("p")])
    adapters.stop("p", [])
    assert adapters.pinned == set() and adapters.fits(req("b"), [req("a")])
