"""What the engine holds per request and hands out: a request's progress, its streaming deltas,
its finished result, one round's summary, and one round between its launch and its stop rules.
(``tandem.engine`` re-exports the public ones.)"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from .drafters.base import DraftProposal
from .metrics import SpecDecodeStats
from .errors import InvalidRequestError
from .sampling import SamplingParams, new_seed, request_generator
from .stopping import OutputState
from .structured import Grammar, GrammarCompiler  # noqa: F401 (annotations)
from .logprobs import MAX_TOP_LOGPROBS
from .target_items import TargetResult


@dataclass
class Request:
    """One generation request and its progress."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output: OutputState
    generator: torch.Generator | None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    slot: int | None = None
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    logprobs: list[float] | None = None  # the target's log-probability of each output token, when asked
    top_logprobs: int = 0  # alternatives asked per token (0 .. MAX_TOP_LOGPROBS)
    top: list[list[tuple[int, float]]] | None = None  # per output token, its top_logprobs alternatives
    grammar: "Grammar | None" = None  # structured output: the output's grammar state (params.structure)
    resumed: int = 0  # the prompt's last tokens that are output emitted elsewhere (a resumed request)
    pending: list[int] | None = None  # tokens of a collected round whose stop rules have not run yet
    final_only: bool = False  # its output is read once it has finished: no deltas before (``Engine.make_request``)

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None  # (not output.finished: read per request a round)

    @property
    def token_ids(self) -> list[int]:
        """Output tokens so far, the pending round's included (what the next round builds on)."""
        return self.output.token_ids + self.pending if self.pending else self.output.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.output.token_ids) + (len(self.pending) if self.pending else 0)

    @property
    def last_token(self) -> int:
        return self.pending[-1] if self.pending else self.output.token_ids[-1]


class RequestOutput(NamedTuple):
    """What one step produced for one request (a streaming delta). Immutable; a named tuple, not a
    frozen dataclass: the engine makes one per running request per round, on the host's critical
    path, and a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None = None  # of new_token_ids, when the request asked for them
    token_texts: list[str] | None = None  # with logprobs: each new token's text; they join to text_delta (OutputState.token_texts)
    stop_reason: str | int | None = None  # once finished: the stop string or stop token id that ended it
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (id, log-probability), best first


def new_request(tokenizer, vocab_size: int, max_seq_len: int, request_id: str, prompt=None,
                params: SamplingParams | None = None, *, prompt_ids: Sequence[int] | None = None, chat: bool = True,
                logprobs: bool = False, top_logprobs: int = 0, device: str = "cpu",
                grammars: "GrammarCompiler | None" = None, resumed: int = 0, final_only: bool = False) -> Request:
    """Validate and tokenize one request (``Engine.make_request``; a router does the same with
    the served model's tokenizer and limits, without an engine).

    Args:
        tokenizer: the model's ``tandem.tokenizer.Tokenizer``.
        vocab_size: token ids must be in [0, vocab_size).
        max_seq_len: the context limit (prompt + output tokens).
        request_id: the request's id.
        prompt / prompt_ids / params / chat / logprobs / top_logprobs: as ``Engine.make_request``.
        device: where the request's random draws are made.
        grammars: compiles ``params.structure`` into the request's grammar state (an engine's
            or a router's ``tandem.structured.GrammarCompiler``); required for structured requests.
        resumed, final_only: as ``Engine.make_request``.

    Raises:
        InvalidRequestError: empty prompt, prompt at or over the context limit, token ids outside
            the vocabulary, params that are not ``SamplingParams``, ``top_logprobs`` outside
            [0, MAX_TOP_LOGPROBS], a ``logit_bias`` or ``stop_token_ids`` token id outside the vocabulary, a malformed
            structure (schema or grammar).
    """
    params = params or SamplingParams()
    for name, value in (("logprobs", logprobs), ("chat", chat), ("final_only", final_only)):
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be true or false, got {value!r}", param=name)
    if not isinstance(request_id, str):
        raise InvalidRequestError(f"request_id must be a string, got {request_id!r}", param="request_id")
    if (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
            or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}",
                                  param="top_logprobs")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a tandem.sampling.SamplingParams, got {type(params).__name__}")
    if prompt_ids is None:
        if prompt is None:
            raise InvalidRequestError("give a prompt or prompt_ids", param="prompt")
        ids = tokenizer.encode_prompt(prompt, chat)
    else:
        if isinstance(prompt_ids, (str, bytes)):
            raise InvalidRequestError("prompt_ids must be a sequence of integer token ids, got a string",
                                      param="prompt")
        try:
            raw = list(prompt_ids)  # (once: a generator is read one time)
            ids = [operator.index(t) for t in raw]
        except TypeError:
            raise InvalidRequestError("prompt token ids must be integers", param="prompt") from None
        if any(isinstance(t, bool) for t in raw):  # operator.index takes True for 1
            raise InvalidRequestError("prompt token ids must be integers, not booleans", param="prompt")
    if not ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    bad = next((i for i, t in enumerate(ids) if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size}): {ids[bad]} at position {bad}",
                                  param="prompt")
    # token ids the sampling params name (SamplingParams checked they are >= 0); one past the
    # vocabulary would bias or stop nothing: refused, not ignored
    for param, named in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        outside = [t for t in named if t >= vocab_size]
        if outside:
            raise InvalidRequestError(f"{param} token id {outside[0]} is outside the vocabulary [0, {vocab_size})",
                                      param=param)
    if len(ids) >= max_seq_len:
        raise InvalidRequestError(
            f"prompt has {len(ids)} tokens; the context limit is {max_seq_len} tokens "
            f"(prompt plus at least one generated token)", param="prompt")
    max_new = min(params.max_tokens, max_seq_len - len(ids))  # prompt + output <= context limit
    if not params.greedy and params.seed is None:  # every sampled request has a seed: its random numbers
        params = replace(params, seed=new_seed())  # are keyed by (seed, position) wherever it runs
    if isinstance(resumed, bool) or not isinstance(resumed, int) or not 0 <= resumed < len(ids):
        raise InvalidRequestError(f"resumed output must be 0 .. {len(ids) - 1} prompt tokens, got {resumed!r}",
                                  param="output_tokens")
    grammar = None
    if params.structure is not None:
        if grammars is None:
            raise InvalidRequestError("structured output is not available here", param=params.structure.param)
        grammar = grammars.compile(params.structure)
        if resumed:  # the grammar continues after what was emitted
            grammar.advance(ids[len(ids) - resumed:])
    output = OutputState(tokenizer, params, max_new, token_texts=bool(logprobs or top_logprobs), incremental=not final_only)
    return Request(request_id, ids, params, output, request_generator(params, device),
                   logprobs=[] if logprobs or top_logprobs else None, top_logprobs=top_logprobs,
                   top=[] if top_logprobs else None, grammar=grammar, resumed=resumed, final_only=final_only)


@dataclass(frozen=True)
class RoundSummary:
    """One verification round over the running batch (for metrics exporters).

    Attributes:
        num_draft_tokens / num_accepted_tokens: summed over the batch, cut at stop boundaries.
        accepted_per_pos: sequences whose draft at 0-based position i was accepted.
        num_emitted_tokens: tokens the round emitted (accepted drafts + bonus tokens).
        batch_size: sequences verified; round_ms: draft + verify time (ms).
        num_drafts: sequences that verified at least one draft token.
        draft_width / acceptance_threshold: a context-aware policy's plan for this chained round
            (``tandem.control.WidthPlan``: drafts a row may verify, θ it was made under); None
            without one.
    """

    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    num_emitted_tokens: int
    batch_size: int
    round_ms: float
    num_drafts: int = 0
    draft_width: int | None = None
    acceptance_threshold: float | None = None


@dataclass(frozen=True)
class Completion:
    """A finished request.

    Attributes:
        text / token_ids: generated output, cut at the stop boundary.
        finish_reason: "stop" (EOS, stop id or stop string) or "length".
        prompt_tokens: prompt length in tokens.
        ttft_s: time to first token (s), from arrival; latency_s: arrival to finish (s).
        tpot_s: mean time per output token after the first (s).
        spec: speculative decoding counters (acceptance rate, mean accepted length, ...).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float
    latency_s: float
    tpot_s: float
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    logprobs: list[float] | None = None  # of token_ids, when the request asked for them
    token_texts: list[str] | None = None  # with logprobs: each token's text; they join to ``text``
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS or length)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, log-probability), best first

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class _Round:
    """One verify round from its launch to its stop rules (``Engine.step``)."""

    reqs: list[Request]
    proposals: list[DraftProposal]
    held: list[int]  # tokens each slot held before the round
    handle: object  # Target.launch_verify's
    t0: float
    results: list[TargetResult] | None = None
    wall_s: float = 0.0  # launch (or the previous round's collect, if later) to collect
    chained: bool = False  # queued from the device round state (Target.launch_chained)
    plan: object = None  # a chained round's WidthPlan under a draft policy (DraftPolicy.plan_width)

    def __post_init__(self) -> None:
        self.slots = frozenset(r.slot for r in self.reqs)  # the KV slots it runs on

    def surely_finishes(self, req: Request) -> bool:
        """The pending run finishes ``req`` by a rule that needs no text (a stop id or the token
        limit), so it need not be in the next round; a stop string is only found by the stop
        rules, after the next round was launched (that round's result is then discarded)."""
        if req.pending is None:
            return False
        out = req.output
        return len(out.token_ids) + len(req.pending) >= out.max_new_tokens or any(t in out.stop_ids for t in req.pending)
