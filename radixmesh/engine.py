"""The offline engine: tokenizer, scheduler, worker and detokenizer in one process.

It runs the same scheduler and model runner as the mesh; ForwardBatch / ForwardResult
pass by direct call instead of gRPC."""

from __future__ import annotations

import logging
import queue
import random
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch

from radixmesh.core.model_files import resolve_model_path
from radixmesh.core.request import FinishKind, FinishReason, LogprobRequest
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine_args import EngineArgs
from radixmesh.proto import worker_pb2 as pb
from radixmesh.request_output import RequestStream
from radixmesh.services.scheduler.request import Req
from radixmesh.services.scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from radixmesh.services.worker.device import resolve_device
from radixmesh.services.worker.memory import release_free_memory
from radixmesh.services.worker.model_source import load_model
from radixmesh.services.worker.runner import ModelRunner

log = logging.getLogger("radixmesh.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Engine:
    """Generate from prompts in-process: `Engine().generate("Hello", {"max_new_tokens": 8})`."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.args = EngineArgs(model_path=model_path, **kwargs)
        if self.args.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.args.dtype!r}")
        path = resolve_model_path(model_path)
        self.tokenizer = Tokenizer.from_path(str(path))
        # Every torch call runs on this one thread: a second thread running parallel torch
        # ops starts a second OpenMP team, and the two slow each other down by ~1.5x.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixmesh-worker")
        self.runner = self._worker.submit(self._build_runner, str(path)).result()
        loaded_config = self.runner.config
        self.model_config = loaded_config
        self.context_length = min(
            self.args.context_length or loaded_config.max_position_embeddings,
            loaded_config.max_position_embeddings,
        )
        eos = tuple(dict.fromkeys(loaded_config.eos_token_ids + self.tokenizer.eos_token_ids))
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_slots=self.runner.pool.num_slots,
                page_size=self.args.page_size,
                max_running_requests=self.args.max_running_requests,
                chunked_prefill_size=self.args.chunked_prefill_size,
                schedule_policy=self.args.schedule_policy,
                eviction_policy=self.args.eviction_policy,
                context_length=self.context_length,
                eos_token_ids=eos,
            )
        )
        self._rng = random.Random(self.args.random_seed)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        # Guards _closed: once set, nothing new enters the inbox (see shutdown / _fail_all).
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixmesh-scheduler", daemon=True)
        self._thread.start()
        log.info("engine started: %s", asdict(self.args))

    def _build_runner(self, path: str) -> ModelRunner:
        a = self.args
        loaded = load_model(path, progress=a.show_progress)
        num_slots = a.max_total_tokens - a.max_total_tokens % a.page_size
        runner = ModelRunner(
            loaded.config,
            loaded.weights,
            _DTYPES[a.dtype],
            num_slots,
            attention=a.attention_backend,
            device=resolve_device(a.device),
            page_size=a.page_size,
            cuda_graph_max_bs=a.cuda_graph_max_bs,
        )
        del loaded
        release_free_memory()
        return runner

    # ---- public API ----------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        cache_salt: str | None = None,
        priority: int = 0,
        rid: str | list[str] | None = None,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Run one prompt (a dict back) or a list of prompts as one batch (a list back)."""
        batched = isinstance(prompt, list) or (
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        )
        prompts = _as_list(prompt, input_ids, batched)
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        if len(params) != len(prompts) or len(rids) != len(prompts):
            raise ValueError("sampling_params and rid lists must match the number of prompts")
        if stream and batched:
            raise ValueError("stream=True takes a single prompt")
        logprobs = _logprob_request(return_logprob, logprob_start_len, top_logprobs_num)
        reqs = [
            self._make_req(p, sp, logprobs, cache_salt, priority, r)
            for p, sp, r in zip(prompts, params, rids, strict=True)
        ]
        streams = [self._submit(req, stream) for req in reqs]
        if stream:
            return streams[0].chunks()
        results = [s.result() for s in streams]
        return results if batched else results[0]

    def abort(self, rid: str) -> None:
        """Stop a request wherever it is; its slots return to the pool."""
        self._post("abort", rid)

    def flush_cache(self) -> bool:
        """Drop every cached prefix (only while idle)."""
        done: Future[bool] = Future()
        self._post("flush", done)
        return done.result()

    def server_info(self) -> dict[str, Any]:
        """Pool and cache occupancy, read consistently from the scheduler thread."""
        done: Future[dict[str, Any]] = Future()
        self._post("info", done)
        return done.result()

    def shutdown(self) -> None:
        """Stop the scheduler thread and the worker; unfinished requests raise RuntimeError."""
        with self._lock:
            self._closed = True
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join()
        self._worker.shutdown()
        self._fail_all(RuntimeError("the engine was shut down"))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- requests --------------------------------------------------------------------------

    def _make_req(
        self,
        prompt: str | list[int],
        sampling: dict[str, Any] | None,
        logprobs: LogprobRequest,
        cache_salt: str | None,
        priority: int,
        rid: str | None,
    ) -> Req:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if not ids:
                raise ValueError("input_ids must not be empty")
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise ValueError(f"input_ids must be token ids in [0, {vocab})")
        if sampling is not None and not isinstance(sampling, dict):
            raise ValueError("sampling_params must be a dict")
        params = SamplingParams.from_dict(sampling or {})
        params.validate(self.model_config.vocab_size)
        if len(ids) >= self.context_length:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context length is {self.context_length}"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return Req(
            rid=rid or uuid.uuid4().hex,
            input_ids=ids,
            params=params,
            seed=seed,
            namespace=cache_salt,
            priority=priority,
            logprobs=logprobs,
        )

    def _submit(self, req: Req, streaming: bool) -> RequestStream:
        stream = RequestStream(req, self.tokenizer, streaming)
        self._post("add", (req, stream))
        return stream

    def _post(self, kind: str, payload: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is not running")
            self._inbox.put((kind, payload))

    def _fail_all(self, error: Exception) -> None:
        """Fail every request and call still waiting on the (stopped) scheduler thread."""
        with self._lock:
            self._closed = True
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                payload[1].fail(error)
            elif kind in ("flush", "info"):
                payload.set_exception(error)

    # ---- the scheduler thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            log.exception("the scheduler thread failed")
            self._fail_all(RuntimeError(f"the engine failed: {exc!r}"))

    def _loop(self) -> None:
        in_flight: tuple[ScheduledBatch, Future[pb.ForwardResult]] | None = None
        while not self._stop.is_set():
            self._drain_inbox(block=in_flight is None and not self.scheduler.has_work())
            batch = self.scheduler.schedule()
            if self.args.enable_overlap:
                submitted = (
                    (batch, self._worker.submit(self.runner.forward, batch.proto))
                    if batch
                    else None
                )
                if in_flight is not None:
                    self.scheduler.process_result(in_flight[0], in_flight[1].result())
                in_flight = submitted
            elif batch is not None:
                result = self._worker.submit(self.runner.forward, batch.proto).result()
                self.scheduler.process_result(batch, result)
            self._publish()
        if in_flight is not None:
            in_flight[1].result()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            req, stream = payload
            try:
                self.scheduler.add_request(req)
            except ValueError as exc:
                stream.fail(exc)
                return
            self._streams[req.rid] = stream
        elif kind == "abort":
            self.scheduler.abort(payload)
        elif kind == "flush":
            payload.set_result(self.scheduler.flush_cache())
        elif kind == "info":
            payload.set_result(self.scheduler.stats())

    def _publish(self) -> None:
        """Detokenize new tokens, apply stop strings and wake the callers."""
        for req in self.scheduler.drain_updates():
            stream = self._streams.get(req.rid)
            if stream is None:
                continue
            matched = stream.update()
            if matched is not None and req.finish is None:
                self.scheduler.abort(req.rid, FinishReason(FinishKind.STOP, matched))
                stream.update()
            if req.finish is not None:
                del self._streams[req.rid]


def _as_list(
    prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None, batched: bool
) -> list[str | list[int]]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt and input_ids")
    if prompt is not None:
        items: list[Any] = prompt if batched else [prompt]
        if not items or any(not isinstance(p, str) for p in items):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        return items
    assert input_ids is not None
    return list(input_ids) if batched else [input_ids]


def _logprob_request(return_logprob: bool, start: int, top_n: int) -> LogprobRequest:
    if not isinstance(top_n, int) or top_n < 0:
        raise ValueError("top_logprobs_num must be a non-negative integer")
    if not isinstance(start, int) or start < -1:
        raise ValueError("logprob_start_len must be an integer >= -1")
    return LogprobRequest(bool(return_logprob), top_n, start)
