"""The native CPU kernels (decode attention, GEMM, RMSNorm, rotary, SiLU-mul) against plain float64
references and against the torch paths they replace."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.model.attention import AttentionMetadata, SeqSpan
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.linear import Linear
from radixmesh.engine.model.rope import RotaryEmbedding, apply_rotary
from radixmesh.engine.model.torch_attention import TorchAttention
from radixmesh.kernels import native

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
              slots: list[torch.Tensor], scale: float) -> torch.Tensor:
    """One request and one query head at a time, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_pool.shape[1]
    for b, s in enumerate(slots):
        for head in range(q.shape[1]):
            keys = k_pool[s, head // group].double()
            values = v_pool[s, head // group].double()
            probs = torch.softmax(keys @ q[b, head].double() * scale, dim=0)
            out[b, head] = probs @ values
    return out


def random_case(dtype: torch.dtype, hq: int, hkv: int, dim: int, lens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 17
    k_pool = torch.randn(num_slots, hkv, dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, hkv, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), hq, dim, generator=gen).to(dtype)
    order = torch.randperm(num_slots, generator=gen)  # scattered slots, as after evictions
    slots, start = [], 0
    for n in lens:
        slots.append(order[start : start + n])
        start += n
    return q, k_pool, v_pool, slots


# The bf16 GEMM and the native layers need AVX512-BF16; elsewhere the tests check that
# nothing picks them and that the fallback gives the same answers.
BF16_GEMM = bool(native.library().gemm_bf16_supported(64))


def test_library_builds_here():
    assert native.library() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hq", "hkv", "dim"),
    [(9, 3, 64), (4, 4, 64), (8, 2, 128), (6, 3, 48)],  # GQA 3, MHA, GQA 4 at D 128, odd D
)
def test_decode_matches_reference(dtype, hq, hkv, dim):
    lens = [1, 7, 33, 200, 64, 2]
    q, k_pool, v_pool, slots = random_case(dtype, hq, hkv, dim, lens, seed=hq * dim)
    width = max(lens)
    index = torch.zeros(len(lens), width, dtype=torch.long)
    for b, s in enumerate(slots):
        index[b, : len(s)] = s
    scale = dim**-0.5
    out = native.decode_attention(q, k_pool, v_pool, index, torch.tensor(lens), scale)
    want = reference(q, k_pool, v_pool, slots, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("sharpness", [0.0, 40.0])  # uniform weights; one key takes nearly all
def test_decode_softmax_extremes(sharpness):
    """Scores far apart (exp underflows to 0 for all but the top key) and all equal."""
    lens = [16, 31, 300]
    q, k_pool, v_pool, slots = random_case(torch.bfloat16, 9, 3, 64, lens, seed=5)
    q = (q.float() * sharpness).bfloat16()
    index = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for b, s in enumerate(slots):
        index[b, : len(s)] = s
    out = native.decode_attention(q, k_pool, v_pool, index, torch.tensor(lens), 0.125)
    want = reference(q, k_pool, v_pool, slots, 0.125)
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_decode_same_with_and_without_native(dtype):
    lens = [5, 130, 1, 48]
    q, k_pool, v_pool, slots = random_case(dtype, 9, 3, 64, lens, seed=7)
    # The step's new K/V land in each request's last slot.
    last = torch.stack([s[-1] for s in slots])
    meta = AttentionMetadata.from_spans(last, tuple(SeqSpan(b, 1, s) for b, s in enumerate(slots)))
    outs = []
    for use_native in (True, False):
        pool = KVPool(1, k_pool.shape[0], 3, 64, dtype)
        pool.k[0].copy_(k_pool)
        pool.v[0].copy_(v_pool)
        backend = TorchAttention(64**-0.5, native=use_native)
        backend.prepare(meta)
        outs.append(backend.forward(0, q, k_pool[last], v_pool[last], pool))
    torch.testing.assert_close(outs[0].double(), outs[1].double(), atol=TOLERANCE[dtype], rtol=0)
    want = reference(q, k_pool, v_pool, slots, 64**-0.5)
    torch.testing.assert_close(outs[0].double(), want, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize(("new", "prefix"), [(2, 0), (17, 0), (40, 100), (300, 5)])
def test_extend_matches_reference_and_flash(new, prefix):
    """Token i of n new ones sees the prefix and new tokens 0..i, read in place from the pool
    (scattered slots); torch's flash attention path agrees."""
    _, k_pool, v_pool, (slots,) = random_case(torch.bfloat16, 9, 3, 64, [prefix + new], 11)
    q = torch.randn(new, 9, 64, generator=torch.Generator().manual_seed(new)).bfloat16()
    out = native.extend_attention(q, k_pool, v_pool, slots, 0.125)
    want = torch.cat([
        reference(q[i : i + 1], k_pool, v_pool, [slots[: prefix + i + 1]], 0.125)
        for i in range(new)
    ])
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[torch.bfloat16], rtol=0)
    meta = AttentionMetadata.from_spans(slots[prefix:], (SeqSpan(0, new, slots),))
    outs = []
    for use_native in (True, False):
        pool = KVPool(1, k_pool.shape[0], 3, 64, torch.bfloat16)
        pool.k[0].copy_(k_pool)
        pool.v[0].copy_(v_pool)
        backend = TorchAttention(0.125, native=use_native)
        backend.prepare(meta)
        outs.append(backend.forward(0, q, k_pool[slots[prefix:]], v_pool[slots[prefix:]], pool))
    torch.testing.assert_close(outs[0], out, atol=0, rtol=0)
    torch.testing.assert_close(outs[1].double(), want, atol=TOLERANCE[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 33])  # row tiles of 8, and their tails
@pytest.mark.parametrize(("features", "depth"), [(97, 576), (32, 70)])  # padded N; K % 32 != 0
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_float64(rows, features, depth, with_bias):
    gen = torch.Generator().manual_seed(rows + features + with_bias)
    weight = torch.randn(features, depth, generator=gen).bfloat16()
    bias = torch.randn(features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, depth, generator=gen).bfloat16()
    want = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    if not BF16_GEMM:  # no AVX512-BF16: the kernel says no, and the layer falls back
        assert not native.gemm_supported(weight) and Linear(weight, bias).kind != "native"
        torch.testing.assert_close(Linear(weight, bias)(x).double(), want, rtol=2**-7,
                                   atol=1e-2)
        return
    assert native.gemm_supported(weight)
    out = native.gemm(x, native.pack_gemm_weight(weight), features, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, features)
    # Only the final rounding to bf16 differs from exact arithmetic.
    torch.testing.assert_close(out.double(), want, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize(("rows", "features"), [(1, 576), (9, 97), (33, 1536)])
def test_gemm_adds_residual_after_rounding(rows, features):
    """out = residual + (x @ W^T + b), each rounded to bf16 as torch's two ops round."""
    gen = torch.Generator().manual_seed(rows * features)
    weight = torch.randn(features, 64, generator=gen).bfloat16()
    bias = torch.randn(features, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    residual = torch.randn(rows, features, generator=gen).bfloat16()
    if not BF16_GEMM:  # the fallback adds the residual as torch's two ops do
        plain = torch.nn.functional.linear(x, weight, bias)
        assert torch.equal(Linear(weight, bias)(x, residual=residual), residual + plain)
        return
    packed = native.pack_gemm_weight(weight)
    plain = native.gemm(x, packed, features, bias)
    assert torch.equal(native.gemm(x, packed, features, bias, residual), residual + plain)
    layer = Linear(weight, bias)
    assert torch.equal(layer(x, residual=residual), residual + plain)


def test_layer_picks_native_for_bf16_and_onednn_for_float32():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(192, 64, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    bf16, fp32 = Linear(weight.bfloat16()), Linear(weight)
    # Without AVX512-BF16 neither the native kernel nor oneDNN takes bf16: torch's linear.
    assert (bf16.kind, fp32.kind) == ("native" if BF16_GEMM else "torch", "onednn")
    want = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16())
    torch.testing.assert_close(bf16(x.bfloat16()), want, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(fp32(x), torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (33, 576), (300, 576), (5, 9, 64)])
def test_rms_norm_matches_float64_and_torch(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape) + shape[0])
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    out = native.rms_norm(x, weight, 1e-5)
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    exact = exact * weight.double()
    assert out.dtype == dtype and out.shape == x.shape
    tolerance = {"rtol": 2**-8, "atol": 1e-2} if dtype == torch.bfloat16 else {
        "rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(out.double(), exact, **tolerance)
    want = torch.nn.functional.rms_norm(x, weight.shape, weight, 1e-5)
    torch.testing.assert_close(out, want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "dim"), [(1, 64), (37, 64), (300, 128), (5, 6)])
def test_rotary_equals_torch(dtype, tokens, dim):
    """In place on the q|k heads of a fused q|k|v row (strided), bit for bit torch's."""
    gen = torch.Generator().manual_seed(tokens + dim)
    rope = RotaryEmbedding(dim, 4096, 10000.0, dtype)
    qkv = torch.randn(tokens, 13 * dim, generator=gen).to(dtype)
    qk = qkv[:, : 12 * dim].view(tokens, 12, dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    want = apply_rotary(qk.clone(), *rope.tables(positions))
    v_before = qkv[:, 12 * dim :].clone()
    assert native.rotary_supported(qk, rope.cos)
    out = native.rotary_(qk, positions, rope.cos, rope.sin)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(out, want)
    assert torch.equal(qkv[:, 12 * dim :], v_before)


@pytest.mark.parametrize("shape", [(1, 3072), (33, 3072), (4, 38)])  # vector body and tail
def test_silu_mul_matches_torch(shape):
    gen = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=gen) * 4).bfloat16()
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, float("nan")])
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    out = native.silu_mul(x)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    # torch's exp and this one differ in the last float bits: at most one bf16 step apart.
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-30, equal_nan=True)
    same = (out == want) | (out.isnan() & want.isnan())
    assert same.float().mean() > 0.999


@pytest.mark.parametrize("cols", [1, 15, 16, 49152, 1000])
def test_argmax_equals_torch(cols):
    """First index of the largest value, ties and NaN included, as torch answers."""
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(6, cols, generator=gen)
    x[1] = float("-inf")  # all equal: index 0
    x[2] = torch.randint(0, 3, (cols,), generator=gen).float()  # many ties of the maximum
    x[3, cols // 2] = float("nan")
    x[4, -1] = float("inf")
    x[5, : cols // 3] = 7.0
    assert torch.equal(native.argmax(x), x.argmax(dim=-1))


def test_out_of_range_rows_raise_instead_of_reading_past_the_pool():
    q, k_pool, v_pool, _ = random_case(torch.bfloat16, 9, 3, 64, [4], seed=1)
    index = torch.tensor([[0, 1, 2, k_pool.shape[0]]])
    with pytest.raises(IndexError, match="slot out of range"):
        native.decode_attention(q, k_pool, v_pool, index, torch.tensor([4]), 0.125)
    rope = RotaryEmbedding(64, 16, 10000.0, torch.bfloat16)
    with pytest.raises(IndexError, match="position out of range"):
        native.rotary_(torch.zeros(1, 2, 64).bfloat16(), torch.tensor([16]), rope.cos, rope.sin)


@pytest.mark.parametrize(("tokens", "k", "widths", "rank"),
                         [(37, 40, (24, 8, 70), 3), (9, 576, (576, 192, 192), 16),
                          (32, 1536, (64,), 5)])  # vector bodies, tails, partial blocks
def test_lora_add_matches_float32_torch(tokens, k, widths, rank):
    """cpu/lora.cpp: each token adds its adapter's B (A x) to its row of a fused
    projection's bf16 output (A and B^T bf16, the products float32, the delta rounded to
    bf16 before the add); tokens without an adapter and other columns untouched."""
    import ctypes

    from radixmesh.kernels.native_layer import _LoraBlock, _LoraProj

    lib = native.library()
    lib.lora_add_bf16.argtypes = [ctypes.POINTER(_LoraProj), ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    gen = torch.Generator().manual_seed(tokens + k)
    slots_count, r, n = 3, rank * len(widths), sum(widths) + 10
    a = (torch.randn(slots_count, r, k, generator=gen) * 0.1).bfloat16()
    bt = (torch.randn(slots_count, r, n, generator=gen) * 0.3).bfloat16()
    blocks = [(5 + sum(widths[:i]), w, i * rank, rank) for i, w in enumerate(widths)]
    table = (_LoraBlock * len(blocks))(*(_LoraBlock(*blk) for blk in blocks))
    proj = _LoraProj(a.data_ptr(), bt.data_ptr(), r, ctypes.addressof(table), len(blocks))
    slots = torch.randint(-1, slots_count, (tokens,), generator=gen, dtype=torch.int32)
    order = torch.argsort(slots, stable=True)[int((slots < 0).sum()):].to(torch.int32)
    x = torch.randn(tokens, k, generator=gen).bfloat16()
    out = torch.randn(tokens, n, generator=gen).bfloat16()
    expected = out.clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        h = a[s].float() @ x[t].float()
        for column, width, row, rk in blocks:
            delta = h[row : row + rk] @ bt[s, row : row + rk, column : column + width].float()
            expected[t, column : column + width] += delta.bfloat16()
    lib.lora_add_bf16(ctypes.byref(proj), order.data_ptr(), order.numel(), slots.data_ptr(),
                      x.data_ptr(), k, out.data_ptr(), n, 2)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(out[slots < 0], expected[slots < 0])
    assert torch.equal(out[:, :5], expected[:, :5]) and torch.equal(out[:, -10:], expected[:, -10:])
