"""The engine's whole-request conveniences: tokenize a prompt, run prompts to completion, stream
one request, and hand out a finished request's result; and shortcuts to its target's runner,
KV cache and context limit. They use only ``Engine``'s public stepping API (``add_request``,
``step``, ``abort``, ``requests``), its ``tokenizer`` and its ``target``."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from .errors import InvalidRequestError
from .requests import Completion, RequestOutput
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .models.kv_cache import KVCache
    from .models.runner import ModelRunner

Prompt = str | list[dict[str, str]]  # plain text, or chat messages


def _is_int(x, bools: bool = False) -> bool:
    """One integer (a token id): Python, numpy or a 0-d tensor; bools only with ``bools``."""
    if getattr(x, "ndim", 0) > 0:  # a one-element tensor or array is a row, not an id
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return bools or not isinstance(x, bool)


class EngineConveniences:
    """Mixed into ``tandem.engine.Engine``."""

    @property
    def runner(self) -> "ModelRunner":
        """The local target's model runner (AttributeError for a remote target)."""
        return self.target.runner

    @property
    def cache(self) -> "KVCache":
        """The local target's KV cache (AttributeError for a remote target)."""
        return self.target.cache

    @property
    def max_seq_len(self) -> int:
        """The context limit: tokens per request, prompt and output."""
        return self.target.info.max_seq_len

    def encode_prompt(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Tokenize a prompt (``Tokenizer.encode_prompt``).

        Raises:
            InvalidRequestError: empty prompt or malformed messages.
        """
        return self.tokenizer.encode_prompt(prompt, chat)

    def completion(self, request_id: str) -> Completion:
        """The finished request's result (and forget it).

        Raises:
            KeyError: unknown id; RuntimeError: not finished yet.
        """
        req = self.requests[request_id]
        if not req.finished:
            raise RuntimeError(f"request {request_id} has not finished")
        del self.requests[request_id]
        n = len(req.output.token_ids)
        first = req.first_token_time or req.finish_time
        return Completion(
            request_id=req.request_id, text=req.output.text, token_ids=list(req.output.token_ids),
            finish_reason=req.output.finish_reason, prompt_tokens=len(req.prompt_ids),
            ttft_s=first - req.arrival_time, latency_s=req.finish_time - req.arrival_time,
            tpot_s=(req.finish_time - first) / (n - 1) if n > 1 else 0.0, spec=req.spec,
            logprobs=None if req.logprobs is None else list(req.logprobs),
            token_texts=None if req.logprobs is None else req.output.token_texts(),
            stop_reason=req.output.stop_reason, top_logprobs=None if req.top is None else list(req.top),
        )

    def generate(self, prompts: Iterable[Prompt] | None = None,
                 params: SamplingParams | Iterable[SamplingParams] | None = None, *,
                 prompt_ids: Iterable[Sequence[int]] | None = None, chat: bool = True,
                 on_finish=None) -> list[Completion]:
        """Run every prompt to completion with continuous batching; results in prompt order.

        Args:
            prompts: texts or chat-message lists (one text alone is one prompt).
            params: one SamplingParams for all, or one per prompt (None: the default
                SamplingParams, for all or for that prompt).
            prompt_ids: instead of ``prompts``, prompts already tokenized (token ids, as
                ``add_request(prompt_ids=...)``; ``chat`` does not apply): a caller that tokenized
                them elsewhere, or a benchmark timing decoding alone.
            chat: apply the chat template to plain-text prompts.
            on_finish: optional callback ``(Completion) -> None`` (progress bars).

        The requests are ``final_only`` (``Engine.make_request``): each one's text is decoded once,
        when it finishes. Deltas of other requests the steps advance are kept for the next
        ``step`` call; if ``on_finish`` (or a step) raises, this batch's unfinished requests are
        aborted, so none is left behind.

        Raises:
            InvalidRequestError: a prompt is invalid (nothing is queued then); the message starts
                with "prompt I of N:" (1-based).
            ValueError: both or neither of ``prompts`` and ``prompt_ids``; ``prompt_ids`` not a
                list of lists (one flat list of ids, a string); token-id lists given as
                ``prompts``; params neither a SamplingParams nor one per prompt.
        """
        if (prompts is None) == (prompt_ids is None):
            raise ValueError("pass prompts or prompt_ids (one of them)")
        tokenized = prompt_ids is not None
        if tokenized:
            if isinstance(prompt_ids, (str, bytes, dict)) or not isinstance(prompt_ids, Iterable):
                raise ValueError("prompt_ids: a list of token-id lists, one per prompt (texts go in prompts), "
                                 f"got {type(prompt_ids).__name__}")
            prompts = list(prompt_ids)
            if prompts and all(_is_int(t, bools=True) for t in prompts):
                raise ValueError("prompt_ids: a list of token-id lists, one per prompt; got one list of ints "
                                 "(for one prompt, pass [ids])")
            if any(p is None or _is_int(p, bools=True) for p in prompts):
                i = next(i for i, p in enumerate(prompts) if p is None or _is_int(p, bools=True))
                raise ValueError(f"prompt_ids[{i}] is {prompts[i]!r}, not a list of token ids")
        else:
            if hasattr(prompts, "dtype") and hasattr(prompts, "shape"):  # an array or tensor: token ids
                raise ValueError("prompts: token ids go in prompt_ids= (prompts takes texts or chat messages)")
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)  # one text is one prompt
            if prompts and all(_is_int(t) for t in prompts):
                raise ValueError("prompts: a list of ints looks like token ids: pass prompt_ids=[ids] "
                                 "(prompts takes texts or chat messages)")
            if any(isinstance(p, (list, tuple)) and p and all(_is_int(t) for t in p) for p in prompts):
                raise ValueError("prompts: token-id lists go in prompt_ids= (prompts takes texts or chat messages)")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
            raise ValueError(f"params: a SamplingParams, or one per prompt, got {type(params).__name__}")
        params = list(params)  # (any iterable of them)
        if len(params) != len(prompts):
            raise ValueError(f"need one SamplingParams per prompt: {len(params)} for {len(prompts)} prompts")
        ids: list[str] = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                ids.append(self.add_request(prompt_ids=p if tokenized else self.encode_prompt(p, chat=chat), params=sp,
                                            final_only=True))
            except InvalidRequestError as exc:
                for rid in ids:  # all or nothing: a bad prompt queues none of the batch
                    self.abort(rid)
                raise InvalidRequestError(f"prompt {i + 1} of {len(prompts)}: {exc}") from None
        results: dict[str, Completion] = {}
        pending = set(ids)
        try:
            while pending:
                for out in self._step_for(pending):
                    if out.finished:
                        pending.discard(out.request_id)
                        results[out.request_id] = self.completion(out.request_id)
                        if on_finish is not None:
                            on_finish(results[out.request_id])
        except BaseException:  # (on_finish raised, or the step did): none of this batch is left behind
            for rid in pending:
                self.abort(rid)
            raise
        return [results[i] for i in ids]

    def _step_for(self, mine: set[str]) -> list[RequestOutput]:
        """One ``step`` (after the admission policy's intake window, if it holds the queue back with
        nothing else to do); its deltas of requests not in ``mine`` are held for the next ``step``
        call (held before the caller sees its own: it may stop or raise while handling them)."""
        self.wait_for_intake()
        outs = self.step()
        self._held_outputs.extend(o for o in outs if o.request_id not in mine)
        return [o for o in outs if o.request_id in mine]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = True) -> Iterator[RequestOutput]:
        """Generate one request, yielding its deltas as they come. Other queued requests advance
        too; their deltas are kept for the next ``step`` call."""
        rid = self.add_request(prompt, params, chat=chat)
        try:
            while True:
                for out in self._step_for({rid}):
                    yield out
                    if out.finished:
                        self.requests.pop(rid, None)
                        return
        finally:
            if rid in self.requests and not self.requests[rid].finished:
                self.abort(rid)
