"""SGLang 0.5's names against radixmesh's, in one place: every `radixmesh up` flag, native
/generate field and sampling parameter of SGLang that radixmesh takes (by SGLang's name, under
its own or as an alias) is accepted and means what it says, and every one it does not take is
refused. The documentation's "What radixmesh does not take from SGLang" is these tables'
NOT_TAKEN parts, so they keep it true."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from radixmesh import cli
from radixmesh.core.flags import from_args
from radixmesh.core.request import FieldNames, ModelLimits, build_request
from radixmesh.core.sampling_params import LogprobRequest, SamplingParams
from radixmesh.launcher import MeshArgs
from radixmesh.services.tokenizer.native_protocol import GenerateCall, parse_generate

# ---- `radixmesh up` flags -------------------------------------------------------------------

# SGLang's flag -> the arguments that give it, and (setting, value) it must set.
FLAGS_TAKEN: dict[str, tuple[list[str], str, Any]] = {
    "--model-path": (["/m.gguf"], "model_path", "/m.gguf"),
    # argparse takes it for --model-path, the only flag it begins (`radixmesh bench` has a
    # --model of its own: the served model's name, as SGLang's benchmark has).
    "--model": (["/m.gguf"], "model_path", "/m.gguf"),
    "--revision": (["v1"], "revision", "v1"),
    "--is-embedding": ([], "is_embedding", True),
    "--dtype": (["float32"], "dtype", "float32"),
    "--quantization": (["bf16"], "quantization", "bf16"),
    "--device": (["cpu"], "device", "cpu"),
    "--attention-backend": (["torch"], "attention_backend", "torch"),
    "--cuda-graph-max-bs": (["16"], "cuda_graph_max_bs", 16),
    "--disable-cuda-graph": ([], "disable_cuda_graph", True),
    "--page-size": (["16"], "page_size", 16),
    "--max-total-tokens": (["4096"], "max_total_tokens", 4096),
    "--mem-fraction-static": (["0.5"], "mem_fraction_static", 0.5),
    "--max-running-requests": (["32"], "max_running_requests", 32),
    "--max-queued-requests": (["100"], "max_queued_requests", 100),
    "--chunked-prefill-size": (["512"], "chunked_prefill_size", 512),
    "--context-length": (["2048"], "context_length", 2048),
    "--schedule-policy": (["fcfs"], "schedule_policy", "fcfs"),
    "--radix-eviction-policy": (["lfu"], "radix_eviction_policy", "lfu"),
    "--disable-overlap-schedule": ([], "disable_overlap_schedule", True),
    "--stream-interval": (["4"], "stream_interval", 4),
    "--stream-output": ([], "incremental_streaming_output", True),
    "--enable-priority-scheduling": ([], "enable_priority_scheduling", True),
    "--schedule-low-priority-values-first": ([], "schedule_low_priority_values_first", True),
    "--priority-scheduling-preemption-threshold": (
        ["5"], "priority_scheduling_preemption_threshold", 5),
    "--grammar-backend": (["llguidance"], "grammar_backend", "llguidance"),
    "--tool-call-parser": (["qwen25"], "tool_call_parser", "qwen25"),
    "--reasoning-parser": (["qwen3"], "reasoning_parser", "qwen3"),
    "--host": (["0.0.0.0"], "host", "0.0.0.0"),
    "--port": (["8000"], "port", 8000),
    "--api-key": (["k"], "api_key", "k"),
    "--log-level": (["DEBUG"], "log_level", "DEBUG"),
    "--tp-size": (["2"], "tp_size", 2),
    "--tensor-parallel-size": (["2"], "tp_size", 2),
    "--dp-size": (["2"], "dp_size", 2),
    "--data-parallel-size": (["2"], "dp_size", 2),
    "--disaggregation-transfer-backend": (["grpc"], "disaggregation_transfer_backend", "grpc"),
    "--enable-lora": ([], "enable_lora", True),
    "--lora-paths": (["a=/x", "b=/y"], "lora_paths", ("a=/x", "b=/y")),
    "--max-loras-per-batch": (["4"], "max_loras_per_batch", 4),
    "--max-lora-rank": (["16"], "max_lora_rank", 16),
    "--max-loaded-loras": (["4"], "max_loaded_loras", 4),
    "--lora-target-modules": (["q_proj,v_proj"], "lora_target_modules", "q_proj,v_proj"),
    "--enable-hierarchical-cache": ([], "enable_hierarchical_cache", True),
    "--hicache-ratio": (["3"], "hicache_ratio", 3.0),
    "--hicache-size": (["4"], "hicache_size", 4.0),
    "--hicache-write-policy": (["write_back"], "hicache_write_policy", "write_back"),
    "--hicache-mem-layout": (["page_first"], "hicache_mem_layout", "page_first"),
    "--hicache-storage-backend": (["file"], "hicache_storage_backend", "file"),
    "--hicache-storage-backend-extra-config": (
        ['{"path": "/tmp/pages"}', "--hicache-storage-backend", "file"],
        "hicache_storage_backend_extra_config", '{"path": "/tmp/pages"}'),
    "--hicache-storage-prefetch-policy": (
        ["timeout"], "hicache_storage_prefetch_policy", "timeout"),
    "--speculative-algorithm": (["NGRAM"], "speculative_algorithm", "NGRAM"),
    "--speculative-num-draft-tokens": (["4"], "speculative_num_draft_tokens", 4),
    "--speculative-ngram-min-match-window-size": (
        ["2"], "speculative_ngram_min_match_window_size", 2),
    "--speculative-ngram-max-match-window-size": (
        ["6"], "speculative_ngram_max_match_window_size", 6),
    "--speculative-ngram-min-bfs-breadth": (["2"], "speculative_ngram_min_bfs_breadth", 2),
    "--speculative-ngram-max-bfs-breadth": (["4"], "speculative_ngram_max_bfs_breadth", 4),
    "--speculative-ngram-match-type": (["PROB"], "speculative_ngram_match_type", "PROB"),
    "--speculative-ngram-branch-length": (["8"], "speculative_ngram_branch_length", 8),
    "--speculative-ngram-capacity": (["5000"], "speculative_ngram_capacity", 5000),
}

# Why radixmesh does not take a flag -> SGLang's flags it says it of.
FLAGS_NOT_TAKEN: dict[str, tuple[str, ...]] = {
    "always on in radixmesh: leave the flag out": (
        "--enable-metrics", "--enable-cache-report", "--enable-mixed-chunk"),
    "the tokenizer and chat template are the model's own (its folder or GGUF file)": (
        "--tokenizer-path", "--tokenizer-mode", "--skip-tokenizer-init", "--chat-template",
        "--completion-template"),
    "not built: weights load from safetensors or GGUF, told apart by the file, into "
    "radixmesh's own model code": (
        "--load-format", "--model-loader-extra-config", "--model-impl", "--trust-remote-code",
        "--json-model-override-args", "--custom-weight-loader", "--weight-loader-disable-mmap",
        "--delete-ckpt-after-loading", "--remote-instance-weight-loader-seed-instance-ip",
        "--remote-instance-weight-loader-seed-instance-service-port",
        "--remote-instance-weight-loader-send-weights-group-ports",
        "--checkpoint-engine-wait-weights-before-ready", "--decrypted-config-file",
        "--decrypted-draft-config-file", "--weight-version"),
    "models from the Hub go to the Hugging Face cache (HF_HOME)": ("--download-dir",),
    "not built: the KV cache is held in --dtype": ("--kv-cache-dtype", "--quantization-param-path"),
    "not built: one KV pool for every layer": (
        "--hybrid-kvcache-ratio", "--swa-full-tokens-ratio", "--disable-hybrid-swa-memory"),
    "not built: the hybrid models keep their linear layers' state in float32, with two "
    "snapshot slots per running request": (
        "--max-mamba-cache-size", "--mamba-ssm-dtype", "--mamba-full-memory-ratio"),
    "not built: no weight offloading or memory release": (
        "--cpu-offload-gb", "--offload-group-size", "--offload-num-in-group",
        "--offload-prefetch-step", "--offload-mode", "--enable-memory-saver",
        "--enable-weights-cpu-backup"),
    "--chunked-prefill-size bounds the prompt tokens of a step": ("--max-prefill-tokens",),
    "not built: the scheduler has no such knob": (
        "--schedule-conservativeness", "--num-continuous-decode-steps",
        "--scheduler-recv-interval", "--abort-on-priority-when-disabled", "--sleep-on-idle"),
    "not built: the radix cache is always on": ("--disable-radix-cache",),
    "not built: a prompt longer than the context is refused (400)": ("--allow-auto-truncate",),
    "only the in-process Engine (and `radixmesh generate`) takes it; in the mesh a request "
    "brings its own seed": ("--random-seed",),
    "not built as a mode: seeded requests give the same tokens alone or in any batch": (
        "--enable-deterministic-inference", "--rl-on-policy-target"),
    "not built: no pipeline parallelism": ("--pipeline-parallel-size", "--pp-size",
                                           "--pp-max-micro-batch-size"),
    "not built: mixture-of-experts layers run tensor-parallel with radixmesh's own kernels": (
        "--expert-parallel-size", "--ep-size", "--ep", "--moe-a2a-backend",
        "--moe-runner-backend", "--flashinfer-mxfp4-moe-precision", "--deepep-mode",
        "--deepep-config", "--ep-num-redundant-experts", "--ep-dispatch-algorithm",
        "--init-expert-location", "--enable-eplb", "--eplb-algorithm",
        "--eplb-rebalance-num-iterations", "--eplb-rebalance-layers-per-chunk",
        "--eplb-min-rebalancing-utilization-threshold", "--expert-distribution-recorder-mode",
        "--expert-distribution-recorder-buffer-size", "--enable-expert-distribution-metrics",
        "--moe-dense-tp-size", "--elastic-ep-backend", "--mooncake-ib-device",
        "--disable-shared-experts-fusion", "--disable-flashinfer-cutlass-moe-fp4-allgather",
        "--enable-flashinfer-allreduce-fusion", "--kt-amx-weight-path", "--kt-amx-method",
        "--kt-cpuinfer", "--kt-threadpool-count", "--kt-num-gpu-experts",
        "--kt-max-deferred-experts-per-token"),
    "not built: no data-parallel attention or micro-batch overlap": (
        "--enable-dp-attention", "--enable-dp-lm-head", "--enable-two-batch-overlap",
        "--enable-single-batch-overlap", "--tbo-token-distribution-threshold"),
    "`radixmesh up` runs on one machine; across machines start the services (a worker's "
    "--dist-init-addr)": (
        "--dist-init-addr", "--nccl-init-addr", "--nnodes", "--node-rank", "--nccl-port",
        "--dist-timeout"),
    "not built: tensor-parallel rank r runs on GPU r (--device cuda:N for one GPU)": (
        "--base-gpu-id", "--gpu-id-step", "--numa-node"),
    "not built: all-reduce is torch.distributed's (NCCL on GPUs, gloo on the CPU)": (
        "--disable-custom-all-reduce", "--enable-mscclpp", "--enable-torch-symm-mem",
        "--enable-nccl-nvls", "--enable-symm-mem", "--enable-p2p-check"),
    "not built: one --attention-backend (torch or triton) for every step, sampling in torch": (
        "--prefill-attention-backend", "--decode-attention-backend", "--mm-attention-backend",
        "--nsa-prefill-backend", "--nsa-decode-backend", "--sampling-backend",
        "--triton-attention-reduce-in-fp32", "--triton-attention-num-kv-splits",
        "--triton-attention-split-tile-size", "--flashinfer-mla-disable-ragged",
        "--disable-chunked-prefix-cache"),
    "not built: CUDA graphs cover every decode batch up to --cuda-graph-max-bs; no "
    "torch.compile": (
        "--cuda-graph-bs", "--disable-cuda-graph-padding", "--enable-profile-cuda-graph",
        "--enable-cudagraph-gc", "--enable-piecewise-cuda-graph", "--piecewise-cuda-graph-tokens",
        "--piecewise-cuda-graph-compiler", "--piecewise-cuda-graph-max-tokens",
        "--enable-torch-compile", "--torch-compile-max-bs", "--torchao-config",
        "--enable-fp32-lm-head"),
    "not built: --quantization takes gguf, bf16 or q8_0": (
        "--modelopt-quant", "--modelopt-checkpoint-restore-path",
        "--modelopt-checkpoint-save-path", "--modelopt-export-path", "--quantize-and-serve"),
    "not built": (
        "--enable-double-sparsity", "--ds-channel-config-path", "--ds-heavy-channel-num",
        "--ds-heavy-token-num", "--ds-heavy-channel-type", "--ds-sparse-decode-threshold",
        "--enable-pdmux", "--pdmux-config-path", "--sm-group-num", "--enable-nan-detection",
        "--debug-tensor-dump-output-folder", "--debug-tensor-dump-layers",
        "--debug-tensor-dump-input-file", "--debug-tensor-dump-inject", "--config",
        "--watchdog-timeout", "--tool-server", "--enable-custom-logit-processor",
        "--enable-return-hidden-states", "--multi-item-scoring-delimiter", "--kv-events-config",
        "--skip-server-warmup", "--warmups"),
    "not built: requests default to SGLang's and OpenAI's sampling defaults": (
        "--sampling-defaults", "--preferred-sampling-params"),
    "only NGRAM speculation is built (no draft model: EAGLE, standalone)": (
        "--speculative-draft-model-path", "--speculative-draft-model",
        "--speculative-draft-model-revision", "--speculative-draft-load-format",
        "--speculative-num-steps", "--speculative-eagle-topk",
        "--speculative-accept-threshold-single", "--speculative-accept-threshold-acc",
        "--speculative-token-map", "--speculative-attention-mode",
        "--speculative-moe-runner-backend"),
    "not built: radixmesh's own LoRA kernels, slots reused least recently used first": (
        "--lora-backend", "--max-lora-chunk-size", "--lora-eviction-policy"),
    "not built: HiCache (--enable-hierarchical-cache) is radixmesh's host and storage tier": (
        "--hicache-io-backend", "--enable-lmcache"),
    "not built: no outlines backend; JSON whitespace is bounded by radixmesh": (
        "--constrained-json-whitespace-pattern", "--constrained-json-disable-any-whitespace",
        "--disable-outlines-disk-cache"),
    "`--tokenizers N` starts N tokenizer replicas, each on its own port": (
        "--tokenizer-worker-num",),
    "not built: each tokenizer replica tokenizes as requests come": (
        "--enable-tokenizer-batch-encode", "--disable-tokenizer-batch-decode",
        "--enable-dynamic-batch-tokenizer", "--dynamic-batch-tokenizer-batch-size",
        "--dynamic-batch-tokenizer-batch-timeout"),
    "`radixmesh up` serves gRPC beside HTTP (--grpc-port)": ("--grpc-mode",),
    "not yet on `radixmesh up`; a tokenizer service takes --served-model-name": (
        "--served-model-name",),
    "not built: no Files API": ("--file-storage-path",),
    "not built: text models only": (
        "--enable-multimodal", "--disable-fast-image-processor", "--keep-mm-feature-on-device",
        "--mm-max-concurrent-calls", "--mm-per-request-timeout"),
    "not built: --log-level and --log-dir": (
        "--log-level-http", "--log-requests", "--log-requests-level", "--crash-dump-folder",
        "--show-time-cost", "--decode-log-interval", "--enable-request-time-stats-logging",
        "--gc-warning-threshold-secs"),
    "not built: /metrics has fixed buckets and labels": (
        "--enable-metrics-for-all-schedulers", "--tokenizer-metrics-custom-labels-header",
        "--tokenizer-metrics-allowed-custom-labels", "--bucket-time-to-first-token",
        "--bucket-inter-token-latency", "--bucket-e2e-request-latency",
        "--collect-tokens-histogram", "--prompt-tokens-buckets", "--generation-tokens-buckets"),
    "radixmesh traces with --trace-file or OpenTelemetry's OTEL_* variables": (
        "--enable-trace", "--otlp-traces-endpoint"),
    "not built: the tokenizers route by cached prefix and load": (
        "--load-balance-method", "--load-watch-interval", "--prefill-round-robin-balance"),
    "`radixmesh up` starts both roles (--prefill-dp-size, --decode-dp-size, --prefill-tp-size, "
    "--decode-tp-size); a scheduler or worker service takes --disaggregation-mode": (
        "--disaggregation-mode", "--disaggregation-decode-tp", "--disaggregation-decode-dp",
        "--disaggregation-prefill-pp"),
    "not built: KV moves between workers over gRPC or shared memory "
    "(--disaggregation-transfer-backend)": (
        "--disaggregation-bootstrap-port", "--disaggregation-ib-device",
        "--disaggregation-decode-enable-offload-kvcache",
        "--disaggregation-decode-polling-interval", "--num-reserved-decode-tokens"),
}


def _up() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["up"]


@pytest.fixture(autouse=True)
def _no_settings_in_the_environment(monkeypatch) -> None:
    for name in ("RADIXMESH_LORA_PATHS", "RADIXMESH_DEVICE", "RADIXMESH_MODEL_PATH"):
        monkeypatch.delenv(name, raising=False)


def test_no_flag_is_listed_twice() -> None:
    listed = [flag for flags in FLAGS_NOT_TAKEN.values() for flag in flags]
    assert len(listed) == len(set(listed)) and not set(listed) & set(FLAGS_TAKEN)


@pytest.mark.parametrize("flag", sorted(FLAGS_TAKEN))
def test_up_takes_sglangs_flag(flag: str) -> None:
    argv, name, value = FLAGS_TAKEN[flag]
    args = from_args(MeshArgs, _up().parse_args([flag, *argv]))
    assert getattr(args, name) == value


def test_disable_cuda_graph_leaves_no_graph() -> None:
    args = from_args(MeshArgs, _up().parse_args(["--disable-cuda-graph",
                                                 "--cuda-graph-max-bs", "64"]))
    assert args.graph_batch_limit(32) == 0
    assert from_args(MeshArgs, _up().parse_args([])).graph_batch_limit(32) == 32


@pytest.mark.parametrize("flag", sorted(f for flags in FLAGS_NOT_TAKEN.values() for f in flags))
def test_up_refuses_what_it_does_not_take(flag: str) -> None:
    # Neither the flag nor a longer one argparse would take it as an abbreviation of.
    assert not [option for option in _up()._option_string_actions if option.startswith(flag)]


# ---- native /generate fields ----------------------------------------------------------------

LIMITS = ModelLimits(context_length=64, vocab_size=100, compile_grammars=False,
                     lora_names=frozenset({"sql"}))


def _validated(body: dict[str, Any]) -> tuple[GenerateCall, list[Any]]:
    """A /generate body as the native API checks it: parsed, then each prompt's request
    built (prompts by input_ids, so no tokenizer is needed)."""
    call = parse_generate(body)
    built = [build_request(LIMITS, item.rid, item.input_ids or [1], item.sampling,
                           LogprobRequest(item.return_logprob, item.top_logprobs_num,
                                          item.logprob_start_len),
                           item.cache_salt, item.priority, FieldNames(), item.lora_path)
             for item in call.items]
    return call, built


# SGLang's field -> a body with it (input_ids [1, 2, 3] unless it gives a prompt), and where
# the field lands: an attribute of the call, of its first prompt, or of that prompt's request.
FIELDS_TAKEN: dict[str, tuple[dict[str, Any], str, Any]] = {
    "text": ({"text": "hello"}, "item.text", "hello"),
    "input_ids": ({"input_ids": [4, 5]}, "request.input_ids", [4, 5]),
    "sampling_params": ({"sampling_params": {"max_new_tokens": 3}},
                        "request.params.max_new_tokens", 3),
    "return_logprob": ({"return_logprob": True}, "request.logprobs.return_logprob", True),
    "logprob_start_len": ({"return_logprob": True, "logprob_start_len": 1},
                          "request.logprobs.logprob_start_len", 1),
    "top_logprobs_num": ({"return_logprob": True, "top_logprobs_num": 2},
                         "request.logprobs.top_logprobs_num", 2),
    "return_text_in_logprobs": ({"return_text_in_logprobs": True},
                                "call.return_text_in_logprobs", True),
    "stream": ({"stream": True}, "call.stream", True),
    "rid": ({"rid": "r-1"}, "request.rid", "r-1"),
    "priority": ({"priority": 3}, "request.priority", 3),
    "lora_path": ({"lora_path": "sql"}, "request.lora_path", "sql"),
    "extra_key": ({"extra_key": "tenant"}, "request.cache_salt", "tenant"),
}
# Fields SGLang has that radixmesh takes only with a value that asks for nothing (empty,
# false, null): why -> the fields.
FIELDS_NOT_TAKEN: dict[str, tuple[str, ...]] = {
    "not built: text models only": (
        "image_data", "video_data", "audio_data", "modalities", "input_embeds"),
    "not built": (
        "token_ids_logprob", "return_hidden_states", "session_params", "custom_logit_processor",
        "return_entropy", "background", "conversation_id", "no_logs", "custom_labels"),
    "radixmesh pairs prefill and decode engines itself": (
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key"),
    "not built: the tokenizers route by cached prefix and load": ("data_parallel_rank",),
    "SGLang's own bookkeeping (requests name an adapter by lora_path)": (
        "lora_id", "validation_time", "return_bytes"),
    "taken as true or false, and every request is counted in /metrics": ("log_metrics",),
}


def _landed(where: str, call: GenerateCall, request: Any) -> Any:
    owner, _, path = where.partition(".")
    value = {"call": call, "item": call.items[0], "request": request}[owner]
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("field", sorted(FIELDS_TAKEN))
def test_generate_takes_sglangs_field(field: str) -> None:
    body, where, expected = FIELDS_TAKEN[field]
    prompt = {} if "text" in body or "input_ids" in body else {"input_ids": [1, 2, 3]}
    call, built = _validated({**prompt, **body})
    assert _landed(where, call, built[0]) == expected


@pytest.mark.parametrize("field", sorted(f for fs in FIELDS_NOT_TAKEN.values() for f in fs))
def test_generate_refuses_what_it_does_not_take(field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} is not supported by this server$"):
        parse_generate({"input_ids": [1], field: "x"})


# ---- sampling parameters --------------------------------------------------------------------

# SGLang's sampling parameter -> its value, and (field of SamplingParams, value) it sets; n is
# the call's (samples of each prompt).
SAMPLING_TAKEN: dict[str, tuple[Any, str, Any]] = {
    "max_new_tokens": (5, "max_new_tokens", 5),
    "min_new_tokens": (2, "min_new_tokens", 2),
    "stop": ("\n", "stop", ["\n"]),
    "stop_token_ids": ([7], "stop_token_ids", [7]),
    "temperature": (0.5, "temperature", 0.5),
    "top_p": (0.9, "top_p", 0.9),
    "top_k": (20, "top_k", 20),
    "min_p": (0.1, "min_p", 0.1),
    "frequency_penalty": (0.5, "frequency_penalty", 0.5),
    "presence_penalty": (0.5, "presence_penalty", 0.5),
    "repetition_penalty": (1.1, "repetition_penalty", 1.1),
    "n": (3, "n", 3),
    "json_schema": ('{"type": "object"}', "json_schema", '{"type": "object"}'),
    "regex": ("[0-9]+", "regex", "[0-9]+"),
    "ebnf": ('root ::= "a"', "ebnf", 'root ::= "a"'),
    "structural_tag": ('{"structures": [], "triggers": []}', "structural_tag",
                       '{"structures": [], "triggers": []}'),
    "ignore_eos": (True, "ignore_eos", True),
    "skip_special_tokens": (False, "skip_special_tokens", False),
    "spaces_between_special_tokens": (False, "spaces_between_special_tokens", False),
    "no_stop_trim": (True, "no_stop_trim", True),
    "logit_bias": ({"7": 1.5}, "logit_bias", {7: 1.5}),
    "sampling_seed": (1234, "seed", 1234),
}
SAMPLING_NOT_TAKEN: dict[str, tuple[str, ...]] = {
    "not built": ("stop_regex",),
    "not built: no custom logit processors": ("custom_params",),
    "per request not built: the server's --stream-interval": ("stream_interval",),
}


@pytest.mark.parametrize("name", sorted(SAMPLING_TAKEN))
def test_generate_takes_sglangs_sampling_parameter(name: str) -> None:
    value, field, expected = SAMPLING_TAKEN[name]
    call, built = _validated({"input_ids": [1, 2, 3], "sampling_params": {name: value}})
    got = call.n if field == "n" else getattr(built[0].params, field)
    assert got == expected


@pytest.mark.parametrize("name", sorted(n for ns in SAMPLING_NOT_TAKEN.values() for n in ns))
def test_generate_refuses_sampling_parameters_it_does_not_take(name: str) -> None:
    with pytest.raises(ValueError, match=rf"sampling_params\.{name} is not supported|"
                                         rf"unknown sampling parameter '{name}'"):
        _validated({"input_ids": [1], "sampling_params": {name: "x"}})
    with pytest.raises(ValueError, match=f"unknown sampling parameter '{name}'"):
        SamplingParams.from_dict({name: "x"})


def test_sampling_seed_and_seed_are_one_parameter() -> None:
    assert SamplingParams.from_dict({"sampling_seed": 5}) == SamplingParams(seed=5)
    assert SamplingParams.from_dict({"sampling_seed": 5, "seed": 5}) == SamplingParams(seed=5)
    with pytest.raises(ValueError, match=r"^sampling_seed \(5\) and seed \(6\) are one parameter"):
        SamplingParams.from_dict({"sampling_seed": 5, "seed": 6})
    with pytest.raises(ValueError, match="seed must be an integer or null, got 'x'"):
        SamplingParams.from_dict({"sampling_seed": "x"})


def test_engine_generate_samples_the_same_with_sampling_seed_as_with_seed(engine) -> None:
    prompt = "Once upon a time"

    def run(**seed: int) -> list[int]:
        out = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0.9, **seed})
        return out["output_ids"]

    by_seed = run(seed=11)
    assert run(sampling_seed=11) == by_seed
    assert run(sampling_seed=12) != by_seed  # the seed is what decides


# ---- the documentation ----------------------------------------------------------------------

DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "sglang_names.md"


def _documented(heading: str) -> dict[str, tuple[str, ...]]:
    """The table under `heading` of the docs page: why -> the names it lists."""
    section = DOCS_PAGE.read_text().split(f"### {heading}\n", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| (`.+?) \| (.+) \|$", section, re.M)
    return {why: tuple(re.findall(r"`([^`]+)`", names)) for names, why in rows}


@pytest.mark.parametrize(("heading", "table"), [
    ("`radixmesh up` flags", FLAGS_NOT_TAKEN),
    ("`/generate` fields", FIELDS_NOT_TAKEN),
    ("Sampling parameters", SAMPLING_NOT_TAKEN),
])
def test_the_docs_list_exactly_what_is_not_taken(heading: str, table: dict) -> None:
    assert _documented(heading) == table
