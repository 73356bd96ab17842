"""The verifier replica's client of a drafter service: ``RemoteDrafter`` is a
``tandem.drafters.Drafter``, so ``tandem.engine.Engine`` schedules it exactly as it schedules a
local drafter.

It keeps one bidirectional stream open (blocking gRPC; the engine runs in its own thread) and
sends one message per round, waiting for its answer with a timeout; the next round's drafts are
requested while the target verifies this one (``prefetch``).

Faults: a drafter that fails or times out is marked down: the engine gets empty proposals
(target-only decoding, identical output under greedy) and the client reconnects with backoff; a
new stream starts from full sequences, since the drafter's state belonged to the old one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from itertools import chain

import grpc
import torch

from services.common import (CLIENT_OPTIONS, auth_metadata, params_to_pb, probe_health, sparse_to_probs,
                             traced_channel)
from services.proto.tandem.v1 import drafter_pb2, drafter_pb2_grpc
from tandem.drafters.base import NUM_FEATURES, DraftProposal, DraftRequest, Drafter, KeepDrafting, common_prefix
from tandem.telemetry import inject_metadata, span

log = logging.getLogger(__name__)

_CLOSE = object()
PREFETCH_MIN_COVERED = 0.25  # prefetch every round while at least this share of prefetches covered their round ...
PREFETCH_MAX_DELAY = 0.1  # ... or while waiting for a prefetch's answer costs at most this share of a round trip
PREFETCH_PROBE_EVERY = 16  # else prefetch one round in this many
PREFETCH_AVERAGING = 0.25  # weight of the newest round in these moving averages


class BidiStream:
    """One bidirectional gRPC stream used as request/response: ``call(msg, timeout_s)`` sends a
    message and returns the next response.

    Raises (from ``call``):
        grpc.RpcError: the stream failed; TimeoutError: no answer in time; EOFError: the server
        ended the stream.
    """

    def __init__(self, method, metadata: list[tuple[str, str]]) -> None:
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        self._call = method(iter(self._out.get, _CLOSE), metadata=metadata)
        self._reader = threading.Thread(target=self._read, daemon=True, name="grpc-stream-reader")
        self._reader.start()

    def _read(self) -> None:
        try:
            for msg in self._call:
                self._in.put(msg)
            self._in.put(EOFError("the server closed the stream"))
        except grpc.RpcError as exc:
            self._in.put(exc)
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller
            self._in.put(exc)

    def send(self, msg) -> None:
        self._out.put(msg)

    def call(self, msg, timeout_s: float):
        self._out.put(msg)
        return self.recv(timeout_s)

    def recv(self, timeout_s: float):
        """The next response (see the class docstring for the errors)."""
        try:
            item = self._in.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no answer within {timeout_s:.1f} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._out.put(_CLOSE)
        self._call.cancel()


def _rpc_error_text(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__


class RemoteDrafter(Drafter):
    """``tandem.v1.Drafter`` client as a ``Drafter``: sends each sequence's accepted-token delta
    (what the drafter has not seen yet) with its draft request.

    Args:
        address: ``host:port`` of a drafter.
        vocab_size: the target's vocabulary (dense q rows are rebuilt at this size).
        key: bearer token (None: no auth).
        timeout_s: longest wait for one draft batch (s); past it the drafter counts as down.
        retry_s: first reconnection delay after a failure (s); doubles up to ``max_retry_s``.
        resolve: returns the drafter's current address; asked again after a failure (a Ray Serve
            replica that was replaced listens elsewhere). None: ``address`` for good.
        device: where sampled drafts' q is rebuilt from its sparse rows (the target's device,
            where verification reads it).
    """

    prefetches = True  # drafts the next round on the drafter service while the target verifies

    def __init__(self, address: str, vocab_size: int, key: str | None = None, timeout_s: float = 10.0,
                 retry_s: float = 0.5, max_retry_s: float = 5.0, resolve: Callable[[], str] | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.address = address
        self.device = torch.device(device)
        self._resolve = resolve
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.retry_s, self.max_retry_s = retry_s, max_retry_s
        self._metadata = auth_metadata(key)
        self._channel = traced_channel(address, CLIENT_OPTIONS)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        self.probe = lambda timeout_s=1.0: probe_health(self._channel, self._metadata, timeout_s)
        self._stream: BidiStream | None = None
        self._synced: dict[int, list[int]] = {}  # slot -> the sequence as the drafter holds it
        self._rounds = 0
        self._down_until = 0.0
        self._backoff = retry_s
        self.name = "remote"
        self.available = True
        self.reachable = True  # last health-check result (what /health reports)
        self._pending: dict[int, list[int]] | None = None  # prefetch in flight: slot -> sequence it drafts from
        self.prefetch_hits = 0  # next-round drafts that were ready when verification returned
        self.prefetch_misses = 0
        self.prefetch_skipped = 0  # rounds not prefetched: prefetches rarely covered rounds and held them up
        self._covered = 1.0  # moving average: how often a prefetch covered every sequence of its round
        self._prefetch_wait = 0.0  # moving average: seconds a round waited for its prefetch's answer
        self._round_trip = 0.0  # moving average: seconds a round waited for drafts asked for after verification
        self._asks = 0  # prefetch opportunities (``prefetch`` calls)

    def _connect(self) -> BidiStream:
        if self._resolve is not None and not self.available:
            try:
                address = self._resolve()
            except Exception as exc:  # noqa: BLE001 - whatever the resolver raises, the drafter is down
                raise EOFError(f"cannot resolve the drafter's address: {exc}") from None
            if address != self.address:
                log.warning("drafter moved from %s to %s", self.address, address)
                self._channel.close()
                self.address = address
                self._channel = traced_channel(address, CLIENT_OPTIONS)
                self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        info = self._stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=min(self.timeout_s, 2.0),
                               metadata=self._metadata)
        self.name = info.name
        self._synced.clear()  # a new stream starts from full sequences
        return BidiStream(self._stub.Draft, inject_metadata(self._metadata))

    def _mark_down(self, exc: BaseException) -> None:
        self._pending = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._synced.clear()
        if self.available:
            log.warning("drafter %s unavailable (%s); decoding target-only until it returns",
                        self.address, _rpc_error_text(exc))
        self.available = False
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.max_retry_s)

    def retry_now(self) -> None:
        """The drafter answers health checks again: reconnect at the next round, not after the back-off."""
        self._down_until = 0.0

    def _deltas(self, requests: list[DraftRequest]) -> list[drafter_pb2.SequenceDelta]:
        """Each sequence as what the drafter holds (base_len) plus what it has not seen."""
        seqs = []
        for r in requests:
            held = self._synced.get(r.slot)
            n = common_prefix(held, r.token_ids) if held is not None else 0
            seqs.append(drafter_pb2.SequenceDelta(seq_id=r.slot, base_len=n, tokens=r.token_ids[n:],
                                                  max_draft=r.max_draft,
                                                  params=params_to_pb(r.params) if held is None else None))
        return seqs

    def _send(self, requests: list[DraftRequest], wait: bool):
        """Send one draft batch (connecting first if needed); return its answer when ``wait``."""
        seqs = self._deltas(requests)
        if self._stream is None:
            self._stream = self._connect()
            for s, r in zip(seqs, requests):  # everything is new to a new stream
                s.base_len, s.tokens[:] = 0, r.token_ids
                s.params.CopyFrom(params_to_pb(r.params))
        self._rounds += 1
        msg = drafter_pb2.DraftStreamRequest(draft=drafter_pb2.DraftRequestBatch(round=self._rounds, sequences=seqs))
        for r in requests:
            self._synced[r.slot] = list(r.token_ids)
        if not wait:
            self._stream.send(msg)
            return None
        with span("rpc.client.draft", address=self.address, sequences=len(seqs)):
            msg.draft.trace_context.update(dict(inject_metadata()))  # parent of this round's server span
            return self._check(self._stream.call(msg, self.timeout_s), self._rounds, len(requests))

    @staticmethod
    def _check(batch, round_id: int, n: int):
        if batch.round != round_id or len(batch.proposals) != n:
            raise EOFError(f"drafter answered round {batch.round} with {len(batch.proposals)} proposals, "
                           f"expected round {round_id} with {n}")
        return batch

    def prefetch(self, requests: list[DraftRequest]) -> None:
        """Send the next round's draft requests now (the drafter works while the target
        verifies); ``propose`` uses the answers whose guessed bonus token came true.

        A round waits for the drafter unless the prefetch covered every one of its sequences,
        and the drafter serves the prefetch before the round's own request. A prefetch whose
        answer is ready when verification ends costs nothing (a drafter on a GPU of its own);
        one that is not holds the round up. So while fewer than ``PREFETCH_MIN_COVERED`` of
        recent prefetches covered their whole round (every draft accepted and the bonus guessed,
        for every sequence: rare at large batches) and waiting for their answers took more than
        ``PREFETCH_MAX_DELAY`` of a round trip, only one round in ``PREFETCH_PROBE_EVERY``
        prefetches, to keep both estimates current."""
        if self._pending is not None or self._stream is None or time.monotonic() < self._down_until:
            return
        self._asks += 1
        if (self._covered < PREFETCH_MIN_COVERED and self._prefetch_wait > PREFETCH_MAX_DELAY * self._round_trip
                and self._asks % PREFETCH_PROBE_EVERY):
            self.prefetch_skipped += 1
            return
        try:
            self._send(requests, wait=False)
        except (grpc.RpcError, TimeoutError, EOFError) as exc:
            self._mark_down(exc)
            return
        self._pending = {r.slot: list(r.token_ids) for r in requests}
        self._pending_round = self._rounds

    def _take_prefetched(self, requests: list[DraftRequest]) -> dict[int, DraftProposal]:
        """Wait for the prefetch in flight; the proposals it got right, by slot."""
        pending, self._pending = self._pending, None
        t0 = time.perf_counter()
        with span("rpc.client.draft", address=self.address, sequences=len(pending), prefetched=True):
            batch = self._check(self._stream.recv(self.timeout_s), self._pending_round, len(pending))
        self._prefetch_wait += PREFETCH_AVERAGING * (time.perf_counter() - t0 - self._prefetch_wait)
        by_slot = {p.seq_id: p for p in batch.proposals}
        hits: dict[int, DraftProposal] = {}
        for r in requests:
            base, p = pending.get(r.slot), by_slot.get(r.slot)
            if base is None or p is None:
                continue
            # the guess (first prefetched token) must be the token the target emitted after base
            if len(p.tokens) > 1 and len(r.token_ids) == len(base) + 1 and r.token_ids[-1] == p.tokens[0] \
                    and r.token_ids[:-1] == base:
                hits[r.slot] = self._proposal(p, skip=1, limit=r.max_draft)
                self.prefetch_hits += 1
            else:
                self.prefetch_misses += 1
        return hits

    def propose(self, requests: list[DraftRequest], keep_drafting: KeepDrafting | None = None) -> list[DraftProposal]:
        if not any(r.max_draft > 0 for r in requests) or time.monotonic() < self._down_until:
            if self._pending is not None:  # its answer must still be read off the stream
                try:
                    self._take_prefetched([])
                except (grpc.RpcError, TimeoutError, EOFError) as exc:
                    self._mark_down(exc)
            return [DraftProposal.empty() for _ in requests]
        try:
            prefetched = self._pending is not None
            ready = self._take_prefetched(requests) if prefetched else {}
            rest = [r for r in requests if r.slot not in ready]
            if prefetched:
                self._covered += PREFETCH_AVERAGING * ((not rest) - self._covered)
            if rest:
                t0 = time.perf_counter()
                batch = self._send(rest, wait=True)
                self._round_trip += PREFETCH_AVERAGING * (time.perf_counter() - t0 - self._round_trip)
                for r, p in zip(rest, self._proposals(batch.proposals)):
                    ready[r.slot] = p
        except (grpc.RpcError, TimeoutError, EOFError) as exc:
            self._mark_down(exc)
            return [DraftProposal.empty() for _ in requests]
        if not self.available:
            log.info("drafter %s is back", self.address)
        self.available = True
        self._backoff = self.retry_s
        return [ready[r.slot] for r in requests]

    def _proposals(self, ps) -> list[DraftProposal]:
        """``_proposal`` of every proposal of an answer. Proposals whose features and top tokens
        share one shape become tensors in one conversion each for the whole answer, split per
        proposal (one conversion each per proposal costs ~1 ms an answer of 64), and the sampled
        ones' sparse q one dense tensor from one scatter."""
        drafted = [p for p in ps if len(p.tokens)]
        shapes = {(p.num_features or NUM_FEATURES, p.top_m, len(p.scores) == len(p.tokens)) for p in drafted}
        if len(shapes) != 1 or any(len(p.probs) not in (0, len(p.tokens)) for p in drafted):
            return [self._proposal(p) for p in ps]
        nf, m, scored = shapes.pop()
        lens = [len(p.tokens) for p in drafted]
        if any(len(p.features) != n * nf or len(p.top_tokens) != n * m for p, n in zip(drafted, lens)):
            raise ValueError("the drafter answered with features or top tokens of the wrong size")
        feats = torch.tensor(list(chain.from_iterable(p.features for p in drafted)), dtype=torch.float32)
        feats = feats.reshape(-1, nf).split(lens)
        tops = (torch.tensor(list(chain.from_iterable(p.top_tokens for p in drafted)), dtype=torch.long)
                .reshape(-1, m).split(lens) if m else [None] * len(drafted))
        scores = (torch.tensor(list(chain.from_iterable(p.scores for p in drafted)), dtype=torch.float32).split(lens)
                  if scored else [None] * len(drafted))
        sampled = [p for p in drafted if len(p.probs)]
        q = iter(sparse_to_probs([row for p in sampled for row in p.probs], self.vocab_size, self.device)
                 .split([len(p.tokens) for p in sampled]) if sampled else ())
        made = iter(DraftProposal(list(p.tokens), next(q) if len(p.probs) else None, f, t, scores=sc)
                    for p, f, t, sc in zip(drafted, feats, tops, scores))
        return [next(made) if len(p.tokens) else self._proposal(p) for p in ps]

    def _proposal(self, p: drafter_pb2.DraftProposal, skip: int = 0, limit: int | None = None) -> DraftProposal:
        """A core proposal from the wire; ``skip`` leading drafts dropped (a prefetch's guessed
        bonus token: later positions move up, their position feature too), at most ``limit`` kept."""
        n = len(p.tokens)
        nf = p.num_features or NUM_FEATURES
        feats = torch.tensor(list(p.features), dtype=torch.float32).reshape(n, nf) if n else torch.zeros(0, nf)
        probs = sparse_to_probs(p.probs, self.vocab_size, self.device) if len(p.probs) == n and n else None
        top = torch.tensor(list(p.top_tokens), dtype=torch.long).reshape(n, p.top_m) if p.top_m and n else None
        # drafter-side scores saw the original positions: after a skip the router rescores the shifted features
        scores = torch.tensor(list(p.scores), dtype=torch.float32) if len(p.scores) == n and n and not skip else None
        end = n if limit is None else min(n, skip + limit)
        if skip or end < n:
            feats = feats[skip:end].clone()
            if skip and nf == NUM_FEATURES:
                feats[:, NUM_FEATURES - 1] -= skip  # the position feature is 1-based from the new start
            probs = None if probs is None else probs[skip:end]
            top = None if top is None else top[skip:end]
            scores = None if scores is None else scores[skip:end]
        return DraftProposal(list(p.tokens[skip:end]), probs, feats, top, scores=scores)

    def release(self, slot: int) -> None:
        if self._synced.pop(slot, None) is not None and self._stream is not None:
            self._stream.send(drafter_pb2.DraftStreamRequest(release=drafter_pb2.ReleaseSequences(seq_ids=[slot])))

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._channel.close()
