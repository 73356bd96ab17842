"""Router process: HTTP (OpenAI-compatible) and gRPC (``tandem.v1.Router``) front doors over one
``Router`` core, plus the standard gRPC health service."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common import (MAX_TEMPERATURE, Delta, Done, Failed, GrpcServer, check_category, params_from_pb,
                             top_to_pb)
from services.proto.tandem.v1 import router_pb2, router_pb2_grpc
from tandem.errors import InvalidRequestError


from .core import Router, RouterConfig
from .http import build_app

log = logging.getLogger(__name__)

SERVICE_NAME = "tandem.v1.Router"


def _usage_pb(c) -> router_pb2.Usage:
    return router_pb2.Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                            num_draft_tokens=c.spec.num_drafted, num_accepted_tokens=c.spec.num_accepted,
                            num_verify_steps=c.spec.num_steps, acceptance_rate=c.spec.acceptance_rate,
                            mean_accepted_length=c.spec.mean_accepted_length, ttft_s=c.ttft_s, e2e_s=c.latency_s)


def _with_max_tokens(params, max_tokens: int):
    out = type(params)()
    out.CopyFrom(params)
    out.max_tokens = max_tokens
    return out


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``Router.Generate``: bad input (a ``max_tokens`` past the context included) ->
    INVALID_ARGUMENT; ``max_tokens`` unset (0) -> ``default_max_tokens``; no verifier replica to
    serve it -> UNAVAILABLE; a cancelled call aborts the request and frees its KV slot on the replica."""

    def __init__(self, router: Router, default_max_tokens: int = 256) -> None:
        self.router = router
        self.default_max_tokens = default_max_tokens

    async def Generate(self, request, context):
        try:
            if bool(request.prompt) + bool(request.messages) + bool(request.prompt_ids) != 1:
                raise InvalidRequestError("give exactly one of prompt, messages or prompt_ids")
            if request.prompt_ids and request.raw_prompt:
                raise InvalidRequestError("raw_prompt is for a text prompt: prompt_ids are the whole prompt already",
                                          param="raw_prompt")
            if not 0.0 <= request.params.temperature <= MAX_TEMPERATURE:  # as over HTTP (NaN fails too)
                raise InvalidRequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                                          f"{request.params.temperature}", param="temperature")
            explicit = request.params.max_tokens  # 0 (unset): the default, and the output stops at the context
            pb = request.params if explicit else _with_max_tokens(request.params, self.default_max_tokens)
            params = params_from_pb(pb)
            prompt = request.prompt or [{"role": m.role, "content": m.content} for m in request.messages] or None
            req = self.router.make_request(prompt, params, prompt_ids=list(request.prompt_ids) or None,
                                           chat=not request.raw_prompt and not request.prompt_ids,
                                           request_id=request.request_id or None, logprobs=request.logprobs,
                                           top_logprobs=request.top_logprobs, final_only=request.final_only)
            if explicit:
                self.router.check_room(len(req.prompt_ids), "max_tokens", explicit)
            category = check_category(request.category)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        # (the call's SERVER span comes from the gRPC instrumentation: the request span is its child)
        async for event in self.router.generate(req, category,
                                                "chat" if request.messages else "text_completion"):
            if isinstance(event, Delta):
                out = event.output
                if (out.new_token_ids or out.text_delta) and not request.final_only:  # final_only: sent with the end
                    yield router_pb2.GenerateResponse(request_id=req.request_id, token_ids=out.new_token_ids,
                                                      text=out.text_delta, logprobs=out.logprobs or [],
                                                      top_logprobs=[top_to_pb(a) for a in out.top_logprobs or ()])
            elif isinstance(event, Done):
                c = event.completion
                if request.final_only:
                    yield router_pb2.GenerateResponse(
                        request_id=req.request_id, token_ids=c.token_ids, text=c.text, logprobs=c.logprobs or [],
                        top_logprobs=[top_to_pb(a) for a in c.top_logprobs or ()], finished=True,
                        finish_reason=c.finish_reason, usage=_usage_pb(c))
                else:
                    yield router_pb2.GenerateResponse(request_id=req.request_id, finished=True,
                                                      finish_reason=c.finish_reason, usage=_usage_pb(c))
            elif isinstance(event, Failed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT if event.invalid
                                    else grpc.StatusCode.UNAVAILABLE, event.message)


async def serve_grpc(router: Router, port: int, host: str = "127.0.0.1", key: str | None = None,
                     ready: "asyncio.Future | None" = None, stop: "asyncio.Event | None" = None,
                     default_max_tokens: int = 256) -> None:
    """Serve ``tandem.v1.Router`` (and health) for an existing ``Router`` until ``stop`` is set."""
    server = GrpcServer(port, host, key)
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router, default_max_tokens), server.server)
    watcher = asyncio.ensure_future(_watch_health(router, server))
    try:
        await server.serve_until([SERVICE_NAME], ready, stop)
    finally:
        watcher.cancel()


async def _watch_health(router: Router, server: GrpcServer, period_s: float = 2.0) -> None:
    """Keep the gRPC health status in step with the verifier replicas (NOT_SERVING when none is healthy)."""
    serving = True
    while True:
        await asyncio.sleep(period_s)  # (the router polls its replicas in a thread of its own)
        now = router.any_healthy
        if now != serving:
            serving = now
            await server.set_serving(now, [SERVICE_NAME])


async def serve(config: RouterConfig, http_port: int, grpc_port: int | None = None, host: str = "127.0.0.1",
                api_key: str | None = None, default_max_tokens: int = 256, stop: "asyncio.Event | None" = None) -> None:
    """Run the router until ``stop`` is set (or the process is signalled).

    Raises:
        TargetUnavailable: a verifier does not answer at start-up.
    """
    import uvicorn

    router = await asyncio.to_thread(Router, config)
    app = build_app(router, api_key, default_max_tokens)
    # `tandem -v serve router` (root logger at INFO) also logs each HTTP request, as uvicorn's access log
    verbose = logging.getLogger().getEffectiveLevel() <= logging.INFO
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=http_port, log_level="info" if verbose else "warning",
                                         access_log=verbose, lifespan="off"))
    grpc_task = None
    if grpc_port is not None:
        grpc_stop = asyncio.Event()
        grpc_ready = asyncio.get_running_loop().create_future()
        grpc_task = asyncio.ensure_future(serve_grpc(router, grpc_port, host, api_key, grpc_ready, grpc_stop,
                                                     default_max_tokens))
        await asyncio.wait({grpc_task, grpc_ready}, return_when=asyncio.FIRST_COMPLETED)
        if grpc_task.done():
            grpc_task.result()  # raises the start-up error
    log.info("router: HTTP on %s:%d, verifier replicas %s, %s", host, http_port, config.verifiers,
             "bearer-token auth on" if api_key else "no auth (no --api-key / TANDEM_API_KEY)")
    try:
        if stop is None:
            await http.serve()
        else:
            task = asyncio.ensure_future(http.serve())
            await asyncio.wait({task, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
            http.should_exit = True
            await task
    finally:
        if grpc_task is not None:
            grpc_stop.set()
            await grpc_task
        await router.aclose()
        await asyncio.to_thread(router.close)
