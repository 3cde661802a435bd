"""A small OTLP/HTTP trace receiver (protobuf, optionally gzipped) on a background thread:
every span it gets goes to a sink, e.g. a spans file."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from radixmesh.tracing.records import SpanRecord, records_from_otlp

TRACES_PATH = "/v1/traces"
Sink = Callable[[list[SpanRecord]], None]


class JsonlSink:
    """Appends records to a file, one JSON object per line, flushed per export."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        self._lock = threading.Lock()

    def __call__(self, records: list[SpanRecord]) -> None:
        with self._lock:
            if self._file.closed:  # an export that raced the receiver's stop
                return
            self._file.writelines(r.to_json() + "\n" for r in records)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class SpanReceiver:
    """`start()` binds a loopback port (0: any free one); `endpoint` is the OTLP base URL
    to give exporters; every span received is also kept in `spans`."""

    def __init__(self, sink: Sink | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sink = sink
        self.spans: list[SpanRecord] = []
        self._changed = threading.Condition()
        self._server = ThreadingHTTPServer((host, port), _handler_for(self._received))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SpanReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if isinstance(self.sink, JsonlSink):
            self.sink.close()

    def wait_for(
        self, done: Callable[[list[SpanRecord]], bool], timeout: float
    ) -> list[SpanRecord]:
        """Block until `done(spans so far)` holds; raise TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"spans incomplete after {timeout} s ({len(self.spans)})")
                self._changed.wait(left)
            return list(self.spans)

    def _received(self, records: list[SpanRecord]) -> None:
        if self.sink is not None:
            self.sink(records)
        with self._changed:
            self.spans.extend(records)
            self._changed.notify_all()

    def __enter__(self) -> SpanReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler_for(received: Sink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path.split("?")[0] != TRACES_PATH:
                self._answer(404, b"")
                return
            if "protobuf" not in (self.headers.get("Content-Type") or ""):
                self._answer(415, b"")
                return
            try:
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
            except (DecodeError, OSError, EOFError):
                self._answer(400, b"")
                return
            received(records_from_otlp(request))
            self._answer(200, ExportTraceServiceResponse().SerializeToString())

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            """Quiet: exporters post every half second."""

    return Handler
