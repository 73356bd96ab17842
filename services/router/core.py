"""Router core: sends each request, whole, to a verifier replica and relays its stream, from asyncio.

The router holds no engine and no KV slot. A verifier replica (``services.verifier``) runs the whole
engine loop for the requests it is sent; the router tokenizes and validates a request, picks the
replica with the least load for its KV slots (this router's requests open there, plus the other
routers' as each replica's polled ``Load`` report implies; ``replicas.Replica``), sends it on its
stream to that replica (``replicas.ReplicaLink``) and relays the answer as ``Delta`` / ``Done`` /
``Failed`` events. Any number of routers can run over the same replicas: a full replica queues
requests for its slots, it never refuses them.

Failover: a replica that dies, or hangs (it stops answering HTTP/2 keepalive pings for
``RouterConfig.verifier_timeout_s``), ends its stream with UNAVAILABLE; the router resumes each
of its requests on another healthy replica from the accepted prefix (prompt + the tokens already
streamed, re-prefilled there; ``max_tokens`` reduced by them). The client sees no error and greedy
output is the same token for token (a sampled request keeps its seed: its draws are keyed by
(seed, position)). The replicas own their KV slots, so nothing leaks when a router or a replica
goes away. Known limit of a resumed request: text held back at the failover point because it might
begin a stop string is flushed as text, and a stop string that spans the point is not matched.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.common import Delta, Done, Event, Failed, params_to_pb, top_from_pb

from .budget import DraftBudget
from services.proto.tandem.v1 import verifier_pb2
from services.verifier.server import spec_from_pb
from tandem.engine import Completion, Prompt, Request, RequestOutput
from tandem.errors import ConfigError, InvalidRequestError
from tandem.metrics import SpecDecodeStats
from tandem.requests import new_request
from tandem.sampling import SamplingParams
from tandem.structured import GrammarCompiler
from tandem.telemetry import Metrics, inject_metadata, span
from tandem.tokenizer import Tokenizer

from .replicas import STREAM_LOST, Replica, merge_events

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    """How the router is wired.

    Attributes:
        verifiers: ``host:port`` of each verifier replica.
        model: model path (GGUF file / HF directory) whose tokenizer to load; None = the replicas'
            model when its path is readable here (``router_model``).
        model_name: the id clients see in /v1/models (default: the verifiers' model file name).
        api_key: bearer token for the internal services (None: no auth).
        verifier_timeout_s: a replica that answers no keepalive ping for this long (s) is taken as
            hung: its calls fail and their requests move to another replica.
        failover_wait_s: how long a request whose replicas all failed waits for one to be healthy
            again before it fails (s).
        load_period_s: how often each replica's load and health are polled (s).
    """

    verifiers: list[str]
    model: str | None = None
    model_name: str | None = None
    api_key: str | None = None
    verifier_timeout_s: float = 10.0
    failover_wait_s: float = 30.0
    load_period_s: float = 0.5


def load_router_tokenizer(model: str | None, eos_token_ids: list[int]) -> Tokenizer:
    """The model's tokenizer without its weights (GGUF metadata or an HF directory).

    Raises:
        ModelLoadError: the tokenizer cannot be loaded.
    """
    from transformers.utils import logging as hf_logging

    from tandem.models.config import ModelLoadError
    from tandem.models.weights import default_model_path
    from tandem.tokenizer import load_hf_tokenizer

    hf_logging.set_verbosity_error()
    path = default_model_path() if model is None else Path(model).expanduser()
    try:
        hf = load_hf_tokenizer(path)
    except Exception as exc:  # transformers raises many types
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {exc}") from None
    eos = list(eos_token_ids) + ([int(hf.eos_token_id)] if hf.eos_token_id is not None else [])
    return Tokenizer(hf, eos)


def router_model(model: str | None, served: str) -> str | None:
    """Where the router reads its tokenizer: ``model`` when given; else the replicas' model
    ``served`` when that path is readable here; else the bundled model, if that is what they serve.

    Raises:
        ConfigError: the replicas serve another model that is not on this host.
    """
    from tandem.models.weights import default_model_path

    if model is not None:
        return model
    if Path(served).exists():
        return served
    if Path(served).name == default_model_path().name:
        return None
    raise ConfigError(f"the verifier replicas serve {served}, which is not on this host: pass --model with a copy "
                      f"of it (the GGUF file or the Hugging Face directory: the router reads its tokenizer)")


def system_fingerprint(model: str, speculation: str) -> str:
    """OpenAI's ``system_fingerprint``: ``fp_`` and 12 hex digits naming the Tandem version, the
    target model and the replicas' speculation (all of them, when they differ); it changes when
    any of them does (greedy output
    is the target's whatever the speculation: the fingerprint tells apart what served it)."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("tandem")
    except PackageNotFoundError:  # run from a source tree without an install
        release = "source"
    return "fp_" + hashlib.sha256(f"{release}|{model}|{speculation}".encode()).hexdigest()[:12]


class _ReplicaLost(Exception):
    """The replica serving a request failed (UNAVAILABLE, a broken stream): move the request."""


@dataclass
class _Progress:
    """What a request has streamed so far, over every replica that served it."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    first_token_time: float | None = None
    replicas: list[str] = field(default_factory=list)


class Router:
    """The router (see the module docstring).

    Args:
        config: wiring.
        metrics: Prometheus metrics to feed (a new ``Metrics`` by default).

    Raises:
        TargetUnavailable: a verifier replica does not answer at start-up.
        ConfigError: replicas that serve different models.
    """

    def __init__(self, config: RouterConfig, metrics: Metrics | None = None) -> None:
        if not config.verifiers:
            raise ConfigError("the router needs at least one verifier replica")
        self.config = config
        self.started = time.time()
        self.replicas: list[Replica] = []
        try:
            for address in config.verifiers:
                self.replicas.append(Replica(address, config.api_key, config.verifier_timeout_s))
        except BaseException:
            for r in self.replicas:
                r.close()
            raise
        first = self.replicas[0].info
        for r in self.replicas[1:]:
            if (r.info.model, r.info.vocab_size) != (first.model, first.vocab_size):
                raise ConfigError(f"verifier replicas serve different models: {first.model} at "
                                  f"{self.replicas[0].address}, {r.info.model} at {r.address}")
        self.model_name = config.model_name or Path(first.model).name
        self.metrics = metrics or Metrics(self.model_name)
        # the replicas may speculate differently (a rolling change): the fingerprint names them all
        self.fingerprint = system_fingerprint(first.model, " + ".join(sorted({r.info.speculation for r in self.replicas})))
        self.tokenizer = load_router_tokenizer(router_model(config.model, first.model), list(first.eos_token_ids))
        self._token_texts: dict[int, str] = {}  # token_text's cache (at most the vocabulary)
        if len(self.tokenizer.hf) > int(first.vocab_size):
            raise ConfigError(f"the router's tokenizer ({config.model or 'the bundled model'}: {len(self.tokenizer.hf)} "
                              f"tokens) is not the replicas' model's ({first.model}: vocabulary {first.vocab_size}); "
                              f"pass --model with the replicas' model")
        self.vocab_size = int(first.vocab_size)
        self.context_limit = min(int(r.info.max_seq_len) for r in self.replicas)  # prompt + output tokens
        self._span_tasks: set[asyncio.Future] = set()
        self.budget = DraftBudget()  # the replicas' draft widths, from the acceptance every request shows
        self._stop = threading.Event()
        self.probe()
        self._poller = threading.Thread(target=self._poll, daemon=True, name="replica-load")
        self._poller.start()

    # ------------------------------------------------------------------ load and health

    def _poll(self) -> None:
        while not self._stop.wait(self.config.load_period_s):
            self.probe()

    def probe(self) -> None:
        """Poll every replica's ``Load`` (2 s each at most): the load the router balances on, and health
        (/health and the router's own gRPC health follow it while no request runs); each poll
        carries the replica's draft width and θ from the cluster-level budget (``DraftBudget``), decided
        on the previous poll's reports. Blocking."""
        widths = self.budget.decide_widths(self.replicas, self.metrics)
        thresholds = self.budget.decide_thresholds(self.replicas, self.metrics)
        for r in self.replicas:
            r.refresh(draft_width=widths[r.address], acceptance_threshold=thresholds.get(r.address))

    def _choose(self, avoid: set[str]) -> Replica | None:
        """The healthy replica with the fewest requests per KV slot (``Replica.score``), not in ``avoid``."""
        healthy = [r for r in self.replicas if r.healthy and r.address not in avoid]
        return min(healthy, key=Replica.score) if healthy else None

    async def _wait_for_replica(self, avoid: set[str]) -> Replica | None:
        """A replica to run on: one not in ``avoid`` if healthy, else (all of them failed) the first
        to be healthy again within ``failover_wait_s``; None after that."""
        replica = self._choose(avoid) or self._choose(set())
        deadline = time.monotonic() + self.config.failover_wait_s
        while replica is None and time.monotonic() < deadline:
            await asyncio.sleep(min(0.2, self.config.load_period_s))
            replica = self._choose(set())
        return replica

    def unavailable_message(self) -> str:
        """Why no request can be served now: no replica answered within the failover wait, and
        each replica's last error (what a 503 / UNAVAILABLE says)."""
        errors = "; ".join(f"{r.address}: {r.last_error}" for r in self.replicas if r.last_error)
        return f"no verifier replica is available after {self.config.failover_wait_s:g} s" + (
            f" ({errors})" if errors else "") + "; retry later"

    async def wait_available(self) -> bool:
        """Whether a replica is healthy, waiting up to ``failover_wait_s`` for one to come back
        (a front door that must answer before the first token, e.g. a stream's 200)."""
        return await self._wait_for_replica(set()) is not None

    # ------------------------------------------------------------------ requests

    def make_request(self, prompt: Prompt | None, params: SamplingParams, *, prompt_ids: list[int] | None = None,
                     chat: bool = True, request_id: str | None = None, logprobs: bool = False,
                     top_logprobs: int = 0, final_only: bool = False) -> Request:
        """Validate and tokenize (``tandem.requests.new_request`` with the served model's tokenizer,
        vocabulary and context limit). A sampled request gets its seed here, so a replica that
        resumes it draws the same numbers. ``final_only``: a client that does not stream; the
        replica sends nothing for it until it finishes (``generate`` then yields one ``Delta`` with
        the whole output), and a replica lost meanwhile has it rerun from its prompt.

        Raises:
            InvalidRequestError: bad prompt or parameters (a malformed schema or grammar included).
        """
        rid = request_id or f"req-{uuid.uuid4().hex}"
        return new_request(self.tokenizer, self.vocab_size, self.context_limit, rid, prompt, params,
                           prompt_ids=prompt_ids, chat=chat, logprobs=logprobs, top_logprobs=top_logprobs,
                           grammars=self.grammars if params.structure is not None else None, final_only=final_only)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Validates structured requests' grammars at the boundary (the replica compiles its own)."""
        return GrammarCompiler(self.tokenizer.hf, self.vocab_size, list(self.tokenizer.eos_token_ids))

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone (top-logprobs alternatives); cached per id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def check_room(self, prompt_tokens: int, name: str, value: int) -> None:
        """Refuse an explicit output limit that with the prompt passes the context limit (without
        one, the output stops at the context).

        Raises:
            InvalidRequestError: ``prompt_tokens + value`` over ``context_limit``, naming ``name``.
        """
        limit = self.context_limit
        if prompt_tokens + value > limit:
            tokens = "token" if prompt_tokens == 1 else "tokens"
            raise InvalidRequestError(f"{name} is {value} and the prompt has {prompt_tokens} {tokens}: past the context "
                                      f"limit of {limit} tokens (prompt + {name} <= {limit}; at most "
                                      f"{limit - prompt_tokens} for this prompt)", param=name)

    async def generate(self, request: Request, category: str = "default",
                       operation: str = "text_completion") -> AsyncIterator[Event]:
        """Async iterator of events for one request: ``Delta`` per streamed step, then ``Done`` or
        ``Failed``. Leaving it early (client disconnect, cancellation) sends an abort on the
        replica stream, which drops the request there. A ``request`` span covers its lifetime,
        with the GenAI semantic conventions' attributes (``operation``: ``chat`` or
        ``text_completion``, its ``gen_ai.operation.name``)."""
        rid = request.request_id
        ended = asyncio.get_running_loop().create_future()

        async def request_span() -> None:  # a span may not cross the generator's yields (contexts differ)
            # OpenTelemetry's GenAI semantic conventions beside our own attributes
            with span("request", request_id=rid, category=category or "default",
                      **{"gen_ai.operation.name": operation, "gen_ai.request.model": self.model_name,
                         "gen_ai.provider.name": "tandem", "gen_ai.request.max_tokens": request.params.max_tokens,
                         "gen_ai.request.temperature": request.params.temperature,
                         "gen_ai.request.top_p": request.params.top_p,
                         "gen_ai.usage.input_tokens": len(request.prompt_ids)}) as s:
                outcome, completion, progress = await ended
                s.set_attribute("outcome", outcome)
                s.set_attribute("replicas", progress.replicas)
                if completion is not None:
                    s.set_attribute("gen_ai.usage.output_tokens", completion.completion_tokens)
                    s.set_attribute("gen_ai.response.finish_reasons", [completion.finish_reason])

        holder = asyncio.ensure_future(request_span())
        self._span_tasks.add(holder)
        holder.add_done_callback(self._span_tasks.discard)
        progress = _Progress()
        outcome, completion = "aborted", None
        failed_on: set[str] = set()
        try:
            while True:
                replica = await self._wait_for_replica(failed_on)
                if replica is None:
                    outcome = "failed"
                    yield Failed(self.unavailable_message())
                    return
                try:
                    async with aclosing(self._run_on(replica, request, progress, category)) as attempt:
                        async for event in attempt:
                            if isinstance(event, Done):
                                outcome, completion = "finished", event.completion
                            elif isinstance(event, Failed):
                                outcome = "failed"
                            yield event
                    return
                except _ReplicaLost as exc:
                    failed_on.add(replica.address)
                    replica.mark_failed(str(exc))
                    log.warning("request %s: verifier replica %s failed (%s); resuming after %d tokens", rid,
                                replica.address, exc, len(progress.token_ids))
                    held = self._held_text(progress)
                    if held:
                        yield Delta(RequestOutput(rid, [], held, False, None))
        finally:
            ended.set_result((outcome, completion, progress))

    def _held_text(self, progress: _Progress) -> str:
        """Text of the streamed tokens that the failed replica had held back (a possible stop
        string's start), so a resumed request loses none of it."""
        full = self.tokenizer.decode(progress.token_ids).rstrip("\ufffd")
        sent = "".join(progress.text)
        if not full.startswith(sent) or len(full) == len(sent):
            return ""
        progress.text.append(full[len(sent):])
        return progress.text[-1]

    async def _run_on(self, replica: Replica, request: Request, progress: _Progress,
                      category: str) -> AsyncIterator[Event]:
        """One attempt of ``request`` on ``replica``, from what ``progress`` already holds.

        Raises:
            _ReplicaLost: the replica failed while serving it.
        """
        rid = request.request_id
        done = len(progress.token_ids)
        params = request.params
        if done:  # (min_tokens too: what was emitted counts)
            params = replace(params, max_tokens=request.output.max_new_tokens - done,
                             min_tokens=max(0, params.min_tokens - done))
        progress.replicas.append(replica.address)
        with span("route", replica=replica.address, request_id=rid, resumed_tokens=done):
            trace = dict(inject_metadata())  # the replica's "generate" span is this one's child
        msg = verifier_pb2.ReplicaRequest(request_id=rid, prompt_ids=[*request.prompt_ids, *progress.token_ids],
                                          params=params_to_pb(params), logprobs=request.logprobs is not None,
                                          top_logprobs=request.top_logprobs, output_tokens=done,
                                          category=category or "default", trace_context=trace,
                                          final_only=request.final_only)
        link = replica.link()
        wire_id, events = link.submit(msg)
        replica.open_calls += 1
        settled = False
        try:
            while True:
                ev = await events.get()
                while ev is not STREAM_LOST and not events.empty() and not ev.finished and not ev.error:
                    nxt = events.get_nowait()  # the front door fell behind: coalesce what queued
                    if nxt is STREAM_LOST or nxt.error:
                        events.put_nowait(nxt)  # (handled next time round)
                        break
                    ev = merge_events(ev, nxt)
                if ev is STREAM_LOST:
                    raise _ReplicaLost(link.error)
                if ev.error:
                    settled = True
                    yield Failed(ev.error, invalid=ev.invalid)
                    return
                now = time.perf_counter()
                if ev.token_ids and progress.first_token_time is None:
                    # a final_only request's one event: its first token came since_first_token_s earlier
                    progress.first_token_time = now - (ev.since_first_token_s if ev.finished else 0.0)
                progress.token_ids.extend(ev.token_ids)
                progress.text.append(ev.text)
                progress.logprobs.extend(ev.logprobs)
                progress.token_texts.extend(ev.token_texts)
                top = [top_from_pb(m) for m in ev.top_logprobs] if request.top is not None else None
                progress.top_logprobs.extend(top or ())
                stop_reason = ev.stop_string if ev.HasField("stop_string") else (
                    int(ev.stop_token_id) if ev.HasField("stop_token_id") else None)
                out = RequestOutput(rid, list(ev.token_ids), ev.text, ev.finished, ev.finish_reason or None,
                                    list(ev.logprobs) if request.logprobs is not None else None,
                                    list(ev.token_texts) if request.logprobs is not None else None, stop_reason, top)
                if ev.finished:
                    settled = True
                    progress.spec.merge(spec_from_pb(ev.spec))
                    completion = self._completion(request, progress, ev.finish_reason, stop_reason, now)
                    self._observe(completion)
                    yield Delta(out)
                    yield Done(completion)
                    return
                yield Delta(out)
        finally:
            replica.open_calls -= 1
            link.release(wire_id, abort=not settled)  # a consumer that left aborts the request on the replica

    def _completion(self, request: Request, progress: _Progress, finish_reason: str, stop_reason, now: float) -> Completion:
        n = len(progress.token_ids)
        first = progress.first_token_time or now
        return Completion(request.request_id, "".join(progress.text), list(progress.token_ids), finish_reason,
                          len(request.prompt_ids), first - request.arrival_time, now - request.arrival_time,
                          (now - first) / (n - 1) if n > 1 else 0.0, progress.spec,
                          list(progress.logprobs) if request.logprobs is not None else None,
                          list(progress.token_texts) if request.logprobs is not None else None, stop_reason,
                          list(progress.top_logprobs) if request.top is not None else None)

    def _observe(self, c: Completion) -> None:
        """Cluster-wide metrics of a finished request (its rounds ran on replicas: their counters
        are added here when it finishes, one request at a time)."""
        s = c.spec
        self.budget.observe(s)
        self.metrics.observe_round(s.num_drafted, s.num_accepted, s.accepted_per_pos, s.num_emitted,
                                   s.drafted_per_pos[0] if s.drafted_per_pos else 0)
        self.metrics.observe_request(c.ttft_s, c.tpot_s if c.completion_tokens > 1 else None, c.latency_s,
                                     c.prompt_tokens, c.completion_tokens, c.finish_reason)

    # ------------------------------------------------------------------ status

    def health(self) -> dict:
        """Replica and state-store status (what /health reports), as of the last poll."""
        store = next((r.report.state_store for r in self.replicas if r.healthy and r.report is not None
                      and r.report.HasField("state_store")), None)
        drafters = [r.report.drafter for r in self.replicas if r.healthy and r.report is not None
                    and r.report.HasField("drafter") and r.report.drafter.address]
        if store is not None:
            self.metrics.set_store_up(store.up)
        return {
            "verifiers": [{"address": r.address, "healthy": r.healthy, "error": r.last_error,
                           "running": r.report.running if r.report and r.healthy else None,
                           "waiting": r.report.waiting if r.report and r.healthy else None,
                           "num_slots": r.num_slots, "speculation": r.info.speculation,
                           "draft_limit": r.report.draft_limit if r.report and r.healthy else None,
                           "draft_width": r.report.draft_width if r.report and r.healthy
                           and r.report.HasField("draft_width") else None,
                           "acceptance_threshold": round(r.report.acceptance_threshold, 4) if r.report and r.healthy
                           and r.report.HasField("acceptance_threshold") else None,
                           "acceptance_threshold_set": bool(r.report.acceptance_threshold_set) if r.report
                           and r.healthy else None}
                          for r in self.replicas],
            "drafter": None if not drafters else {"address": drafters[0].address,
                                                  "available": all(d.available for d in drafters)},
            "state_store": None if store is None else {
                "backend": store.backend, "up": store.up, "pending_writes": int(store.pending_writes),
                "mode": ("shared" if store.up else "local: Redis unreachable, writes queued for replay")
                        if store.backend == "redis" else "local (in-memory; set TANDEM_REDIS_URL to share)"},
        }

    def update_gauges(self) -> None:
        reports = [r.report for r in self.replicas if r.healthy and r.report is not None]
        self.metrics.set_running(sum(x.running for x in reports))
        self.metrics.set_waiting(sum(x.waiting for x in reports))

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    async def aclose(self) -> None:
        """Close this event loop's streaming channels."""
        for r in self.replicas:
            await r.aclose()

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=5)
        for r in self.replicas:
            r.close()
