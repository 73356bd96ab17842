"""Verifier gRPC server: ``tandem.v1.Verifier`` over a ``tandem.target.LocalTarget``.

Each ``Verify`` stream owns its sequences: the router's ``seq_id`` maps to a KV slot of this
target, and every slot of a stream is freed when the stream ends (router gone, cancelled).
Forwards run one at a time in a worker thread, so several streams (router replicas) share the
model safely.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import torch

from services.common import GrpcServer, params_from_pb, sparse_to_probs, tensor_to_pb
from services.proto.tandem.v1 import verifier_pb2, verifier_pb2_grpc
from tandem.drafters.base import NUM_FEATURES, DraftProposal
from tandem.errors import InvalidRequestError
from tandem.models.kv_cache import CacheFullError
from tandem.target import LocalTarget, PrefillItem, TargetResult, VerifyItem
from tandem.telemetry import extract_context, span

log = logging.getLogger(__name__)

SERVICE_NAME = "tandem.v1.Verifier"


class _Stream:
    """Sequences of one Verify stream: seq_id -> (slot, params). Random numbers come from the
    target's counter-based draws keyed by each request's seed: the verifier holds no generator."""

    def __init__(self) -> None:
        self.seqs: dict[int, tuple[int, object]] = {}  # seq_id -> (slot, SamplingParams)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """Args:
        target: the local target model.
        eos_token_ids: the tokenizer's end-of-sequence ids (reported in ``Info``).
        cost: measured verifier cost T(b, q) as ``{b: {q: ms}}`` (reported in ``Info``).
    """

    def __init__(self, target: LocalTarget, eos_token_ids: list[int], cost: dict[int, dict[int, float]] | None = None):
        self.target = target
        self.eos_token_ids = eos_token_ids
        self.cost = cost or {}
        self._lock = threading.Lock()  # one forward at a time, whatever the stream

    async def Info(self, request, context):
        i = self.target.info
        return verifier_pb2.VerifierInfo(
            model=i.model, vocab_size=i.vocab_size, num_slots=i.num_slots, max_seq_len=i.max_seq_len,
            eos_token_ids=self.eos_token_ids,
            cost=[verifier_pb2.CostPoint(batch_size=b, tokens_per_sequence=q, ms=ms)
                  for b, row in sorted(self.cost.items()) for q, ms in sorted(row.items())])

    async def Verify(self, request_iterator, context):
        stream = _Stream()
        parent = extract_context(context.invocation_metadata())
        try:
            async for batch in request_iterator:
                try:
                    ctx = extract_context(batch.trace_context.items()) if batch.trace_context else parent
                    with span("rpc.server.verify", parent_context=ctx, batch_id=int(batch.batch_id),
                              prefill=len(batch.prefill), verify=len(batch.verify)):
                        result = await asyncio.to_thread(self._run, stream, batch)
                except InvalidRequestError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                except CacheFullError as exc:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                yield result
        finally:
            await asyncio.to_thread(self._release_all, stream)

    # ------------------------------------------------------------------ blocking part (worker thread)

    def _release_all(self, stream: _Stream) -> None:
        with self._lock:
            for slot, _ in stream.seqs.values():
                self.target.free(slot)
            stream.seqs.clear()

    def _run(self, stream: _Stream, batch) -> verifier_pb2.VerifyResult:
        vocab = self.target.info.vocab_size
        with self._lock:
            for sid in batch.release:
                if sid in stream.seqs:
                    self.target.free(stream.seqs.pop(sid)[0])
            prefill: list[PrefillItem] = []
            # fewer free slots than the prefills need (another router holds them): refuse them all,
            # allocating nothing, and keep the stream (its running sequences) going
            refused = len(batch.prefill) > self.target.num_free()
            for p in [] if refused else batch.prefill:
                if p.seq_id in stream.seqs:
                    raise InvalidRequestError(f"sequence {p.seq_id} is already running")
                ids = list(p.prompt_ids)
                if not ids or min(ids) < 0 or max(ids) >= vocab:
                    raise InvalidRequestError(f"sequence {p.seq_id}: prompt ids must be non-empty and in [0, {vocab})")
                params = params_from_pb(p.params)
                slot = self.target.allocate()
                stream.seqs[p.seq_id] = (slot, params)
                prefill.append(PrefillItem(slot, ids, params, p.return_logprobs))
            verify: list[VerifyItem] = []
            for v in batch.verify:
                if v.seq_id not in stream.seqs:
                    raise InvalidRequestError(f"sequence {v.seq_id} is not running on this stream")
                slot, params = stream.seqs[v.seq_id]
                drafts = list(v.draft_tokens)
                if any(t < 0 or t >= vocab for t in drafts) or not 0 <= v.last_token < vocab:
                    raise InvalidRequestError(f"sequence {v.seq_id}: token ids must be in [0, {vocab})")
                probs = None
                if v.draft_probs:
                    if len(v.draft_probs) != len(drafts):
                        raise InvalidRequestError(f"sequence {v.seq_id}: one q row per draft token")
                    probs = sparse_to_probs(v.draft_probs, vocab).to(self.target.runner.device)
                parents = list(v.parents) if v.is_tree else None
                if parents is not None and (len(parents) != len(drafts)
                                            or any(not -1 <= q < i for i, q in enumerate(parents))):
                    raise InvalidRequestError(f"sequence {v.seq_id}: bad token-tree parents")
                prop = DraftProposal(drafts, probs, torch.zeros(len(drafts), NUM_FEATURES), None, parents)
                verify.append(VerifyItem(slot, int(v.last_token), prop, params, v.return_logprobs))
            try:
                pre = self.target.prefill(prefill) if prefill else []
            except CacheFullError:
                for p in batch.prefill:  # the prompt does not fit: undo this batch's admissions
                    if p.seq_id in stream.seqs:
                        self.target.free(stream.seqs.pop(p.seq_id)[0])
                raise
            ver = self.target.verify(verify) if verify else []
        return verifier_pb2.VerifyResult(
            batch_id=batch.batch_id, prefill_refused=refused,
            prefill=[_result_pb(p.seq_id, r) for p, r in zip(batch.prefill, pre)],
            verify=[_result_pb(v.seq_id, r) for v, r in zip(batch.verify, ver)])


def _result_pb(seq_id: int, r: TargetResult) -> verifier_pb2.SequenceResult:
    return verifier_pb2.SequenceResult(seq_id=seq_id, tokens=r.tokens, num_accepted=r.num_accepted,
                                       logprobs=r.logprobs or [],
                                       extras=[tensor_to_pb(k, t) for k, t in r.extras.items()])


async def serve(target: LocalTarget, eos_token_ids: list[int], port: int = 0, host: str = "127.0.0.1",
                key: str | None = None, cost: dict[int, dict[int, float]] | None = None,
                ready: "asyncio.Future | None" = None, stop: "asyncio.Event | None" = None) -> None:
    """Run the verifier server until ``stop`` is set (forever without one).

    Args:
        ready: resolved with the bound address once serving.
    """
    server = GrpcServer(port, host, key)
    verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(target, eos_token_ids, cost), server.server)
    await server.serve_until([SERVICE_NAME], ready, stop)
