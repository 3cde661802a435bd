"""The GPU path's wiring, checked on the CPU: device / attention / CUDA-graph options from
every front door down to ModelRunner, and the decode-graph path inside ModelRunner (padded
to its bucket, run eagerly under the Triton interpreter) against the torch backend."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_model import VOCAB, save_tiny_model, tokens
from tokenizers import Tokenizer, models, pre_tokenizers

from radixmesh import cli
from radixmesh.api import Engine
from radixmesh.core.flags import parse_config
from radixmesh.core.sampling_params import LogprobRequest, SamplingParams
from radixmesh.core.service_settings import WorkerConfig
from radixmesh.core.settings import EngineArgs
from radixmesh.core.step import NewRequest, StepBatch, StepEntry, StepResult
from radixmesh.engine.model.attention_choice import check_runs_on
from radixmesh.engine.model.device import resolve_device
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.engine.model.torch_attention import TorchAttention
from radixmesh.engine.model.triton_attention import TritonAttention
from radixmesh.launcher import Mesh, MeshArgs
from radixmesh.services.worker.server import WorkerService

GREEDY = SamplingParams(temperature=0)
REGION = 40  # pool slots reserved per request in the workload


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Make torch report `count` CUDA devices (0: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


# ---- options and their validation ------------------------------------------------------


def test_defaults() -> None:
    args = EngineArgs()
    assert (args.device, args.attention_backend, args.cuda_graph_max_bs) == ("auto", "auto", None)
    # CUDA graphs for every batch the engine runs: up to its running-request limit.
    assert args.graph_batch_limit(args.max_running_requests) == 64
    assert EngineArgs(cuda_graph_max_bs=8).graph_batch_limit(64) == 8
    config = WorkerConfig()
    assert (config.device, config.attention_backend, config.cuda_graph_max_bs) == (
        "auto",
        "auto",
        None,
    )
    assert config.graph_batch_limit() == 256  # alone, it does not know its engine's limit
    mesh = MeshArgs()
    assert (mesh.device, mesh.attention_backend, mesh.cuda_graph_max_bs) == ("auto", "auto", None)


@pytest.mark.parametrize("make", [EngineArgs, WorkerConfig, MeshArgs])
@pytest.mark.parametrize(
    ("options", "gpus", "message"),
    [
        ({"device": "gpu"}, 0, "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        ({"device": "cuda:x"}, 1, "device must be auto, cpu, cuda or cuda:N"),
        ({"device": "cuda:"}, 1, "device must be auto, cpu, cuda or cuda:N"),
        ({"device": "cuda"}, 0, "device='cuda' needs CUDA, but torch.cuda.is_available()"),
        ({"device": "cuda:0"}, 0, "device='cuda:0' needs CUDA"),
        ({"device": "cuda:2"}, 2, r"device='cuda:2': this machine has 2 CUDA device\(s\)"),
        ({"attention_backend": "flash"}, 0, "attention_backend must be one of"),
        (
            {"device": "cuda", "attention_backend": "torch"},
            1,
            "attention_backend='torch' runs on the CPU only",
        ),
        ({"cuda_graph_max_bs": -1}, 0, "cuda_graph_max_bs must be an integer >= 0"),
    ],
)
def test_bad_options(monkeypatch, make, options, gpus, message) -> None:
    fake_gpus(monkeypatch, gpus)
    with pytest.raises(ValueError, match=message):
        make(**options)


def test_good_options(monkeypatch) -> None:
    fake_gpus(monkeypatch, 2)
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert EngineArgs(device=device).device == device
    assert WorkerConfig(attention_backend="triton", cuda_graph_max_bs=0).cuda_graph_max_bs == 0
    assert EngineArgs(device="cpu", attention_backend="torch").attention_backend == "torch"


def test_resolve_device(monkeypatch) -> None:
    fake_gpus(monkeypatch, 0)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu", rank=3) == torch.device("cpu")
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_device("cuda")
    fake_gpus(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("auto", rank=1) == torch.device("cuda", 1)
    assert resolve_device("cuda", rank=3) == torch.device("cuda", 1)
    assert resolve_device("cuda:1", rank=0) == torch.device("cuda", 1)


def test_backend_must_run_on_its_device(monkeypatch) -> None:
    with pytest.raises(ValueError, match="torch attention backend runs on the CPU only"):
        check_runs_on(TorchAttention(0.5), torch.device("cuda", 0))
    check_runs_on(TorchAttention(0.5), torch.device("cpu"))
    check_runs_on(TritonAttention(0.5), torch.device("cpu"))  # under the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton attention backend needs a CUDA device"):
        check_runs_on(TritonAttention(0.5), torch.device("cpu"))


# ---- flags through each front door ------------------------------------------------------


def test_worker_flags_and_environment(monkeypatch) -> None:
    flags = ["--device=cpu", "--attention-backend=triton", "--cuda-graph-max-bs=8"]
    config = parse_config(WorkerConfig, flags)
    assert (config.device, config.attention_backend, config.cuda_graph_max_bs) == (
        "cpu",
        "triton",
        8,
    )
    monkeypatch.setenv("RADIXMESH_ATTENTION_BACKEND", "torch")
    monkeypatch.setenv("RADIXMESH_CUDA_GRAPH_MAX_BS", "0")
    config = parse_config(WorkerConfig, [])
    assert (config.attention_backend, config.cuda_graph_max_bs) == ("torch", 0)


def test_launcher_passes_the_options_to_every_worker(monkeypatch) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(
        "radixmesh.launcher.subprocess.Popen", lambda args, **_: commands.append(args)
    )
    args = MeshArgs(device="cpu", attention_backend="triton", cuda_graph_max_bs=4, tp_size=2)
    Mesh(args)._start_engine(0, "null", 2)
    workers = [c[3:] for c in commands if c[1:3] == ["-m", "radixmesh.services.worker"]]
    assert len(workers) == 2
    for rank, flags in enumerate(workers):
        # What the launcher passes is what the worker's own flag parser reads.
        config = parse_config(WorkerConfig, flags)
        assert (config.device, config.attention_backend, config.cuda_graph_max_bs) == (
            "cpu",
            "triton",
            4,
        )
        assert (config.tp_rank, config.tp_size) == (rank, 2)
    # By default the workers capture graphs for every batch the scheduler may run.
    commands.clear()
    Mesh(MeshArgs(device="cpu", max_running_requests=48))._start_engine(0, "null", 1)
    (worker,) = [c[3:] for c in commands if c[1:3] == ["-m", "radixmesh.services.worker"]]
    assert parse_config(WorkerConfig, worker).cuda_graph_max_bs == 48


def test_cli_up_flags(monkeypatch, capsys) -> None:
    served: list[MeshArgs] = []
    monkeypatch.setattr(cli, "serve", lambda args: served.append(args) or 0)
    argv = ["up", "--device", "cpu", "--attention-backend", "torch", "--cuda-graph-max-bs", "0"]
    assert cli.main(argv) == 0
    assert (served[0].device, served[0].attention_backend, served[0].cuda_graph_max_bs) == (
        "cpu",
        "torch",
        0,
    )
    fake_gpus(monkeypatch, 0)
    assert cli.main(["up", "--device", "cuda"]) == 2
    assert "device='cuda' needs CUDA" in capsys.readouterr().err
    assert len(served) == 1


# ---- the runner, the worker service and the engine ------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny random Llama with a word-level tokenizer (token "t<i>" is id i)."""
    path = save_tiny_model(tmp_path_factory.mktemp("gpu_path") / "llama")
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{VOCAB - 1}"}))
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(str(model_dir), progress=False)


class Workload:
    """StepBatches for several requests, each request's tokens in a pool region of its
    own (a request sharing another's prefix points at that one's slots)."""

    def __init__(self) -> None:
        self.batches: list[StepBatch] = []
        self._slots: dict[str, list[int]] = {}
        self._prompt: dict[str, list[int]] = {}
        self._batch = StepBatch(0)

    def admit(
        self,
        rid: str,
        prompt_len: int,
        prefix_of: str | None = None,
        prefix_len: int = 0,
        chunk_end: int | None = None,
    ) -> None:
        """A new request, prefilled in this step after `prefix_len` cached tokens of
        `prefix_of`'s prompt, up to `chunk_end` (default: the whole prompt)."""
        region = len(self._slots) * REGION + 3  # regions do not start on a round slot
        seed = len(self._slots) + 1
        prompt = [(seed * 31 + 7 * i) % (VOCAB - 1) for i in range(prompt_len)]
        prefix_slots: list[int] = []
        if prefix_of is not None:
            prompt[:prefix_len] = self._prompt[prefix_of][:prefix_len]
            prefix_slots = self._slots[prefix_of][:prefix_len]
        self._prompt[rid] = prompt
        self._slots[rid] = prefix_slots + list(range(region, region + prompt_len - prefix_len))
        self._batch.new_requests.append(NewRequest(
            rid,
            len(self._prompt) - 1,
            prompt[:prefix_len],
            prefix_slots,
            prompt_len,
            GREEDY,
            0,
            LogprobRequest(True, 2, 0) if rid == "a" else LogprobRequest(),
        ))
        self.chunk(rid, prefix_len, prompt_len if chunk_end is None else chunk_end)

    def chunk(self, rid: str, start: int, end: int) -> None:
        """Prompt tokens [start, end) of a request in this step; it samples at the end."""
        self._batch.entries.append(StepEntry(
            rid,
            self._prompt[rid][start:end],
            self._slots[rid][start:end],
            end == len(self._prompt[rid]),
        ))

    def decode(self, *rids: str) -> None:
        for rid in rids:
            slot = self._slots[rid][-1] + 1
            self._slots[rid].append(slot)
            self._batch.entries.append(StepEntry(rid, [], [slot], True))

    def release(self, *rids: str) -> None:
        self._batch.release.extend(rids)

    def end_step(self) -> None:
        self._batch.step = len(self.batches) + 1
        self.batches.append(self._batch)
        self._batch = StepBatch(0)


def mixed_workload() -> tuple[Workload, int]:
    """11 steps: prefills (chunked, after a cached prefix, a one-token prompt), decode
    batches of 1, 2, 3, 4, 7 and 8 (graph buckets 1, 2, 4 and 8) and of 9 (past the cap
    of 8), requests finishing mid-way and new ones joining. Returns it with its number of
    steps that fit a decode graph (every entry one token, at most 8 of them)."""
    w = Workload()
    w.admit("a", 5)
    w.admit("b", 9, chunk_end=6)
    w.admit("c", 3)
    w.end_step()  # 1: prefills, b's first chunk
    w.decode("a", "c")
    w.chunk("b", 6, 9)
    w.end_step()  # 2: decodes and b's last chunk
    w.decode("a", "b", "c")
    w.end_step()  # 3: graph, 3 padded to 4
    w.admit("d", 1)
    w.decode("a", "b", "c")
    w.end_step()  # 4: graph, 4: a one-token prompt is a decode-shaped step
    w.release("b")
    w.decode("a", "c", "d")
    w.end_step()  # 5: graph, 3 padded to 4, b finished
    w.admit("e", 7, prefix_of="a", prefix_len=4)
    for rid, n in (("f", 4), ("g", 2), ("h", 5), ("i", 3), ("j", 2)):
        w.admit(rid, n)
    w.decode("a", "c", "d")
    w.end_step()  # 6: e extends a's cached prefix; five more join
    running = ["a", "c", "d", "e", "f", "g", "h", "i", "j"]
    w.decode(*running)
    w.end_step()  # 7: 9 decodes, past the cap
    for gone in ("d", "e"):
        w.release(gone)
        running.remove(gone)
        w.decode(*running)
        w.end_step()  # 8: graph, 8; 9: graph, 7 padded to 8
    w.release("a", "c", "f", "g", "h")
    w.decode("i", "j")
    w.end_step()  # 10: graph, 2
    w.release("i")
    w.decode("j")
    w.end_step()  # 11: graph, 1
    return w, 7


def run(runner: ModelRunner, batches: list[StepBatch]) -> list[StepResult]:
    return [runner.forward(b) for b in batches]


def test_decode_graph_path_matches_torch_backend(loaded) -> None:
    workload, graph_steps = mixed_workload()
    assert len(workload.batches) == 11
    expected = run(
        ModelRunner(loaded.config, loaded.weights, torch.float32, 512, attention="torch"),
        workload.batches,
    )
    runner = ModelRunner(
        loaded.config,
        loaded.weights,
        torch.float32,
        512,
        attention="triton",
        cuda_graph_max_bs=8,
        eager_graphs=True,
    )
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8]
    got = run(runner, workload.batches)
    assert runner.graph_steps == graph_steps
    assert tokens(got) == tokens(expected)
    sampled = [
        r.token_id
        for batch, result in zip(workload.batches, got, strict=True)
        for e, r in zip(batch.entries, result.results, strict=True)
        if e.sample
    ]
    assert len(sampled) == 51 and min(sampled) >= 0
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want.results, have.results, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            assert a.input_logprobs[1:] == pytest.approx(b.input_logprobs[1:], abs=1e-4)


def test_graph_path_only_where_it_applies(loaded) -> None:
    """Graphs need the Triton backend and CUDA (or eager_graphs), and a cap above 0."""
    args = (loaded.config, loaded.weights, torch.float32, 512)
    for options in (
        {"attention": "torch", "cuda_graph_max_bs": 8, "eager_graphs": True},
        {"attention": "triton", "cuda_graph_max_bs": 8},  # CPU: ignored
        {"attention": "triton", "cuda_graph_max_bs": 0, "eager_graphs": True},
    ):
        runner = ModelRunner(*args, **options)
        assert runner.graphs is None
        run(runner, mixed_workload()[0].batches[:4])
        assert runner.graph_steps == 0


def test_worker_service_builds_its_runner_from_the_config(model_dir) -> None:
    config = WorkerConfig(
        model_path=str(model_dir),
        dtype="float32",
        max_total_tokens=256,
        page_size=4,
        device="cpu",
        attention_backend="triton",
    )

    async def load() -> ModelRunner:
        service = WorkerService(config)
        try:  # on the service's torch thread, as start() does
            return await asyncio.get_running_loop().run_in_executor(service._torch, service._load)
        finally:
            await service.stop()

    runner = asyncio.run(load())
    assert runner.device == torch.device("cpu")
    assert isinstance(runner.attention, TritonAttention)
    assert runner.attention.page_size == 4
    assert runner.graphs is None  # the CUDA-graph cap is ignored on the CPU


@pytest.fixture
def engines(model_dir) -> Iterator[dict[str, Engine]]:
    built: dict[str, Engine] = {}
    try:
        for backend in ("torch", "triton"):
            built[backend] = Engine(
                str(model_dir),
                dtype="float32",
                max_total_tokens=256,
                device="cpu",
                attention_backend=backend,
                show_progress=False,
            )
        yield built
    finally:
        for engine in built.values():
            engine.shutdown()


def test_engine_kwargs_reach_the_runner(engines) -> None:
    assert isinstance(engines["torch"].runner.attention, TorchAttention)
    assert isinstance(engines["triton"].runner.attention, TritonAttention)
    prompts = [[5, 9, 13, 2, 7], [100, 3], [42] * 9]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = {
        name: engine.generate(input_ids=prompts, sampling_params=params)
        for name, engine in engines.items()
    }
    ids = {name: [o["output_ids"] for o in out] for name, out in outs.items()}
    assert [len(x) for x in ids["triton"]] == [6, 6, 6]
    assert ids["triton"] == ids["torch"]
