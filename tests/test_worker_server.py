"""The worker service as a process: GetInfo, gRPC health, Forward against an in-process
ModelRunner, /metrics, SIGTERM; and two tensor-parallel ranks behind gRPC. And GetInfo's
answer for a mixture-of-experts model, without one."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny_model import (
    EOS,
    HEAD_DIM,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    forward_script,
    save_tiny_model,
    tokens,
)

from radixmesh.core.model_files import mlp_work, resolve_model_path
from radixmesh.core.service_settings import WorkerConfig
from radixmesh.core.step import StepResult
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.mesh.nats_server import free_port
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto import worker_pb2_grpc as wgrpc
from radixmesh.proto.convert import batch_to_proto, result_from_proto
from radixmesh.services.worker.kv_stream import host_id
from radixmesh.services.worker.server import SERVICE_NAME, worker_info

_LISTENING = re.compile(r"gRPC on (\S+):(\d+), /metrics on (\S+):(\d+)")
START_TIMEOUT = 120.0


class WorkerProcess:
    """`python -m radixmesh.services.worker` with its log read on a thread."""

    def __init__(self, *flags: str) -> None:
        args = [sys.executable, "-m", "radixmesh.services.worker", "--num-threads=1", *flags]
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        match = None
        while match is None:
            line = self.lines.get(timeout=START_TIMEOUT)
            assert line is not None, "the worker exited at start:\n" + "".join(self.log)
            match = _LISTENING.search(line)
        self.addr = f"{match[1]}:{match[2]}"
        self.metrics_url = f"http://{match[3]}:{match[4]}/metrics"
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = wgrpc.WorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_serving(self) -> None:
        """Block on the health Watch stream until the model is loaded."""
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        watch = self.health.Watch(request, timeout=START_TIMEOUT)
        for reply in watch:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return

    def terminate(self) -> int:
        """SIGTERM; the exit code."""
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> list[StepResult]:
    loaded = load_model(str(model_dir), progress=False)
    runner = ModelRunner(loaded.config, loaded.weights, torch.float32, num_slots=496)
    return [runner.forward(b) for b in forward_script()]


def assert_same_results(got: list[StepResult], ref: list[StepResult]) -> None:
    assert tokens(got) == tokens(ref)
    for ours, theirs in zip(got, ref, strict=True):
        assert ours.step == theirs.step
        for a, b in zip(ours.results, theirs.results, strict=True):
            assert a.rid == b.rid
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_worker_serves_forward(model_dir, reference) -> None:
    worker = WorkerProcess(
        f"--model-path={model_dir}", "--dtype=float32", "--max-total-tokens=500", "--page-size=16"
    )
    try:
        worker.wait_serving()
        check = worker.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        info = worker.stub.GetInfo(wpb.WorkerInfoRequest())
        assert info == wpb.WorkerInfo(
            num_slots=496,
            vocab_size=256,
            max_position_embeddings=256,
            eos_token_ids=[EOS],
            model_path=str(model_dir),
            dtype="float32",
            tp_rank=0,
            tp_size=1,
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            quantization="bf16",  # a safetensors model, not asked to quantize
            architecture="llama",  # dense: no experts
            host_id=host_id(),
            hidden_size=HIDDEN,
        )
        steps = worker.stub.Steps(iter([batch_to_proto(b) for b in forward_script()]))
        got = [result_from_proto(r) for r in steps]
        assert_same_results(got, reference)
        assert all(r.forward_ms > 0 for r in got)
        unknown = wpb.StepBatch(step=len(got) + 1)
        unknown.entries.add(rid="nobody", slots=[0], sample=True)
        with pytest.raises(grpc.RpcError) as err:
            list(worker.stub.Steps(iter([unknown])))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        metrics = urllib.request.urlopen(worker.metrics_url, timeout=10).read().decode()
        labels = f'{{model_name="{model_dir.name}",tp_rank="0"}}'
        assert f"radixmesh:worker_forward_seconds_count{labels} {float(len(got))}" in metrics
        assert f"radixmesh:worker_kv_pool_tokens{labels} 496.0" in metrics
        # 12+4, 1+5, then 6 x 2
        assert f"radixmesh:worker_batch_tokens_sum{labels} 34.0" in metrics
        assert worker.terminate() == 0
    finally:
        worker.kill()


def test_worker_sizes_its_pool_by_the_engines_limits_and_reports_it(model_dir) -> None:
    """No max_total_tokens: the worker sizes the pool for max_running_requests requests of
    the tiny model's whole context (256, shorter than a typical request) and tells the
    scheduler that size."""
    worker = WorkerProcess(f"--model-path={model_dir}", "--dtype=float32", "--page-size=16",
                           "--max-running-requests=3")
    try:
        worker.wait_serving()
        assert worker.stub.GetInfo(wpb.WorkerInfoRequest()).num_slots == 3 * 256
        token_bytes = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
        assert any(f"KV pool: 768 tokens x {token_bytes:,} bytes = 0.00 GiB, bound by the "
                   "requests (3 max_running_requests x 256 tokens; memory allows" in line
                   for line in worker.log)
        assert worker.terminate() == 0
    finally:
        worker.kill()


def test_worker_info_carries_the_experts_of_a_mixture_of_experts() -> None:
    moe = ModelConfig(
        architecture="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(EOS,),
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, sparse_layers=(0, 1),
    )
    runner = SimpleNamespace(config=moe, pool=SimpleNamespace(num_slots=96), quantization="bf16",
                             model_path=Path("/models/moe"), lora=None,
                             states=SimpleNamespace(num_snapshots=0))
    info = worker_info(runner, WorkerConfig(dtype="float32"))
    assert (info.architecture, info.num_experts, info.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert info.model_path == "/models/moe" and info.num_slots == 96 and info.num_layers == 2


def test_two_ranks_behind_grpc(model_dir, reference) -> None:
    addr = f"tcp://127.0.0.1:{free_port()}"
    flags = [f"--model-path={model_dir}", "--dtype=float32", "--max-total-tokens=496"]
    ranks: list[WorkerProcess] = []
    try:
        for rank in range(2):
            ranks.append(
                WorkerProcess(
                    *flags, "--tp-size=2", f"--tp-rank={rank}", f"--dist-init-addr={addr}"
                )
            )
        for worker in ranks:
            worker.wait_serving()
        infos = [w.stub.GetInfo(wpb.WorkerInfoRequest()) for w in ranks]
        assert [(i.tp_rank, i.tp_size, i.num_slots) for i in infos] == [(0, 2, 496), (1, 2, 496)]
        # The model's geometry on every rank, not the rank's share of the KV heads.
        assert {(i.num_layers, i.num_kv_heads, i.head_dim) for i in infos} == {
            (LAYERS, KV_HEADS, HEAD_DIM)
        }
        messages = [batch_to_proto(b) for b in forward_script()]
        # Every rank gets the same steps at once: they meet in collectives.
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(lambda w=w: list(w.stub.Steps(iter(messages), timeout=120)))
                       for w in ranks]
            results = [[result_from_proto(r) for r in s.result()] for s in streams]
        assert_same_results(results[0], reference)
        assert tokens(results[1]) == tokens(results[0])
        assert [w.terminate() for w in ranks] == [0, 0]
    finally:
        for worker in ranks:
            worker.kill()


def test_the_worker_picks_its_openmp_spin_by_the_model_before_torch_loads(tmp_path) -> None:
    """libgomp reads its spin count once, when torch loads it: the worker's main module must
    not load torch before main() sets it. A model with layers as small as the host
    benchmark's spins briefly; the bundled model keeps libgomp's default; a wait policy the
    user chose wins."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 256}')
    script = (
        "import sys, radixmesh.services.worker.__main__ as m; "
        "print('torch' in sys.modules); "
        f"env = {{}}; m.openmp_spin(env, {str(tiny)!r}); print(env); "
        "env = {}; m.openmp_spin(env, None); print(env); "
        f"env = {{'GOMP_SPINCOUNT': '5'}}; m.openmp_spin(env, {str(tiny)!r}); print(env); "
        f"env = {{'OMP_WAIT_POLICY': 'active'}}; m.openmp_spin(env, {str(tiny)!r}); print(env); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["False", "{'GOMP_SPINCOUNT': '1000'}", "{}", "{'GOMP_SPINCOUNT': '5'}",
                   "{'OMP_WAIT_POLICY': 'active'}", "False"]
    assert mlp_work(tiny) == 64 * 256
    assert mlp_work(resolve_model_path(None)) == 576 * 1536  # the bundled GGUF's metadata
    assert mlp_work(tmp_path) is None
