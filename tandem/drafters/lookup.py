"""Context lookup: what followed the most recent earlier occurrence of a sequence's suffix.

Prompt lookup decoding (Saxena 2023) proposes, as drafts, the tokens that followed an earlier
occurrence of the last n tokens. A SpecFormer head with ``lookup_tokens`` reads the same
continuation as an extra input to its draft slots (``SpecFormerHead.draft``), so it learns when
copying from the context pays (repetition loops, extraction, summarisation, translation of a
quoted text) and when its own forecast is better.

The rule, for a sequence ``x[0..i]`` whose last index is ``i``:

- the longest ``n`` in ``[1, max_n]`` whose n-gram ``x[i-n+1..i]`` also ends at an earlier index;
  ``e < i`` is the most recent such end, and ``n`` the match length (0: no n-gram recurs);
- the continuation is ``c_j = x[e + 1 + ((j - 1) mod (i - e))]`` for ``j = 1..k``: the tokens after
  the match, and, where they run past the end of the sequence, the same period again (in a loop
  of period ``i - e`` the text after the end repeats what followed the match).

``lookup_continuations`` computes every index of whole sequences at once (training, replay; a batch
of rows in one vectorised pass);
``LookupIndex`` keeps one growing sequence and answers for its end in O(max_n) dictionary probes
(serving, host-drafted rounds); ``lookup_drafts`` answers for the end of every row of a batch on
the device, inside a CUDA graph (chained rounds). All three give the same answer (tested).
``suffix_match_lengths`` is the device core it shares with the n-gram drafter's ``ngram_drafts``.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_N = 4  # longest n-gram matched


def lookup_continuations(tokens, k: int, max_n: int = MAX_N) -> tuple[np.ndarray, np.ndarray]:
    """Every index's lookup continuation, for one sequence ``[T]`` or for independent rows ``[B, T]``
    (a row never matches another; right padding only affects indexes inside it).

    Args:
        tokens: ``[T]`` or ``[B, T]`` token ids.
        k: continuation tokens per index.
        max_n: longest n-gram matched.

    Returns:
        ``cont`` ``[..., T, k]`` int64 (index ``i``: the continuation of ``x[0..i]``; -1 where nothing
        recurs) and ``match`` ``[..., T]`` int64 (the match length n, 0 for none).

    Raises:
        ValueError: ``k`` or ``max_n`` < 1, or ``tokens`` neither one- nor two-dimensional.
    """
    if k < 1 or max_n < 1:
        raise ValueError(f"k and max_n must be >= 1, got k={k}, max_n={max_n}")
    x = np.asarray(tokens, dtype=np.int64)
    if x.ndim not in (1, 2):
        raise ValueError(f"tokens must be one- or two-dimensional, got shape {x.shape}")
    if x.ndim == 1:
        cont, match = lookup_continuations(x[None], k, max_n)
        return cont[0], match[0]
    B, T = x.shape
    end = np.full((B, T), -1, np.int64)  # most recent earlier end of the longest recurring suffix
    match = np.zeros((B, T), np.int64)
    for n in range(1, max_n + 1):
        if T <= n:
            break
        ends = np.arange(n - 1, T)  # n-grams ending at n-1 .. T-1, in every row
        grams = np.stack([x[:, ends - n + 1 + s] for s in range(n)], axis=-1).reshape(-1, n)  # [B*(T-n+1), n]
        row = np.repeat(np.arange(B), len(ends))
        at_end = np.tile(ends, B)
        # sorted by row, then gram, then end: the previous equal entry is the latest earlier occurrence
        order = np.lexsort((at_end,) + tuple(grams[:, s] for s in reversed(range(n))) + (row,))
        g, r, e = grams[order], row[order], at_end[order]
        same = np.zeros(len(order), bool)
        same[1:] = (r[1:] == r[:-1]) & (g[1:] == g[:-1]).all(axis=1)
        hit = np.nonzero(same)[0]
        end[r[hit], e[hit]] = e[hit - 1]  # longer n overwrite shorter ones
        match[r[hit], e[hit]] = n
    cont = np.full((B, T, k), -1, np.int64)
    rows, cols = np.nonzero(end >= 0)
    if rows.size:
        src = end[rows, cols]
        period = cols - src  # >= 1
        j = np.arange(k)[None, :]
        cont[rows, cols] = x[rows[:, None], src[:, None] + 1 + j % period[:, None]]
    return cont, match


class LookupIndex:
    """One growing sequence, answering ``lookup_continuations``'s last row incrementally.

    Each n-gram (n <= max_n) maps to the most recent index where it ends; an n-gram is indexed
    once a later token exists, so a lookup never matches the suffix with itself.

    Args:
        max_n: longest n-gram matched.
    """

    def __init__(self, max_n: int = MAX_N) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0  # n-grams ending before this index are in ``latest``

    def extend(self, new) -> None:
        """Append token ids."""
        self.tokens.extend(int(t) for t in new)

    def lookup(self, k: int) -> tuple[list[int], int]:
        """The continuation (``k`` ids, or ``[]`` when nothing recurs) and match length of the
        sequence so far."""
        toks = self.tokens
        i = len(toks) - 1
        for e in range(self._indexed, i):  # index every n-gram ending before the last token
            for n in range(1, min(self.max_n, e + 1) + 1):
                self.latest[n][tuple(toks[e - n + 1:e + 1])] = e
        self._indexed = max(self._indexed, i)
        for n in range(min(self.max_n, i), 0, -1):
            e = self.latest[n].get(tuple(toks[i - n + 1:]))
            if e is not None:
                period = i - e
                return [toks[e + 1 + j % period] for j in range(k)], n
        return [], 0


def suffix_match_lengths(history: torch.Tensor, last: torch.Tensor, max_n: int) -> torch.Tensor:
    """For each row's sequence ``x = history[b, :last[b] + 1]`` (T tokens) and every earlier end
    index ``e <= T - 2``, how many of its last tokens match the sequence's suffix: the number of
    leading ``s`` in ``0 .. max_n - 1`` with ``x[e - s] == x[T - 1 - s]``, capped where the window
    runs off the start. ``max_n`` compares of contiguous shifted slices against one suffix token
    each, folded with a running AND: about three small kernels per ``s`` and no host work (it runs
    inside CUDA graphs). (A compare over strided end-aligned windows and a cumulative product over
    their last dimension, the first version, cost about 1 ms a round at batch 64 on an H200: both
    ran non-vectorised over ``[B, C, max_n]``.)

    Args:
        history: ``[B, C]`` int64 token ids >= 0 (entries past ``last`` are ignored).
        last: ``[B]`` int64 index of each row's last token, in ``[0, C)``.
        max_n: longest match counted (>= 1).

    Returns:
        ``[B, C]`` int64 match lengths in ``[0, max_n]``; 0 for ``e > T - 2``.
    """
    B, C = history.shape
    dev = history.device
    T = last + 1
    s = torch.arange(max_n, device=dev)
    e = torch.arange(C, device=dev)
    # shifted by s: padded[:, max_n - s + e] = x[e - s] (-1 before the start)
    # suffix[b, s] = x[T - 1 - s] (-2 before it)
    padded = torch.cat([torch.full((B, max_n), -1, dtype=history.dtype, device=dev), history], dim=1)
    at = T[:, None] - 1 - s[None, :]
    suffix = torch.where(at >= 0, history.gather(1, at.clamp(min=0)), torch.full_like(at, -2))
    running = (history == suffix[:, :1]) & (e[None, :] <= (T - 2)[:, None])  # s = 0, earlier ends only
    length = running.to(torch.int64)
    for i in range(1, max_n):
        running = running & (padded[:, max_n - i:max_n - i + C] == suffix[:, i:i + 1])
        length = length + running
    return length


def lookup_drafts(history: torch.Tensor, last: torch.Tensor, k: int, max_n: int = MAX_N
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``LookupIndex.lookup`` for the end of every row of a batch at once, on the device (no host
    sync; the module docstring's rule).

    Args:
        history: ``[B, C]`` int64, row b's sequence is ``history[b, :last[b] + 1]``.
        last: ``[B]`` int64 index of each row's last token.
        k: continuation tokens per row.
        max_n: longest n-gram matched.

    Returns:
        ``cont`` ``[B, k]`` int64 (-1 where nothing recurs) and ``match`` ``[B]`` int64 (the match
        length, 0 for none).
    """
    C = history.shape[1]
    e = torch.arange(C, device=history.device)
    length = suffix_match_lengths(history, last, max_n)
    match = length.amax(1)  # the longest recurring suffix
    hit = (length >= match[:, None]) & (match[:, None] > 0)
    end = torch.where(hit, e[None, :], torch.full_like(length, -1)).amax(1)  # its most recent earlier end
    period = (last - end).clamp(min=1)
    j = torch.arange(k, device=history.device)
    cols = (end[:, None] + 1 + j[None, :] % period[:, None]).clamp(0, C - 1)
    cont = torch.where(match[:, None] > 0, history.gather(1, cols), torch.full_like(cols, -1))
    return cont, match
