"""What a decode step's output costs at each hop of the mesh, per output token.

A step of N running requests, each one new token, goes from the scheduler to a detokenizer
(one TokenStep, its updates of new ids alone packed) and from there to its tokenizer (one
TextChunks); this runs those hops' own code on the same data, without sockets: the
scheduler building and serializing the step, the detokenizer parsing it, detokenizing
every update and serializing the replies, and the tokenizer parsing them and putting each
request's chunk in order for its reader, who takes what arrived every --read-every steps
(a busy front door's readers fall behind: what arrives meanwhile joins one chunk).
Printed per hop: microseconds of CPU per output token, and the bytes per token of the
message it sends on (the tokenizer's answer is HTTP, not counted).

The output streams are the default model's tokens of an assistant-style answer (the same
text as bench_detokenize.py), the requests' prompts 64 tokens, greedy, no stop strings
unless --stop.

Usage:
    python benchmarks/bench_hops.py                  # 256 requests x 64 steps, 5 runs
    python benchmarks/bench_hops.py --requests 32 --stop
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_detokenize import STOPS, streams

from radixmesh.core.detokenize import detok_context_size
from radixmesh.core.model_files import resolve_model_path
from radixmesh.core.request import GenerationRequest
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.request import Req
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.services.detokenizer.server import step_replies
from radixmesh.services.scheduler.mesh_io import StepMessage, UpdateBuilder
from radixmesh.services.tokenizer.assembler import ChunkAssembler, InFlight, deliver

PROMPT = 64
HOPS = ("scheduler", "detokenizer", "tokenizer")


def run_once(tok: Tokenizer, outputs: list[list[int]], stop: list[str], read_every: int,
             pieces: bool = True) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds and bytes of each hop over one batch decoded to its end (without `pieces`,
    the detokenizer decodes every update, as it does for tokenizers other than byte-level
    BPE)."""
    builder = UpdateBuilder("e0")
    reqs, flights = [], {}
    for i, out in enumerate(outputs):
        prompt = [(7 * i + k) % 1000 + 100 for k in range(PROMPT)]
        params = SamplingParams(max_new_tokens=len(out), stop=list(stop))
        req = Req(f"r{i}", prompt, params, seed=0)
        builder.register(req, mpb.EngineRequest(
            rid=req.rid, reply_to="rm.tokenizer.t0.out",
            detok=mpb.DetokSpec(stop=stop, skip_special_tokens=True, prompt_tail=prompt[-8:]),
            detok_context=detok_context_size(stop), stream=True,
        ))
        reqs.append(req)
        flights[req.rid] = InFlight("e0", ChunkAssembler(GenerationRequest(req.rid, prompt,
                                                                         params)))
    seconds = dict.fromkeys(HOPS, 0.0)
    nbytes = dict.fromkeys(HOPS[:2], 0)
    steps = len(outputs[0])
    for k in range(steps):
        for req, out in zip(reqs, outputs, strict=True):
            req.output_ids.append(out[k])
        began = time.perf_counter()
        step = StepMessage("e0")
        for req in reqs:
            builder.add(step, req)
        data = step.to_proto().SerializeToString()
        took = time.perf_counter()
        replies = step_replies(mpb.TokenStep.FromString(data), tok.decode,
                               tok.pieces if pieces else None)
        (chunks,) = replies.chunks.values()
        text = chunks.SerializeToString()
        detokenized = time.perf_counter()
        deliver(mpb.TextChunks.FromString(text), flights, detokenized)
        if (k + 1) % read_every == 0:
            for flight in flights.values():
                flight.pop()
        ended = time.perf_counter()
        seconds["scheduler"] += took - began
        seconds["detokenizer"] += detokenized - took
        seconds["tokenizer"] += ended - detokenized
        nbytes["scheduler"] += len(data)
        nbytes["detokenizer"] += len(text)
    return seconds, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stop", action="store_true", help=f"stop strings {STOPS!r}")
    parser.add_argument("--read-every", type=int, default=2,
                        help="steps between a request's reader's takes")
    args = parser.parse_args()

    tok = Tokenizer.from_path(str(resolve_model_path(None)))
    outputs = streams(tok, args.requests, args.tokens)
    stop = STOPS if args.stop else []
    tokens = args.requests * args.tokens
    run_once(tok, outputs, stop, args.read_every)
    runs, decoding = [], []
    for _ in range(args.runs):  # taking turns
        runs.append(run_once(tok, outputs, stop, args.read_every))
        decoding.append(run_once(tok, outputs, stop, args.read_every,
                                 pieces=False)[0]["detokenizer"])
    print(f"{args.requests} requests x {args.tokens} steps, one token each, stop={stop!r}, "
          f"readers take every {args.read_every} steps, median of {args.runs} runs")
    print(f"{'hop':<13}{'us/token':>10}{'bytes/token':>13}")
    for hop in HOPS:
        us = statistics.median(r[0][hop] for r in runs) / tokens * 1e6
        sent = f"{runs[0][1][hop] / tokens:.1f}" if hop in runs[0][1] else "-"
        print(f"{hop:<13}{us:>10.2f}{sent:>13}")
    us = statistics.median(decoding) / tokens * 1e6
    print(f"the detokenizer decoding every update (no token texts): {us:.2f} us/token, "
          f"{us / (statistics.median(r[0]['detokenizer'] for r in runs) / tokens * 1e6):.2f}x")


if __name__ == "__main__":
    main()
