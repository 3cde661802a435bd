"""What a step's call from the scheduler to a worker costs in gRPC itself, per step.

The scheduler runs each step as one unary `Worker.Forward` call (grpc.aio, on uvloop, as
the services run). This serves Forward from a worker that does nothing but answer, in a
process of its own, and times a step's round trip and both sides' CPU (every thread of the
process), against the same messages over one bidirectional stream per worker (a
`stream StepBatch -> stream StepResult` method registered beside it here), the other way
a step could travel.

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

STREAM = "/bench.Steps/Stream"


def _serve(port: mp.Queue) -> None:
    """A worker whose steps do nothing: Forward, and the same as a stream."""

    class Idle(wgrpc.WorkerServicer):
        async def Forward(self, request: wpb.StepBatch, context: Any) -> wpb.StepResult:
            return wpb.StepResult(step=request.step)

    async def steps(requests: AsyncIterator[wpb.StepBatch], context: Any
                    ) -> AsyncIterator[wpb.StepResult]:
        async for request in requests:
            yield wpb.StepResult(step=request.step)

    async def main() -> None:
        server = grpc.aio.server()
        wgrpc.add_WorkerServicer_to_server(Idle(), server)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Steps", {
            "Stream": grpc.stream_stream_rpc_method_handler(
                steps, request_deserializer=wpb.StepBatch.FromString,
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
    stub = wgrpc.WorkerStub(channel)
    stream = channel.stream_stream(STREAM, request_serializer=wpb.StepBatch.SerializeToString,
                                   response_deserializer=wpb.StepResult.FromString)()

    async def over_stream(msg: wpb.StepBatch) -> wpb.StepResult:
        await stream.write(msg)
        return await stream.read()

    figures: dict[str, list[tuple[float, float, float]]] = {"unary": [], "stream": []}
    for _ in range(rounds):  # taking turns
        figures["unary"].append(await _timed(stub.Forward, steps, server))
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
    for way, label in (("unary", "unary Forward (today)"), ("stream", "one bidirectional stream")):
        wall, mine, theirs = (statistics.median(f[k] for f in figures[way]) for k in range(3))
        print(f"{label:<28}{wall:>12.0f}{mine:>15.0f}{theirs:>12.0f}")


if __name__ == "__main__":
    main()
