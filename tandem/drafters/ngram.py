"""N-gram drafter: prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` speculator).

Matches the last n tokens (n from ``max_n`` down to ``min_n``) against the earlier sequence
(prompt and generated text) and proposes what followed the most recent earlier match that has
a full continuation (else the earliest match). q is
one-hot, so speculative sampling accepts draft token x with probability p(x).
"""

from __future__ import annotations

import numpy as np

from .base import DraftProposal, DraftRequest, Drafter, one_hot_features


def ngram_lookup(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """Continuation of an earlier occurrence of the longest matching suffix: the most recent one
    that still has ``k`` tokens after it, else the earliest (in a loop the most recent match ends
    just before the sequence's end and would propose almost nothing).

    Args:
        tokens: ``[T]`` int64 sequence.
        max_n, min_n: suffix lengths to try, longest first.
        k: tokens to propose at most.

    Returns:
        Up to k token ids (empty when no suffix of length >= min_n recurs).
    """
    T = len(tokens)
    for n in range(min(max_n, T - 1), min_n - 1, -1):
        suffix = tokens[T - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:T - 1], n)  # starts 0..T-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < T]  # a continuation must exist
        if hits.size:
            full = hits[hits + n + k <= T]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramDrafter(Drafter):
    """Prompt-lookup drafter. Stateless: nothing to roll back.

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

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = []
        for req in requests:
            if req.max_draft <= 0 or len(req.token_ids) < 2:
                out.append(DraftProposal.empty())
                continue
            toks = ngram_lookup(np.asarray(req.token_ids, dtype=np.int64), self.max_n, self.min_n, req.max_draft)
            out.append(DraftProposal(toks, None, one_hot_features(len(toks))))
        return out
