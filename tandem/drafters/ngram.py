"""N-gram drafter: prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` speculator).

Matches the last n tokens (n from ``max_n`` down to ``min_n``) against the earlier sequence
(prompt and generated text) and proposes what followed the most recent earlier match that has
a full continuation (else the earliest match). q is
one-hot, so speculative sampling accepts draft token x with probability p(x).

Two implementations of one rule: ``NgramIndex`` (host, per sequence, incremental) and
``ngram_drafts`` (device, the whole batch at once over the target's token history, so a round's
drafts are ready on the device without the host; ``tandem.target.LocalTarget.launch_chained``).
"""

from __future__ import annotations

from bisect import bisect_right

import torch

from .base import DraftProposal, DraftRequest, Drafter, KeepDrafting, one_hot_features, synced_index
from .lookup import suffix_match_lengths


class NgramIndex:
    """Incremental n-gram index of one sequence: ``lookup`` finds the longest recurring suffix in
    O(max_n - min_n) dictionary probes instead of a scan of the sequence (a scan is the reference
    in tests/test_verify.py).

    Each n-gram (n in [min_n, max_n]) maps to its start positions in ascending order; a round only
    indexes the tokens accepted since the last one.

    Args:
        max_n, min_n: n-gram sizes indexed.
    """

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new: list[int]) -> None:
        """Append tokens and index every n-gram that ends in them."""
        toks = self.tokens
        for tok in new:
            toks.append(tok)
            end = len(toks)
            for n, table in self.starts.items():
                if end >= n:
                    table.setdefault(tuple(toks[end - n:]), []).append(end - n)

    def lookup(self, k: int) -> list[int]:
        """Continuation of an earlier occurrence of the longest matching suffix (n from ``max_n``
        down to ``min_n``): the most recent one that still has ``k`` tokens after it, else the
        earliest (in a loop the most recent match ends just before the sequence's end and would
        propose almost nothing). Up to ``k`` ids; empty when no suffix of length >= min_n recurs."""
        toks = self.tokens
        T = len(toks)
        for n in range(min(self.max_n, T - 1), self.min_n - 1, -1):
            hits = self.starts[n].get(tuple(toks[T - n:]))
            if not hits or hits[0] > T - 1 - n:  # the only occurrence is the suffix itself
                continue
            i = bisect_right(hits, T - n - k) - 1  # the most recent start with k tokens after it
            start = (hits[i] if i >= 0 else hits[0]) + n
            return toks[start:start + k]
        return []


def ngram_drafts(history: torch.Tensor, last: torch.Tensor, room: torch.Tensor, max_n: int, min_n: int,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``NgramIndex.lookup`` for a batch of sequences at once, on their device, with no host sync
    and a fixed number of kernels (about twenty, whatever ``max_n``: it runs inside a CUDA graph).

    Row b's sequence is ``x = history[b, :last[b] + 1]`` of length T. For every earlier end index
    ``e <= T - 2`` the match length ``L[e]`` is how many of the tokens ending at e match the
    sequence's suffix (``tandem.drafters.lookup.suffix_match_lengths``). The longest n in
    ``[min_n, max_n]`` that some e reaches wins; of its matches (start ``st = e - n + 1``), the most recent one with
    ``room[b]`` tokens after it (``st <= T - n - room``, i.e. ``e <= T - 1 - room``), else the
    earliest; the drafts are the tokens after the match, at most ``room[b]`` and at most what the
    sequence holds.

    Args:
        history: ``[B, C]`` int64 token ids (entries past ``last`` are ignored).
        last: ``[B]`` int64 index of each row's last token (T - 1).
        room: ``[B]`` int64 drafts allowed per row, in [0, k] (0: none).
        max_n, min_n: n-gram sizes, 1 <= min_n <= max_n.
        k: width of the result.

    Returns:
        ``(tokens [B, k] int64, lens [B] int64)``: row b's drafts are ``tokens[b, :lens[b]]``.
    """
    B, C = history.shape
    dev = history.device
    T = last + 1
    e = torch.arange(C, device=dev)
    length = suffix_match_lengths(history, last, max_n)  # [B, C]
    length = torch.where(length >= min_n, length, torch.zeros_like(length))
    n = length.amax(1)  # [B]: the longest recurring suffix (0: none)
    hit = (length >= n[:, None]) & (n[:, None] > 0)
    big = torch.full_like(length, C)
    recent = torch.where(hit & (e[None, :] <= (T - 1 - room)[:, None]), e[None, :], torch.full_like(length, -1)).amax(1)
    earliest = torch.where(hit, e[None, :], big).amin(1)
    end = torch.where(recent >= 0, recent, earliest)
    first = end + 1  # the continuation starts after the match's end
    j = torch.arange(k, device=dev)
    lens = torch.where(n > 0, torch.minimum(room, T - first), torch.zeros_like(room)).clamp(min=0)
    cols = (first[:, None] + j[None, :]).clamp(max=C - 1)
    tokens = torch.where(j[None, :] < lens[:, None], history.gather(1, cols), torch.zeros_like(cols))
    return tokens, lens


class NgramDrafter(Drafter):
    """Prompt-lookup drafter. Keeps one ``NgramIndex`` per KV slot, extended with the tokens
    accepted since the previous round (rebuilt if the slot's sequence is not an extension of
    what it indexed, e.g. after the slot was reused); nothing to roll back, since only accepted
    tokens are ever indexed.

    Args:
        max_n, min_n: n-gram sizes to match, longest first (1 <= min_n <= max_n).

    Raises:
        ValueError: bad n-gram sizes.
    """

    name = "ngram"
    drafts_on_device = True  # ``device_drafts``: chained rounds draft without the host

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[int, NgramIndex] = {}

    def release(self, slot: int) -> None:
        self._index.pop(slot, None)

    def device_drafts(self, history: torch.Tensor, last: torch.Tensor, room: torch.Tensor,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``propose``'s drafts computed on the device from the target's token history
        (``ngram_drafts``; same rule, same tokens)."""
        return ngram_drafts(history, last, room, self.max_n, self.min_n, k)

    def _synced(self, req: DraftRequest) -> NgramIndex:
        return synced_index(self._index, req, lambda: NgramIndex(self.max_n, self.min_n))

    def propose(self, requests: list[DraftRequest], keep_drafting: KeepDrafting | None = None) -> list[DraftProposal]:
        out = []
        for req in requests:
            if req.max_draft <= 0 or len(req.token_ids) < 2:
                out.append(DraftProposal.empty())
                continue
            toks = self._synced(req).lookup(req.max_draft)
            out.append(DraftProposal(toks, None, one_hot_features(len(toks))))
        return out
