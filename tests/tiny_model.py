"""A tiny random-weight Hugging Face model directory, a fixed run of StepBatches,
transformers configs and random models of any tiny size, and such a model written as a GGUF
file (float or in a quantized type)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from radixmesh.core.sampling_params import LogprobRequest, SamplingParams
from radixmesh.core.step import NewRequest, StepBatch, StepEntry, StepResult

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 64, 128, 2, 4, 2, 16
EOS = 255


def save_tiny_model(path: Path, kind: str = "llama", seed: int = 0) -> Path:
    """Write config.json + model.safetensors of a random Llama / Qwen2 / Qwen3 model."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": kind,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": kind == "qwen3",
        "eos_token_id": EOS,
    }
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return 1 + rand(n, scale=0.1)

    w = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN, scale=HIDDEN**-0.5),
        "model.norm.weight": norm(HIDDEN),
    }
    if kind != "qwen3":
        w["lm_head.weight"] = rand(VOCAB, HIDDEN, scale=HIDDEN**-0.5)
    sizes = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(HIDDEN)
        w[f"{p}.post_attention_layernorm.weight"] = norm(HIDDEN)
        for name, rows in sizes.items():
            w[f"{p}.self_attn.{name}_proj.weight"] = rand(rows, HIDDEN, scale=HIDDEN**-0.5)
            if kind == "qwen2":
                w[f"{p}.self_attn.{name}_proj.bias"] = rand(rows, scale=0.1)
        w[f"{p}.self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM, scale=HIDDEN**-0.5)
        if kind == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = norm(HEAD_DIM)
            w[f"{p}.self_attn.k_norm.weight"] = norm(HEAD_DIM)
        w[f"{p}.mlp.gate_proj.weight"] = rand(INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5)
        w[f"{p}.mlp.up_proj.weight"] = rand(INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5)
        w[f"{p}.mlp.down_proj.weight"] = rand(HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5)
    save_file(w, str(path / "model.safetensors"))
    return path


def save_word_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer.json for a tiny model ("t0 t1 ..." -> 0, 1, ...), so that the
    Engine can load the directory; prompts are best given as ids."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tokenizer = tokenizers.Tokenizer(
        models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))


def forward_script(decode_steps: int = 6) -> list[StepBatch]:
    """Two requests: "a" prefilled whole with prompt logprobs, "b" sampled with a seed and
    prefilled in two chunks, then both decode together."""
    a_ids = [(7 * i + 3) % VOCAB for i in range(12)]
    b_ids = [(11 * i + 5) % VOCAB for i in range(9)]
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=0.8, top_k=20)
    first = StepBatch(
        1,
        new_requests=[
            NewRequest("a", 0, [], [], len(a_ids), greedy, 0, LogprobRequest(True, 3, 0)),
            NewRequest("b", 1, [], [], len(b_ids), sampled, 1234),
        ],
        entries=[
            StepEntry("a", a_ids, list(range(12)), True),
            StepEntry("b", b_ids[:4], list(range(100, 104)), False),
        ],
    )
    second = StepBatch(2, entries=[
        StepEntry("a", [], [12], True), StepEntry("b", b_ids[4:], list(range(104, 109)), True)
    ])
    batches = [first, second]
    for s in range(decode_steps):
        batches.append(StepBatch(3 + s, entries=[
            StepEntry("a", [], [13 + s], True), StepEntry("b", [], [109 + s], True)
        ]))
    return batches


def tokens(results: list[StepResult]) -> list[list[int]]:
    """Each step's sampled token per entry."""
    return [[r.token_id for r in result.results] for result in results]


def hf_config(
    kind: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
    kv_heads: int, **fields: object,
):
    """A transformers config of `kind` ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
    "mixtral", "phi3", "gemma2" or "gemma3_text") of these sizes, with `fields` (rope,
    norms, tokens, experts, ...) as given."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "phi3": transformers.Phi3Config,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
    }[kind]
    return config_cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        **fields,
    )


def random_hf_model(config):
    """transformers' causal LM for `config`, its weights drawn after torch.manual_seed(0), in
    eval mode."""
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def spread_weights(model, router_scale: float = 1.0) -> None:
    """Redraw a tiny transformers model's weights so its greedy output moves: norms in
    [0.5, 1.5], every matrix N(0, 1/fan_in), a MoE router (`mlp.gate`) `router_scale` times
    wider so that its choices differ from token to token."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                scale = router_scale if name.endswith("mlp.gate.weight") else 1.0
                p.normal_(0.0, scale * p.shape[-1] ** -0.5)


def save_with_word_tokenizer(model, path: Path) -> Path:
    """`model` saved by transformers at `path`, with a word-level tokenizer beside it."""
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return path


def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation of one prompt, `steps` tokens (no eos stop)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections, fused in its files too
    "mlp.gate_up_proj": "ffn_up",
}
# Gemma's norms around the attention and the MLP: its `ffn_norm` is the MLP's pre-norm.
_GEMMA_TO_GGUF = {
    **_TO_GGUF,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# llama.cpp's period of Gemma's windowed layers (all but the last of each period windowed).
_GEMMA_WINDOW_PERIOD = {"gemma2": 2, "gemma3": 6}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter writes q/k in (rope pairs interleaved)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# A transformers 5 model's fused experts -> llama.cpp's stacked expert tensors.
_EXPERTS_TO_GGUF = {
    "gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
    "down_proj": ("ffn_down_exps",),
}


def write_tiny_gguf(
    tmp_path: Path, arch: str, model, weight_type: gguf.GGMLQuantizationType | None = None
) -> Path:
    """Write ``model`` the way llama.cpp would: names, permuted q/k for llama, Q8_0 embeddings
    and an F16 ffn_up. With `weight_type`, every matrix (embeddings, output and stacked experts
    included; routers stay F32, as llama.cpp keeps them) is in that type instead: quantized
    from the model's weights where the gguf package can, else random blocks with small scales
    (the K-quants). A mixture-of-experts model (arch "qwen3moe", or "llama" for Mixtral) gets
    its experts stacked as 3-D `ffn_{gate,up,down}_exps` tensors and the expert metadata; a
    Phi-3 model ("phi3") its fused tensors as they are and its rope metadata (add_phi3_rope);
    a Gemma 2 or 3 model ("gemma2", "gemma3") its norms plus one, its norm names and its
    metadata (add_gemma_metadata)."""
    cfg = model.config
    gemma = arch in _GEMMA_WINDOW_PERIOD
    names = _GEMMA_TO_GGUF if gemma else _TO_GGUF
    suffix = "" if weight_type is None else f"-{weight_type.name}"
    path = tmp_path / f"tiny-{arch}{suffix}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    experts = getattr(cfg, "num_local_experts", 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_weights_norm(getattr(cfg, "norm_topk_prob", True))  # Mixtral: always
        if arch == "qwen3moe":  # Mixtral's files take the experts' width from the above
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim(cfg))
    w.add_value_length(head_dim(cfg))
    if gemma:
        add_gemma_metadata(w, arch, cfg)
    else:
        w.add_rope_freq_base(5000.0)
        w.add_layer_norm_rms_eps(1e-5)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes YaRN
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope.get("beta_fast") or 32.0)
        w.add_rope_scaling_yarn_beta_slow(rope.get("beta_slow") or 1.0)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    if arch == "phi3":
        add_phi3_rope(w, cfg)
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        if gemma and name.endswith("norm.weight"):
            a += 1  # Gemma's norms scale by 1 + weight: the converter stores the sum
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            qtype = gguf.GGMLQuantizationType.Q8_0 if weight_type is None else weight_type
            w.add_tensor("token_embd.weight", _quantized(a, qtype), raw_dtype=qtype)
            continue
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif ".mlp.experts." in name:  # [E, 2I, H] gate rows first, or [E, H, I]
            layer, fused = name.split(".")[2], name.rsplit(".", 1)[1]
            gnames = _EXPERTS_TO_GGUF[fused]
            for gname, part in zip(gnames, np.split(a, len(gnames), axis=1), strict=True):
                part = np.ascontiguousarray(part)
                full = f"blk.{layer}.{gname}.weight"
                if weight_type is None:
                    w.add_tensor(full, part)
                else:
                    w.add_tensor(full, _quantized(part, weight_type), raw_dtype=weight_type)
            continue
        elif name.endswith(".mlp.gate.weight"):  # the router: F32 in every llama.cpp file
            w.add_tensor(f"blk.{name.split('.')[2]}.ffn_gate_inp.weight", a)
            continue
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                a = llama_cpp_permute(a, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                a = llama_cpp_permute(a, cfg.num_key_value_heads)
        if weight_type is not None and a.ndim == 2:
            w.add_tensor(gname, _quantized(a, weight_type), raw_dtype=weight_type)
        elif gname.endswith("ffn_up.weight"):
            w.add_tensor(gname, a.astype(np.float16))  # exercise the F16 path
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_phi3_rope(w: gguf.GGUFWriter, cfg) -> None:
    """What llama.cpp's converter writes of a Phi-3 config: the rotated dims, the original
    context, the sliding window (0: none) and, for LongRoPE, its factors as two F32 tensors
    and its attention factor."""
    rope = cfg.rope_parameters
    original = cfg.original_max_position_embeddings
    w.add_rope_dimension_count(int(head_dim(cfg) * rope.get("partial_rotary_factor", 1.0)))
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(cfg.sliding_window or 0)
    if rope["rope_type"] == "longrope":
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))


def add_gemma_metadata(w: gguf.GGUFWriter, arch: str, cfg) -> None:
    """What llama.cpp's converter writes of a Gemma config besides the shape: the norm
    epsilon and the window; Gemma 2's soft caps (no RoPE base: llama.cpp takes 10000);
    Gemma 3's global RoPE base and linear scaling, its windowed layers' base and its final
    soft cap, if any. The converter writes no layer pattern (llama.cpp's default period
    holds for every released model); layer types that period would not give are written as
    `sliding_window_pattern`, one flag per layer, which llama.cpp reads."""
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    period = _GEMMA_WINDOW_PERIOD[arch]
    windowed = [kind == "sliding_attention" for kind in cfg.layer_types]
    if windowed != [i % period < period - 1 for i in range(cfg.num_hidden_layers)]:
        w.add_sliding_window_pattern(windowed)


# Byte offsets of the float16 scales (and mins) in each quantized type's blocks.
_SCALES_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(
    qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int, scale: float = 0.002
) -> np.ndarray:
    """Random blocks of `qtype` for a [rows, cols] tensor ([rows, bytes] uint8): every bit
    random but the float16 scales, drawn from +-[scale / 4, scale]."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _SCALES_AT[qtype.name]:
        value = rng.uniform(scale / 4, scale, raw.shape[:-1]) * rng.choice([-1, 1], raw.shape[:-1])
        raw[..., at : at + 2] = value.astype(np.float16).view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(rows, -1)


def _quantized(a: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    try:
        return gguf.quants.quantize(a, qtype)
    except NotImplementedError:  # the K-quants
        return random_blocks(qtype, *a.shape, seed=a.size)


def draft_script(ref: list[list[int]]) -> tuple[list[StepBatch], list[list[int]]]:
    """forward_script's first two steps, then a step that verifies draft trees built from
    `ref` (forward_script's tokens, by tokens()) and a plain decode after it; with the
    tokens each request must output, accepted drafts first, step by step.

    "a" (greedy) drafts its next two tokens beside a wrong guess at each end: it must
    accept the two and sample its third itself. "b" (seeded sampling) drafts its next three
    as a chain, all right: it must accept them and sample its fourth."""
    a = [ref[0][0], ref[1][0], *(step[0] for step in ref[2:])]
    b = [ref[1][1], *(step[1] for step in ref[2:])]
    wrong = [(t + 1) % VOCAB for t in a]
    steps = forward_script()[:2]
    steps.append(StepBatch(3, entries=[
        StepEntry("a", [], list(range(13, 18)), True, [wrong[2], a[2], a[3], wrong[4]],
                  [-1, -1, 1, 2]),
        StepEntry("b", [], list(range(109, 113)), True, b[1:4], [-1, 0, 1]),
    ]))
    # "a" kept positions 13-15 (slots 13-15 after the move); "b" positions 9-12.
    steps.append(StepBatch(4, entries=[
        StepEntry("a", [], [18], True), StepEntry("b", [], [113], True)
    ]))
    expected = [[a[0]], [a[1], b[0]], [*a[2:5], *b[1:5]], [a[5], b[5]]]
    return steps, expected


def emitted(results: list[StepResult]) -> list[list[int]]:
    """Each step's output tokens, accepted drafts and sampled, entry after entry."""
    return [[t for r in result.results if r.token_id >= 0 for t in [*r.accepted_ids, r.token_id]]
            for result in results]
