"""A router's view of its verifier replicas: each replica's ``Info``, polled ``Load`` and health
(``Replica``), and the one multiplexed ``Verifier/Generate`` stream a router keeps to it per event
loop (``ReplicaLink``): requests out as commands, their events dispatched back by request id.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Iterator

import grpc

from services.common import (CLIENT_OPTIONS, auth_metadata, keepalive_options, retry_options, traced_aio_channel,
                             traced_channel)
from services.proto.tandem.v1 import verifier_pb2, verifier_pb2_grpc
from tandem.target_items import TargetUnavailable

log = logging.getLogger(__name__)


class Replica:
    """One verifier replica as a router sees it: its ``Info``, its last ``Load`` report and health,
    and the calls this router has open on it.

    Args:
        address: ``host:port``.
        key: bearer token (None: no auth).
        deadline_s: keepalive deadline of the streaming channel (``keepalive_options``).

    Raises:
        TargetUnavailable: the replica does not answer ``Info`` at start-up.
    """

    def __init__(self, address: str, key: str | None, deadline_s: float) -> None:
        self.address = address
        self.metadata = auth_metadata(key)
        self._deadline_s = deadline_s
        # Info and Load polls: a transient UNAVAILABLE is retried by gRPC (service config retryPolicy)
        self._channel = traced_channel(address, CLIENT_OPTIONS + retry_options("tandem.v1.Verifier", ["Info", "Load"]))
        self._stub = verifier_pb2_grpc.VerifierStub(self._channel)
        try:
            self.info = self._stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=30, metadata=self.metadata,
                                        wait_for_ready=True)
        except grpc.RpcError as exc:
            self._channel.close()
            why, hint = ("does not answer", "")
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                why, hint = "refused the router", " (give the router the replicas' --api-key)"
            elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # wait_for_ready: refused connections wait too
                why, hint = "did not answer within 30 s", " (no verifier replica serving there, or one still starting)"
            raise TargetUnavailable(f"verifier replica {address} {why}: {exc.code().name}: {exc.details()}{hint}") from None
        self.healthy = True
        self.last_error: str | None = None
        self.report: verifier_pb2.LoadReport | None = None
        self.open_calls = 0  # this router's calls in progress here
        self.others = 0  # requests here that other routers sent, as of the last report
        self._streams: dict[int, list] = {}  # event loop id -> [grpc.aio channel, its ReplicaLink or None]

    def link(self) -> "ReplicaLink":
        """This router's multiplexed ``Generate`` stream to the replica for the running event loop
        (one per loop: the HTTP and gRPC front doors may run on different loops), opened anew after
        a failure, over a channel with keepalive for hang detection."""
        loop = asyncio.get_running_loop()
        entry = self._streams.get(id(loop))
        if entry is None:
            channel = traced_aio_channel(self.address, CLIENT_OPTIONS + keepalive_options(self._deadline_s))
            entry = self._streams[id(loop)] = [channel, None]
        if entry[1] is None or entry[1].closed:
            entry[1] = ReplicaLink(verifier_pb2_grpc.VerifierStub(entry[0]), self.metadata)
        return entry[1]

    @property
    def num_slots(self) -> int:
        return max(1, int(self.info.num_slots))

    def score(self) -> float:
        """Requests per KV slot: this router's open calls here (exact) plus the other routers'
        requests as the last report implied (its running + waiting less this router's calls then)."""
        return (self.others + self.open_calls) / self.num_slots

    @functools.cached_property
    def cost_model(self):
        """The replica's measured verify cost T(b, q) as a ``CostModel`` (None when it measured none)."""
        from .budget import cost_model

        return cost_model(self.info.cost)

    def refresh(self, timeout_s: float = 2.0, draft_width: int | None = None,
                acceptance_threshold: float | None = None) -> bool:
        """Poll ``Load`` (blocking), sending the router's ``draft_width`` and ``acceptance_threshold``
        for the replica when given: updates the report and the health; returns the health."""
        try:
            self.report = self._stub.Load(verifier_pb2.LoadRequest(draft_width=draft_width,
                                                                    acceptance_threshold=acceptance_threshold),
                                          timeout=timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            if self.healthy:
                log.error("verifier replica %s does not answer: %s", self.address, exc.code().name)
            self.healthy, self.last_error = False, f"{exc.code().name}: {exc.details()}"
            return False
        self.others = max(0, self.report.running + self.report.waiting - self.open_calls)
        if not self.healthy:
            log.info("verifier replica %s answers again", self.address)
            try:  # it may have restarted with other settings: slots, speculation, cost model
                self.info = self._stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=timeout_s,
                                            metadata=self.metadata)
                self.__dict__.pop("cost_model", None)
            except grpc.RpcError as exc:
                log.warning("verifier replica %s: Info failed (%s); keeping what it said before", self.address,
                            exc.code().name)
        self.healthy, self.last_error = True, None
        return True

    def mark_failed(self, message: str) -> None:
        self.healthy, self.last_error = False, message

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        entry = self._streams.pop(id(loop), None)
        if entry is not None:
            if entry[1] is not None:
                entry[1].close()
            await entry[0].close()

    def close(self) -> None:
        self._channel.close()


STREAM_LOST = object()  # put on every open request's queue when its link's stream ends


class ReplicaLink:
    """One router's ``Verifier/Generate`` stream to one replica: commands out (a queue the call
    reads), events in, dispatched to each open request's queue by request id. When the stream
    fails, every open request gets ``STREAM_LOST`` and the link is ``closed``.

    Args:
        stub: the replica's ``grpc.aio`` stub.
        metadata: call metadata (the bearer token).
    """

    def __init__(self, stub: verifier_pb2_grpc.VerifierStub, metadata: list[tuple[str, str]]) -> None:
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._waiters: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self.closed = False
        self.error = "the replica ended the stream"
        self._call = stub.Generate(self._commands(), metadata=metadata)
        self._reader = asyncio.ensure_future(self._read())

    async def _commands(self):
        while True:
            first = await self._outbox.get()
            if first is None:
                return
            cmds = verifier_pb2.ReplicaCommands()
            cmds.MergeFrom(first)
            while not self._outbox.empty():  # whatever queued meanwhile goes in the same message
                more = self._outbox.get_nowait()
                if more is None:
                    yield cmds
                    return
                cmds.MergeFrom(more)
            yield cmds

    async def _read(self) -> None:
        try:
            async for msg in self._call:
                for ev in step_events(msg):
                    q = self._waiters.get(ev.request_id)
                    if q is not None:
                        q.put_nowait(ev)
        except grpc.aio.AioRpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"
        except ValueError as exc:  # a message this router cannot read: the stream is of no more use
            self.error = f"the replica sent {exc}"
            self._call.cancel()
        except asyncio.CancelledError:
            self.error = "the router closed the stream"
        finally:
            self.closed = True
            self._outbox.put_nowait(None)  # the command generator ends, and grpc's task that reads it with it
            for q in self._waiters.values():
                q.put_nowait(STREAM_LOST)

    def submit(self, request: verifier_pb2.ReplicaRequest) -> tuple[str, asyncio.Queue]:
        """Send ``request`` under an id unique on this stream (``<n>:<request id>``: clients may
        reuse their own ids); returns that id and the queue its ``ReplicaEvent``s (then ``STREAM_LOST``
        if the stream fails) arrive on."""
        request.request_id = f"{next(self._ids)}:{request.request_id}"
        q: asyncio.Queue = asyncio.Queue()
        self._waiters[request.request_id] = q
        self._outbox.put_nowait(verifier_pb2.ReplicaCommands(submit=[request]))
        return request.request_id, q

    def release(self, request_id: str, abort: bool) -> None:
        """Stop dispatching ``request_id``; ``abort``: also tell the replica to drop it."""
        if self._waiters.pop(request_id, None) is not None and abort and not self.closed:
            self._outbox.put_nowait(verifier_pb2.ReplicaCommands(abort=[request_id]))

    def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()


def step_events(msg: verifier_pb2.ReplicaEvents) -> Iterator[verifier_pb2.ReplicaEvent]:
    """A replica's message as one ``ReplicaEvent`` per request and step, in the order the replica
    produced them: the plain deltas' columns (``StepDeltas``) first, then the events.

    Raises:
        ValueError: the columns disagree (lengths, or token counts against the tokens sent).
    """
    d = msg.deltas
    if d.request_ids:
        n_ids = len(d.request_ids)
        if len(d.num_tokens) != n_ids or len(d.texts) != n_ids or sum(d.num_tokens) != len(d.token_ids):
            raise ValueError(f"malformed step deltas: {n_ids} requests, {len(d.num_tokens)} counts summing to "
                             f"{sum(d.num_tokens)}, {len(d.token_ids)} tokens, {len(d.texts)} texts")
        tokens = d.token_ids
        at = 0
        for rid, n, text in zip(d.request_ids, d.num_tokens, d.texts):
            yield verifier_pb2.ReplicaEvent(request_id=rid, token_ids=tokens[at:at + n], text=text)
            at += n
    yield from msg.events


def merge_events(a: verifier_pb2.ReplicaEvent, b: verifier_pb2.ReplicaEvent) -> verifier_pb2.ReplicaEvent:
    """Two consecutive events of one request as one (``b`` after ``a``; ``a`` not final)."""
    merged = verifier_pb2.ReplicaEvent()
    merged.CopyFrom(b)
    del merged.token_ids[:], merged.logprobs[:], merged.token_texts[:], merged.top_logprobs[:]
    merged.token_ids.extend([*a.token_ids, *b.token_ids])
    merged.top_logprobs.extend([*a.top_logprobs, *b.top_logprobs])
    merged.logprobs.extend([*a.logprobs, *b.logprobs])
    merged.token_texts.extend([*a.token_texts, *b.token_texts])
    merged.text = a.text + b.text
    return merged
