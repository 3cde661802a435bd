"""The KV pool's size: the automatic rule on made-up memory and model shapes, an explicit
max_total_tokens, the line the runner logs, the host's memory as the rule reads it; and the
pool's memory on the CPU, committed only where tokens are written."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixmesh.core.settings import EngineArgs
from radixmesh.engine.model import pool_size
from radixmesh.engine.model.memory import Memory, host_memory
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.pool_size import PoolSize, auto_pool_size, size_pool
from radixmesh.mesh.nats_server import free_port

GIB = 2**30
SMOLLM2_TOKEN = 2 * 30 * 3 * 64 * 2  # K and V of 30 layers, 3 KV heads of 64, bfloat16


def test_on_the_cpu_the_pool_holds_the_running_requests() -> None:
    size = auto_pool_size(EngineArgs(), 8192, SMOLLM2_TOKEN, Memory(24 * GIB, 20 * GIB), True)
    by_memory = (20 * GIB - int((1 - 0.85) * 24 * GIB)) // SMOLLM2_TOKEN
    assert size == PoolSize(64 * 1024, SMOLLM2_TOKEN, (
        f"bound by the requests (64 max_running_requests x 1,024 tokens; memory allows "
        f"{by_memory:,}: mem_fraction_static 0.85 leaves 16.4 GiB of the 20.0 GiB free of "
        "24.0 GiB)"))
    assert str(size) == f"KV pool: 65,536 tokens x 23,040 bytes = 1.41 GiB, {size.reason}"


def test_a_context_shorter_than_a_typical_request_sizes_each_request() -> None:
    args = EngineArgs(max_running_requests=4, context_length=310, page_size=16)
    size = auto_pool_size(args, 8192, 1000, Memory(24 * GIB, 20 * GIB), True)
    assert size.tokens == 1248  # 4 x 310, up to whole pages


def test_on_the_cpu_memory_bounds_the_pool() -> None:
    """mem_fraction_static 0.75 of 10 MB leaves 4 - 2.5 MB for 1,000-byte tokens."""
    args = EngineArgs(mem_fraction_static=0.75, page_size=16)
    size = auto_pool_size(args, 1024, 1000, Memory(10_000_000, 4_000_000), True)
    assert size.tokens == 1488  # 1,500 tokens, down to whole pages
    assert size.reason.startswith("bound by memory (mem_fraction_static 0.75 leaves")


def test_ranks_of_a_group_share_the_hosts_memory() -> None:
    args = EngineArgs(mem_fraction_static=0.75)
    size = auto_pool_size(args, 512, 1000, Memory(10_000_000, 4_000_000), True, ranks=2)
    assert size.tokens == 750


def test_on_a_gpu_the_pool_takes_all_the_memory_left_to_it() -> None:
    args = EngineArgs(mem_fraction_static=0.75)
    size = auto_pool_size(args, 8192, SMOLLM2_TOKEN, Memory(80 * GIB, 70 * GIB), False)
    assert size.tokens == 50 * GIB // SMOLLM2_TOKEN
    assert size.reason == ("bound by memory (mem_fraction_static 0.75 leaves 50.0 GiB of the "
                           "70.0 GiB free of 80.0 GiB)")


@pytest.mark.parametrize("on_cpu", [True, False])
def test_never_less_than_one_request_of_the_whole_context(on_cpu) -> None:
    args = EngineArgs(page_size=16)
    size = auto_pool_size(args, 8192, SMOLLM2_TOKEN, Memory(10 * GIB, GIB), on_cpu)
    assert size.tokens == 8192 + 16
    assert size.reason.startswith(
        "raised to one request of the whole context (8,192 tokens) from 0, bound by memory")
    few = EngineArgs(max_running_requests=2, context_length=4000)
    assert auto_pool_size(few, 8192, 100, Memory(10 * GIB, 9 * GIB), True).tokens == 4001


def _config(**shape: int) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_heads=4, **shape)


# 1,024 bytes a token in float32
SHARD = _config(num_layers=2, num_kv_heads=2, head_dim=32, max_position_embeddings=512)


def test_an_explicit_max_total_tokens_wins(monkeypatch, caplog) -> None:
    monkeypatch.setattr(pool_size, "device_memory", lambda device: pytest.fail("measured"))
    args = EngineArgs(max_total_tokens=100, page_size=16, max_running_requests=256)
    with caplog.at_level(logging.INFO, "radixmesh.worker"):
        size = size_pool(args, SHARD, torch.float32, torch.device("cpu"))
    assert size == PoolSize(96, 1024, "set by max_total_tokens")
    assert caplog.messages == [
        "KV pool: 96 tokens x 1,024 bytes = 0.00 GiB, set by max_total_tokens"]


def test_the_automatic_size_reads_the_devices_memory(monkeypatch, caplog) -> None:
    memory = Memory(10_000_000, 4_000_000)
    monkeypatch.setattr(pool_size, "device_memory", lambda device: memory)
    args = EngineArgs(mem_fraction_static=0.75)
    with caplog.at_level(logging.INFO, "radixmesh.worker"):
        size = size_pool(args, SHARD, torch.float32, torch.device("cpu"))
    assert size == auto_pool_size(args, 512, 1024, memory, True)
    assert size.tokens == 1_500_000 // 1024
    assert caplog.messages == [str(size)]


_RANK = """
import json, sys, torch
from radixmesh.core.settings import EngineArgs
from radixmesh.engine.model import pool_size
from radixmesh.engine.model.memory import Memory
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.parallel import destroy_tensor_parallel, init_tensor_parallel
rank = int(sys.argv[1])
pool_size.device_memory = lambda device: Memory(10_000_000, (4_000_000, 3_000_000)[rank])
tp = init_tensor_parallel(sys.argv[2], rank, 2)
shard = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_heads=4, num_layers=2, num_kv_heads=2, head_dim=32,
                    max_position_embeddings=512)
args = EngineArgs(mem_fraction_static=0.75)
size = pool_size.size_pool(args, shard, torch.float32, torch.device("cpu"), tp)
destroy_tensor_parallel()
print(json.dumps([size.tokens, size.reason]))
"""


def test_the_ranks_of_a_group_agree_on_the_smallest_size() -> None:
    """On the CPU two ranks share the host's memory (each counts it for both); the rank that
    sees less memory sizes the pool of both."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), addr],
                              stdout=subprocess.PIPE, text=True) for rank in range(2)]
    got = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    assert [tokens for tokens, _ in got] == [513, 513]  # 500,000 // 2,048 raised to 512 + 1
    assert got[0][1].startswith("the smallest rank's size (this rank's would be 732, bound by "
                                "memory (mem_fraction_static 0.75")
    assert got[1][1].startswith("raised to one request of the whole context (512 tokens) "
                                "from 244, bound by memory")


def test_host_memory_within_a_cgroups_limit(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        1000 kB\nMemFree:  300 kB\nMemAvailable:     800 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_memory(meminfo, cgroup) == Memory(1_024_000, 819_200)
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("100000\n")
    assert host_memory(meminfo, cgroup) == Memory(1_024_000, 819_200)
    (cgroup / "memory.max").write_text("512000\n")
    assert host_memory(meminfo, cgroup) == Memory(512_000, 412_000)


def test_a_bad_memory_fraction_is_refused_by_name() -> None:
    for bad in (0, 1.2, -0.5):
        with pytest.raises(ValueError, match="mem_fraction_static must be in"):
            EngineArgs(mem_fraction_static=bad)


# ---- the pool's memory on the CPU ---------------------------------------------------------

_RSS = """
import json, re, sys, torch
def rss():
    status = open("/proc/self/status").read()
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", status)[1]) * 1024
"""


def _granule() -> int:
    """The memory the kernel commits at a first write: a huge page where THP is always on."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return 2 << 20 if thp.exists() and "[always]" in thp.read_text() else 4096


def _run(script: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _RSS + script], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS")
def test_the_pools_memory_is_committed_only_where_written() -> None:
    """SmolLM2's shape, 65,536 slots (1.41 GiB): creating it commits nothing; writing 500
    slots in every layer commits about those slots' K and V."""
    got = _run("""
from radixmesh.engine.model.kv_pool import KVPool
k = torch.full((500, 3, 64), 0.5, dtype=torch.bfloat16)
KVPool(1, 500, 3, 64, torch.bfloat16).store(0, torch.arange(500), k, -k)  # torch's own warm-up
before = rss()
pool = KVPool(30, 65536, 3, 64, torch.bfloat16)
created = rss() - before
for layer in range(30):
    pool.store(layer, torch.arange(500), k, -k)
print(json.dumps({"created": created, "written": rss() - before - created,
                  "values": [pool.k[7][499, 2, 63].item(), pool.v[29][0, 0, 0].item(),
                             pool.k[7][500:].abs().sum().item(), pool.v[0][-1].sum().item()]}))
""")
    pool_bytes, used = 65536 * SMOLLM2_TOKEN, 500 * SMOLLM2_TOKEN
    assert got["created"] < 0.1 * pool_bytes
    assert 0.9 * used < got["written"] < 1.2 * used + 60 * _granule()
    assert got["values"] == [0.5, -0.5, 0.0, 0.0]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS")
def test_an_engine_on_the_bundled_model_commits_its_pool_as_it_fills() -> None:
    """The Engine's automatic pool: created at a sliver of its size, and a short generation
    takes memory for its tokens, not for the pool; the scheduler has the runner's size."""
    got = _run("""
from radixmesh.api import Engine
from radixmesh.engine.model import runner
from radixmesh.engine.model.kv_pool import KVPool
created = {}
class Measured(KVPool):
    def __init__(self, *args, **kwargs):
        before = rss()
        super().__init__(*args, **kwargs)
        created["bytes"] = rss() - before
runner.KVPool = Measured
with Engine(show_progress=False) as engine:
    pool = engine.runner.pool
    token_bytes = 2 * len(pool.k) * pool.k[0][0].numel() * pool.k[0].element_size()
    pool_bytes = pool.num_slots * token_bytes
    before = rss()
    out = engine.generate("Tell me a story.", {"max_new_tokens": 32, "ignore_eos": True})
    print(json.dumps({"pool_bytes": pool_bytes, "created": created["bytes"],
                      "grown": rss() - before, "tokens": out["meta_info"]["completion_tokens"],
                      "slots": [pool.num_slots, engine.scheduler.config.num_slots]}))
""")
    assert got["tokens"] == 32 and got["slots"][0] == got["slots"][1] >= 8193
    assert got["created"] < 0.1 * got["pool_bytes"]
    assert got["grown"] < 0.1 * got["pool_bytes"]
