"""Stop rules over a run of new tokens (the single place they are applied).

A run is one or more tokens appended at once: 1 in plain decoding, the accepted draft tokens
plus the bonus token in speculative decoding. Rules are checked token by token, in order:
EOS / stop token ids, then stop strings (which may complete anywhere inside the run), then
max_tokens. Tokens after the boundary are dropped, so token ids, text and every metric derived
from the returned count are cut at the same place. A stop string is cut from the text, and with it
every token whose text starts at or after the cut (those of earlier runs included): the tokens
left are exactly those that made the returned text (the last may end inside the stop string: its
text is counted up to the cut). While a request runs, text that could begin a stop string is held
back, and with it the tokens that made it, so a stream never hands out a token it later drops.
"""

from __future__ import annotations

import torch

from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer, released_text


def draft_room(limit, context: int, prompt_len, num_tokens, max_new_tokens):
    """The draft-room rule: how many drafts a request may verify in a round that starts with
    ``num_tokens`` output tokens (the last one not yet in the KV cache). The last token and the
    drafts must fit the context, and no draft goes past the token limit (the bonus token after
    them is the limit's last). Negative where there is no room at all.

    The one rule for the engine's host-drafted rounds (``Engine._draft_room``), the device's
    chained rounds (``RoundState.feed``, through ``draft_room_end``, over int64 tensors) and
    replay (``tandem.bench.replay.walk_all``).

    Args:
        limit: drafts allowed otherwise (k, or a row's placeholder count): int or ``[B]`` tensor.
        context: the context limit in tokens (the KV cache's capacity).
        prompt_len, num_tokens, max_new_tokens: the request's prompt length, output tokens so far
            and effective token limit (``OutputState.max_new_tokens``): ints or ``[B]`` tensors.

    Returns:
        An int, or a ``[B]`` int64 tensor when any argument is a tensor.
    """
    held = prompt_len + num_tokens - 1  # tokens in the KV cache
    fit, stop = context - held - 1, max_new_tokens - num_tokens - 1
    if any(isinstance(v, torch.Tensor) for v in (limit, fit, stop)):
        return torch.minimum(torch.as_tensor(limit), torch.minimum(torch.as_tensor(fit), torch.as_tensor(stop)))
    return min(limit, fit, stop)


def draft_room_end(context: int, prompt_len, max_new_tokens):
    """``draft_room``'s two bounds as one number per request: the KV length its drafts may bring
    the cache to, ``end``, so that ``draft_room(limit, context, prompt_len, num_tokens,
    max_new_tokens) == min(limit, end - held)`` with ``held = prompt_len + num_tokens - 1`` the
    tokens the cache holds (the context bound is ``context - 1 - held``, the token limit's
    ``prompt_len + max_new_tokens - 2 - held``). A device round (``RoundState.feed``) then
    computes the room from the slot's cache length in two small ops instead of ten.

    Args:
        context: the context limit in tokens; prompt_len, max_new_tokens: ints or ``[B]`` int64
            tensors, as ``draft_room``.

    Returns:
        An int, or a ``[B]`` int64 tensor when an argument is a tensor.
    """
    by_limit = prompt_len + max_new_tokens - 2
    if isinstance(by_limit, torch.Tensor):
        return torch.clamp(by_limit, max=context - 1)
    return min(context - 1, by_limit)


class OutputState:
    """Generated tokens and text of one request.

    Args:
        tokenizer: for detokenization and the EOS ids.
        params: the request's sampling parameters (stop rules and max_tokens).
        max_new_tokens: the effective token limit: ``min(max_tokens, room left in the context)``.
        token_texts: keep each token's text (``token_texts``; a request with logprobs hands them
            out). Without it and without stop strings, a run of tokens takes a path with no
            per-token bookkeeping (the host's work a request a round bounds large batches).
        incremental: text as the tokens come (streams). False (a request whose output is read
            once it has finished): without token texts or stop strings nothing is detokenized
            until the request finishes, then its text comes from one decode of every token
            (``released_text``: the text the token-by-token path would hold), and ``take_delta``
            hands out nothing before then.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, max_new_tokens: int,
                 token_texts: bool = False, incremental: bool = True) -> None:
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_token_ids))
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it (not EOS)
        self._tokenizer = tokenizer
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._released = 0  # tokens handed out (take_delta), and with them text[:_start(_released)]
        # end offset in ``text`` of each token's text (a stop id: empty), kept where something reads
        # it (stop strings, token texts); else None, and take_delta counts handed-out characters
        self._ends: list[int] | None = [] if self._max_stop_len or token_texts else None
        self._released_chars = 0  # (without ``_ends``) len(text) handed out
        self._lazy = self._ends is None and not incremental  # text made once, when the request finishes
        self._detok = None if self._lazy else IncrementalDetokenizer(tokenizer)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int]) -> int:
        """Append a run of tokens, stopping at the first rule that fires.

        Returns:
            How many tokens of ``tokens`` were kept (the rest are dropped).

        Raises:
            RuntimeError: the request has already finished.
        """
        if self.finish_reason is not None:
            raise RuntimeError("append to a finished request")
        ids, ends, stop_ids = self.token_ids, self._ends, self.stop_ids
        if ends is None:  # no stop strings, no token texts: the run at once
            run = tokens[:max(0, self.max_new_tokens - len(ids))]
            stop_at = None
            if not stop_ids.isdisjoint(run):  # the first stop id ends it (it has no text)
                stop_at = next(i for i, t in enumerate(run) if t in stop_ids)
                run = run[:stop_at + 1]
            ids.extend(run)
            if not self._lazy:
                delta = self._detok.extend(run if stop_at is None else run[:-1])
                if delta:
                    self.text += delta
            if stop_at is not None:
                self._stop_at_id(run[-1])
            elif len(ids) >= self.max_new_tokens:
                self.finish_reason = "length"
            if self._lazy and self.finish_reason is not None:
                self.text = released_text(self._tokenizer, ids if stop_at is None else ids[:-1])
            return len(run)
        detok = self._detok.step
        before = len(ids)
        # (locals: a round appends a run to every request of the batch, on the host's critical path)
        stop_from = self.params.min_tokens if self._max_stop_len else None  # stop strings match from here
        text, limit = self.text, self.max_new_tokens
        for tok in tokens:
            ids.append(tok)
            if tok in stop_ids:
                ends.append(len(text))
                self._stop_at_id(tok)
                break
            delta = detok(tok)  # the completed text, or None / ""
            if delta:
                prev_len = len(text)
                self.text = text = text + delta
                ends.append(len(text))
                if stop_from is not None and len(ids) >= stop_from and self._cut_at_stop_string(prev_len):
                    self.finish_reason = "stop"  # (the cut shortened self.text; the loop ends here)
                    break
            else:
                ends.append(len(text))
            if len(ids) >= limit:
                self.finish_reason = "length"
                break
        return max(0, len(ids) - before)

    def _stop_at_id(self, tok: int) -> None:
        """Finish at stop id ``tok``: its reason is the id for a requested stop token, None for EOS (as vLLM)."""
        self.finish_reason = "stop"
        self.stop_reason = tok if tok in self.params.stop_token_ids else None

    def _cut_at_stop_string(self, prev_len: int) -> bool:
        """Cut the text at a stop string the last delta completed, and the tokens whose text
        starts at or after the cut (see the module docstring)."""
        if not self._max_stop_len:
            return False
        # a stop string completed by this delta starts after prev_len - (max_stop_len - 1)
        lo = max(0, prev_len - self._max_stop_len + 1)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, lo)) >= 0]
        if not hits:
            return False
        cut, self.stop_reason = min(hits)
        self.text = self.text[:cut]
        while self.token_ids and self._start(len(self.token_ids) - 1) >= cut:
            self.token_ids.pop()
            self._ends.pop()
        self._ends = [min(e, cut) for e in self._ends]
        return True

    def _start(self, i: int) -> int:
        return self._ends[i - 1] if i else 0

    def token_texts(self, lo: int = 0, hi: int | None = None) -> list[str] | None:
        """The text of each token in ``token_ids[lo:hi]``: they join to the text those tokens made
        (a token that completes no character yet has "", the next one the whole character; a stop
        id has ""). None where they are not kept (no ``token_texts`` and no stop strings)."""
        if self._ends is None:
            return None
        hi = len(self.token_ids) if hi is None else hi
        text, ends = self.text, self._ends
        return [text[ends[i - 1] if i else 0:ends[i]] for i in range(lo, hi)]

    def take_delta(self) -> tuple[str, int, int]:
        """Text and tokens not yet handed out: ``(text, lo, hi)`` with ``token_ids[lo:hi]`` the
        tokens that made it. While running, the last ``max_stop_len - 1`` characters are held back
        so a stop string never leaks partially into a stream, and so are the tokens whose text
        reaches into them; once finished, everything left."""
        lo = hi = self._released
        ends = self._ends
        if self._lazy and self.finish_reason is None:  # no text yet: nothing to hand out
            return "", lo, lo
        if ends is None:  # nothing held back: all that is new
            start, self._released_chars = self._released_chars, len(self.text)
            self._released = len(self.token_ids)
            return self.text[start:], lo, self._released
        if self._max_stop_len <= 1 or self.finish_reason is not None:  # nothing to hold back
            hi = len(self.token_ids)
        else:
            limit = len(self.text) - (self._max_stop_len - 1)
            while hi < len(self.token_ids) and ends[hi] <= limit:
                hi += 1
        self._released = hi
        return self.text[ends[lo - 1] if lo else 0:ends[hi - 1] if hi else 0], lo, hi
