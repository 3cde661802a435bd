"""Multi-head latent attention against a multi-head cache of the same width, and gpt-oss's
harmony parsers, on the CPU, in one sitting.

Usage:
    python benchmarks/bench_latent.py                      # 1 and 16 streams, 4096-token prompts
    python benchmarks/bench_latent.py --context 1024 --streams 1,4   # quicker

Two random-weight bf16 models of one width (hidden 1024, 4 layers, 16 heads, MLP 2816,
vocab 4096), saved as Hugging Face checkpoints and served by the Engine with default flags:
`mla`, DeepSeek-V3's attention (query rank 384, latent rank 256, 64 + 32 query/key dims per
head, values 64; its MLPs dense), and `mha`, a Llama whose heads are 64 wide (its cache holds
every head's K and V). For each number of streams: decode tok/s at the context (each stream
a different prompt of that many tokens; the time of 65 new tokens less the time of 1, on
fresh prompts, so both include the same prefill), and the KV cache's bytes per token. Then
the harmony parsers (`--reasoning-parser gpt-oss --tool-call-parser gpt-oss`) over a
scripted gpt-oss answer, whole and streamed 4 characters at a time, in MB/s.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HIDDEN, LAYERS, HEADS, MLP, VOCAB = 1024, 4, 16, 2816, 4096
NEW_TOKENS = 64


def save_models(root: Path) -> dict[str, Path]:
    """The two checkpoints, random weights, with a word-level tokenizer each."""
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_model import save_with_word_tokenizer, spread_weights

    configs = {
        "mla": transformers.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, first_k_dense_replace=LAYERS,
            q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
            v_head_dim=64, max_position_embeddings=8192, bos_token_id=0, eos_token_id=1,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256),
        "mha": transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
            head_dim=64, max_position_embeddings=8192, bos_token_id=0, eos_token_id=1),
    }
    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        spread_weights(model)
        paths[name] = save_with_word_tokenizer(model.to(torch.bfloat16), root / name)
    return paths


def decode_rate(path: Path, streams: int, context: int, seed: int) -> tuple[float, int]:
    """(decode tok/s over `streams` prompts of `context` tokens, KV bytes per token): every
    stream's tokens after the last first token, over the time from it to the last token."""
    from radixmesh import Engine

    rng = random.Random(seed)
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": NEW_TOKENS + 1}
    prompts = [[rng.randrange(2, VOCAB) for _ in range(context)] for _ in range(streams)]
    with Engine(str(path), max_total_tokens=streams * (context + NEW_TOKENS + 1) + 64,
                chunked_prefill_size=1024, show_progress=False) as engine:
        pool = engine.runner.pool
        per_token = sum(t[0].numel() * t.element_size() for t in (*pool.k, *pool.v))
        arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]

        def read(i: int) -> None:
            for chunk in engine.generate(input_ids=prompts[i], sampling_params=params,
                                         stream=True):
                arrivals[i].append((time.perf_counter(), len(chunk["output_ids"])))

        threads = [threading.Thread(target=read, args=(i,)) for i in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    first = max(times[0][0] for times in arrivals)  # every stream is decoding from here
    last = max(times[-1][0] for times in arrivals)
    after = sum(n for times in arrivals for at, n in times if at > first)
    return after / (last - first), per_token


def harmony_transcript(turns: int) -> str:
    analysis = "The user wants the weather; I should call the tool and then answer. " * 6
    call = ('<|start|>assistant<|channel|>commentary to=functions.get_weather '
            '<|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>')
    final = "It is 18 degrees and sunny in Paris, with a light wind from the west. " * 4
    turn = (f"<|channel|>analysis<|message|>{analysis}<|end|>{call}"
            f"<|start|>assistant<|channel|>final<|message|>{final}<|end|>")
    return turn * turns


def parser_rates(text: str, repeats: int) -> tuple[float, float]:
    """MB/s of the gpt-oss reasoning and tool-call parsers over `text`: whole, streamed."""
    from radixmesh.core.reasoning import reasoning_parser
    from radixmesh.core.tool_formats import tool_parser

    tools = {"get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}}}}
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    whole, streamed = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        _, content = reasoning_parser("gpt-oss").parse(text)
        tool_parser("gpt-oss", tools).parse(content)
        whole.append(time.perf_counter() - start)
        start = time.perf_counter()
        reader, calls = reasoning_parser("gpt-oss"), tool_parser("gpt-oss", tools)
        for piece in pieces:
            calls.feed(reader.feed(piece).content)
        calls.feed(reader.finish().content)
        calls.finish()
        streamed.append(time.perf_counter() - start)
    mb = len(text.encode()) / 1e6
    return mb / statistics.median(whole), mb / statistics.median(streamed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--streams", default="1,16")
    args = parser.parse_args()
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                if line.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} CPUs; bf16, hidden {HIDDEN}, {LAYERS} layers, {HEADS} "
          f"heads; {args.context}-token prompts, {NEW_TOKENS} new tokens each")
    with tempfile.TemporaryDirectory() as root:
        paths = save_models(Path(root))
        for streams in [int(s) for s in args.streams.split(",")]:
            rates = {}
            for seed, (name, path) in enumerate(paths.items()):
                rates[name] = decode_rate(path, streams, args.context, seed)
            (mla, mla_bytes), (mha, mha_bytes) = rates["mla"], rates["mha"]
            print(f"{streams:3d} streams: decode tok/s mla {mla:8.1f}  mha {mha:8.1f}  "
                  f"({mla / mha:.2f}x); KV bytes per token mla {mla_bytes}, mha {mha_bytes} "
                  f"({mha_bytes / mla_bytes:.1f}x less)")
    text = harmony_transcript(50)
    whole, streamed = parser_rates(text, 5)
    print(f"harmony parsers over a {len(text) / 1e3:.0f} kB answer: whole {whole:.1f} MB/s, "
          f"streamed in 4-character pieces {streamed:.1f} MB/s")


if __name__ == "__main__":
    main()
