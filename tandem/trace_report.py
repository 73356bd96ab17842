"""``tandem trace-report``: where the time of a decode round goes, from exported spans.

Input: OTLP JSON as the OpenTelemetry collector's ``file`` exporter writes it (one
``ExportTraceServiceRequest`` per line; ``TANDEM_TRACE_FILE`` writes the same), or a single JSON
document of that message (``resourceSpans`` / ``scopeSpans`` / ``spans``), decoded by the
OpenTelemetry OTLP-JSON codec (``opentelemetry-proto-json``).

Phases (span names shared by the services, see ``tandem.telemetry``): ``request``, ``prefill``
(admitting new requests, between rounds), ``round`` and the round's children ``draft``,
``allocate``, ``verify``, and ``network``: time on the wire
of one RPC = the client span's duration minus its server span's (``rpc.client.<m>`` and the
``rpc.server.<m>`` span it parents, e.g. ``verify`` or ``draft``; floored at 0), or an explicit
``network`` span. A span inside a span of the same name is part of it and not counted again.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PHASES = ("request", "prefill", "round", "draft", "allocate", "verify", "observe", "network")
ROUND_CHILD_PHASES = ("draft", "allocate", "verify", "observe", "network")
RPC_CLIENT, RPC_SERVER = "rpc.client.", "rpc.server."


class TraceFileError(ValueError):
    """The file is missing, unreadable, not OTLP JSON, or holds no spans."""


@dataclass(frozen=True)
class SpanRecord:
    """One finished span. Times in ns since the epoch; ids as lower-case hex."""

    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _attribute_value(any_value):
    """The Python value of an OTLP ``AnyValue`` (scalars; arrays and maps as their JSON dicts)."""
    if any_value is None:
        return None
    for name in ("string_value", "bool_value", "int_value", "double_value"):
        value = getattr(any_value, name)
        if value is not None:
            return value
    return any_value.to_dict()


def _spans_of(document: dict, where: str) -> list[SpanRecord]:
    """Spans of one decoded JSON document (an ``ExportTraceServiceRequest`` / ``TracesData``).

    Raises:
        TraceFileError: not that message, or a span without ids or with end < start.
    """
    from opentelemetry.proto_json.collector.trace.v1.trace_service import ExportTraceServiceRequest

    if not isinstance(document, dict) or not ("resourceSpans" in document or document.keys() & {
            "resourceMetrics", "resourceLogs"}):
        raise TraceFileError(f"{where}: not an OTLP trace export (no resourceSpans)")
    try:
        request = ExportTraceServiceRequest.from_dict(document)
    except (TypeError, ValueError, AttributeError) as exc:
        raise TraceFileError(f"{where}: malformed OTLP JSON: {exc}") from None
    out = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                if not s.trace_id or not s.span_id:
                    raise TraceFileError(f"{where}: span {s.name!r} has no traceId / spanId")
                if s.end_time_unix_nano < s.start_time_unix_nano:
                    raise TraceFileError(f"{where}: span {s.name!r} ends before it starts")
                out.append(SpanRecord(s.trace_id.hex(), s.span_id.hex(), (s.parent_span_id or b"").hex(), s.name or "",
                                      s.start_time_unix_nano, s.end_time_unix_nano,
                                      {kv.key: _attribute_value(kv.value) for kv in s.attributes}))
    return out


def read_spans(path: str | Path) -> list[SpanRecord]:
    """All spans in an OTLP JSON trace file: one JSON document, or one per line (JSON Lines, as
    the collector's ``file`` exporter writes). Metric and log lines of a shared file are skipped.

    Raises:
        TraceFileError: the file cannot be read, a line is not JSON or not an OTLP trace export,
            or the file holds no spans.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFileError(f"{path}: cannot read: {exc}") from None
    try:
        documents = [(json.loads(text), str(path))]
    except json.JSONDecodeError:  # JSON Lines
        documents = []
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                documents.append((json.loads(line), f"{path}:{i}"))
            except json.JSONDecodeError as exc:
                raise TraceFileError(f"{path}:{i}: not JSON: {exc.msg}") from None
    spans = [s for doc, where in documents for s in _spans_of(doc, where)]
    if not spans:
        raise TraceFileError(f"{path}: no spans")
    return spans


@dataclass
class PhaseStats:
    """Durations of one phase in ms; ``share_of_round`` = its time inside rounds / all round
    time (None for ``request``, ``prefill`` and ``round``, and when there are no rounds or no
    such spans). Spans of one phase that overlap in time (concurrent calls) can add up to more
    than their round; only the network share is capped at each round's duration."""

    phase: str
    count: int
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    total_ms: float
    share_of_round: float | None


@dataclass
class TraceReport:
    """Per-phase statistics of a trace file; ``network_share`` = time on the network inside
    rounds / round time, in [0, 1] (None without rounds or without network figures)."""

    num_spans: int
    num_traces: int
    phases: list[PhaseStats]
    network_share: float | None

    def phase(self, name: str) -> PhaseStats:
        return next(p for p in self.phases if p.phase == name)

    def to_dict(self) -> dict:
        return {"num_spans": self.num_spans, "num_traces": self.num_traces, "network_share": self.network_share,
                "phases": {p.phase: {k: v for k, v in asdict(p).items() if k != "phase"} for p in self.phases}}


def build_report(spans: list[SpanRecord]) -> TraceReport:
    """Group ``spans`` by phase (module docstring) and summarise each: count, p50, p99, mean and
    total duration in ms, and the share of round time spent in it."""
    by_id = {(s.trace_id, s.span_id): s for s in spans}

    def parent(s: SpanRecord) -> SpanRecord | None:
        return by_id.get((s.trace_id, s.parent_span_id)) if s.parent_span_id else None

    def ancestors(s: SpanRecord):
        seen = set()
        p = parent(s)
        while p is not None and (p.trace_id, p.span_id) not in seen:  # a cycle in a corrupt file ends the walk
            seen.add((p.trace_id, p.span_id))
            yield p
            p = parent(p)

    def enclosing_round(s: SpanRecord) -> SpanRecord | None:
        return next((a for a in ancestors(s) if a.name == "round"), None)

    # Phase samples: (duration ms, enclosing round or None). Nested same-name spans count once.
    samples: dict[str, list[tuple[float, SpanRecord | None]]] = defaultdict(list)
    for s in spans:
        if s.name in PHASES and not any(a.name == s.name for a in ancestors(s)):
            samples[s.name].append((s.duration_ms, s if s.name == "round" else enclosing_round(s)))
    # Network from RPC pairs: client duration minus the duration of the server span(s) it parents.
    servers_of: dict[tuple[str, str], list[SpanRecord]] = defaultdict(list)
    for s in spans:
        p = parent(s) if s.name.startswith(RPC_SERVER) else None
        if p is not None and p.name == RPC_CLIENT + s.name[len(RPC_SERVER):]:
            servers_of[(p.trace_id, p.span_id)].append(s)
    for key, servers in servers_of.items():
        client = by_id[key]
        if any(a.name == "network" for a in ancestors(client)):
            continue  # already inside an explicit network span
        wire_ms = max(0.0, client.duration_ms - sum(s.duration_ms for s in servers))
        samples["network"].append((wire_ms, enclosing_round(client)))

    rounds = [r for _, r in samples["round"]]
    round_ms = sum(r.duration_ms for r in rounds)
    phases = []
    network_share = None
    for name in PHASES:
        durations = np.array([d for d, _ in samples[name]], dtype=np.float64)
        share = None
        if name in ROUND_CHILD_PHASES and round_ms > 0 and samples[name]:
            per_round: dict[tuple[str, str], float] = defaultdict(float)
            for d, r in samples[name]:
                if r is not None:
                    per_round[(r.trace_id, r.span_id)] += d
            if name == "network":  # concurrent RPCs cannot put more than the round's own time on the wire
                share = sum(min(ms, by_id[k].duration_ms) for k, ms in per_round.items()) / round_ms
                network_share = share
            else:
                share = sum(per_round.values()) / round_ms
        if len(durations):
            p50, p99 = np.percentile(durations, [50, 99])
            stats = PhaseStats(name, len(durations), float(p50), float(p99), float(durations.mean()),
                               float(durations.sum()), share)
        else:
            stats = PhaseStats(name, 0, None, None, None, 0.0, share)
        phases.append(stats)
    return TraceReport(len(spans), len({s.trace_id for s in spans}), phases, network_share)


def render_table(report: TraceReport, title: str):
    """A ``rich`` table of the report (ms; shares in %)."""
    from rich.table import Table

    def ms(x: float | None) -> str:
        return "-" if x is None or math.isnan(x) else f"{x:.3f}"

    table = Table(title=title)
    for col in ("phase", "count", "p50 ms", "p99 ms", "mean ms", "total ms", "% of round time"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for p in report.phases:
        share = "-" if p.share_of_round is None else f"{100 * p.share_of_round:.1f}%"
        table.add_row(p.phase, str(p.count), ms(p.p50_ms), ms(p.p99_ms), ms(p.mean_ms), ms(p.total_ms), share)
    return table
