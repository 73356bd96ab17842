"""Process entry points behind ``tandem serve drafter|verifier|router`` (each runs standalone on
loopback or any host; the Ray Serve deployments wrap the same pieces)."""

from __future__ import annotations

import asyncio
import logging
import signal

import torch

from services.common import api_key as resolve_api_key
from tandem.telemetry import force_flush, init_tracing

log = logging.getLogger(__name__)


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


def build_local_target(model: str | None, device: str | None, max_batch_size: int | None, max_seq_len: int,
                       dtype: torch.dtype | None = None):
    """(LocalTarget, eos ids) for ``model`` (None: the bundled SmolLM2).

    Raises:
        ModelLoadError / ConfigError: bad model path or device.
    """
    from tandem.models.runner import default_runner_config
    from tandem.models.weights import load_checkpoint
    from tandem.target import LocalTarget
    from tandem.tokenizer import load_tokenizer

    cfg = default_runner_config(device, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype)
    checkpoint = load_checkpoint(model)
    tokenizer = load_tokenizer(checkpoint)
    return LocalTarget(checkpoint, cfg), list(tokenizer.eos_token_ids)


def run_verifier(model, device, port, host, max_batch_size, max_seq_len, measure_cost_k: int = 0,
                 key: str | None = None) -> None:
    """Serve ``tandem.v1.Verifier`` until signalled.

    Args:
        measure_cost_k: measure T(b, q) for q = 1..k+1 at start-up (0: skip) and publish it.
    """
    from services.verifier.server import serve
    from tandem.speculation import measure_target_cost

    check_port_free(host, port)
    init_tracing("tandem-verifier")
    target, eos = build_local_target(model, device, max_batch_size, max_seq_len)
    cost = measure_target_cost(target, measure_cost_k + 1).table if measure_cost_k else None
    _run(lambda stop: serve(target, eos, port, host, resolve_api_key(key), cost, stop=stop))


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
            scorer = AcceptancePredictor.load(path)
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
