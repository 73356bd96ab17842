"""Drafter gRPC server: ``tandem.v1.Drafter`` over any ``tandem.drafters`` drafter.

Each ``Draft`` stream owns its sequences: the router's ``seq_id`` maps to a slot of the wrapped
drafter (a draft model's KV cache slot), and the stream's accepted-token deltas keep the
drafter's view of each sequence; the wrapped drafter syncs its own cache to that view (it rolls
back whatever was rejected). Every slot of a stream is released when the stream ends.

Sampled requests: the wrapped drafter samples from ``q`` truncated to its ``max_probs_per_token``
most likely tokens (``top_k = min(top_k, K)``), so the sparse ``q`` sent back is exactly the
distribution each draft was drawn from and speculative sampling on the verifier stays lossless.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace

import grpc
import torch

from services.common import GrpcServer, messages_until, params_from_pb, probs_to_sparse, probs_to_sparse_batch
from services.proto.tandem.v1 import drafter_pb2, drafter_pb2_grpc
from tandem.drafters.base import NUM_FEATURES, DraftProposal, DraftRequest, Drafter
from tandem.errors import InvalidRequestError
from tandem.models.kv_cache import SlotPool
from tandem.sampling import SamplingParams, request_generator
from tandem.telemetry import extract_context, span

log = logging.getLogger(__name__)

SERVICE_NAME = "tandem.v1.Drafter"


class _Sequence:
    def __init__(self, slot: int, params: SamplingParams, generator: torch.Generator | None) -> None:
        self.slot = slot
        self.params = params
        self.generator = generator
        self.tokens: list[int] = []


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Args:
        drafter: the wrapped drafter.
        max_sequences: slots the drafter can hold at once over all streams (a draft model's
            KV cache slots).
        max_probs_per_token: K of the top-k truncation of q for sampled requests.
        device: where sampled requests' generators live (the drafter's device).
    """

    def __init__(self, drafter: Drafter, max_sequences: int, max_probs_per_token: int = 64, device: str = "cpu",
                 predictor=None):
        self.drafter = drafter
        self.predictor = predictor  # AcceptancePredictor: drafts go out with predicted acceptance scores
        self.max_sequences = max_sequences
        self.max_probs_per_token = max_probs_per_token
        self.device = device
        self._slots = SlotPool(max_sequences, "drafter sequence slot")
        self._lock = threading.Lock()  # one propose at a time, whatever the stream
        self._closing = asyncio.Event()  # set by close_streams: the server is stopping

    def close_streams(self) -> None:
        """The server is stopping: every open ``Draft`` stream ends with UNAVAILABLE (its
        sequences released; the replica decodes target-only until a drafter is back)."""
        self._closing.set()

    async def Info(self, request, context):
        return drafter_pb2.DrafterInfo(name=self.drafter.name, num_features=NUM_FEATURES,
                                       max_sequences=self.max_sequences, max_probs_per_token=self.max_probs_per_token)

    async def Draft(self, request_iterator, context):
        seqs: dict[int, _Sequence] = {}
        parent = extract_context(context.invocation_metadata())
        try:
            async for msg in messages_until(request_iterator, self._closing):
                if msg.HasField("release"):
                    await asyncio.to_thread(self._release, seqs, list(msg.release.seq_ids))
                    continue
                try:
                    ctx = extract_context(msg.draft.trace_context.items()) if msg.draft.trace_context else parent
                    with span("rpc.server.draft", parent_context=ctx, round=int(msg.draft.round),
                              sequences=len(msg.draft.sequences)):
                        out = await asyncio.to_thread(self._draft, seqs, msg.draft)
                except InvalidRequestError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                yield out
            if self._closing.is_set():
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter service is shutting down")
        finally:
            await asyncio.to_thread(self._release, seqs, list(seqs))

    # ------------------------------------------------------------------ blocking part (worker thread)

    def _release(self, seqs: dict[int, _Sequence], ids: list[int]) -> None:
        with self._lock:
            for sid in ids:
                seq = seqs.pop(sid, None)
                if seq is not None:
                    self.drafter.release(seq.slot)
                    self._slots.free(seq.slot)

    def _draft(self, seqs: dict[int, _Sequence], batch) -> drafter_pb2.DraftBatch:
        asks: list[DraftRequest] = []
        with self._lock:
            for d in batch.sequences:
                seq = seqs.get(d.seq_id)
                if seq is None:
                    if d.base_len:
                        raise InvalidRequestError(f"sequence {d.seq_id} is new to this stream: send it whole (base_len 0)")
                    if not self._slots.num_free():
                        raise InvalidRequestError(f"the drafter holds {self.max_sequences} sequences at most")
                    params = params_from_pb(d.params)
                    if not params.greedy:  # sample from the top-K truncation of q: exactly what is sent back
                        k = self.max_probs_per_token
                        params = replace(params, top_k=min(params.top_k, k) if params.top_k else k)
                    gen = request_generator(params, self.device, drafter=True)
                    seq = seqs[d.seq_id] = _Sequence(self._slots.allocate(), params, gen)
                if d.base_len > len(seq.tokens):
                    raise InvalidRequestError(f"sequence {d.seq_id}: base_len {d.base_len} > {len(seq.tokens)} held")
                del seq.tokens[d.base_len:]
                seq.tokens.extend(int(t) for t in d.tokens)
                if not seq.tokens:
                    raise InvalidRequestError(f"sequence {d.seq_id} is empty")
                asks.append(DraftRequest(seq.slot, list(seq.tokens), int(d.max_draft), seq.params, seq.generator))
            proposals = self.drafter.propose(asks)
        drafted = [p for p in proposals if p.tokens]
        if self.predictor is not None and drafted:  # one predictor call for the whole batch
            scores = self.predictor.predict(torch.cat([p.features for p in drafted]))
            for p, part in zip(drafted, scores.split([len(p.tokens) for p in drafted])):
                p.scores = part
        return drafter_pb2.DraftBatch(round=batch.round, proposals=_proposals_pb(
            [d.seq_id for d in batch.sequences], proposals, self.max_probs_per_token))


def _proposals_pb(seq_ids: list[int], proposals: list[DraftProposal],
                  max_probs: int) -> list[drafter_pb2.DraftProposal]:
    """The wire form of a batch's proposals. When every non-empty proposal has features and top
    tokens of one shape, they leave the tensors in one conversion each for the batch (three per
    proposal cost ~1 ms a batch of 64), as do scores and the sampled proposals' q (sparse, at
    most ``max_probs`` entries a row: ``probs_to_sparse_batch``); else each proposal converts
    its own."""
    drafted = [p for p in proposals if p.tokens]
    shapes = {(p.features.shape[1] if p.features.ndim == 2 else -1,
               p.top_tokens.shape[1] if p.top_tokens is not None else 0, p.scores is not None) for p in drafted}
    if len(shapes) != 1 or next(iter(shapes))[0] < 0:
        return [_proposal_pb(sid, p) for sid, p in zip(seq_ids, proposals)]
    nf, m, scored = shapes.pop()
    feats = torch.cat([p.features.float() for p in drafted]).flatten().tolist()
    top = torch.cat([p.top_tokens for p in drafted]).flatten().tolist() if m else []
    scores = torch.cat([p.scores.float() for p in drafted]).tolist() if scored else []
    sparse = iter(probs_to_sparse_batch([p.probs for p in drafted if p.probs is not None], max_probs))
    out, at = [], 0
    for sid, p in zip(seq_ids, proposals):
        n = len(p.tokens)
        out.append(drafter_pb2.DraftProposal(
            seq_id=sid, tokens=p.tokens, probs=[next(sparse) for _ in range(n)] if p.probs is not None else [],
            features=feats[at * nf:(at + n) * nf], num_features=nf, top_tokens=top[at * m:(at + n) * m],
            top_m=m if n else 0, scores=scores[at:at + n]))
        at += n
    return out


def _proposal_pb(seq_id: int, p: DraftProposal) -> drafter_pb2.DraftProposal:
    top = p.top_tokens
    return drafter_pb2.DraftProposal(
        seq_id=seq_id, tokens=p.tokens, probs=probs_to_sparse(p.probs) if p.probs is not None else [],
        features=p.features.float().flatten().tolist(), num_features=int(p.features.shape[1]) if p.features.ndim == 2 else NUM_FEATURES,
        top_tokens=top.flatten().tolist() if top is not None else [], top_m=int(top.shape[1]) if top is not None else 0,
        scores=p.scores.float().tolist() if p.scores is not None else [])


async def serve(drafter: Drafter, max_sequences: int, port: int = 0, host: str = "127.0.0.1", key: str | None = None,
                device: str = "cpu", max_probs_per_token: int = 64, ready: "asyncio.Future | None" = None,
                stop: "asyncio.Event | None" = None, predictor=None) -> None:
    """Run the drafter server until ``stop`` is set (forever without one).

    Args:
        max_probs_per_token: K of the top-K truncation of q for sampled requests.
        ready: resolved with the bound address once serving.
    """
    server = GrpcServer(port, host, key)
    servicer = DrafterServicer(drafter, max_sequences, max_probs_per_token, device, predictor)
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server.server)
    await server.serve_until([SERVICE_NAME], ready, stop, close_streams=servicer.close_streams)
