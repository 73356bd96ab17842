"""Prompt lookup: the one rule every drafter, service, trainer and replay uses.

Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` speculator) proposes, as drafts, the
tokens that followed an earlier occurrence of the sequence's last n tokens. The n-gram drafter
proposes them as they are; a SpecFormer head with ``lookup_tokens`` reads them as an extra input
to its draft slots (``SpecFormerHead.draft``), so it learns when copying from the context pays.

The rule, for a sequence ``x[0..i]`` (T = i + 1 tokens), a width ``k`` and n-gram sizes
``min_n <= n <= max_n``:

- the match: the longest ``n`` (at most ``T - 1``) whose n-gram ``x[i-n+1..i]`` also ends at an
  earlier index ``e < i`` (0: none recurs);
- the occurrence: of the earlier ends of that n-gram, the most recent one with ``k`` tokens after
  it (``e <= i - k``), else the earliest (in a loop the most recent end sits just before ``i`` and
  would leave almost nothing to propose);
- the continuation: ``x[e+1 .. min(e+k, i)]``, at most ``k`` tokens and never past the end.

Measured by greedy replay of the committed Spec-Bench traces (480 prompts; pure prompt lookup,
``max_n`` 4): mean accepted length 2.045 at k = 4 (2.132 at k = 5, 2.276 at k = 8), against 2.042
(2.126, 2.267) for the rule that took the most recent occurrence and repeated its period past the
end, which SpecFormer heads read until then.

Each draft can come with the evidence behind it (``LookupIndex.lookup_with_support``,
``lookup_drafts_with_support``): how many earlier occurrences of the matched n-gram agree with
the drafts so far and how many of them continue with this one; ``support_features`` turns that
into the acceptance predictor's features, so a context-aware policy can tell a well-attested
draft from a one-off.

One rule, three forms, tested equal (``tests/test_specformer.py``, ``tests/test_chained.py``):
``LookupIndex`` keeps one growing sequence and answers for its end in O(max_n) dictionary probes
(host-drafted rounds, the drafter service); ``lookup_drafts`` answers for the end of every row of
a batch on the device inside a CUDA graph (chained rounds); ``lookup_continuations`` answers for
every index of whole sequences in one vectorised pass (training, analysis).
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np
import torch

from ..models import kernels
from . import lookup_kernel

MAX_N = 4  # longest n-gram matched
MIN_N = 1  # shortest n-gram matched


def check_sizes(max_n: int, min_n: int) -> None:
    """Raise ValueError unless ``1 <= min_n <= max_n``."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


def lookup_continuations(tokens, k: int, max_n: int = MAX_N, min_n: int = MIN_N
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Every index's continuation, for one sequence ``[T]`` or for independent rows ``[B, T]``
    (a row never matches another; right padding only affects indexes inside it).

    Args:
        tokens: ``[T]`` or ``[B, T]`` token ids.
        k: continuation width.
        max_n, min_n: n-gram sizes matched.

    Returns:
        ``cont`` ``[..., T, k]`` int64 (index ``i``: the continuation of ``x[0..i]``, -1 past its
        length; all -1 where nothing recurs) and ``match`` ``[..., T]`` int64 (n, 0 for none).

    Raises:
        ValueError: ``k`` < 1, bad n-gram sizes, or ``tokens`` neither one- nor two-dimensional.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    check_sizes(max_n, min_n)
    x = np.asarray(tokens, dtype=np.int64)
    if x.ndim not in (1, 2):
        raise ValueError(f"tokens must be one- or two-dimensional, got shape {x.shape}")
    if x.ndim == 1:
        cont, match = lookup_continuations(x[None], k, max_n, min_n)
        return cont[0], match[0]
    B, T = x.shape
    end = np.full((B, T), -1, np.int64)  # the chosen earlier end of the longest recurring suffix
    match = np.zeros((B, T), np.int64)
    for n in range(min_n, max_n + 1):
        if T <= n:
            break
        ends = np.arange(n - 1, T)  # n-grams ending at n-1 .. T-1, in every row
        grams = np.stack([x[:, ends - n + 1 + s] for s in range(n)], axis=-1).reshape(-1, n)  # [B*(T-n+1), n]
        row = np.repeat(np.arange(B), len(ends))
        at_end = np.tile(ends, B)
        # sorted by row, then gram, then end: a group of equal grams lists its ends in order
        order = np.lexsort((at_end,) + tuple(grams[:, s] for s in reversed(range(n))) + (row,))
        g, r, e = grams[order], row[order], at_end[order]
        new = np.ones(len(order), bool)
        new[1:] = (r[1:] != r[:-1]) | (g[1:] != g[:-1]).any(axis=1)
        group = np.cumsum(new) - 1
        first = np.flatnonzero(new)[group]  # each entry's earliest occurrence (sorted index)
        key = group * (T + 1) + e
        recent = np.searchsorted(key, group * (T + 1) + e - k, side="right") - 1  # latest end <= e - k
        hit = np.flatnonzero(first < np.arange(len(order)))  # an earlier occurrence exists
        pick = np.where(recent[hit] >= first[hit], recent[hit], first[hit])
        end[r[hit], e[hit]] = e[pick]  # longer n overwrite shorter ones
        match[r[hit], e[hit]] = n
    cont = np.full((B, T, k), -1, np.int64)
    rows, cols = np.nonzero(end >= 0)
    if rows.size:
        at = end[rows, cols][:, None] + 1 + np.arange(k)[None, :]
        cont[rows, cols] = np.where(at <= cols[:, None], x[rows[:, None], np.minimum(at, T - 1)], -1)
    return cont, match


class LookupIndex:
    """One growing sequence, answering the rule for its end incrementally: each n-gram maps to
    its start positions in ascending order, and ``extend`` indexes only the new tokens.

    Args:
        max_n, min_n: n-gram sizes matched.

    Raises:
        ValueError: bad n-gram sizes.
    """

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N) -> None:
        check_sizes(max_n, min_n)
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new) -> None:
        """Append token ids and index every n-gram that ends in them."""
        toks = self.tokens
        for tok in new:
            toks.append(int(tok))
            end = len(toks)
            for n, table in self.starts.items():
                if end >= n:
                    table.setdefault(tuple(toks[end - n:]), []).append(end - n)

    def lookup(self, k: int) -> tuple[list[int], int]:
        """The continuation of the sequence so far (1 to ``k`` ids, ``[]`` when nothing recurs)
        and its match length n (0 for none)."""
        toks = self.tokens
        T = len(toks)
        for n in range(min(self.max_n, T - 1), self.min_n - 1, -1):
            hits = self.starts[n].get(tuple(toks[T - n:]))
            if not hits or hits[0] > T - 1 - n:  # the only occurrence is the suffix itself
                continue
            i = bisect_right(hits, T - n - k) - 1  # the most recent start with k tokens after it
            start = (hits[i] if i >= 0 else hits[0]) + n
            return toks[start:start + k], n
        return [], 0

    def lookup_with_support(self, k: int, top_m: int = 0) -> tuple:
        """``lookup``, and the evidence behind each draft (``lookup_drafts_with_support`` on the
        host, equal to it): over the earlier occurrences of the matched n-gram, at draft position
        j, ``survivors[j]`` counts those whose continuation agrees with the drafts before j and
        reaches j, ``support[j]`` those of them that also continue with draft j (the occurrence
        the drafts came from is always one): ``(drafts, n, support, survivors)``.

        With ``top_m`` > 0 a fifth item, per position, ``top_m`` candidate tokens for hard-position
        branching: the draft, then the other continuations of the survivors by how many of them
        continue so (ties: the most recent first), padded with the draft."""
        drafts, n = self.lookup(k)
        if not drafts:
            return (drafts, n, [], [], []) if top_m > 0 else (drafts, n, [], [])
        toks = self.tokens
        T = len(toks)
        starts = self.starts[n][tuple(toks[T - n:])]
        cont = np.asarray([s + n for s in starts if s <= T - 1 - n], dtype=np.int64)  # earlier occurrences only
        seq = np.asarray(toks, dtype=np.int64)
        alive = np.ones(len(cont), dtype=bool)
        support, survivors, candidates = [], [], []
        for j, tok in enumerate(drafts):
            alive &= cont + j <= T - 1  # the occurrence reaches position j
            nxt = seq[np.minimum(cont + j, T - 1)]
            agree = alive & (nxt == tok)
            survivors.append(int(alive.sum()))
            support.append(int(agree.sum()))
            if top_m > 0:
                counts: dict[int, int] = {}
                for t in nxt[alive][::-1].tolist():  # most recent first: ties keep that order
                    counts[t] = counts.get(t, 0) + 1
                others = sorted((t for t in counts if t != tok), key=lambda t: -counts[t])
                candidates.append(([tok] + others + [tok] * top_m)[:top_m])
            alive = agree
        return (drafts, n, support, survivors, candidates) if top_m > 0 else (drafts, n, support, survivors)


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


def lookup_drafts(history: torch.Tensor, last: torch.Tensor, room: torch.Tensor, k: int,
                  max_n: int = MAX_N, min_n: int = MIN_N, kernel: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``LookupIndex.lookup`` for the end of every row of a batch at once, on the device, with no
    host sync and a fixed number of kernels (it runs inside a CUDA graph): one on CUDA where Triton
    imports (``tandem.drafters.lookup_kernel``), 61 in plain ops elsewhere (at ``max_n`` 4; each
    n-gram size adds three), with equal results. Row b's width is ``room[b]``: its continuation comes from the
    most recent occurrence with ``room[b]`` tokens after it, and holds at most ``room[b]`` tokens.

    Args:
        history: ``[B, C]`` int64 token ids; row b's sequence is ``history[b, :last[b] + 1]``.
        last: ``[B]`` int64 index of each row's last token, in ``[0, C)``.
        room: ``[B]`` int64 continuation width per row, in ``[0, k]`` (0: none).
        k: width of the result.
        max_n, min_n: n-gram sizes matched, ``1 <= min_n <= max_n``.
        kernel: None (the default) for the kernel where it runs by default (CUDA with Triton);
            True for it wherever it runs (also the CPU under ``TRITON_INTERPRET=1``), False for
            the plain ops.

    Returns:
        ``cont`` ``[B, k]`` int64 (row b's continuation is ``cont[b, :lens[b]]``, -1 after it),
        ``lens`` ``[B]`` int64 and ``match`` ``[B]`` int64 (the match length n, 0 for none).
    """
    if _on_kernel(history, kernel):
        return lookup_kernel.ngram_lookup(history, last, room, k, max_n, min_n)
    cont, lens, n, _ = _lookup(history, last, room, k, max_n, min_n)
    return cont, lens, n


def lookup_drafts_with_support(history: torch.Tensor, last: torch.Tensor, room: torch.Tensor, k: int,
                               max_n: int = MAX_N, min_n: int = MIN_N, kernel: bool | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lookup_drafts`` plus the evidence behind each draft position (``LookupIndex.support``, on
    the device, inside a CUDA graph): over the earlier occurrences of the matched n-gram, at draft
    position j, ``survivors[b, j]`` counts those whose continuation agrees with the drafts before
    j and reaches j, and ``support[b, j]`` those of them that also continue with draft j.

    In plain ops the occurrences still alive are carried from position to position as one
    ``[B, C]`` mask, about seven small kernels a position; the kernel (``kernel`` as in
    ``lookup_drafts``) walks them in the same launch as the lookup. (The first version compared
    all positions at once over ``[B, C, k]`` and took the running AND with a cumulative product
    along k: PyTorch's scan over a short innermost dimension cost 0.44 ms a round at batch 64 on an
    H200, a fifth of the round's GPU time.)

    Returns:
        ``cont``, ``lens``, ``match`` as ``lookup_drafts``; ``support`` and ``survivors`` ``[B, k]``
        int64 (0 past each row's continuation).
    """
    if _on_kernel(history, kernel):
        return lookup_kernel.ngram_lookup(history, last, room, k, max_n, min_n, with_support=True)
    cont, lens, n, hit = _lookup(history, last, room, k, max_n, min_n)
    B, C = history.shape
    last_end = (last - 1)[:, None]  # [B, 1]: an occurrence reaching position j ends at e <= T - 2 - j
    e = torch.arange(C, device=history.device)[None, :]
    alive = hit  # [B, C] occurrences agreeing with every draft so far
    survivors, support = [], []
    for j in range(k):
        width = C - 1 - j  # ends whose j-th next token lies inside the history
        if width <= 0:
            survivors.append(torch.zeros_like(lens))
            support.append(torch.zeros_like(lens))
            continue
        alive = alive[:, :width] & (e[:, :width] <= last_end - j) & (lens > j)[:, None]
        agree = alive & (history[:, 1 + j:] == cont[:, j:j + 1])
        survivors.append(alive.sum(1))
        support.append(agree.sum(1))
        alive = agree
    if not k:
        return cont, lens, n, cont.clone(), cont.clone()  # [B, 0]
    return cont, lens, n, torch.stack(support, 1), torch.stack(survivors, 1)


def _on_kernel(history: torch.Tensor, kernel: bool | None) -> bool:
    """Whether a device lookup runs as one kernel (``lookup_kernel``): by default on CUDA where
    Triton imports; ``kernel`` True asks for it anywhere it runs (the CPU under Triton's
    interpreter, in tests), False for the plain ops."""
    return kernels.round_kernels_on(history.device) if kernel is None else kernel


def _lookup(history: torch.Tensor, last: torch.Tensor, room: torch.Tensor, k: int, max_n: int, min_n: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lookup_drafts``, and ``hit`` ``[B, C]``: the earlier ends of each row's matched n-gram."""
    B, C = history.shape
    dev = history.device
    T = last + 1
    e = torch.arange(C, device=dev)
    length = suffix_match_lengths(history, last, max_n)  # [B, C]
    length = torch.where(length >= min_n, length, torch.zeros_like(length))
    n = length.amax(1)  # [B]: the longest recurring suffix (0: none)
    hit = (length >= n[:, None]) & (n[:, None] > 0)
    recent = torch.where(hit & (e[None, :] <= (T - 1 - room)[:, None]), e[None, :], torch.full_like(length, -1)).amax(1)
    earliest = torch.where(hit, e[None, :], torch.full_like(length, C)).amin(1)
    first = torch.where(recent >= 0, recent, earliest) + 1  # the continuation starts after the match's end
    j = torch.arange(k, device=dev)
    lens = torch.where(n > 0, torch.minimum(room, T - first), torch.zeros_like(room)).clamp(min=0)
    cols = (first[:, None] + j[None, :]).clamp(max=C - 1)
    cont = torch.where(j[None, :] < lens[:, None], history.gather(1, cols), torch.full_like(cols, -1))
    return cont, lens, n, hit


def support_features(support: torch.Tensor, survivors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Predictor features ``[..., 4]`` of n-gram drafts from their evidence, in the schema of
    ``tandem.drafters.base.distribution_features``, over the empirical continuation distribution
    of the survivors N with one pseudo-occurrence of "something else" (a one-off is not certain):
    the draft's share s = support / (N + 1), the other survivors' o = (N - support) / (N + 1), the
    unknown u = 1 / (N + 1). The entropy slot holds the draft's surprisal -ln s (for a model
    drafter's draft, the mode of a peaked q, the two nearly agree; here the draft need not be the
    mode, and ``entropy_score``'s exp(-x) then gives s itself), then s as the top-1 probability,
    s - max(o, u) as the margin (negative where the evidence prefers another token), and the
    1-based position. Positions without a draft (support 0) get s = 0 and a surprisal of 20.

    Args:
        support, survivors: int tensors of one shape (``lookup_drafts_with_support``).
        positions: 1-based draft positions, broadcastable to them.
    """
    n = survivors.to(torch.float32) + 1.0
    s = support.to(torch.float32) / n
    o = (survivors - support).to(torch.float32) / n
    u = 1.0 / n
    surprisal = -s.clamp_min(2e-9).log()
    pos = torch.as_tensor(positions, dtype=torch.float32, device=s.device).expand_as(s)
    return torch.stack([surprisal, s, s - torch.maximum(o, u), pos], dim=-1)
