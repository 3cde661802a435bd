"""Quantized weights: the native quantized GEMM (kernels/cpu/quant.cpp) against float64
references built from the same blocks, for every GGUF type it takes and every instruction set
this CPU runs; tiny Llama and Qwen2 GGUF files in each type; quantizing at load (q8_0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_model import hf_config, random_blocks, random_hf_model, save_tiny_model, write_tiny_gguf

from radixmesh.engine.model.attention import AttentionMetadata, SeqSpan
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.linear import Linear
from radixmesh.engine.model.model import CausalLM
from radixmesh.engine.model.model_source import load_model, resolve_quantization
from radixmesh.engine.model.parallel import shard_weights
from radixmesh.engine.model.torch_attention import TorchAttention
from radixmesh.kernels import native_quant as nq

TYPES = sorted(nq.QUANT_TYPES)
QT = gguf.GGMLQuantizationType


def unpacked(raw: np.ndarray, ggml_type: int) -> tuple[np.ndarray, np.ndarray | None]:
    """float64 [n, k]: scale * (u - zero) per input, and the mins per block (or None)."""
    qt = nq.QUANT_TYPES[ggml_type]
    u, scale, mins = nq.unpack_blocks(raw.reshape(raw.shape[0], -1, qt.block_bytes), qt)
    sym = np.repeat(scale.astype(np.float64), qt.scale_block, 1) * (u.astype(np.float64) - qt.zero)
    return sym, None if mins is None else mins.astype(np.float64)


def inputs_for(ggml_type: int) -> int:
    """An odd number of the type's blocks."""
    return 3 * nq.QUANT_TYPES[ggml_type].block_inputs


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: QT(t).name)
def test_unpacking_is_ggml_dequantization(ggml_type):
    n, k = 37, inputs_for(ggml_type)
    raw = random_blocks(QT(ggml_type), n, k, seed=ggml_type)
    ref = gguf.quants.dequantize(raw, QT(ggml_type)).astype(np.float64)
    sym, mins = unpacked(raw, ggml_type)
    block = nq.QUANT_TYPES[ggml_type].scale_block
    ours = sym if mins is None else sym + np.repeat(mins, block, 1)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-9)
    w = nq.QuantizedWeight.from_gguf(raw, ggml_type, n, k)
    np.testing.assert_allclose(w.dequantize().numpy(), ours, rtol=1e-6, atol=1e-9)
    assert w.dequantize(torch.bfloat16).equal(torch.from_numpy(ours).bfloat16())


def check_gemm(ggml_type: int, seed: int) -> None:
    """linear() over two weights of the type side by side (37 and 16 features), with a bias
    and a residual, in bf16 and float32, against float64 over the same quantized x; x's
    quantization within half a step; each row as it comes alone."""
    k = inputs_for(ggml_type)
    block = nq.QUANT_TYPES[ggml_type].scale_block
    raws = [random_blocks(QT(ggml_type), n, k, seed=seed + n) for n in (37, 16)]
    parts = [nq.QuantizedWeight.from_gguf(r, ggml_type, r.shape[0], k) for r in raws]
    refs = [unpacked(r, ggml_type) for r in raws]
    sym = np.concatenate([s for s, _ in refs])
    gen = torch.Generator().manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float32):
        for m in (1, 2, 5, 8, 11, 19):
            x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
            bias = torch.randn(53, generator=gen).to(dtype)
            residual = torch.randn(m, 53, generator=gen).to(dtype)
            buf = nq.quantize_rows(x)
            xq = nq.quantized_rows_reference(buf, m, k).numpy()
            blocks = x.double().view(m, -1, 32)
            step = blocks.abs().amax(-1, keepdim=True) / 127
            off = (torch.from_numpy(xq).view(m, -1, 32) - blocks).abs()
            assert (off <= step / 2 + 1e-6 * blocks.abs()).all()
            ref = xq @ sym.T
            bound = np.abs(xq) @ np.abs(sym).T
            xs = x.double().view(m, -1, block).sum(-1).numpy()
            if refs[0][1] is not None:
                mins = np.concatenate([mn for _, mn in refs])
                ref = ref + xs @ mins.T
                bound = bound + np.abs(xs) @ np.abs(mins).T
            ref = ref + bias.double().numpy()
            out = nq.linear(x, parts, bias)
            tol = 1e-5 * bound + (2**-8 * np.abs(ref) if dtype == torch.bfloat16 else 0)
            assert (np.abs(out.double().numpy() - ref) <= tol + 1e-30).all(), (dtype, m)
            both = nq.linear(x, parts, bias, residual)
            assert both.equal((out.float() + residual.float()).to(dtype))
            for i in range(m):
                assert nq.linear(x[i : i + 1], parts, bias).equal(out[i : i + 1])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: QT(t).name)
def test_gemm_against_float64(ggml_type):
    check_gemm(ggml_type, seed=ggml_type)


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


# Each instruction set's build target, its name and the CPU flags it needs.
ISAS = [
    ("x86-64-v2", "portable C++", {"sse4_2"}),
    ("haswell", "AVX2", {"avx2", "fma"}),
    ("haswell -mavxvnni", "AVX-VNNI", {"avx2", "fma", "avx_vnni"}),
    ("native", None, set()),
]


@pytest.mark.parametrize(("march", "name", "flags"), ISAS, ids=[i[0] for i in ISAS])
def test_every_instruction_set(march, name, flags, tmp_path):
    """The kernels built for each instruction set this CPU runs agree with float64 (the
    whole of check_gemm per type, in a process of their own)."""
    have = _cpu_flags()
    if march != "native" and not (have and flags <= have):
        pytest.skip(f"this CPU cannot run {march} code")
    env = {**os.environ, "RADIXMESH_NATIVE_MARCH": march, "RADIXMESH_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if name is not None:
        assert proc.stdout.split("\n")[0] == name


def test_q8_0_at_load_is_ggml_q8_0():
    t = torch.randn(40, 96)
    t[3, :32] = 0  # an all-zero block
    t[5, 40] = 1e4  # a block with one large value
    ref = gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), QT.Q8_0), QT.Q8_0)
    assert nq.QuantizedWeight.quantize_q8_0(t).dequantize().equal(torch.from_numpy(ref))


def test_shards_are_slices():
    raw = random_blocks(QT.Q6_K, 48, 512, seed=1)
    w = nq.QuantizedWeight.from_gguf(raw, QT.Q6_K.value, 48, 512)
    full = w.dequantize()
    assert w.narrow(0, 16, 32).dequantize().equal(full[16:48])
    assert w.narrow(1, 256, 256).dequantize().equal(full[:, 256:])
    assert w.narrow(1, 32, 64).dequantize().equal(full[:, 32:96])
    with pytest.raises(ValueError, match="whole 16s"):
        w.narrow(0, 8, 16)
    with pytest.raises(ValueError, match="whole 32s"):
        w.narrow(1, 16, 256)


def test_the_bundled_model_shards_over_three_ranks():
    """SmolLM2 (9 heads, 3 KV heads) over 3 ranks in its own Q4_1: every split falls on a
    block, and the shards are slices of the whole."""
    full = load_model(None, progress=False, quantization="gguf")
    for rank in range(3):
        part = load_model(None, progress=False, quantization="gguf")
        shard_weights(part.config, part.weights, rank, 3)
        for name in ("self_attn.k_proj", "self_attn.o_proj", "mlp.down_proj"):
            key = f"model.layers.7.{name}.weight"
            whole, shard = full.weights[key], part.weights[key]
            assert isinstance(whole, nq.QuantizedWeight) and isinstance(shard, nq.QuantizedWeight)
            dim = 1 if name.endswith(("o_proj", "down_proj")) else 0
            size = whole.shape[dim] // 3
            expected = whole.dequantize().narrow(dim, rank * size, size)
            assert shard.dequantize().equal(expected), key


def test_mixed_parts_run_dequantized():
    raw = random_blocks(QT.Q4_0, 16, 64, seed=2)
    q = nq.QuantizedWeight.from_gguf(raw, QT.Q4_0.value, 16, 64)
    dense = torch.randn(8, 64)
    layer = Linear([q, dense])
    assert layer.kind != "quant"
    x = torch.randn(3, 64)
    expected = x @ torch.cat([q.dequantize(), dense]).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_quantization_resolves():
    assert resolve_quantization("auto", True, "cpu") == "gguf"
    assert resolve_quantization("auto", True, "cpu", "float32") == "bf16"
    assert resolve_quantization("gguf", True, "cpu", "float32") == "gguf"
    assert resolve_quantization("auto", False, "cpu") == "bf16"
    assert resolve_quantization("auto", True, "cuda") == "bf16"
    assert resolve_quantization("q8_0", False, "cpu") == "q8_0"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("gguf", True, "cuda")


# ---- tiny models in each type ------------------------------------------------------------


def prompt_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [n, vocab] of one prompt run from position 0."""
    cfg, n = model.cfg, ids.numel()
    slots = torch.arange(n)
    attn = TorchAttention(cfg.head_dim**-0.5)
    attn.prepare(AttentionMetadata.from_spans(slots, (SeqSpan(0, n, slots),)))
    pool = KVPool(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    with torch.inference_mode():
        return model.logits(model.forward(ids, slots, attn, pool))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: QT(t).name)
@pytest.mark.parametrize(("arch", "tie"), [("llama", False), ("qwen2", True)])
def test_tiny_gguf_in_each_type(tmp_path, ggml_type, arch, tie):
    """Every matrix loads in the file's type and dequantizes to exactly what the bf16 path
    loads; the model's logits in bf16 and float32 activations follow the dequantized model's
    (float32) within what int8 activations cost."""
    k = max(nq.QUANT_TYPES[ggml_type].block_inputs, 64)
    cfg = hf_config(arch, vocab=96, hidden=k, intermediate=2 * k, layers=2, heads=4,
                    kv_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                    rope_theta=5000.0, bos_token_id=0, eos_token_id=[1],
                    tie_word_embeddings=tie)
    torch.manual_seed(ggml_type)
    path = write_tiny_gguf(tmp_path, arch, random_hf_model(cfg), QT(ggml_type))
    quantized = load_model(str(path), progress=False, quantization="gguf")
    dense = load_model(str(path), progress=False, quantization="bf16")
    assert quantized.quantization == "gguf"
    matrices = [n for n, w in dense.weights.items() if w.dim() == 2]
    assert len(matrices) == 7 * 2 + 1 + (0 if tie else 1)
    for name in matrices:
        w = quantized.weights[name]
        assert isinstance(w, nq.QuantizedWeight) and w.qtype.name == QT(ggml_type).name, name
        torch.testing.assert_close(w.dequantize(), dense.weights[name], rtol=1e-6, atol=1e-9)
    ids = torch.tensor([0, 5, 17, 42, 9, 88, 3, 61, 27, 70, 11])
    ref = prompt_logits(CausalLM(dense.config, dense.weights, torch.float32), ids)
    for dtype in (torch.float32, torch.bfloat16):
        model = CausalLM(quantized.config, quantized.weights, dtype)
        assert model.lm_head.kind == "quant"
        got = prompt_logits(model, ids)
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 0.08, (dtype, float(err))  # measured: 0.4-4.7%


def test_q8_0_quantizes_a_safetensors_model(tmp_path):
    """quantization=q8_0 on a float checkpoint: every matrix in Q8_0 (ggml's), norms float;
    the logits follow the float model's within what int8 weights and activations cost."""
    path = save_tiny_model(tmp_path / "m", "qwen2")
    q8 = load_model(str(path), progress=False, quantization="q8_0")
    dense = load_model(str(path), progress=False)
    for name, w in dense.weights.items():
        if w.dim() == 2:
            got = q8.weights[name]
            assert isinstance(got, nq.QuantizedWeight) and got.qtype.name == "Q8_0"
            ref = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), QT.Q8_0), QT.Q8_0)
            assert got.dequantize().equal(torch.from_numpy(ref)), name
        else:
            assert q8.weights[name].equal(w)
    ids = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
    ref = prompt_logits(CausalLM(dense.config, dense.weights, torch.float32), ids)
    got = prompt_logits(CausalLM(q8.config, q8.weights, torch.float32), ids)
    assert (got - ref).abs().max() / ref.abs().max() < 0.08  # measured: 3%


if __name__ == "__main__":  # test_every_instruction_set's child: the kernels as built here
    print(nq.isa())
    for t in TYPES:
        check_gemm(t, seed=t)
