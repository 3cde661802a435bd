"""The native GEMMs beside another process on the same cores, as the mesh's worker runs
beside its services and clients.

One decode step's weight GEMMs of the bundled model's shape (32 rows; the fused MLP up and
gate, the attention output, the 49,152-word head; hidden 576) in bf16 and in Q8_0, timed
alone and then beside a process that works 1.5 ms and sleeps 1.5 ms over and over (a
service's bursts). With every thread of the GEMM needed, a thread the OS takes away for the
other process holds the whole GEMM up unless the others take over its share of the blocks:
the ratio of the two times shows how much of the competitor's time the GEMMs lose.

Usage:
    python benchmarks/bench_shared_cores.py
    python benchmarks/bench_shared_cores.py --runs 120
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from radixmesh.bench.report import cpu_name
from radixmesh.kernels import native, native_quant

ROWS, HIDDEN = 32, 576
FEATURES = (2 * 1536, 576, 49152)  # up and gate fused, attention output, the head
BURST_S = 0.0015


def burn() -> None:
    """The competitor: BURST_S of work, BURST_S of sleep, until killed."""
    while True:
        began = time.perf_counter()
        while time.perf_counter() - began < BURST_S:
            pass
        time.sleep(BURST_S)


def step_gemms(kind: str) -> Callable[[], None]:
    """One step's GEMMs, bf16 or q8_0, on random weights."""
    torch.manual_seed(0)
    weights = [torch.randn(n, HIDDEN, dtype=torch.bfloat16) / 20 for n in FEATURES]
    x = torch.randn(ROWS, HIDDEN, dtype=torch.bfloat16)
    packed = [(native.pack_gemm_weight(w), w.shape[0]) for w in weights]
    quantized = [native_quant.QuantizedWeight.quantize_q8_0(w.float()) for w in weights]

    def bf16() -> None:
        for weight, n in packed:
            native.gemm(x, weight, n, None)

    def q8_0() -> None:
        for weight in quantized:
            native_quant.linear(x, [weight])

    return bf16 if kind == "bf16" else q8_0


def times_ms(step: Callable[[], None], runs: int, per_run: int = 20) -> list[float]:
    """Milliseconds per step, each run the mean of `per_run` steps."""
    out = []
    for _ in range(runs):
        began = time.perf_counter()
        for _ in range(per_run):
            step()
        out.append((time.perf_counter() - began) / per_run * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=80)
    parser.add_argument("--burn", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.burn:
        burn()
        return
    if not native.gemm_supported(torch.zeros(32, HIDDEN, dtype=torch.bfloat16)):
        sys.exit("the native bf16 GEMM needs AVX512-BF16 on this CPU")
    print(f"a decode step's GEMMs ({ROWS} rows), {torch.get_num_threads()} threads, "
          f"{cpu_name()}; medians (p90) of {args.runs} runs")
    print(f"{'':<6}{'alone ms':>12}{'beside a bursty process ms':>30}{'ratio':>8}")
    for kind in ("bf16", "q8_0"):
        step = step_gemms(kind)
        times_ms(step, 5)
        alone = times_ms(step, args.runs // 2)
        competitor = subprocess.Popen([sys.executable, __file__, "--burn"])
        try:
            time.sleep(0.2)
            beside = times_ms(step, args.runs)
        finally:
            competitor.kill()
            competitor.wait()
        a, b = statistics.median(alone), statistics.median(beside)
        p90 = statistics.quantiles(beside, n=10)[8]
        print(f"{kind:<6}{a:>12.3f}{f'{b:.3f} ({p90:.3f})':>30}{b / a:>7.2f}x")


if __name__ == "__main__":
    main()
