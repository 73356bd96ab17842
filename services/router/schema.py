"""What an OpenAI-compatible request body may be (``services.router.http`` serves them): the
request models of ``/v1/completions`` and ``/v1/chat/completions`` with their validation (strict
JSON types; a field OpenAI's API does not have, or one Tandem does not implement at a value that
would change the output, is an ``InvalidRequestError`` naming it: no field is ignored in silence),
and the body-level checks (a key twice in one object; why a body does not decode).
"""

from __future__ import annotations

import json
from typing import ClassVar, Literal

from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.data import refuse_duplicate_keys
from tandem.errors import InvalidRequestError
from tandem.logprobs import MAX_TOP_LOGPROBS
from tandem.sampling import SamplingParams
from tandem.structured import Structure

from services.common import MAX_TEMPERATURE, check_category

from .tools import response_format_structure

MAX_CHOICES = 16  # OpenAI's ``n``: choices per request at most (each decodes as a request of its own)

# OpenAI fields Tandem does not implement, accepted only at the value that changes nothing
# (None: any string, or null, is accepted and has no effect: ids for the caller's own bookkeeping
# and cache hints)
UNKNOWN_FIELDS = "unknown field(s): {} (not a field of the OpenAI API this server speaks)"
NO_OP_VALUES = {"functions": ([], None), "function_call": ("none", None), "best_of": (1, None),
                "store": (False, None), "metadata": (None,), "user": None, "safety_identifier": None,
                "prompt_cache_key": None, "service_tier": ("auto", "default", None), "modalities": (["text"], None),
                "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
                "web_search_options": (None,), "suffix": (None, "")}
# the same for the fields of a chat message
MESSAGE_NO_OP_VALUES = {"name": (None,), "refusal": (None,), "audio": (None,)}


class _Base(BaseModel):
    # extra fields are kept so that ``field_problems`` can name them; strict: a field of the wrong
    # JSON type is a 400, not converted ("4" or true for max_tokens, "yes" for stream)
    model_config = ConfigDict(extra="allow", strict=True)
    _no_op_values: ClassVar[dict] = NO_OP_VALUES

    def field_problems(self) -> list[tuple[str, str]]:
        """``(field, problem)`` of each extra field: "unknown" (no OpenAI field of this object),
        "unsupported" (one Tandem does not implement, at a value that would change the output:
        ``NO_OP_VALUES``) or "not a string" (an id or hint that must be a string)."""
        problems = []
        for name, value in (self.model_extra or {}).items():
            if name not in self._no_op_values:
                problems.append((name, "unknown"))
            elif self._no_op_values[name] is None:
                if value is not None and not isinstance(value, str):
                    problems.append((name, "not a string"))
            elif value not in self._no_op_values[name]:
                problems.append((name, "unsupported"))
        return problems

    def check_fields(self) -> None:
        """Raise ``InvalidRequestError`` naming every problem ``field_problems`` finds (unknown
        fields first: most often a typo)."""
        problems = self.field_problems()
        for kind, say in (("unknown", UNKNOWN_FIELDS),
                          ("not a string", "{} must be a string"),
                          ("unsupported", "unsupported field(s): {} (Tandem does not implement them; send them at "
                                          "their no-op value ({}) or leave them out)")):
            names = [name for name, k in problems if k == kind]
            if names:
                allowed = "; ".join(f"{n}: {' or '.join(json.dumps(v) for v in self._allowed(n))}" for n in names)
                raise InvalidRequestError(say.format(", ".join(names), allowed), param=names[0])

    def _allowed(self, path: str) -> tuple:
        """The no-op values of a field named by its path (``messages.0.name`` for a message's)."""
        table = MESSAGE_NO_OP_VALUES if path.startswith("messages.") else NO_OP_VALUES
        return table.get(path.rsplit(".", 1)[-1]) or ()


def unknown_fields(model: type[BaseModel], body) -> list[str]:
    """The top-level keys of a JSON ``body`` that ``model`` neither declares nor knows as a no-op
    field (what ``check_fields`` would name first, for a body that failed validation before it ran)."""
    if not isinstance(body, dict):
        return []
    return [k for k in body if k not in model.model_fields and k not in model._no_op_values]


class StreamOptions(_Base):
    include_usage: bool = False


class _SamplingFields(_Base):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)  # OpenAI's range
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)  # extension (vLLM)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # extension (vLLM)
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias in [-100, 100]
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0, allow_inf_nan=False)  # extension (vLLM)
    min_tokens: int = Field(default=0, ge=0)  # extension (vLLM)
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    category: str = "default"  # extension: acceptance statistics per category

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """An explicit null for a declared field means what leaving it out means (OpenAI's
        clients send null for a parameter not given)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value):
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError("stop must be a string or a list of strings")
        return value

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        self.check_fields()
        check_category(self.category)
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidRequestError("stream_options is only allowed with stream: true", param="stream_options")
            unknown = sorted(self.stream_options.model_extra or {})
            if unknown:
                raise InvalidRequestError(f"unknown stream_options field(s): {', '.join(unknown)} (only include_usage)",
                                          param=f"stream_options.{unknown[0]}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit():
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            bias[int(key)] = value
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              structure=self.structure(),
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed, stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              logit_bias=bias, min_tokens=self.min_tokens, presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty)


    def structure(self) -> Structure | None:
        """``response_format`` as a grammar (``tools.response_format_structure``)."""
        return response_format_structure(self.response_format)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # top alternatives per token

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_forms(cls, value):
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            raise ValueError("a batch of token-id prompts (a list of lists) is not supported: send one prompt "
                             "per request (a string, a list of one string, or one list of token ids)")
        if not isinstance(value, str) and not (isinstance(value, list) and (
                all(isinstance(v, str) for v in value)
                or all(isinstance(v, int) and not isinstance(v, bool) for v in value))):
            raise ValueError("prompt must be a string, a list of strings or a list of token ids (integers)")
        return value

    def wants_logprobs(self) -> tuple[bool, int]:
        """(return the tokens' log-probabilities, top alternatives per token)."""
        return self.logprobs is not None, self.logprobs or 0


class ChatMessage(_Base):
    _no_op_values: ClassVar[dict] = MESSAGE_NO_OP_VALUES
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: str | None = None  # the call a tool message answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # a response holds at most one call either way

    def field_problems(self) -> list[tuple[str, str]]:
        return super().field_problems() + [(f"messages.{i}.{f}", kind) for i, m in enumerate(self.messages)
                                           for f, kind in m.field_problems()]  # validation errors' path format

    def wants_logprobs(self) -> tuple[bool, int]:
        """(return the tokens' log-probabilities, top alternatives per token)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return self.logprobs, self.top_logprobs or 0


class _CheckedJSONRequest(Request):
    """A request whose ``json()`` (the one parse FastAPI makes of a JSON body) refuses a key twice
    in one object (``DuplicateKey``; FastAPI then raises its 400 "error parsing the body" from it,
    which the app's handler names). Its body is ``source``'s: read once and kept by the request
    the app's exception handlers get too."""

    def __init__(self, source: Request) -> None:
        super().__init__(source.scope, source.receive)
        self._source = source

    async def body(self) -> bytes:
        return await self._source.body()

    async def json(self):
        if not hasattr(self, "_json"):
            self._json = json.loads(await self.body(), object_pairs_hook=refuse_duplicate_keys)
        return self._json


class CheckedJSONRoute(APIRoute):
    """The app's route class: its endpoints see ``_CheckedJSONRequest`` (FastAPI's documented way
    to customise the request a route parses)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_CheckedJSONRequest(request))

        return route


def encoding_refused(request: Request) -> str | None:
    """Why the body's ``Content-Encoding`` (gzip, br, ...) is refused, or None for an uncompressed
    body: nothing is decompressed here."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return None
    return f"Content-Encoding {encoding!r} is not supported (send the body uncompressed)"


async def identity_encoding(request: Request) -> None:
    """A dependency of the POST endpoints: a compressed body is refused by name even when its bytes
    happen to parse (one that does not parse is named by ``undecodable``)."""
    why = encoding_refused(request)
    if why is not None:
        raise InvalidRequestError(why)


async def undecodable(request: Request) -> str:
    """Why a body the framework could not parse is bad, for the error message: invalid UTF-8 (and
    where), JSON nested past the parser's depth, or else UTF-8 JSON is what to send; a compressed
    body (``Content-Encoding``) is named as such."""
    why = encoding_refused(request)
    if why is not None:
        return why
    try:
        body = await request.body()
    except Exception:  # the stream was consumed and not kept: say what to send
        body = None
    if body is not None:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"invalid UTF-8 at byte {exc.start} (send UTF-8 JSON)"
        try:
            json.loads(text)
        except RecursionError:
            return "JSON nested deeper than the parser allows"
        except ValueError as exc:
            if "digits" in str(exc):  # Python's limit on integer digits (sys.get_int_max_str_digits)
                return "a number in it has more digits than the parser reads"
            return f"not valid JSON ({exc})"
    return "send UTF-8 JSON (invalid UTF-8 and JSON nested past the parser's depth end here)"
