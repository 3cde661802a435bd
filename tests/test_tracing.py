"""Tracing helpers without sockets: settings from OTEL_* variables, W3C context through
every carrier, request tagging, OTLP to records, the waterfall and the HTTP middleware."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, get_current_span
from tracing_helpers import one, traced

from radixmesh.cli import main as cli_main
from radixmesh.tracing import attributes as attr
from radixmesh.tracing.config import exporter_env, instance_env, tracing_settings
from radixmesh.tracing.http_server import tracing_middleware
from radixmesh.tracing.propagation import (
    context_from_headers,
    context_from_metadata,
    context_from_traceparent,
    grpc_metadata,
    headers,
    traceparent,
)
from radixmesh.tracing.provider import init_tracing, shutdown_tracing, tracer
from radixmesh.tracing.receiver import JsonlSink, SpanReceiver
from radixmesh.tracing.records import SpanRecord, records_from_otlp
from radixmesh.tracing.spans import current_span, start_span
from radixmesh.tracing.waterfall import describe_request, load_spans, summaries, waterfall

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


# ---- settings -------------------------------------------------------------------------


def test_tracing_is_off_unless_an_exporter_is_named():
    assert not tracing_settings({}).enabled
    assert not tracing_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}).enabled
    assert not tracing_settings({"OTEL_TRACES_EXPORTER": "none"}).enabled
    on = tracing_settings({"OTEL_TRACES_EXPORTER": "otlp"})
    assert on.enabled and on.exporters == ("otlp",) and on.protocol == "http/protobuf"
    off = tracing_settings({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})
    assert not off.enabled


def test_protocol_and_unknown_names():
    s = tracing_settings({"OTEL_TRACES_EXPORTER": "otlp,console,zipkin",
                          "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert s.exporters == ("otlp", "console") and s.protocol == "grpc"
    assert s.unknown == ("zipkin",)
    per_signal = tracing_settings({"OTEL_TRACES_EXPORTER": "otlp",
                                   "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                   "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    assert per_signal.protocol == "http/protobuf"
    odd = tracing_settings({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "x"})
    assert odd.protocol == "http/protobuf" and odd.unknown == ("x",)


def test_child_environment_for_a_receiver_and_an_instance():
    env = exporter_env("http://127.0.0.1:4318/", {})
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://127.0.0.1:4318/v1/traces"
    assert env["OTEL_BSP_SCHEDULE_DELAY"] == "500"
    assert exporter_env("http://h:1", {"OTEL_BSP_SCHEDULE_DELAY": "50"})[
        "OTEL_BSP_SCHEDULE_DELAY"] == "50"
    assert instance_env("worker-0.0", {}) == {
        "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=worker-0.0"}
    assert instance_env("t0", {"OTEL_RESOURCE_ATTRIBUTES": "a=b"}) == {
        "OTEL_RESOURCE_ATTRIBUTES": "a=b,service.instance.id=t0"}
    assert instance_env("t0", {"OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=me"}) == {}


# ---- propagation ----------------------------------------------------------------------


def test_traceparent_round_trips_through_every_carrier():
    with traced():
        parent = context_from_traceparent(PARENT)
        assert parent is not None
        span = start_span("child", parent)
        assert span is not None
        ctx = span.get_span_context()
        assert ctx.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
        assert span.parent is not None and span.parent.span_id == 0xB7AD6B7169203331
        value = traceparent(span)
        assert value == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
        for carried in (
            context_from_traceparent(value),
            context_from_headers(headers(span)),
            context_from_headers({"TraceParent": value}),
            context_from_metadata(grpc_metadata(span)),
        ):
            assert carried is not None
            remote = get_current_span(carried).get_span_context()
            assert (remote.trace_id, remote.span_id) == (ctx.trace_id, ctx.span_id)
            assert remote.is_remote
        span.end()


@pytest.mark.parametrize("bad", ["", "nonsense", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"])
def test_missing_or_malformed_context_is_none(bad):
    assert context_from_traceparent(bad) is None
    assert context_from_headers({"traceparent": bad}) is None
    assert context_from_headers(None) is None
    assert context_from_headers({"other": "x"}) is None
    assert context_from_metadata([("traceparent", bad)]) is None
    assert context_from_metadata(None) is None


def test_everything_is_none_while_tracing_is_off():
    assert tracer() is None
    assert start_span("x") is None
    assert traceparent(None) == "" and headers(None) is None and grpc_metadata(None) is None
    with current_span("x") as span:
        assert span is None


def test_rid_tags():
    assert attr.rid_attributes([]) == {}
    assert attr.rid_attributes(["a", "a"]) == {attr.RID: "a"}
    assert attr.rid_attributes(["a", "b", "a"]) == {attr.RID: "a", attr.RIDS: ["a", "b"]}
    with traced() as exported:
        span = start_span("http")
        assert span is not None
        attr.tag_rid(span, "a")
        attr.tag_rid(span, "a")
        attr.tag_rid(span, "b")
        span.end()
        got = one(exported.get_finished_spans(), "http").attributes
    assert got[attr.RID] == "a" and list(got[attr.RIDS]) == ["a", "b"]


# ---- records and the waterfall -----------------------------------------------------------


def _three_spans() -> list[SpanRecord]:
    """A front-door span, its child with an event, and a batch span of another trace that
    links to the child; through the real OTLP encoding."""
    with traced("radixmesh-tokenizer") as exported:
        root = start_span("POST /generate", context_from_traceparent(PARENT),
                          {attr.RID: "r1"}, kind=SpanKind.SERVER, start_time=1_000_000_000)
        assert root is not None
        child = start_span("generate", root, {attr.RID: "r1", attr.PROMPT_TOKENS: 7,
                                              "radixmesh.list": [1, 2]},
                           start_time=1_001_000_000)
        assert child is not None
        child.add_event("first token", {"n": 1}, 1_002_000_000)
        child.set_status(Status(StatusCode.ERROR, "boom"))
        child.end(1_004_000_000)
        root.end(1_005_000_000)
        batch = start_span("forward batch", None, {attr.RID: "r2", attr.RIDS: ["r2", "r1"]},
                           links=[Link(child.get_span_context(), {attr.RID: "r1"})],
                           start_time=1_002_000_000)
        assert batch is not None
        batch.end(1_003_000_000)
        request = encode_spans(exported.get_finished_spans())
    return records_from_otlp(request)


def test_records_from_otlp_keep_everything_a_reader_needs():
    records = {r.name: r for r in _three_spans()}
    root, child, batch = records["POST /generate"], records["generate"], records["forward batch"]
    assert root.trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert root.parent_span_id == "b7ad6b7169203331" and root.kind == "server"
    assert child.parent_span_id == root.span_id and child.service == "radixmesh-tokenizer"
    assert child.attributes == {attr.RID: "r1", attr.PROMPT_TOKENS: 7, "radixmesh.list": [1, 2]}
    assert child.events == [{"name": "first token", "time_ns": 1_002_000_000,
                             "attributes": {"n": 1}}]
    assert (child.status, child.status_message) == ("error", "boom")
    assert child.duration_ns == 3_000_000
    assert batch.links == [{"trace_id": child.trace_id, "span_id": child.span_id,
                            "attributes": {attr.RID: "r1"}}]
    assert SpanRecord.from_json(child.to_json()) == child


def test_waterfall_of_a_request(tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in _three_spans()) + '{"torn": ')
    spans = load_spans(path)
    assert len(spans) == 3
    rows = waterfall([s for s in spans if s.name != "forward batch"])
    assert [(r.span.name, r.depth, r.offset_ms, r.event) for r in rows] == [
        ("POST /generate", 0, 0.0, None), ("generate", 1, 1.0, None),
        ("generate", 2, 2.0, {"name": "first token", "time_ns": 1_002_000_000,
                              "attributes": {"n": 1}})]
    text = describe_request(spans, "r1")
    assert text is not None
    lines = text.splitlines()
    assert lines[0].startswith("request r1  trace 0af7651916cd43dd8448eb211c80319c  5.00 ms")
    assert lines[2].split()[:4] == ["tokenizer[i0]", "POST", "/generate", "0.00"]
    assert "  generate" in lines[3] and "prompt_tokens=7" in lines[3] and "error=boom" in lines[3]
    assert lines[4].split() == ["·", "first", "token", "2.00", "n=1"]
    assert "1 more spans of batches that carried it" in text
    # r2 is named only by a batch span, which stands for requests traced elsewhere.
    assert describe_request(spans, "r2") is None
    assert [(s.rid, s.services) for s in summaries(spans)] == [("r1", ("tokenizer",))]


def test_trace_command_prints_the_waterfall(tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in _three_spans()))
    assert cli_main(["trace", "r1", "--file", str(path)]) == 0
    assert "POST /generate" in capsys.readouterr().out
    assert cli_main(["trace", "--file", str(path)]) == 0
    assert " r1 " in capsys.readouterr().out
    assert cli_main(["trace", "missing", "--file", str(path)]) == 1
    assert cli_main(["trace", "r1", "--file", str(tmp_path / "none.jsonl")]) == 2


# ---- the HTTP middleware (loopback) --------------------------------------------------------


def test_http_span_continues_the_clients_traceparent():
    async def handler(request: web.Request) -> web.Response:
        attr.tag_rid(get_current_span(), "r9")
        return web.json_response({}, status=201)

    async def run() -> list[int]:
        app = web.Application(middlewares=[tracing_middleware])
        app.router.add_post("/generate", handler)
        app.router.add_post("/health", handler)
        async with TestClient(TestServer(app)) as client:
            return [(await client.post(path, headers={"traceparent": PARENT})).status
                    for path in ("/generate", "/health")]

    with traced() as exported:
        assert asyncio.run(run()) == [201, 201]
        spans = exported.get_finished_spans()
    assert [s.name for s in spans] == ["POST /generate"]
    span = spans[0]
    assert span.kind is SpanKind.SERVER
    assert span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert span.attributes["http.response.status_code"] == 201
    assert span.attributes[attr.RID] == "r9"


# ---- the receiver and the SDK's OTLP exporter (loopback) --------------------------------------


def test_services_export_to_the_receiver(tmp_path, monkeypatch):
    for name in ("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "spans.jsonl"
    with SpanReceiver(JsonlSink(path)) as receiver:
        for key, value in exporter_env(receiver.endpoint, {}).items():
            monkeypatch.setenv(key, value)
        assert init_tracing("scheduler", "e7")
        try:
            span = start_span("hello", attributes={attr.RID: "r1"})
            assert span is not None
            span.end()
        finally:
            shutdown_tracing()  # exports what is buffered
        spans = receiver.wait_for(lambda got: len(got) >= 1, timeout=10)
    assert tracer() is None
    assert [(s.name, s.service, s.instance, s.attributes) for s in spans] == [
        ("hello", "radixmesh-scheduler", "e7", {attr.RID: "r1"})]
    assert load_spans(path) == spans


def test_receiver_refuses_what_is_not_otlp_protobuf():
    with SpanReceiver() as receiver:
        def post(path: str, body: bytes, kind: str = "application/x-protobuf") -> int:
            request = urllib.request.Request(receiver.endpoint + path, data=body,
                                             headers={"Content-Type": kind})
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert post("/v1/traces", b"") == 200  # an empty export
        assert post("/v1/traces", b"\xff\xff") == 400
        assert post("/v1/traces", b"{}", "application/json") == 415
        assert post("/v1/logs", b"") == 404
        with pytest.raises(TimeoutError):
            receiver.wait_for(lambda got: len(got) > 0, timeout=0.05)
