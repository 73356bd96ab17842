"""A verifier replica's engine loop: one ``tandem.engine.Engine`` over the local target, stepped by
a thread of its own, serving whole requests from any number of routers.

The replica owns everything a decode step touches: the scheduler (continuous batching, admission),
the KV slots, the target's forwards and the drafters that live in the verify pass (SpecFormer) or
need no GPU (n-gram); a draft model may run here or behind a drafter service
(``services.drafter.client.RemoteDrafter``). Requests arrive whole (``submit``) and leave as
streamed deltas through a per-request sink: nothing crosses the network per round but a remote
drafter's traffic. Cancelling a request (``abort``) frees its slot at the next step, so a router
that dies mid-stream leaks nothing.

Shared state (``tandem.state``): the draft policy's threshold state (through ``DraftPolicy``),
acceptance counters per drafter and category, and the verification-log stream, in the replica's
store (Redis when configured, in-memory otherwise; a store that is down degrades to local state).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common import AcceptanceCategories, Delta, Done, Event, Failed
from tandem.engine import Completion, Engine, Request, RoundSummary
from tandem.errors import InvalidRequestError
from tandem.metrics import AcceptanceWindow
from tandem.predictor import VerificationRecord
from tandem.state import FallbackStore, InMemoryStore, StateStore, best_effort
from tandem.telemetry import Metrics
from tandem.warmup import capture_round_shapes

log = logging.getLogger(__name__)

VERIFICATION_LOG = "vlog"  # stream prefix: vlog:<drafter>, as `tandem collect-logs` reads it


@dataclass(frozen=True)
class Load:
    """What a replica holds (``ReplicaEngine.load``; the ``Load`` RPC reports it to routers).

    Attributes:
        num_slots: KV cache slots (requests decoding at once).
        running: requests decoding; waiting: requests queued for a slot (submitted ones not yet
            taken in by the engine thread included).
        queued_prompt_tokens: prompt tokens of the waiting requests (the prefill work ahead).
    """

    num_slots: int
    running: int
    waiting: int
    queued_prompt_tokens: int


@dataclass
class _Submission:
    request: Request
    sink: Callable[[list[tuple[str, Event]]], None]
    category: str


class ReplicaEngine:
    """The replica's engine, stepped by its own thread (see the module docstring).

    Args:
        engine: the engine over the local target, with the replica's speculation.
        metrics: Prometheus metrics fed per round and per finished request (None: none).
        store: shared state for acceptance counters (None: in-memory).
        drafter_name: names the acceptance counters (``acceptance:<drafter>:<category>``) of a
            replica without a drafter; with one, its current name does (a drafter service's own).
        capture_rounds: with CUDA graphs and rounds chained on the device, capture every round
            shape's graph before the engine thread starts (``tandem.warmup.capture_round_shapes``:
            a few seconds), so no request waits on a capture mid-traffic; a failure is logged and
            the replica serves on, capturing shapes as they come.
    """

    def __init__(self, engine: Engine, metrics: Metrics | None = None, store: StateStore | None = None,
                 drafter_name: str = "none", capture_rounds: bool = False) -> None:
        self.engine = engine
        self.metrics = metrics
        self.store = store or InMemoryStore()
        self.drafter_name = drafter_name
        self.categories = AcceptanceCategories()  # engine thread only (_on_done)
        self._inbox: queue.Queue = queue.Queue()
        self._subs: dict[str, _Submission] = {}
        self.recent = AcceptanceWindow()  # the acceptance of its last requests, reported with every Load poll
        self._load = Load(engine.target.info.num_slots, 0, 0, 0)
        self._submitted = 0  # submitted and not yet taken in by the engine thread (read by load())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # engine thread's totals since start (read by Load without a lock: each a single store)
        self.steps = 0
        self.step_s = 0.0  # inside engine.step()
        self.deliver_s = 0.0  # after each step: completions recorded, events handed to the sinks (messages built)
        engine.on_round = self._observe_round
        engine.cap_rounds = True  # a router's draft width (Load) may cap any round: no graph captures when it comes
        config = engine.runner_config
        if capture_rounds and config is not None and config.cuda_graphs and engine.chains_rounds:
            try:  # (after cap_rounds: the graphs captured are the ones its rounds will replay)
                capture_round_shapes(engine)
            except Exception as exc:  # noqa: BLE001 - the replica still serves: its rounds capture as they come
                log.warning("decode-round graphs not captured at start-up (%s); each is captured when first met", exc)
        if engine.drafter is not None and not engine.chains_rounds:
            # verification logs (the predictor's training data) need host-side draft features:
            # kept where rounds run on the host anyway, never at the cost of device-chained rounds
            engine.verification_sink = self._log_verification
        self._thread = threading.Thread(target=self._run, daemon=True, name="replica-engine")
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)

    def submit(self, request: Request, sink: Callable[[list[tuple[str, Event]]], None],
               category: str = "default") -> None:
        """Queue ``request`` (built by ``engine.make_request``); its events go to ``sink``, called
        from the engine thread once per step with (request id, event) for every event of that step
        of the requests that share the sink (a router's stream): ``Delta`` per step that emitted
        tokens, then ``Done`` or ``Failed``. ``category`` was checked where the request came in
        (``check_category``)."""
        with self._lock:
            self._submitted += 1
        self._inbox.put(("add", _Submission(request, sink, category)))

    def abort(self, request_id: str) -> None:
        """Drop a request (queued or running) and free its KV slot; its sink hears nothing more."""
        self._inbox.put(("abort", request_id))

    def load(self) -> Load:
        """The replica's load as of the last step, submissions since then counted as waiting."""
        with self._lock:
            pending = self._submitted
        current = self._load
        return Load(current.num_slots, current.running, current.waiting + pending, current.queued_prompt_tokens)

    def drafter_status(self) -> dict:
        """The drafter's name and, for a drafter service, its address and whether it answers (a
        live health check, 0.5 s; one that answers again is retried at the next round). Blocking."""
        d = self.engine.drafter
        if d is None:
            return {"name": "none", "address": "", "available": True}
        address = getattr(d, "address", None)
        if address is None:
            return {"name": d.name, "address": "", "available": True}
        d.reachable = d.probe(0.5)
        if d.reachable and not d.available:
            d.retry_now()
        return {"name": d.name, "address": address, "available": bool(d.reachable)}

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ callbacks (engine thread)

    def _observe_round(self, r: RoundSummary) -> None:
        if self.metrics is not None:
            self.metrics.observe_round(r.num_draft_tokens, r.num_accepted_tokens, r.accepted_per_pos,
                                       r.num_emitted_tokens, r.num_drafts, r.draft_width, r.acceptance_threshold)

    def _log_verification(self, record: VerificationRecord) -> None:
        x, y = record.labelled()
        if len(y):
            best_effort(self.store.append_log, f"{VERIFICATION_LOG}:{record.drafter}",
                        {"features": x.tolist(), "labels": y.tolist()}, why="verification log record dropped")

    def _on_done(self, sub: _Submission, c: Completion) -> None:
        self.recent.observe(c.spec)
        if self.metrics is not None:
            self.metrics.observe_request(c.ttft_s, c.tpot_s if c.completion_tokens > 1 else None, c.latency_s,
                                         c.prompt_tokens, c.completion_tokens, c.finish_reason)
        # the drafter's name as it is now: a drafter service's own (e.g. draft-model) once its stream
        # is up, as the verification logs name it (``VerificationRecord.drafter``)
        drafter = self.engine.drafter.name if self.engine.drafter is not None else self.drafter_name
        best_effort(self.store.incr, f"acceptance:{drafter}:{self.categories.key(sub.category)}", {
            "requests": 1, "num_drafted": c.spec.num_drafted, "num_accepted": c.spec.num_accepted,
            "num_emitted": c.spec.num_emitted, "num_steps": c.spec.num_steps}, why="acceptance counters not counted")

    # ------------------------------------------------------------------ engine thread

    def _drain(self, block: bool, timeout: float = 0.05) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            kind, arg = item
            if kind == "add":
                with self._lock:
                    self._submitted -= 1
                rid = arg.request.request_id
                try:
                    self.engine.submit(arg.request)
                    self._subs[rid] = arg
                except InvalidRequestError as exc:  # a duplicate id: refuse this one, keep the running one
                    arg.sink([(rid, Failed(str(exc), invalid=True))])
            elif kind == "abort" and arg in self._subs:
                self.engine.abort(arg)
                self._subs.pop(arg)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _note_load(self) -> None:
        e = self.engine
        self._load = Load(e.target.info.num_slots, len(e.running), len(e.waiting),
                          sum(len(r.prompt_ids) for r in e.waiting))

    def _fail_all(self, message: str) -> None:
        """A step failed: the engine's state for its requests is not to be trusted; fail them all."""
        batches = _Batches()
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            sub = self._subs.pop(rid, None)
            if sub is not None:
                batches.add(sub, rid, Failed(message))
        batches.deliver()

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.has_unfinished())
            self._note_load()
            if self._stop.is_set() or not engine.has_unfinished():
                continue
            wait = engine.intake_wait_s()
            if wait > 0.0:  # the intake window holds the queue back: take arrivals (and aborts) meanwhile
                self._drain(block=True, timeout=min(wait, 0.05))
                continue
            t0 = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug fails the requests, never the replica's thread
                log.exception("engine step failed")
                self._fail_all(f"internal error on the verifier replica: {exc}")
                continue
            t1 = time.perf_counter()
            self.steps += 1
            self.step_s += t1 - t0
            batches = _Batches()
            for out in outputs:
                sub = self._subs.get(out.request_id)
                if sub is None:
                    continue
                batches.add(sub, out.request_id, Delta(out))
                if out.finished:
                    completion = engine.completion(out.request_id)
                    self._subs.pop(out.request_id)
                    self._on_done(sub, completion)
                    batches.add(sub, out.request_id, Done(completion))
            batches.deliver()
            self.deliver_s += time.perf_counter() - t1
        for rid in list(self._subs):  # stopping: what is left is aborted (its callers see the stream end)
            self.engine.abort(rid)


class _Batches:
    """One step's events grouped by sink: each sink is called once, with (request id, event) pairs."""

    def __init__(self) -> None:
        self._by_sink: dict[int, tuple[Callable, list]] = {}

    def add(self, sub: _Submission, request_id: str, event: Event) -> None:
        self._by_sink.setdefault(id(sub.sink), (sub.sink, []))[1].append((request_id, event))

    def deliver(self) -> None:
        for sink, events in self._by_sink.values():
            sink(events)


def store_status(store: StateStore) -> dict:
    """The store's backend, whether it is up, and writes queued while it was not."""
    shared = isinstance(store, FallbackStore)
    up = True
    if shared:
        store.ping()
        up = store.up
    return {"backend": "redis" if shared else "memory", "up": up, "pending_writes": int(getattr(store, "pending", 0))}
