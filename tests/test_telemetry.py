"""Observability: Prometheus metrics, trace-context propagation, tracing set-up from the
environment, and ``tandem trace-report`` on traces of real work (the tiny engine, a real gRPC hop).

Spans in this process come from local ``TracerProvider``s (the global one can be set only once per
process); ``init_tracing`` itself runs in short subprocesses, with the environment it reads. The
tests of real work record the spans that the engine and the services emit themselves
(``product_spans``: the product's tracer, ``tandem.telemetry._tracer``, swapped for a local one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from opentelemetry import trace
from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from tandem import telemetry
from tandem.cli import main
from tandem.telemetry import Metrics, extract_context, inject_metadata
from tandem.trace_report import build_report, read_spans

ROOT = Path(__file__).resolve().parent.parent


def file_tracer(path: Path) -> tuple[TracerProvider, trace.Tracer]:
    """A provider (not the global one) writing every span to ``path`` as OTLP JSON lines. It samples
    every span, even under an unsampled parent: an in-process CLI test may have installed the
    global provider (`init_tracing` with no exporter samples everything out), whose spans would
    otherwise make these children unsampled too."""
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    return provider, provider.get_tracer("tandem-tests")


@pytest.fixture()
def product_spans(tmp_path, monkeypatch):
    """Records every span that Tandem's own code opens (``tandem.telemetry.span``) in this test, in
    memory (``finished()``: the SDK's ``ReadableSpan``s, with kinds and parent links) and as the
    OTLP JSON file that ``tandem trace-report`` reads (``path``)."""
    path = tmp_path / "product.jsonl"
    memory = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer(telemetry.TRACER_NAME))

    class Recorded:
        def finished(self) -> list:
            provider.force_flush()
            return list(memory.get_finished_spans())

    rec = Recorded()
    rec.path = path
    yield rec
    provider.shutdown()


def by_name(spans, name: str) -> list:
    return [s for s in spans if s.name == name]


def parent_of(span, spans):
    """The recorded span that is ``span``'s parent (None for a root or a parent not recorded)."""
    if span.parent is None:
        return None
    return next((p for p in spans if p.context.span_id == span.parent.span_id
                 and p.context.trace_id == span.context.trace_id), None)


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` parsed back from the exposition text."""
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


# ----------------------------------------------------------------------------- Prometheus


def test_metrics_exposition_names_labels_values():
    m, other = Metrics("smol"), Metrics()  # separate registries: both can exist in one process
    rounds = [(8, 5, [3, 2], 7, 3), (4, 1, [1], 3, 2), (6, 0, [], 2, 2)]
    for draft, accepted, per_pos, emitted, drafts in rounds:
        m.observe_round(draft, accepted, per_pos, emitted, drafts)
    m.observe_round(0, 0, [], 1, 0, draft_width=3, acceptance_threshold=0.4)  # a policy's plan
    m.observe_round(0, 0, [], 1, 0)  # a round without a plan leaves the gauges
    m.observe_request(0.05, 0.01, 1.2, prompt_tokens=11, completion_tokens=40)
    m.observe_request(0.3, None, 0.3, prompt_tokens=7, completion_tokens=1, finished_reason="length")
    m.set_running(3)
    m.set_waiting(2)
    m.set_store_up(False)
    got = samples(m)
    assert got[("tandem_spec_decode_num_draft_tokens_total", ())] == sum(r[0] for r in rounds)
    assert got[("tandem_spec_decode_num_accepted_tokens_total", ())] == sum(r[1] for r in rounds)
    assert got[("tandem_spec_decode_num_emitted_tokens_total", ())] == sum(r[3] for r in rounds) + 2
    assert got[("tandem_draft_width", ())] == 3 and got[("tandem_acceptance_threshold", ())] == 0.4
    per_pos = {}
    for r in rounds:
        for i, n in enumerate(r[2]):
            per_pos[str(i)] = per_pos.get(str(i), 0) + n
    for pos, n in per_pos.items():
        assert got[("tandem_spec_decode_num_accepted_tokens_per_pos_total", (("position", pos),))] == n
        assert got[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                    (("model_name", "smol"), ("position", pos)))] == n
    vllm = (("model_name", "smol"),)  # the same counts under vLLM's names, drafts besides
    assert got[("vllm:spec_decode_num_drafts_total", vllm)] == sum(r[4] for r in rounds)
    assert got[("vllm:spec_decode_num_draft_tokens_total", vllm)] == sum(r[0] for r in rounds)
    assert got[("vllm:spec_decode_num_accepted_tokens_total", vllm)] == sum(r[1] for r in rounds)
    assert got[("tandem_request_success_total", (("finished_reason", "stop"),))] == 1
    assert got[("tandem_request_success_total", (("finished_reason", "length"),))] == 1
    assert got[("tandem_prompt_tokens_total", ())] == 11 + 7
    assert got[("tandem_generation_tokens_total", ())] == 40 + 1
    assert got[("tandem_time_to_first_token_seconds_count", ())] == 2
    assert got[("tandem_time_to_first_token_seconds_sum", ())] == pytest.approx(0.35)
    assert got[("tandem_time_per_output_token_seconds_count", ())] == 1  # a 1-token request has no TPOT
    assert got[("tandem_e2e_request_latency_seconds_sum", ())] == pytest.approx(1.5)
    # the 0.05 s TTFT falls in every bucket from 0.06 s up, not in the 0.04 s one
    assert got[("tandem_time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 0
    assert got[("tandem_time_to_first_token_seconds_bucket", (("le", "0.06"),))] == 1
    assert got[("tandem_num_requests_running", ())] == 3
    assert got[("tandem_num_requests_waiting", ())] == 2
    assert got[("tandem_state_store_up", ())] == 0
    m.set_store_up(True)
    assert samples(m)[("tandem_state_store_up", ())] == 1
    assert samples(other)[("tandem_spec_decode_num_draft_tokens_total", ())] == 0


@pytest.mark.parametrize("args,match", [
    ((4, 5, [1, 1, 1, 1, 1]), "accepted tokens > 4 draft"),
    ((4, 2, [1]), "sums to 1, not 2"),
    ((-1, 0, []), ">= 0"),
    ((2, 0, [], 0, 3), "3 drafts > 2 draft tokens"),
])
def test_observe_round_rejects_inconsistent_counts(args, match):
    m = Metrics()
    with pytest.raises(ValueError, match=match):
        m.observe_round(*args)
    assert samples(m)[("tandem_spec_decode_num_draft_tokens_total", ())] == 0  # nothing half-counted


def test_router_budget_series_appear_with_a_routers_first_decision():
    """A replica's metrics (which make no budget decision) export no ``tandem_router_*`` series,
    not even their HELP lines; a router's appear with its first decision and each replica's
    series goes away when its budget or θ is cleared."""
    m = Metrics("smol")
    assert "tandem_router_" not in m.exposition()[0].decode()
    m.clear_replica_budget("a:1")  # nothing to clear yet: fine
    m.clear_replica_threshold("a:1")
    m.set_replica_budget("a:1", 3, 12)
    m.set_replica_threshold("a:1", 0.4)
    got = samples(m)
    assert got[("tandem_router_draft_width", (("replica", "a:1"),))] == 3
    assert got[("tandem_router_draft_budget_tokens", (("replica", "a:1"),))] == 12
    assert got[("tandem_router_acceptance_threshold", (("replica", "a:1"),))] == pytest.approx(0.4)
    m.clear_replica_budget("a:1")
    m.clear_replica_threshold("a:1")
    assert 'replica="a:1"' not in m.exposition()[0].decode()


# ----------------------------------------------------------------------------- propagation


def test_inject_extract_round_trips_the_trace(tmp_path):
    provider, tracer = file_tracer(tmp_path / "t.jsonl")
    assert inject_metadata([("x-request-id", "r1")]) == [("x-request-id", "r1")]  # no span: nothing to send
    with tracer.start_as_current_span("rpc.client.verify") as client:
        md = inject_metadata([("x-request-id", "r1"), ("traceparent", "stale")])
    assert ("x-request-id", "r1") in md and all(k == k.lower() for k, _ in md)
    assert [v for k, v in md if k == "traceparent"] != ["stale"] and sum(k == "traceparent" for k, _ in md) == 1
    ctx = extract_context(md + [("x-bin", b"\x00")])  # binary metadata is ignored
    with tracer.start_as_current_span("rpc.server.verify", context=ctx) as server:
        pass
    sent, got = client.get_span_context(), server.get_span_context()
    assert got.trace_id == sent.trace_id and server.parent.span_id == sent.span_id
    # no or garbage metadata: no remote parent
    for bad in (None, [], [("traceparent", "00-zz-yy-01")]):
        assert not trace.get_current_span(extract_context(bad)).get_span_context().is_valid
    provider.shutdown()


def test_network_time_from_a_real_grpc_hop(product_spans, tiny_engine):
    """The engine over a real drafter service on loopback (a verifier replica's ``RemoteDrafter``
    -> gRPC -> ``tandem.v1.Drafter``): the client's ``rpc.client.draft`` spans (inside the round's
    ``draft`` phase) parent the server's ``rpc.server.draft`` spans through the trace context each
    stream message carries, and trace-report derives one network sample per call, no larger than
    the call."""
    pytest.importorskip("grpc")
    from services.common import BackgroundServer
    from services.drafter.client import RemoteDrafter
    from services.drafter.server import serve as serve_drafter
    from tandem.drafters import NgramDrafter
    from tandem.engine import Engine
    from tandem.sampling import SamplingParams
    from tandem.target import LocalTarget

    local = LocalTarget(tiny_engine.checkpoint, tiny_engine.runner_config)
    server = BackgroundServer(lambda ready, stop: serve_drafter(NgramDrafter(), 8, 0, ready=ready, stop=stop))
    try:
        remote = RemoteDrafter(server.address, local.info.vocab_size)
        engine = Engine(tokenizer=tiny_engine.tokenizer, drafter=remote, num_draft_tokens=3, target=local)
        engine.overlap_drafting = False  # every call inside its round's draft phase
        got = engine.generate(["a b c a b c a b", "one two one two one", "x y z"], SamplingParams(max_tokens=10))
        remote.close()
    finally:
        server.stop()
    assert all(c.completion_tokens for c in got)
    spans = product_spans.finished()
    clients, servers = by_name(spans, "rpc.client.draft"), by_name(spans, "rpc.server.draft")
    assert len(clients) == len(servers) >= 2  # at least two draft rounds, each one RPC
    assert {s.kind for s in clients} == {trace.SpanKind.CLIENT} and {s.kind for s in servers} == {trace.SpanKind.SERVER}
    client_of = {}
    for srv in servers:  # each server span is the child of exactly one client span, in its trace
        cl = parent_of(srv, spans)
        assert cl is not None and cl.name == "rpc.client.draft", srv.name
        assert cl.context.trace_id == srv.context.trace_id and cl.context.span_id not in client_of
        client_of[cl.context.span_id] = cl
        assert cl.attributes["address"] == server.address
        assert cl.start_time <= srv.start_time <= srv.end_time <= cl.end_time  # the server's work inside the call
    for cl in clients:  # the engine's phase around each call: a round's draft
        phase = parent_of(cl, spans)
        assert phase is not None and phase.name == "draft", phase
        assert parent_of(phase, spans).name == "round"

    report = build_report(read_spans(product_spans.path))
    network = report.phase("network")
    assert network.count == len(clients) and report.phase("round").count == len(by_name(spans, "round"))
    durations = [(s.end_time - s.start_time) / 1e6 for s in clients]
    assert 0 <= network.p50_ms <= network.p99_ms <= max(durations)
    assert network.total_ms <= sum(durations)
    assert 0 < report.network_share <= report.phase("draft").share_of_round <= 1


# ----------------------------------------------------------------------------- a real engine run


def test_trace_report_on_a_real_engine_run(product_spans, tiny_engine):
    """The engine's own spans: each decode round a ``round``, the drafter's proposals in its
    ``draft`` child and the target forward that verifies them in its ``verify`` child, admission
    in ``prefill``; the report must count exactly what ran."""
    from tandem.drafters import NgramDrafter
    from tandem.engine import Engine
    from tandem.sampling import SamplingParams

    engine = Engine(tiny_engine.checkpoint, tiny_engine.runner_config, tokenizer=tiny_engine.tokenizer,
                    drafter=NgramDrafter(), num_draft_tokens=3)
    # the host-drafted path, where drafting is a host call of its own in a draft span (chained
    # n-gram rounds draft inside the verify step on the device: no separate draft call to count)
    engine.target.chains_rounds = False
    calls = {"draft": 0, "verify": 0, "prefill": 0, "draft_tokens": 0}

    def counted(name, fn):  # counts what really ran (no spans of its own)
        def wrapper(*args, **kwargs):
            calls[name] += 1
            out = fn(*args, **kwargs)
            if name == "draft":
                calls["draft_tokens"] += sum(len(p.tokens) for p in out)
            return out
        return wrapper

    engine.drafter.propose = counted("draft", engine.drafter.propose)
    engine.target.launch_verify = counted("verify", engine.target.launch_verify)
    engine.target.launch_prefill = counted("prefill", engine.target.launch_prefill)  # what admission calls
    for i, prompt in enumerate(["a b c a b c a b", "one two one two one", "x y z"]):
        engine.add_request(prompt, SamplingParams(max_tokens=12), request_id=f"r{i}")
    steps, wall_ms = 0, 0.0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        wall_ms += (time.perf_counter() - t0) * 1e3
        steps += 1

    spans = product_spans.finished()
    rounds, drafts, verifies = by_name(spans, "round"), by_name(spans, "draft"), by_name(spans, "verify")
    prefills = by_name(spans, "prefill")
    assert steps > 1 and calls["draft"] > 0 and calls["draft_tokens"] > 0
    assert (len(rounds), len(drafts), len(verifies), len(prefills)) == \
        (calls["verify"], calls["draft"], calls["verify"], calls["prefill"])
    assert {s.name for s in spans} == {"prefill", "round", "draft", "verify"}  # nothing else, nothing unnamed
    for child in drafts + verifies:  # each inside a round, one of each per round, describing it
        rnd = parent_of(child, spans)
        assert rnd is not None and rnd.name == "round"
        assert child.attributes["batch_size"] == rnd.attributes["batch_size"]
    assert sorted(parent_of(c, spans).context.span_id for c in drafts) == \
        sorted(parent_of(c, spans).context.span_id for c in verifies) == sorted(r.context.span_id for r in rounds)
    assert all(d.attributes["drafter"] == "ngram" for d in drafts)
    assert sum(v.attributes["draft_tokens"] for v in verifies) == calls["draft_tokens"]
    assert sum(p.attributes["batch_size"] for p in prefills) == 3 and all(p.parent is None for p in prefills + rounds)

    res = CliRunner().invoke(main, ["trace-report", str(product_spans.path), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    phases = report["phases"]
    assert phases["round"]["count"] == len(rounds) and phases["prefill"]["count"] == len(prefills)
    assert phases["verify"]["count"] == len(verifies) and phases["draft"]["count"] == len(drafts)
    assert report["num_spans"] == len(spans)
    assert phases["network"]["count"] == 0 and report["network_share"] is None  # in-process: no wire
    for name in ("round", "draft", "verify"):
        p = phases[name]
        assert 0 < p["p50_ms"] <= p["p99_ms"] and p["mean_ms"] * p["count"] == pytest.approx(p["total_ms"])
    # span clocks agree with the wall time measured around the same steps: the rounds and prefills
    # lie inside the measured steps, and cover most of them (a unit error would be off by 1000x;
    # the bookkeeping between spans grows on a loaded machine, so no tighter lower bound)
    covered = phases["round"]["total_ms"] + phases["prefill"]["total_ms"]
    assert 0.5 * wall_ms <= covered <= wall_ms + 1.0
    shares = [phases[n]["share_of_round"] for n in ("draft", "verify")]
    assert all(0 < s < 1 for s in shares) and sum(shares) <= 1
    table = CliRunner().invoke(main, ["trace-report", str(product_spans.path)])
    assert table.exit_code == 0 and "verify" in table.stdout and "no RPC or network spans" in table.stdout


def test_single_document_and_json_lines_give_the_same_report(tmp_path):
    path = tmp_path / "lines.jsonl"
    provider, tracer = file_tracer(path)
    for _ in range(3):
        with tracer.start_as_current_span("request", attributes={"request_id": "r"}):
            with tracer.start_as_current_span("round"):
                with tracer.start_as_current_span("allocate"):
                    sum(range(1000))
                with tracer.start_as_current_span("network"):
                    sum(range(1000))
    provider.shutdown()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    doc = tmp_path / "one.json"
    doc.write_text(json.dumps({"resourceSpans": [rs for x in lines for rs in x["resourceSpans"]]}, indent=2))
    a, b = build_report(read_spans(path)), build_report(read_spans(doc))
    assert a.to_dict() == b.to_dict()
    # the same spans split over two files (one per service, say) give the same report too
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    text = path.read_text().splitlines(keepends=True)
    first.write_text("".join(text[: len(text) // 2]))
    second.write_text("".join(text[len(text) // 2:]))
    res = CliRunner().invoke(main, ["trace-report", str(first), str(second), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout) == a.to_dict()
    assert a.phase("request").count == a.phase("round").count == a.phase("allocate").count == 3
    assert a.phase("network").count == 3 and 0 < a.network_share < 1


# ----------------------------------------------------------------------------- CLI errors


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("", "no spans"),
    ('{"resourceSpans": []\n{"x": 1}\n', ":1: not JSON"),
    ('{"hello": "world"}', "not an OTLP trace export"),
    ('{"resourceSpans": {"scopeSpans": 1}}', "malformed OTLP JSON"),
    ('{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"zz","spanId":"01","name":"round"}]}]}]}',
     "malformed OTLP JSON"),
    ('{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"round"}]}]}]}', "no traceId"),
])
def test_bad_trace_file_is_a_one_line_error(tmp_path, content, message):
    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_text(content)
    res = CliRunner().invoke(main, ["trace-report", str(path)])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert res.exception is None or isinstance(res.exception, SystemExit)


# ----------------------------------------------------------------------------- init_tracing from the environment

SCRIPT = """
from tandem import telemetry as t
t.init_tracing("router")
t.init_tracing("ignored")  # idempotent
with t.span("request", request_id="r1"):
    with t.span("round", batch_size=2, tau=0.5, greedy=True):
        with t.span("rpc.client.verify"):
            md = t.inject_metadata()
            with t.span("rpc.server.verify", parent_context=t.extract_context(md)):
                sum(range(10000))
try:
    with t.span("round", bad=[1]):
        pass
except TypeError as exc:
    print("TypeError:", exc)
print("traceparent:", dict(md).get("traceparent"))
"""


def run_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != telemetry.TRACE_FILE_ENV}
    clean["PYTHONPATH"] = os.pathsep.join([str(ROOT), clean.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", SCRIPT], env={**clean, **env}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=True)


def sampled(script_output: str) -> bool:
    """The W3C ``sampled`` flag (bit 0 of trace-flags) of the traceparent the script printed."""
    return bool(int(script_output.split("traceparent: ")[1].strip().rsplit("-", 1)[1], 16) & 1)


def test_init_tracing_writes_the_trace_file(tmp_path):
    path = tmp_path / "spans.jsonl"
    out = run_script(tmp_path, TANDEM_TRACE_FILE=str(path), OTEL_SERVICE_NAME="tandem-router-test").stdout
    assert "TypeError: span attribute 'bad'" in out
    assert sampled(out)
    docs = [json.loads(x) for x in path.read_text().splitlines()]
    resources = {a["value"]["stringValue"] for d in docs for rs in d["resourceSpans"]
                 for a in rs["resource"]["attributes"] if a["key"] == "service.name"}
    assert resources == {"tandem-router-test"}  # OTEL_SERVICE_NAME beats the name in code
    raw = {s["name"]: s for d in docs for rs in d["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]}
    assert sorted(raw) == ["request", "round", "rpc.client.verify", "rpc.server.verify"]  # each once: one provider
    assert raw["rpc.client.verify"]["kind"] == 3 and raw["rpc.server.verify"]["kind"] == 2 and raw["round"]["kind"] == 1
    spans = {s.name: s for s in read_spans(path)}
    assert spans["round"].attributes == {"batch_size": 2, "tau": 0.5, "greedy": True}
    assert spans["request"].attributes == {"request_id": "r1"}
    assert spans["round"].parent_span_id == spans["request"].span_id
    assert spans["rpc.server.verify"].parent_span_id == spans["rpc.client.verify"].span_id
    assert len({s.trace_id for s in spans.values()}) == 1


def test_console_exporter_and_no_exporter(tmp_path):
    out = run_script(tmp_path, OTEL_TRACES_EXPORTER="console").stdout
    assert '"name": "rpc.server.verify"' in out and '"service.name": "router"' in out
    out = run_script(tmp_path).stdout  # nothing configured: spans are sampled out, context still flows
    assert '"name"' not in out and not sampled(out)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("env,expected", [
    ({}, set()),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, set()),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"},
     {"opentelemetry.exporter.otlp.proto.grpc.trace_exporter.OTLPSpanExporter"}),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces",
      "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     {"opentelemetry.exporter.otlp.proto.http.trace_exporter.OTLPSpanExporter"}),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"},
     {"opentelemetry.sdk.trace.export.ConsoleSpanExporter",
      "opentelemetry.exporter.otlp.proto.grpc.trace_exporter.OTLPSpanExporter"}),
])
def test_exporters_follow_the_otel_environment(monkeypatch, env, expected):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = {f"{c.__module__}.{c.__qualname__}" for c in telemetry._span_exporter_classes().values()}
    assert got == expected


def test_unknown_exporter_is_an_error(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "no-such-exporter")
    with pytest.raises(RuntimeError, match="no-such-exporter"):
        telemetry._span_exporter_classes()
