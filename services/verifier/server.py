"""Verifier replica gRPC server: ``tandem.v1.Verifier`` over a ``ReplicaEngine``.

``Generate`` is one stream per router: whole requests in, their accepted tokens out, one message
per engine step for all the stream's requests that step touched, their plain deltas in packed
columns (a request per message, or a message field per request, would cost the replica's event
loop and engine thread, which share one interpreter, work per request per step). The engine loop
(scheduler, KV slots, drafts, verification) runs here, beside the weights. A stream that ends (the router went away) aborts its requests and frees
their KV slots. ``Load`` reports what the replica holds, for routers to balance on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from services.common import (Delta, Done, Failed, GrpcServer, check_category, merge_outputs, params_from_pb,
                             top_to_pb)
from services.proto.tandem.v1 import verifier_pb2, verifier_pb2_grpc
from tandem.errors import InvalidRequestError
from tandem.metrics import SpecDecodeStats
from tandem.models.graphs import CapturedCall
from tandem.requests import Completion, RequestOutput
from tandem.telemetry import extract_context, span

from .replica import ReplicaEngine, store_status

log = logging.getLogger(__name__)

# What a router sets with its Load polls (the draft width, θ) is a lease: each lapses this long (s)
# after the last poll that carried it (a router that died or stopped budgeting leaves the replica's
# own k and θ to stand again).
BUDGET_LEASE_S = 3.0

SERVICE_NAME = "tandem.v1.Verifier"

# A replica whose θ controller observed no round this long (s) leaves its state out of its Load
# reports, so the routers' cluster θ is merged over the replicas that decode now: an idle
# replica's sums are discounted per round, and without rounds they would keep their weight.
THRESHOLD_STALE_S = 10.0


def threshold_report(policy) -> float:
    """θ a draft policy's next rounds use, as a replica reports it: a router's while one is set,
    else the best its own controller has measured, else its fixed θ."""
    if not policy.learns_threshold:
        return float(policy.fixed_threshold)
    if policy.threshold_override is not None:
        return float(policy.threshold_override)
    return float(policy.controller.acceptance_threshold)


def threshold_state_report(policy, now: float | None = None) -> verifier_pb2.ThresholdState | None:
    """A draft policy's θ controller as a ``Load`` report carries it: None for a policy that does
    not learn θ, and for a controller that observed no round in the last ``THRESHOLD_STALE_S``
    seconds (``now``: ``time.monotonic()``, by default the current time)."""
    if policy is None or not policy.learns_threshold:
        return None
    ctl = policy.controller
    now = time.monotonic() if now is None else now
    if ctl.observed_at is None or now - ctl.observed_at > THRESHOLD_STALE_S:
        return None
    state = ctl.state_dict()
    return verifier_pb2.ThresholdState(grid=state["grid"], rounds=state["counts"], tokens=state["tokens"],
                                       ms=state["ms"])


def spec_to_pb(s: SpecDecodeStats) -> verifier_pb2.SpecStats:
    return verifier_pb2.SpecStats(num_steps=s.num_steps, num_emitted=s.num_emitted, num_drafted=s.num_drafted,
                                  num_accepted=s.num_accepted, drafted_per_pos=s.drafted_per_pos,
                                  accepted_per_pos=s.accepted_per_pos)


def spec_from_pb(m: verifier_pb2.SpecStats) -> SpecDecodeStats:
    return SpecDecodeStats(int(m.num_steps), int(m.num_emitted), int(m.num_drafted), int(m.num_accepted),
                           [int(x) for x in m.drafted_per_pos], [int(x) for x in m.accepted_per_pos])


def fill_event(msg: verifier_pb2.ReplicaEvent, out: RequestOutput,
               completion: Completion | None = None) -> verifier_pb2.ReplicaEvent:
    """Write ``out``'s tokens into ``msg``; with ``completion`` also the end (finish and stop
    reasons, the request's speculative-decoding counters, the seconds since its first token).
    Returns ``msg``."""
    msg.token_ids.extend(out.new_token_ids)
    msg.text = out.text_delta
    if out.logprobs:
        msg.logprobs.extend(out.logprobs)
        msg.token_texts.extend(out.token_texts or [])
    for alternatives in out.top_logprobs or ():
        msg.top_logprobs.append(top_to_pb(alternatives))
    if completion is not None:
        msg.finished = True
        msg.finish_reason = completion.finish_reason
        if isinstance(completion.stop_reason, str):
            msg.stop_string = completion.stop_reason
        elif completion.stop_reason is not None:
            msg.stop_token_id = int(completion.stop_reason)
        msg.spec.CopyFrom(spec_to_pb(completion.spec))
        msg.since_first_token_s = max(0.0, completion.latency_s - completion.ttft_s)
    return msg


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """Args:
        replica: the engine loop.
        eos_token_ids: the tokenizer's end-of-sequence ids (reported in ``Info``).
        cost: measured verifier cost T(b, q) as ``{b: {q: ms}}`` (reported in ``Info``).
        speculation: how the replica speculates, in words (reported in ``Info``).
    """

    def __init__(self, replica: ReplicaEngine, eos_token_ids: list[int], cost: dict[int, dict[int, float]] | None = None,
                 speculation: str = "") -> None:
        self.replica = replica
        self.eos_token_ids = eos_token_ids
        self.cost = cost or {}
        self._width_until = 0.0  # when the draft width a router last sent lapses (time.monotonic)
        self._threshold_until = 0.0  # when the θ a router last sent lapses
        self.speculation = speculation
        self._streams = itertools.count()
        self._open: set[asyncio.Queue] = set()  # each open Generate stream's queue of engine steps

    def close_streams(self) -> None:
        """The server is stopping: every open ``Generate`` stream ends with UNAVAILABLE (its
        requests aborted, their slots freed; the router resumes them elsewhere)."""
        for batches in self._open:
            batches.put_nowait(None)

    async def Info(self, request, context):
        i = self.replica.engine.target.info
        return verifier_pb2.VerifierInfo(
            model=i.model, vocab_size=i.vocab_size, num_slots=i.num_slots, max_seq_len=self.replica.engine.max_seq_len,
            eos_token_ids=self.eos_token_ids, speculation=self.speculation,
            cost=[verifier_pb2.CostPoint(batch_size=b, tokens_per_sequence=q, ms=ms)
                  for b, row in sorted(self.cost.items()) for q, ms in sorted(row.items())])

    async def Load(self, request, context):
        engine = self.replica.engine
        policy = engine.draft_policy
        now = time.monotonic()
        if request.HasField("acceptance_threshold") and not 0.0 <= request.acceptance_threshold <= 1.0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"acceptance_threshold must be in [0, 1], got {request.acceptance_threshold:.6g}")
        if request.HasField("draft_width"):  # a router's budget: the engine caps its next rounds at it ...
            engine.width_cap = int(request.draft_width)
            self._width_until = now + BUDGET_LEASE_S
        elif engine.width_cap is not None and now > self._width_until:  # ... while some router renews it
            engine.width_cap = None
        learns = policy is not None and policy.learns_threshold
        if learns and request.HasField("acceptance_threshold"):  # the cluster's θ, likewise a lease
            policy.threshold_override = round(float(request.acceptance_threshold), 4)  # float32 on the wire
            self._threshold_until = now + BUDGET_LEASE_S
        elif learns and policy.threshold_override is not None and now > self._threshold_until:
            policy.threshold_override = None
        load = self.replica.load()
        store, drafter = await asyncio.gather(asyncio.to_thread(store_status, self.replica.store),
                                              asyncio.to_thread(self.replica.drafter_status))
        report = verifier_pb2.LoadReport(num_slots=load.num_slots, running=load.running, waiting=load.waiting,
                                         queued_prompt_tokens=load.queued_prompt_tokens,
                                         state_store=verifier_pb2.StateStoreStatus(**store),
                                         drafter=verifier_pb2.DrafterStatus(**drafter),
                                         draft_limit=engine.configured_draft_limit, draft_width=engine.width_cap,
                                         graphs_captured=CapturedCall.made, engine_steps=self.replica.steps,
                                         engine_step_s=self.replica.step_s, engine_deliver_s=self.replica.deliver_s,
                                         engine_rounds=engine.num_rounds, engine_round_rows=engine.round_rows,
                                         engine_prefills=engine.admission.prefills,
                                         engine_prefill_s=engine.admission.prefill_total_s)
        drafted, accepted = self.replica.recent.totals()
        report.recent_drafted_per_pos.extend(drafted)
        report.recent_accepted_per_pos.extend(accepted)
        if policy is not None:
            threshold = threshold_report(policy)
            report.acceptance_threshold = threshold
            report.acceptance_threshold_set = learns and policy.threshold_override is not None
            state = threshold_state_report(policy, now)
            if state is not None:
                report.threshold.CopyFrom(state)
        return report

    async def Generate(self, request_iterator, context):
        """One router's stream: ``ReplicaCommands`` in, ``ReplicaEvents`` out (see the proto)."""
        loop = asyncio.get_running_loop()
        batches: asyncio.Queue = asyncio.Queue()  # (ReplicaEvents, settled router ids), one per engine step
        prefix = f"s{next(self._streams)}/"  # engine ids unique across streams; the router's id goes back out
        live: set[str] = set()  # this stream's requests not settled yet (router ids)

        def sink(events: list) -> None:
            # engine thread: the step's message is built here, so the event loop's share of the
            # interpreter per step is one queue hand-off and one write, not a conversion per request
            if loop.is_closed():  # the server is shutting down: nobody reads this stream any more
                return
            try:
                loop.call_soon_threadsafe(batches.put_nowait, self._events(events, prefix))
            except RuntimeError:  # (closed between the check and the call)
                pass

        def submit(r: verifier_pb2.ReplicaRequest) -> None:
            rid = r.request_id
            try:
                if not rid:
                    raise InvalidRequestError("request_id is required")
                if rid in live:
                    raise InvalidRequestError(f"request {rid!r} is already running on this stream")
                category = check_category(r.category)
                req = self.replica.engine.make_request(prompt_ids=list(r.prompt_ids), params=params_from_pb(r.params),
                                                       request_id=prefix + rid, logprobs=r.logprobs,
                                                       top_logprobs=r.top_logprobs, resumed=r.output_tokens,
                                                       final_only=r.final_only)
            except InvalidRequestError as exc:
                batches.put_nowait(self._events([(prefix + rid, Failed(str(exc), invalid=True))], prefix))
                return
            live.add(rid)
            with span("generate", parent_context=extract_context(r.trace_context.items()), request_id=rid,
                      prompt_tokens=len(req.prompt_ids)):
                self.replica.submit(req, sink, category)

        async def read_commands() -> None:
            async for cmds in request_iterator:
                for r in cmds.submit:
                    submit(r)
                for rid in cmds.abort:
                    if rid in live:
                        live.discard(rid)
                        self.replica.abort(prefix + rid)

        reader = asyncio.ensure_future(read_commands())
        self._open.add(batches)
        try:
            while True:
                step = await batches.get()
                if step is None:  # close_streams: the server is stopping
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier replica is shutting down")
                msg, settled = step
                live.difference_update(settled)
                while not batches.empty():  # every step queued by now goes out in the same message
                    more = batches.get_nowait()
                    if more is None:
                        batches.put_nowait(None)  # this message first, then the end
                        break
                    msg.MergeFrom(more[0])  # columns and events appended: each request's order holds
                    live.difference_update(more[1])
                if msg.events or msg.deltas.request_ids:
                    yield msg
        finally:
            self._open.discard(batches)
            reader.cancel()
            for rid in live:  # the stream ended (router gone, cancelled, server stopping): free their slots
                self.replica.abort(prefix + rid)

    @staticmethod
    def _events(events: list, prefix: str) -> tuple[verifier_pb2.ReplicaEvents, list[str]]:
        """(engine id, event) pairs as one message, and the router ids it settles (finished or
        failed): consecutive deltas of a request merged, a request's last delta sent with its
        completion, plain deltas (tokens and text only) in the message's columns (``StepDeltas``)."""
        merged: dict[str, list] = {}  # router id -> [RequestOutput | None, Done | Failed | None]
        cut = len(prefix)
        for eid, event in events:
            slot = merged.get(eid)
            if slot is None:
                slot = merged[eid] = [None, None]
            if isinstance(event, Delta):
                slot[0] = event.output if slot[0] is None else merge_outputs(slot[0], event.output)
            else:
                slot[1] = event
        out = verifier_pb2.ReplicaEvents()
        settled = []
        ids, counts, tokens, texts = [], [], [], []
        for eid, (delta, end) in merged.items():
            rid = eid[cut:]
            if end is None:
                if delta.logprobs is None and delta.top_logprobs is None:
                    if delta.new_token_ids or delta.text_delta:
                        ids.append(rid)
                        counts.append(len(delta.new_token_ids))
                        tokens += delta.new_token_ids
                        texts.append(delta.text_delta)
                elif delta.new_token_ids or delta.text_delta:
                    fill_event(out.events.add(request_id=rid), delta)
            elif isinstance(end, Failed):
                settled.append(rid)
                out.events.append(verifier_pb2.ReplicaEvent(request_id=rid, error=end.message or "failed",
                                                            invalid=end.invalid))
            else:  # Done
                settled.append(rid)
                fill_event(out.events.add(request_id=rid),
                           delta or RequestOutput(rid, [], "", True, end.completion.finish_reason), end.completion)
        if ids:
            d = out.deltas
            d.request_ids.extend(ids)
            d.num_tokens.extend(counts)
            d.token_ids.extend(tokens)
            d.texts.extend(texts)
        return out, settled


async def serve(replica: ReplicaEngine, eos_token_ids: list[int], port: int = 0, host: str = "127.0.0.1",
                key: str | None = None, cost: dict[int, dict[int, float]] | None = None, speculation: str = "",
                ready: "asyncio.Future | None" = None, stop: "asyncio.Event | None" = None) -> None:
    """Run the verifier replica's server until ``stop`` is set (forever without one).

    Args:
        ready: resolved with the bound address once serving.
    """
    server = GrpcServer(port, host, key)
    servicer = VerifierServicer(replica, eos_token_ids, cost, speculation)
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server.server)
    await server.serve_until([SERVICE_NAME], ready, stop, close_streams=servicer.close_streams)
