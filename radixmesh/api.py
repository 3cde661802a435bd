"""The offline engine: tokenizer, scheduler, worker and detokenizer in one process.

It runs the mesh's engine loop, scheduler and model runner: steps go to the runner by
direct call on a dedicated torch thread, and progress to in-process request streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, replace
from typing import Any

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.hicache import DEFAULT_NATS_URL, KVGeometry, shm_root
from radixmesh.core.model_files import model_fingerprint, served_name
from radixmesh.core.model_info import model_info, model_shape
from radixmesh.core.pooling import model_serving, ranked, rerank_inputs
from radixmesh.core.request import FieldNames, ModelLimits, RequestError, build_request
from radixmesh.core.sampling_params import LogprobRequest
from radixmesh.core.settings import EngineArgs
from radixmesh.core.step import StepResult
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.host_link import HostLink
from radixmesh.engine.loop import EngineLoop
from radixmesh.engine.model.launch import LaunchAhead
from radixmesh.engine.model.runner import ModelRunner, load_runner
from radixmesh.engine.model.torch_thread import TorchThread
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import ScheduledBatch, Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.engine.stores.host_pool import LocalCachectl, in_process_engine_id
from radixmesh.engine.stores.storage import StorageBackend, open_backend
from radixmesh.request_output import RequestStream

log = logging.getLogger("radixmesh.engine")


class _DirectExecutor:
    """The in-process executor: each step straight to the runner on the torch thread."""

    def __init__(self, runner: ModelRunner, torch_thread: TorchThread) -> None:
        self._runner = runner
        self._steps: LaunchAhead[StepResult] = LaunchAhead(torch_thread)

    def submit(self, batch: ScheduledBatch) -> Awaitable[StepResult]:
        return self._steps.submit(lambda: self._runner.launch(batch.batch))


class _Streams:
    """The in-process sink: detokenizes each request's new tokens into its stream and
    applies stop strings (a match finishes the request at once)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self.host_link: HostLink | None = None
        # Keyed by the request object, so a refused duplicate id never takes another's stream.
        self._streams: dict[Req, RequestStream] = {}

    def watch(self, req: Req, stream: RequestStream) -> None:
        self._streams[req] = stream

    def refuse(self, req: Req, error: Exception) -> None:
        stream = self._streams.pop(req, None)
        if stream is not None:
            stream.fail(error)

    async def publish(self, updated: list[Req]) -> None:
        for req in updated:
            stream = self._streams.get(req)
            if stream is None:
                continue
            matched = stream.update()
            if matched is not None and req.finish is None:
                self._scheduler.abort(req.rid, FinishReason(FinishKind.STOP, matched))
                stream.update()
            if req.finish is not None:
                del self._streams[req]
        if self.host_link is not None:
            self.host_link.report(self._scheduler)

    def fail_all(self, error: Exception) -> None:
        for stream in list(self._streams.values()):
            stream.fail(error)
        self._streams.clear()


class Engine:
    """Generate from prompts in-process: `Engine().generate("Hello", {"max_new_tokens": 8})`."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.args = a = EngineArgs(model_path=model_path, **kwargs)
        self._torch = TorchThread("radixmesh-worker")
        self.runner = self._torch.submit(load_runner, a, progress=a.show_progress,
                                         max_running_requests=a.max_running_requests,
                                         lora=a).result()
        # The tokenizer from the snapshot the weights came from (a hub repo resolved once).
        path = self.model_path = self.runner.model_path
        assert path is not None
        self.tokenizer = Tokenizer.from_path(str(path))
        self.model_config = loaded = self.runner.config
        # An embedding model's pooling (encode; None: the model generates), and a reranker's
        # answer tokens and prompt (rerank).
        self.pooling, self.reranker = model_serving(path, self.tokenizer, a)
        self.scheduler = Scheduler(replace(
            SchedulerConfig.from_settings(
                a,
                a.page_size,
                self.runner.pool.num_slots,
                loaded.max_position_embeddings,
                [*loaded.eos_token_ids, *self.tokenizer.eos_token_ids],
                model_fingerprint(path) if a.enable_hierarchical_cache else "",
                loaded.architecture,
                state_snapshots=self.runner.states.num_snapshots,
            ),
            lora_names=frozenset(self.runner.lora.adapters) if self.runner.lora else frozenset(),
            max_loras_per_batch=a.max_loras_per_batch,
            lora_pinned=frozenset(self.runner.lora.pinned) if self.runner.lora else frozenset(),
        ))
        self.context_length = self.scheduler.config.context_length
        self.limits = ModelLimits(self.context_length, loaded.vocab_size, a.grammar_backend,
                                  lora_names=self.scheduler.config.lora_names,
                                  embedding=self.pooling is not None)
        self._rng = random.Random(a.random_seed)
        self._streams = _Streams(self.scheduler)
        self.loop = EngineLoop(
            self.scheduler, _DirectExecutor(self.runner, self._torch), self._streams,
            overlap=not a.disable_overlap_schedule,
        )
        if a.enable_hierarchical_cache:
            geometry = KVGeometry(
                loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, a.dtype, a.page_size
            )
            self._streams.host_link = HostLink(
                LocalCachectl(shm_root(), _storage_opener(a)), self.loop, in_process_engine_id(),
                geometry,
                self.runner.pool.num_slots, a,
            )
        # Guards _closed: once set, nothing new enters the loop (see shutdown / _run).
        self._lock = threading.Lock()
        self._closed = False
        self._events = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="radixmesh-scheduler", daemon=True)
        self._thread.start()
        log.info("engine started: %s", asdict(a))

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
        lora_path: str | list[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Run one prompt (a dict back) or a list of prompts as one batch (a list back);
        `lora_path` names the LoRA adapter each runs with (one for all, or one per prompt;
        None: the base model)."""
        prompts, batched = _as_list(prompt, input_ids)
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        adapters = lora_path if isinstance(lora_path, list) else [lora_path] * len(prompts)
        if len(params) != len(prompts) or len(rids) != len(prompts) or len(adapters) != len(
                prompts):
            raise ValueError("sampling_params, rid and lora_path lists must match the number "
                             "of prompts")
        if stream and batched:
            raise ValueError("stream=True takes a single prompt")
        logprobs = LogprobRequest(return_logprob, top_logprobs_num, logprob_start_len)
        reqs = [
            self._make_req(p, sp, logprobs, cache_salt, priority, r, lora)
            for p, sp, r, lora in zip(prompts, params, rids, adapters, strict=True)
        ]
        streams = [self._submit(req, stream) for req in reqs]
        if stream:
            return streams[0].chunks()
        results = [s.result() for s in streams]
        return results if batched else results[0]

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        dimensions: int | None = None,
        cache_salt: str | None = None,
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Embed one prompt (a dict back: embedding and meta_info) or a list of prompts as
        one batch (a list back), on an embedding model (is_embedding, or a checkpoint that
        declares its pooling); `dimensions` keeps each vector's first values (Matryoshka)
        before it is normalized."""
        pooling = self.pooling
        if pooling is None:
            raise RequestError("this model generates: start it with is_embedding=True to "
                               "embed prompts")
        prompts, batched = _as_list(prompt, input_ids)
        size = pooling.check_dimensions(dimensions, self.model_config.hidden_size)
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        if len(rids) != len(prompts):
            raise ValueError("a rid list must match the number of prompts")
        reqs = [self._make_req(p, {"max_new_tokens": 0}, LogprobRequest(), cache_salt, 0, r,
                               pooling=pooling.kind) for p, r in zip(prompts, rids, strict=True)]
        streams = [self._submit(req, False) for req in reqs]
        results = []
        for stream in streams:
            meta = stream.result()["meta_info"]
            assert stream.req.embedding is not None
            results.append({"embedding": pooling.finish(stream.req.embedding, size),
                            "meta_info": meta})
        return results if batched else results[0]

    def rerank(self, query: str, documents: list[str], top_n: int | None = None,
               return_documents: bool = True, cache_salt: str | None = None
               ) -> list[dict[str, Any]]:
        """Score each document against `query` with a reranker model (rerank_tokens, or a
        checkpoint naming its answer tokens): the results best first, each with its index,
        relevance_score and (return_documents) its text; `top_n` of them."""
        reranker = self.reranker
        if reranker is None:
            raise RequestError("this model is not a reranker: start it with rerank_tokens "
                               "(e.g. yes,no)")
        texts = rerank_inputs(query, documents, top_n)
        reqs = [self._make_req(self.tokenizer.encode(reranker.prompt(query, text)),
                               {"max_new_tokens": 0}, LogprobRequest(), cache_salt, 0, None,
                               pooling="score", score_ids=reranker.score_ids) for text in texts]
        # The first document alone: the prompt they all begin with (instruction and query)
        # is then in the prefix cache for the others.
        first = self._submit(reqs[0], False)
        first.result()
        streams = [first, *(self._submit(req, False) for req in reqs[1:])]
        scores = []
        for stream in streams:
            stream.result()
            assert stream.req.embedding is not None
            scores.append(reranker.score(stream.req.embedding))
        return ranked(scores, texts, top_n, return_documents)

    def abort(self, rid: str) -> None:
        """Stop a request wherever it is; its slots return to the pool."""
        with self._open():
            self.loop.abort(rid)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve the PEFT adapter at `lora_path` as `lora_name` from now on (enable_lora);
        ValueError naming what is wrong with it."""
        self._torch.submit(self.runner.load_lora, lora_name, lora_path).result()
        with self._open():
            done = self.loop.call(lambda s: s.adapters.serve(lora_name))
        done.result()
        self.limits = replace(self.limits, lora_names=self.limits.lora_names | {lora_name})

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving adapter `lora_name`; ValueError while a request uses it."""
        if lora_name not in self.limits.lora_names:
            raise ValueError(f"LoRA adapter {lora_name!r} is not loaded")
        with self._open():
            done = self.loop.call(lambda s: s.adapters.stop(lora_name, s.requests.values()))
        done.result()
        self.limits = replace(self.limits, lora_names=self.limits.lora_names - {lora_name})
        self._torch.submit(self.runner.unload_lora, lora_name).result()

    def flush_cache(self) -> bool:
        """Drop every cached prefix (only while idle)."""
        with self._open():
            done = self.loop.flush()
        return done.result()

    def model_info(self) -> dict[str, Any]:
        """The served model as /get_model_info describes it: its path and name, and its
        architecture and experts."""
        path = self.model_path
        return model_info(str(path), served_name(path), model_shape(self.model_config),
                          self.tokenizer, self.limits.lora_names, self.pooling is None)

    def server_info(self) -> dict[str, Any]:
        """Pool and cache occupancy, read consistently between steps, how the weights are
        held (quantization), and the model's architecture and experts."""
        with self._open():
            done = self.loop.info()
        return {
            **done.result(),
            "quantization": self.runner.quantization,
            **model_shape(self.model_config),
            "lora_adapters": sorted(self.limits.lora_names),
        }

    def shutdown(self) -> None:
        """Stop the scheduler thread and the worker; unfinished requests raise RuntimeError."""
        with self._lock:
            self._closed = True
        self.loop.stop()
        self._thread.join()
        self._torch.shutdown()

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
        lora_path: str | None = None,
        pooling: str = "",
        score_ids: tuple[int, ...] = (),
    ) -> Req:
        """The engine's request, checked as every front door of the mesh checks it."""
        if isinstance(prompt, str):
            ids, names = self.tokenizer.encode(prompt), FieldNames(prompt="text")
        else:
            ids, names = list(prompt), FieldNames()
        request = build_request(self.limits, rid or uuid.uuid4().hex, ids, sampling, logprobs,
                                cache_salt, priority, names, lora_path, pooling, score_ids)
        seed = request.params.seed
        return Req.from_request(request, self._rng.getrandbits(63) if seed is None else seed)

    def _submit(self, req: Req, streaming: bool) -> RequestStream:
        stream = RequestStream(req, self.tokenizer, streaming, self.args.stream_interval)
        with self._open():
            self._streams.watch(req, stream)
            self.loop.add(req)
        return stream

    @contextlib.contextmanager
    def _open(self) -> Iterator[None]:
        """Hold the lock while handing something to the loop, so that once the loop has
        stopped nothing new arrives and what arrived before is failed (see _run)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is not running")
            yield

    # ---- the scheduler thread --------------------------------------------------------------

    async def _serve(self) -> None:
        link = self._streams.host_link
        if link is not None:
            await link.start()
        try:
            await self.loop.run()
        finally:
            if link is not None:
                await link.close()

    def _run(self) -> None:
        error = RuntimeError("the engine was shut down")
        try:
            self._events.run_until_complete(self._serve())
        except Exception as exc:
            log.exception("the scheduler thread failed")
            error = RuntimeError(f"the engine failed: {exc!r}")
        with self._lock:
            self._closed = True
        self.loop.fail_pending(error)
        self._streams.fail_all(error)
        self._events.close()


def _storage_opener(args: EngineArgs) -> Callable[[], Awaitable[StorageBackend]] | None:
    """How the in-process engine connects to its storage tier, if it has one; the nats
    backend's server is the extra config's "url", else one on this host's default port."""
    name = args.hicache_storage_backend
    if name is None:
        return None
    config = args.storage_config
    return lambda: open_backend(name, config, DEFAULT_NATS_URL)


def _as_list(
    prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None
) -> tuple[list[str | list[int]], bool]:
    """The prompts, and whether they came as a batch (a list of them)."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt and input_ids")
    if prompt is not None:
        batched = isinstance(prompt, list)
        items: list[Any] = prompt if batched else [prompt]
        if not items or any(not isinstance(p, str) for p in items):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        return items, batched
    assert input_ids is not None
    batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    return (list(input_ids) if batched else [input_ids]), batched
