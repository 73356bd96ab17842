"""What every Tandem service shares: protobuf <-> core dataclass conversion, bearer-token auth,
the standard gRPC health service, and a gRPC server runner.

Conversions raise ``InvalidRequestError`` (mapped to INVALID_ARGUMENT) on malformed input.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.proto.tandem.v1 import common_pb2
from tandem.errors import InvalidRequestError
from tandem.requests import Completion, RequestOutput
from tandem.sampling import SamplingParams
from tandem.structured import Structure

log = logging.getLogger(__name__)

MAX_TEMPERATURE = 2.0  # the public APIs' bound (OpenAI's range is [0, 2])
# A request's ``category`` (our extension field) names a key of the shared state store
# (``acceptance:<drafter>:<category>``): a short name, and a replica keeps at most MAX_CATEGORIES
# of them (``AcceptanceCategories``), so no client can grow the store without bound.
CATEGORY_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_CATEGORIES = 256
OTHER_CATEGORY = "other"


def check_category(category: str | None) -> str:
    """The ``category`` of a request as the services keep it: empty -> "default".

    Raises:
        InvalidRequestError: not 1-64 characters of letters, digits, "_", ".", ":" or "-".
    """
    if not category:
        return "default"
    if not isinstance(category, str) or not CATEGORY_RE.fullmatch(category):
        shown = category if isinstance(category, str) and len(category) <= 80 else f"{str(category)[:80]}..."
        raise InvalidRequestError(f"category {shown!r} is not 1-64 characters of letters, digits, '_', '.', ':' "
                                  "or '-'", param="category")
    return category


class AcceptanceCategories:
    """The categories one replica counts acceptance under: the first ``MAX_CATEGORIES`` distinct
    ones as they come, every later new one under ``OTHER_CATEGORY`` (logged once), so the state
    store holds a bounded number of counter keys whatever clients send."""

    def __init__(self, limit: int = MAX_CATEGORIES) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._warned = False

    def key(self, category: str) -> str:
        if category in self._seen:
            return category
        if len(self._seen) < self.limit:
            self._seen.add(category)
            return category
        if not self._warned:
            self._warned = True
            log.warning("more than %d acceptance categories: new ones are counted under %r", self.limit,
                        OTHER_CATEGORY)
        return OTHER_CATEGORY

API_KEY_ENV = "TANDEM_API_KEY"
AUTH_HEADER = "authorization"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # verify batches with sparse q rows can be a few MB
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Clients reconnect quickly to a restarted drafter / verifier (gRPC's default backoff grows to 120 s).
CLIENT_OPTIONS = GRPC_OPTIONS + [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                                 ("grpc.max_reconnect_backoff_ms", 2000)]
# Servers answer HTTP/2 keepalive pings as often as a client sends them: clients detect a hung peer
# (a stopped process keeps its TCP connection but answers no ping) with ``keepalive_options``.
SERVER_OPTIONS = GRPC_OPTIONS + [("grpc.so_reuseport", 0),  # a second server on a taken port must fail
                                 ("grpc.http2.min_recv_ping_interval_without_data_ms", 200),
                                 ("grpc.http2.max_ping_strikes", 0), ("grpc.keepalive_permit_without_calls", 1)]


def retry_options(service: str, methods: Sequence[str], attempts: int = 3) -> list[tuple[str, object]]:
    """Client channel options under which gRPC itself retries ``service``'s unary ``methods`` on
    UNAVAILABLE (a peer restarting, a connection reset): up to ``attempts`` tries, exponential
    back-off from 0.1 s (gRPC service config ``retryPolicy``; each call's deadline still bounds
    the whole)."""
    import json

    config = {"methodConfig": [{
        "name": [{"service": service, "method": m} for m in methods],
        "retryPolicy": {"maxAttempts": attempts, "initialBackoff": "0.1s", "maxBackoff": "1s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]


def keepalive_options(deadline_s: float) -> list[tuple[str, int]]:
    """Client channel options that fail the channel's calls with UNAVAILABLE when the peer stops
    answering HTTP/2 pings for about ``deadline_s`` (a hung or stopped process): a ping every
    ``deadline_s / 2``, each allowed ``deadline_s / 2`` for its answer (gRPC keepalive)."""
    half = max(100, int(deadline_s * 500))
    return [("grpc.keepalive_time_ms", half), ("grpc.keepalive_timeout_ms", half), ("grpc.http2.ping_timeout_ms", half),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


# ----------------------------------------------------------------------------- request events


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
    """The request failed; ``message`` says why. ``invalid``: the request itself was refused (bad
    input, a duplicate id), not the replica that served it."""

    message: str
    invalid: bool = False


Event = Delta | Done | Failed


# ----------------------------------------------------------------------------- sampling params


def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                     seed=p.seed, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                                     ignore_eos=p.ignore_eos, logit_bias=dict(p.logit_bias), min_tokens=p.min_tokens,
                                     presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                     repetition_penalty=p.repetition_penalty,
                                     structure=None if p.structure is None else common_pb2.Structure(
                                         kind=p.structure.kind, spec=p.structure.spec, param=p.structure.param))


def params_from_pb(m: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError naming the bad field (max_tokens 0 included)."""
    return SamplingParams(max_tokens=int(m.max_tokens), temperature=float(m.temperature), top_k=int(m.top_k),
                          top_p=float(m.top_p) if m.top_p else 1.0, seed=int(m.seed) if m.HasField("seed") else None,
                          stop=tuple(m.stop), stop_token_ids=tuple(int(t) for t in m.stop_token_ids),
                          ignore_eos=bool(m.ignore_eos), logit_bias={int(t): float(b) for t, b in m.logit_bias.items()},
                          min_tokens=int(m.min_tokens), presence_penalty=float(m.presence_penalty),
                          frequency_penalty=float(m.frequency_penalty),
                          repetition_penalty=float(m.repetition_penalty) if m.HasField("repetition_penalty") else 1.0,
                          structure=Structure(m.structure.kind, m.structure.spec, m.structure.param or "response_format")
                          if m.HasField("structure") else None)


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one (``b`` after ``a``)."""
    lp = (a.logprobs or []) + (b.logprobs or []) if a.logprobs is not None or b.logprobs is not None else None
    texts = (a.token_texts or []) + (b.token_texts or []) if a.token_texts is not None or b.token_texts is not None \
        else None
    top = (a.top_logprobs or []) + (b.top_logprobs or []) \
        if a.top_logprobs is not None or b.top_logprobs is not None else None
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, a.text_delta + b.text_delta, b.finished,
                         b.finish_reason, lp, texts, b.stop_reason, top)


def top_to_pb(alternatives: Sequence[tuple[int, float]]) -> common_pb2.TopLogprobs:
    """One token's top alternatives ``[(token id, log-probability), ...]`` as a message."""
    return common_pb2.TopLogprobs(token_ids=[t for t, _ in alternatives], logprobs=[v for _, v in alternatives])


def top_from_pb(m: common_pb2.TopLogprobs) -> list[tuple[int, float]]:
    return list(zip((int(t) for t in m.token_ids), (float(v) for v in m.logprobs)))


# ----------------------------------------------------------------------------- tensors


def probs_to_sparse(probs: torch.Tensor) -> list[common_pb2.SparseProbs]:
    """``[n, vocab]`` distributions -> n sparse rows holding every non-zero entry exactly."""
    rows = []
    for row in probs.detach().float().cpu():
        idx = row.nonzero().flatten()
        rows.append(common_pb2.SparseProbs(indices=idx.tolist(), values=row[idx].tolist()))
    return rows


def probs_to_sparse_batch(probs: Sequence[torch.Tensor], k: int,
                          topk: bool | None = None) -> list[common_pb2.SparseProbs]:
    """``probs_to_sparse`` of several ``[n_i, vocab]`` distributions, the rows in order. With
    ``topk`` (default: where they are on a GPU) one top-``k`` and one copy to the host for all of
    them, where a row at a time costs a sync and a whole-vocabulary copy each; exact for rows
    with at most ``k`` non-zero entries (a drafter service's q, truncated to its top-K), a row
    with more going through ``probs_to_sparse``. On a CPU a row at a time is the faster (a top-K
    over the vocabulary costs more there than finding the non-zero entries). Indices ascending."""
    if not probs:
        return []
    if not (topk if topk is not None else any(p.device.type == "cuda" for p in probs)):
        return [row for p in probs for row in probs_to_sparse(p)]
    q = torch.cat([p.detach().float() for p in probs])
    kk = min(k, q.shape[-1])
    vals, idx = q.topk(kk, dim=-1)
    host = torch.cat([vals.double(), idx.double(), (q > 0).sum(-1, keepdim=True).double()], dim=1).cpu()
    values, indices, counts = host[:, :kk].tolist(), host[:, kk:2 * kk].tolist(), host[:, -1].tolist()
    rows = []
    for r, (v, i, n) in enumerate(zip(values, indices, counts)):
        n = int(n)
        if n > kk:
            rows.append(probs_to_sparse(q[r:r + 1])[0])
            continue
        pairs = sorted(zip(i[:n], v[:n]))
        rows.append(common_pb2.SparseProbs(indices=[int(a) for a, _ in pairs], values=[b for _, b in pairs]))
    return rows


def sparse_to_probs(rows: Sequence[common_pb2.SparseProbs], vocab_size: int,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """n sparse rows -> ``[n, vocab_size]`` float32 (zeros elsewhere) on ``device``: only the
    entries cross to it (a verifier's q is built where it verifies, not filled on the host).

    Raises:
        InvalidRequestError: an index outside the vocabulary or mismatched lengths.
    """
    out = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    lens = [len(r.indices) for r in rows]
    if any(n != len(r.values) for n, r in zip(lens, rows)):
        raise InvalidRequestError("sparse probability row with mismatched indices and values")
    idx = torch.tensor(list(chain.from_iterable(r.indices for r in rows)), dtype=torch.long)
    if idx.numel():  # every row's entries in one scatter
        if int(idx.min()) < 0 or int(idx.max()) >= vocab_size:
            raise InvalidRequestError(f"sparse probability index outside [0, {vocab_size})")
        at = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lens, dtype=torch.long))
        values = torch.tensor(list(chain.from_iterable(r.values for r in rows)), dtype=torch.float32)
        out[at.to(device), idx.to(device)] = values.to(device)
    return out


# ----------------------------------------------------------------------------- auth


def api_key(explicit: str | None = None) -> str | None:
    """The bearer token services require: ``explicit`` or ``TANDEM_API_KEY`` (None: no auth)."""
    return explicit or os.environ.get(API_KEY_ENV) or None


def auth_metadata(key: str | None) -> list[tuple[str, str]]:
    """gRPC call metadata carrying ``key`` as a bearer token (empty without a key)."""
    return [(AUTH_HEADER, f"Bearer {key}")] if key else []


def bearer_matches(header: str | bytes | None, expected: bytes) -> bool:
    """Whether an ``authorization`` header carries the credentials of ``expected``
    (``b"Bearer <key>"``): the scheme compared without regard to case (RFC 7235, 2.1), the key in
    constant time (``hmac.compare_digest``): the comparison time tells nothing of the key."""
    if header is None:
        return False
    scheme, _, key = (header.encode("latin-1", "replace") if isinstance(header, str) else header).partition(b" ")
    want_scheme, _, want_key = expected.partition(b" ")
    key_ok = hmac.compare_digest(key.strip(b" "), want_key)
    return key_ok and scheme.lower() == want_scheme.lower()


class _Malformed:
    """A request message that did not parse (``MalformedMessageInterceptor``)."""

    def __init__(self, why: str) -> None:
        self.why = why


class MalformedMessageInterceptor(grpc.aio.ServerInterceptor):
    """A request message of a Tandem service that does not parse (corrupt bytes, invalid UTF-8 in
    a string field) ends its call with INVALID_ARGUMENT saying so, as other bad input does, instead
    of grpc's UNKNOWN and an ERROR traceback in the service's log for every such message. The
    parse failure becomes a marker the wrapped method refuses before the servicer sees it (a
    message inside a request stream: when the stream reaches it)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/tandem.") or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, details.method

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # protobuf's DecodeError, or UnicodeDecodeError for a str field
                return _Malformed(f"{type(exc).__name__}: {exc}")

        async def refuse(m: _Malformed, context) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message for {method} ({m.why})")

        async def checked(request_iterator, context):
            async for m in request_iterator:
                if isinstance(m, _Malformed):
                    await refuse(m, context)
                yield m

        if handler.request_streaming:
            behavior = handler.stream_stream or handler.stream_unary
            if handler.response_streaming:
                async def stream_stream(request_iterator, context):
                    async for out in behavior(checked(request_iterator, context), context):
                        yield out
                return handler._replace(request_deserializer=deserialize, stream_stream=stream_stream)

            async def stream_unary(request_iterator, context):
                return await behavior(checked(request_iterator, context), context)
            return handler._replace(request_deserializer=deserialize, stream_unary=stream_unary)
        if handler.response_streaming:
            behavior = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                async for out in behavior(request, context):
                    yield out
            return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)
        behavior = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Malformed):
                await refuse(request, context)
            return await behavior(request, context)
        return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <key>`` with UNAUTHENTICATED (health checks
    are exempt, so orchestrators can probe without the key)."""

    def __init__(self, key: str) -> None:
        self._expected = f"Bearer {key}".encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = deny

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        if bearer_matches(dict(details.invocation_metadata or ()).get(AUTH_HEADER), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            async def deny_stream(request_iterator, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
                yield  # pragma: no cover - abort raises
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        if handler.response_streaming:
            async def deny_server_stream(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
                yield  # pragma: no cover
            return grpc.unary_stream_rpc_method_handler(deny_server_stream)
        return grpc.unary_unary_rpc_method_handler(self._deny)


# ----------------------------------------------------------------------------- servers


def _drop_cancelled_rpc_logs(record: logging.LogRecord) -> bool:
    """Logging filter: False (drop) for grpc's report of an RPC cancelled by the server's stop."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(exc, asyncio.CancelledError) and "_handle_exceptions" in record.getMessage())


def _drop_cross_context_detach_logs(record: logging.LogRecord) -> bool:
    """Logging filter: False (drop) for OpenTelemetry's report that a span's context could not be
    detached because the streaming call's generator was closed from another task (a call
    cancelled when its peer went away: opentelemetry-instrumentation-grpc's server interceptor
    attached the context in the handler's task; the span still ends). Any other detach failure
    is kept."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (record.getMessage() == "Failed to detach context" and isinstance(exc, ValueError)
                and "was created in a different Context" in str(exc))


def quiet_cross_context_detach() -> None:
    """Install ``_drop_cross_context_detach_logs`` on OpenTelemetry's context logger (every
    ``GrpcServer`` does; ``addFilter`` keeps one copy)."""
    logging.getLogger("opentelemetry.context").addFilter(_drop_cross_context_detach_logs)


def traced_channel(address: str, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A blocking gRPC client channel whose calls make OpenTelemetry CLIENT spans with the RPC
    semantic conventions (``rpc.system``, ``rpc.service``, ``rpc.method``; opentelemetry-
    instrumentation-grpc) and carry the trace context to the server."""
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    return intercept_channel(grpc.insecure_channel(address, options=options), client_interceptor())


def traced_aio_channel(address: str, options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    """``traced_channel`` for asyncio (``grpc.aio``)."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return grpc.aio.insecure_channel(address, options=options, interceptors=aio_client_interceptors())


class GrpcServer:
    """A ``grpc.aio`` server with the standard health service (``grpc.health.v1.Health``), its
    calls traced (OpenTelemetry SERVER spans with ``rpc.system`` / ``rpc.service`` / ``rpc.method``).

    Args:
        port: TCP port (0: pick a free one; read ``port`` after ``start``).
        host: bind address.
        key: bearer token to require (None: no auth).
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", key: str | None = None) -> None:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        # SERVER spans with the RPC semantic conventions for every call (opentelemetry-instrumentation-grpc)
        interceptors = ([aio_server_interceptor()] + ([BearerAuthInterceptor(key)] if key else [])
                        + [MalformedMessageInterceptor()])
        quiet_cross_context_detach()
        self.server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.host = host
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port} (address in use?)")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self, service_names: Sequence[str]) -> None:
        await self.server.start()
        for name in ["", *service_names]:
            await _maybe_await(self.health.set(name, health_pb2.HealthCheckResponse.SERVING))
        log.info("gRPC serving %s on %s", ", ".join(service_names), self.address)

    async def set_serving(self, serving: bool, service_names: Sequence[str]) -> None:
        """Report SERVING / NOT_SERVING for the overall server and ``service_names``."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *service_names]:
            await _maybe_await(self.health.set(name, status))

    async def stop(self, grace_s: float = 2.0, close_streams=None) -> None:
        """Graceful shutdown: health NOT_SERVING, then ``close_streams()`` (a servicer's way to end
        its long-lived streams with a status of their own, e.g. a router's ``Generate`` stream with
        UNAVAILABLE, so each call finishes instead of being cancelled under its task), then
        ``grace_s`` for in-flight RPCs. A stream still open after that is cancelled by grpc; that
        cancellation is the shutdown itself, so its "Exception not handled" log is dropped. Last,
        the calls' tasks still running (a handler finishing a draft in a worker thread) get
        ``grace_s`` to end on their own and are then cancelled and awaited: a task left to the
        loop's teardown would end in a CancelledError traceback."""
        await _maybe_await(self.health.enter_graceful_shutdown())
        if close_streams is not None:
            close_streams()
            await _settle_calls(grace_s / 2)  # each call ends once its peer has seen the status
        logging.getLogger("grpc._cython.cygrpc").addFilter(_drop_cancelled_rpc_logs)
        await self.server.stop(grace_s)
        await _settle_calls(grace_s, cancel=True)

    async def serve_until(self, service_names: Sequence[str], ready: "asyncio.Future | None" = None,
                          stop: "asyncio.Event | None" = None, close_streams=None) -> None:
        """Start, resolve ``ready`` with the bound address, serve until ``stop`` is set (forever
        without one), then shut down gracefully (``stop``; ``close_streams`` as there)."""
        await self.start(service_names)
        if ready is not None:
            ready.set_result(self.address)
        try:
            await (stop.wait() if stop is not None else self.server.wait_for_termination())
        finally:
            await self.stop(close_streams=close_streams)


async def messages_until(request_iterator, closing: asyncio.Event):
    """The messages of a streaming call's ``request_iterator`` until ``closing`` is set (the
    server is stopping: a servicer's ``close_streams``), so a handler waiting for its client's
    next message can end the call with a status of its own instead of being cancelled by grpc."""
    it = request_iterator.__aiter__()
    closed = asyncio.ensure_future(closing.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({nxt, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                return
            try:
                yield nxt.result()
            except StopAsyncIteration:
                return
    finally:
        closed.cancel()


async def _settle_calls(timeout_s: float, cancel: bool = False) -> None:
    """Wait up to ``timeout_s`` for the running loop's gRPC call tasks (grpc's ``rpc_task`` and its
    ``HandleExceptions[...]`` handler tasks) to end; with ``cancel``, cancel and await what is left."""
    calls = [t for t in asyncio.all_tasks()
             if t is not asyncio.current_task() and (t.get_name() == "rpc_task"
                                                     or t.get_name().startswith("HandleExceptions["))]
    if not calls:
        return
    _, left = await asyncio.wait(calls, timeout=timeout_s)
    if cancel and left:
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)


async def _maybe_await(x):
    if asyncio.iscoroutine(x):
        return await x
    return x


class BackgroundServer:
    """Runs a service's ``serve(ready, stop)`` coroutine on its own event loop in a daemon thread
    (Ray Serve replicas and tests use it to host a ``grpc.aio`` server beside other work).

    Args:
        serve_factory: ``(ready: Future, stop: Event) -> coroutine``; the coroutine must resolve
            ``ready`` with the bound address and return after ``stop`` is set.
        timeout_s: how long to wait for ``ready``.

    Raises:
        RuntimeError: the server failed to start (its exception is chained).
    """

    def __init__(self, serve_factory, timeout_s: float = 300.0) -> None:
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.address: str | None = None

        async def main() -> None:
            self._stop = asyncio.Event()
            ready = self.loop.create_future()
            task = asyncio.ensure_future(serve_factory(ready, self._stop))
            done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
            if ready in done:
                self.address = ready.result()
                self._ready.set()
            await task

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(main())
            except BaseException as exc:  # noqa: BLE001 - reported to the starter
                self._error = exc
                log.exception("background server stopped with an error")
            finally:
                self._ready.set()

        self.thread = threading.Thread(target=run, daemon=True, name="grpc-server")
        self.thread.start()
        self._ready.wait(timeout_s)
        if self.address is None:
            raise RuntimeError(f"server did not start: {self._error!r}") from self._error

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._stop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=timeout_s)


def probe_health(channel: grpc.Channel, metadata: list[tuple[str, str]], timeout_s: float = 1.0) -> bool:
    """One standard gRPC health check (``grpc.health.v1.Health/Check``) over ``channel``: True when
    the peer answers SERVING within ``timeout_s``."""
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s,
                                                         metadata=metadata, wait_for_ready=True)
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING
