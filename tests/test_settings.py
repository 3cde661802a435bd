"""Every setting declared once: the flags of `radixmesh up`, `radixmesh generate` and each
service, their help, their environment variables, their validation, and what the launcher
hands its children all come from the declarations in radixmesh.core.settings and
radixmesh.core.service_settings."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch

from radixmesh import cli
from radixmesh.core import flags, settings
from radixmesh.core.flags import Setting, Settings, build_parser, from_args, parse_config, setting
from radixmesh.core.service_settings import (
    CachectlConfig,
    DetokenizerConfig,
    SchedulerServiceConfig,
    TokenizerServiceConfig,
    WorkerConfig,
)
from radixmesh.core.settings import EngineArgs
from radixmesh.engine import eviction, schedule_policy
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.launcher import SERVICE_CONFIGS, Mesh, MeshArgs

CONFIGS: list[type[Settings]] = [
    EngineArgs,
    MeshArgs,
    WorkerConfig,
    SchedulerServiceConfig,
    TokenizerServiceConfig,
    DetokenizerConfig,
    CachectlConfig,
]


def _subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {f"radixmesh {name}": _subcommand(name) for name in ("up", "generate")}
    for service, config in SERVICE_CONFIGS.items():
        parsers[service] = build_parser(config)
    return parsers


@pytest.fixture(autouse=True)
def _no_settings_in_the_environment(monkeypatch) -> None:
    """The parsers read RADIXMESH_* and NATS_URL: none may leak in from the test's shell."""
    for config in CONFIGS:
        for f in dataclasses.fields(config):
            monkeypatch.delenv(flags.env_name(f.name), raising=False)
    monkeypatch.delenv("NATS_URL", raising=False)


# ---- help -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["radixmesh up", "radixmesh generate", *SERVICE_CONFIGS])
def test_every_flag_has_help(name) -> None:
    parser = _parsers()[name]
    assert len(parser._actions) > 5
    for action in parser._actions:
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings
        assert len(action.help.split()) >= 3, (action.option_strings, action.help)


@pytest.mark.parametrize("service", sorted(SERVICE_CONFIGS))
def test_service_help_lists_its_settings(service) -> None:
    """`python -m radixmesh.services.<name> --help` prints the flags of its config."""
    out = subprocess.run(
        [sys.executable, "-m", f"radixmesh.services.{service}", "--help"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    config = SERVICE_CONFIGS[service]
    for action in build_parser(config)._actions:
        for flag in action.option_strings:
            assert flag in out
    assert "RADIXMESH_LOG_LEVEL" in out


SHARED = {
    "model_path": [EngineArgs, MeshArgs, WorkerConfig, SchedulerServiceConfig,
                   TokenizerServiceConfig, DetokenizerConfig],
    "revision": [EngineArgs, MeshArgs, WorkerConfig, SchedulerServiceConfig,
                 TokenizerServiceConfig, DetokenizerConfig],
    "dtype": [EngineArgs, MeshArgs, WorkerConfig],
    "quantization": [EngineArgs, MeshArgs, WorkerConfig],
    "device": [EngineArgs, MeshArgs, WorkerConfig],
    "attention_backend": [EngineArgs, MeshArgs, WorkerConfig],
    "cuda_graph_max_bs": [EngineArgs, MeshArgs, WorkerConfig],
    "disable_cuda_graph": [EngineArgs, MeshArgs, WorkerConfig],
    "page_size": [EngineArgs, MeshArgs, WorkerConfig, SchedulerServiceConfig],
    "max_total_tokens": [EngineArgs, MeshArgs, WorkerConfig],
    "mem_fraction_static": [EngineArgs, MeshArgs, WorkerConfig],
    # The workers size the KV pool by these, the scheduler admits by them.
    "max_running_requests": [EngineArgs, MeshArgs, SchedulerServiceConfig, WorkerConfig],
    "chunked_prefill_size": [EngineArgs, MeshArgs, SchedulerServiceConfig],
    "schedule_policy": [EngineArgs, MeshArgs, SchedulerServiceConfig],
    "radix_eviction_policy": [EngineArgs, MeshArgs, SchedulerServiceConfig],
    "radix_slru_protected_ratio": [EngineArgs, MeshArgs, SchedulerServiceConfig],
    "disable_overlap_schedule": [EngineArgs, MeshArgs, SchedulerServiceConfig],
    "stream_interval": [EngineArgs, MeshArgs, SchedulerServiceConfig],
    "context_length": [EngineArgs, MeshArgs, SchedulerServiceConfig, WorkerConfig],
    "enable_priority_scheduling": [EngineArgs, MeshArgs, SchedulerServiceConfig],
    "schedule_low_priority_values_first": [EngineArgs, MeshArgs, SchedulerServiceConfig],
    "priority_scheduling_preemption_threshold": [EngineArgs, MeshArgs, SchedulerServiceConfig],
    "host": [MeshArgs, WorkerConfig, SchedulerServiceConfig, TokenizerServiceConfig,
             DetokenizerConfig, CachectlConfig],
    "log_level": [MeshArgs, WorkerConfig, SchedulerServiceConfig, TokenizerServiceConfig,
                  DetokenizerConfig, CachectlConfig],
    "metrics_port": [WorkerConfig, SchedulerServiceConfig, DetokenizerConfig, CachectlConfig],
    **dict.fromkeys(
        (
            "enable_hierarchical_cache",
            "hicache_ratio",
            "hicache_size",
            "hicache_write_policy",
            "hicache_write_through_threshold",
            "hicache_mem_layout",
            "hicache_storage_page_size",
            "hicache_storage_prefetch_policy",
            "hicache_storage_prefetch_timeout",
            "hicache_storage_prefetch_threshold",
        ),
        [EngineArgs, MeshArgs, SchedulerServiceConfig],
    ),
    **dict.fromkeys(
        ("hicache_storage_backend", "hicache_storage_backend_extra_config"),
        [EngineArgs, MeshArgs, CachectlConfig],
    ),
    "nats_url": [SchedulerServiceConfig, TokenizerServiceConfig, DetokenizerConfig,
                 CachectlConfig],
    "grammar_backend": [EngineArgs, MeshArgs, WorkerConfig, TokenizerServiceConfig],
    **dict.fromkeys(("tool_call_parser", "reasoning_parser"),
                    [MeshArgs, TokenizerServiceConfig]),
}


@pytest.mark.parametrize("name", sorted(SHARED))
def test_a_shared_setting_is_the_same_everywhere(name) -> None:
    """Same default on every config, same flag and help in every parser that has it."""
    configs = SHARED[name]
    assert len({getattr(config(), name) for config in configs}) == 1
    parsers = [build_parser(config) for config in configs]
    if EngineArgs in configs:
        parsers.append(_subcommand("generate"))
    if MeshArgs in configs:
        parsers.append(_subcommand("up"))
    seen = []
    for parser in parsers:
        for action in parser._actions:
            if action.dest == name and not action.option_strings[0].startswith("--no-"):
                seen.append((tuple(action.option_strings), action.default, action.help))
    assert len(seen) == len(parsers) and len(set(seen)) == 1, seen


def test_page_size_everywhere() -> None:
    for config in (EngineArgs, MeshArgs, WorkerConfig, SchedulerServiceConfig):
        assert config().page_size == 1
        action = next(a for a in build_parser(config)._actions if a.dest == "page_size")
        assert action.option_strings == ["--page-size"]
        assert action.help.startswith("tokens per KV-cache page")
        assert "RADIXMESH_PAGE_SIZE" in action.help


# ---- the environment --------------------------------------------------------------------


def test_environment_sets_defaults_and_flags_win(monkeypatch) -> None:
    monkeypatch.setenv("RADIXMESH_PAGE_SIZE", "16")
    monkeypatch.setenv("RADIXMESH_DISABLE_OVERLAP_SCHEDULE", "true")
    monkeypatch.setenv("RADIXMESH_CONTEXT_LENGTH", "2048")
    monkeypatch.setenv("RADIXMESH_WORKER_TIMEOUT", "2.5")
    monkeypatch.setenv("NATS_URL", "nats://bus:4222")
    config = parse_config(SchedulerServiceConfig, [])
    assert (config.page_size, config.disable_overlap_schedule, config.context_length) == (
        16, True, 2048
    )
    assert (config.worker_timeout, config.nats_url) == (2.5, "nats://bus:4222")
    config = parse_config(
        SchedulerServiceConfig, ["--page-size=4", "--no-disable-overlap-schedule"]
    )
    assert (config.page_size, config.disable_overlap_schedule) == (4, False)
    monkeypatch.setenv("RADIXMESH_NATS_URL", "nats://own:4222")  # the specific one first
    assert parse_config(DetokenizerConfig, []).nats_url == "nats://own:4222"


def test_environment_reaches_up_and_generate(monkeypatch) -> None:
    monkeypatch.setenv("RADIXMESH_MAX_TOTAL_TOKENS", "4096")
    monkeypatch.setenv("RADIXMESH_DEVICE", "cpu")
    monkeypatch.setenv("NATS_URL", "nats://bus:4222")
    served: list[MeshArgs] = []
    monkeypatch.setattr(cli, "serve", lambda args: served.append(args) or 0)
    assert cli.main(["up"]) == 0
    assert (served[0].max_total_tokens, served[0].device) == (4096, "cpu")
    assert served[0].nats_url == "nats://bus:4222"
    args = cli.build_parser().parse_args(["generate", "hello", "--no-show-progress"])
    engine_args = from_args(EngineArgs, args)
    assert (engine_args.max_total_tokens, engine_args.device) == (4096, "cpu")
    assert engine_args.show_progress is False


def test_empty_variable_means_none(monkeypatch) -> None:
    monkeypatch.setenv("RADIXMESH_MODEL_PATH", "")
    monkeypatch.setenv("RADIXMESH_CONTEXT_LENGTH", "")
    config = parse_config(SchedulerServiceConfig, ["--engine-id=e3"])
    assert (config.model_path, config.context_length, config.engine_id) == (None, None, "e3")


def test_bad_variable_exits_2_naming_it(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RADIXMESH_PAGE_SIZE", "big")
    with pytest.raises(SystemExit) as exc:
        parse_config(WorkerConfig, [])
    assert exc.value.code == 2
    assert "RADIXMESH_PAGE_SIZE='big'" in capsys.readouterr().err


def test_factory_defaults_stay_per_instance(monkeypatch) -> None:
    a, b = parse_config(TokenizerServiceConfig, []), parse_config(TokenizerServiceConfig, [])
    assert a.replica_id != b.replica_id
    monkeypatch.setenv("RADIXMESH_REPLICA_ID", "t7")
    assert parse_config(TokenizerServiceConfig, []).replica_id == "t7"
    assert parse_config(DetokenizerConfig, ["--replica-id=d2"]).replica_id == "d2"


# ---- validation -------------------------------------------------------------------------

# One bad value per validated setting (a test below checks none is missing).
BAD_VALUES: dict[str, list[Any]] = {
    "dtype": ["float16"],
    "quantization": ["q4", "awq"],
    "device": ["gpu", "cuda:x"],
    "attention_backend": ["flash"],
    "cuda_graph_max_bs": [-1, "8"],
    "page_size": [0, None, 2.0],
    "max_total_tokens": [0],
    "mem_fraction_static": [0, 1.5, -0.2, True, "0.5"],
    "max_running_requests": [0],
    "chunked_prefill_size": [-5],
    "stream_interval": [0],
    "schedule_policy": ["random"],
    "radix_eviction_policy": ["mru"],
    "radix_slru_protected_ratio": [0.0, 1.0, True],
    "context_length": [1, -3],
    "priority_scheduling_preemption_threshold": [-1, "10"],
    "log_level": ["LOUD"],
    "metrics_port": [-1],
    "tp_size": [0],
    "dp_size": [0],
    "prefill_dp_size": [-1],
    "decode_dp_size": [-1],
    "prefill_tp_size": [-1],
    "decode_tp_size": [-1],
    "disaggregation_mode": ["both", None],
    "disaggregation_transfer_backend": ["rdma"],
    "disaggregation_timeout": [0.0],
    "tokenizers": [0],
    "detokenizers": [0],
    "port": [-1],
    "grpc_port": [-2],
    "tp_rank": [-1],
    "num_threads": [-1],
    "worker_timeout": [-1.0],
    "engine_timeout": [-0.5],
    "shutdown_grace": [-1],
    "stall_timeout": [-1],
    "max_queued_requests": [-1, 1.5],
    "cache_threshold": [-0.1],
    "balance_abs_threshold": [-1],
    "balance_rel_threshold": [-1.5],
    "max_tree_tokens": [0],
    "hicache_ratio": [0.5],
    "hicache_size": [-1.0],
    "hicache_write_policy": ["always"],
    "hicache_write_through_threshold": [0],
    "hicache_mem_layout": ["token_first"],
    "hicache_storage_page_size": [0],
    "hicache_storage_prefetch_policy": ["eager"],
    "hicache_storage_prefetch_timeout": [-1.0],
    "hicache_storage_prefetch_threshold": [0],
    "hicache_storage_backend": ["s3"],
    "grammar_backend": ["outlines", None],
    "speculative_algorithm": ["EAGLE", "ngram"],
    "speculative_num_draft_tokens": [0],
    "speculative_ngram_min_match_window_size": [0],
    "speculative_ngram_max_match_window_size": [0],
    "speculative_ngram_min_bfs_breadth": [0],
    "speculative_ngram_max_bfs_breadth": [0],
    "speculative_ngram_match_type": ["DFS"],
    "speculative_ngram_branch_length": [0],
    "speculative_ngram_max_trie_depth": [1],
    "speculative_ngram_capacity": [10],
    "tool_call_parser": ["hermes", "QWEN25"],
    "reasoning_parser": ["deepseek"],
    "max_loras_per_batch": [0],
    "lora_paths": [["a=/x", "a=/y"], "a=", [None]],
    "max_lora_rank": [-1],
    "max_loaded_loras": [0],
}


def _validated(config: type[Settings]) -> set[str]:
    names = set()
    for f in dataclasses.fields(config):
        spec: Setting | None = f.metadata.get(flags.METADATA_KEY)
        if spec is not None and (spec.choices or spec.minimum is not None or spec.check):
            names.add(f.name)
    return names


def test_every_validated_setting_has_a_bad_value() -> None:
    assert set().union(*map(_validated, CONFIGS)) == set(BAD_VALUES)


@pytest.mark.parametrize(
    ("config", "name", "value"),
    [
        (config, name, value)
        for config in CONFIGS
        for name in sorted(_validated(config))
        for value in BAD_VALUES[name]
    ],
)
def test_bad_value_names_the_setting(config, name, value) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        config(**{name: value})


@pytest.mark.parametrize(
    ("config", "values", "message"),
    [
        (EngineArgs, {"page_size": 16, "max_total_tokens": 16},
         r"max_total_tokens must hold at least two pages \(32 tokens at page_size 16\)"),
        (MeshArgs, {"page_size": 8, "max_total_tokens": 8}, "max_total_tokens"),
        (EngineArgs, {"speculative_ngram_min_match_window_size": 4,
                      "speculative_ngram_max_match_window_size": 3},
         "speculative_ngram_min_match_window_size"),
        (EngineArgs, {"speculative_ngram_min_bfs_breadth": 4,
                      "speculative_ngram_max_bfs_breadth": 3}, "speculative_ngram_min_bfs_breadth"),
        (MeshArgs, {"speculative_ngram_max_trie_depth": 12}, "speculative_ngram_max_trie_depth"),
        (WorkerConfig, {"page_size": 4, "max_total_tokens": 7}, "max_total_tokens"),
        (WorkerConfig, {"tp_size": 2, "tp_rank": 2, "dist_init_addr": "tcp://h:1"},
         r"tp_rank must be in \[0, tp_size\), got 2/2"),
        (WorkerConfig, {"tp_size": 2, "tp_rank": 1}, "tp_size > 1 needs dist_init_addr"),
        (MeshArgs, {"device": "cuda", "attention_backend": "torch"},
         "attention_backend='torch' runs on the CPU only"),
        (EngineArgs, {"page_size": 16, "hicache_storage_page_size": 24},
         "hicache_storage_page_size must be a multiple of page_size 16, got 24"),
        (MeshArgs, {"hicache_storage_backend": "file",
                    "hicache_storage_backend_extra_config": "{not json"},
         "hicache_storage_backend_extra_config is not JSON"),
        (CachectlConfig, {"hicache_storage_backend": "redis",
                          "hicache_storage_backend_extra_config": '{"path": "/x"}'},
         "'path' is not a setting of the redis backend"),
        (EngineArgs, {"hicache_storage_backend": "redis",
                      "hicache_storage_backend_extra_config": '{"url": "http://x"}'},
         "hicache_storage_backend_extra_config: the redis backend's url must be "
         "redis://HOST:PORT/DB"),
        (EngineArgs, {"hicache_storage_backend_extra_config": '{"path": "/x"}'},
         "hicache_storage_backend_extra_config needs a storage backend"),
        (MeshArgs, {"prefill_dp_size": 1}, "prefill_dp_size and decode_dp_size go together"),
    ],
)
def test_cross_field_checks(monkeypatch, config, values, message) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=message):
        config(**values)


def test_good_values_pass() -> None:
    assert EngineArgs(context_length=0).context_length == 0
    assert EngineArgs(context_length=2).context_length == 2
    assert MeshArgs(log_level="debug", nats_url="nats://x:1").log_level == "debug"
    assert TokenizerServiceConfig(grpc_port=-1, cache_threshold=0.0).grpc_port == -1
    worker = WorkerConfig(tp_size=2, tp_rank=1, dist_init_addr="tcp://127.0.0.1:1")
    assert worker.tp_rank == 1


def test_up_with_a_bad_value_exits_2_before_starting(monkeypatch, capsys) -> None:
    started: list[MeshArgs] = []
    monkeypatch.setattr(cli, "serve", lambda args: started.append(args) or 0)
    monkeypatch.setattr(Mesh, "start", lambda self, *_: started.append(self.args))
    assert cli.main(["up", "--page-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "page_size" in err
    assert started == []


def test_service_with_a_bad_value_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(WorkerConfig, ["--tp-rank=3"])
    assert exc.value.code == 2
    assert "tp_rank must be in [0, tp_size)" in capsys.readouterr().err


def test_engine_keywords_are_validated_before_loading() -> None:
    from radixmesh.api import Engine

    with pytest.raises(ValueError, match="chunked_prefill_size"):
        Engine(chunked_prefill_size=0)
    with pytest.raises(TypeError, match="no_such_setting"):
        Engine(no_such_setting=1)


def test_choices_match_what_the_scheduler_implements() -> None:
    assert settings.SCHEDULE_POLICIES == schedule_policy.POLICIES
    assert set(settings.EVICTION_POLICIES) == set(eviction.POLICIES)


def test_slru_and_its_ratio_reach_the_radix_cache(monkeypatch) -> None:
    monkeypatch.setenv("RADIXMESH_RADIX_SLRU_PROTECTED_RATIO", "0.6")
    config = parse_config(SchedulerServiceConfig, ["--radix-eviction-policy=slru"])
    assert (config.radix_eviction_policy, config.radix_slru_protected_ratio) == ("slru", 0.6)
    config = parse_config(SchedulerServiceConfig, ["--radix-slru-protected-ratio", "0.5"])
    assert config.radix_slru_protected_ratio == 0.5
    scheduler = Scheduler(SchedulerConfig.from_settings(EngineArgs(
        radix_eviction_policy="slru", radix_slru_protected_ratio=0.3), 1, 64, 128, ()))
    policy = scheduler.cache._eviction
    assert isinstance(policy, eviction.SegmentedLRU) and policy.protected_ratio == 0.3


# ---- flags: names, booleans, optional values -----------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Toy(Settings):
    """Flag names from declarations."""

    overlap_off: bool = setting(False, flag="disable-overlap", aliases=("no-overlap-x",),
                                help="a boolean with its own flag name and an alias")
    ranks: int = setting(1, minimum=1, aliases=("tp-size", "tp"), help="a count with aliases")
    seed: int | None = setting(None, help="an optional number")


def test_declared_flag_names_and_aliases(monkeypatch) -> None:
    assert parse_config(_Toy, ["--disable-overlap"]).overlap_off is True
    assert parse_config(_Toy, ["--no-overlap-x=yes"]).overlap_off is True
    assert parse_config(_Toy, ["--disable-overlap", "--no-disable-overlap"]).overlap_off is False
    assert parse_config(_Toy, ["--tp", "3"]).ranks == 3
    assert parse_config(_Toy, ["--tp-size=2"]).ranks == 2
    assert parse_config(_Toy, ["--ranks=4"]).ranks == 4
    with pytest.raises(SystemExit):
        parse_config(_Toy, ["--overlap-off"])  # the declared flag replaces the derived one
    monkeypatch.setenv("RADIXMESH_OVERLAP_OFF", "on")  # the variable follows the field
    monkeypatch.setenv("RADIXMESH_SEED", "7")
    assert parse_config(_Toy, []).overlap_off is True
    assert parse_config(_Toy, []).seed == 7
    assert parse_config(_Toy, ["--seed="]).seed is None


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], False),
        (["--disable-overlap-schedule"], True),
        (["--no-disable-overlap-schedule"], False),
        (["--disable-overlap-schedule=false"], False),
        (["--disable-overlap-schedule", "on"], True),
        (["--disable-overlap-schedule=True"], True),
        (["--disable-overlap-schedule=0"], False),
    ],
)
def test_boolean_flag_forms(flags, expected) -> None:
    assert parse_config(SchedulerServiceConfig, flags).disable_overlap_schedule is expected


def test_boolean_flag_rejects_other_words(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(SchedulerServiceConfig, ["--disable-overlap-schedule=maybe"])
    assert "expected a boolean, got 'maybe'" in capsys.readouterr().err


# ---- what the launcher hands its children ------------------------------------------------


def test_launcher_hands_every_service_the_settings_it_shares(monkeypatch) -> None:
    commands: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(
        "radixmesh.launcher.subprocess.Popen",
        lambda args, env, **_: commands.append((args, env)),
    )
    args = MeshArgs(
        model_path="/models/m.gguf", dtype="float32", device="cpu", attention_backend="torch",
        cuda_graph_max_bs=0, page_size=4, max_total_tokens=4096, max_running_requests=3,
        mem_fraction_static=0.5,
        chunked_prefill_size=128, schedule_policy="fcfs", radix_eviction_policy="lfu",
        disable_overlap_schedule=True, context_length=None, host="127.0.0.2", log_level="DEBUG",
        tp_size=2, port=0, grpc_port=0, nats_url="nats://bus:4222",
        lora_paths=("a=/x", {"lora_name": "b", "lora_path": "/y y", "pinned": True}),
    )
    mesh = Mesh(args)
    mesh._pick_front_ports()
    mesh._start_engine(0, "null", 2)
    mesh._spawn("detokenizer-0", "detokenizer", {"replica_id": "d0"})
    mesh._start_tokenizer(0)
    started: dict[str, list[Settings]] = {}
    for command, env in commands:
        at = command.index("-m")
        service = command[at + 1].rsplit(".", 1)[1]
        assert not any("nats://" in arg for arg in command)  # secrets go in the environment
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            config = parse_config(SERVICE_CONFIGS[service], command[at + 2:])
        started.setdefault(service, []).append(config)
    assert {s: len(c) for s, c in started.items()} == {
        "worker": 2, "scheduler": 1, "detokenizer": 1, "tokenizer": 1
    }
    shared = dataclasses.fields(MeshArgs)
    for service, configs in started.items():
        for config in configs:
            for f in dataclasses.fields(config):
                owner_has_it = any(
                    f.name == g.name and f.metadata is g.metadata for g in shared
                )
                if owner_has_it:
                    assert getattr(config, f.name) == getattr(args, f.name), (service, f.name)
            if service != "worker":
                assert config.nats_url == "nats://bus:4222"
    workers = started["worker"]
    assert [(w.tp_rank, w.tp_size) for w in workers] == [(0, 2), (1, 2)]
    assert workers[0].dist_init_addr == workers[1].dist_init_addr
    scheduler = started["scheduler"][0]
    assert scheduler.worker_list == [f"127.0.0.2:{w.port}" for w in workers]
    assert scheduler.context_length is None and scheduler.disable_overlap_schedule is True


def test_the_launcher_starts_prefill_and_decode_engines_in_their_roles(monkeypatch) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr("radixmesh.launcher.subprocess.Popen",
                        lambda args, env, **_: commands.append(args))
    args = MeshArgs(prefill_dp_size=1, decode_dp_size=2, disaggregation_timeout=5.0,
                    prefill_tp_size=3, port=0, grpc_port=0, nats_url="nats://bus:4222")
    assert args.engine_roles == ["prefill", "decode", "decode"]
    mesh = Mesh(args)
    mesh._pick_front_ports()
    for e, role in enumerate(args.engine_roles):
        mesh._start_engine(e, role, 5)
    roles = {}
    for command in commands:
        at = command.index("-m")
        service = command[at + 1].rsplit(".", 1)[1]
        config = parse_config(SERVICE_CONFIGS[service], command[at + 2:])
        if service == "scheduler":
            assert config.disaggregation_timeout == 5.0
            roles[config.engine_id] = config.disaggregation_mode
        else:
            assert config.disaggregation_mode in ("prefill", "decode")
            assert config.tp_size == (3 if config.disaggregation_mode == "prefill" else 1)
    assert roles == {"p0": "prefill", "d0": "decode", "d1": "decode"}


def test_the_native_kernels_settings_come_from_the_environment(monkeypatch):
    from radixmesh.core.settings import NativeKernelSettings

    for name in ("RADIXMESH_NATIVE_KERNELS", "RADIXMESH_NATIVE_MARCH", "RADIXMESH_CACHE"):
        monkeypatch.delenv(name, raising=False)
    assert flags.from_environment(NativeKernelSettings) == NativeKernelSettings()
    monkeypatch.setenv("RADIXMESH_NATIVE_MARCH", "haswell -mavxvnni")
    monkeypatch.setenv("RADIXMESH_NATIVE_KERNELS", "0")
    monkeypatch.setenv("RADIXMESH_CACHE", "/tmp/kernels-here")
    got = flags.from_environment(NativeKernelSettings)
    assert (got.native_march, got.native_kernels, got.cache) == (
        "haswell -mavxvnni", False, "/tmp/kernels-here")
    monkeypatch.setenv("RADIXMESH_NATIVE_KERNELS", "maybe")
    with pytest.raises(ValueError, match="RADIXMESH_NATIVE_KERNELS='maybe'"):
        flags.from_environment(NativeKernelSettings)
