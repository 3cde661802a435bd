"""What a step's call from the scheduler to a worker costs in gRPC itself, per step.

The scheduler sends its steps over one bidirectional stream per worker rank
(`Worker.Steps`, grpc.aio on uvloop, as the services run). This serves Steps from a worker
that does nothing but answer, in a process of its own, and times a step's round trip and
both sides' CPU (every thread of the process), against the same messages as one unary call a
step (a method registered beside it here: how steps travelled before the stream).

Usage:
    python benchmarks/bench_step_rpc.py              # 4,000 steps each way, 3 rounds
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import uvloop
from peer_server import proc_stat

from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto import worker_pb2_grpc as wgrpc

UNARY = "/bench.Steps/Unary"


def _serve(port: mp.Queue) -> None:
    """A worker whose steps do nothing: Steps, and the same as one unary call a step."""

    class Idle(wgrpc.WorkerServicer):
        async def Steps(self, requests: AsyncIterator[wpb.StepBatch], context: Any
                        ) -> AsyncIterator[wpb.StepResult]:
            async for request in requests:
                yield wpb.StepResult(step=request.step)

    async def unary(request: wpb.StepBatch, context: Any) -> wpb.StepResult:
        return wpb.StepResult(step=request.step)

    async def main() -> None:
        server = grpc.aio.server()
        wgrpc.add_WorkerServicer_to_server(Idle(), server)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Steps", {
            "Unary": grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=wpb.StepBatch.FromString,
                response_serializer=wpb.StepResult.SerializeToString),
        }),))
        port.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


async def _timed(step: Callable[[wpb.StepBatch], Awaitable[Any]], steps: int, server: int
                 ) -> tuple[float, float, float]:
    """Microseconds per step: wall, this process's CPU, the server's CPU."""
    msg = wpb.StepBatch(step=1)
    for _ in range(100):
        await step(msg)
    cpu, server_cpu, began = time.process_time(), proc_stat(server)[0], time.perf_counter()
    for _ in range(steps):
        await step(msg)
    wall = time.perf_counter() - began
    used, server_used = time.process_time() - cpu, proc_stat(server)[0] - server_cpu
    return wall / steps * 1e6, used / steps * 1e6, server_used / steps * 1e6


async def _client(port: int, server: int, steps: int, rounds: int
                  ) -> dict[str, list[tuple[float, float, float]]]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = wgrpc.WorkerStub(channel).Steps()
    per_call = channel.unary_unary(UNARY, request_serializer=wpb.StepBatch.SerializeToString,
                                   response_deserializer=wpb.StepResult.FromString)

    async def over_stream(msg: wpb.StepBatch) -> wpb.StepResult:
        await stream.write(msg)
        return await stream.read()

    figures: dict[str, list[tuple[float, float, float]]] = {"unary": [], "stream": []}
    for _ in range(rounds):  # taking turns
        figures["unary"].append(await _timed(per_call, steps, server))
        figures["stream"].append(await _timed(over_stream, steps, server))
    await stream.done_writing()
    await channel.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spawn = mp.get_context("spawn")  # grpc's threads do not survive a fork
    port: mp.Queue = spawn.Queue()
    server = spawn.Process(target=_serve, args=(port,), daemon=True)
    server.start()
    try:
        assert server.pid is not None
        figures = uvloop.run(_client(port.get(timeout=30), server.pid, args.steps, args.rounds))
    finally:
        server.kill()
    print(f"{args.steps} steps a round, {args.rounds} rounds taking turns; medians, "
          "microseconds per step")
    print(f"{'':<28}{'round trip':>12}{'scheduler CPU':>15}{'worker CPU':>12}")
    for way, label in (("unary", "a unary call a step"), ("stream", "Worker.Steps (today)")):
        wall, mine, theirs = (statistics.median(f[k] for f in figures[way]) for k in range(3))
        print(f"{label:<28}{wall:>12.0f}{mine:>15.0f}{theirs:>12.0f}")


if __name__ == "__main__":
    main()
