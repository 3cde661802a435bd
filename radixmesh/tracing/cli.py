"""`radixmesh trace`: a request's waterfall from a spans file, the traced requests, or a
receiver that writes a spans file for services started by hand."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import datetime

from radixmesh.tracing.receiver import JsonlSink, SpanReceiver
from radixmesh.tracing.waterfall import describe_request, load_spans, summaries

DEFAULT_FILE = "spans.jsonl"


def add_trace_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `trace` on the `radixmesh` command's subparsers."""
    trace = sub.add_parser(
        "trace",
        help="print a request's spans as a waterfall (from `radixmesh up --trace-file`)",
        description=__doc__,
    )
    trace.add_argument("rid", nargs="?", help="request id; none: list the traced requests")
    trace.add_argument("--file", default=DEFAULT_FILE, help="spans file (JSON lines)")
    trace.add_argument(
        "--receive", metavar="HOST:PORT",
        help="run an OTLP/HTTP receiver appending to --file until Ctrl-C (point services at "
             "it with OTEL_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:PORT)",
    )
    trace.add_argument("--last", type=int, default=20, help="requests to list")
    trace.set_defaults(func=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    """The `trace` command."""
    if args.receive:
        return _receive(args.receive, args.file)
    try:
        spans = load_spans(args.file)
    except FileNotFoundError:
        print(f"error: no spans file {args.file!r} (radixmesh up --trace-file {args.file})",
              file=sys.stderr)
        return 2
    if args.rid is None:
        for s in summaries(spans)[-args.last:]:
            when = datetime.fromtimestamp(s.start_ns / 1e9).strftime("%H:%M:%S.%f")[:-3]
            print(f"{when}  {s.rid}  {s.duration_ms:9.2f} ms  {','.join(s.services)}")
        return 0
    text = describe_request(spans, args.rid)
    if text is None:
        print(f"error: no span of request {args.rid!r} in {args.file}", file=sys.stderr)
        return 1
    print(text)
    return 0


def _receive(address: str, path: str) -> int:
    host, _, port = address.rpartition(":")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with SpanReceiver(JsonlSink(path), host or "127.0.0.1", int(port)) as receiver:
        print(f"radixmesh: OTLP/HTTP receiver on {receiver.endpoint}, spans to {path}",
              flush=True)
        stop.wait()
    return 0
