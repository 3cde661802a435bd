"""One request through the real mesh (real processes, the real SmolLM2) leaves one trace
across tokenizer, scheduler, worker and detokenizer, which the launcher's receiver writes
to its spans file and `radixmesh trace` reads back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest
from process_helpers import running_mesh

from radixmesh.cli import main as cli_main
from radixmesh.launcher import Mesh
from radixmesh.proto import generate_pb2 as gpb
from radixmesh.proto import generate_pb2_grpc as ggrpc
from radixmesh.tracing import attributes as attr
from radixmesh.tracing.records import SpanRecord
from radixmesh.tracing.waterfall import load_spans, rids_of

PROMPT = "The three primary colors are red, yellow and"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVICES = {"radixmesh-tokenizer", "radixmesh-scheduler", "radixmesh-worker",
            "radixmesh-detokenizer"}
REQUEST_SPANS = {"POST /generate", "tokenize", "generate", "route", "engine request",
                 "queue wait", "prefix match", "prefill chunk", "decode", "forward batch",
                 "forward", "detokenize", "stream out"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    folder = tmp_path_factory.mktemp("traced-mesh")
    with running_mesh(
        folder / "logs", dtype="float32", max_total_tokens=4096,
        trace_file=str(folder / "spans.jsonl"), extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    ) as m:
        yield m


def generate(mesh: Mesh, rid: str, text: str, max_new_tokens: int, **headers: str) -> dict:
    body = {"text": text, "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                "ignore_eos": True}}
    response = httpx.post(mesh.url + "/generate", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def trace_of(rid: str, need: Callable[[list[SpanRecord]], bool]) -> Callable:
    """A wait_for predicate: the spans of `rid`'s own trace satisfy `need`."""

    def done(spans: list[SpanRecord]) -> bool:
        traces = {s.trace_id for s in spans if not s.links and rid in rids_of(s)}
        return need([s for s in spans if s.trace_id in traces])

    return done


def names(spans: list[SpanRecord]) -> set[str]:
    return {s.name for s in spans}


def test_one_request_is_one_trace_across_every_service(mesh, capsys):
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    out = generate(mesh, "trace-1", PROMPT, 4, traceparent=traceparent)
    assert out["meta_info"]["completion_tokens"] == 4
    assert mesh.spans is not None
    def complete(got: list[SpanRecord]) -> bool:
        # Each service exports on its own schedule: wait for the worker's last step too.
        forwards = sum(s.name == "forward" for s in got)
        return (names(got) >= REQUEST_SPANS and sum(s.name == "detokenize" for s in got) == 2
                and forwards == sum(s.name == "forward batch" for s in got))

    spans = mesh.spans.wait_for(trace_of("trace-1", complete), timeout=30)
    mine = [s for s in spans if s.trace_id == CLIENT_TRACE]
    assert {s.service for s in mine} == SERVICES
    assert {s.instance for s in mine} == {"tokenizer-0", "scheduler-0", "worker-0.0",
                                          "detokenizer-0"}
    for s in mine:
        assert "trace-1" in rids_of(s), s

    by_id = {s.span_id: s for s in mine}

    def only(name: str) -> SpanRecord:
        found = [s for s in mine if s.name == name]
        assert len(found) == 1, (name, found)
        return found[0]

    def parent(span: SpanRecord) -> str:
        return by_id[span.parent_span_id].name

    http = only("POST /generate")
    assert http.parent_span_id == CLIENT_SPAN and http.kind == "server"
    assert http.attributes["http.response.status_code"] == 200
    assert parent(only("tokenize")) == "POST /generate"
    assert parent(only("generate")) == "POST /generate"
    for name in ("route", "engine request", "stream out"):
        assert parent(only(name)) == "generate", name
    for name in ("queue wait", "prefix match", "decode"):
        assert parent(only(name)) == "engine request", name
    assert only("route").attributes[attr.ENGINE_ID] == "e0"
    assert only("prefix match").attributes[attr.PREFIX_TIER] == "device"
    assert only("decode").attributes[attr.DECODE_STEPS] == 3
    assert only("engine request").attributes[attr.COMPLETION_TOKENS] == 4
    prompt_tokens = out["meta_info"]["prompt_tokens"]
    chunks = [s for s in mine if s.name == "prefill chunk"]
    assert sum(c.attributes[attr.CHUNK_TOKENS] for c in chunks) == prompt_tokens
    assert {parent(c) for c in chunks} == {"engine request"}
    assert {parent(s) for s in mine if s.name == "detokenize"} == {"generate"}

    # Every step is a forward batch linked to the request, and the worker's span is its child.
    root = only("engine request")
    batches = [s for s in mine if s.name == "forward batch"]
    assert len(batches) == len(chunks) + 3
    for batch in batches:
        assert parent(batch) in ("prefill chunk", "decode")
        assert [(ln["trace_id"], ln["span_id"]) for ln in batch.links] == [
            (root.trace_id, root.span_id)]
    forwards = [s for s in mine if s.name == "forward"]
    assert sorted(parent(f) for f in forwards) == ["forward batch"] * len(batches)
    assert {by_id[f.parent_span_id].attributes[attr.STEP] for f in forwards} == {
        f.attributes[attr.STEP] for f in forwards}
    assert all(f.attributes[attr.FORWARD_MS] > 0 for f in forwards)

    # The same trace, from the spans file, as `radixmesh trace` prints it.
    assert {s.span_id for s in mine} <= {s.span_id for s in load_spans(mesh.args.trace_file)}
    assert cli_main(["trace", "trace-1", "--file", str(mesh.args.trace_file)]) == 0
    printed = capsys.readouterr().out
    assert f"trace {CLIENT_TRACE}" in printed
    for service in ("tokenizer[tokenizer-0]", "scheduler[scheduler-0]", "worker[worker-0.0]",
                    "detokenizer[detokenizer-0]"):
        assert service in printed


def test_second_request_shows_its_prefix_hit(mesh):
    first = generate(mesh, "prefix-1", PROMPT + " blue.", 2)
    second = generate(mesh, "prefix-2", PROMPT + " blue. And the sky is", 2)
    hit = second["meta_info"]["cached_tokens"]
    assert hit >= first["meta_info"]["prompt_tokens"] - 1
    assert mesh.spans is not None
    spans = mesh.spans.wait_for(
        trace_of("prefix-2", lambda got: {"prefix match", "engine request"} <= names(got)),
        timeout=30)
    (match,) = [s for s in spans if s.name == "prefix match" and rids_of(s) == ["prefix-2"]]
    assert match.attributes[attr.PREFIX_MATCHED] == hit
    (root,) = [s for s in spans if s.name == "engine request" and rids_of(s) == ["prefix-2"]]
    assert root.attributes[attr.CACHED_TOKENS] == hit


def test_grpc_call_and_client_hang_up(mesh):
    async def run() -> None:
        metadata = (("traceparent", f"00-{'5' * 32}-{'6' * 16}-01"),)
        async with grpc.aio.insecure_channel(mesh.grpc_addrs[0]) as channel:
            stub = ggrpc.GenerateStub(channel)
            params = gpb.ClientSamplingParams(max_new_tokens=2000, ignore_eos=True)
            call = stub.Generate(gpb.GenerateRequest(text="Go on", rid="hang-up",
                                                     sampling_params=params), metadata=metadata)
            async for _ in call:
                call.cancel()
                break

    asyncio.run(run())
    assert mesh.spans is not None
    spans = mesh.spans.wait_for(trace_of("hang-up", lambda got: sum(
        s.name == "abort" for s in got) == 2 and "engine request" in names(got)), timeout=30)
    spans = [s for s in spans if s.trace_id == "5" * 32]
    by_id = {s.span_id: s for s in spans}
    call = next(s for s in spans if s.name == "radixmesh.v1.Generate/Generate")
    assert call.parent_span_id == "6" * 16
    tokenizer_abort, engine_abort = sorted(
        (s for s in spans if s.name == "abort"), key=lambda s: s.start_ns)
    assert by_id[tokenizer_abort.parent_span_id].name == "generate"
    assert engine_abort.parent_span_id == tokenizer_abort.span_id
    assert engine_abort.attributes[attr.ABORT_FOUND] is True
    root = next(s for s in spans if s.name == "engine request")
    assert root.attributes[attr.FINISH] == "abort"
