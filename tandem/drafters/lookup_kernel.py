"""Prompt lookup for a whole batch in one Triton kernel: the device form of the rule in
``tandem.drafters.lookup`` that chained rounds run inside their CUDA graph.

The plain-ops form (``lookup._lookup`` over ``suffix_match_lengths``, and the evidence loop of
``lookup_drafts_with_support``) issues 61 small kernels a round (four compare-and-AND passes
over ``[B, C]``, the thresholds, two masked reductions, the gathers; 101 with the evidence,
about ten more a draft position), each a few microseconds on an H100 whatever the batch. Here
one program per row scans its own history once: every earlier end ``e`` of the row is compared with
the row's last ``max_n`` tokens, and for each candidate match length L the most recent end that
leaves ``room`` tokens after it and the earliest end are kept, so the longest recurring suffix, its
occurrence and the continuation come out of one pass; with the evidence, a second pass walks the
occurrences of that suffix along the continuation. Integer work only: the results equal the plain
form's bit for bit (``tests/test_lookup_kernel.py``), on the GPU and under Triton's interpreter.
"""

from __future__ import annotations

import functools

import torch

from ..models import kernels

BLOCK = 256  # earlier ends compared per step of a row's scan


available = kernels.triton_runs_on  # where the kernel runs: CUDA with Triton, or the CPU under the interpreter


@functools.lru_cache(maxsize=1)
def _kernel():
    triton, tl = kernels._modules()

    @triton.jit
    def _suffix_match(base, e, last, ok, MAX_N: tl.constexpr, MIN_N: tl.constexpr):
        # [BLOCK] how many of the last tokens ending at e match the row's suffix x[last - s],
        # s = 0 .. MAX_N - 1 (leading run; off the start never matches); 0 below MIN_N
        run = ok
        length = tl.zeros(e.shape, tl.int64)
        for s in tl.static_range(MAX_N):
            at = last - s
            sfx = tl.where(at >= 0, tl.load(base + tl.maximum(at, 0)), -2)
            inside = e - s >= 0
            x = tl.load(base + (e - s), mask=run & inside, other=-1)
            run = run & inside & (x == sfx)
            length += run.to(tl.int64)
        return tl.where(length >= MIN_N, length, 0)

    globals()["_suffix_match"] = _suffix_match  # Triton resolves a called @jit function among the module's globals

    @triton.jit
    def ngram_lookup_kernel(hist_ptr, last_ptr, room_ptr, cont_ptr, lens_ptr, match_ptr, support_ptr,
                            survivors_ptr, C, hist_stride,
                            K: tl.constexpr, KP: tl.constexpr, MAX_N: tl.constexpr, MIN_N: tl.constexpr,
                            LP: tl.constexpr, WITH_SUPPORT: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row b; its sequence is x = hist[b, :last + 1] (T = last + 1 tokens)
        row = tl.program_id(0).to(tl.int64)
        base = hist_ptr + row * hist_stride
        last = tl.load(last_ptr + row).to(tl.int64)
        room = tl.load(room_ptr + row).to(tl.int64)
        offs = tl.arange(0, BLOCK).to(tl.int64)
        L = tl.arange(0, LP).to(tl.int64)  # candidate match lengths
        cap = C.to(tl.int64)
        recent = tl.full([LP], -1, tl.int64)  # per L: latest end with a match >= L and room after it
        earliest = tl.full([LP], 0, tl.int64) + cap  # per L: first end with a match >= L (C: none)
        for start in range(0, last, BLOCK):  # earlier ends e <= T - 2 = last - 1
            e = start + offs
            ok = e < last
            length = _suffix_match(base, e, last, ok, MAX_N, MIN_N)
            hit = (length[:, None] >= L[None, :]) & ok[:, None]  # [BLOCK, LP]
            roomy = hit & (e <= last - room)[:, None]
            recent = tl.maximum(recent, tl.max(tl.where(roomy, e[:, None], -1), axis=0))
            earliest = tl.minimum(earliest, tl.min(tl.where(hit, e[:, None], cap), axis=0))
        found = (earliest < cap) & (L >= MIN_N) & (L <= MAX_N)
        n = tl.max(tl.where(found, L, 0), axis=0)  # the longest recurring suffix (0: none)
        rec = tl.max(tl.where(L == n, recent, -1), axis=0)
        first = tl.where(rec >= 0, rec, tl.min(tl.where(L == n, earliest, cap), axis=0)) + 1
        lens = tl.where(n > 0, tl.maximum(tl.minimum(room, last + 1 - first), 0), 0)
        j = tl.arange(0, KP).to(tl.int64)
        cont = tl.load(base + tl.minimum(first + j, cap - 1), mask=j < lens, other=-1)
        tl.store(cont_ptr + row * K + j, cont, mask=j < K)
        tl.store(lens_ptr + row, lens)
        tl.store(match_ptr + row, n)
        if WITH_SUPPORT:
            # the occurrences of the matched suffix still agreeing with the drafts before position
            # jj (survivors) and those continuing with draft jj as well (support)
            survivors = tl.zeros([KP], tl.int64)
            support = tl.zeros([KP], tl.int64)
            for start in range(0, last, BLOCK):
                e = start + offs
                ok = e < last
                length = _suffix_match(base, e, last, ok, MAX_N, MIN_N)
                # (scalar conditions folded into the vector compares: Triton's interpreter cannot
                # take a mask made of a vector AND a 0-d bool)
                alive = ok & (length >= tl.where(n > 0, n, MAX_N + 1))
                for jj in tl.static_range(K):
                    alive = alive & (e <= tl.where(lens > jj, last - 1 - jj, -1))
                    draft = tl.sum(tl.where(j == jj, cont, 0), axis=0)
                    nxt = tl.load(base + (e + 1 + jj), mask=alive, other=-1)
                    agree = alive & (nxt == draft)
                    survivors += tl.where(j == jj, tl.sum(alive.to(tl.int64), axis=0), 0)
                    support += tl.where(j == jj, tl.sum(agree.to(tl.int64), axis=0), 0)
                    alive = agree
            tl.store(support_ptr + row * K + j, support, mask=j < K)
            tl.store(survivors_ptr + row * K + j, survivors, mask=j < K)

    return ngram_lookup_kernel


def ngram_lookup(history: torch.Tensor, last: torch.Tensor, room: torch.Tensor, k: int, max_n: int, min_n: int,
                 with_support: bool = False) -> tuple[torch.Tensor, ...]:
    """``lookup._lookup``'s continuation, length and match (and with ``with_support`` the evidence
    of ``lookup_drafts_with_support``) in one kernel launch; the arguments and results as
    ``lookup_drafts`` / ``lookup_drafts_with_support`` (``history`` ``[B, C]`` int64 with
    contiguous rows, ``last`` and ``room`` ``[B]`` int64).

    Returns:
        ``(cont [B, k], lens [B], match [B])``, then ``support`` and ``survivors`` ``[B, k]`` with
        ``with_support``; int64 on ``history``'s device.

    Raises:
        RuntimeError: not ``available`` on ``history``'s device.
    """
    if not available(history.device):
        raise RuntimeError(f"the lookup kernel does not run on {history.device} here (CUDA with Triton, "
                           "or TRITON_INTERPRET=1 on a CPU)")
    if history.stride(1) != 1:
        history = history.contiguous()
    B, C = history.shape
    dev = history.device
    cont = torch.empty((B, k), dtype=torch.int64, device=dev)
    lens = torch.empty(B, dtype=torch.int64, device=dev)
    match = torch.empty(B, dtype=torch.int64, device=dev)
    support = torch.empty((B, k), dtype=torch.int64, device=dev) if with_support else cont
    survivors = torch.empty((B, k), dtype=torch.int64, device=dev) if with_support else cont
    if B:
        _kernel()[(B,)](history, last.to(torch.int64).contiguous(), room.to(torch.int64).contiguous(), cont, lens,
                        match, support, survivors, C, history.stride(0), K=k, KP=kernels._pow2(max(k, 1)),
                        MAX_N=max_n, MIN_N=min_n, LP=kernels._pow2(max_n + 1), WITH_SUPPORT=with_support,
                        BLOCK=BLOCK)
    return (cont, lens, match, support, survivors) if with_support else (cont, lens, match)
