"""The bundled SmolLM2-135M-Instruct (a Q4_1 GGUF with Q8_0 embeddings) served in its own
types (quantization=gguf, the CPU default) against the same file dequantized to bf16: the
same next-token choices over a fixed text, its perplexity within 2%, and greedy streams."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixmesh.api import Engine

TEXT = (Path(__file__).parent / "data" / "perplexity.txt").read_text()
PROMPTS = [
    "Explain how a refrigerator works.",
    "Write a short story about a lighthouse keeper.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle in detail.",
    "def quicksort(arr):",
    "List five facts about the planet Mars.",
]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    """The default engine (quantization=auto: gguf for a GGUF file on the CPU) and bf16."""
    made = {
        "gguf": Engine(max_total_tokens=4096, show_progress=False),
        "bf16": Engine(quantization="bf16", max_total_tokens=4096, show_progress=False),
    }
    yield made
    for engine in made.values():
        engine.shutdown()


def scored(engine: Engine) -> dict[str, Any]:
    out = engine.generate(TEXT, {"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=1)
    assert isinstance(out, dict)
    return out["meta_info"]


def test_the_default_keeps_the_files_types(engines):
    model = engines["gguf"].runner.model
    assert model.lm_head.kind == "quant" and model.native_layers is not None
    assert {p.qtype.name for p in model.layers[0].qkv.parts} == {"Q4_1"}
    assert model.embed.qtype.name == "Q8_0"
    assert engines["bf16"].runner.model.layers[0].qkv.kind != "quant"


LOAD = """
import torch
from radixmesh.kernels.native_quant import QuantizedWeight
from radixmesh.engine.model.model_source import load_model
def vm():
    fields = [ln.split() for ln in open("/proc/self/status") if ln.startswith("Vm")]
    return {f[0][:-1]: int(f[1]) // 1024 for f in fields}
before = vm()["VmRSS"]
loaded = load_model(None, progress=False, quantization="gguf")
after = vm()
held = sum(w.nbytes for w in loaded.weights.values() if isinstance(w, QuantizedWeight))
print(before, after["VmRSS"], after["VmHWM"], held // 2**20)
"""


def test_loading_holds_one_copy():
    """The weights take the file's bytes, and loading them never holds much more: the file's
    pages are let go as they are read (measured: peak 6 MiB above the end)."""
    out = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                         check=True).stdout.split()
    before, rss, peak, held = map(int, out)
    assert 88 <= held <= 94  # the file is 93.8 MiB, its metadata and norms included
    assert rss - before < held + 60  # the weights, and what reading the metadata left (44)
    assert peak - rss < 20, (before, rss, peak)


def test_perplexity_and_next_token_choices(engines):
    """Teacher-forced over 1,107 tokens: perplexity within 2% of the bf16 path, and the same
    top token at 90% or more of the positions (measured 93%). Measured: +0.1-0.8% on AMD
    hosts; +1.7% on an Intel Xeon (16.93 against 16.64), where the file dequantized to
    float32 scores 16.67: the quantized path's int8 activations cost it 1.6% and the bf16
    path lands 0.14% under float32 there."""
    meta = {q: scored(e) for q, e in engines.items()}
    ppl = {}
    for q, m in meta.items():
        logprobs = [lp for lp, _, _ in m["input_token_logprobs"] if lp is not None]
        assert len(logprobs) == m["prompt_tokens"] - 1 > 1000
        ppl[q] = math.exp(-sum(logprobs) / len(logprobs))
    print(f"perplexity gguf {ppl['gguf']:.3f} bf16 {ppl['bf16']:.3f}")
    assert abs(ppl["gguf"] / ppl["bf16"] - 1) < 0.02
    tops = {q: [top[0][1] for top in m["input_top_logprobs"] if top] for q, m in meta.items()}
    same = sum(a == b for a, b in zip(tops["gguf"], tops["bf16"], strict=True))
    share = same / len(tops["gguf"])
    print(f"same top token at {share:.1%} of {len(tops['gguf'])} positions")
    assert share >= 0.90


def test_greedy_streams(engines):
    """128 greedy tokens per prompt each way: the share of equal tokens at equal positions
    (reported; a stream follows its own first different choice from there on), and every
    stream opening the same way over its first tokens on most prompts."""
    params = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    outs = {q: [o["output_ids"] for o in e.generate(PROMPTS, params)]  # type: ignore[union-attr]
            for q, e in engines.items()}
    shares, firsts = [], []
    for a, b in zip(outs["gguf"], outs["bf16"], strict=True):
        assert len(a) == len(b) == 128
        shares.append(sum(x == y for x, y in zip(a, b, strict=True)) / 128)
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 128))
    print(f"equal tokens {sum(shares) / len(shares):.1%}; first difference at {firsts}")
    assert sum(f >= 4 for f in firsts) >= len(PROMPTS) // 2
