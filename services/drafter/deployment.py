"""Ray Serve deployment of a drafter service: each replica runs its own ``grpc.aio``
``tandem.v1.Drafter`` server on a port and publishes the address through ``address()``; the
verifier replicas (``VerifierDeployment`` given this deployment's handle) draft through it.

Bound only when the application uses a drafter service (``AppArgs.drafter_service``; by default
for ``drafter: draft-model``, a model of its own that fits a cheaper GPU). Drafters that live in
the verifier replica (SpecFormer in the verify pass, n-gram on the CPU) need no deployment.

Placement lives in the Serve config: e.g. ``ray_actor_options: {num_gpus: 0.25,
accelerator_type: L4}`` for a draft model on a cheap GPU.
"""

from __future__ import annotations

import logging

from ray import serve

from services.common import api_key as resolve_api_key
from services.verifier.deployment import GrpcReplica

log = logging.getLogger(__name__)


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, health_check_period_s=5)
class DrafterDeployment(GrpcReplica):
    """A drafter service replica (as ``tandem serve drafter``). ``address()`` is where its
    ``tandem.v1.Drafter`` listens.

    Args:
        drafter: "draft-model" or "ngram".
        draft_model: the draft model: a path, or truncate:N (the target's first N layers); None =
            the one shipped for the bundled target.
        model: the target (for truncate:N and the shipped draft model's check; None = bundled).
        device: torch device (None = cuda when present, else cpu).
        max_sequences: sequences held at once over all the verifier replicas' streams (a draft
            model's KV cache slots).
        max_seq_len: context limit per sequence.
        port: gRPC port (0 = any free one).
        host: bind address of the gRPC server.
        advertise_host: the host to publish in ``address()`` (None: the Ray node's IP when bound
            to all interfaces, else ``host``).
        api_key: bearer token required on this replica's gRPC (None: ``TANDEM_API_KEY``, else none).

    Raises:
        InvalidRequestError / ModelLoadError / ConfigError: bad drafter options.
        RuntimeError: the server failed to start.
    """

    role = "drafter"

    def __init__(self, drafter: str = "draft-model", draft_model: str | None = None, model: str | None = None,
                 device: str | None = None, max_sequences: int = 64, max_seq_len: int = 2048, port: int = 0,
                 host: str = "127.0.0.1", advertise_host: str | None = None, api_key: str | None = None) -> None:
        from services.drafter.server import serve as serve_drafter
        from services.processes import build_drafter
        from tandem.telemetry import init_tracing

        init_tracing("tandem-drafter")
        impl, device_name = build_drafter(drafter, draft_model, model, device, max_sequences, max_seq_len)
        key = resolve_api_key(api_key)
        self._start(lambda ready, stop: serve_drafter(impl, max_sequences, port, host, key, device_name,
                                                      ready=ready, stop=stop), host, advertise_host)
        log.info("drafter replica (%s) serving gRPC on %s", drafter, self._address)
