"""A sampled round's per-row work in Triton kernels: counter-based uniforms in one launch, and
the sampling transform (temperature, top-k, top-p) without sorting the vocabulary.

``tandem.sampling.counter_uniform`` in PyTorch ops is four 32-bit integer hashes of int64 tensors,
each multiply in 16-bit halves so that no product overflows: about 115 element-wise launches a
call, ~1 µs each on an H100 whatever the size, and a sampled round calls it two or three times
(the accept tests, the token drawn after them, a device drafter's drafts). Measured on an H100
(2026-12-07, docs/benchmarks.md, "Sampled decoding"), that took a target-only sampled step from
254 to 455 GPU operations. Here the same arithmetic, operation for operation on int64 lanes, is
one launch, so its numbers are the PyTorch ops' bit for bit (``tests/test_sampling_kernels.py``,
on the GPU and under Triton's interpreter).

``tandem.sampling.sampling_probs`` in PyTorch ops sorts every row of the vocabulary to find its
top-k / top-p cut: on an H100, 0.33 ms for 64 rows of 49,152 logits and 1.7 ms for 320 (a verify
step of 64 sequences x 5 tokens), then a cumulative sum and a scatter back. Here one program per
row finds the same cut by searching the logits' bit patterns, which order as the logits do:
each pass over the row sums, for ``WAYS`` candidate cuts at once, the count (top-k) or the
softmax mass (top-p) of the logits at or above each, and keeps the interval where the wanted
count or mass is first reached, so four passes settle a bf16 logit (eight a float32 one). Then
one pass writes the probabilities. Every program reads its row in fixed column steps
(``SAMPLING_BLOCK``, ``SEARCH_BLOCK``) and sums in a fixed order, so a row's result does not depend on the rows beside it. The
cut is the PyTorch ops' (tokens tied with it stay in both); their sums run in another order, so
the probabilities agree to rounding, and a cut can differ where a row's mass reaches ``top_p``
within rounding of it.

``tandem.sampling.sample_inverse_cdf`` in PyTorch ops is a cumulative sum over each row (63 µs
for up to 64 rows of 49,152 on an H100, 185 µs for 320), a search and a reversed copy for the
fallback index; here one program per row sums its row, then walks it in ``SAMPLING_BLOCK``
steps until the running sum passes the drawn point: two passes, one launch.
"""

from __future__ import annotations

import functools

import torch

from .models import kernels

_MASK32 = 0xFFFFFFFF
UNIFORM_BLOCK = 256  # numbers a program makes


_mul32 = _hash32 = None  # the kernel's device functions, made with it (a jit function calls another through module globals)


@functools.lru_cache(maxsize=1)
def _uniform_kernel():
    global _mul32, _hash32
    triton, tl = kernels._modules()

    @triton.jit
    def _mul32(x, C_LO, C_HI):
        # x * (C_HI << 16 | C_LO) mod 2**32 for int64 x in [0, 2**32): sampling._mul32's halves
        return (x * C_LO + (((x * C_HI) & 0xFFFF) << 16)) & 0xFFFFFFFF

    @triton.jit
    def _hash32(x):
        # Chris Wellons' "triple32", as sampling._hash32
        x = x ^ (x >> 17)
        x = _mul32(x, 0xD4BB, 0xED5A)
        x = x ^ (x >> 11)
        x = _mul32(x, 0x1B51, 0xAC4C)
        x = x ^ (x >> 15)
        x = _mul32(x, 0x8BAB, 0x3184)
        return x ^ (x >> 14)

    @triton.jit
    def counter_uniform_kernel(seed_ptr, pos_ptr, out_ptr, n, per_row, STREAM_KEY: tl.constexpr,
                               BLOCK: tl.constexpr):
        # number i: row i // per_row's seed, position pos[i]
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        seed = tl.load(seed_ptr + i // per_row, mask=ok, other=0).to(tl.int64)
        lo = seed & 0xFFFFFFFF
        hi = (seed >> 32) & 0xFFFFFFFF
        key = _hash32(_hash32(lo ^ STREAM_KEY) ^ hi)
        pos = tl.load(pos_ptr + i, mask=ok, other=0).to(tl.int64)
        h = _hash32(key ^ (pos & 0xFFFFFFFF))
        tl.store(out_ptr + i, (h >> 8).to(tl.float32) * (1.0 / 16777216.0), mask=ok)

    return counter_uniform_kernel


def stream_key(stream: int | torch.Tensor) -> int | torch.Tensor:
    """The 32-bit constant a stream (an int, or an int64 tensor of them) mixes into the seed."""
    return (stream * 0x9E3779B9 + 0x7F4A7C15) & _MASK32


def counter_uniform(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """``tandem.sampling.counter_uniform`` in one launch (bit for bit its numbers), for one stream.

    Args:
        seed: ``[B]`` int64 in ``[0, 2**63)``.
        position: ``[B, ...]`` int64 in ``[0, 2**32)``; row b's numbers use ``seed[b]``.
        stream: the stream (``sampling.STREAM_*``).

    Returns:
        float32 in [0, 1), shaped like ``position``, on its device (CUDA, or the CPU under
        Triton's interpreter).

    Raises:
        ValueError: ``position``'s first dimension is not ``seed``'s.
    """
    if position.dim() == 0 or position.shape[0] != seed.shape[0]:
        raise ValueError(f"counter_uniform: position {tuple(position.shape)} needs seed's {tuple(seed.shape)} rows")
    pos = position.contiguous()
    out = torch.empty(pos.shape, dtype=torch.float32, device=pos.device)
    n = pos.numel()
    if n:
        grid = (-(-n // UNIFORM_BLOCK),)
        _uniform_kernel()[grid](seed.contiguous(), pos, out, n, n // seed.shape[0], STREAM_KEY=stream_key(stream),
                                BLOCK=UNIFORM_BLOCK)
    return out


SAMPLING_BLOCK = 2048  # logits a step of a row's pass reads
WAYS = 16  # candidate cuts a pass of the search sums for: 4 passes settle a 16-bit key, 8 a 32-bit one
# logits a step of a search pass reads: each of a program's threads keeps a running sum per
# candidate for its columns, reduced across the program once a pass (reducing [2048, 16] sums at
# every step instead made the kernel 0.72 ms for 64 rows on an H200, docs/benchmarks.md)
SEARCH_BLOCK = 256
SAMPLING_WARPS = 8

_key = _cut_search = None  # device functions of the sampling kernel (module globals, as above)


@functools.lru_cache(maxsize=1)
def _sampling_kernel():
    global _key, _cut_search
    triton, tl = kernels._modules()

    @triton.jit
    def _key(raw, BITS):
        # an unsigned key of a float's bits that orders as the floats do (-0 as +0), int64
        if BITS == 16:
            b = raw.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
            b = tl.where(b == 0x8000, 0, b)
            return tl.where(b >= 0x8000, 0xFFFF - b, b + 0x8000)
        else:
            b = raw.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            b = tl.where(b == 0x80000000, 0, b)
            return tl.where(b >= 0x80000000, 0xFFFFFFFF - b, b + 0x80000000)

    @triton.jit
    def _cut_search(src, V, temp, m, lo, target, MASS, BITS, BLOCK, WAYS_: tl.constexpr):
        # the largest key t >= lo whose count (or, with MASS, softmax mass exp(x - m)) of keys >= t
        # reaches target (it must at lo), and that count or mass
        hi = lo * 0 + (1 << BITS)
        j = tl.arange(0, WAYS_)
        found = tl.sum(tl.zeros([WAYS_], tl.float32), axis=0)
        for _ in range(0, (BITS + 3) // 4):  # each pass narrows [lo, hi) by WAYS_ (16 = 2 ** 4)
            step = tl.maximum((hi - lo + WAYS_ - 1) // WAYS_, 1)
            cand = lo + j.to(tl.int64) * step  # [WAYS_]; cand[0] = lo
            # each thread keeps its columns' sums for every candidate; one reduction after the pass
            # (the columns loaded as a [BLOCK, 1] column, so that they meet the candidates in the
            # sums' own layout, without a trip through shared memory each step)
            part = tl.zeros([BLOCK, WAYS_], tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)[:, None]
                ok = cols < V
                raw = tl.load(src + cols, mask=ok, other=0.0)
                key = _key(raw, BITS)
                if MASS:
                    w = tl.where(ok, tl.exp(raw.to(tl.float32) / temp - m), 0.0)
                else:
                    w = tl.where(ok, 1.0, 0.0)
                part += tl.where(key >= cand[None, :], w, 0.0)
            acc = tl.sum(part, axis=0)
            good = (acc >= target) & (cand < hi)
            best = tl.max(tl.where(good, j, 0), axis=0)
            found = tl.sum(tl.where(j == best, acc, 0.0), axis=0)
            lo = lo + best.to(tl.int64) * step
            hi = tl.minimum(hi, lo + step)
        return lo, found

    @triton.jit
    def sampling_probs_kernel(x_ptr, t_ptr, k_ptr, p_ptr, out_ptr, V, x_stride, out_stride,
                              BITS: tl.constexpr, FILTER: tl.constexpr, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                              WAYS_: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        src = x_ptr + row * x_stride
        temp = tl.load(t_ptr + row).to(tl.float32)
        # the softmax's max and sum of x = logit / T, in fixed column steps
        mv = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temp
            mv = tl.maximum(mv, x)
        m = tl.max(mv, axis=0)
        zv = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temp
            zv += tl.where(cols < V, tl.exp(x - m), 0.0)
        z = tl.sum(zv, axis=0)
        cut = (row * 0).to(tl.int64)  # the least key: every token kept
        if FILTER:
            k = tl.load(k_ptr + row)
            if (k > 0) & (k < V):  # top-k: the largest cut with k logits at or above it
                cut, _ = _cut_search(src, V, temp, m, cut, k.to(tl.float32), False, BITS, SEARCH_BLOCK, WAYS_)
                zk = tl.zeros([BLOCK], tl.float32)  # the mass it keeps
                for start in range(0, V, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    ok = cols < V
                    raw = tl.load(src + cols, mask=ok, other=0.0)
                    zk += tl.where(ok & (_key(raw, BITS) >= cut), tl.exp(raw.to(tl.float32) / temp - m), 0.0)
                z = tl.sum(zk, axis=0)
            p = tl.load(p_ptr + row).to(tl.float32)
            if p < 1.0:  # top-p over the top-k distribution: the largest cut keeping p of its mass
                cut, z = _cut_search(src, V, temp, m, cut, p * z, True, BITS, SEARCH_BLOCK, WAYS_)
        dst = out_ptr + row * out_stride
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            raw = tl.load(src + cols, mask=ok, other=0.0)
            keep = _key(raw, BITS) >= cut
            tl.store(dst + cols, tl.where(keep, tl.exp(raw.to(tl.float32) / temp - m) / z, 0.0), mask=ok)

    return sampling_probs_kernel


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   filtered: bool = True) -> torch.Tensor:
    """``tandem.sampling.sampling_probs`` in one launch, one program a row (see the module docstring).

    Args:
        logits: ``[B, V]`` bfloat16, float16 or float32, the last dimension contiguous.
        temperature: ``[B]`` > 0; top_k: ``[B]`` int64 (0 = off); top_p: ``[B]`` in (0, 1] (1 = off).
        filtered: False when no row uses top-k or top-p (the search is left out of the kernel).

    Returns:
        ``[B, V]`` float32 probabilities on ``logits``' device (CUDA, or the CPU under Triton's
        interpreter); filtered tokens exactly 0.

    Raises:
        ValueError: logits of another dtype.
    """
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"sampling_probs kernel: logits of {logits.dtype} (it reads bf16, fp16 or fp32 bit patterns)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    out = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    if B:
        bits = 32 if logits.dtype == torch.float32 else 16
        _sampling_kernel()[(B,)](logits, temperature.float().contiguous(), top_k.contiguous(),
                                 top_p.float().contiguous(), out, V, logits.stride(0), out.stride(0),
                                 BITS=bits, FILTER=bool(filtered), BLOCK=SAMPLING_BLOCK, SEARCH_BLOCK=SEARCH_BLOCK,
                                 WAYS_=WAYS,
                                 num_warps=SAMPLING_WARPS)
    return out


@functools.lru_cache(maxsize=1)
def _inverse_cdf_kernel():
    triton, tl = kernels._modules()

    @triton.jit
    def inverse_cdf_kernel(w_ptr, u_ptr, out_ptr, V, w_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        src = w_ptr + row * w_stride
        tv = tl.zeros([BLOCK], tl.float32)
        lastv = tl.full([BLOCK], -1, tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            w = tl.load(src + cols, mask=cols < V, other=0.0).to(tl.float32)
            tv += w
            lastv = tl.maximum(lastv, tl.where(w > 0, cols, -1))
        x = tl.load(u_ptr + row) * tl.sum(tv, axis=0)  # the drawn point on [0, total)
        last = tl.max(lastv, axis=0)  # the last index of positive weight (-1: none)
        run = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        found = V + 0 * last
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            w = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
            c = tl.cumsum(w, axis=0) + run
            found = tl.minimum(found, tl.min(tl.where(ok & (c > x), cols, V), axis=0))
            run = tl.max(tl.where(ok, c, run), axis=0)  # weights >= 0: the running sum is the largest
        idx = tl.minimum(found, V - 1)
        w_idx = tl.load(src + idx).to(tl.float32)
        # past the last positive weight (rounding; or none at all, then the last index, as the ops)
        fallback = tl.where(last >= 0, last, V - 1)
        tl.store(out_ptr + row, tl.where(w_idx > 0, idx, fallback).to(tl.int64))

    return inverse_cdf_kernel


def sample_inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``tandem.sampling.sample_inverse_cdf`` in one launch, one program a row (see the module
    docstring): the first index whose running sum of ``weights`` passes ``uniform`` x the row's
    total; an index of weight 0 is never returned (the last positive one instead).

    Args:
        weights: ``[B, V]`` float >= 0; uniform: ``[B]`` float32 in [0, 1).

    Returns:
        ``[B]`` int64 on ``weights``' device (CUDA, or the CPU under Triton's interpreter).
    """
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    B, V = weights.shape
    out = torch.empty(B, dtype=torch.int64, device=weights.device)
    if B:
        _inverse_cdf_kernel()[(B,)](weights, uniform.float().contiguous(), out, V, weights.stride(0),
                                    BLOCK=SAMPLING_BLOCK, num_warps=SAMPLING_WARPS)
    return out
