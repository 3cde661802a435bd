"""The Triton kernels on a CUDA GPU: correctness, decode bandwidth, extend TFLOP/s, and decode
steps/s of a random-weight ~0.6B Qwen3-style model with and without CUDA graphs.

Usage:
    python benchmarks/bench_kernels.py                   # everything, on a CUDA GPU
    python benchmarks/bench_kernels.py --json out.json   # also write the figures as JSON
    python benchmarks/bench_kernels.py --cpu-smoke       # correctness only, small shapes, on
                                                         # the CPU under the Triton interpreter

Sections:
  1. correctness: every kernel against its torch reference (bf16 and fp32, page sizes 1 and
     16, GQA, ragged lengths); max abs error and the tolerance it must meet.
  2. copy bandwidth: a 2 GiB device-to-device copy, bytes read + written per second (the
     ceiling decode attention is held to; an H200 is expected near 4.3 TB/s).
  3. decode attention: batch 64, context 4096, bf16, 32 query / 8 KV heads, head dim 128,
     slots scattered (page size 1) or in random 16-token pages; K+V bytes read per second,
     as a share of the measured copy bandwidth and of 4.3 TB/s.
  4. extend attention: 32 query / 8 KV heads, head dim 128, bf16; TFLOP/s counting the
     visible (causal) query-key pairs, 4 * head_dim FLOPs each.
  5. model decode: 28 layers, hidden 1024, 16 query / 8 KV heads, head dim 128, vocab 151936
     (~0.6B parameters with tied embeddings), bf16, random weights; decode steps/s of
     ModelRunner.forward (a StepBatch in, greedy tokens out: inputs, forward, logits,
     sampling) at batch 1, 16 and 64 over a 1024-token cached prefix, eager
     (cuda_graph_max_bs 0) and with CUDA graphs, and whether both produced the same tokens
     (they may not: the two modes can split the KV differently, and random weights leave
     near-ties).
Kernel times are triton.testing.do_bench medians; steps/s are wall-clock over 64 steps.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import triton

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.step import NewRequest, StepBatch, StepEntry
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.kernels.activation import silu_and_mul, silu_and_mul_reference
from radixmesh.kernels.decode_attention import decode_attention, decode_attention_reference
from radixmesh.kernels.extend_attention import extend_attention, extend_attention_reference
from radixmesh.kernels.kv_store import store_kv, store_kv_reference
from radixmesh.kernels.paging import page_table
from radixmesh.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_reference
from radixmesh.kernels.rotary import rotary_embedding, rotary_embedding_reference
from radixmesh.kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_reference_

BF16, F32 = torch.bfloat16, torch.float32
TOL = {F32: 1e-4, BF16: 2e-2}
NOMINAL_COPY_BYTES_PER_S = 4.3e12


def scattered_slots(lengths: list[int], page_size: int, device: torch.device) -> list[torch.Tensor]:
    """Each request's slots: whole pages of page_size spread over the pool in random order."""
    pages = torch.randperm(sum(-(-n // page_size) for n in lengths) * 2)
    out, used = [], 0
    for n in lengths:
        count = -(-n // page_size)
        mine = pages[used : used + count]
        used += count
        out.append((mine[:, None] * page_size + torch.arange(page_size)).flatten()[:n].to(device))
    return out


def pool_for(
    slots: list[torch.Tensor], kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device
):
    size = int(max(int(s.max()) for s in slots if s.numel())) + 1
    return [torch.randn(size, kv_heads, dim, device=device).to(dtype) for _ in range(2)]


def ratio(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """max |got - want| / (tol + tol * |want|): at most 1 passes (torch.testing's rule);
    with tol 0 the results must be identical (0 if so, inf if not)."""
    if tol == 0:
        return 0.0 if torch.equal(got, want) else float("inf")
    got, want = got.float(), want.float()
    return ((got - want).abs() / (tol + tol * want.abs())).max().item()


def ints(values: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device=device)


def extend_args(
    slots: list[torch.Tensor],
    pool: tuple[torch.Tensor, torch.Tensor],
    q_lens: list[int],
    prefixes: list[int],
    heads: tuple[int, int, int],
    page: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple:
    """Positional arguments of extend_attention: random new tokens over cached prefixes."""
    hq, hkv, dim = heads
    table = page_table([s.cpu() for s in slots], page).to(device)
    q, k, v = (
        torch.randn(sum(q_lens), hq + 2 * hkv, dim, device=device)
        .to(dtype)
        .split([hq, hkv, hkv], dim=1)
    )
    starts = [0, *torch.tensor(q_lens).cumsum(0)[:-1].tolist()]
    return (q, k, v, *pool, table, ints(starts, device), ints(q_lens, device),
            ints(prefixes, device), max(q_lens), dim**-0.5, page)


def attention_checks(device: torch.device, small: bool, dtype: torch.dtype) -> list[tuple]:
    """(name, got, want, tol) for decode and extend over page sizes and head layouts."""
    lengths = [1, 33, 100, 0] if small else [1, 4096, 777, 2048, 0, 65, 3000, 16]
    q_lens = [5, 1, 40] if small else [512, 1, 1000, 77]
    prefixes = [0, 33, 16] if small else [0, 2048, 300, 0]
    checks = []
    for page in (1, 16):
        for hq, hkv, dim in ((16, 8, 128), (9, 3, 64)):
            slots = scattered_slots(lengths, page, device)
            k_pool, v_pool = pool_for(slots, hkv, dim, dtype, device)
            table = page_table([s.cpu() for s in slots], page).to(device)
            q = torch.randn(len(lengths), hq, dim, device=device).to(dtype)
            args = (q, k_pool, v_pool, table, ints(lengths, device), dim**-0.5, page)
            name = f"page{page} {hq}q/{hkv}kv d{dim}"
            checks.append(
                (
                    f"decode {name}",
                    decode_attention(*args),
                    decode_attention_reference(*args),
                    TOL[dtype],
                )
            )

            slots = scattered_slots(prefixes, page, device)
            pool = pool_for([*slots, torch.tensor([0])], hkv, dim, dtype, device)
            args = extend_args(slots, pool, q_lens, prefixes, (hq, hkv, dim), page, dtype, device)
            checks.append(
                (
                    f"extend {name}",
                    extend_attention(*args),
                    extend_attention_reference(*args),
                    TOL[dtype],
                )
            )
    return checks


def elementwise_checks(device: torch.device, small: bool, dtype: torch.dtype) -> list[tuple]:
    """(name, got, want, tol) for the KV store, norm, rotary and activation kernels."""
    tokens, hidden = (6, 96) if small else (64, 4096)
    checks = []
    k, v = torch.randn(tokens, 16, 128, device=device).to(dtype).split([8, 8], dim=1)
    slots = torch.randperm(4 * tokens, device=device)[:tokens].int()
    slots[1] = -1  # a padding row
    pools = [torch.zeros(4 * tokens, 8, 128, dtype=dtype, device=device) for _ in range(4)]
    store_kv(k, v, pools[0], pools[1], slots)
    store_kv_reference(k, v, pools[2], pools[3], slots)
    checks.append(("store_kv", torch.stack(pools[:2]), torch.stack(pools[2:]), 0.0))

    x, res = torch.randn(2, tokens, hidden, device=device).to(dtype).unbind(0)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    got, want = fused_add_rms_norm(x, res, w, 1e-6), fused_add_rms_norm_reference(x, res, w, 1e-6)
    checks.append(("fused_add_rms_norm", torch.stack(got), torch.stack(want), TOL[dtype]))

    angles = torch.randn(4096, 64, device=device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = torch.randn(tokens, 24, 128, device=device).to(dtype)
    pos = torch.randint(0, 4096, (tokens,), device=device)
    for neox in (True, False):
        checks.append(
            (
                f"rotary {'neox' if neox else 'gptj'}",
                rotary_embedding(x, pos, cos, sin, neox),
                rotary_embedding_reference(x, pos, cos, sin, neox),
                TOL[dtype],
            )
        )

    x = torch.randn(tokens, 2 * (100 if small else 3072), device=device).to(dtype)
    checks.append(("silu_and_mul", silu_and_mul(x), silu_and_mul_reference(x), TOL[dtype]))
    return checks


def bitmask_check(device: torch.device, small: bool) -> tuple:
    vocab = 100 if small else 151936
    logits = torch.randn(4, vocab, device=device)
    words = -(-vocab // 32)
    mask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32, device=device)
    got, want = logits.clone(), logits.clone()
    apply_token_bitmask_(got, mask)
    apply_token_bitmask_reference_(want, mask)
    return ("token_bitmask", got, want, 0.0)


def correctness(device: torch.device, small: bool) -> list[dict[str, Any]]:
    """Each kernel against its reference (small shapes for the interpreter)."""
    torch.manual_seed(0)
    rows = []
    for dtype in (BF16, F32):
        checks = attention_checks(device, small, dtype) + elementwise_checks(device, small, dtype)
        if dtype == F32:
            checks.append(bitmask_check(device, small))
        for name, got, want, tol in checks:
            worst = ratio(got, want, tol)
            rows.append(
                {
                    "kernel": name,
                    "dtype": str(dtype)[6:],
                    "tol": tol,
                    # -inf against -inf (masked logits) is no error
                    "max_abs_err": (got.float() - want.float()).nan_to_num(0.0).abs().max().item(),
                    "ok": worst <= 1,
                }
            )
    return rows


def bench_ms(fn: Callable[[], Any]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=BF16, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def decode_bandwidth(device: torch.device, copy_bw: float) -> list[dict[str, Any]]:
    batch, context, hq, hkv, dim = 64, 4096, 32, 8, 128
    rows = []
    for page in (1, 16):
        torch.manual_seed(0)
        slots = scattered_slots([context] * batch, page, device)
        k_pool, v_pool = pool_for(slots, hkv, dim, BF16, device)
        table = page_table([s.cpu() for s in slots], page).to(device)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, hq, dim, device=device).to(BF16)
        ms = bench_ms(partial(decode_attention, q, k_pool, v_pool, table, lens, dim**-0.5, page))
        kv_bytes = 2 * batch * context * hkv * dim * 2
        bw = kv_bytes / (ms * 1e-3)
        rows.append(
            {
                "page_size": page,
                "ms": ms,
                "kv_bytes": kv_bytes,
                "bytes_per_s": bw,
                "share_of_copy": bw / copy_bw,
                "share_of_nominal": bw / NOMINAL_COPY_BYTES_PER_S,
            }
        )
    return rows


def extend_tflops(device: torch.device) -> list[dict[str, Any]]:
    hq, hkv, dim = 32, 8, 128
    rows = []
    for q_lens, prefixes in (([4096], [0]), ([1024] * 4, [3072] * 4), ([512] * 16, [0] * 16)):
        torch.manual_seed(0)
        # a request without a prefix still needs a table row; its entries are never read
        slots = scattered_slots([max(p, 1) for p in prefixes], 1, device)
        pool = pool_for(slots, hkv, dim, BF16, device)
        args = extend_args(slots, pool, q_lens, prefixes, (hq, hkv, dim), 1, BF16, device)
        out = torch.empty_like(args[0])
        ms = bench_ms(partial(extend_attention, *args, out=out))
        pairs = sum(n * p + n * (n + 1) // 2 for n, p in zip(q_lens, prefixes, strict=True))
        flops = 4 * dim * hq * pairs
        rows.append(
            {"q_lens": q_lens, "prefixes": prefixes, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        )
    return rows


QWEN3_SMALL = ModelConfig(
    architecture="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    qk_norm=True,
)


def random_weights(cfg: ModelConfig, device: torch.device) -> dict[str, torch.Tensor]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=BF16) * 0.02

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=BF16)

    w = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": ones(cfg.hidden_size),
    }
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        w |= {
            f"{p}.input_layernorm.weight": ones(cfg.hidden_size),
            f"{p}.post_attention_layernorm.weight": ones(cfg.hidden_size),
            f"{p}.self_attn.q_proj.weight": rand(q, cfg.hidden_size),
            f"{p}.self_attn.k_proj.weight": rand(kv, cfg.hidden_size),
            f"{p}.self_attn.v_proj.weight": rand(kv, cfg.hidden_size),
            f"{p}.self_attn.o_proj.weight": rand(cfg.hidden_size, q),
            f"{p}.self_attn.q_norm.weight": ones(cfg.head_dim),
            f"{p}.self_attn.k_norm.weight": ones(cfg.head_dim),
            f"{p}.mlp.gate_proj.weight": rand(cfg.intermediate_size, cfg.hidden_size),
            f"{p}.mlp.up_proj.weight": rand(cfg.intermediate_size, cfg.hidden_size),
            f"{p}.mlp.down_proj.weight": rand(cfg.hidden_size, cfg.intermediate_size),
        }
    return w


def decode_steps(
    runner: ModelRunner, batch: int, steps: int, warmup: int, prefix: int, context: int
) -> tuple[float, list[list[int]]]:
    """Steps/s of `batch` greedy requests decoding over a random cached prefix of `prefix`
    tokens (request i owns pool slots [i * context, (i + 1) * context)), and their tokens."""
    torch.manual_seed(0)
    for t in (*runner.pool.k, *runner.pool.v):  # the same random cached prefix every run
        t.normal_()
    greedy = SamplingParams(temperature=0)
    rids = [f"r{i}" for i in range(batch)]
    first = StepBatch(1)
    for i, rid in enumerate(rids):
        prefix_slots = list(range(i * context, i * context + prefix))
        first.new_requests.append(
            NewRequest(rid, i, [1] * prefix, prefix_slots, prefix + 1, greedy, 0)
        )
        first.entries.append(StepEntry(rid, [7 * i % 1000], [i * context + prefix], True))
    produced: list[list[int]] = []
    began = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize(runner.device)
            began = time.perf_counter()
        if step == 0:
            forward = first
        else:
            forward = StepBatch(step + 1, entries=[
                StepEntry(rid, [], [i * context + prefix + step], True)
                for i, rid in enumerate(rids)
            ])
        produced.append([r.token_id for r in runner.forward(forward).results])
    torch.cuda.synchronize(runner.device)
    elapsed = time.perf_counter() - began
    runner.forward(StepBatch(warmup + steps + 1, release=rids))
    return steps / elapsed, produced


def model_decode(device: torch.device, steps: int = 64, prefix: int = 1024) -> list[dict[str, Any]]:
    """Decode steps/s through ModelRunner over a random cached prefix, eager and with CUDA
    graphs."""
    cfg = QWEN3_SMALL
    weights = random_weights(cfg, device)
    warmup, batches = 4, (1, 16, 64)
    context = prefix + warmup + steps + 1
    results: dict[tuple[str, int], tuple[float, list[list[int]]]] = {}
    for mode, graph_bs in (("eager", 0), ("cuda_graphs", max(batches))):
        runner = ModelRunner(
            cfg,
            weights,
            BF16,
            max(batches) * context,
            attention="triton",
            device=device,
            cuda_graph_max_bs=graph_bs,
        )
        for batch in batches:
            results[mode, batch] = decode_steps(runner, batch, steps, warmup, prefix, context)
        del runner
        torch.cuda.empty_cache()
    return [
        {
            "batch": batch,
            "eager_steps_per_s": results["eager", batch][0],
            "graph_steps_per_s": results["cuda_graphs", batch][0],
            "same_tokens": results["eager", batch][1] == results["cuda_graphs", batch][1],
        }
        for batch in batches
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="correctness only, CPU")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu-smoke for the CPU correctness pass")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    report: dict[str, Any] = {
        "device": "cpu (interpreter)" if args.cpu_smoke else torch.cuda.get_device_name(device)
    }
    report["correctness"] = correctness(device, small=args.cpu_smoke)
    for row in report["correctness"]:
        print(
            f"{row['kernel']:<32} {row['dtype']:<9} max abs err {row['max_abs_err']:.2e} "
            f"(atol = rtol = {row['tol']:.0e}) {'ok' if row['ok'] else 'FAIL'}"
        )
    if not args.cpu_smoke:
        copy_bw = copy_bandwidth(device)
        report["copy_bytes_per_s"] = copy_bw
        print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
        report["decode_attention"] = decode_bandwidth(device, copy_bw)
        for row in report["decode_attention"]:
            print(
                f"decode b64 ctx4096 page{row['page_size']}: {row['ms']:.3f} ms, "
                f"{row['bytes_per_s'] / 1e12:.2f} TB/s = {row['share_of_copy']:.0%} of copy, "
                f"{row['share_of_nominal']:.0%} of 4.3 TB/s"
            )
        report["extend_attention"] = extend_tflops(device)
        for row in report["extend_attention"]:
            print(
                f"extend q{row['q_lens'][0]}x{len(row['q_lens'])} prefix {row['prefixes'][0]}: "
                f"{row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s"
            )
        report["model_decode"] = model_decode(device)
        for row in report["model_decode"]:
            print(
                f"qwen3-style 0.6B decode batch {row['batch']}: eager "
                f"{row['eager_steps_per_s']:.1f} steps/s, graphs {row['graph_steps_per_s']:.1f} "
                f"steps/s, same tokens: {row['same_tokens']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if not all(row["ok"] for row in report["correctness"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
