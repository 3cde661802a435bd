"""Host (L2) KV tier copy bandwidth: backups (device -> host pool) and loads (host pool ->
device) of N tokens through the worker's copy code (radixmesh/engine/model/host_copies.py), beside a
plain copy of the same bytes as one contiguous tensor on the same machine.

Usage:
    python benchmarks/bench_host_copies.py                  # 4096 tokens, SmolLM2's geometry
    python benchmarks/bench_host_copies.py --tokens 1024 --device cuda

The geometry defaults to SmolLM2-135M's KV (30 layers, 3 KV heads, head_dim 64, bf16:
22.5 KiB a token). The host pool is a file in /dev/shm as cachectl makes one; both pools
hold twice N tokens and each copy moves N of them: scattered (random slots, page size 1) or
in whole 16-token pages at random page positions. A backup is timed until its copy thread
has written the host pool; a load until its device writes are done. Figures are bytes moved
per second (each byte counted once), medians of --runs runs after a warm-up run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from radixmesh.core.hicache import DTYPE_BYTES, HostPoolSpec, KVGeometry
from radixmesh.core.step import KVCopy
from radixmesh.engine.model.host_copies import HostCopier
from radixmesh.engine.model.kv_pool import KVPool

PAGE = 16  # tokens per page in the "pages" runs


def median_seconds(fn: Callable[[], None], runs: int, device: torch.device) -> float:
    fn()  # warm-up: first touch of the host pool's pages, allocator caches
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def random_slots(tokens: int, capacity: int, page: int, gen: torch.Generator) -> list[int]:
    """`tokens` distinct slots of `capacity`, in whole pages of `page` at random positions."""
    pages = torch.randperm(capacity // page, generator=gen)[: tokens // page]
    return (pages.unsqueeze(1) * page + torch.arange(page)).flatten().tolist()


def bench_copies(
    args: argparse.Namespace, device: torch.device, layout: str, page: int, shm: Path
) -> tuple[float, float]:
    """(backup, load) GB/s of N tokens with the host pool in `layout`."""
    geometry = KVGeometry(args.layers, args.kv_heads, args.head_dim, args.dtype, page)
    capacity = 2 * args.tokens
    name = f"bench-host-copies-{os.getpid()}"
    spec = HostPoolSpec(name, str(shm / name), capacity, layout, geometry)
    with open(spec.path, "wb") as f:
        f.truncate(spec.nbytes)
    try:
        dtype = getattr(torch, args.dtype)
        pool = KVPool(args.layers, capacity, args.kv_heads, args.head_dim, dtype, device)
        for t in (*pool.k, *pool.v):
            t.normal_()
        copier = HostCopier(pool, args.kv_heads)
        copier.map(spec)
        gen = torch.Generator().manual_seed(0)
        device_slots = random_slots(args.tokens, capacity, page, gen)
        host_slots = random_slots(args.tokens, capacity, page, gen)
        backup = KVCopy(1, True, device_slots, host_slots)
        load = KVCopy(2, False, device_slots, host_slots)

        def back_up() -> None:
            copier.start_backups([backup])
            copier.wait()
            copier.finished()

        nbytes = args.tokens * geometry.token_bytes
        with torch.inference_mode():
            backup_s = median_seconds(back_up, args.runs, device)
            load_s = median_seconds(lambda: copier.load([load]), args.runs, device)
        return nbytes / backup_s / 1e9, nbytes / load_s / 1e9
    finally:
        os.unlink(spec.path)


def bench_memcpy(args: argparse.Namespace, device: torch.device) -> list[tuple[str, float]]:
    """GB/s of one contiguous copy of N tokens' bytes: host to host on the CPU; device to
    pinned host and back on CUDA."""
    geometry = KVGeometry(args.layers, args.kv_heads, args.head_dim, args.dtype)
    nbytes = args.tokens * geometry.token_bytes
    numel = nbytes // DTYPE_BYTES[args.dtype]
    dtype = getattr(torch, args.dtype)
    src = torch.randn(numel, device=device).to(dtype)
    if device.type == "cpu":
        dst = torch.empty_like(src)
        return [("host -> host", nbytes / median_seconds(lambda: dst.copy_(src), args.runs,
                                                          device) / 1e9)]
    host = torch.empty(numel, dtype=dtype, pin_memory=True)
    to_host = median_seconds(lambda: host.copy_(src, non_blocking=True), args.runs, device)
    to_device = median_seconds(lambda: src.copy_(host, non_blocking=True), args.runs, device)
    return [("device -> pinned host", nbytes / to_host / 1e9),
            ("pinned host -> device", nbytes / to_device / 1e9)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (of `argv`, else the command line); every one has a default."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads of the loads (0: torch's default)"
    )
    return parser.parse_args(argv)


def measure(
    args: argparse.Namespace,
) -> tuple[list[tuple[str, str, float, float]], list[tuple[str, float]]]:
    """(host layout, slots, backup GB/s, load GB/s) of every layout and slot pattern, and
    (what, GB/s) of the plain copies beside them."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    copies = []
    for layout in ("layer_first", "page_first"):
        for page, slots in ((1, "scattered"), (PAGE, f"{PAGE}-pages")):
            copies.append((layout, slots, *bench_copies(args, device, layout, page, shm)))
    return copies, bench_memcpy(args, device)


def main() -> None:
    args = parse_args()
    copies, memcpy = measure(args)
    token_bytes = KVGeometry(args.layers, args.kv_heads, args.head_dim, args.dtype).token_bytes
    print(
        f"{args.tokens} tokens x {token_bytes} B = {args.tokens * token_bytes / 2**20:.1f} MiB "
        f"per copy; {args.layers} layers, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
        f"{args.dtype}; device {args.device}, {torch.get_num_threads()} torch threads "
        f"(backups: 1 copy thread); median of {args.runs}"
    )
    print(f"{'host layout':<12} {'slots':<10} {'backup GB/s':>12} {'load GB/s':>10}")
    for layout, slots, backup, load in copies:
        print(f"{layout:<12} {slots:<10} {backup:>12.2f} {load:>10.2f}")
    for what, rate in memcpy:
        print(f"plain .copy_ of one contiguous tensor, {what}: {rate:.2f} GB/s")


if __name__ == "__main__":
    main()
