"""Radix cache eviction policies under hot shared prefixes and one-off scans: the real
RadixCache and KV allocator driven as the scheduler drives them, no model, a few seconds.

Usage:
    python benchmarks/bench_eviction.py                                # 4 pools, 4 policies
    python benchmarks/bench_eviction.py --pools 8192 --policies lru,slru --requests 2000
    python benchmarks/bench_eviction.py --hot-share 0.3 --protected-ratio 0.5

The workload (fixed seed, the same requests for every policy): --hot-prefixes system prompts
of --hot-lens tokens, each request either one of them (chosen at random) followed by a fresh
--suffix-len-token question, with probability --hot-share, or else a one-off scan: a fresh
prompt of --scan-min..--scan-max tokens that nobody sends again. With --phases N the run falls
in N equal parts, each with system prompts of its own (a hot set that moves on, which
frequency counts from earlier parts mislead). Every request also decodes
--output-len fresh tokens. Each request is served as the scheduler serves it: match_prefix
(an admission: a hit), lock, allocate the uncached rest of its prompt and its output (evicting
when the pool is short), and when it finishes, insert prompt and output, free the slots the
tree already had, unlock. --concurrency requests are in flight at once; when the pool cannot
hold the next one, the oldest finishes first.

Per pool size and policy: hit rate = cached prompt tokens / prompt tokens, hot-prefix hit
rate = cached tokens of the system prompts / their tokens (hot requests only), each with its
ratio to lru in the same run, and the CPU time a request costs the cache (us, the mean over
the run). The first --warmup requests fill the cache and are not counted.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass

from radixmesh.bench.report import cpu_name
from radixmesh.engine.eviction import POLICIES
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.tree_node import TreeNode

VOCAB = 32000


@dataclass(frozen=True)
class Request:
    """A prompt, the tokens its answer will add, and how much of the prompt is a hot prefix."""

    prompt: list[int]
    output: list[int]
    hot_len: int  # 0: a one-off scan


@dataclass
class Figures:
    """What one policy cached over one run (after the warm-up)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    hot_tokens: int = 0
    hot_cached: int = 0
    seconds: float = 0.0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def hot_hit_rate(self) -> float:
        return self.hot_cached / self.hot_tokens

    @property
    def us_per_request(self) -> float:
        return self.seconds / self.requests * 1e6


def workload(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    lens = [args.hot_lens[i % len(args.hot_lens)] for i in range(args.hot_prefixes)]
    hot_sets = [[fresh(n) for n in lens] for _ in range(args.phases)]
    requests = []
    for i in range(args.requests):
        output = fresh(args.output_len)
        if rng.random() < args.hot_share:
            prefix = rng.choice(hot_sets[i * args.phases // args.requests])
            requests.append(Request(prefix + fresh(args.suffix_len), output, len(prefix)))
        else:
            requests.append(Request(fresh(rng.randint(args.scan_min, args.scan_max)), output, 0))
    return requests


class Server:
    """Serves requests against one cache the way the scheduler does, without a model."""

    def __init__(self, policy: str, pool: int, protected_ratio: float) -> None:
        self.allocator = KVAllocator(pool)
        ticks = itertools.count()
        # A counter, not the wall clock: lru's order must not depend on the machine's speed.
        self.cache = RadixCache(
            self.allocator, 1, policy, lambda: float(next(ticks)), protected_ratio
        )
        self.in_flight: deque[tuple[Request, int, list[int], TreeNode]] = deque()

    def admit(self, req: Request) -> int:
        """Starts req; returns its prompt tokens found cached."""
        match = self.cache.match_prefix(req.prompt)
        self.cache.lock(match.node)
        need = len(req.prompt) + len(req.output) - len(match.slots)
        fresh = self._alloc(need)
        while fresh is None and self.in_flight:
            self.finish()
            fresh = self._alloc(need)
        if fresh is None:
            raise SystemExit(f"a request of {need} tokens does not fit the pool")
        self.in_flight.append((req, len(match.slots), match.slots + fresh, match.node))
        return len(match.slots)

    def finish(self) -> None:
        """The oldest request in flight ends: its prompt and answer go into the tree."""
        req, cached_before, slots, node = self.in_flight.popleft()
        cached = self.cache.insert(req.prompt + req.output, slots)
        self.allocator.free(slots[cached_before:cached])
        self.cache.unlock(node)

    def _alloc(self, num_slots: int) -> list[int] | None:
        fresh = self.allocator.alloc(num_slots)
        if fresh is None:
            self.cache.evict(num_slots - self.allocator.available())
            fresh = self.allocator.alloc(num_slots)
        return fresh


def run(policy: str, pool: int, requests: list[Request], args: argparse.Namespace) -> Figures:
    server = Server(policy, pool, args.protected_ratio)
    figures = Figures()
    for i, req in enumerate(requests):
        began = time.perf_counter()
        cached = server.admit(req)
        if len(server.in_flight) > args.concurrency:
            server.finish()
        spent = time.perf_counter() - began
        if i < args.warmup:
            continue
        figures.requests += 1
        figures.seconds += spent
        figures.prompt_tokens += len(req.prompt)
        figures.cached_tokens += cached
        if req.hot_len:
            figures.hot_tokens += req.hot_len
            figures.hot_cached += min(cached, req.hot_len)
    return figures


def ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pools", default="6144,8192,12288,16384", help="KV pool sizes in tokens")
    p.add_argument("--policies", default="lru,slru,lfu,fifo", help="lru is the baseline")
    p.add_argument("--hot-prefixes", type=int, default=4)
    p.add_argument("--hot-lens", default="256,512,768,1024", help="system prompt lengths")
    p.add_argument("--suffix-len", type=int, default=64, help="fresh question after a prefix")
    p.add_argument("--hot-share", type=float, default=0.5, help="of requests that are hot")
    p.add_argument("--phases", type=int, default=1, help="parts with a hot set each")
    p.add_argument("--scan-min", type=int, default=512)
    p.add_argument("--scan-max", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--protected-ratio", type=float, default=0.8, help="slru's protected cap")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    args.hot_lens = [int(n) for n in args.hot_lens.split(",")]
    pools = [int(n) for n in args.pools.split(",")]
    policies = args.policies.split(",")
    unknown = set(policies) - set(POLICIES)
    if unknown or "lru" not in policies:
        p.error(f"--policies must include lru and name only {', '.join(POLICIES)}")
    if args.requests <= args.warmup:
        p.error("--requests must exceed --warmup")

    requests = workload(args)
    hot_total = sum(args.hot_lens[i % len(args.hot_lens)] for i in range(args.hot_prefixes))
    print(f"{args.requests} requests ({args.warmup} warm-up), {args.hot_share:.0%} hot: "
          f"{args.hot_prefixes} system prompts ({hot_total} tokens in all) + "
          f"{args.suffix_len}-token question; the rest one-off scans of {args.scan_min}.."
          f"{args.scan_max} tokens; {args.output_len} output tokens each, concurrency "
          f"{args.concurrency}, {args.phases} phase(s), slru protected ratio "
          f"{args.protected_ratio}; {cpu_name()}")
    for pool in pools:
        results = {policy: run(policy, pool, requests, args) for policy in policies}
        lru = results["lru"]
        print(f"\npool {pool} tokens")
        print(f"{'policy':<8} {'hit rate':>9} {'vs lru':>7} {'hot-prefix hit':>15} "
              f"{'vs lru':>7} {'us/request':>11}")
        for policy, fig in results.items():
            print(f"{policy:<8} {fig.hit_rate:>9.1%} {ratio(fig.hit_rate, lru.hit_rate):>7} "
                  f"{fig.hot_hit_rate:>15.1%} {ratio(fig.hot_hit_rate, lru.hot_hit_rate):>7} "
                  f"{fig.us_per_request:>11.0f}")


if __name__ == "__main__":
    main()
