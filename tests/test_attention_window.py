"""Sliding windows and logit soft-capping in the Triton attention kernels and backend, on CPU
under the Triton interpreter: each kernel against its torch reference and against a dense
masked softmax written here (transformers' eager attention: scores * scale, then softcap *
tanh(scores / softcap), then the causal mask and, with a window, kv_idx > q_idx - window).

Everything runs in float32, so the tolerance is 1e-5 (only summation order and the
kernels' exp2-based tanh differ)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import pytest
import torch
from test_kernels_attention import paged_slots

from radixmesh.engine.model.attention import AttentionMetadata, SeqSpan
from radixmesh.engine.model.attention_choice import make_attention
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.triton_attention import DecodeTables, TritonAttention
from radixmesh.kernels.decode_attention import decode_attention, decode_attention_reference
from radixmesh.kernels.extend_attention import extend_attention, extend_attention_reference
from radixmesh.kernels.paging import page_table

DIM = 16
SCALE = DIM**-0.5
BLOCK = 16  # small blocks, so short sequences still cross block and split boundaries
# Scores of random unit vectors sit around +-1: a cap of 2 bends them visibly.
CAP = 2.0
SHAPE = ("page_size", "q_heads", "kv_heads", "window", "softcap")


def dense(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """Queries q [n, Hq, D] at key positions `positions` [n] over one request's keys and
    values [L, Hkv, D] -> [n, Hq, D], all in float32."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * SCALE
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    kv_idx, q_idx = torch.arange(keys.shape[0])[None, :], positions[:, None]
    seen = kv_idx <= q_idx
    if window > 0:
        seen &= kv_idx > q_idx - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    SHAPE,
    [
        (1, 4, 2, 8, 0.0),  # a window inside most requests
        (4, 4, 1, 16, 0.0),  # as long as one request
        (4, 2, 2, 64, 0.0),  # longer than every request
        (1, 4, 1, 0, CAP),  # soft-capping alone
        (4, 4, 2, 5, CAP),  # both, a window of no whole page or block
    ],
    ids=["window8", "window16-paged", "window64-paged", "softcap", "both-paged"],
)
def test_decode(page_size, q_heads, kv_heads, window, softcap):
    torch.manual_seed(0)
    # one token, a padding row, shorter than the window, one and two blocks, several blocks
    lengths = [1, 0, 5, 16, 17, 40]
    k_pool, v_pool = (torch.randn(256, kv_heads, DIM) for _ in range(2))
    slots = paged_slots(lengths, page_size, 256 // page_size, seed=0)
    table = page_table(slots, page_size)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), q_heads, DIM)
    args = (q, k_pool, v_pool, table, seq_lens, SCALE, page_size)
    shape = {"window": window, "softcap": softcap}
    expected = torch.zeros_like(q)
    for b, s in enumerate(slots):
        if s.numel():
            at = torch.tensor([s.numel() - 1])
            expected[b] = dense(q[b : b + 1], k_pool[s], v_pool[s], at, window, softcap)[0]
    close(decode_attention_reference(*args, **shape), expected)
    # 1 split; 3 (uneven chunks of the window); the default count
    for splits in (1, 3, None):
        out = decode_attention(*args, splits, block_n=BLOCK, **shape)
        close(out, expected)


@pytest.mark.parametrize(
    SHAPE,
    [
        (1, 4, 2, 4, 0.0),  # shorter than a block: rows of one block start reading apart
        (4, 4, 1, 8, 0.0),  # cuts into the prefix
        (4, 2, 2, 32, 0.0),  # as long as the longest request
        (1, 4, 2, 100, 0.0),  # longer than every request
        (1, 4, 1, 0, CAP),  # soft-capping alone
        (4, 4, 2, 6, CAP),  # both
    ],
    ids=["window4", "window8-paged", "window32-paged", "window100", "softcap", "both-paged"],
)
def test_extend(page_size, q_heads, kv_heads, window, softcap):
    torch.manual_seed(1)
    # (new tokens, cached prefix): no prefix; one token over a long prefix; two blocks of
    # rows over a prefix; one past a block over a prefix that ends inside a page
    requests = [(5, 0), (1, 33), (20, 12), (17, 7)]
    q_lens = [n for n, _ in requests]
    prefixes = [p for _, p in requests]
    k_pool, v_pool = (torch.randn(256, kv_heads, DIM) for _ in range(2))
    slots = paged_slots(prefixes, page_size, 256 // page_size, seed=1)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0)[:-1].tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), q_heads, DIM)
    k, v = (torch.randn(sum(q_lens), kv_heads, DIM) for _ in range(2))
    args = (
        q,
        k,
        v,
        k_pool,
        v_pool,
        page_table(slots, page_size),
        starts,
        torch.tensor(q_lens, dtype=torch.int32),
        torch.tensor(prefixes, dtype=torch.int32),
        max(q_lens),
        SCALE,
        page_size,
    )
    shape = {"window": window, "softcap": softcap}
    expected = torch.empty_like(q)
    for start, (n, prefix), s in zip(starts.tolist(), requests, slots, strict=True):
        new = slice(start, start + n)
        keys, values = torch.cat((k_pool[s], k[new])), torch.cat((v_pool[s], v[new]))
        at = torch.arange(prefix, prefix + n)
        expected[new] = dense(q[new], keys, values, at, window, softcap)
    close(extend_attention_reference(*args, **shape), expected)
    close(extend_attention(*args, block_m=BLOCK, block_n=BLOCK, **shape), expected)


def test_softcap_and_window_change_the_result():
    """The cases above are not vacuous: each option alone moves the output."""
    torch.manual_seed(2)
    k_pool, v_pool = torch.randn(32, 1, DIM), torch.randn(32, 1, DIM)
    table = torch.arange(32, dtype=torch.int32)[None]
    args = (torch.randn(1, 2, DIM), k_pool, v_pool, table, torch.tensor([30], dtype=torch.int32))
    plain = decode_attention(*args, SCALE, num_splits=2, block_n=BLOCK)
    for shape in ({"window": 8}, {"softcap": CAP}):
        out = decode_attention(*args, SCALE, num_splits=2, block_n=BLOCK, **shape)
        assert (out - plain).abs().max() > 1e-2


def spans(requests: list[tuple[int, int]], page_size: int) -> AttentionMetadata:
    """A step of (new tokens, cached prefix) requests on whole pages, the pool's first three
    pages left out."""
    seqs, out_slots, start, page = [], [], 0, 3
    for n, prefix in requests:
        count = -(-(prefix + n) // page_size)
        pages = torch.arange(page, page + count)
        page += count
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[: prefix + n]
        seqs.append(SeqSpan(start, n, slots))
        out_slots.append(slots[prefix:])
        start += n
    return AttentionMetadata.from_spans(torch.cat(out_slots), tuple(seqs))


def backend_matches_dense(
    backend: TritonAttention, meta: AttentionMetadata, pool: KVPool, rows: int
) -> None:
    """Run every layer of a step of `rows` tokens (padding rows past meta's) and check each
    request's rows against the dense reference over the pool the step wrote."""
    for layer, window in enumerate(backend.windows):
        q = torch.randn(rows, 4, DIM)
        k, v = torch.randn(rows, 2, DIM), torch.randn(rows, 2, DIM)
        out = backend.forward(layer, q, k, v, pool)
        for s in meta.spans():
            new = slice(s.q_start, s.q_start + s.q_len)
            total = s.kv_slots.numel()
            keys, values = pool.k[layer][s.kv_slots], pool.v[layer][s.kv_slots]
            at = torch.arange(total - s.q_len, total)
            close(out[new], dense(q[new], keys, values, at, window, backend.softcap))


@pytest.mark.parametrize("page_size", [1, 4])
def test_backend_windows_per_layer(page_size):
    """A mixed step, then a padded decode step from DecodeTables (what a CUDA graph
    replays): each layer with its own window, all soft-capped."""
    torch.manual_seed(3)
    backend = make_attention(
        "triton", SCALE, torch.device("cpu"), page_size, windows=(4, 0, 9), softcap=CAP
    )
    assert isinstance(backend, TritonAttention)
    assert backend.windows == (4, 0, 9) and backend.softcap == CAP
    pool = KVPool(3, 256, 2, DIM, torch.float32)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn_like(t))
    mixed = spans([(6, 0), (1, 20), (12, 5), (1, 3)], page_size)
    backend.prepare(mixed)
    backend_matches_dense(backend, mixed, pool, 20)

    decodes = spans([(1, 20), (1, 2), (1, 8)], page_size)
    tables = DecodeTables.empty(4, 24 // page_size, torch.device("cpu"))  # 24 tokens
    backend.write_decode(decodes, tables)
    backend.bind_decode(tables)
    backend_matches_dense(backend, decodes, pool, 4)
