"""Ray Serve deployment of a verifier replica: each replica loads the target and runs the whole
engine loop over it (scheduler, KV slots, drafts, verification), serves whole requests on its own
``grpc.aio`` ``tandem.v1.Verifier`` server, and publishes the address through ``address()`` (the
router relays each request's ``Generate`` stream from there; Serve's proxy is not on the data path).

A drafter that lives in the replica (SpecFormer in the verify pass, n-gram on the CPU) runs here;
a draft model of its own runs as ``DrafterDeployment`` replicas, which a verifier replica reaches
through the handle it is given (``drafter_service``).

Also here: what the deployments that host their own gRPC server share (``GrpcReplica``) and how
one deployment finds the gRPC addresses of another's replicas (``replica_addresses``).

Placement lives in the Serve config (``infra/serve_config.yaml``): e.g.
``ray_actor_options: {num_gpus: 1, accelerator_type: A100}``; the defaults here ask for half a
CPU so a whole application fits a 2-CPU machine.

Autoscaling: requests reach a verifier replica over its own gRPC server, so Serve's built-in
autoscaling signal (ongoing requests counted at handles and replicas) never sees them. Instead each
replica reports its load as a custom autoscaling metric (``record_autoscaling_stats``, which Ray
Serve calls on every replica of a deployment that has an ``autoscaling_config``: the result is
recorded every ``look_back_period_s * 0.2`` s and pushed to the controller every
``metrics_interval_s``), and ``RequestsPerSlotPolicy``, the deployment's autoscaling policy (named in
the config's ``autoscaling_config.policy``), turns the reported requests per KV slot into a replica
count. Serve applies ``min_replicas`` / ``max_replicas``, ``upscale_delay_s`` /
``downscale_delay_s`` and the scaling factors to what the policy returns. Routers pick up replicas
added or replaced later (``RouterDeployment`` follows the running replicas).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ray import serve
from ray.serve.handle import DeploymentHandle

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


def dialable(address: str) -> str:
    """``address`` as this node dials it: loopback when the replica behind it is on this node,
    else unchanged (its node's IP)."""
    import ray

    host, port = address.rsplit(":", 1)
    return f"127.0.0.1:{port}" if host == ray.util.get_node_ip_address() else address


def replica_count(handle: DeploymentHandle, default: int, starting: bool = True) -> int:
    """Replicas of the deployment behind ``handle`` that are running (and, with ``starting``,
    starting) as Serve's status of the calling replica's application shows them, at least
    ``default``. Blocking (asks the Serve controller).

    Args:
        handle: a deployment of the caller's application.
        default: the count to use when the status is smaller or cannot be read.
        starting: count replicas still starting too.
    """
    try:
        app = serve.get_replica_context().app_name
        states = serve.status().applications[app].deployments[handle.deployment_name].replica_states
        return max(default, int(states.get("RUNNING", 0)) + (int(states.get("STARTING", 0)) if starting else 0))
    except Exception:  # noqa: BLE001 - status is advisory; fall back to the configured count
        return default


async def replica_addresses(handle: DeploymentHandle, expected: int, timeout_s: float = 300.0) -> list[str]:
    """The gRPC addresses the replicas behind ``handle`` publish (``address()``), as this node dials
    them (``dialable``).

    Args:
        handle: a deployment whose replicas are ``GrpcReplica``s.
        expected: how many distinct addresses to collect: asks again until that many answered
            (replicas still starting join when they are up) or ``timeout_s`` passed.
        timeout_s: how long to keep asking (s); fewer addresses (a warning logged) after it.

    Returns:
        The distinct addresses, in order of first answer.
    """
    found: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        batch = [dialable(a) for a in await asyncio.gather(*(handle.address.remote() for _ in range(2 * expected)))]
        found = list(dict.fromkeys([*found, *batch]))
        if len(found) >= expected or time.monotonic() > deadline:
            if len(found) < expected:
                log.warning("found %d of %d replicas of %s", len(found), expected, handle.deployment_name)
            return found
        await asyncio.sleep(0.5)


LOAD_METRIC = "requests_per_slot"  # the custom autoscaling metric of a verifier replica


class RequestsPerSlotPolicy:
    """Ray Serve autoscaling policy of ``VerifierDeployment``: as many replicas as keep each one's
    requests per KV slot (running + waiting, over its slots: ``LOAD_METRIC``, which every replica
    reports through ``record_autoscaling_stats``) at ``target_requests_per_slot``.

    Named in the deployment's ``autoscaling_config`` (``policy: {policy_function:
    services.verifier.deployment:RequestsPerSlotPolicy, policy_kwargs: {...}}``); Serve makes one
    instance with ``policy_kwargs`` and calls it with an ``AutoscalingContext`` every control-loop
    tick (0.1 s). The desired count is the sum over the running replicas of each one's load (its
    mean over ``look_back_period_s``) divided by the target, the queue-length rule of Serve's
    default policy applied to KV slots instead of handle requests: replicas at the target keep the
    count, requests waiting for a slot raise it, idle slots lower it. A replica that reported
    nothing yet counts as idle; with no report at all the count stays. Serve then applies the
    scaling factors, ``upscale_delay_s`` / ``downscale_delay_s`` and ``min_replicas`` /
    ``max_replicas``.

    The class is serialized by value into the Serve controller (Serve pickles the policy's module
    by value), so it uses nothing of this module but ``LOAD_METRIC`` and the standard library.

    Args:
        target_requests_per_slot: requests per KV slot to keep each replica at (> 0): 1.0 fills
            every slot with nothing waiting; less keeps slots free for bursts.
        metric: the replica metric to read.

    Raises:
        ValueError: a target that is not positive.
    """

    def __init__(self, target_requests_per_slot: float = 1.0, metric: str = LOAD_METRIC) -> None:
        if not target_requests_per_slot > 0:
            raise ValueError(f"target_requests_per_slot must be > 0, not {target_requests_per_slot}")
        self.target = float(target_requests_per_slot)
        self.metric = metric

    def __call__(self, ctx) -> tuple[float, dict]:
        """``(desired replicas, policy state)`` for ``ctx`` (a ``ray.serve.config.AutoscalingContext``)."""
        loads = (ctx.aggregated_metrics or {}).get(self.metric) or {}
        if ctx.current_num_replicas == 0 or not loads:
            return ctx.target_num_replicas, {}
        running = set(ctx.running_replicas)
        total = sum(v for r, v in loads.items() if r in running)
        return total / self.target, {}


class GrpcReplica:
    """What a Ray Serve replica that hosts its own ``grpc.aio`` server shares: the server on a
    background loop (``BackgroundServer``), the address it publishes, its health check and its
    shutdown. ``role`` names the service in logs and errors; ``_close`` (after the server stopped)
    releases what the subclass holds."""

    role = "service"

    def _start(self, serve_factory, host: str, advertise_host: str | None) -> None:
        """Start the server and note the address to publish.

        Args:
            serve_factory: ``BackgroundServer``'s argument: ``(ready, stop) -> coroutine``.
            host: the address the server binds (its port is read from what it bound).
            advertise_host: the host to publish instead (see ``advertised``).

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
        server = getattr(self, "_server", None)
        if server is None or not server.alive:
            raise RuntimeError(f"the {self.role}'s gRPC server stopped")

    def _close(self) -> None:
        """Release what the replica holds besides its server (nothing here)."""

    def __del__(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop(timeout_s=5)
            self._server = None
        self._close()


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, health_check_period_s=5)
class VerifierDeployment(GrpcReplica):
    """A verifier replica: the target model, its KV slots and the engine loop over them (as
    ``tandem serve verifier``). ``address()`` is where its ``tandem.v1.Verifier`` listens.

    Args:
        model: the target, a GGUF file or Hugging Face directory on every node (None = the bundled
            SmolLM2-135M-Instruct).
        device: torch device (None = cuda when present, else cpu).
        max_batch_size: KV slots, i.e. requests decoding at once (None = the device's default).
        max_seq_len: context limit per request (prompt + output tokens).
        drafter: the drafter that runs in this replica: "none", "ngram", "specformer" (a head in
            the verify pass) or "draft-model"; ignored with ``drafter_service``.
        draft_model: weights of a specformer / draft-model drafter (a path, or truncate:N for a
            draft model; None = the ones shipped for the bundled target).
        num_draft_tokens: k, draft tokens per sequence per round at most.
        policy: draft lengths: "fixed" (k), "entropy" or "predictor" (adaptive, with a threshold
            learned online).
        predictor: acceptance predictor for ``policy="predictor"`` (a path, or "auto").
        measure_cost: time T(b, q) at start-up: adaptive policies allocate draft tokens under it and
            routers budget the replica's draft width with it
            (also reported in ``Info``).
        redis_url: state store for the threshold, acceptance counters and verification logs
            (None: ``TANDEM_REDIS_URL``, else in-memory in each replica).
        drafter_service: handle to ``DrafterDeployment``: draft with one of its replicas (its
            address asked again when it stops answering) instead of ``drafter``; None: in-replica.
        drafter_timeout_s: longest wait for one round from the drafter service (s), past which
            the replica decodes target-only until the drafter answers again.
        overlap: ask the drafter service for the next round while the target verifies this one.
        port: gRPC port (0 = any free one).
        host: bind address of the gRPC server.
        advertise_host: the host to publish in ``address()`` (None: the Ray node's IP when bound
            to all interfaces, else ``host``).
        api_key: bearer token required on this replica's gRPC and sent to the drafter service
            (None: ``TANDEM_API_KEY``, else none).
        gil_switch_interval_s: the actor process's ``sys.setswitchinterval`` (None: the
            replica's default, ``services.processes.GIL_SWITCH_INTERVAL_S``; ``run_verifier``
            says why).

    Raises:
        ConfigError / ModelLoadError / InvalidRequestError: bad model, device or speculation.
        RuntimeError: the drafter service has no replica that answers, or the server failed to start.
    """

    role = "verifier"

    async def __init__(self, model: str | None = None, device: str | None = None, max_batch_size: int | None = None,
                       max_seq_len: int = 2048, drafter: str = "ngram", draft_model: str | None = None,
                       num_draft_tokens: int = 4, policy: str = "fixed", predictor: str | None = None,
                       measure_cost: bool = False, redis_url: str | None = None,
                       drafter_service: DeploymentHandle | None = None, drafter_timeout_s: float = 10.0,
                       overlap: bool = True, port: int = 0, host: str = "127.0.0.1",
                       advertise_host: str | None = None, api_key: str | None = None,
                       gil_switch_interval_s: float | None = None) -> None:
        import sys

        from services.processes import GIL_SWITCH_INTERVAL_S, build_replica
        from services.verifier.server import serve as serve_verifier
        from tandem.speculation import SpeculativeConfig
        from tandem.telemetry import init_tracing

        init_tracing("tandem-verifier")
        # the engine thread beside the gRPC loop, as in ``run_verifier`` (its docstring says why)
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S if gil_switch_interval_s is None else gil_switch_interval_s)
        key = resolve_api_key(api_key)
        spec = SpeculativeConfig(drafter, draft_model=draft_model, num_draft_tokens=num_draft_tokens, policy=policy,
                                 predictor=predictor)
        drafter_address = None
        if drafter_service is not None:
            found = await replica_addresses(drafter_service, 1)
            if not found:
                raise RuntimeError(f"no replica of {drafter_service.deployment_name} answered")
            drafter_address = found[0]

        def resolver() -> str:  # a replaced drafter replica listens elsewhere: ask the handle again
            return dialable(drafter_service.address.remote().result(timeout_s=5))

        self.replica, eos, cost, words = await asyncio.to_thread(
            build_replica, spec, model, device, max_batch_size, max_seq_len, drafter_address=drafter_address, key=key,
            drafter_timeout_s=drafter_timeout_s, drafter_resolver=resolver if drafter_service is not None else None,
            redis_url=redis_url or os.environ.get("TANDEM_REDIS_URL"), overlap=overlap, measure_cost=measure_cost)
        try:
            await asyncio.to_thread(
                self._start, lambda ready, stop: serve_verifier(self.replica, eos, port, host, key, cost, words,
                                                                ready=ready, stop=stop), host, advertise_host)
        except BaseException:
            self._close()
            raise
        log.info("verifier replica (%s) serving gRPC on %s", words, self._address)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load for Serve's autoscaler (Serve calls it on the replica's event loop
        when the deployment has an ``autoscaling_config``; ``RequestsPerSlotPolicy`` reads it).

        Returns:
            ``LOAD_METRIC``: (running + waiting requests) / KV slots; ``running`` and ``waiting``:
            requests decoding and queued for a slot; ``num_slots``: KV slots. Empty once the
            replica is closed.
        """
        replica = getattr(self, "replica", None)
        if replica is None:
            return {}
        load = replica.load()
        slots = max(1, int(load.num_slots))
        return {LOAD_METRIC: (load.running + load.waiting) / slots, "running": float(load.running),
                "waiting": float(load.waiting), "num_slots": float(slots)}

    def _close(self) -> None:
        """Stop the engine loop (its KV slots go with it) and close the state store."""
        replica = getattr(self, "replica", None)
        if replica is not None:
            self.replica = None
            replica.stop()
            replica.store.close()
