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
step of 64 sequences x 5 tokens), then a cumulative sum and a scatter back. Here the same cut is
found by searching the logits' bit patterns, which order as the logits do: each pass over a row
sums, for ``WAYS`` candidate cuts at once, the count (top-k) or the softmax mass (top-p) of the
logits at or above each, and keeps the interval where the wanted count or mass is first reached.
A search's first pass puts its candidates geometrically below the row's greatest logit, where a
language model's cut falls, so one or two evenly spread passes after it settle the cut; a pass
over a settled interval reads nothing, and a cut far below the top takes four even passes (a bf16
logit; eight a float32 one). Then one pass writes the probabilities.
A row's columns are split into fixed chunks (``CHUNK``), one program each, and each pass is a
launch: the chunks' partial sums go to a small buffer, and every program of the next launch
reduces its row's partials in the same fixed order, so a few rows still fill the GPU (one program
a row took 0.17 ms for up to 64 rows on an H100, a row's seven passes one after another). The
chunks and the column steps (``SEARCH_BLOCK``) are fixed and the sums run in a fixed order, so a
row's result does not depend on the rows beside it. The cut is the PyTorch ops' (tokens tied with
it stay in both); their sums run in another order, so the probabilities agree to rounding, and a
cut can differ where a row's mass reaches ``top_p`` within rounding of it.

``tandem.sampling.sample_inverse_cdf`` in PyTorch ops is a cumulative sum over each row (63 µs
for up to 64 rows of 49,152 on an H100, 185 µs for 320), a search and a reversed copy for the
fallback index; here, in the same chunks, one launch sums each chunk, and in the next the chunk
where the drawn point falls (every program finds it from the same running sums) walks its
columns until the running sum passes it: two launches, each chunk read at most twice.
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


WAYS = 16  # candidate cuts a pass of the search sums for
# A search's first pass spreads its candidates geometrically down from the row's greatest key (at
# 0, 1, 3, 7, ... keys below it, steps of 2 for a 16-bit key, of 4 for a 32-bit one), where a
# top-k or top-p cut of a language model's logits falls: the interval it keeps is then a few keys
# wide, and one or two of the evenly spread passes after it settle the cut; a pass over a settled
# interval reads nothing. Past the geometric candidates (a cut far below the greatest logit) the
# even passes settle it as before: 4 of them for a 16-bit key, 8 for a 32-bit one.


def search_passes(bits: int) -> int:
    """Launches of one search (the geometric pass and the even ones) for ``bits``-bit keys."""
    return bits // 4 + 1


# A row's columns are split into fixed chunks of CHUNK, one program each, so that a few rows still
# fill the GPU (one program a row made seven sequential passes over 49,152 logits: 0.17 ms
# whatever the row count up to 64 on an H100, docs/benchmarks.md); the chunk does not depend on
# the batch, so neither does a row's result. A row of one chunk (a vocabulary of at most CHUNK)
# takes one program and one launch for everything: no partial sums to keep (a test's millions of
# five-token rows would need gigabytes of them).
CHUNK = 4096
SEARCH_BLOCK = 256  # logits a step of a chunk's pass reads, as a [SEARCH_BLOCK, 1] column
CHUNK_WARPS = 4

# device functions of the sampling kernels (module globals, as above)
_key = _chunk_stats = _chunk_sums = _chunk_write = _cands = _narrow_acc = _row_stats = _pass_sums = _replay = None


@functools.lru_cache(maxsize=1)
def _sampling_kernels():
    """The sampling transform's kernels. Rows of several chunks: ``stats`` (each chunk's max, sum
    of exp and greatest key), ``search`` (one pass of the cut search: each chunk's sums for
    ``WAYS`` candidate cuts; a pass whose interval is settled reads nothing) and ``write`` (the
    probabilities), each over a ``(rows, chunks)`` grid, every program rebuilding its row's state
    from the earlier launches' partial sums, reduced in the same fixed order by all. Rows of one
    chunk: ``row``, all of it in one program a row."""
    global _key, _chunk_stats, _chunk_sums, _chunk_write, _cands, _narrow_acc, _row_stats, _pass_sums, _replay
    triton, tl = kernels._modules()

    @triton.jit
    def _key(raw, BITS: tl.constexpr):
        # an unsigned key of a float's bits that orders as the floats do (-0 as +0): int32 for a
        # 16-bit float, int64 for a 32-bit one
        if BITS == 16:
            b = raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            b = tl.where(b == 0x8000, 0, b)
            return tl.where(b >= 0x8000, 0xFFFF - b, b + 0x8000)
        else:
            b = raw.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            b = tl.where(b == 0x80000000, 0, b)
            return tl.where(b >= 0x80000000, 0xFFFFFFFF - b, b + 0x80000000)

    @triton.jit
    def _chunk_stats(src, temp, c0, c1, BLOCK: tl.constexpr):
        # over columns [c0, c1): the max m of x = logit / T, the sum of exp(x - m) (0 for -inf
        # logits) and the greatest logit (in the logits' dtype, whose key the search starts from).
        # Dividing by T > 0 keeps the order (it rounds monotonically), so the max of x is the
        # greatest logit over T: one division, and no key a column
        rv = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(c0, c1, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            rv = tl.maximum(rv, tl.load(src + cols, mask=cols < c1, other=float("-inf")).to(tl.float32))
        top = tl.max(rv, axis=0)
        m = top / temp
        m_finite = tl.maximum(m, -3.0e38)  # (a chunk of -inf logits: no -inf - -inf; else m itself)
        zv = tl.zeros([BLOCK], tl.float32)
        for start in range(c0, c1, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < c1, other=float("-inf")).to(tl.float32) / temp
            zv += tl.where((cols < c1) & (x > float("-inf")), tl.exp(x - m_finite), 0.0)
        return m, tl.sum(zv, axis=0), top.to(src.dtype.element_ty)

    @triton.jit
    def _cands(lo, hi, top, geo, BITS: tl.constexpr, WAYS_: tl.constexpr):
        # a pass's WAYS_ candidate cuts (int64, candidate 0 = lo) and the bound above them: spread
        # evenly over [lo, hi), or (geo) at lo and 0, 1, 3, 7, ... keys below the row's greatest
        # key `top` (each twice the last for a 16-bit key, 4 times for a 32-bit one), none below
        # lo, with top + 1 above them (no key is greater than top)
        j = tl.arange(0, WAYS_).to(tl.int64)
        step = tl.maximum((hi - lo + WAYS_ - 1) // WAYS_, 1)
        even = lo + j * step
        if BITS == 16:
            below = (tl.full([WAYS_], 1, tl.int64) << tl.maximum(j - 1, 0)) - 1
        else:
            below = (tl.full([WAYS_], 1, tl.int64) << (2 * tl.maximum(j - 1, 0))) - 1
        spread = tl.where(j == 0, lo, tl.maximum(top - below, lo))
        return tl.where(geo, spread, even), tl.where(geo, tl.minimum(hi, top + 1), hi)

    @triton.jit
    def _chunk_sums(src, temp, m, c0, c1, cand, MASS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                    WAYS_: tl.constexpr):
        # over columns [c0, c1): the count (or, with MASS, the softmax mass exp(x - m)) of keys at or
        # above each candidate cut cand [WAYS_]; each thread keeps its columns' sums for every
        # candidate and the program reduces them once (the columns loaded as a [BLOCK, 1] column,
        # meeting the candidates in the sums' own layout)
        cand = cand[None, :]
        if BITS == 16:
            cand = cand.to(tl.int32)
        part = tl.zeros([BLOCK, WAYS_], tl.float32)
        for start in range(c0, c1, BLOCK):
            cols = start + tl.arange(0, BLOCK)[:, None]
            ok = cols < c1
            raw = tl.load(src + cols, mask=ok, other=0.0)
            if MASS:
                w = tl.where(ok, tl.exp(raw.to(tl.float32) / temp - m), 0.0)
            else:
                w = tl.where(ok, 1.0, 0.0)
            part += tl.where(_key(raw, BITS) >= cand, w, 0.0)
        return tl.sum(part, axis=0)

    @triton.jit
    def _chunk_write(src, dst, temp, m, z, cut, c0, c1, BITS: tl.constexpr, BLOCK: tl.constexpr):
        for start in range(c0, c1, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < c1
            raw = tl.load(src + cols, mask=ok, other=0.0)
            keep = _key(raw, BITS) >= cut
            tl.store(dst + cols, tl.where(keep, tl.exp(raw.to(tl.float32) / temp - m) / z, 0.0), mask=ok)

    @triton.jit
    def _narrow_acc(acc, cand, lo, cap, target, WAYS_: tl.constexpr):
        # the interval a pass keeps, from its candidates cand [WAYS_] (cand[0] = lo, all below cap)
        # and their sums acc: [the greatest candidate whose count (or mass) of keys at or above it
        # reaches target, the next candidate above it or cap); with that count, and acc[0]
        j = tl.arange(0, WAYS_)
        good = (acc >= target) & (acc > 0) & (cand < cap)  # (acc > 0: the most likely token always stays)
        best = tl.max(tl.where(good, cand, lo), axis=0)
        first = tl.min(tl.where(cand == best, j, WAYS_), axis=0)  # (candidates clamped to lo repeat it)
        found = tl.sum(tl.where(j == first, acc, 0.0), axis=0)
        hi = tl.min(tl.where(cand > best, cand, cap), axis=0)
        return best, hi, found, tl.sum(tl.where(j == 0, acc, 0.0), axis=0)

    @triton.jit
    def _row_stats(pm_ptr, pz_ptr, pk_ptr, row, C, CP: tl.constexpr):
        # the row's softmax max m, sum z of exp(x - m) (from its chunks' in chunk order) and greatest key
        c = tl.arange(0, CP)
        pm = tl.load(pm_ptr + row * C + c, mask=c < C, other=float("-inf"))
        pz = tl.load(pz_ptr + row * C + c, mask=c < C, other=0.0)
        m = tl.max(pm, axis=0)
        top = tl.max(tl.load(pk_ptr + row * C + c, mask=c < C, other=0), axis=0)
        return m, tl.sum(tl.where(c < C, pz * tl.exp(pm - m), 0.0), axis=0), top

    @triton.jit
    def _pass_sums(part_ptr, g, row, B, C, CP: tl.constexpr, WAYS_: tl.constexpr):
        # pass g's sums [WAYS_] over the row's chunks (chunk order)
        c = tl.arange(0, CP)[:, None]
        j = tl.arange(0, WAYS_)
        return tl.sum(tl.load(part_ptr + ((g * B + row) * C + c) * WAYS_ + j[None, :], mask=c < C, other=0.0), axis=0)

    @triton.jit
    def _replay(part_ptr, row, B, C, k, p, V, top, upto, NP: tl.constexpr, BITS: tl.constexpr, CP: tl.constexpr,
                WAYS_: tl.constexpr):
        # the search's state before global pass `upto` (top-k passes 0 .. NP-1, then top-p passes
        # NP .. 2 NP-1, the first of each geometric; a pass over a settled interval ran nothing):
        # the interval [lo, hi), the top-p target, the mass at and above lo once top-p's first pass
        # is summed (the mass the top-k cut keeps) and the last pass's count or mass
        lo = (row * 0).to(tl.int64)
        hi = lo + (1 << BITS)
        found = tl.sum(tl.zeros([WAYS_], tl.float32), axis=0)
        if (k > 0) & (k < V):
            for g in range(0, tl.minimum(upto, NP)):
                if hi - lo > 1:
                    cand, cap = _cands(lo, hi, top, g == 0, BITS, WAYS_)
                    lo, hi, found, _ = _narrow_acc(_pass_sums(part_ptr, g, row, B, C, CP, WAYS_), cand, lo, cap,
                                                   k.to(tl.float32), WAYS_)
        kept = found
        target = found
        if upto >= NP:  # top-p searches above the top-k cut, over the rest of the keys
            hi = lo * 0 + (1 << BITS)
        if upto > NP:  # (its first pass always runs: it sums the mass the top-k cut keeps)
            cand, cap = _cands(lo, hi, top, True, BITS, WAYS_)
            acc = _pass_sums(part_ptr, NP, row, B, C, CP, WAYS_)
            kept = tl.sum(tl.where(tl.arange(0, WAYS_) == 0, acc, 0.0), axis=0)
            target = kept
            found = kept
            if p < 1.0:
                target = p * kept
                lo, hi, found, _ = _narrow_acc(acc, cand, lo, cap, target, WAYS_)
                for g in range(NP + 1, upto):
                    if hi - lo > 1:
                        cand, cap = _cands(lo, hi, top, False, BITS, WAYS_)
                        lo, hi, found, _ = _narrow_acc(_pass_sums(part_ptr, g, row, B, C, CP, WAYS_), cand, lo, cap,
                                                       target, WAYS_)
        return lo, hi, target, kept, found

    @triton.jit
    def stats_kernel(x_ptr, t_ptr, pm_ptr, pz_ptr, pk_ptr, V, x_stride, C, BITS: tl.constexpr, CHUNK_: tl.constexpr,
                     BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        m, z, top = _chunk_stats(x_ptr + row * x_stride, tl.load(t_ptr + row).to(tl.float32), c * CHUNK_,
                                 tl.minimum(c * CHUNK_ + CHUNK_, V), BLOCK)
        tl.store(pm_ptr + row * C + c, m)
        tl.store(pz_ptr + row * C + c, z)
        tl.store(pk_ptr + row * C + c, _key(top, BITS).to(tl.int64))

    @triton.jit
    def search_kernel(x_ptr, t_ptr, k_ptr, p_ptr, pm_ptr, pz_ptr, pk_ptr, part_ptr, V, x_stride, B, C, g,
                      NP: tl.constexpr, BITS: tl.constexpr, CHUNK_: tl.constexpr, BLOCK: tl.constexpr,
                      CP: tl.constexpr, WAYS_: tl.constexpr):
        # pass g of the cut search: this chunk's count (top-k, g < NP) or softmax mass (top-p) of the
        # logits at or above each of WAYS_ candidate cuts over the row's current interval
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        k = tl.load(k_ptr + row)
        p = tl.load(p_ptr + row).to(tl.float32)
        topk = (k > 0) & (k < V)
        # passes a row does not need: top-k's without top-k; top-p's after its first (which sums the
        # mass the top-k cut keeps) without top-p; any over a settled interval
        if ((g < NP) & topk) | (g == NP) | ((g > NP) & (p < 1.0)):
            m, z, top = _row_stats(pm_ptr, pz_ptr, pk_ptr, row, C, CP)
            lo, hi, target, kept, found = _replay(part_ptr, row, B, C, k, p, V, top, g, NP, BITS, CP, WAYS_)
            if (hi - lo > 1) | (g == NP):
                cand, cap = _cands(lo, hi, top, (g == 0) | (g == NP), BITS, WAYS_)
                src = x_ptr + row * x_stride
                temp = tl.load(t_ptr + row).to(tl.float32)
                c1 = tl.minimum(c * CHUNK_ + CHUNK_, V)
                if g >= NP:
                    acc = _chunk_sums(src, temp, m, c * CHUNK_, c1, cand, True, BITS, BLOCK, WAYS_)
                else:
                    acc = _chunk_sums(src, temp, m, c * CHUNK_, c1, cand, False, BITS, BLOCK, WAYS_)
                tl.store(part_ptr + ((g * B + row) * C + c) * WAYS_ + tl.arange(0, WAYS_), acc)

    @triton.jit
    def write_kernel(x_ptr, t_ptr, k_ptr, p_ptr, pm_ptr, pz_ptr, pk_ptr, part_ptr, out_ptr, sel_ptr, V, x_stride,
                     out_stride, B, C, FILTER: tl.constexpr, HAS_SEL: tl.constexpr, NP: tl.constexpr,
                     BITS: tl.constexpr, CHUNK_: tl.constexpr, BLOCK: tl.constexpr, CP: tl.constexpr,
                     WAYS_: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        go = True
        if HAS_SEL:  # rows left out keep what their output row holds
            go = tl.load(sel_ptr + row) != 0
        if go:
            m, z, top = _row_stats(pm_ptr, pz_ptr, pk_ptr, row, C, CP)
            cut = (row * 0).to(tl.int64)  # the least key: every token kept
            if FILTER:
                k = tl.load(k_ptr + row)
                p = tl.load(p_ptr + row).to(tl.float32)
                cut, _, _, _, z = _replay(part_ptr, row, B, C, k, p, V, top, 2 * NP, NP, BITS, CP, WAYS_)
            _chunk_write(x_ptr + row * x_stride, out_ptr + row * out_stride, tl.load(t_ptr + row).to(tl.float32),
                         m, z, cut, c * CHUNK_, tl.minimum(c * CHUNK_ + CHUNK_, V), BITS, BLOCK)

    @triton.jit
    def row_kernel(x_ptr, t_ptr, k_ptr, p_ptr, out_ptr, sel_ptr, V, x_stride, out_stride, FILTER: tl.constexpr,
                   HAS_SEL: tl.constexpr, NP: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                   WAYS_: tl.constexpr):
        # a row of one chunk, all in this program: the same sums and search as the chunked kernels
        row = tl.program_id(0).to(tl.int64)
        go = True
        if HAS_SEL:
            go = tl.load(sel_ptr + row) != 0
        if go:
            src = x_ptr + row * x_stride
            temp = tl.load(t_ptr + row).to(tl.float32)
            m, z, top = _chunk_stats(src, temp, 0, V, BLOCK)
            top = _key(top, BITS).to(tl.int64)
            cut = (row * 0).to(tl.int64)
            if FILTER:
                k = tl.load(k_ptr + row)
                p = tl.load(p_ptr + row).to(tl.float32)
                hi = cut + (1 << BITS)
                if (k > 0) & (k < V):
                    for g in range(0, NP):
                        if hi - cut > 1:
                            cand, cap = _cands(cut, hi, top, g == 0, BITS, WAYS_)
                            acc = _chunk_sums(src, temp, m, 0, V, cand, False, BITS, BLOCK, WAYS_)
                            cut, hi, _, _ = _narrow_acc(acc, cand, cut, cap, k.to(tl.float32), WAYS_)
                    hi = cut * 0 + (1 << BITS)
                cand, cap = _cands(cut, hi, top, True, BITS, WAYS_)
                acc = _chunk_sums(src, temp, m, 0, V, cand, True, BITS, BLOCK, WAYS_)
                z = tl.sum(tl.where(tl.arange(0, WAYS_) == 0, acc, 0.0), axis=0)  # the mass top-k keeps
                if p < 1.0:
                    target = p * z
                    cut, hi, z, _ = _narrow_acc(acc, cand, cut, cap, target, WAYS_)
                    for g in range(1, NP):
                        if hi - cut > 1:
                            cand, cap = _cands(cut, hi, top, False, BITS, WAYS_)
                            acc = _chunk_sums(src, temp, m, 0, V, cand, True, BITS, BLOCK, WAYS_)
                            cut, hi, z, _ = _narrow_acc(acc, cand, cut, cap, target, WAYS_)
            _chunk_write(src, out_ptr + row * out_stride, temp, m, z, cut, 0, V, BITS, BLOCK)

    return stats_kernel, search_kernel, write_kernel, row_kernel


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   filtered: bool = True, out: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """``tandem.sampling.sampling_probs`` without sorting (see the module docstring): each row's
    columns in chunks of ``CHUNK``, one program a chunk; launches: the chunks' max, sum and
    greatest key, then (``filtered``) ``2 x search_passes(BITS)`` search passes (top-k's, then
    top-p's, each search's first geometric; a row skips those it does not use and those over a
    settled interval), then the probabilities.

    Args:
        logits: ``[B, V]`` bfloat16, float16 or float32, the last dimension contiguous.
        temperature: ``[B]`` > 0; top_k: ``[B]`` int64 (0 = off); top_p: ``[B]`` in (0, 1] (1 = off).
        filtered: False when no row uses top-k or top-p (the search is left out).
        out: ``[B, V]`` float32 to write into (its last dimension contiguous), or None (a new tensor).
        rows: ``[B]`` bool, with ``out``: only these rows are written; the others keep their values.

    Returns:
        ``[B, V]`` float32 probabilities on ``logits``' device (CUDA, or the CPU under Triton's
        interpreter); filtered tokens exactly 0. ``out`` when given.

    Raises:
        ValueError: logits of another dtype; ``out`` of another shape, dtype or layout; ``rows``
            without ``out``.
    """
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"sampling_probs kernel: logits of {logits.dtype} (it reads bf16, fp16 or fp32 bit patterns)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    if out is None:
        if rows is not None:
            raise ValueError("sampling_probs kernel: rows needs out (the rows left out keep out's values)")
        out = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    elif out.shape != (B, V) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"sampling_probs kernel: out {tuple(out.shape)} {out.dtype} needs [{B}, {V}] float32 "
                         "with contiguous rows")
    if not B:
        return out
    stats, search, write, row_kernel = _sampling_kernels()
    bits = 32 if logits.dtype == torch.float32 else 16
    n_pass = search_passes(bits)
    C = -(-V // CHUNK)
    cp = max(2, 1 << (C - 1).bit_length())
    dev = logits.device
    temperature = temperature.float().contiguous()
    top_k, top_p = top_k.contiguous(), top_p.float().contiguous()
    sel = rows.contiguous() if rows is not None else temperature  # (any pointer where no rows are chosen)
    if C == 1:
        row_kernel[(B,)](logits, temperature, top_k, top_p, out, sel, V, logits.stride(0), out.stride(0),
                         FILTER=bool(filtered), HAS_SEL=rows is not None, NP=n_pass, BITS=bits, BLOCK=SEARCH_BLOCK,
                         WAYS_=WAYS, num_warps=CHUNK_WARPS)
        return out
    pm = torch.empty((B, C), dtype=torch.float32, device=dev)
    pz = torch.empty((B, C), dtype=torch.float32, device=dev)
    pk = torch.empty((B, C), dtype=torch.int64, device=dev)
    # the search passes' partial sums (none without a search: the write kernel then reads none)
    part = torch.empty((2 * n_pass, B, C, WAYS), dtype=torch.float32, device=dev) if filtered else pm
    grid = (B, C)
    stats[grid](logits, temperature, pm, pz, pk, V, logits.stride(0), C, BITS=bits, CHUNK_=CHUNK, BLOCK=SEARCH_BLOCK,
                num_warps=CHUNK_WARPS)
    if filtered:
        for g in range(2 * n_pass):
            search[grid](logits, temperature, top_k, top_p, pm, pz, pk, part, V, logits.stride(0), B, C, g, NP=n_pass,
                         BITS=bits, CHUNK_=CHUNK, BLOCK=SEARCH_BLOCK, CP=cp, WAYS_=WAYS, num_warps=CHUNK_WARPS)
    write[grid](logits, temperature, top_k, top_p, pm, pz, pk, part, out, sel, V, logits.stride(0), out.stride(0), B, C,
                FILTER=bool(filtered), HAS_SEL=rows is not None, NP=n_pass, BITS=bits, CHUNK_=CHUNK,
                BLOCK=SEARCH_BLOCK, CP=cp, WAYS_=WAYS, num_warps=CHUNK_WARPS)
    return out


INVERSE_CDF_BLOCK = 1024  # weights a step of the inverse-CDF draw's chunk reads


_chunk_owner = None  # the draw's device function, made with its kernels (module global, as above)


@functools.lru_cache(maxsize=1)
def _inverse_cdf_kernels():
    """The inverse-CDF draw's two kernels over a ``(rows, chunks)`` grid: ``sums`` (each chunk's
    total and last positive index), then ``walk`` (the chunk where the drawn point falls walks its
    columns; every program finds that chunk from the same running totals)."""
    # tl becomes a module global too: residual_kernel's walk calls _chunk_owner, and Triton's
    # interpreter looks for triton.language among a device function's module globals (it adds its
    # own only when one of this module's kernels runs first, and never over a name already there)
    global _chunk_owner, tl
    triton, tl = kernels._modules()

    @triton.jit
    def _chunk_owner(ps_ptr, step, row, C, u):
        # the chunk sums at ps_ptr + (row C + i) step, added in chunk order: the drawn point x =
        # u x total, the first chunk whose running total passes it (C: none) and the total before
        # that chunk. One addition at a time, so the running totals never fall (a scan's tree
        # order can move a total across a chunk of zeros by a rounding)
        total = tl.load(ps_ptr + row * C * step) * 0.0
        for i in range(0, C):
            total += tl.load(ps_ptr + (row * C + i) * step)
        x = u * total
        run = total * 0.0
        before = run
        owner = C + 0 * C
        for i in range(0, C):
            nxt = run + tl.load(ps_ptr + (row * C + i) * step)
            hit = (owner == C) & (nxt > x)
            before = tl.where(hit, run, before)
            owner = tl.where(hit, i, owner)
            run = nxt
        return x, owner, before

    @triton.jit
    def sums_kernel(w_ptr, ps_ptr, pl_ptr, V, w_stride, C, CHUNK_: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        src = w_ptr + row * w_stride
        tv = tl.zeros([BLOCK], tl.float32)
        lastv = tl.full([BLOCK], -1, tl.int32)
        for start in range(c * CHUNK_, tl.minimum(c * CHUNK_ + CHUNK_, V), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            w = tl.load(src + cols, mask=(cols < V) & (cols < c * CHUNK_ + CHUNK_), other=0.0).to(tl.float32)
            tv += w
            lastv = tl.maximum(lastv, tl.where(w > 0, cols, -1))
        tl.store(ps_ptr + row * C + c, tl.sum(tv, axis=0))
        tl.store(pl_ptr + row * C + c, tl.max(lastv, axis=0))

    @triton.jit
    def walk_kernel(w_ptr, u_ptr, ps_ptr, pl_ptr, out_ptr, V, w_stride, C, CHUNK_: tl.constexpr,
                    BLOCK: tl.constexpr, CP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        i = tl.arange(0, CP)
        lasts = tl.load(pl_ptr + row * C + i, mask=i < C, other=-1)
        last = tl.max(lasts, axis=0)  # the row's last positive index (-1: none)
        last = tl.where(last >= 0, last, V - 1)
        x, owner, run = _chunk_owner(ps_ptr, 1, row, C, tl.load(u_ptr + row))
        src = w_ptr + row * w_stride
        if owner == c:
            found = V + 0 * c
            for start in range(c * CHUNK_, tl.minimum(c * CHUNK_ + CHUNK_, V), BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = (cols < V) & (cols < c * CHUNK_ + CHUNK_)
                w = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
                cs = tl.cumsum(w, axis=0) + run
                found = tl.minimum(found, tl.min(tl.where(ok & (cs > x), cols, V), axis=0))
                run = tl.max(tl.where(ok, cs, run), axis=0)
            # past the chunk's end, or on a weight of 0 (the scan's rounding): the last positive index
            idx = tl.minimum(found, V - 1)
            ok_idx = (found < V) & (tl.load(src + idx).to(tl.float32) > 0)
            tl.store(out_ptr + row, tl.where(ok_idx, idx, last).to(tl.int64))
        elif (owner == C) & (c == C - 1):  # past the total (rounding), or no weight at all
            tl.store(out_ptr + row, last.to(tl.int64))

    return sums_kernel, walk_kernel


def sample_inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``tandem.sampling.sample_inverse_cdf`` in two launches over chunks of ``CHUNK`` columns
    (see the module docstring): the first index whose running sum of ``weights`` passes
    ``uniform`` x the row's total; an index of weight 0 is never returned (the last positive one
    instead; the last index when the row has no weight).

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
        sums, walk = _inverse_cdf_kernels()
        C = -(-V // CHUNK)
        ps = torch.empty((B, C), dtype=torch.float32, device=weights.device)
        pl = torch.empty((B, C), dtype=torch.int32, device=weights.device)
        sums[(B, C)](weights, ps, pl, V, weights.stride(0), C, CHUNK_=CHUNK, BLOCK=INVERSE_CDF_BLOCK,
                     num_warps=CHUNK_WARPS)
        walk[(B, C)](weights, uniform.float().contiguous(), ps, pl, out, V, weights.stride(0), C, CHUNK_=CHUNK,
                     BLOCK=INVERSE_CDF_BLOCK, CP=max(2, 1 << (C - 1).bit_length()), num_warps=CHUNK_WARPS)
    return out

