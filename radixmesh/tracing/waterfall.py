"""A request's trace as a waterfall: its spans as a tree in time order, each with its
service, start offset, duration and key attributes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixmesh.tracing.attributes import RID, RIDS
from radixmesh.tracing.records import SpanRecord

# Attributes a reader of the waterfall already sees, or that repeat on every span.
_HIDDEN = {RID, RIDS, "http.route", "url.path", "rpc.system", "rpc.service", "rpc.method"}
_MAX_VALUE = 40


@dataclass(frozen=True)
class Row:
    """One line of the waterfall: a span, or one of its events (a point in time)."""

    span: SpanRecord
    depth: int
    offset_ms: float  # from the start of the trace's first span
    event: dict[str, Any] | None = None


@dataclass(frozen=True)
class RequestSummary:
    """One traced request: where its trace starts and how long it took."""

    rid: str
    trace_id: str
    start_ns: int
    duration_ms: float
    services: tuple[str, ...]


def load_spans(path: str | Path) -> list[SpanRecord]:
    """Every record of a spans file; lines that do not parse (a torn last line) are skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(SpanRecord.from_json(line))
            except (ValueError, TypeError):
                continue
    return out


def rids_of(span: SpanRecord) -> list[str]:
    """The requests a span serves."""
    rids = span.attributes.get(RIDS)
    if isinstance(rids, list):
        return [str(r) for r in rids]
    rid = span.attributes.get(RID)
    return [str(rid)] if rid is not None else []


def request_spans(spans: Iterable[SpanRecord], rid: str) -> list[SpanRecord]:
    """Every span of the traces in which some span serves `rid` (a batch span, which has
    links, names requests whose own traces are elsewhere)."""
    spans = list(spans)
    traces = {s.trace_id for s in spans if not s.links and rid in rids_of(s)}
    return [s for s in spans if s.trace_id in traces]


def linked_batches(spans: Iterable[SpanRecord], members: list[SpanRecord]) -> list[SpanRecord]:
    """Spans of other traces that link to one of `members` (forward batches another
    request's trace holds)."""
    ids = {s.span_id for s in members}
    traces = {s.trace_id for s in members}
    return [
        s for s in spans
        if s.trace_id not in traces and any(ln["span_id"] in ids for ln in s.links)
    ]


def waterfall(spans: list[SpanRecord]) -> list[Row]:
    """Spans as a tree (children under their parent, by start time), offsets from the start."""
    if not spans:
        return []
    known = {s.span_id for s in spans}
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        children[s.parent_span_id if s.parent_span_id in known else ""].append(s)
    origin = min(s.start_ns for s in spans)
    rows: list[Row] = []

    def visit(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s.start_ns, s.end_ns)):
            rows.append(Row(s, depth, (s.start_ns - origin) / 1e6))
            rows.extend(Row(s, depth + 1, (e["time_ns"] - origin) / 1e6, e) for e in s.events)
            visit(s.span_id, depth + 1)

    visit("", 0)
    return rows


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 3] + "..."


def _attributes(attributes: dict[str, Any]) -> list[str]:
    return [f"{k.removeprefix('radixmesh.')}={_value(v)}"
            for k, v in attributes.items() if k not in _HIDDEN]


def key_attributes(span: SpanRecord) -> str:
    """The attributes worth a glance, without their radixmesh. prefix."""
    parts = _attributes(span.attributes)
    if span.status == "error":
        parts.append(f"error={_value(span.status_message or 'yes')}")
    return " ".join(parts)


def _service(span: SpanRecord) -> str:
    name = span.service.removeprefix("radixmesh-")
    return f"{name}[{span.instance}]" if span.instance else name


def format_waterfall(rows: list[Row]) -> str:
    """The rows as an aligned table."""
    header = ("service", "span", "start ms", "dur ms", "attributes")
    lines = [
        (_service(r.span), "  " * r.depth + r.span.name, f"{r.offset_ms:.2f}",
         f"{r.span.duration_ns / 1e6:.2f}", key_attributes(r.span))
        if r.event is None else
        ("", "  " * r.depth + "· " + r.event["name"], f"{r.offset_ms:.2f}", "",
         " ".join(_attributes(r.event["attributes"])))
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(4)]
    out = []
    for cells in [header, *lines]:
        left = f"{cells[0]:<{widths[0]}}  {cells[1]:<{widths[1]}}"
        right = f"{cells[2]:>{widths[2]}}  {cells[3]:>{widths[3]}}"
        out.append(f"{left}  {right}  {cells[4]}".rstrip())
    return "\n".join(out)


def describe_request(spans: list[SpanRecord], rid: str) -> str | None:
    """The waterfall of one request's trace(s) as text; None when no span names it."""
    members = request_spans(spans, rid)
    if not members:
        return None
    parts = []
    for trace_id in dict.fromkeys(s.trace_id for s in sorted(members, key=lambda s: s.start_ns)):
        rows = waterfall([s for s in members if s.trace_id == trace_id])
        total = max(r.offset_ms + r.span.duration_ns / 1e6 for r in rows if r.event is None)
        parts.append(f"request {rid}  trace {trace_id}  {total:.2f} ms\n{format_waterfall(rows)}")
    others = linked_batches(spans, members)
    if others:
        busy = sum(s.duration_ns for s in others) / 1e6
        parts.append(f"{len(others)} more spans of batches that carried it live in other "
                     f"requests' traces ({busy:.2f} ms in all)")
    return "\n\n".join(parts)


def summaries(spans: Iterable[SpanRecord]) -> list[RequestSummary]:
    """Every request the spans name, oldest first."""
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    out = []
    for trace_id, members in by_trace.items():
        start = min(s.start_ns for s in members)
        end = max(s.end_ns for s in members)
        services = tuple(sorted({s.service.removeprefix("radixmesh-") for s in members}))
        # A batch span (it has links) also names requests whose traces are elsewhere.
        rids = dict.fromkeys(r for s in members if not s.links for r in rids_of(s))
        out.extend(RequestSummary(r, trace_id, start, (end - start) / 1e6, services)
                   for r in rids)
    return sorted(out, key=lambda r: r.start_ns)
