"""Process entry points behind ``tandem serve drafter|verifier|router`` (each runs standalone on
loopback or any host; the Ray Serve deployments wrap the same pieces)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from services.common import api_key as resolve_api_key
from tandem.telemetry import force_flush, init_tracing

if TYPE_CHECKING:
    from tandem.speculation import SpeculativeConfig

log = logging.getLogger(__name__)

# a verifier replica process's sys.setswitchinterval (run_verifier; Python's default is 0.005 s)
GIL_SWITCH_INTERVAL_S = 5e-4


def check_port_free(host: str, port: int) -> None:
    """Fail fast, before loading any model, when ``host:port`` is taken.

    Raises:
        OSError: the address is in use (or cannot be bound).
    """
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _run(coro_factory) -> None:
    """Run ``coro_factory(stop)`` until SIGINT / SIGTERM sets ``stop`` (clean shutdown)."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        def stopping(sig: signal.Signals) -> None:
            if not stop.is_set():
                log.info("%s: shutting down", sig.name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping, sig)
        await coro_factory(stop)
        log.info("stopped")

    asyncio.run(main())
    force_flush()  # spans of the last rounds reach the exporter before the process exits


def build_replica(spec: "SpeculativeConfig", model: str | None = None, device: str | None = None,
                  max_batch_size: int | None = None, max_seq_len: int = 2048, *, drafter_address: str | None = None,
                  key: str | None = None, drafter_timeout_s: float = 10.0, drafter_resolver=None,
                  redis_url: str | None = None, overlap: bool = True, measure_cost: bool = False,
                  metrics: bool = True, runner: dict | None = None, capture_rounds: bool = True,
                  admission: tuple | None = None):
    """A verifier replica's engine loop and what its ``Info`` reports.

    Args:
        spec: how the replica speculates: a drafter that runs in the replica ("none", "ngram",
            "specformer", "draft-model"), or with ``drafter_address`` the drafter service there
            (``spec.drafter`` is then "remote"); k and the draft policy.
        model, device, max_batch_size (KV slots), max_seq_len: the target and its runner.
        drafter_address / key / drafter_timeout_s / drafter_resolver: the drafter service client
            (``RemoteDrafter``).
        redis_url: the state store the draft policy's θ, the acceptance counters and the
            verification logs go to (None: in-memory).
        overlap: request the next round's remote drafts while the target verifies this one.
        measure_cost: time T(b, q) at start-up: adaptive policies allocate draft tokens under it,
            and routers budget the replica's draft width with it (``VerifierInfo.cost``).
        metrics: feed Prometheus metrics (``ReplicaEngine.metrics``).
        runner: more ``RunnerConfig`` settings (dtype, kernels, cuda_graphs, compile,
            prefill_graphs, prefill_varlen); None values keep the device's defaults.
        capture_rounds: capture every round shape's graph before serving (``ReplicaEngine``).
        admission: ``(share, wait_rounds, overlap, intake_s)`` of the engine's ``AdmissionPolicy`` (a
            prefix of them: the rest at their defaults; None: its defaults).

    Returns:
        (``ReplicaEngine``, eos token ids, cost table ``{b: {q: ms}}`` or None, the speculation in words).

    Raises:
        ModelLoadError / ConfigError / InvalidRequestError: bad model, device or speculation.
    """
    from dataclasses import replace

    from services.drafter.client import RemoteDrafter
    from services.verifier.replica import ReplicaEngine
    from tandem.admission import AdmissionPolicy
    from tandem.models.runner import default_runner_config
    from tandem.models.weights import load_checkpoint
    from tandem.speculation import build_engine, measure_target_cost
    from tandem.state import open_store
    from tandem.target import LocalTarget
    from tandem.telemetry import Metrics

    cfg = default_runner_config(device, max_batch_size=max_batch_size, max_seq_len=max_seq_len, **(runner or {}))
    checkpoint = load_checkpoint(model)
    store = open_store(redis_url, fallback=True)
    drafter = None
    if drafter_address:
        spec = replace(spec, drafter="remote", draft_model=None)
        drafter = RemoteDrafter(drafter_address, checkpoint.config.vocab_size, key, timeout_s=drafter_timeout_s,
                                resolve=drafter_resolver, device=cfg.device)
    engine = build_engine(replace(spec, cost_model=measure_cost), checkpoint, cfg, drafter=drafter, store=store)
    engine.overlap_drafting = overlap
    if admission is not None:
        engine.admission = AdmissionPolicy(*admission)
        if engine.admission.overlap and not engine.target.overlaps_admission:
            log.warning("--admission-overlap has no effect on this replica (it needs CUDA graphs and the varlen "
                        "prefill): every prefill runs in line")
    policy = engine.draft_policy
    cost = getattr(policy, "cost", None)
    if cost is None and measure_cost and engine.drafter is not None and isinstance(engine.target, LocalTarget):
        # a fixed-k replica measures T(b, q) too: its router budgets its draft width with it (Info.cost)
        cost = measure_target_cost(engine.target, engine.configured_draft_limit + 1)
    name = engine.drafter.name if engine.drafter is not None else "none"
    words = f"drafter={name} k={spec.num_draft_tokens} policy={spec.policy}"
    replica = ReplicaEngine(engine, Metrics(checkpoint.path.name) if metrics else None, store, name,
                            capture_rounds=capture_rounds)
    return replica, list(engine.tokenizer.eos_token_ids), cost.table if cost is not None else None, words


def run_verifier(spec: "SpeculativeConfig", model, device, port, host, max_batch_size, max_seq_len, *,
                 drafter_address: str | None = None, drafter_timeout_s: float = 10.0, redis_url: str | None = None,
                 overlap: bool = True, measure_cost: bool = False, metrics_port: int | None = None,
                 key: str | None = None, runner: dict | None = None, gil_switch_interval_s: float = GIL_SWITCH_INTERVAL_S,
                 capture_rounds: bool = True, admission: tuple | None = None) -> None:
    """Serve ``tandem.v1.Verifier`` (a verifier replica, ``build_replica``) until signalled; with
    ``metrics_port`` its Prometheus metrics on ``http://host:metrics_port/metrics``.

    ``gil_switch_interval_s`` is the process's ``sys.setswitchinterval``: the engine thread and the
    gRPC event loop share one interpreter, and grpc's asyncio I/O (its socket writes included)
    runs holding it; a thread that waits for the interpreter asks its holder to let go only after
    this interval, so Python's 5 ms default can hold a round's launch back by up to that much."""
    from services.verifier.server import serve

    sys.setswitchinterval(gil_switch_interval_s)

    for p in (port, metrics_port):
        if p:
            check_port_free(host, p)
    init_tracing("tandem-verifier")
    key = resolve_api_key(key)
    replica, eos, cost, words = build_replica(spec, model, device, max_batch_size, max_seq_len,
                                              drafter_address=drafter_address, key=key,
                                              drafter_timeout_s=drafter_timeout_s, redis_url=redis_url,
                                              overlap=overlap, measure_cost=measure_cost, runner=runner,
                                              capture_rounds=capture_rounds, admission=admission)
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, host, registry=replica.metrics.registry)
    log.info("verifier replica: %s", words)
    try:
        _run(lambda stop: serve(replica, eos, port, host, key, cost, words, stop=stop))
    finally:
        replica.stop()
        replica.store.close()


def drafter_speculation(drafter: str, draft_model: str | None) -> "SpeculativeConfig":
    """The ``SpeculativeConfig`` of a drafter service (``tandem serve drafter``): its drafter kind
    and weights; the router holds k and the policy.

    Raises:
        InvalidRequestError: a drafter that has no service (SpecFormer drafts inside the
            verifier's pass); ConfigError: weights for a drafter that takes none.
    """
    from tandem.errors import InvalidRequestError
    from tandem.speculation import SpeculativeConfig

    if drafter not in ("ngram", "draft-model"):  # SpecFormer drafts inside the verifier's pass: no service
        raise InvalidRequestError(f"unknown drafter {drafter!r} for a drafter service; use ngram or draft-model")
    return SpeculativeConfig(drafter, draft_model=draft_model if drafter == "draft-model" else None)


def build_drafter(drafter: str, draft_model: str | None, model: str | None, device: str | None, max_sequences: int,
                  max_seq_len: int):
    """(the drafter, its device name) from ``tandem serve drafter`` options
    (``tandem.speculation.build_speculation`` of ``drafter_speculation``).

    Raises:
        InvalidRequestError / ModelLoadError / ConfigError: bad drafter options.
    """
    from tandem.models.runner import default_runner_config
    from tandem.models.weights import load_checkpoint
    from tandem.speculation import build_speculation

    spec = drafter_speculation(drafter, draft_model)
    cfg = default_runner_config(device, max_batch_size=max_sequences, max_seq_len=max_seq_len)
    if drafter == "ngram":  # no weights: no target to load
        return build_speculation(spec).drafter, "cpu"
    return build_speculation(spec, load_checkpoint(model), cfg).drafter, cfg.device


def run_drafter(drafter: str, draft_model: str | None, model: str | None, device: str | None, port: int, host: str,
                max_sequences: int, max_seq_len: int, key: str | None = None, predictor: str | None = None) -> None:
    """Serve ``tandem.v1.Drafter`` until signalled; with ``predictor`` (a path, or "auto" = the one
    saved beside the drafter's weights) every draft goes out with its predicted acceptance.

    Raises:
        InvalidRequestError / ModelLoadError / ConfigError: bad drafter or predictor options.
    """
    from dataclasses import replace

    from services.drafter.server import serve

    check_port_free(host, port)
    init_tracing("tandem-drafter")
    impl, dev = build_drafter(drafter, draft_model, model, device, max_sequences, max_seq_len)
    scorer = None
    if predictor is not None:
        from tandem.errors import ConfigError
        from tandem.models.weights import load_checkpoint
        from tandem.predictor import AcceptancePredictor
        from tandem.speculation import resolve_predictor

        spec = replace(drafter_speculation(drafter, draft_model), policy="predictor", predictor=predictor)
        path = resolve_predictor(spec, load_checkpoint(model) if predictor == "auto" else None)
        try:
            scorer = AcceptancePredictor.load(path, features_only=True)
        except Exception as exc:  # missing file, not a predictor
            raise ConfigError(f"cannot load predictor {path!r}: {exc}") from None
    _run(lambda stop: serve(impl, max_sequences, port, host, resolve_api_key(key), dev, stop=stop, predictor=scorer))


def run_router(config, http_port: int, grpc_port: int | None, host: str, key: str | None,
               default_max_tokens: int) -> None:
    """Serve the HTTP and gRPC front doors until signalled."""
    from services.router.server import serve

    for p in (http_port, grpc_port):
        if p:
            check_port_free(host, p)
    init_tracing("tandem-router")
    config.api_key = resolve_api_key(key)
    _run(lambda stop: serve(config, http_port, grpc_port, host, config.api_key, default_max_tokens, stop=stop))
