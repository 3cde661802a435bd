"""Embedding and rerank throughput of the in-process Engine against sentence-transformers
(and llama.cpp's llama-server, given --llama-server) on the same weights and CPU.

The checkpoint: the bundled SmolLM2 GGUF's weights as transformers dequantizes them, saved
with a sentence-transformers config (last-token pooling, Normalize), which radixmesh reads
to pick its pooling. Sides, one after the other in one run, with the same threads:
  radixmesh              Engine on that checkpoint, bfloat16 (its default)
  sentence-transformers  SentenceTransformer on it, float32 (its default), batch_size = the
                         batch
  llama.cpp              llama-server --embedding --pooling last on the GGUF itself, one
                         /v1/embeddings call per batch (-c 16384 -np 16 -ub 2048 -b 2048)
Each case is --batches inputs of --lengths tokens (word tokens that re-tokenize to
themselves); printed: inputs/s and tokens/s per side (median of --repeats) and the ratio to
sentence-transformers; the cosine of the warm-up's first vectors checks that the sides
agree. Every run embeds texts no side has seen (no prefix cache helps).
The issue's target: radixmesh >= 1.5x sentence-transformers at 32 x 512.

Then a rerank: --documents documents of 32 tokens against one 256-token query (Engine.rerank
with the default Qwen3-Reranker prompt, answer tokens yes,no) with the prefix cache on, and
off (each document under a cache_salt of its own, so nothing is shared): the target is the
cache making it >= 2x faster.

Usage:
    python benchmarks/bench_embed.py
    python benchmarks/bench_embed.py --batches 1,32 --lengths 64,512 --repeats 3
    python benchmarks/bench_embed.py --llama-server PATH/llama-server
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from radixmesh.api import Engine
from radixmesh.bench.report import cpu_name
from radixmesh.bench.workloads import word_pool
from radixmesh.core.model_files import default_model_path
from radixmesh.core.tokenizer import Tokenizer

SEED = 1234


def sentence_transformer_dir(out: Path) -> Path:
    """The bundled GGUF as a safetensors sentence-transformers checkpoint."""
    from transformers import AutoModel, AutoTokenizer

    gguf = default_model_path()
    from safetensors.torch import save_file

    model = AutoModel.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                      dtype=torch.float32)
    # The base model alone, as embedding checkpoints are saved (transformers will not save a
    # model it read from a GGUF file itself).
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(out / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": model.config.hidden_size, "pooling_mode_lasttoken": True}))
    (out / "2_Normalize").mkdir()
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 4096}))
    return out


def texts(pool: list[str], count: int, length: int, rng: random.Random) -> list[str]:
    return ["".join(rng.choice(pool) for _ in range(length)) for _ in range(count)]


def timed(run: Callable[[list[str]], list[list[float]]], inputs: list[list[str]]
          ) -> tuple[float, list[float]]:
    """Median seconds of runs over inputs[1:] (after a warm-up over inputs[0]: fresh texts
    each time, so that no side finds a run's prompts in a cache) and the first vector."""
    first = run(inputs[0])[0]
    times = []
    for batch in inputs[1:]:
        began = time.perf_counter()
        run(batch)
        times.append(time.perf_counter() - began)
    return statistics.median(times), first


def cosine(a: list[float], b: list[float]) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0).item()


class LlamaServer:
    """llama-server serving embeddings of the bundled GGUF on a free loopback port."""

    def __init__(self, binary: str, threads: int) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.flags = ["--embedding", "--pooling", "last", "-c", "16384", "-np", "16",
                      "-ub", "2048", "-b", "2048", "-t", str(threads)]
        self.proc = subprocess.Popen(
            [binary, "-m", str(default_model_path()), "--host", "127.0.0.1", "--port",
             str(self.port), *self.flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def embed(self, inputs: list[str]) -> list[list[float]]:
        body = json.dumps({"input": inputs, "model": "m"}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/embeddings", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as answer:
            data = json.loads(answer.read())["data"]
        return [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--lengths", default="64,512")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--llama-server", default=None, help="a built llama-server binary")
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    rng = random.Random(SEED)
    tokenizer = Tokenizer.from_path(None)
    pool = [tokenizer.decode([i]) for i in word_pool(tokenizer)]
    threads = torch.get_num_threads()
    cases = [(b, n) for n in map(int, args.lengths.split(",")) for b in map(int,
                                                                            args.batches.split(","))]
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = sentence_transformer_dir(Path(tmp) / "st")
        # Per case: the warm-up's texts (the same for every side, to compare their vectors)
        # and each timed run's.
        inputs = {case: [texts(pool, *case, rng) for _ in range(args.repeats + 1)]
                  for case in cases}
        results: dict[str, dict[tuple[int, int], tuple[float, list[float]]]] = {}
        with Engine(str(checkpoint), max_total_tokens=200_000, chunked_prefill_size=4096,
                    max_running_requests=256, show_progress=False) as engine:
            assert engine.pooling is not None and engine.pooling.kind == "last"
            results["radixmesh"] = {case: timed(lambda batch: [
                r["embedding"] for r in engine.encode(batch)], inputs[case]) for case in cases}
            tokens = {case: sum(len(tokenizer.encode(t)) for t in inputs[case][0])
                      for case in cases}
        model = SentenceTransformer(str(checkpoint), device="cpu")
        results["sentence-transformers"] = {case: timed(lambda batch: model.encode(
            batch, batch_size=len(batch), normalize_embeddings=True).tolist(), inputs[case])
            for case in cases}
        if args.llama_server:
            server = LlamaServer(args.llama_server, threads)
            try:
                results["llama.cpp"] = {case: timed(server.embed, inputs[case])
                                        for case in cases}
            finally:
                server.close()
        rerank = rerank_case(checkpoint, pool, args.documents, rng)
    print(f"Embeddings, {cpu_name()}, {threads} threads; medians of {args.repeats}")
    base = results["sentence-transformers"]
    for (batch, length) in cases:
        n = tokens[(batch, length)]
        for side, runs in results.items():
            seconds, first = runs[(batch, length)]
            ratio = base[(batch, length)][0] / seconds
            agree = cosine(first, results["radixmesh"][(batch, length)][1])
            rows.append(f"  {batch:>3} x {length:<4} {side:<22} {batch / seconds:9.1f} inputs/s "
                        f"{n / seconds:9.0f} tok/s  {ratio:5.2f}x  cos {agree:.5f}")
    print("\n".join(rows))
    print(f"Rerank, {args.documents} documents x 32 tokens, 256-token query: prefix cache on "
          f"{rerank[0]:.2f} s, off {rerank[1]:.2f} s: {rerank[1] / rerank[0]:.2f}x")


def rerank_case(checkpoint: Path, pool: list[str], documents: int, rng: random.Random
                ) -> tuple[float, float]:
    """Seconds to rerank the documents with the prefix cache on and off (medians of 3)."""
    query = texts(pool, 1, 256, rng)[0]
    docs = texts(pool, documents, 32, rng)
    with Engine(str(checkpoint), rerank_tokens="yes,no", max_total_tokens=200_000,
                show_progress=False) as engine:
        def on() -> None:
            engine.flush_cache()
            engine.rerank(query, docs)

        reranker = engine.reranker
        assert reranker is not None
        prompts = [reranker.prompt(query, doc) for doc in docs]

        def off() -> None:  # the same prompts at once, each in a namespace of its own
            engine.flush_cache()
            with ThreadPoolExecutor(len(prompts)) as threads:
                list(threads.map(lambda i: engine.encode(prompts[i], cache_salt=str(i)),
                                 range(len(prompts))))

        seconds = []
        for run in (on, off):
            run()
            times = []
            for _ in range(3):
                began = time.perf_counter()
                run()
                times.append(time.perf_counter() - began)
            seconds.append(statistics.median(times))
    return seconds[0], seconds[1]


if __name__ == "__main__":
    main()
