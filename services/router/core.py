"""Router core: the engine's scheduler over remote verifiers and drafters, driven from asyncio.

One ``tandem.engine.Engine`` per verifier replica (its ``RemoteTarget``), each stepped by its own
thread: continuous batching over that replica's running requests, one verify batch per replica
per round, drafts from a ``RemoteDrafter`` stream (target-only while the drafter is down). New
requests go to the least loaded healthy replica. Front doors (HTTP, gRPC) call ``submit`` from
the event loop and read events from an ``asyncio.Queue``.

Shared state (``tandem.state``): threshold controller state (through ``DraftPolicy``), acceptance
counters per drafter and category, and the verification-log stream. A store that is down
degrades to local state (``FallbackStore``) and is reported by ``health()``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.engine import Completion, Engine, Prompt, Request, RequestOutput, RoundSummary
from tandem.errors import ConfigError, InvalidRequestError
from tandem.predictor import VerificationRecord
from tandem.sampling import SamplingParams
from tandem.speculation import TARGET_ONLY, SpeculativeConfig, build_speculation
from tandem.state import FallbackStore, InMemoryStore, RedisStore, StateStore, best_effort
from tandem.target import TargetUnavailable
from tandem.telemetry import Metrics, span
from tandem.tokenizer import Tokenizer

from .remote import RemoteDrafter, RemoteTarget

log = logging.getLogger(__name__)

VERIFICATION_LOG = "vlog"  # stream prefix: vlog:<drafter>, as `tandem collect-logs` writes it


@dataclass
class RouterConfig:
    """How the router is wired.

    Attributes:
        verifiers: ``host:port`` of each verifier replica (one engine each).
        drafter: ``host:port`` of the drafter service (None: target-only decoding).
        model: model path (GGUF file / HF directory) whose tokenizer to load; None = bundled.
        model_name: the id clients see in /v1/models (default: the verifier's).
        speculation: k and the draft policy (``remote_speculation``): "fixed" (k for everyone),
            "entropy" (draft length from exp(-entropy) under an online threshold θ, allocated with the
            verifier's cost model) or "predictor" (the learned acceptance predictor, same
            control); its drafter is "remote" exactly when ``drafter`` is set.
        redis_url: shared state store; None = in-memory (this process only).
        api_key: bearer token for the internal services (None: no auth).
        drafter_timeout_s / verifier_timeout_s: longest wait for one round's answer (s).
        drafter_resolver: returns the drafter's current address after a failure (Ray Serve
            replicas that were replaced); None: ``drafter`` for good.
        overlap: draft the next round while the verifier checks this one (``Drafter.prefetch``).
    """

    verifiers: list[str]
    drafter: str | None = None
    model: str | None = None
    model_name: str | None = None
    speculation: SpeculativeConfig = TARGET_ONLY
    redis_url: str | None = None
    api_key: str | None = None
    drafter_timeout_s: float = 10.0
    verifier_timeout_s: float = 120.0
    drafter_resolver: Callable[[], str] | None = None
    overlap: bool = True


def remote_speculation(drafter: str | None, num_draft_tokens: int = 4, policy: str = "fixed",
                       predictor: str | None = None) -> SpeculativeConfig:
    """The router's ``SpeculativeConfig``: the drafter service at ``drafter`` (None: target-only),
    k, and the draft policy with θ learned online.

    Raises:
        ConfigError: a bad policy / predictor combination, or a policy without a drafter.
    """
    return SpeculativeConfig("remote" if drafter else "none", num_draft_tokens=num_draft_tokens, policy=policy,
                             predictor=predictor)


@dataclass
class Delta:
    """Newly accepted tokens of a request (``RequestOutput``)."""

    output: RequestOutput


@dataclass
class Done:
    """The request finished; ``completion`` carries text, usage and speculative metrics."""

    completion: Completion


@dataclass
class Failed:
    """The request failed (its verifier went away); ``message`` says why."""

    message: str


Event = Delta | Done | Failed


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


def open_router_store(url: str | None) -> StateStore:
    """``FallbackStore`` over Redis at ``url``; the in-memory store without one."""
    return FallbackStore(RedisStore(url)) if url else InMemoryStore()


@dataclass
class _Submission:
    request: Request
    sink: Callable[[Event], None]
    category: str
    worker: "Worker | None" = None


class Worker:
    """One engine (one verifier replica) stepped by a thread.

    Args:
        name: for logs (the verifier's address).
        engine: the engine over a ``RemoteTarget``.
        on_done: called in the worker thread with (submission, completion) for finished requests.
    """

    def __init__(self, name: str, engine: Engine, on_done) -> None:
        self.name = name
        self.engine = engine
        self._on_done = on_done
        self._inbox: queue.Queue = queue.Queue()
        self._subs: dict[str, _Submission] = {}
        self.load = 0  # requests assigned and not finished (read by the router to balance)
        self.healthy = True
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"engine-{name}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def submit(self, sub: _Submission) -> None:
        self.load += 1
        self._inbox.put(("add", sub))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # ------------------------------------------------------------------ worker thread

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            kind, arg = item
            if kind == "add":
                self._subs[arg.request.request_id] = arg
                try:
                    self.engine.submit(arg.request)
                except InvalidRequestError as exc:
                    self._finish(arg.request.request_id, Failed(str(exc)))
            elif kind == "abort":
                if arg in self._subs:
                    self.engine.abort(arg)
                    self._subs.pop(arg)
                    self.load -= 1
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _finish(self, rid: str, event: Event) -> None:
        sub = self._subs.pop(rid, None)
        if sub is not None:
            self.load -= 1
            sub.sink(event)

    def _fail_started(self, message: str) -> None:
        """The verifier lost its sequences: fail every request that had reached it."""
        waiting = {id(r) for r in self.engine.waiting}
        for rid, req in list(self.engine.requests.items()):
            if id(req) not in waiting:
                self.engine.abort(rid)
                self._finish(rid, Failed(message))

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.has_unfinished())
            if self._stop.is_set() or not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
                self.healthy, self.last_error = True, None
            except TargetUnavailable as exc:
                log.error("verifier %s: %s; failing its running requests", self.name, exc)
                self.healthy, self.last_error = False, str(exc)
                self._fail_started(f"the verifier failed while serving this request: {exc}")
                time.sleep(0.2)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug must fail requests, not kill the replica's thread
                log.exception("engine step failed on %s", self.name)
                self._fail_started(f"internal error: {exc}")
                continue
            for out in outputs:
                sub = self._subs.get(out.request_id)
                if sub is None:
                    continue
                sub.sink(Delta(out))
                if out.finished:
                    completion = engine.completion(out.request_id)
                    self._on_done(sub, completion)
                    self._finish(out.request_id, Done(completion))


def system_fingerprint(model: str, spec: SpeculativeConfig) -> str:
    """OpenAI's ``system_fingerprint``: ``fp_`` and 12 hex digits naming the Tandem version, the
    target model and the speculation configuration; it changes when any of them does (greedy output
    is the target's whatever the speculation: the fingerprint tells apart what served it)."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("tandem")
    except PackageNotFoundError:  # run from a source tree without an install
        release = "source"
    return "fp_" + hashlib.sha256(f"{release}|{model}|{spec!r}".encode()).hexdigest()[:12]


class Router:
    """The router's scheduling core (see the module docstring).

    Args:
        config: wiring.
        metrics: Prometheus metrics to feed (a new ``Metrics`` by default).

    Raises:
        TargetUnavailable: a verifier does not answer at start-up.
        ConfigError: a bad policy / predictor combination.
    """

    def __init__(self, config: RouterConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.store = open_router_store(config.redis_url)
        self.started = time.time()
        self._ids = itertools.count()
        self._subs_by_id: dict[str, _Submission] = {}
        self._span_tasks: set[asyncio.Future] = set()
        spec = config.speculation
        if spec.speculates != bool(config.drafter) or spec.drafter not in ("remote", "none"):
            raise ConfigError(f"the router's speculation must name a remote drafter exactly when a drafter service "
                              f"is given (drafter {config.drafter!r}, speculation drafter {spec.drafter!r})")
        targets = [RemoteTarget(a, config.api_key, timeout_s=config.verifier_timeout_s) for a in config.verifiers]
        first = targets[0]
        self.model_name = config.model_name or Path(first.info.model).name
        self.metrics = metrics or Metrics(self.model_name)
        self.fingerprint = system_fingerprint(first.info.model, config.speculation)
        self.tokenizer = load_router_tokenizer(config.model, first.eos_token_ids)
        self.workers: list[Worker] = []
        self.drafters: list[RemoteDrafter] = []
        for addr, target in zip(config.verifiers, targets):
            drafter = None
            if config.drafter:
                drafter = RemoteDrafter(config.drafter, target.info.vocab_size, config.api_key,
                                        timeout_s=config.drafter_timeout_s, resolve=config.drafter_resolver)
                self.drafters.append(drafter)
            speculation = build_speculation(spec, drafter=drafter, cost=target.cost, store=self.store)
            engine = Engine(tokenizer=self.tokenizer, drafter=speculation.drafter,
                            num_draft_tokens=speculation.num_draft_tokens, draft_policy=speculation.draft_policy,
                            chained_rounds=speculation.chained_rounds, verification_sink=self._log_verification,
                            target=target)
            engine.on_round = self._observe_round
            engine.overlap_drafting = config.overlap
            self.workers.append(Worker(addr, engine, self._on_done))
        for w in self.workers:
            w.start()

    # ------------------------------------------------------------------ callbacks (worker threads)

    def _observe_round(self, r: RoundSummary) -> None:
        self.metrics.observe_round(r.num_draft_tokens, r.num_accepted_tokens, r.accepted_per_pos, r.num_emitted_tokens,
                                   r.num_drafts)

    def _log_verification(self, record: VerificationRecord) -> None:
        x, y = record.labelled()
        if len(y):
            best_effort(self.store.append_log, f"{VERIFICATION_LOG}:{record.drafter}",
                        {"features": x.tolist(), "labels": y.tolist()}, why="verification log record dropped")

    def _on_done(self, sub: _Submission, c: Completion) -> None:
        self.metrics.observe_request(c.ttft_s, c.tpot_s if c.completion_tokens > 1 else None, c.latency_s,
                                     c.prompt_tokens, c.completion_tokens, c.finish_reason)
        drafter = self.drafters[0].name if self.drafters else "none"
        best_effort(self.store.incr, f"acceptance:{drafter}:{sub.category}", {
            "requests": 1, "num_drafted": c.spec.num_drafted, "num_accepted": c.spec.num_accepted,
            "num_emitted": c.spec.num_emitted, "num_steps": c.spec.num_steps}, why="acceptance counters not counted")

    # ------------------------------------------------------------------ API (event loop)

    @property
    def context_limit(self) -> int:
        """Tokens a request may hold in all (prompt + output): the verifiers' context."""
        return self.workers[0].engine.max_seq_len

    def make_request(self, prompt: Prompt | None, params: SamplingParams, *, prompt_ids: list[int] | None = None,
                     chat: bool = True, request_id: str | None = None, logprobs: bool = False) -> Request:
        """Validate and tokenize (no engine state is touched).

        Raises:
            InvalidRequestError: bad prompt or parameters.
        """
        rid = request_id or f"req-{next(self._ids)}"
        return self.workers[0].engine.make_request(prompt, params, prompt_ids=prompt_ids, chat=chat, request_id=rid,
                                                   logprobs=logprobs)

    def submit(self, request: Request, category: str = "default") -> tuple[str, "asyncio.Queue[Event]"]:
        """Queue ``request`` on the least loaded healthy replica; events arrive on the queue.

        Must be called from a running event loop.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(event: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        healthy = [w for w in self.workers if w.healthy] or self.workers
        worker = min(healthy, key=lambda w: w.load)
        sub = _Submission(request, sink, category or "default", worker)
        self._subs_by_id[request.request_id] = sub
        worker.submit(sub)
        return request.request_id, events

    def abort(self, request_id: str) -> None:
        """Cancel a request (client went away): frees its KV slots on the verifier and drafter."""
        sub = self._subs_by_id.pop(request_id, None)
        if sub is not None and sub.worker is not None:
            sub.worker.abort(request_id)

    def forget(self, request_id: str) -> None:
        """The front door is done with a finished request."""
        self._subs_by_id.pop(request_id, None)

    async def generate(self, request: Request, category: str = "default"):
        """Async iterator of events for one request; aborts it when the consumer stops early
        (client disconnect, cancellation). A ``request`` span covers its lifetime."""
        rid, events = self.submit(request, category)
        ended = asyncio.get_running_loop().create_future()

        async def request_span() -> None:  # a span may not cross the generator's yields (contexts differ)
            # OpenTelemetry's GenAI semantic conventions beside our own attributes
            with span("request", request_id=rid, category=category or "default",
                      **{"gen_ai.operation.name": "text_completion", "gen_ai.request.model": self.model_name,
                         "gen_ai.request.max_tokens": request.params.max_tokens,
                         "gen_ai.usage.input_tokens": len(request.prompt_ids)}) as s:
                outcome, completion = await ended
                s.set_attribute("outcome", outcome)
                if completion is not None:
                    s.set_attribute("gen_ai.usage.output_tokens", completion.completion_tokens)
                    s.set_attribute("gen_ai.response.finish_reasons", [completion.finish_reason])

        holder = asyncio.ensure_future(request_span())
        self._span_tasks.add(holder)
        holder.add_done_callback(self._span_tasks.discard)
        outcome, completion = "aborted", None
        try:
            while True:
                event = await events.get()
                if isinstance(event, (Done, Failed)):  # settled before the yield: a consumer may stop at it
                    outcome = "finished" if isinstance(event, Done) else "failed"
                    completion = event.completion if isinstance(event, Done) else None
                    yield event
                    return
                yield event
        finally:
            ended.set_result((outcome, completion))
            if outcome == "aborted":
                self.abort(rid)
            else:
                self.forget(rid)

    def probe(self) -> None:
        """Actively health-check every verifier and the drafter (gRPC health service, 1 s each), so
        /health and the router's own gRPC health follow them while no request runs: a verifier that
        died is marked unhealthy, one that came back healthy again; a drafter that came back is
        retried at the next round instead of after its back-off. Blocking: call from a thread."""
        for w in self.workers:
            if w.engine.target.probe():
                if not w.healthy:
                    log.info("verifier %s answers its health check again", w.name)
                w.healthy, w.last_error = True, None
            elif w.healthy:
                log.error("verifier %s fails its health check", w.name)
                w.healthy, w.last_error = False, "the verifier does not answer its health check"
        for d in self.drafters:
            d.reachable = d.probe()  # what /health reports (``available`` flips only when a round reconnects)
            if d.reachable and not d.available:
                d.retry_now()

    def health(self) -> dict:
        """Replica, drafter and state-store status (what /health reports; call ``probe`` first for
        live status)."""
        shared = isinstance(self.store, FallbackStore)
        store_up = True
        if shared:
            self.store.ping()
            store_up = self.store.up
        self.metrics.set_store_up(store_up)
        return {
            "verifiers": [{"address": w.name, "healthy": w.healthy, "error": w.last_error, "load": w.load}
                          for w in self.workers],
            "drafter": None if not self.drafters else {"address": self.config.drafter,
                                                       "available": all(d.reachable for d in self.drafters)},
            "state_store": {"backend": "redis" if shared else "memory",
                            "up": store_up,
                            "mode": ("shared" if store_up else "local: Redis unreachable, writes queued for replay")
                                    if shared else "local (in-memory; set TANDEM_REDIS_URL to share)",
                            "pending_writes": getattr(self.store, "pending", 0)},
        }

    def update_gauges(self) -> None:
        self.metrics.set_running(sum(len(w.engine.running) for w in self.workers))
        self.metrics.set_waiting(sum(len(w.engine.waiting) for w in self.workers))

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        for w in self.workers:
            w.engine.target.close()
        for d in self.drafters:
            d.close()
        self.store.close()
