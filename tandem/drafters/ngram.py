"""N-gram drafter: prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` speculator).

Matches the last n tokens (n from ``max_n`` down to ``min_n``) against the earlier sequence
(prompt and generated text) and proposes what followed the most recent earlier match that has
a full continuation (else the earliest match). q is
one-hot, so speculative sampling accepts draft token x with probability p(x).
"""

from __future__ import annotations

from bisect import bisect_right

from .base import DraftProposal, DraftRequest, Drafter, KeepDrafting, one_hot_features, synced_index


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

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[int, NgramIndex] = {}

    def release(self, slot: int) -> None:
        self._index.pop(slot, None)

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
