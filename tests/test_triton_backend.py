"""The Triton attention backend against the torch one, on CPU under the Triton interpreter:
one layer on mixed steps, the tiny model's forward, and padded decode steps (what a CUDA
graph replays).

Tolerances: float32 1e-5 for attention, 1e-4 for logprobs after the whole model; bfloat16
2e-2 for attention and 0.1 for logits after two layers (random weights, bf16 activations)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

from pathlib import Path

import pytest
import torch
from tiny_model import draft_script, emitted, forward_script, save_tiny_model, tokens

from radixmesh.engine.model.attention import AttentionMetadata, SeqSpan
from radixmesh.engine.model.attention_choice import make_attention
from radixmesh.engine.model.cuda_graphs import DecodeGraphs, batch_buckets
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.model import CausalLM
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.engine.model.torch_attention import TorchAttention
from radixmesh.engine.model.triton_attention import TritonAttention

Q_HEADS, KV_HEADS, DIM = 8, 2, 64


def mixed_step(page_size: int) -> tuple[AttentionMetadata, int]:
    """A step mixing decodes and extends, in an order where decode rows are not first:
    (new tokens, cached prefix) per request, with whole pages when page_size > 1."""
    shapes = [(6, 0), (1, 20), (1, 1), (5, 16), (1, 37)]
    spans, out_slots, start, page = [], [], 0, 3
    for n, prefix in shapes:
        total = prefix + n
        pages = range(page, page + -(-total // page_size))
        page += len(pages) + 1  # leave a gap: requests are not adjacent in the pool
        slots = torch.tensor([p * page_size + o for p in pages for o in range(page_size)])[:total]
        spans.append(SeqSpan(start, n, slots))
        out_slots.append(slots[prefix:])
        start += n
    return AttentionMetadata.from_spans(torch.cat(out_slots), tuple(spans)), page * page_size


@pytest.mark.parametrize(
    ("dtype", "page_size", "tol"),
    [(torch.float32, 1, 1e-5), (torch.bfloat16, 1, 2e-2), (torch.float32, 16, 1e-5)],
)
def test_one_layer_matches_torch_backend(dtype, page_size, tol):
    torch.manual_seed(0)
    meta, num_slots = mixed_step(page_size)
    tokens_ = meta.out_slots.numel()
    results = []
    for backend in (TorchAttention(DIM**-0.5), TritonAttention(DIM**-0.5, page_size)):
        torch.manual_seed(1)
        pool = KVPool(1, num_slots, KV_HEADS, DIM, dtype)
        pool.k[0].copy_(torch.randn_like(pool.k[0], dtype=torch.float32))
        pool.v[0].copy_(torch.randn_like(pool.v[0], dtype=torch.float32))
        qkv = torch.randn(tokens_, Q_HEADS + 2 * KV_HEADS, DIM).to(dtype)
        q, k, v = qkv.split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
        backend.prepare(meta)
        results.append((backend.forward(0, q, k, v, pool), pool))
    (expected, expected_pool), (out, pool) = results
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert torch.equal(pool.k[0], expected_pool.k[0]) and torch.equal(pool.v[0], expected_pool.v[0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random Llama, Qwen2 and Qwen3 models (4 query / 2 KV heads, head dim 16)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        kind: load_model(str(save_tiny_model(Path(root) / kind, kind)), progress=False)
        for kind in ("llama", "qwen2", "qwen3")
    }


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_runner_tokens_match_torch_backend(tiny, kind):
    """Chunked prefill, prefill + decode in one step, and batched decode: same tokens."""
    loaded = tiny[kind]
    runs = []
    for name in ("torch", "triton"):
        runner = ModelRunner(loaded.config, loaded.weights, torch.float32, 256, attention=name)
        runs.append([runner.forward(batch) for batch in forward_script(decode_steps=3)])
    expected, got = runs
    assert tokens(got) == tokens(expected)
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want.results, have.results, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.input_logprobs[1:] == pytest.approx(b.input_logprobs[1:], abs=1e-4)


def test_model_logits_close_in_bfloat16(tiny):
    loaded = tiny["qwen3"]
    model = CausalLM(loaded.config, loaded.weights, torch.bfloat16)
    meta, _ = mixed_step(1)
    cfg = loaded.config
    ids = torch.arange(meta.out_slots.numel()) * 7 % cfg.vocab_size
    positions = torch.cat(
        [torch.arange(s.kv_slots.numel() - s.q_len, s.kv_slots.numel()) for s in meta.spans()]
    )
    logits = []
    for backend in (TorchAttention(cfg.head_dim**-0.5), TritonAttention(cfg.head_dim**-0.5)):
        torch.manual_seed(0)
        pool = KVPool(cfg.num_layers, 128, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
        for t in (*pool.k, *pool.v):  # a random cached prefix
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        backend.prepare(meta)
        logits.append(model.logits(model.forward(ids, positions, backend, pool)))
    torch.testing.assert_close(logits[1], logits[0], atol=0.1, rtol=0.05)
    assert (logits[1].argmax(-1) == logits[0].argmax(-1)).float().mean() >= 0.9


def decode_step(lengths: list[int], first_slot: int) -> AttentionMetadata:
    spans, slot = [], first_slot
    for i, n in enumerate(lengths):
        spans.append(SeqSpan(i, 1, torch.arange(slot, slot + n)))
        slot += n
    return AttentionMetadata.from_spans(torch.stack([s.kv_slots[-1] for s in spans]), tuple(spans))


def test_padded_decode_steps_match_plain_ones(tiny):
    """Decode steps through DecodeGraphs (padded to a bucket, fixed buffers, run eagerly
    here) give the same hidden states and pool contents as ordinary steps."""
    loaded = tiny["llama"]
    cfg = loaded.config
    model = CausalLM(cfg, loaded.weights, torch.float32)
    scale = cfg.head_dim**-0.5

    def fresh_pool() -> KVPool:
        torch.manual_seed(0)
        pool = KVPool(cfg.num_layers, 160, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        for t in (*pool.k, *pool.v):
            t.copy_(torch.randn_like(t))
        return pool

    plain_pool, padded_pool = fresh_pool(), fresh_pool()
    plain = TritonAttention(scale)
    graphs = DecodeGraphs(model, TritonAttention(scale), padded_pool, 8, 64, capture=False)
    assert graphs.buckets == [1, 2, 4, 8]
    for lengths, first in (([9, 30, 4], 0), ([12, 1, 7, 20, 5], 50)):  # buckets 4 and 8
        meta = decode_step(lengths, first)
        ids = torch.arange(len(lengths)) + 11
        positions = torch.tensor(lengths) - 1
        assert graphs.fits(meta)
        got = graphs.run(ids, positions, meta)
        plain.prepare(meta)
        expected = model.forward(ids, positions, plain, plain_pool)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for a, b in zip(
            (*padded_pool.k, *padded_pool.v), (*plain_pool.k, *plain_pool.v), strict=True
        ):
            assert torch.equal(a, b)  # padding rows wrote nothing
    assert not graphs.fits(decode_step([65], 0))
    assert not graphs.fits(decode_step([1] * 9, 0))


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(300) == [1, 2, 4, *range(8, 257, 8), 272, 288, 300]


def test_backend_choice():
    assert isinstance(make_attention("auto", 0.5, torch.device("cpu")), TorchAttention)
    assert isinstance(make_attention("auto", 0.5, torch.device("cuda")), TritonAttention)
    assert isinstance(make_attention("triton", 0.5, torch.device("cpu")), TritonAttention)
    assert isinstance(make_attention("torch", 0.5, torch.device("cuda")), TorchAttention)
    with pytest.raises(ValueError, match="attention backend"):
        make_attention("flash", 0.5, torch.device("cpu"))


@pytest.mark.parametrize("graphs", [False, True], ids=["triton", "padded-graphs"])
def test_draft_trees_verify_on_the_triton_path(tiny, graphs):
    """The tree's rows, each over its own key list, through the Triton decode kernel (and
    the padded CUDA-graph path, run eagerly): the tokens of plain decoding."""
    loaded = tiny["llama"]
    plain = ModelRunner(loaded.config, loaded.weights, torch.float32, 256, attention="torch")
    ref = tokens([plain.forward(b) for b in forward_script()])
    steps, expected = draft_script(ref)
    runner = ModelRunner(loaded.config, loaded.weights, torch.float32, 256, attention="triton",
                         cuda_graph_max_bs=16 if graphs else 0, eager_graphs=graphs)
    assert emitted([runner.forward(b) for b in steps]) == expected
    assert runner.graph_steps == (2 if graphs else 0)  # the verify and the decode after it
