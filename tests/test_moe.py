"""Mixture-of-experts models (Qwen3-MoE, Mixtral): tiny random models greedy-identical to
transformers in float32 through the Engine (batched, chunked, from a cached prefix); the
sparse block's routing edge cases against a per-token reference; both safetensors layouts;
tiny MoE GGUF files (F32 and Q8_0) loading exactly their dequantized weights; tensor-parallel
shards of the experts summing to the whole block."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import torch.nn.functional as F
from process_helpers import mesh_generates
from test_model_vs_hf import greedy
from test_native_layer import STEPS, assert_same, run_both_ways
from test_quantized import prompt_logits
from tiny_model import (
    hf_config,
    hf_greedy,
    save_with_word_tokenizer,
    spread_weights,
    write_tiny_gguf,
)

from radixmesh.api import Engine
from radixmesh.engine.model.model import CausalLM
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.moe import Routing, SparseMoE, expert_weight_name, route
from radixmesh.engine.model.parallel import TensorParallel, local_config, shard_weights
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.kernels.native_quant import QuantizedWeight, moe_route

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, KV_HEADS = 256, 64, 4, 2
# Qwen3-MoE: 8 experts of width 32, top-2 without renormalization, a dense middle layer
# (mlp_only_layers); Mixtral: 4 experts of width 64, top-2, renormalized, every layer sparse.
KINDS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "intermediate": 96, "layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [1],
        "norm_topk_prob": False, "tie_word_embeddings": True,
    },
    "mixtral": {"intermediate": 64, "layers": 2, "num_local_experts": 4,
                "num_experts_per_tok": 2},
}
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
PROMPTS = [[(7 * i + 3 * p + 1) % VOCAB for i in range(n)] for p, n in enumerate((37, 5, 21, 1))]
NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def tiny_moe(kind: str, seed: int = 0):
    """A random transformers MoE model of `kind` (float32, eval), its weights scaled so that
    every layer matters and routing is decisive: norms in [0.5, 1.5], matrices ~ fan_in^-0.5,
    routers 2x that."""
    fields = dict(KINDS[kind])
    config = hf_config(
        kind, VOCAB, HIDDEN, fields.pop("intermediate"), fields.pop("layers"), HEADS, KV_HEADS,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5000.0, bos_token_id=0,
        eos_token_id=1, **fields,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    spread_weights(model, router_scale=2.0)
    return model


@pytest.fixture(scope="module", params=list(KINDS))
def saved(request, tmp_path_factory) -> tuple[str, Any, Path]:
    """(kind, the transformers model, its directory with a word-level tokenizer)."""
    kind = request.param
    model = tiny_moe(kind)
    path = save_with_word_tokenizer(model, tmp_path_factory.mktemp(kind) / "model")
    return kind, model, path


# ---- config ---------------------------------------------------------------------------


def test_config_reads_the_moe_shape(saved):
    kind, _, path = saved
    config = load_model(str(path), progress=False).config
    assert config.architecture == kind and config.is_moe
    if kind == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
        assert (config.moe_intermediate_size, config.intermediate_size) == (32, 96)
        assert config.sparse_layers == (0, 2) and config.norm_topk_prob is False
        assert config.qk_norm
    else:
        assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
        assert config.moe_intermediate_size == config.intermediate_size == 64
        assert config.sparse_layers == (0, 1) and config.norm_topk_prob is True
        assert not config.qk_norm


def test_qwen3_moe_config_fields():
    base = {"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 4, "norm_topk_prob": True,
            "max_position_embeddings": 4096}
    config = ModelConfig.from_hf_dict({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert config.sparse_layers == (1, 5) and config.norm_topk_prob
    assert ModelConfig.from_hf_dict({**base, "num_experts": 0}).is_moe is False
    # Qwen's windowed attention counts only with use_sliding_window.
    windowed = {**base, "sliding_window": 1024}
    assert ModelConfig.from_hf_dict(windowed).layer_windows == ()
    on = ModelConfig.from_hf_dict({**windowed, "use_sliding_window": True})
    assert on.layer_windows == (1024,) * 6 and on.max_position_embeddings == 4096


def test_mixtral_sliding_window_windows_every_layer():
    """A window every layer applies, where it is narrower than the context; the context is
    the model's whole either way."""
    cfg = {"model_type": "mixtral", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 32768}
    for window, windows in ((None, ()), (4096, (4096, 4096)), (65536, ())):
        config = ModelConfig.from_hf_dict({**cfg, "sliding_window": window})
        assert config.layer_windows == windows
        assert config.max_position_embeddings == 32768
    assert ModelConfig.from_hf_dict(cfg).layer_windows == ()


# ---- the Engine against transformers ----------------------------------------------------


def test_engine_greedy_matches_transformers(saved):
    """Four prompts at once (37, 5, 21 and 1 tokens) through 16-token prefill chunks, each
    token-identical to transformers run alone; then the first again, from the cache."""
    _, model, path = saved
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    assert len({t for ref in refs for t in ref}) > NEW_TOKENS  # the model says something
    with Engine(str(path), dtype="float32", max_total_tokens=512, chunked_prefill_size=16,
                show_progress=False) as engine:
        assert engine.runner.model.native_layers is None
        assert engine.model_config.architecture == saved[0] and engine.model_config.is_moe
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert isinstance(outs, list)
        assert [o["output_ids"] for o in outs] == refs
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert isinstance(again, dict)
        assert again["meta_info"]["cached_tokens"] == len(PROMPTS[0]) - 1
        assert again["output_ids"] == refs[0]


def test_the_mesh_serves_a_moe_model(tmp_path):
    """The mesh's processes serve the Qwen3-MoE model through /generate, token-identical to
    transformers, and report its experts."""
    model = tiny_moe("qwen3_moe")
    path = save_with_word_tokenizer(model, tmp_path / "model")
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS[:2]]
    info, outputs = mesh_generates(path, tmp_path / "logs", PROMPTS[:2], GREEDY)
    assert (info["architecture"], info["num_experts"], info["num_experts_per_tok"]) == (
        "qwen3_moe", 8, 2)
    assert outputs == refs


def test_bf16_follows_float32(saved):
    """bf16 activations and weights (the native bf16 GEMMs where this CPU has them) follow
    the float32 model within bf16's precision."""
    _, _, path = saved
    loaded = load_model(str(path), progress=False)
    ids = torch.tensor(PROMPTS[2])
    ref = prompt_logits(CausalLM(loaded.config, loaded.weights, torch.float32), ids)
    got = prompt_logits(CausalLM(loaded.config, loaded.weights, torch.bfloat16), ids)
    assert (got - ref).abs().max() / ref.abs().max() < 0.05


# ---- the sparse block's routing -----------------------------------------------------------

E, H, FF = 6, 32, 16  # experts, hidden size, expert width


def block_weights(seed: int, router: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Random float32 weights of one sparse block under prefix "mlp" (the router given or
    random)."""
    g = torch.Generator().manual_seed(seed)
    w = {"mlp.gate.weight": torch.randn(E, H, generator=g) if router is None else router}
    for e in range(E):
        for proj, shape in (("gate_proj", (FF, H)), ("up_proj", (FF, H)), ("down_proj", (H, FF))):
            w[expert_weight_name("mlp", e, proj)] = torch.randn(*shape, generator=g) * 0.3
    return w


def per_token_reference(
    w: dict[str, torch.Tensor], x: torch.Tensor, top_k: int, renormalize: bool
) -> torch.Tensor:
    """The block token by token, straight from the definition, routed as transformers routes
    (softmax, then torch.topk over the whole batch: how it orders ties)."""
    probs = torch.softmax(F.linear(x, w["mlp.gate.weight"]), dim=-1)
    tops, chosen = torch.topk(probs, top_k)
    rows = []
    for token, top, experts in zip(x, tops, chosen, strict=True):
        if renormalize:
            top = top / top.sum()
        out = torch.zeros(H)
        for weight, e in zip(top.tolist(), experts.tolist(), strict=True):
            gate, up, down = (w[expert_weight_name("mlp", e, p)]
                              for p in ("gate_proj", "up_proj", "down_proj"))
            out += weight * (down @ (F.silu(gate @ token) * (up @ token)))
        rows.append(out)
    return torch.stack(rows)


class Spy:
    """Counts the tokens each expert of a block runs over."""

    def __init__(self, block: SparseMoE) -> None:
        self.tokens = [0] * len(block.experts)
        for e, expert in enumerate(block.experts):
            block.experts[e] = self._counting(e, expert)

    def _counting(self, e: int, expert: Any) -> Any:
        def run(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            assert x.shape[0] > 0, f"expert {e} ran over no tokens"
            self.tokens[e] += x.shape[0]
            return expert(x, residual)

        return run


def run_block(
    w: dict[str, torch.Tensor], x: torch.Tensor, top_k: int = 2, renormalize: bool = True
) -> tuple[torch.Tensor, list[int]]:
    """The block's output (no residual) and the tokens each expert ran over."""
    block = SparseMoE(w, "mlp", E, top_k, renormalize)
    spy = Spy(block)
    out = block(x, torch.zeros_like(x))
    ref = per_token_reference(w, x, top_k, renormalize)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    return out, spy.tokens


@pytest.mark.parametrize("renormalize", [True, False])
def test_block_matches_the_per_token_reference(renormalize):
    x = torch.randn(23, H, generator=torch.Generator().manual_seed(1))
    _, tokens = run_block(block_weights(0), x, 2, renormalize)
    assert sum(tokens) == 23 * 2  # each expert's tokens in one run


def test_a_batch_of_one_token():
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(2))
    _, tokens = run_block(block_weights(3), x, top_k=3)
    assert sorted(tokens) == [0, 0, 0, 1, 1, 1]


def test_an_expert_no_token_picks_never_runs():
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(4)).abs()
    router[4] = -1.0  # x >= 0 below: expert 4 always scores lowest
    x = torch.rand(17, H, generator=torch.Generator().manual_seed(5))
    _, tokens = run_block(block_weights(6, router), x)
    assert tokens[4] == 0 and sum(tokens) == 34


@pytest.mark.parametrize("top_k", [1, 2])
def test_every_token_on_the_same_experts(top_k):
    router = torch.zeros(E, H)
    router[2] = 5.0
    router[5] = 3.0  # x >= 0: experts 2, then 5, win for every token
    x = torch.rand(9, H, generator=torch.Generator().manual_seed(7))
    _, tokens = run_block(block_weights(8, router), x, top_k=top_k)
    assert tokens == [0, 0, 9, 0, 0, 9 if top_k == 2 else 0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_ties_choose_as_transformers_does(kind):
    """Experts with equal scores (a duplicated router row; all-equal rows): the same experts
    and weights as transformers' router, torch.topk's order."""
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router
    config = hf_config(kind, 16, H, FF, 1, 2, 2, num_experts_per_tok=2,
                       **({"num_local_experts": E} if kind == "mixtral" else
                          {"num_experts": E, "moe_intermediate_size": FF, "norm_topk_prob": True}))
    g = torch.Generator().manual_seed(9)
    duplicated = torch.randn(E, H, generator=g)
    duplicated[1] = duplicated[4]
    duplicated[3] = duplicated[4]
    x = torch.randn(12, H, generator=g)
    for router in (duplicated, torch.zeros(E, H)):
        theirs = Router(config)
        with torch.no_grad():
            theirs.weight.copy_(router)
            _, their_weights, their_experts = theirs(x)
        ours = route(F.linear(x, router), 2, renormalize=True)
        assert torch.equal(ours.experts, their_experts)
        torch.testing.assert_close(ours.weights, their_weights.float(), rtol=0, atol=0)
        run_block(block_weights(10, router), x)


# ---- quantized experts: one native call a step --------------------------------------------

QH, QFF = 64, 32  # the quantized kernels take widths in whole blocks of 32


def quantized_block(seed: int, router: torch.Tensor | None = None) -> dict[str, Any]:
    """One sparse block under prefix "mlp", every expert's projections Q8_0 (a float
    router, given or random)."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, QH, generator=g) if router is None else router
    w: dict[str, Any] = {"mlp.gate.weight": router.bfloat16()}
    for e in range(E):
        for proj, shape in (("gate_proj", (QFF, QH)), ("up_proj", (QFF, QH)),
                            ("down_proj", (QH, QFF))):
            weight = torch.randn(*shape, generator=g) * shape[1] ** -0.5
            w[expert_weight_name("mlp", e, proj)] = QuantizedWeight.quantize_q8_0(weight)
    return w


@pytest.mark.parametrize("tokens, top_k, hot", [(1, 3, False), (23, 2, False), (17, 2, True),
                                                 (9, 1, True)])
def test_quantized_experts_run_in_one_native_call(tokens, top_k, hot):
    """Every expert quantized: with bf16 activations the step is routed natively (the same
    experts as torch's routing, the same weights within float32 rounding) and its experts
    run in one native call (kernels/cpu/moe.cpp), each expert's output the same bits as one
    Linear after another, the picks' weighted sum the same float32 sum. `hot`: every token
    on experts 2 and 5, the others never picked."""
    router = None
    if hot:
        router = torch.zeros(E, QH)
        router[2], router[5] = 5.0, 3.0
    block = SparseMoE(quantized_block(13, router), "mlp", E, top_k, True)
    assert block.native is not None
    g = torch.Generator().manual_seed(tokens)
    x = (torch.rand if hot else torch.randn)(tokens, QH, generator=g).bfloat16()
    residual = torch.randn(tokens, QH, generator=g).bfloat16()
    experts, weights = moe_route(x, block.router, top_k, True)
    theirs = route(F.linear(x, block.router), top_k, True)
    assert torch.equal(experts, theirs.experts)
    torch.testing.assert_close(weights, theirs.weights, rtol=1e-6, atol=1e-7)
    native = block(x, residual)
    spy = Spy(block)
    one_by_one = block._expert_by_expert(x, Routing(experts, weights))
    assert torch.equal(native, residual + one_by_one.to(torch.bfloat16))
    assert sum(spy.tokens) == tokens * top_k
    if hot:
        assert spy.tokens == [0, 0, tokens, 0, 0, tokens if top_k == 2 else 0]


def test_native_layers_run_quantized_experts(saved, tmp_path):
    """A Q8_0 MoE file in bf16 runs every layer natively, experts included (routing, experts
    and the residual add in cpu/layer.cpp), bit for bit the Python layers: decodes, a prompt,
    and both in one step."""
    kind, model, _ = saved
    gguf_path = write_tiny_gguf(tmp_path, GGUF_ARCH[kind], model, gguf.GGMLQuantizationType.Q8_0)
    loaded = load_model(str(gguf_path), progress=False, quantization="gguf")
    bf16 = CausalLM(loaded.config, loaded.weights, torch.bfloat16)
    # Quantized weights run natively on any CPU (bf16 ones only with AVX512-BF16).
    assert bf16.native_layers is not None
    for parts in STEPS:
        assert_same(run_both_ways(bf16, parts, seed=len(parts)))


def test_tensor_parallel_shards_sum_to_the_block():
    """Each expert split like the dense MLP over two ranks, the router replicated: the ranks'
    partial outputs (before their one all-reduce) sum to the whole block's."""

    class Sum(TensorParallel):
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return x  # the test sums the ranks' outputs itself

    config = ModelConfig("mixtral", 16, H, FF, 1, 2, 2, H // 2, num_experts=E,
                         num_experts_per_tok=2, moe_intermediate_size=FF, sparse_layers=(0,))
    whole = {f"model.layers.0.{k}": v for k, v in block_weights(11).items()}
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(12))
    full = SparseMoE(whole, "model.layers.0.mlp", E, 2, True)(x, torch.zeros_like(x))
    parts = []
    for rank in range(2):
        shard = dict(whole)
        shard_weights(config, shard, rank, 2)
        assert shard["model.layers.0.mlp.gate.weight"].shape == (E, H)  # replicated
        assert shard[expert_weight_name("model.layers.0.mlp", 0, "down_proj")].shape == (H, FF // 2)
        block = SparseMoE(shard, "model.layers.0.mlp", E, 2, True, Sum(rank, 2))
        parts.append(block(x, torch.zeros_like(x)))
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)
    assert local_config(config, 2).moe_intermediate_size == FF // 2
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        local_config(dataclasses.replace(config, moe_intermediate_size=FF + 1), 2)


# ---- weight layouts ---------------------------------------------------------------------


def test_fused_expert_checkpoints_load_the_same(saved, tmp_path):
    """transformers' save_original_format=False writes experts fused as 3-D tensors
    (mlp.experts.gate_up_proj / down_proj): they load to the same per-expert weights."""
    _, model, path = saved
    model.save_pretrained(tmp_path, save_original_format=False)
    with open(tmp_path / "model.safetensors", "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    assert "model.layers.0.mlp.experts.gate_up_proj" in header
    fused = load_model(str(tmp_path), progress=False).weights
    per_expert = load_model(str(path), progress=False).weights
    assert set(fused) == set(per_expert)
    assert all(torch.equal(fused[k], per_expert[k]) for k in fused)


# ---- GGUF ---------------------------------------------------------------------------------


def hf_weights_as_gguf_stores_them(path: Path, q8_embeddings: bool) -> dict[str, torch.Tensor]:
    """The safetensors weights rounded as write_tiny_gguf stores them by default: Q8_0
    embeddings, F16 dense up projections."""
    weights = load_model(str(path), progress=False).weights
    out = {}
    for name, w in weights.items():
        assert isinstance(w, torch.Tensor)
        if name == "model.embed_tokens.weight" and q8_embeddings:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), q8), q8))
        elif name.endswith("mlp.up_proj.weight"):
            w = w.half().float()
        out[name] = w
    return out


def greedy_ids(config: ModelConfig, weights: dict, dtype: torch.dtype = torch.float32) -> list:
    """Greedy tokens of the first prompt through a runner (no tokenizer: GGUF files here
    carry none)."""
    runner = ModelRunner(config, weights, dtype, num_slots=128)
    return greedy(runner, PROMPTS[0], NEW_TOKENS)


def test_f32_gguf_loads_exactly_and_generates_the_same(saved, tmp_path):
    kind, model, path = saved
    gguf_path = write_tiny_gguf(tmp_path, GGUF_ARCH[kind], model)
    loaded = load_model(str(gguf_path), progress=False)
    reference = load_model(str(path), progress=False).config
    fields = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "norm_topk_prob", "sparse_layers", "qk_norm", "num_layers")
    assert [getattr(loaded.config, f) for f in fields] == [getattr(reference, f) for f in fields]
    expected = hf_weights_as_gguf_stores_them(path, q8_embeddings=True)
    assert set(loaded.weights) == set(expected)
    for name, w in expected.items():
        assert torch.equal(loaded.weights[name], w), name
    assert greedy_ids(loaded.config, loaded.weights) == greedy_ids(reference, expected)


def test_q8_0_gguf_keeps_experts_quantized(saved, tmp_path):
    """Every matrix (each expert's too: one QuantizedWeight per expert, cut from the stacked
    tensor) stays Q8_0 and dequantizes to exactly what the float path loads; the model's
    logits follow the dequantized model's (float32) within what int8 activations cost, as
    test_quantized asserts of dense models."""
    kind, model, _ = saved
    q8 = gguf.GGMLQuantizationType.Q8_0
    gguf_path = write_tiny_gguf(tmp_path, GGUF_ARCH[kind], model, q8)
    quantized = load_model(str(gguf_path), progress=False, quantization="gguf")
    dense = load_model(str(gguf_path), progress=False, quantization="bf16")
    experts = [n for n in dense.weights if ".experts." in n]
    assert len(experts) == 3 * quantized.config.num_experts * len(quantized.config.sparse_layers)
    for name, w in dense.weights.items():
        got = quantized.weights[name]
        if w.dim() == 2 and not name.endswith("mlp.gate.weight"):
            assert isinstance(got, QuantizedWeight) and got.qtype.name == "Q8_0", name
            assert torch.equal(got.dequantize(), w), name
        else:
            assert torch.equal(got, w), name
    ids = torch.tensor(PROMPTS[2])
    ref = prompt_logits(CausalLM(dense.config, dense.weights, torch.float32), ids)
    for dtype in (torch.float32, torch.bfloat16):
        got = prompt_logits(CausalLM(quantized.config, quantized.weights, dtype), ids)
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 0.08, (dtype, float(err))
