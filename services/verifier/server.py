"""Verifier replica gRPC server: ``tandem.v1.Verifier`` over a ``ReplicaEngine``.

``Generate`` takes one whole request and streams its accepted tokens; the engine loop (scheduler,
KV slots, drafts, verification) runs here, beside the weights. A call that ends early (the router
cancelled it, or died) aborts its request and frees its KV slot. ``Load`` reports what the replica
holds, for routers to balance on.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common import Delta, Done, Failed, GrpcServer, params_from_pb
from services.proto.tandem.v1 import verifier_pb2, verifier_pb2_grpc
from tandem.errors import InvalidRequestError
from tandem.metrics import SpecDecodeStats
from tandem.requests import Completion, RequestOutput
from tandem.telemetry import extract_context, span

from .replica import ReplicaEngine, store_status

log = logging.getLogger(__name__)

SERVICE_NAME = "tandem.v1.Verifier"


def spec_to_pb(s: SpecDecodeStats) -> verifier_pb2.SpecStats:
    return verifier_pb2.SpecStats(num_steps=s.num_steps, num_emitted=s.num_emitted, num_drafted=s.num_drafted,
                                  num_accepted=s.num_accepted, drafted_per_pos=s.drafted_per_pos,
                                  accepted_per_pos=s.accepted_per_pos)


def spec_from_pb(m: verifier_pb2.SpecStats) -> SpecDecodeStats:
    return SpecDecodeStats(int(m.num_steps), int(m.num_emitted), int(m.num_drafted), int(m.num_accepted),
                           [int(x) for x in m.drafted_per_pos], [int(x) for x in m.accepted_per_pos])


def event_pb(out: RequestOutput, completion: Completion | None = None) -> verifier_pb2.ReplicaEvent:
    """One streamed message: ``out``'s tokens; with ``completion`` also the end (finish and stop
    reasons, the request's speculative-decoding counters)."""
    msg = verifier_pb2.ReplicaEvent(token_ids=out.new_token_ids, text=out.text_delta, logprobs=out.logprobs or [],
                                    token_texts=(out.token_texts or []) if out.logprobs else [])
    if completion is not None:
        msg.finished = True
        msg.finish_reason = completion.finish_reason
        if isinstance(completion.stop_reason, str):
            msg.stop_string = completion.stop_reason
        elif completion.stop_reason is not None:
            msg.stop_token_id = int(completion.stop_reason)
        msg.spec.CopyFrom(spec_to_pb(completion.spec))
    return msg


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one (``b`` after ``a``)."""
    lp = (a.logprobs or []) + (b.logprobs or []) if a.logprobs is not None or b.logprobs is not None else None
    texts = (a.token_texts or []) + (b.token_texts or []) if a.token_texts is not None or b.token_texts is not None \
        else None
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, a.text_delta + b.text_delta, b.finished,
                         b.finish_reason, lp, texts, b.stop_reason)


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
        self.speculation = speculation

    async def Info(self, request, context):
        i = self.replica.engine.target.info
        return verifier_pb2.VerifierInfo(
            model=i.model, vocab_size=i.vocab_size, num_slots=i.num_slots, max_seq_len=self.replica.engine.max_seq_len,
            eos_token_ids=self.eos_token_ids, speculation=self.speculation,
            cost=[verifier_pb2.CostPoint(batch_size=b, tokens_per_sequence=q, ms=ms)
                  for b, row in sorted(self.cost.items()) for q, ms in sorted(row.items())])

    async def Load(self, request, context):
        load = self.replica.load()
        store, drafter = await asyncio.gather(asyncio.to_thread(store_status, self.replica.store),
                                              asyncio.to_thread(self.replica.drafter_status))
        return verifier_pb2.LoadReport(num_slots=load.num_slots, running=load.running, waiting=load.waiting,
                                       queued_prompt_tokens=load.queued_prompt_tokens,
                                       state_store=verifier_pb2.StateStoreStatus(**store),
                                       drafter=verifier_pb2.DrafterStatus(**drafter))

    async def Generate(self, request, context):
        engine = self.replica.engine
        try:
            if not request.request_id:
                raise InvalidRequestError("request_id is required")
            req = engine.make_request(prompt_ids=list(request.prompt_ids), params=params_from_pb(request.params),
                                      request_id=request.request_id, logprobs=request.logprobs)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        with span("generate", parent_context=extract_context(context.invocation_metadata()),
                  request_id=req.request_id, prompt_tokens=len(req.prompt_ids)):
            self.replica.submit(req, lambda e: loop.call_soon_threadsafe(events.put_nowait, e), request.category)
        settled = False
        held: RequestOutput | None = None  # the last delta, held until its completion arrives
        try:
            while True:
                # every event queued by now goes out in one message: when the loop falls behind the
                # engine's steps, a request's deltas coalesce instead of costing a message each
                events_now = [await events.get()]
                while not events.empty():
                    events_now.append(events.get_nowait())
                pending, held = held, None
                for event in events_now:
                    if isinstance(event, Delta):
                        pending = event.output if pending is None else merge_outputs(pending, event.output)
                    elif isinstance(event, Done):
                        settled = True
                        yield event_pb(pending or RequestOutput(req.request_id, [], "", True,
                                                                event.completion.finish_reason), event.completion)
                        return
                    elif isinstance(event, Failed):
                        settled = True
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT if event.invalid
                                            else grpc.StatusCode.INTERNAL, event.message)
                if pending is not None and not pending.finished and (pending.new_token_ids or pending.text_delta):
                    yield event_pb(pending)
                elif pending is not None and pending.finished:  # sent with the completion that follows it
                    held = pending
        finally:
            if not settled:  # cancelled by the caller (or the server stopping): free the slot
                self.replica.abort(req.request_id)


async def serve(replica: ReplicaEngine, eos_token_ids: list[int], port: int = 0, host: str = "127.0.0.1",
                key: str | None = None, cost: dict[int, dict[int, float]] | None = None, speculation: str = "",
                ready: "asyncio.Future | None" = None, stop: "asyncio.Event | None" = None) -> None:
    """Run the verifier replica's server until ``stop`` is set (forever without one).

    Args:
        ready: resolved with the bound address once serving.
    """
    server = GrpcServer(port, host, key)
    verifier_pb2_grpc.add_VerifierServicer_to_server(
        VerifierServicer(replica, eos_token_ids, cost, speculation), server.server)
    await server.serve_until([SERVICE_NAME], ready, stop)
