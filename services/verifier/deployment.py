"""Ray Serve deployment of the verifier: each replica loads the target and runs its own
``grpc.aio`` ``tandem.v1.Verifier`` server on a port, and publishes the address through
``address()`` (the router opens its streams there; Serve's proxy is not on the data path).

Placement lives in the Serve config (``infra/serve_config.yaml``): e.g.
``ray_actor_options: {num_gpus: 1, accelerator_type: A100}``; the defaults here ask for half a
CPU so the whole application fits a 2-CPU machine.
"""

from __future__ import annotations

import logging

from ray import serve

from services.common import BackgroundServer, api_key as resolve_api_key

log = logging.getLogger(__name__)


def advertised(host: str, advertise_host: str | None, port: int) -> str:
    """``host:port`` others should dial: ``advertise_host``, else the Ray node's IP when bound to
    all interfaces, else ``host``."""
    if advertise_host:
        return f"{advertise_host}:{port}"
    if host in ("0.0.0.0", "::", ""):
        import ray

        return f"{ray.util.get_node_ip_address()}:{port}"
    return f"{host}:{port}"


class GrpcReplica:
    """What a Ray Serve replica that hosts its own ``grpc.aio`` server shares: the server on a
    background loop (``BackgroundServer``), the address it publishes, its health check and its
    shutdown. ``role`` names the service in logs and errors."""

    role = "service"

    def _start(self, serve_factory, host: str, advertise_host: str | None) -> None:
        """Start ``serve_factory`` (``BackgroundServer``'s argument) and note the address to publish.

        Raises:
            RuntimeError: the server failed to start.
        """
        self._server = BackgroundServer(serve_factory)
        self._address = advertised(host, advertise_host, int(self._server.address.rsplit(":", 1)[1]))

    def address(self) -> str:
        """Where this replica's gRPC service listens (``host:port``)."""
        return self._address

    def check_health(self) -> None:
        """Ray Serve's health check. Raises RuntimeError when the gRPC server stopped."""
        if not self._server.alive:
            raise RuntimeError(f"the {self.role}'s gRPC server stopped")

    def __del__(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop(timeout_s=5)


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, health_check_period_s=5)
class VerifierDeployment(GrpcReplica):
    """Args: as ``tandem serve verifier``: model (None = bundled SmolLM2), device (None = cuda if
    present), max_batch_size (KV slots), max_seq_len, port (0 = any free), host (bind address),
    advertise_host, measure_cost (K: publish T(b, q) for q <= K+1; 0 = off), api_key.
    ``address()`` is where its ``tandem.v1.Verifier`` listens."""

    role = "verifier"

    def __init__(self, model: str | None = None, device: str | None = None, max_batch_size: int | None = None,
                 max_seq_len: int = 2048, port: int = 0, host: str = "127.0.0.1", advertise_host: str | None = None,
                 measure_cost: int = 0, api_key: str | None = None) -> None:
        from services.processes import build_local_target
        from services.verifier.server import serve as serve_verifier
        from tandem.speculation import measure_target_cost
        from tandem.telemetry import init_tracing

        init_tracing("tandem-verifier")
        target, eos = build_local_target(model, device, max_batch_size, max_seq_len)
        cost = measure_target_cost(target, measure_cost + 1).table if measure_cost else None
        key = resolve_api_key(api_key)
        self._start(lambda ready, stop: serve_verifier(target, eos, port, host, key, cost, ready=ready, stop=stop),
                    host, advertise_host)
        log.info("verifier replica serving gRPC on %s", self._address)
