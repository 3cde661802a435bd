"""One side of bench_engine.py, in its own process: the in-process radixmesh Engine or
Hugging Face transformers on the prompts the parent drew, every figure timed the same way
(see bench_engine.py for the figures)."""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sizes:
    batch_requests: int
    batch_prompt_len: tuple[int, int]  # each batch prompt's length is drawn from [lo, hi]
    batch_new_tokens: int
    stream_prompt_len: int
    stream_new_tokens: int
    prefill_len: int
    prefix_requests: int
    prefix_len: int
    question_len: int
    prefix_new_tokens: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sizes:
        return cls(**{**d, "batch_prompt_len": tuple(d["batch_prompt_len"])})

    def kv_tokens(self) -> int:
        """KV slots that hold every request of the largest figure, with room to spare."""
        need = max(
            self.batch_requests * (self.batch_prompt_len[1] + self.batch_new_tokens),
            self.prefill_len + 1,
            self.prefix_len + self.prefix_requests * (self.question_len + self.prefix_new_tokens),
        )
        return -(-need * 5 // 4 // 1024) * 1024


# ---- measuring ----


def log(side: str, message: str) -> None:
    print(f"[{side}] {message}", file=sys.stderr, flush=True)


@contextmanager
def timer() -> Iterator[list[float]]:
    """`with timer() as t: ...` then t[0] is the elapsed seconds."""
    out: list[float] = []
    began = time.perf_counter()
    yield out
    out.append(time.perf_counter() - began)


def rss_mib() -> tuple[float, float]:
    """(peak, current) resident set size of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return peak, pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over runs."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def check_lengths(side: str, what: str, got: list[int], want: int) -> None:
    if any(n != want for n in got):
        raise RuntimeError(f"{side} {what}: expected {want} new tokens each, got {got}")


# ---- radixmesh side ----


def greedy(new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}


class RadixmeshSide:
    name = "radixmesh"

    def __init__(self, dtype: str, sizes: Sizes, quantization: str = "auto") -> None:
        from radixmesh.api import Engine

        self.kv_tokens = sizes.kv_tokens()
        self.engine = Engine(
            dtype=dtype, max_total_tokens=self.kv_tokens, show_progress=False, random_seed=0,
            quantization=quantization,
        )

    def info(self) -> dict[str, Any]:
        layer = self.engine.runner.model.layers[0].qkv
        return {
            "kv_pool_tokens": self.kv_tokens,
            "dtype": str(self.engine.runner.model.dtype),
            "quantization": self.engine.runner.quantization,
            "linear_kernel": layer.kind,
        }

    def batch(self, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        self.engine.flush_cache()
        with timer() as t:
            outs = self.engine.generate(input_ids=prompts, sampling_params=greedy(new_tokens))
        got = [o["meta_info"]["completion_tokens"] for o in outs]
        check_lengths(self.name, "batch", got, new_tokens)
        return {"batch_s": t[0], "batch_tok_s": sum(got) / t[0]}

    def stream(self, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int], dict]:
        """(seconds to the first token, seconds in all, output ids, final meta_info)."""
        first: float | None = None
        ids: list[int] = []
        meta: dict[str, Any] = {}
        began = time.perf_counter()
        chunks = self.engine.generate(
            input_ids=prompt, sampling_params=greedy(new_tokens), stream=True
        )
        for chunk in chunks:
            if first is None and chunk["output_ids"]:
                first = time.perf_counter() - began
            ids += chunk["output_ids"]
            meta = chunk["meta_info"]
        total = time.perf_counter() - began
        assert first is not None
        return first, total, ids, meta

    def single(self, prompt: list[int], new_tokens: int) -> tuple[dict[str, float], list[int]]:
        self.engine.flush_cache()
        first, total, ids, _ = self.stream(prompt, new_tokens)
        check_lengths(self.name, "stream", [len(ids)], new_tokens)
        decode = (len(ids) - 1) / (total - first)
        return {"stream_ttft_ms": first * 1e3, "stream_decode_tok_s": decode}, ids

    def prefill(self, prompt: list[int]) -> dict[str, float]:
        self.engine.flush_cache()
        with timer() as t:
            out = self.engine.generate(input_ids=prompt, sampling_params=greedy(1))
        assert isinstance(out, dict) and out["meta_info"]["cached_tokens"] == 0
        return {"prefill_tok_s": len(prompt) / t[0]}

    def shared_prefix(
        self, system: list[int], questions: list[list[int]], new_tokens: int
    ) -> dict[str, float]:
        self.engine.flush_cache()
        ttfts, cached = [], []
        for q in questions:  # one at a time: the first is cold, the rest find the prefix
            first, _, ids, meta = self.stream(system + q, new_tokens)
            check_lengths(self.name, "shared prefix", [len(ids)], new_tokens)
            ttfts.append(first)
            cached.append(meta["cached_tokens"])
        cold, warm = ttfts[0], statistics.median(ttfts[1:])
        self.engine.flush_cache()
        with timer() as t:
            outs = self.engine.generate(
                input_ids=[system + q for q in questions], sampling_params=greedy(new_tokens)
            )
        got = [o["meta_info"]["completion_tokens"] for o in outs]
        check_lengths(self.name, "shared-prefix batch", got, new_tokens)
        return {
            "prefix_cold_ttft_ms": cold * 1e3,
            "prefix_cached_ttft_ms": warm * 1e3,
            "prefix_ttft_ratio": cold / warm,
            "prefix_first_cached_tokens": cached[0],
            "prefix_hit_rate": sum(cached[1:]) / (len(system) * (len(questions) - 1)),
            "prefix_batch_s": t[0],
            "prefix_batch_tok_s": sum(got) / t[0],
            "prefix_batch_cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
        }

    def close(self) -> None:
        self.engine.shutdown()


# ---- Hugging Face side ----


class HFSide:
    name = "hf"

    def __init__(self, dtype: str, sizes: Sizes) -> None:
        from radixmesh.bench.hf_offline import HFGenerator

        self.hf = HFGenerator(dtype=dtype)

    def info(self) -> dict[str, Any]:
        model = self.hf.model
        layer = model.model.layers[0].self_attn.q_proj
        return {
            "weight_dtype": str(layer.weight.dtype),
            "linear_class": type(layer).__name__,
            "attn_implementation": model.config._attn_implementation,
        }

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy, exactly `new_tokens` each, prompts left-padded to one length."""
        return self.hf.generate(prompts, new_tokens)[0]

    def batch(self, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        with timer() as t:
            outs = self.generate(prompts, new_tokens)
        got = [len(o) for o in outs]
        check_lengths(self.name, "batch", got, new_tokens)
        return {"batch_s": t[0], "batch_tok_s": sum(got) / t[0]}

    def single(self, prompt: list[int], new_tokens: int) -> tuple[dict[str, float], list[int]]:
        with timer() as t_first:
            self.generate([prompt], 1)
        with timer() as t_total:
            ids = self.generate([prompt], new_tokens)[0]
        check_lengths(self.name, "stream", [len(ids)], new_tokens)
        decode = (len(ids) - 1) / (t_total[0] - t_first[0])
        return {"stream_ttft_ms": t_first[0] * 1e3, "stream_decode_tok_s": decode}, ids

    def prefill(self, prompt: list[int]) -> dict[str, float]:
        with timer() as t:
            self.generate([prompt], 1)
        return {"prefill_tok_s": len(prompt) / t[0]}

    def close(self) -> None:
        pass


# ---- one side, in its own process ----


def timed(side: str, what: str, runs: int, fn: Callable[[], dict[str, float]]) -> dict:
    results = []
    for i in range(runs):
        with timer() as t:
            results.append(fn())
        log(side, f"{what} run {i + 1}/{runs}: {t[0]:.1f} s")
    return median_of(results)


def run_side(name: str, dtype: str, threads: int | None, prompts: dict[str, Any]) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    sizes = Sizes.from_dict(prompts["sizes"])
    repeats, long_repeats = prompts["repeats"], prompts["long_repeats"]
    log(name, f"loading the model ({dtype}, {torch.get_num_threads()} torch threads)")
    with timer() as t_load:
        side: RadixmeshSide | HFSide = (
            HFSide(dtype, sizes) if name == "hf"
            else RadixmeshSide(dtype, sizes, "bf16" if name == "radixmesh-bf16" else "auto")
        )
    res: dict[str, Any] = {"side": name, "load_s": t_load[0], "info": side.info()}

    log(name, "warming up")
    with timer() as t_warm:
        side.batch(prompts["batch"], 2)
        side.single(prompts["stream"][0], min(8, sizes.stream_new_tokens))
        side.prefill(prompts["prefill"][0])
        if isinstance(side, RadixmeshSide):
            warm_q = prompts["prefix_questions"][:2]
            side.shared_prefix(prompts["prefix_system"][0], warm_q, 2)
    log(name, f"warm-up: {t_warm[0]:.1f} s")
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    new = sizes.batch_new_tokens
    res |= timed(name, "batch", long_repeats, lambda: side.batch(prompts["batch"], new))
    stream_ids: list[list[int]] = []

    def single() -> dict[str, float]:
        figures, ids = side.single(prompts["stream"][len(stream_ids) + 1], sizes.stream_new_tokens)
        stream_ids.append(ids)
        return figures

    res |= timed(name, "stream", repeats, single)
    res["stream_ids"] = stream_ids
    prefill_runs = iter(prompts["prefill"][1:])
    res |= timed(name, "prefill", repeats, lambda: side.prefill(next(prefill_runs)))
    if isinstance(side, RadixmeshSide):
        system, questions = prompts["prefix_system"][1], prompts["prefix_questions"]
        res |= timed(
            name,
            "shared prefix",
            long_repeats,
            lambda: side.shared_prefix(system, questions, sizes.prefix_new_tokens),
        )
    # Page faults while timing mean memory freed to the OS and touched again, step after step.
    res["timed_minor_faults_k"] = (
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    ) / 1e3
    side.close()
    res["peak_rss_mib"], res["end_rss_mib"] = rss_mib()
    res["info"]["torch_threads"] = torch.get_num_threads()
    return res
