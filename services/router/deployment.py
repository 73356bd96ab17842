"""Ray Serve application: ``RouterDeployment`` (HTTP ingress: the OpenAI-compatible API, and
optionally ``tandem.v1.Router`` on its own gRPC port) over ``VerifierDeployment`` and
``DrafterDeployment`` replicas, whose ``grpc.aio`` servers the router reaches directly.

``build_app(args)`` is the application builder named in the Serve config
(``import_path: services.router.deployment:build_app``); replicas, autoscaling and placement
(``ray_actor_options``: GPUs, ``accelerator_type``) are set per deployment in that config.

Data path: Serve's proxy carries client HTTP to the router replica; the router's per-round
bidirectional streams go straight to the verifier and drafter replicas' own gRPC servers
(addresses published by their ``address()`` methods), so nothing depends on which streaming
modes the installed Ray's gRPC proxy supports.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.handle import DeploymentHandle

from services.common import BackgroundServer, api_key as resolve_api_key
from services.drafter.deployment import DrafterDeployment
from services.verifier.deployment import VerifierDeployment

log = logging.getLogger(__name__)


def _replica_count(handle: DeploymentHandle, default: int) -> int:
    """Replicas of the deployment behind ``handle`` that are running or starting (Serve's status),
    at least ``default``."""
    try:
        app = serve.get_replica_context().app_name
        states = serve.status().applications[app].deployments[handle.deployment_name].replica_states
        return max(default, int(states.get("RUNNING", 0)) + int(states.get("STARTING", 0)))
    except Exception:  # noqa: BLE001 - status is advisory; fall back to the configured count
        return default


def _dialable(address: str) -> str:
    """A replica on this router's own node is dialled on loopback; others on their node's IP."""
    import ray

    host, port = address.rsplit(":", 1)
    return f"127.0.0.1:{port}" if host == ray.util.get_node_ip_address() else address


async def _replica_addresses(handle: DeploymentHandle, expected: int, timeout_s: float = 300.0) -> list[str]:
    """Addresses published by the replicas behind ``handle``: asks until ``expected`` distinct ones
    answered (replicas still starting join when they are up) or ``timeout_s`` passed; order of
    first answer kept."""
    import time

    found: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        batch = [_dialable(a) for a in await asyncio.gather(*(handle.address.remote() for _ in range(2 * expected)))]
        found = list(dict.fromkeys([*found, *batch]))
        if len(found) >= expected or time.monotonic() > deadline:
            if len(found) < expected:
                log.warning("found %d of %d replicas of %s", len(found), expected, handle.deployment_name)
            return found
        await asyncio.sleep(0.5)


@serve.deployment(ray_actor_options={"num_cpus": 0.5})
@serve.ingress()
class RouterDeployment:
    """The router replica.

    Args:
        verifier: handle to ``VerifierDeployment``.
        drafter: handle to ``DrafterDeployment`` (None: target-only decoding).
        verifier_replicas: verifier replicas to wait for at least (one engine each); more are used
            when Serve's status shows more running or starting at start-up.
        model: the model path whose tokenizer to load (None = bundled SmolLM2).
        num_draft_tokens, policy, predictor, redis_url, default_max_tokens: as ``tandem serve router``.
        api_key: bearer token for clients and the internal services (None: ``TANDEM_API_KEY``).
        grpc_port: also serve ``tandem.v1.Router`` here (None: HTTP only).
        host: bind address of that gRPC server.
    """

    async def __init__(self, verifier: DeploymentHandle, drafter: DeploymentHandle | None = None,
                       verifier_replicas: int = 1, model: str | None = None, num_draft_tokens: int = 4,
                       policy: str = "fixed", predictor: str | None = None, redis_url: str | None = None,
                       default_max_tokens: int = 256, api_key: str | None = None, grpc_port: int | None = None,
                       host: str = "127.0.0.1") -> None:
        from services.router.core import Router, RouterConfig, remote_speculation
        from tandem.telemetry import init_tracing

        init_tracing("tandem-router")
        self.api_key = resolve_api_key(api_key)
        self.default_max_tokens = default_max_tokens
        verifiers = await _replica_addresses(verifier, _replica_count(verifier, verifier_replicas))
        drafter_address = (await _replica_addresses(drafter, 1))[0] if drafter is not None else None
        def resolver() -> str:  # a replaced drafter replica listens elsewhere: ask its handle again
            return _dialable(drafter.address.remote().result(timeout_s=5))

        config = RouterConfig(verifiers, drafter_address, model,
                              speculation=remote_speculation(drafter_address, num_draft_tokens, policy, predictor),
                              redis_url=redis_url or os.environ.get("TANDEM_REDIS_URL"), api_key=self.api_key,
                              drafter_resolver=resolver if drafter is not None else None)
        self.router = await asyncio.to_thread(Router, config)
        self._grpc = None
        if grpc_port is not None:
            from services.router.server import serve_grpc

            self._grpc = BackgroundServer(lambda ready, stop: serve_grpc(self.router, grpc_port, host, self.api_key,
                                                                        ready=ready, stop=stop))
        log.info("router replica over verifiers %s, drafter %s", verifiers, drafter_address)

    def __serve_build_asgi_app__(self):
        from services.router.http import build_app as build_http_app

        return build_http_app(self.router, self.api_key, self.default_max_tokens)

    def check_health(self) -> None:
        if not any(w.healthy for w in self.router.workers):
            raise RuntimeError("no healthy verifier")

    def __del__(self) -> None:
        if getattr(self, "_grpc", None) is not None:
            self._grpc.stop(timeout_s=5)
        if getattr(self, "router", None) is not None:
            self.router.close()


class AppArgs(BaseModel):
    """Arguments of ``build_app`` (``serve run services.router.deployment:build_app k=v ...`` or
    the ``args:`` of the Serve config)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    device: str | None = None
    drafter: Literal["ngram", "draft-model", "none"] = "ngram"
    draft_model: str | None = None
    num_draft_tokens: int = 4
    max_batch_size: int | None = None
    max_seq_len: int = 2048
    verifier_replicas: int = 1
    policy: Literal["fixed", "entropy", "predictor"] = "fixed"
    predictor: str | None = None
    measure_cost: int = 0
    redis_url: str | None = None
    api_key: str | None = None
    default_max_tokens: int = 256
    grpc_port: int | None = None
    host: str = "0.0.0.0"  # verifier / drafter gRPC bind address; replicas publish their node's IP
    advertise_host: str | None = None


def build_app(args: dict):
    """Bound Serve application: router -> verifier (+ drafter) deployments.

    Raises:
        pydantic.ValidationError: an unknown or malformed argument.
    """
    a = AppArgs(**(args or {}))
    verifier = VerifierDeployment.options(num_replicas=a.verifier_replicas).bind(
        a.model, a.device, a.max_batch_size, a.max_seq_len, 0, a.host, a.advertise_host, a.measure_cost, a.api_key)
    drafter = None
    if a.drafter != "none":
        drafter = DrafterDeployment.bind(a.drafter, a.draft_model, a.model, a.device, a.max_batch_size or 64,
                                         a.max_seq_len, 0, a.host, a.advertise_host, a.api_key)
    router_host = "127.0.0.1" if a.host in ("127.0.0.1", "localhost") else "0.0.0.0"
    return RouterDeployment.bind(verifier, drafter, a.verifier_replicas, a.model, a.num_draft_tokens, a.policy,
                                 a.predictor, a.redis_url, a.default_max_tokens, a.api_key, a.grpc_port, router_host)
