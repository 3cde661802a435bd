"""Tensor parallelism: weight sharding, and two gloo ranks against one process (float32)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_model import (
    HEADS,
    INTERMEDIATE,
    KV_HEADS,
    draft_script,
    emitted,
    forward_script,
    save_tiny_model,
    tokens,
)

from radixmesh.core.step import StepResult
from radixmesh.engine.model.attention import AttentionMetadata, SeqSpan
from radixmesh.engine.model.linear import Linear
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.parallel import (
    RowParallelLinear,
    TensorParallel,
    check_divisible,
    destroy_tensor_parallel,
    init_tensor_parallel,
    local_config,
    shard_weights,
)
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.mesh.nats_server import free_port
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto.convert import result_from_proto, result_to_proto

KINDS = ("llama", "qwen2", "qwen3")
LOGIT_IDS = [(5 * i + 1) % 256 for i in range(10)]
LOGIT_SLOTS = list(range(200, 210))


def run_script(runner: ModelRunner) -> tuple[list[StepResult], torch.Tensor]:
    """The fixed batches, then every-position logits of one more prompt (in fresh slots)."""
    results = [runner.forward(batch) for batch in forward_script()]
    slots = torch.tensor(LOGIT_SLOTS)
    runner.attention.prepare(
        AttentionMetadata.from_spans(slots, (SeqSpan(0, len(LOGIT_IDS), slots),))
    )
    with torch.inference_mode():
        positions = torch.arange(len(LOGIT_IDS))
        hidden = runner.model.forward(
            torch.tensor(LOGIT_IDS), positions, runner.attention, runner.pool
        )
        logits = runner.model.logits(hidden)
    return results, logits


def _rank_main(
    rank: int, size: int, addr: str, model_dirs: list[str], out_dir: str,
    quantization: str = "bf16",
) -> None:
    """One rank of the group: run the script on every model, save what it got."""
    torch.set_num_threads(1)
    tp = init_tensor_parallel(addr, rank, size)
    try:
        for i, model_dir in enumerate(model_dirs):
            loaded = load_model(model_dir, progress=False, quantization=quantization)
            shard_weights(loaded.config, loaded.weights, rank, size)
            runner = ModelRunner(loaded.config, loaded.weights, torch.float32, 256, tp=tp)
            assert (runner.model.layers[0].mlp.down.kind == "quant") == (quantization == "q8_0")
            results, logits = run_script(runner)
            saved = {
                "results": [result_to_proto(r).SerializeToString() for r in results],
                "logits": logits,
            }
            torch.save(saved, Path(out_dir) / f"rank{rank}-model{i}.pt")
    finally:
        destroy_tensor_parallel()


def run_ranks(target: Any, size: int, *args: Any) -> None:
    """`target(rank, size, addr, *args)` in a spawned process per rank of one gloo group;
    every rank must exit 0."""
    ctx = multiprocessing.get_context("spawn")
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(rank, size, addr, *args)) for rank in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * size


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("tiny")
    return [save_tiny_model(root / kind, kind) for kind in KINDS]


def test_shards_concatenate_to_the_full_weights(model_dirs) -> None:
    full = load_model(str(model_dirs[1]), progress=False)  # qwen2: q/k/v biases too
    shards = []
    for rank in range(2):
        part = load_model(str(model_dirs[1]), progress=False)
        shard_weights(part.config, part.weights, rank, 2)
        shards.append(part.weights)
    for name, w in full.weights.items():
        pieces = [s[name] for s in shards]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            dim = 1
        elif name.endswith(("_proj.weight", "_proj.bias")):
            dim = 0
        else:
            assert all(torch.equal(p, w) for p in pieces), f"{name} must be replicated"
            continue
        assert pieces[0].shape[dim] == w.shape[dim] // 2, name
        assert torch.equal(torch.cat(pieces, dim=dim), w), name
    local = local_config(full.config, 2)
    assert (local.num_heads, local.num_kv_heads) == (HEADS // 2, KV_HEADS // 2)
    assert local.intermediate_size == INTERMEDIATE // 2
    assert (local.hidden_size, local.vocab_size) == (full.config.hidden_size, 256)


def test_uneven_split_is_a_clear_error(model_dirs) -> None:
    loaded = load_model(str(model_dirs[0]), progress=False)
    with pytest.raises(ValueError, match="does not divide the model's num_heads"):
        check_divisible(loaded.config, 3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        check_divisible(loaded.config, 4)  # 4 heads split, 2 KV heads do not


def test_one_rank_keeps_the_plain_layers(model_dirs) -> None:
    loaded = load_model(str(model_dirs[0]), progress=False)
    runner = ModelRunner(loaded.config, loaded.weights, torch.float32, 64)
    layer = runner.model.layers[0]
    assert type(layer.o) is Linear and type(layer.mlp.down) is Linear
    assert runner.pool.k[0].shape[1] == KV_HEADS
    tp = TensorParallel(rank=0, size=2)
    shard_weights(loaded.config, loaded.weights, 0, 2)
    sharded = ModelRunner(loaded.config, loaded.weights, torch.float32, 64, tp=tp)
    assert isinstance(sharded.model.layers[0].o, RowParallelLinear)
    assert sharded.pool.k[0].shape[1] == KV_HEADS // 2


@pytest.mark.parametrize("quantization", ["bf16", "q8_0"])
def test_two_ranks_match_one_process(model_dirs, tmp_path, quantization) -> None:
    """Also with Q8_0 weights: each rank's shards are whole blocks, so its int8 inputs are
    the one process's; only the order of the final sums differs. Under Q8_0 that order can
    move an activation across an int8 rounding boundary of the next layer's input: one
    input's step of amax / 127 (measured: one prompt logprob 1.4e-3 away, on an Intel Xeon),
    so its logprobs are held to 5e-3 there."""
    tol = 1e-4 if quantization == "bf16" else 5e-3
    run_ranks(_rank_main, 2, [str(d) for d in model_dirs], str(tmp_path), quantization)
    for i, model_dir in enumerate(model_dirs):
        loaded = load_model(str(model_dir), progress=False, quantization=quantization)
        ref_results, ref_logits = run_script(
            ModelRunner(loaded.config, loaded.weights, torch.float32, 256)
        )
        ranks = [torch.load(tmp_path / f"rank{r}-model{i}.pt") for r in range(2)]
        got = [
            [result_from_proto(wpb.StepResult.FromString(b)) for b in saved["results"]]
            for saved in ranks
        ]
        kind = KINDS[i]
        assert tokens(got[0]) == tokens(ref_results), f"{kind}: rank 0 differs from tp=1"
        assert tokens(got[1]) == tokens(got[0]), f"{kind}: rank 1 diverged from rank 0"
        torch.testing.assert_close(ranks[0]["logits"], ref_logits, atol=1e-4, rtol=1e-4)
        for ours, ref in zip(got[0], ref_results, strict=True):
            for a, b in zip(ours.results, ref.results, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=tol)
                assert a.input_logprobs_start == b.input_logprobs_start
                assert list(a.input_logprobs)[1:] == pytest.approx(
                    list(b.input_logprobs)[1:], abs=tol
                )
                assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def _draft_rank_main(rank: int, size: int, addr: str, model_dir: str, ref: list[list[int]],
                     out_dir: str) -> None:
    """One rank verifying draft_script's trees; saves the tokens it output."""
    torch.set_num_threads(1)
    tp = init_tensor_parallel(addr, rank, size)
    try:
        loaded = load_model(model_dir, progress=False)
        shard_weights(loaded.config, loaded.weights, rank, size)
        runner = ModelRunner(loaded.config, loaded.weights, torch.float32, 256, tp=tp)
        steps, _ = draft_script(ref)
        torch.save(emitted([runner.forward(b) for b in steps]), Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_tensor_parallel()


def test_two_ranks_verify_drafts_as_one_process(model_dirs, tmp_path) -> None:
    """Rank 0 walks the trees and sends the accepted paths; rank 1 moves the same K/V, so
    both feed the same tokens next and output what one process does."""
    loaded = load_model(str(model_dirs[0]), progress=False)
    runner = ModelRunner(loaded.config, loaded.weights, torch.float32, 256)
    ref = tokens([runner.forward(b) for b in forward_script()])
    _, expected = draft_script(ref)
    run_ranks(_draft_rank_main, 2, str(model_dirs[0]), ref, str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == expected, f"rank {rank}"


def _lora_script() -> list:
    """forward_script with request "a" under LoRA adapter "a" and "b" under none."""
    batches = forward_script()
    batches[0].new_requests[0].lora = "a"
    return batches


def _lora_runner(model_dir: str, adapter_dir: str, tp: TensorParallel | None) -> ModelRunner:
    from radixmesh.core.settings import LoraSettings
    from radixmesh.engine.model.lora import lora_pool

    loaded = load_model(model_dir, progress=False)
    if tp is not None:
        shard_weights(loaded.config, loaded.weights, tp.rank, tp.size)
    runner = ModelRunner(loaded.config, loaded.weights, torch.float32, 256, tp=tp)
    settings = LoraSettings(enable_lora=True, lora_paths=f"a={adapter_dir}")
    runner.attach_lora(lora_pool(settings, loaded.config, torch.float32, torch.device("cpu"), tp))
    return runner


def _lora_rank_main(rank: int, size: int, addr: str, model_dir: str, adapter_dir: str,
                    out_dir: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(addr, rank, size)
    try:
        runner = _lora_runner(model_dir, adapter_dir, tp)
        results = [runner.forward(b) for b in _lora_script()]
        torch.save([result_to_proto(r).SerializeToString() for r in results],
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_tensor_parallel()


def test_two_ranks_split_a_lora_adapter_as_its_projections(model_dirs, tmp_path) -> None:
    """Each rank holds its share of the adapter (B's rows of q/k/v and gate/up, A's columns
    of o and down) and the group sums o's and down's partial B A x with their base output:
    the one process's tokens and logprobs."""
    from test_lora import save_adapter

    adapter = save_adapter(tmp_path / "a", {"r": 4, "lora_alpha": 8}, dict.fromkeys(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 4), 3)
    run_ranks(_lora_rank_main, 2, str(model_dirs[0]), str(adapter), str(tmp_path))
    one = _lora_runner(str(model_dirs[0]), str(adapter), None)
    expected = [one.forward(b) for b in _lora_script()]
    loaded = load_model(str(model_dirs[0]), progress=False)
    bare = ModelRunner(loaded.config, loaded.weights, torch.float32, 256)
    assert tokens([bare.forward(b) for b in forward_script()]) != tokens(expected)
    for rank in range(2):
        got = [result_from_proto(wpb.StepResult.FromString(b))
               for b in torch.load(tmp_path / f"rank{rank}.pt")]
        assert tokens(got) == tokens(expected), f"rank {rank}"
        if rank == 0:
            for ours, ref in zip(got, expected, strict=True):
                for a, b in zip(ours.results, ref.results, strict=True):
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
