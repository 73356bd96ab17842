"""Ray Serve deployment of a drafter: each replica runs its own ``grpc.aio``
``tandem.v1.Drafter`` server on a port and publishes the address through ``address()``.

Placement lives in the Serve config: e.g. ``ray_actor_options: {num_gpus: 0.25,
accelerator_type: T4}`` for a draft model on a cheap GPU, or CPU only for n-gram drafting.
"""

from __future__ import annotations

import logging

from ray import serve

from services.common import api_key as resolve_api_key
from services.verifier.deployment import GrpcReplica

log = logging.getLogger(__name__)


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, health_check_period_s=5)
class DrafterDeployment(GrpcReplica):
    """Args: as ``tandem serve drafter``: drafter ("ngram" | "draft-model"), draft_model (path or
    truncate:N), model (the target, for truncate:N), device, max_sequences, max_seq_len, port,
    host, advertise_host, api_key. ``address()`` is where its ``tandem.v1.Drafter`` listens."""

    role = "drafter"

    def __init__(self, drafter: str = "ngram", draft_model: str | None = None, model: str | None = None,
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
