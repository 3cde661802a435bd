"""What the in-process engine's detokenization costs per update.

The Engine detokenizes on its scheduler thread while the worker thread runs the model, so
every microsecond here is taken from batch decoding on a small machine. This feeds
`RequestStream.update()` as the engine does during batch decoding: N requests, one new
token per request per step, the last step finishing each by length, with and without stop
strings (ones that never match, so every request runs to its end and every update pays for
the matcher).

Usage:
    python benchmarks/bench_detokenize.py                    # 32 requests x 128 tokens, 7 runs
    python benchmarks/bench_detokenize.py --runs 15 --streaming

The output streams are slices of assistant-style text (prose, markdown, code, accented
letters, CJK and emoji, so that some characters span several tokens) encoded with the
default model's tokenizer. Figures are microseconds per update: the median and the
minimum over timed runs, after one warm-up run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.model_files import resolve_model_path
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.request import Req
from radixmesh.request_output import RequestStream

ANSWER = """\
Sure! Here is a short overview of how a radix prefix cache works, followed by an example.

## Overview

A radix tree stores token sequences so that requests sharing a prefix (a system prompt,
earlier turns of a conversation, few-shot examples) reuse the key/value cache computed for
it. When a new request arrives, the scheduler walks the tree from the root, matching as many
tokens as possible; only the unmatched suffix needs a forward pass. Evicting the least
recently used leaves keeps memory bounded.

1. **Match**: walk the tree and lock the deepest matching node.
2. **Extend**: run the model on the remaining tokens.
3. **Insert**: add the new tokens as a child node once the request finishes.

```python
def match_prefix(root: Node, tokens: list[int]) -> tuple[Node, int]:
    node, matched = root, 0
    while matched < len(tokens) and tokens[matched] in node.children:
        child = node.children[tokens[matched]]
        common = shared_length(child.key, tokens[matched:])
        matched += common
        if common < len(child.key):
            break
        node = child
    return node, matched
```

Some notes in other languages, since users ask in many: en français, le cache évite de
recalculer les préfixes déjà vus — c'est très efficace pour les conversations longues.
中文说明：前缀缓存可以显著减少首个词元的延迟，尤其是在多轮对话中。日本語でも同じです。
Performance tips 🚀: batch similar requests together 👍, keep system prompts identical ✅,
and watch the hit rate 📈 in the metrics (radixmesh:cache_hit_rate ≈ 0.85 is typical).

In summary, the cache trades a little memory for a large cut in time-to-first-token. Let me
know if you would like a deeper dive into eviction policies or page sizes!
"""
PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nExplain radix prefix caching with an example.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Realistic stop strings that the answer never contains.
STOPS = ["</answer>", "\n\nUser:"]


def streams(tok: Tokenizer, requests: int, tokens: int) -> list[list[int]]:
    """`requests` output streams of `tokens` ids each, starting at different points."""
    ids = tok.encode(ANSWER, add_special_tokens=False)
    stride = max((len(ids) - tokens) // max(requests - 1, 1), 1)
    out = []
    for i in range(requests):
        start = (i * stride) % max(len(ids) - tokens, 1)
        out.append(ids[start : start + tokens])
    if any(len(s) < tokens for s in out):
        raise SystemExit(f"the answer is {len(ids)} tokens, fewer than {tokens}")
    return out


def run_once(
    tok: Tokenizer, prompt: list[int], outputs: list[list[int]], stop: list[str], streaming: bool
) -> float:
    """Seconds spent in the updates of one batch decoded to its end, one token per step."""
    reqs = []
    for i, out in enumerate(outputs):
        params = SamplingParams(max_new_tokens=len(out), stop=list(stop))
        req = Req(f"r{i}", list(prompt), params, seed=0)
        reqs.append((req, RequestStream(req, tok, streaming), out))
    elapsed = 0.0
    steps = len(outputs[0])
    for k in range(steps):
        for req, stream, out in reqs:
            req.output_ids.append(out[k])
            if k == steps - 1:
                req.finish = FinishReason(FinishKind.LENGTH, steps)
            start = time.perf_counter()
            matched = stream.update()
            elapsed += time.perf_counter() - start
            if matched is not None:
                raise SystemExit(f"stop string {matched!r} matched: pick one the text lacks")
    for req, stream, out in reqs:
        if stream.result()["text"] != tok.decode(out):
            raise SystemExit(f"{req.rid}: the streamed text differs from the whole decode")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--streaming", action="store_true", help="also build streamed chunks")
    args = parser.parse_args()

    tok = Tokenizer.from_path(str(resolve_model_path(None)))
    prompt = tok.encode(PROMPT)
    outputs = streams(tok, args.requests, args.tokens)
    updates = args.requests * args.tokens
    print(f"{args.requests} requests x {args.tokens} tokens, one token per update, "
          f"{args.runs} runs, streaming={args.streaming}")
    for label, stop in (("no stop strings", []), (f"stop={STOPS!r}", STOPS)):
        run_once(tok, prompt, outputs, stop, args.streaming)
        times = [run_once(tok, prompt, outputs, stop, args.streaming) for _ in range(args.runs)]
        per_update = [t / updates * 1e6 for t in times]
        print(f"  {label:<32} median {statistics.median(per_update):6.2f} us/update"
              f"   min {min(per_update):6.2f}")


if __name__ == "__main__":
    main()
