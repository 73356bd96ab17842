"""Shared state: one interface, an in-memory default and a Redis implementation.

What lives here: the threshold controller's state (kept by each verifier replica), acceptance statistics per
drafter and Spec-Bench-style category (counters), and the verification-log stream that retrains
the difficulty predictor (a capped stream: Redis ``XADD ... MAXLEN ~``).

``open_store()`` picks Redis when ``TANDEM_REDIS_URL`` is set, else the in-memory store. Redis
errors surface as ``StateStoreUnavailable`` so callers can keep serving on local state.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import defaultdict, deque

log = logging.getLogger(__name__)


class StateStoreUnavailable(RuntimeError):
    """The backing store (Redis) cannot be reached."""


def best_effort(fn, *args, why: str = ""):
    """``fn(*args)`` (a state store call), or None after logging a warning when the store is
    unavailable: shared state is an optimisation, and a caller keeps serving on its local state.
    ``why`` says what stays local (e.g. "θ stays local")."""
    try:
        return fn(*args)
    except StateStoreUnavailable as exc:
        log.warning("state store unavailable%s: %s", f", {why}" if why else "", exc)
        return None


class StateStore(ABC):
    """Key/value JSON documents, counters and capped append-only logs."""

    @abstractmethod
    def get_json(self, key: str) -> dict | None:
        """The document at ``key`` (None if absent)."""

    @abstractmethod
    def set_json(self, key: str, value: dict) -> None:
        """Store a JSON-serialisable dict at ``key``."""

    @abstractmethod
    def incr(self, key: str, counts: dict[str, float]) -> None:
        """Add ``counts`` to the named counters of hash ``key``."""

    @abstractmethod
    def counters(self, key: str) -> dict[str, float]:
        """All counters of hash ``key`` ({} if absent)."""

    @abstractmethod
    def append_log(self, stream: str, record: dict, maxlen: int = 100_000) -> None:
        """Append ``record`` to a log capped at about ``maxlen`` entries (oldest dropped)."""

    @abstractmethod
    def read_log(self, stream: str, count: int | None = None) -> list[dict]:
        """The newest ``count`` records (all when None), oldest first."""

    @abstractmethod
    def ping(self) -> bool:
        """True when the store answers."""

    def close(self) -> None:
        """Release connections."""


class InMemoryStore(StateStore):
    """Process-local store (the default: no services needed). Thread-safe."""

    def __init__(self) -> None:
        self._docs: dict[str, str] = {}
        self._counters: dict[str, dict[str, float]] = defaultdict(dict)
        self._logs: dict[str, deque] = {}
        self._lock = threading.Lock()

    def get_json(self, key: str) -> dict | None:
        with self._lock:
            raw = self._docs.get(key)
        return None if raw is None else json.loads(raw)

    def set_json(self, key: str, value: dict) -> None:
        raw = json.dumps(value)
        with self._lock:
            self._docs[key] = raw

    def incr(self, key: str, counts: dict[str, float]) -> None:
        with self._lock:
            h = self._counters[key]
            for k, v in counts.items():
                h[k] = h.get(k, 0) + v

    def counters(self, key: str) -> dict[str, float]:
        with self._lock:
            return dict(self._counters.get(key, {}))

    def append_log(self, stream: str, record: dict, maxlen: int = 100_000) -> None:
        raw = json.dumps(record)
        with self._lock:
            log = self._logs.get(stream)
            if log is None or log.maxlen != maxlen:
                log = self._logs[stream] = deque(log or (), maxlen=maxlen)
            log.append(raw)

    def read_log(self, stream: str, count: int | None = None) -> list[dict]:
        with self._lock:
            items = list(self._logs.get(stream, ()))
        if count is not None:
            items = items[-count:] if count > 0 else []
        return [json.loads(x) for x in items]

    def ping(self) -> bool:
        return True


class RedisStore(StateStore):
    """Redis-backed store (``redis-py``): JSON strings, hashes and capped streams.

    Args:
        url: ``redis://host:port/db``.
        prefix: key namespace.
        timeout_s: socket timeout; a slow or dead Redis fails fast.

    Raises:
        StateStoreUnavailable: on any connection or timeout error.
    """

    def __init__(self, url: str, prefix: str = "tandem:", timeout_s: float = 0.5) -> None:
        import redis

        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self.prefix = prefix
        self.url = url
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                       decode_responses=True)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            raise StateStoreUnavailable(f"Redis at {self.url} is unavailable: {exc}") from None

    def get_json(self, key: str) -> dict | None:
        raw = self._call(self._r.get, self.prefix + key)
        return None if raw is None else json.loads(raw)

    def set_json(self, key: str, value: dict) -> None:
        self._call(self._r.set, self.prefix + key, json.dumps(value))

    def incr(self, key: str, counts: dict[str, float]) -> None:
        def run():
            pipe = self._r.pipeline()
            for k, v in counts.items():
                pipe.hincrbyfloat(self.prefix + key, k, v)
            pipe.execute()
        self._call(run)

    def counters(self, key: str) -> dict[str, float]:
        return {k: float(v) for k, v in self._call(self._r.hgetall, self.prefix + key).items()}

    def append_log(self, stream: str, record: dict, maxlen: int = 100_000) -> None:
        self._call(self._r.xadd, self.prefix + stream, {"json": json.dumps(record)}, maxlen=maxlen, approximate=True)

    def read_log(self, stream: str, count: int | None = None) -> list[dict]:
        if count is not None and count <= 0:
            return []
        if count is None:
            items = self._call(self._r.xrange, self.prefix + stream)
        else:
            items = list(reversed(self._call(self._r.xrevrange, self.prefix + stream, count=count)))
        return [json.loads(fields["json"]) for _, fields in items]

    def ping(self) -> bool:
        try:
            return bool(self._r.ping())
        except self._errors:
            return False

    def close(self) -> None:
        self._r.close()


def open_store(url: str | None = None, fallback: bool = False) -> StateStore:
    """Redis when ``url`` or ``TANDEM_REDIS_URL`` is given, else the in-memory store; with
    ``fallback``, Redis behind a ``FallbackStore`` (serving: a Redis outage degrades to local
    state instead of failing requests)."""
    url = url or os.environ.get("TANDEM_REDIS_URL")
    if not url:
        return InMemoryStore()
    return FallbackStore(RedisStore(url)) if fallback else RedisStore(url)


class FallbackStore(StateStore):
    """A shared store (Redis) that degrades to local state instead of failing.

    Every write goes to the local in-memory mirror and to the shared store; while the shared
    store is down, writes are queued (up to ``max_pending`` operations, oldest dropped past
    that, with a warning) and replayed in order when it answers again, so nothing is lost across
    an outage. Reads come from the shared store when up, else from the local mirror. ``up`` says
    which mode it is in (the router reports it in /health and logs each change).

    Args:
        shared: the shared store (usually ``RedisStore``).
        retry_s: how long to wait after a failure before trying the shared store again (s).
        max_pending: queued operations at most while the shared store is down.
    """

    def __init__(self, shared: StateStore, retry_s: float = 2.0, max_pending: int = 100_000) -> None:
        import logging
        import time

        self._log = logging.getLogger(__name__)
        self._clock = time.monotonic
        self.shared = shared
        self.local = InMemoryStore()
        self.retry_s = retry_s
        self._pending: deque = deque(maxlen=max_pending)
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self.up = True
        self.last_error: str | None = None

    def _mark_down(self, exc: Exception) -> None:
        if self.up:
            self._log.warning("state store down, serving on local state (%s)", exc)
        self.up = False
        self.last_error = str(exc)
        self._retry_at = self._clock() + self.retry_s

    def _flush(self) -> bool:
        """Replay queued writes; True when the shared store is usable now."""
        if not self.up and self._clock() < self._retry_at:
            return False
        try:
            while self._pending:
                name, args = self._pending[0]
                getattr(self.shared, name)(*args)
                self._pending.popleft()
        except StateStoreUnavailable as exc:
            self._mark_down(exc)
            return False
        if not self.up:
            self._log.warning("state store is back; replayed the writes queued during the outage")
        self.up = True
        self.last_error = None
        return True

    def _write(self, name: str, *args) -> None:
        getattr(self.local, name)(*args)
        with self._lock:
            if len(self._pending) == self._pending.maxlen:
                self._log.warning("state store outage queue is full; dropping the oldest queued write")
            self._pending.append((name, args))
            self._flush()

    def _read(self, name: str, *args):
        with self._lock:
            if self._flush():
                try:
                    return getattr(self.shared, name)(*args)
                except StateStoreUnavailable as exc:
                    self._mark_down(exc)
        return getattr(self.local, name)(*args)

    def get_json(self, key: str) -> dict | None:
        return self._read("get_json", key)

    def set_json(self, key: str, value: dict) -> None:
        self._write("set_json", key, value)

    def incr(self, key: str, counts: dict[str, float]) -> None:
        self._write("incr", key, dict(counts))

    def counters(self, key: str) -> dict[str, float]:
        return self._read("counters", key)

    def append_log(self, stream: str, record: dict, maxlen: int = 100_000) -> None:
        self._write("append_log", stream, record, maxlen)

    def read_log(self, stream: str, count: int | None = None) -> list[dict]:
        return self._read("read_log", stream, count)

    def ping(self) -> bool:
        with self._lock:
            self._retry_at = 0.0 if not self.up else self._retry_at
            ok = self.shared.ping() and self._flush()
            if not ok and self.up:
                self._mark_down(StateStoreUnavailable("ping failed"))
            return ok

    @property
    def pending(self) -> int:
        """Writes queued while the shared store is down."""
        return len(self._pending)

    def close(self) -> None:
        self.shared.close()
