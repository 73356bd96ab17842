"""OpenAI-compatible HTTP front door (FastAPI): ``/v1/completions``, ``/v1/chat/completions``
(``stream: true`` as server-sent events), ``/v1/models``, ``/health``, ``/metrics``.

Usage objects carry the speculative-decoding metrics of the request next to the token counts:
``usage.speculative_decoding = {num_draft_tokens, num_accepted_tokens, num_verify_steps,
acceptance_rate, mean_accepted_length, draft_tokens_per_position, accepted_tokens_per_position}``
(docs/architecture.md ("Metrics") definitions).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: malformed input is
400 with the field at fault in ``param`` (a field of the wrong JSON type, a ``max_tokens`` that
with the prompt passes the served context, and a field Tandem does not implement, unless it is at
its no-op value: no field is ignored in silence), a missing or wrong bearer token 401, a body over
``MAX_BODY_BYTES`` 413, a failed verifier 503. Prompts are tokenized off the event loop, so a long one
never stalls other requests' streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import replace

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.data import DuplicateKey
from tandem.engine import Completion
from tandem.errors import InvalidRequestError
from tandem.metrics import SpecDecodeStats
from tandem.sampling import SamplingParams, choice_seed
from tandem.structured import Structure

from services.common import Delta, Done, Failed, bearer_matches, merge_outputs

from .core import Router
from .schema import (UNKNOWN_FIELDS, ChatCompletionRequest, ChatMessage, CheckedJSONRoute, CompletionRequest,
                     encoding_refused, identity_encoding, undecodable, unknown_fields)
from .tools import Tool, check_tool_calls, parse_tool_call, parse_tools, render_messages, tool_structure, tools_message

log = logging.getLogger(__name__)


MAX_BODY_BYTES = 4 * 2**20  # far above any prompt the context limit admits (8192 tokens as ids: ~60 KB)
BODY_READ_TIMEOUT_S = 30.0  # the longest wait for the next part of a request body (then 408)


class _BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes gets 413 and is never stored or parsed (by its
    Content-Length, or, for a chunked body, as soon as the bytes read pass the limit); a body that
    stops arriving (nothing for ``BODY_READ_TIMEOUT_S``, e.g. fewer bytes than its Content-Length
    said) gets 408 instead of holding its connection open. Once the body is complete, ``receive``
    is not timed (a streamed response waits on it for the client's disconnect)."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        complete = False

        async def timed():
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), BODY_READ_TIMEOUT_S)
            except TimeoutError:
                raise StarletteHTTPException(408, f"the request body stopped arriving: nothing for "
                                                  f"{BODY_READ_TIMEOUT_S:g} s (fewer bytes than its "
                                                  "Content-Length?)") from None
            complete = message["type"] != "http.request" or not message.get("more_body")
            return message

        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            try:
                while (await timed()).get("more_body"):  # read and drop it (never stored or parsed), so
                    pass  # that the client, still sending, gets the 413 instead of a broken pipe
            except StarletteHTTPException:  # it stopped arriving: the 413 says enough
                pass
            return await _too_large(self.limit)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await timed()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise StarletteHTTPException(413, _too_large(self.limit).body.decode())
            return message
        return await self.app(scope, limited, send)


_API_DOCS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")  # FastAPI's pages of the API


class _BearerAuth:
    """ASGI middleware: /v1/* and the API's documentation pages need ``Authorization: Bearer
    <api_key>`` (else 401); /health and /metrics stay open to probes and scrapers. Plain ASGI, not
    Starlette's ``BaseHTTPMiddleware``, whose wrapped ``receive`` hides a client's disconnect from
    the endpoint (a non-streamed request would then run on after its client left)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["path"] in _API_DOCS) \
                and not bearer_matches(dict(scope.get("headers") or ()).get(b"authorization"), self.expected):
            return await _error(401, "missing or wrong bearer token", "authentication_error")(scope, receive, send)
        return await self.app(scope, receive, send)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_type_tag(part) -> bool:
    """A location part pydantic adds for the member of a union field ("str", "list[str]", ...):
    not part of the request's field path."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


def _too_large(limit: int) -> JSONResponse:
    return _error(413, f"the request body is over {limit // 2**20} MiB; no prompt within the context limit needs that")


COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
# each endpoint's body model, for naming a stray field when a required one is missing
_BODY_MODELS = {COMPLETIONS: CompletionRequest, CHAT_COMPLETIONS: ChatCompletionRequest}


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def _nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def usage(completions: list[Completion]) -> dict:
    """OpenAI usage plus the request's speculative-decoding metrics, over its choices (``n``): the
    prompt counted once, the completion tokens and the speculation counters summed; latency is
    the first token of any choice (TTFT), the last choice's end (e2e) and the mean TPOT."""
    first = completions[0]
    spec = SpecDecodeStats()
    for c in completions:
        spec.merge(c.spec)
    out_tokens = sum(c.completion_tokens for c in completions)
    tpots = [c.tpot_s for c in completions if not math.isnan(c.tpot_s)]
    return {
        "prompt_tokens": first.prompt_tokens, "completion_tokens": out_tokens,
        "total_tokens": first.prompt_tokens + out_tokens,
        "speculative_decoding": {
            "num_draft_tokens": spec.num_drafted, "num_accepted_tokens": spec.num_accepted,
            "num_verify_steps": spec.num_steps, "acceptance_rate": _nan_to_none(spec.acceptance_rate),
            "mean_accepted_length": spec.mean_accepted_length,
            # index i: verify steps that drafted a token at draft position i + 1, and how many of those were accepted
            "draft_tokens_per_position": list(spec.drafted_per_pos),
            "accepted_tokens_per_position": list(spec.accepted_per_pos),
        },
        "latency": {"ttft_s": min(c.ttft_s for c in completions), "tpot_s": sum(tpots) / len(tpots) if tpots else math.nan,
                    "e2e_s": max(c.latency_s for c in completions)},
    }


def _chat_content(messages: list[ChatMessage], tools: list[Tool], choice: str | None) -> list[dict[str, str]]:
    """The prompt's messages: text content, tool calls and results rendered as text
    (``tools.render_messages``), and the tools' system message first when there are tools."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):  # OpenAI content parts: text only
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError("only text content parts are supported", param=f"messages.{i}.content")
            content = "".join(texts)
        if m.tool_calls is not None and m.role != "assistant":
            raise InvalidRequestError("only assistant messages carry tool_calls", param=f"messages.{i}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise InvalidRequestError("only tool messages carry tool_call_id", param=f"messages.{i}.tool_call_id")
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidRequestError("a tool message needs the tool_call_id of the call it answers",
                                      param=f"messages.{i}.tool_call_id")
        out.append({"role": m.role, "content": content or "",
                    "tool_calls": check_tool_calls(m.tool_calls, i) if m.tool_calls else None,
                    "tool_call_id": m.tool_call_id})
    # (the tokenizer refuses all-empty messages too, but only after the tools' system message is
    # added below, which is never empty: checked here, on the client's own messages)
    if not any(m["content"].strip() or m["tool_calls"] for m in out):  # as /v1/completions refuses ""
        raise InvalidRequestError("prompt is empty: every message's content is empty (or only whitespace)",
                                  param="messages")
    rendered = render_messages(out)
    return ([tools_message(tools, choice)] if tools else []) + rendered


def build_app(router: Router, api_key: str | None = None, default_max_tokens: int = 256) -> FastAPI:
    """The FastAPI app over a running ``Router``.

    Args:
        api_key: require ``Authorization: Bearer <api_key>`` on /v1/* (None: open).
        default_max_tokens: ``max_tokens`` when a request gives none.
    """
    app = FastAPI(title="Tandem", version="0.1.0")
    app.router.route_class = CheckedJSONRoute  # one parse of a JSON body, refusing a key twice in an object
    app.add_middleware(_BodyLimit)
    # HTTP SERVER spans with the HTTP semantic conventions, parents of the router's request spans
    FastAPIInstrumentor.instrument_app(app, excluded_urls="health,metrics")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        refused = encoding_refused(request)
        if refused is not None:  # a body that claims an encoding: named as such, whatever its bytes say
            return _error(400, refused)
        if first.get("type") == "json_invalid":  # loc is ("body", byte offset): not a parameter
            pos = first.get("loc", ("", "?"))[-1]
            return _error(400, f"the request body is not valid JSON (at byte {pos}): {first.get('ctx', {}).get('error', '')}".rstrip(": "))
        if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
            return _error(400, "the request body is empty; send a JSON object")
        if tuple(first.get("loc", ())) == ("body",) and "json" not in request.headers.get("content-type", ""):
            return _error(400, "the request body must be a JSON object sent with Content-Type: application/json "
                               f"(got {request.headers.get('content-type') or 'no content type'})")
        if tuple(first.get("loc", ())) == ("body",) and first.get("type") in ("model_attributes_type", "dict_type"):
            return _error(400, "the request body must be a JSON object")
        model = _BODY_MODELS.get(request.url.path)
        if model is not None and first.get("type") == "missing":  # a field missing beside a stray one: most
            try:                                                    # often the other endpoint's (messages / prompt)
                stray = unknown_fields(model, await request.json())
            except ValueError:
                stray = []
            if stray:
                return _error(400, UNKNOWN_FIELDS.format(", ".join(stray)), param=stray[0])
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and not _is_type_tag(x))
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")  # our validators' own words
        return _error(400, f"{loc}: {msg}" if loc else msg, param=loc or None)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return _error(400, str(exc), param=exc.param)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        """A fault of ours: OpenAI's error shape, the traceback in the log (not in the response)."""
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal error ({type(exc).__name__}); the request was not completed", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        """Starlette's own errors in OpenAI's shape: unknown path 404, wrong method 405, and a body
        it cannot decode (e.g. invalid UTF-8) 400."""
        if exc.status_code == 400 and isinstance(exc.__cause__, DuplicateKey):  # from CheckedJSONRoute's parse
            key = exc.__cause__.args[0]
            return _error(400, f"the key {key!r} appears twice in one JSON object of the body", param=key)
        if exc.status_code == 400 and "parsing the body" in str(exc.detail):
            message = f"the request body could not be decoded: {await undecodable(request)}"
        elif exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 413:  # a chunked body past MAX_BODY_BYTES (_BodyLimit)
            return JSONResponse(json.loads(exc.detail), status_code=413)
        else:
            message = str(exc.detail)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, message, kind)

    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        await asyncio.to_thread(router.probe)  # live status, even while no request runs
        h = router.health()
        ok = any(v["healthy"] for v in h["verifiers"])
        return JSONResponse({"status": "ok" if ok else "unavailable", **h}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        router.update_gauges()
        body, ctype = router.metrics.exposition()
        return Response(body, media_type=ctype)

    def model_card() -> dict:
        return {"id": router.model_name, "object": "model", "created": int(router.started), "owned_by": "tandem"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != router.model_name:
            return _error(404, f"model {model!r} is not served here; use {router.model_name!r}", param="model")
        return model_card()

    async def run(request: Request, req, prompt, chat: bool, params: SamplingParams, chat_api: bool,
                  requested: tuple[str, int] | None = None, tools: list[Tool] | None = None):
        """Serve one request; ``requested`` = (field, value) of an explicit output limit, refused
        when prompt + it is past the served context (without one, the output stops at the context);
        ``tools``: a call in the output becomes the message's ``tool_calls``."""
        if req.model is not None and req.model != router.model_name:
            return _error(404, f"model {req.model!r} is not served here; use {router.model_name!r}", param="model")
        prompt_ids = None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt) and not chat_api:
            prompt_ids, prompt = prompt, None
        elif isinstance(prompt, list) and not chat_api:
            if not prompt:
                raise InvalidRequestError("prompt is empty (give a string, or a list of token ids)", param="prompt")
            if len(prompt) != 1:
                raise InvalidRequestError("send one prompt per request (a list of one string)", param="prompt")
            prompt = prompt[0]
        rid = ("chatcmpl-" if chat_api else "cmpl-") + uuid.uuid4().hex
        # tokenizing a long prompt takes a while: off the event loop, so other streams keep flowing;
        # a response that is not streamed asks the replica for its output once, when it finishes
        logprobs, top = req.wants_logprobs()
        try:
            engine_req = await asyncio.to_thread(router.make_request, prompt, params, prompt_ids=prompt_ids, chat=chat,
                                                 request_id=rid if req.n == 1 else f"{rid}-0", logprobs=logprobs,
                                                 top_logprobs=top, final_only=not req.stream)
        except InvalidRequestError as exc:
            if exc.param == "prompt" and chat_api:  # the chat API's prompt is its messages
                raise InvalidRequestError(str(exc), param="messages") from exc
            raise
        # n choices: one engine request each over the same prompt ids, a seed of its own (choice_seed)
        engine_reqs = [engine_req] + [
            router.make_request(None, params if params.seed is None else replace(params, seed=choice_seed(params.seed, i)),
                                prompt_ids=engine_req.prompt_ids, chat=False, request_id=f"{rid}-{i}",
                                logprobs=logprobs, top_logprobs=top, final_only=not req.stream)
            for i in range(1, req.n)]
        if requested is not None:
            router.check_room(len(engine_req.prompt_ids), *requested)
        created = int(time.time())
        if req.stream:
            if not await router.wait_available():  # none comes back in time: say so before the 200 of a stream
                return _error(503, router.unavailable_message(), "server_error")
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(_stream(router, engine_reqs, req.category, rid, created, chat_api,
                                               include_usage, tools), ping=15)
        return await _complete(router, request, engine_reqs, req.category, rid, created, chat_api, tools)

    @app.post(COMPLETIONS, dependencies=[Depends(identity_encoding)])
    async def completions(request: Request, body: CompletionRequest):
        if body.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        return await run(request, body, body.prompt, False, body.sampling(default_max_tokens), chat_api=False,
                         requested=None if body.max_tokens is None else ("max_tokens", body.max_tokens))

    @app.post(CHAT_COMPLETIONS, dependencies=[Depends(identity_encoding)])
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        params = body.sampling(default_max_tokens)
        requested = None if body.max_tokens is None else ("max_tokens", body.max_tokens)
        if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
            raise InvalidRequestError(f"max_tokens ({body.max_tokens}) and max_completion_tokens "
                                      f"({body.max_completion_tokens}) disagree; send one of them",
                                      param="max_completion_tokens")
        if body.max_completion_tokens is not None and body.max_tokens is None:
            params = replace(params, max_tokens=body.max_completion_tokens)
            requested = ("max_completion_tokens", body.max_completion_tokens)
        tools, choice = parse_tools(body.tools, body.tool_choice)
        for i, tool in enumerate(tools):  # each function's parameters must make a schema: said per tool
            await asyncio.to_thread(router.grammars.check, Structure(
                "json_schema", json.dumps(tool.parameters), param=f"tools.{i}.function.parameters"))
        structure = tool_structure(tools, choice) if tools else None
        if structure is not None:  # the call grammar
            if params.structure is not None:
                raise InvalidRequestError("response_format and tools both constrain the output; send one of them",
                                          param="response_format")
            params = replace(params, structure=structure)
        return await run(request, body, _chat_content(body.messages, tools, choice), True, params, chat_api=True,
                         requested=requested, tools=tools if choice not in (None, "none") else None)

    return app


def _logprobs(router: Router, logprobs: list[float] | None, tokens: list[str] | None,
              top: list[list[tuple[int, float]]] | None, chat_api: bool) -> dict | None:
    """OpenAI logprobs object of the output tokens whose texts are ``tokens`` (joined, the returned
    text: a token cut by a stop string counts up to the cut), with each token's ``top``
    alternatives ``(id, log-probability)`` when asked; None when the request did not ask. An
    alternative's text is its token decoded alone (``Router.token_text``)."""
    if logprobs is None:
        return None
    tops = top if top is not None else [[] for _ in logprobs]
    if chat_api:
        def entry(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [entry(tok, lp) | {"top_logprobs": [entry(router.token_text(t), v) for t, v in alts]}
                            for tok, lp, alts in zip(tokens, logprobs, tops)]}
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    alternatives = None  # completions: {text: log-probability}; tokens with the same text keep the best
    if top is not None:
        alternatives = []
        for alts in tops:
            best: dict[str, float] = {}
            for t, v in alts:
                best.setdefault(router.token_text(t), v)
            alternatives.append(best)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": alternatives, "text_offset": offsets}


def _choice(text: str, finish_reason: str | None, chat_api: bool, stream: bool, logprobs: dict | None = None,
            stop_reason: str | int | None = None, index: int = 0, tool_call: dict | None = None) -> dict:
    """Choice ``index``; ``stop_reason`` (vLLM's field) is the stop string or stop token id that
    ended the output (None for EOS, the token limit, or while it runs); ``tool_call``: the output
    was a call (``tools.parse_tool_call``): it is the message's ``tool_calls``, not its content."""
    if tool_call is not None:
        calls = [{"index": 0} | tool_call] if stream else [tool_call]
        message = {"content": None, "tool_calls": calls}
        return {"index": index, "delta" if stream else "message": message if stream else {"role": "assistant"} | message,
                # a complete call ended by EOS; a call cut by max_tokens or a stop string keeps its reason
                "finish_reason": "tool_calls" if finish_reason == "stop" and stop_reason is None else finish_reason,
                "logprobs": logprobs,
                "stop_reason": stop_reason}
    if chat_api:
        out = {"index": index, "delta" if stream else "message": {"content": text} if stream
               else {"role": "assistant", "content": text}}
    else:
        out = {"index": index, "text": text}
    return out | {"finish_reason": finish_reason, "logprobs": logprobs, "stop_reason": stop_reason}


async def _complete(router: Router, request: Request, engine_reqs: list, category: str, rid: str, created: int,
                    chat_api: bool, tools: list[Tool] | None = None):
    """The response of a non-streamed request: its choices (one engine request each) run
    concurrently; a client that goes away cancels them all (their KV slots are freed), and a
    failed choice fails the request (503) and cancels the others."""
    async def collect(engine_req):
        async for event in router.generate(engine_req, category, "chat" if chat_api else "text_completion"):
            if isinstance(event, (Done, Failed)):
                return event
        raise RuntimeError("the request ended without a result")

    tasks = [asyncio.ensure_future(collect(r)) for r in engine_reqs]
    try:
        while pending := [t for t in tasks if not t.done()]:  # (waits on the pending only: no spin)
            await asyncio.wait(pending, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            if any(t.done() and not t.cancelled() and isinstance(t.result(), Failed) for t in tasks):
                break
            if not all(t.done() for t in tasks) and await request.is_disconnected():
                return Response(status_code=499)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
    events = [t.result() for t in tasks if t.done() and not t.cancelled()]
    failed = [e for e in events if isinstance(e, Failed)]
    if failed:
        return _error(503, failed[0].message, "server_error")
    done = [e.completion for e in events]
    return {"id": rid, "object": "chat.completion" if chat_api else "text_completion", "created": created,
            "model": router.model_name,
            "system_fingerprint": router.fingerprint,
            "choices": [_choice(c.text, c.finish_reason, chat_api, False,
                                _logprobs(router, c.logprobs, c.token_texts, c.top_logprobs, chat_api), c.stop_reason,
                                index=i, tool_call=parse_tool_call(c.text, tools) if tools else None)
                        for i, c in enumerate(done)],
            "usage": usage(done)}


async def _stream(router: Router, engine_reqs: list, category: str, rid: str, created: int, chat_api: bool,
                  include_usage: bool, tools: list[Tool] | None = None):
    """Server-sent chunks of a streamed request; with several choices (``n``) their deltas
    interleave as they come, each chunk naming its choice's ``index``. A failed choice ends the
    stream with an error event (the others are cancelled); usage, when asked, comes last. With
    ``tools`` a choice's output is held until it ends, then sent as one delta: its ``tool_calls``
    when it is a call, else its text."""
    obj = "chat.completion.chunk" if chat_api else "text_completion"

    def chunk(choices: list, usage_: dict | None = None) -> str:
        return json.dumps({"id": rid, "object": obj, "created": created, "model": router.model_name,
                           "system_fingerprint": router.fingerprint, "choices": choices, "usage": usage_})

    if chat_api:
        for i in range(len(engine_reqs)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                          "logprobs": None}])
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, engine_req) -> None:
        try:
            async for event in router.generate(engine_req, category, "chat" if chat_api else "text_completion"):
                await merged.put((i, event))
        except Exception as exc:  # a fault of ours: the stream ends with an error event, never as if it finished
            log.exception("stream %s, choice %d failed", rid, i)
            merged.put_nowait((i, exc))
        finally:
            merged.put_nowait((i, None))  # this choice has nothing more

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(engine_reqs)]
    completions: dict[int, Completion] = {}
    held: dict[int, object] = {}  # with tools: each choice's deltas so far, merged
    failed = False
    try:
        running = len(tasks)
        while running:
            i, event = await merged.get()
            if event is None:
                running -= 1
            elif isinstance(event, Delta):
                out = event.output
                if tools:  # held: a call is only known as one once it is complete
                    out = held[i] = out if i not in held else merge_outputs(held[i], out)
                    if not out.finished:
                        continue
                if out.text_delta or out.finished or out.logprobs:
                    lp = _logprobs(router, out.logprobs, out.token_texts, out.top_logprobs, chat_api)
                    yield chunk([_choice(out.text_delta, out.finish_reason if out.finished else None, chat_api, True,
                                         lp, out.stop_reason if out.finished else None, index=i,
                                         tool_call=parse_tool_call(out.text_delta, tools) if tools else None)])
            elif isinstance(event, (Failed, Exception)):
                message, code = ((event.message, 503) if isinstance(event, Failed) else
                                 (f"internal error ({type(event).__name__}); the request was not completed", 500))
                yield json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
                failed = True
                break
            elif isinstance(event, Done):
                completions[i] = event.completion
        if include_usage and not failed and len(completions) == len(tasks):
            yield chunk([], usage([completions[i] for i in sorted(completions)]))
        yield "[DONE]"
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
