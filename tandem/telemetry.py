"""Observability: OpenTelemetry tracing and Prometheus metrics for Tandem's services.

Tracing. ``init_tracing(service)`` installs the OpenTelemetry SDK's ``TracerProvider`` once per
process, with the exporters the standard environment variables ask for, resolved by the SDK's own
configuration code (the one ``opentelemetry-instrument`` uses):

- ``OTEL_TRACES_EXPORTER``: ``otlp``, ``console``, ``none`` (comma-separated for several; also
  ``otlp_proto_grpc``, ``otlp_proto_http``, ``otlp_json_file``). Unset: ``otlp`` when an OTLP
  endpoint variable is set, else no exporter at all (spans are then sampled out cheaply).
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: ``grpc`` (default)
  or ``http/protobuf``; ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``..._HEADERS``, ``..._TIMEOUT``,
  ``..._INSECURE`` are read by the exporters themselves.
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` override the service name given in code;
  ``OTEL_TRACES_SAMPLER`` (+ ``_ARG``) pick the sampler; ``OTEL_BSP_*`` tune the batch processor;
  ``OTEL_SDK_DISABLED=true`` turns tracing off; ``OTEL_PROPAGATORS`` picks the propagators
  (default W3C ``tracecontext,baggage``).
- ``TANDEM_TRACE_FILE=path``: also append every span batch to ``path`` as OTLP JSON, one
  ``ExportTraceServiceRequest`` per line: the format of the OpenTelemetry collector's ``file``
  exporter, which ``tandem trace-report`` reads.

Span names used across the services (``tandem trace-report`` groups by them): ``request``
(attribute ``request_id`` and the GenAI semantic conventions' ``gen_ai.*``), ``prefill``, ``round``
(one decode round) and its children ``draft``, ``allocate``, ``verify``, ``observe`` (a drafter
reading the verify pass's states); a message of a long-lived stream as ``rpc.client.<method>`` on
the caller and ``rpc.server.<method>`` on the callee (e.g. ``rpc.client.draft`` /
``rpc.server.draft``), linked by W3C ``traceparent`` carried in the message
(``inject_metadata`` / ``extract_context``). Whole RPCs are traced by opentelemetry-instrumentation-grpc
(interceptors on every server and client channel: ``services.common``) and HTTP requests by the
FastAPI instrumentation, both with their semantic conventions (``rpc.system``, ``rpc.service``,
``rpc.method``; ``http.*``).

Metrics. ``Metrics`` holds Prometheus counters, histograms and gauges named as vLLM's
(``vllm:spec_decode_num_accepted_tokens_total`` ...) with the ``tandem_`` prefix, in its own
registry, and renders them for a ``/metrics`` endpoint (``exposition()``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger(__name__)

TRACE_FILE_ENV = "TANDEM_TRACE_FILE"
TRACER_NAME = "tandem"

_tracer = trace.get_tracer(TRACER_NAME)  # a proxy until init_tracing installs the SDK provider
_init_lock = threading.Lock()
_provider = None  # the SDK TracerProvider this module installed (None before init_tracing)


def _span_exporter_classes() -> dict:
    """Span exporter classes named by ``OTEL_TRACES_EXPORTER`` (name -> class), from the
    ``opentelemetry_traces_exporter`` entry points the exporter packages register (the lookup the
    SDK's auto-configuration makes): ``otlp`` is ``otlp_proto_grpc`` or ``otlp_proto_http`` by
    ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``; unset with an OTLP endpoint set means ``otlp``.

    Raises:
        RuntimeError: an unknown exporter name or OTLP protocol.
    """
    from importlib.metadata import entry_points

    from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
    from opentelemetry.sdk.environment_variables import (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL,
                                                         OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
                                                         OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)

    env = os.environ
    if OTEL_TRACES_EXPORTER in env:
        names = [n.strip() for n in env[OTEL_TRACES_EXPORTER].split(",") if n.strip() and n.strip() != "none"]
    else:
        names = ["otlp"] if env.get(OTEL_EXPORTER_OTLP_ENDPOINT) or env.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) else []
    found = {}
    for name in names:
        entry = name
        if name == "otlp":
            protocol = env.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or env.get(OTEL_EXPORTER_OTLP_PROTOCOL) or "grpc"
            entry = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}.get(protocol)
            if entry is None:
                raise RuntimeError(f"unsupported OTLP protocol {protocol!r} (grpc or http/protobuf)")
        points = entry_points(group="opentelemetry_traces_exporter", name=entry)
        if not points:
            raise RuntimeError(f"trace exporter {name!r} is not installed (OTEL_TRACES_EXPORTER)")
        found[name] = next(iter(points)).load()
    return found


def tracing_configured() -> bool:
    """True when the environment asks for span export (``TANDEM_TRACE_FILE``, or ``OTEL_*``
    settings that name an exporter). In-process commands install a provider only then, so a host
    application keeps its own OpenTelemetry set-up and unconfigured runs pay nothing.

    Raises:
        RuntimeError: see ``init_tracing``.
    """
    return bool(os.environ.get(TRACE_FILE_ENV)) or bool(_span_exporter_classes())


def init_tracing(service_name: str) -> None:
    """Install the OpenTelemetry SDK tracer provider for this process (idempotent: later calls do
    nothing), with the exporters the ``OTEL_*`` environment variables and ``TANDEM_TRACE_FILE``
    ask for (see the module docstring). With none configured, spans are not recorded at all.

    Args:
        service_name: ``service.name`` of the resource unless ``OTEL_SERVICE_NAME`` (or
            ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``) says otherwise.

    Raises:
        RuntimeError: ``OTEL_TRACES_EXPORTER`` names an exporter that is not installed, or the
            OTLP protocol is unknown.
        OSError: ``TANDEM_TRACE_FILE`` cannot be opened for appending.
    """
    global _provider
    with _init_lock:
        if _provider is not None:
            return
        from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

        exporters = [cls() for cls in _span_exporter_classes().values()]
        trace_file = os.environ.get(TRACE_FILE_ENV)
        if trace_file:
            from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter

            exporters.append(FileSpanExporter(trace_file))
        resource = Resource.create({SERVICE_NAME: service_name}).merge(OTELResourceDetector().detect())
        # Nothing to export to: sample everything out, so spans cost a context push and no recording.
        provider = TracerProvider(resource=resource, **({} if exporters else {"sampler": ALWAYS_OFF}))
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _provider = provider
        log.info("tracing for %s: %s", service_name,
                 ", ".join(type(e).__name__ for e in exporters) or "no exporter (spans dropped)")


def force_flush(timeout_s: float = 30.0) -> bool:
    """Export every span ended so far (blocks up to ``timeout_s`` seconds). True when all were
    exported, or when ``init_tracing`` has not run (nothing to flush)."""
    if _provider is None:
        return True
    return _provider.force_flush(int(timeout_s * 1000))


_ATTRIBUTE_TYPES = (str, bool, int, float)


@contextmanager
def span(name: str, parent_context: Context | None = None, **attributes) -> Iterator[trace.Span]:
    """Start a span called ``name`` as the current span for the ``with`` body and end it after.

    ``rpc.client.*`` names make CLIENT spans and ``rpc.server.*`` names SERVER spans (how Jaeger
    draws the hop), with ``rpc.system`` = ``grpc`` and ``rpc.method`` (the name's last part,
    capitalised: a message of a stream whose RPC the gRPC instrumentation traces as a whole);
    other names are INTERNAL. An exception leaving the body is recorded on the span (status
    ERROR) and re-raised.

    Args:
        name: span name (see the module docstring for the names the services share).
        parent_context: parent to use instead of the current context (on a server, the result of
            ``extract_context(metadata)``).
        **attributes: span attributes; values must be str, int, float or bool.

    Raises:
        TypeError: an attribute value of another type.
    """
    for key, value in attributes.items():
        if not isinstance(value, _ATTRIBUTE_TYPES):
            raise TypeError(f"span attribute {key!r} must be str, int, float or bool, got {type(value).__name__}")
    if name.startswith("rpc.client."):
        kind = trace.SpanKind.CLIENT
    elif name.startswith("rpc.server."):
        kind = trace.SpanKind.SERVER
    else:
        kind = trace.SpanKind.INTERNAL
    if kind is not trace.SpanKind.INTERNAL:  # one message of a stream: the RPC semantic conventions' attributes
        attributes = {"rpc.system": "grpc", "rpc.method": name.rsplit(".", 1)[-1].capitalize()} | attributes
    with _tracer.start_as_current_span(name, context=parent_context, kind=kind, attributes=attributes or None) as s:
        yield s


def inject_metadata(metadata: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """gRPC call metadata carrying the current trace context (W3C ``traceparent`` /
    ``tracestate`` and baggage, through the globally configured propagator).

    Args:
        metadata: metadata to extend (not modified); keys the propagator sets replace theirs.

    Returns:
        A new list of ``(key, value)`` pairs with lower-case keys, as gRPC requires. Without an
        active recording span it is ``metadata`` unchanged.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    injected = {k.lower(): v for k, v in carrier.items()}
    kept = [(k, v) for k, v in (metadata or []) if k.lower() not in injected]
    return kept + list(injected.items())


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context sent by the caller in gRPC metadata (the inverse of ``inject_metadata``).

    Args:
        metadata: ``(key, value)`` pairs, e.g. ``servicer_context.invocation_metadata()``; binary
            (``-bin``) entries are ignored; None means no metadata.

    Returns:
        A context whose current span is the caller's (pass it as ``span(..., parent_context=)``);
        the current context unchanged when the metadata carries no valid trace context.
    """
    carrier = {str(k).lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier, context=otel_context.get_current())


# ----------------------------------------------------------------------------- Prometheus

# Histogram buckets (seconds): vLLM's, with finer sub-10 ms steps for per-token times.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """Prometheus metrics of one Tandem service, in a registry of its own (instances coexist).

    Counters (exposed with the ``_total`` suffix): ``tandem_spec_decode_num_draft_tokens_total``,
    ``tandem_spec_decode_num_accepted_tokens_total``,
    ``tandem_spec_decode_num_accepted_tokens_per_pos_total{position}`` (0-based draft position),
    ``tandem_spec_decode_num_emitted_tokens_total``, ``tandem_request_success_total{finished_reason}``,
    ``tandem_prompt_tokens_total``, ``tandem_generation_tokens_total``. Histograms (seconds):
    ``tandem_time_to_first_token_seconds``, ``tandem_time_per_output_token_seconds``,
    ``tandem_e2e_request_latency_seconds``. Gauges: ``tandem_num_requests_running``,
    ``tandem_num_requests_waiting``, ``tandem_state_store_up`` (1 up, 0 down), and under a
    context-aware policy in chained rounds its last plan: ``tandem_draft_width`` (drafts a row may
    verify) and ``tandem_acceptance_threshold`` (θ the plan was made under).

    From these, acceptance rate α = accepted / draft tokens and, with ``num_emitted_tokens`` counted
    per verification step, the mean accepted length (docs/architecture.md ("Metrics")).

    The same speculative-decoding counts also go out under vLLM's names and labels, so dashboards
    built for vLLM read them unchanged: ``vllm:spec_decode_num_drafts_total`` (sequences that
    verified at least one draft token, once per round), ``vllm:spec_decode_num_draft_tokens_total``,
    ``vllm:spec_decode_num_accepted_tokens_total`` and
    ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}``, each labelled
    ``model_name``. Mean accepted length there is 1 + accepted / drafts, per drafting sequence.

    Args:
        model_name: the ``model_name`` label of the vLLM-named series (the served model's id).
    """

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.model_name = model_name
        label = ["model_name"]
        self.vllm_drafts = Counter("vllm:spec_decode_num_drafts", "Sequences that verified draft tokens, per round.",
                                   label, registry=r)
        self.vllm_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", label,
                                         registry=r)
        self.vllm_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", label,
                                            registry=r)
        self.vllm_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by 0-based draft position.",
                                             label + ["position"], registry=r)
        for counter in (self.vllm_drafts, self.vllm_draft_tokens, self.vllm_accepted_tokens):
            counter.labels(model_name=model_name)  # exported at 0 from the start, as Prometheus advises
        self.draft_tokens = Counter("tandem_spec_decode_num_draft_tokens", "Draft tokens proposed for verification.",
                                    registry=r)
        self.accepted_tokens = Counter("tandem_spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted by the target.", registry=r)
        self.accepted_per_pos = Counter("tandem_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by 0-based draft position.", ["position"], registry=r)
        self.emitted_tokens = Counter("tandem_spec_decode_num_emitted_tokens",
                                      "Tokens emitted by verification steps (accepted drafts + bonus tokens).",
                                      registry=r)
        self.request_success = Counter("tandem_request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated for finished requests.",
                                         registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token (s).",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram("tandem_time_per_output_token_seconds",
                              "Mean time per output token after the first (s).", buckets=TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "End-to-end request latency (s).",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.running = Gauge("tandem_num_requests_running", "Requests decoding now.", registry=r)
        self.waiting = Gauge("tandem_num_requests_waiting", "Requests queued, not yet admitted.", registry=r)
        self.store_up = Gauge("tandem_state_store_up", "1 when the state store (Redis) answers, else 0.", registry=r)
        # a router's budget series, made at its first decision: a replica, which makes none, shows none
        self.router_draft_width: Gauge | None = None
        self.router_draft_budget: Gauge | None = None
        self.router_acceptance_threshold: Gauge | None = None
        # made at the first planned round (a replica's policy): a router, which plans none, shows no 0s
        self.draft_width: Gauge | None = None
        self.acceptance_threshold: Gauge | None = None

    def observe_round(self, num_draft_tokens: int, num_accepted_tokens: int, accepted_per_pos: list[int],
                      num_emitted_tokens: int = 0, num_drafts: int = 0, draft_width: int | None = None,
                      acceptance_threshold: float | None = None) -> None:
        """Count one verification round (summed over the requests in it).

        Args:
            num_draft_tokens: draft tokens verified (tokens).
            num_accepted_tokens: of those, accepted (tokens).
            accepted_per_pos: ``accepted_per_pos[i]`` = requests whose draft token at 0-based
                position i was accepted; sums to ``num_accepted_tokens``.
            num_emitted_tokens: tokens the round emitted (accepted + bonus, cut by stop rules).
            num_drafts: requests that verified at least one draft token this round.
            draft_width, acceptance_threshold: the round's plan under a context-aware policy
                (``RoundSummary``); None leaves the gauges as they are.

        Raises:
            ValueError: a negative count, more accepted than drafted tokens, drafts without draft
                tokens, or ``sum(accepted_per_pos) != num_accepted_tokens``.
        """
        if min(num_draft_tokens, num_accepted_tokens, num_emitted_tokens, num_drafts, *accepted_per_pos, 0) < 0:
            raise ValueError("token counts must be >= 0")
        if num_drafts > num_draft_tokens:
            raise ValueError(f"{num_drafts} drafts > {num_draft_tokens} draft tokens")
        if num_accepted_tokens > num_draft_tokens:
            raise ValueError(f"{num_accepted_tokens} accepted tokens > {num_draft_tokens} draft tokens")
        if sum(accepted_per_pos) != num_accepted_tokens:
            raise ValueError(f"accepted_per_pos sums to {sum(accepted_per_pos)}, not {num_accepted_tokens}")
        self.draft_tokens.inc(num_draft_tokens)
        self.accepted_tokens.inc(num_accepted_tokens)
        self.emitted_tokens.inc(num_emitted_tokens)
        for pos, n in enumerate(accepted_per_pos):
            self.accepted_per_pos.labels(position=str(pos)).inc(n)
            self.vllm_accepted_per_pos.labels(model_name=self.model_name, position=str(pos)).inc(n)
        self.vllm_drafts.labels(model_name=self.model_name).inc(num_drafts)
        self.vllm_draft_tokens.labels(model_name=self.model_name).inc(num_draft_tokens)
        self.vllm_accepted_tokens.labels(model_name=self.model_name).inc(num_accepted_tokens)
        if (draft_width is not None or acceptance_threshold is not None) and self.draft_width is None:
            self.draft_width = Gauge("tandem_draft_width", "Draft tokens a row may verify in the last round a "
                                     "context-aware policy planned (chained rounds).", registry=self.registry)
            self.acceptance_threshold = Gauge("tandem_acceptance_threshold", "Acceptance threshold θ of the last "
                                              "round a context-aware policy planned.", registry=self.registry)
        if draft_width is not None:
            self.draft_width.set(draft_width)
        if acceptance_threshold is not None:
            self.acceptance_threshold.set(acceptance_threshold)

    def observe_request(self, ttft_s: float, tpot_s: float | None, e2e_s: float, prompt_tokens: int,
                        completion_tokens: int, finished_reason: str = "stop") -> None:
        """Record one finished request.

        Args:
            ttft_s: time to first token (s).
            tpot_s: mean time per output token after the first (s); None when there was at most
                one output token (nothing to time).
            e2e_s: arrival to last token (s).
            prompt_tokens: prompt length (tokens).
            completion_tokens: generated tokens.
            finished_reason: ``stop``, ``length``, ``abort``, ...

        Raises:
            ValueError: a negative time or token count.
        """
        if min(ttft_s, e2e_s, prompt_tokens, completion_tokens) < 0 or (tpot_s is not None and tpot_s < 0):
            raise ValueError("request times and token counts must be >= 0")
        self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.request_success.labels(finished_reason=finished_reason).inc()

    def set_running(self, n: int) -> None:
        """Requests decoding now."""
        self.running.set(n)

    def set_waiting(self, n: int) -> None:
        """Requests waiting for admission."""
        self.waiting.set(n)

    def set_store_up(self, up: bool) -> None:
        """Whether the state store answers (``StateStore.ping()``)."""
        self.store_up.set(1 if up else 0)

    def set_replica_budget(self, replica: str, draft_width: int, draft_tokens: int) -> None:
        """A router's draft budget for one verifier replica: drafts per sequence and draft tokens a
        round (``services.router.budget``)."""
        if self.router_draft_width is None:
            self.router_draft_width = Gauge("tandem_router_draft_width", "Drafts per sequence the router's budget "
                                            "gives a verifier replica's rounds.", ["replica"], registry=self.registry)
            self.router_draft_budget = Gauge("tandem_router_draft_budget_tokens", "Draft tokens a round the "
                                             "router's budget gives a verifier replica (width x its requests).",
                                             ["replica"], registry=self.registry)
        self.router_draft_width.labels(replica=replica).set(draft_width)
        self.router_draft_budget.labels(replica=replica).set(draft_tokens)

    def clear_replica_budget(self, replica: str) -> None:
        """No budget for the replica now (unhealthy, or nothing to decide on): its series go away."""
        if self.router_draft_width is not None:
            _remove(replica, self.router_draft_width, self.router_draft_budget)

    def set_replica_threshold(self, replica: str, acceptance_threshold: float) -> None:
        """The θ a router sets for one verifier replica (``services.router.budget``)."""
        if self.router_acceptance_threshold is None:
            self.router_acceptance_threshold = Gauge(
                "tandem_router_acceptance_threshold", "Acceptance threshold θ the router sets for a verifier "
                "replica's rounds (chosen over every replica's θ controller).", ["replica"], registry=self.registry)
        self.router_acceptance_threshold.labels(replica=replica).set(acceptance_threshold)

    def clear_replica_threshold(self, replica: str) -> None:
        """No θ set for the replica now: its series goes away."""
        if self.router_acceptance_threshold is not None:
            _remove(replica, self.router_acceptance_threshold)

    def exposition(self) -> tuple[bytes, str]:
        """``(body, content_type)`` of the Prometheus text format, for a ``/metrics`` endpoint."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _remove(replica: str, *gauges) -> None:
    """Remove one replica's series from labelled gauges (absent ones are fine)."""
    for gauge in gauges:
        try:
            gauge.remove(replica)
        except KeyError:
            pass
