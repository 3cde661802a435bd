"""Soak: many randomized requests through a mesh, a share of them abandoned by their client
part way, then checks that nothing leaked.

Usage:
    python benchmarks/soak.py                       # 10,000 requests, 20% aborted, own mesh
    python benchmarks/soak.py --requests 1000 --concurrency 16
    python benchmarks/soak.py --url http://127.0.0.1:30000 --api-key KEY   # a running mesh

Requests mix prompt lengths (2 to 400 words), output lengths (1 to 64 tokens), greedy and
sampled decoding, stop strings, streaming and not, and a regex constraint on one in ten;
--abort-fraction of them are dropped by the client after a random 0-1.5 s. Figures: how
the requests ended, throughput, and, for a mesh this script starts, each worker's resident
memory after the warm-up (a quarter of the requests, and the KV pool filled once: the OS
hands a pool its memory as it is first written, and the worker's heap keeps freed blocks
for reuse, so it grows to the largest batch seen) and at the end, with its course. The
script fails (exit 1) when a KV slot is still held, a request is still running once all are
done, or a worker grew more than 10% after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from radixmesh.launcher import Mesh, MeshArgs

WORDS = ["river", "stone", "lamp", "quiet", "orbit", "maple", "signal", "copper", "harbor",
         "velvet", "tunnel", "meadow", "lantern", "frost", "ember", "canyon"]


def random_request(rng: random.Random) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": rng.randint(1, 64)}
    if rng.random() < 0.5:
        params |= {"temperature": rng.choice([0.3, 0.8, 1.2]), "top_p": 0.9,
                   "seed": rng.randrange(1 << 30)}
    else:
        params["temperature"] = 0
    if rng.random() < 0.2:
        params["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.1:
        params["regex"] = r"[a-z]{3,12}( [a-z]{3,12}){0,4}"
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 400)))
    return {"text": text, "sampling_params": params, "stream": rng.random() < 0.5}


async def one(client: httpx.AsyncClient, body: dict[str, Any], abort_after: float | None
              ) -> str:
    async def call() -> str:
        if body["stream"]:
            async with client.stream("POST", "/generate", json=body) as reply:
                async for _ in reply.aiter_lines():
                    pass
                return str(reply.status_code)
        return str((await client.post("/generate", json=body)).status_code)

    task = asyncio.create_task(call())
    if abort_after is None:
        return await task
    done, _ = await asyncio.wait([task], timeout=abort_after)
    if done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return "aborted by the client"


async def pool_filled(client: httpx.AsyncClient) -> bool:
    """Whether every engine's KV pool has been written through once (under 10% free)."""
    states = (await client.get("/server_info")).json()["internal_states"]
    return all(s["free_slots"] < 0.1 * s["num_slots"] for s in states)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def soak(url: str, args: argparse.Namespace, worker_pids: list[int]) -> int:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    outcomes: Counter[str] = Counter()
    warm_rss: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    warm_up = max(1, args.requests // 4)
    done = 0
    started = time.perf_counter()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while not queue.empty():
            queue.get_nowait()
            body = random_request(rng)
            abort_after = rng.uniform(0, 1.5) if rng.random() < args.abort_fraction else None
            outcomes[await one(client, body, abort_after)] += 1
            done += 1
            if done >= warm_up and not warm_rss and await pool_filled(client):
                warm_rss.extend(rss_mb(pid) for pid in worker_pids)
            if done % max(1, args.requests // 20) == 0:
                rss = ", ".join(f"{rss_mb(pid):.0f}" for pid in worker_pids)
                print(f"  {done}/{args.requests} in {time.perf_counter() - started:.0f} s"
                      + (f", worker RSS {rss} MB" if rss else ""), flush=True)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        seconds = time.perf_counter() - started
        await asyncio.sleep(2)  # aborts reach the engines
        info = (await client.get("/server_info")).json()
    print(f"# {args.requests} requests, concurrency {args.concurrency}, "
          f"{args.abort_fraction:.0%} dropped by their client, in {seconds:.0f} s "
          f"({args.requests / seconds:.1f} requests/s)")
    for outcome, count in sorted(outcomes.items()):
        print(f"  {outcome:>22}: {count}")
    failed = False
    for state in info["internal_states"]:
        leaks = {k: state[k] for k in ("held_slots", "running", "waiting")}
        print(f"  engine {state['engine_id']}: {leaks}, free slots {state['free_slots']} "
              f"of {state['num_slots']}")
        failed |= any(leaks.values())
    if worker_pids and not warm_rss:
        print("  the KV pool never filled: run more requests to measure memory")
    for pid, warm in zip(worker_pids, warm_rss, strict=False):
        end = rss_mb(pid)
        print(f"  worker pid {pid}: RSS {warm:.0f} MB after warm-up, {end:.0f} MB at the "
              f"end ({end / warm:.3f}x)")
        failed |= end > 1.10 * warm
    if any(o.startswith("5") for o in outcomes):
        failed = True
    print("FAILED" if failed else "OK: nothing leaked")
    return 1 if failed else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running mesh; default: start one")
    p.add_argument("--api-key", default="")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--abort-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    args = p.parse_args()
    if args.url:
        sys.exit(asyncio.run(soak(args.url, args, [])))
    with tempfile.TemporaryDirectory() as logs, Mesh(MeshArgs(
        port=0, grpc_port=0, dtype=args.dtype, log_dir=logs, max_total_tokens=4096,
    )) as mesh:
        pids = [c.proc.pid for c in mesh.children if c.service == "worker"]
        code = asyncio.run(soak(mesh.url, args, pids))
    sys.exit(code)


if __name__ == "__main__":
    main()
