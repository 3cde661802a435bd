"""The sweep plot is a PNG with one line per target."""

from __future__ import annotations

import pytest

from radixmesh.bench.plot import plot_sweep


def test_plot_sweep_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [{"max_concurrency": c, "output_throughput": 10.0 * c, "ttft_ms": {"mean": 50.0 * c}}
            for c in (1, 2, 4)]
    path = tmp_path / "sweep.png"
    plot_sweep({"a": runs, "b": runs[:2]}, path, "random")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
