"""A PNG of output throughput and mean TTFT against concurrency (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_sweep(series: dict[str, list[dict[str, Any]]], path: str | Path, title: str = "") -> None:
    """Two panels, one line per label; each run needs max_concurrency and its summary."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels: set[int] = set()
    for label, runs in series.items():
        points = sorted((r["max_concurrency"], r) for r in runs if r["max_concurrency"])
        xs = [c for c, _ in points]
        levels.update(xs)
        tput.plot(xs, [r["output_throughput"] for _, r in points], marker="o", label=label)
        ttft.plot(xs, [(r["ttft_ms"] or {}).get("mean", float("nan")) for _, r in points],
                  marker="o", label=label)
    for ax, ylabel in ((tput, "output tokens / s"), (ttft, "mean TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels), [str(c) for c in sorted(levels)])
        ax.minorticks_off()
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ttft.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
