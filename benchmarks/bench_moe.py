"""A mixture-of-experts model of realistic shape against llama-server, with the bundled dense
model beside it, in one sitting.

Usage:
    python benchmarks/bench_moe.py --llama-server PATH        # ~15 minutes
    python benchmarks/bench_moe.py --llama-server PATH --quick

The MoE model is written once (to --model-dir) as a Qwen3-MoE GGUF of random Q4_K weights:
1,024 hidden, 16 layers, 16 query and 4 KV heads of 64, 16 experts of width 1,024 with 2
used per token, the bundled model's tokenizer (49,152 tokens) and an untied output layer:
0.95 B parameters, 0.19 B active per token. Random weights make the text meaningless, but
every request produces exactly the tokens it asks for (ignore_eos), so each side does the
same work. Each model is served by the whole mesh (`radixmesh up`'s processes, its
defaults) and by llama-server (16 slots, 2 threads, its other flags default), one after
the other, and measured with random 128-token prompts and 128 new tokens: one stream
(4 requests in turn; output tok/s and the median inter-token gap) and 16 concurrent
streams (32 requests; output tok/s). RSS is read after the work, summed over the mesh's
processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from peer_server import Processes, llama_server, llama_version

from radixmesh.bench.backends import Backend, OpenAIBackend, RadixmeshBackend
from radixmesh.bench.runner import Load, run_loads
from radixmesh.bench.workloads import random_workload, word_pool
from radixmesh.core.gguf import read_gguf
from radixmesh.core.model_files import resolve_model_path
from radixmesh.core.tokenizer import Tokenizer

SEED = 1234
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 1024, 16, 16, 4, 64
EXPERTS, USED, EXPERT_WIDTH = 16, 2, 1024
CONTEXT = 4096
Q4_K = gguf.GGMLQuantizationType.Q4_K
# The tokenizer's keys copied from the bundled GGUF, with the writer's method for each.
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "add_tokenizer_model",
    "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list",
    "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
    "tokenizer.chat_template": "add_chat_template",
}


def log(message: str) -> None:
    print(f"[bench-moe] {message}", file=sys.stderr, flush=True)


def q4k(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Random Q4_K blocks for a tensor of `shape` (rows of 256-value blocks): random bits,
    float16 scales of +-[2.5e-5, 1e-4], small enough that 16 layers keep activations sane."""
    block, size = gguf.GGML_QUANT_SIZES[Q4_K]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for at in (0, 2):  # d and dmin
        scale = rng.uniform(2.5e-5, 1e-4, raw.shape[:-1]) * rng.choice([-1, 1], raw.shape[:-1])
        raw[..., at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(*shape[:-1], -1)


def write_moe_gguf(path: Path) -> None:
    """The synthetic Qwen3-MoE model described in the module's docstring."""
    source = read_gguf(resolve_model_path(None), tensors=False).metadata
    vocab = len(source["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(SEED)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(EXPERT_WIDTH)
    w.add_expert_feed_forward_length(EXPERT_WIDTH)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_expert_weights_norm(True)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    for key, method in _TOKENIZER_KEYS.items():
        if key in source:
            getattr(w, method)(source[key])
    ones = np.ones(HIDDEN, dtype=np.float32)
    w.add_tensor("token_embd.weight", q4k(rng, vocab, HIDDEN), raw_dtype=Q4_K)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", q4k(rng, vocab, HIDDEN), raw_dtype=Q4_K)
    for i in range(LAYERS):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", ones)
        w.add_tensor(f"{blk}.ffn_norm.weight", ones)
        w.add_tensor(f"{blk}.attn_q_norm.weight", np.ones(HEAD_DIM, dtype=np.float32))
        w.add_tensor(f"{blk}.attn_k_norm.weight", np.ones(HEAD_DIM, dtype=np.float32))
        for name, rows in (("attn_q", HEADS * HEAD_DIM), ("attn_k", KV_HEADS * HEAD_DIM),
                           ("attn_v", KV_HEADS * HEAD_DIM)):
            w.add_tensor(f"{blk}.{name}.weight", q4k(rng, rows, HIDDEN), raw_dtype=Q4_K)
        w.add_tensor(f"{blk}.attn_output.weight", q4k(rng, HIDDEN, HEADS * HEAD_DIM),
                     raw_dtype=Q4_K)
        router = rng.normal(0, HIDDEN**-0.5, (EXPERTS, HIDDEN)).astype(np.float32)
        w.add_tensor(f"{blk}.ffn_gate_inp.weight", router)
        for name in ("ffn_gate_exps", "ffn_up_exps"):
            w.add_tensor(f"{blk}.{name}.weight", q4k(rng, EXPERTS, EXPERT_WIDTH, HIDDEN),
                         raw_dtype=Q4_K)
        w.add_tensor(f"{blk}.ffn_down_exps.weight", q4k(rng, EXPERTS, HIDDEN, EXPERT_WIDTH),
                     raw_dtype=Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


async def measure(backend: Backend, pool: list[int], quick: bool) -> dict[str, Any]:
    """One stream, then 16 concurrent streams, of random 128-token prompts x 128 tokens."""
    out_len = 32 if quick else 128
    one = random_workload(pool, SEED, 2 if quick else 4, 128, out_len)
    many = random_workload(pool, SEED + 1, 16 if quick else 32, 128, out_len)
    try:
        (single,) = await run_loads(backend, one, [Load(1, seed=SEED)], pool, progress=False)
        (multi,) = await run_loads(backend, many, [Load(16, seed=SEED)], pool, progress=False)
    finally:
        await backend.close()
    for run in (single, multi):
        if run["failed"] or not run["exact_output_lengths"]:
            log(f"warning: {run['failed']} failed, exact lengths {run['exact_output_lengths']}, "
                f"{run['errors'][:3]}")
    return {"one_stream_tok_s": single["output_throughput"],
            "one_stream_itl_ms": single["itl_ms"]["p50"],
            "streams16_tok_s": multi["output_throughput"]}


def run_radixmesh(model: Path, tok: Tokenizer, pool: list[int], quick: bool) -> dict[str, Any]:
    from radixmesh.launcher import Mesh, MeshArgs

    with tempfile.TemporaryDirectory(prefix="moe-mesh-") as logs:
        args = MeshArgs(model_path=str(model), port=0, grpc_port=0, log_dir=logs)
        with Mesh(args).start() as mesh:
            result = asyncio.run(measure(RadixmeshBackend(mesh.url, tok), pool, quick))
            result["rss_mib"] = sum(Processes.of_mesh(mesh).rss_mib().values())
    return result


def run_llama(args: argparse.Namespace, model: Path, tok: Tokenizer, pool: list[int]
              ) -> dict[str, Any]:
    with llama_server(args, model) as (url, pid):
        backend = OpenAIBackend(url, tok, prompt_format="ids", keep_alive=False)
        result = asyncio.run(measure(backend, pool, args.quick))
        result["rss_mib"] = sum(Processes({"llama-server": [pid]}).rss_mib().values())
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", default=shutil.which("llama-server"),
                   help="the llama-server binary (default: the one on PATH)")
    p.add_argument("--llama-args", default="", help="more llama-server flags")
    p.add_argument("--threads", type=int, default=2, help="llama-server's CPU threads")
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "radixmesh-moe"),
                   help="where the synthetic MoE GGUF is written (kept for the next run)")
    p.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    if not args.llama_server:
        p.error("no llama-server on PATH: pass --llama-server PATH")
    moe = Path(args.model_dir) / "moe-16x-top2-Q4_K.gguf"
    if not moe.is_file():
        moe.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing {moe}")
        write_moe_gguf(moe)
    tok = Tokenizer.from_path(None)
    pool = word_pool(tok)
    results: dict[str, dict[str, Any]] = {}
    for label, model in (("MoE 16x top-2, Q4_K", moe), ("dense SmolLM2, Q4_1",
                                                         resolve_model_path(None))):
        log(f"{label}: radixmesh")
        mesh = run_radixmesh(model, tok, pool, args.quick)
        log(f"{label}: llama-server")
        peer = run_llama(args, model, tok, pool)
        results[label] = {"radixmesh": mesh, "llama-server": peer}
    print(f"llama-server {llama_version(args.llama_server)}, flags -np 16 -c 32768 "
          f"-t {args.threads} -tb {args.threads} {args.llama_args}".rstrip())
    print(f"{'model':<22}{'figure':<26}{'radixmesh':>11}{'llama-server':>14}{'ratio':>8}")
    for label, sides in results.items():
        mesh, peer = sides["radixmesh"], sides["llama-server"]
        for key, name in (("one_stream_tok_s", "one stream, tok/s"),
                          ("one_stream_itl_ms", "one stream, ITL p50 ms"),
                          ("streams16_tok_s", "16 streams, tok/s"), ("rss_mib", "RSS, MiB")):
            print(f"{label:<22}{name:<26}{mesh[key]:>11.1f}{peer[key]:>14.1f}"
                  f"{mesh[key] / peer[key]:>7.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
