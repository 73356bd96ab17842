"""Ray Serve application: ``RouterDeployment`` (HTTP ingress: the OpenAI-compatible API, and
optionally ``tandem.v1.Router`` on its own gRPC port) over ``VerifierDeployment`` replicas, each
of which runs the whole engine loop (scheduler, KV slots, drafts, verification) behind its own
``grpc.aio`` server; with a drafter service, over ``DrafterDeployment`` replicas too, which only
the verifier replicas call.

``build_app(args)`` is the application builder named in the Serve config
(``import_path: services.router.deployment:build_app``); replicas, autoscaling and placement
(``ray_actor_options``: GPUs, ``accelerator_type``) are set per deployment in that config.

Data path: Serve's proxy carries client HTTP to a router replica; the router tokenizes each
request, picks the least loaded healthy verifier replica (each replica's ``Load``, polled) and
relays that replica's ``Generate`` stream, moving the request to another replica if it fails.
The streams go straight to the verifier replicas' own gRPC servers (addresses published by their
``address()`` methods), and a verifier replica's rounds straight to its drafter replica's, so
nothing depends on which streaming modes the installed Ray's gRPC proxy supports.

Because of that, Serve's own request counts never see the verifier replicas' load: they report it
themselves (``VerifierDeployment.record_autoscaling_stats``, requests per KV slot) and the
verifier's ``autoscaling_config`` scales on it (``RequestsPerSlotPolicy``). Each router replica
follows the verifier replicas Serve runs (``follow_s``): it starts sending to a replica added by the
autoscaler (or one that replaced a failed replica) within a few seconds, and drops a stopped one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.handle import DeploymentHandle

from services.common import BackgroundServer, api_key as resolve_api_key
from services.drafter.deployment import DrafterDeployment
from services.verifier.deployment import VerifierDeployment, replica_addresses, replica_count

log = logging.getLogger(__name__)


@serve.deployment(ray_actor_options={"num_cpus": 0.5})
@serve.ingress()
class RouterDeployment:
    """A router replica: no engine and no KV slot; requests go whole to the verifier replicas.

    Args:
        verifier: handle to ``VerifierDeployment``.
        verifier_replicas: verifier replicas to wait for at start-up, at least; more when Serve's
            status shows more running or starting then.
        model: the model path whose tokenizer to load (None = bundled SmolLM2).
        default_max_tokens: ``max_tokens`` of a request that gives none.
        api_key: bearer token for clients and the verifier replicas (None: ``TANDEM_API_KEY``).
        grpc_port: also serve ``tandem.v1.Router`` here (None: HTTP only).
        host: bind address of that gRPC server.
        follow_s: how often to compare the verifier replicas Serve shows running with those the
            router sends to (s): replicas the autoscaler added (or that replaced failed ones) are
            taken in, stopped ones that no longer answer dropped. 0: keep the start-up set.

    Raises:
        TargetUnavailable: a verifier replica does not answer; ConfigError: replicas that serve
            different models.
    """

    async def __init__(self, verifier: DeploymentHandle, verifier_replicas: int = 1, model: str | None = None,
                       default_max_tokens: int = 256, api_key: str | None = None, grpc_port: int | None = None,
                       host: str = "127.0.0.1", follow_s: float = 2.0) -> None:
        from services.router.core import Router, RouterConfig
        from tandem.telemetry import init_tracing

        init_tracing("tandem-router")
        self.api_key = resolve_api_key(api_key)
        self.default_max_tokens = default_max_tokens
        verifiers = await replica_addresses(verifier, replica_count(verifier, verifier_replicas))
        self.router = await asyncio.to_thread(Router, RouterConfig(verifiers, model, api_key=self.api_key))
        self._grpc = None
        if grpc_port is not None:
            from services.router.server import serve_grpc

            self._grpc = await asyncio.to_thread(
                BackgroundServer, lambda ready, stop: serve_grpc(self.router, grpc_port, host, self.api_key,
                                                                 ready=ready, stop=stop,
                                                                 default_max_tokens=default_max_tokens))
        self._verifier = verifier
        self._follow = asyncio.create_task(self._follow_verifiers(follow_s)) if follow_s > 0 else None
        log.info("router replica over verifier replicas %s", verifiers)

    async def _follow_verifiers(self, period_s: float) -> None:
        """Every ``period_s`` seconds, ``sync_verifiers`` when Serve shows a different number of
        running verifier replicas than the router has healthy ones (a sync that takes over 30 s,
        e.g. a replica that answers no ``address()``, is given up till the next period)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                running = await asyncio.to_thread(replica_count, self._verifier, 0, False)
                if running and running != sum(r.healthy for r in self.router.replicas):
                    await asyncio.wait_for(self.sync_verifiers(running), timeout=30)
            except Exception:  # noqa: BLE001 - the next period tries again
                log.exception("following the verifier replicas failed")

    async def sync_verifiers(self, expected: int, timeout_s: float = 10.0) -> list[str]:
        """Make the router's verifier replicas those the deployment publishes: take in the new
        ones, drop the ones that no longer answer and are no longer published (a replica that
        is still published stays, healthy or not: the router's poll tells when it answers again).

        Args:
            expected: running verifier replicas to look for.
            timeout_s: how long to keep asking for their addresses (s).

        Returns:
            The addresses the router now sends to.
        """
        from services.router.replicas import Replica

        published = await replica_addresses(self._verifier, expected, timeout_s=timeout_s)
        current = self.router.replicas
        known = {r.address for r in current}
        first = current[0].info if current else None
        added = []
        for address in published:
            if address in known:
                continue
            try:
                replica = await asyncio.to_thread(Replica, address, self.api_key, self.router.config.verifier_timeout_s)
            except Exception as exc:  # noqa: BLE001 - not up yet (or gone): the next sync tries again
                log.warning("verifier replica %s not taken in: %s", address, exc)
                continue
            if first is not None and (replica.info.model, replica.info.vocab_size) != (first.model, first.vocab_size):
                log.error("verifier replica %s serves %s, not %s: not used", address, replica.info.model, first.model)
                replica.close()
                continue
            await asyncio.to_thread(replica.refresh)
            added.append(replica)
        gone = [r for r in current if not r.healthy and r.address not in published] \
            if len(published) >= expected else []
        if added or gone:
            # a new list, not the old one changed: the load poller's thread iterates the old one
            self.router.replicas = [r for r in current if r not in gone] + added
            for r in gone:
                await r.aclose()
                r.close()
            log.info("verifier replicas: added %s, dropped %s", [r.address for r in added], [r.address for r in gone])
        return [r.address for r in self.router.replicas]

    def __serve_build_asgi_app__(self):
        from services.router.http import build_app as build_http_app

        return build_http_app(self.router, self.api_key, self.default_max_tokens)

    def check_health(self) -> None:
        """Ray Serve's health check. Raises RuntimeError when no verifier replica is healthy."""
        if not self.router.any_healthy:
            raise RuntimeError("no healthy verifier replica")

    def __del__(self) -> None:
        if getattr(self, "_follow", None) is not None:
            self._follow.cancel()
            self._follow = None
        if getattr(self, "_grpc", None) is not None:
            self._grpc.stop(timeout_s=5)
            self._grpc = None
        if getattr(self, "router", None) is not None:
            self.router.close()
            self.router = None


class AppArgs(BaseModel):
    """Arguments of ``build_app`` (``serve run services.router.deployment:build_app k=v ...`` or
    the ``args:`` of the Serve config).

    Attributes:
        model: the target, a GGUF file or Hugging Face directory on every node (None = bundled
            SmolLM2-135M-Instruct).
        device: the verifier (and drafter service) replicas' torch device (None = cuda when
            present, else cpu).
        drafter: "none" (target-only), "ngram", "specformer" or "draft-model".
        draft_model: weights of a specformer / draft-model drafter (a path, or truncate:N for a
            draft model; None = the ones shipped for the bundled target).
        drafter_service: run the drafter as ``DrafterDeployment`` replicas the verifier replicas
            call; None: for "draft-model" only (a model of its own, on a cheaper GPU), the others
            run inside the verifier replicas (SpecFormer in the verify pass, n-gram on the CPU).
        num_draft_tokens: k, draft tokens per sequence per round at most.
        max_batch_size: KV slots per verifier replica (None = the device's default).
        max_seq_len: context limit per request.
        verifier_replicas: verifier replicas the router waits for at start-up;
            the Serve config's ``num_replicas`` (or ``autoscaling_config``) of
            ``VerifierDeployment`` overrides the count started, and the routers use every replica
            Serve shows running (keep it at most ``min_replicas`` when autoscaling).
        policy: draft lengths: "fixed" (k), "entropy" or "predictor" (adaptive).
        predictor: acceptance predictor for ``policy="predictor"`` (a path, or "auto").
        measure_cost: adaptive policies allocate draft tokens under T(b, q) timed at start-up.
        redis_url: the verifier replicas' shared state store (None: ``TANDEM_REDIS_URL``, else
            in-memory in each replica).
        drafter_timeout_s: a verifier replica's longest wait for one round from the drafter
            service (s).
        overlap: verifier replicas ask the drafter service for the next round while the target
            verifies this one.
        drafter_max_sequences: sequences one drafter service replica holds (None:
            ``max_batch_size`` (or 64) times ``verifier_replicas``).
        api_key: bearer token for clients and between the services (None: ``TANDEM_API_KEY``).
        default_max_tokens: ``max_tokens`` of a request that gives none.
        grpc_port: the router also serves ``tandem.v1.Router`` on this port (None: HTTP only).
        host: bind address of the verifier / drafter gRPC servers (the router's gRPC server binds
            loopback when this is loopback, else all interfaces).
        advertise_host: the host the verifier / drafter replicas publish (None: the Ray node's IP
            when ``host`` is all interfaces).
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    device: str | None = None
    drafter: Literal["none", "ngram", "specformer", "draft-model"] = "ngram"
    draft_model: str | None = None
    drafter_service: bool | None = None
    num_draft_tokens: int = 4
    max_batch_size: int | None = None
    max_seq_len: int = 2048
    verifier_replicas: int = 1
    policy: Literal["fixed", "entropy", "predictor"] = "fixed"
    predictor: str | None = None
    measure_cost: bool = False
    redis_url: str | None = None
    drafter_timeout_s: float = 10.0
    overlap: bool = True
    drafter_max_sequences: int | None = None
    api_key: str | None = None
    default_max_tokens: int = 256
    grpc_port: int | None = None
    host: str = "0.0.0.0"  # verifier / drafter gRPC bind address; replicas publish their node's IP
    advertise_host: str | None = None

    def stack(self):
        """The same speculation as a ``services.launch.StackConfig`` (its rules decide whether a
        drafter service is used and which combinations are valid)."""
        from services.launch import StackConfig

        return StackConfig(model=self.model, drafter=self.drafter, draft_model=self.draft_model,
                           drafter_service=self.drafter_service, num_draft_tokens=self.num_draft_tokens,
                           max_seq_len=self.max_seq_len, policy=self.policy, predictor=self.predictor,
                           measure_cost=self.measure_cost)


def build_app(args: dict):
    """Bound Serve application: router -> verifier replicas (-> drafter service, when used).

    Args:
        args: ``AppArgs`` fields.

    Raises:
        pydantic.ValidationError: an unknown or malformed argument.
        ConfigError: a speculation the verifier replicas cannot run (e.g. a drafter service for
            SpecFormer, which drafts inside the verify pass; a policy without a drafter).
    """
    a = AppArgs(**(args or {}))
    stack = a.stack()
    spec = stack.speculation  # an invalid combination fails here, before any replica starts
    drafter = None
    if stack.uses_drafter_service:
        drafter = DrafterDeployment.bind(
            drafter=spec.drafter, draft_model=spec.draft_model, model=a.model, device=a.device,
            max_sequences=a.drafter_max_sequences or (a.max_batch_size or 64) * a.verifier_replicas,
            max_seq_len=a.max_seq_len, port=0, host=a.host, advertise_host=a.advertise_host, api_key=a.api_key)
    verifier = VerifierDeployment.options(num_replicas=a.verifier_replicas).bind(
        model=a.model, device=a.device, max_batch_size=a.max_batch_size, max_seq_len=a.max_seq_len,
        drafter=spec.drafter, draft_model=spec.draft_model, num_draft_tokens=spec.num_draft_tokens,
        policy=spec.policy, predictor=spec.predictor, measure_cost=a.measure_cost, redis_url=a.redis_url,
        drafter_service=drafter, drafter_timeout_s=a.drafter_timeout_s, overlap=a.overlap, port=0, host=a.host,
        advertise_host=a.advertise_host, api_key=a.api_key)
    router_host = "127.0.0.1" if a.host in ("127.0.0.1", "localhost") else "0.0.0.0"
    return RouterDeployment.bind(verifier, verifier_replicas=a.verifier_replicas, model=a.model,
                                 default_max_tokens=a.default_max_tokens, api_key=a.api_key, grpc_port=a.grpc_port,
                                 host=router_host)
