"""The token a sampled round emits after its accepted drafts, drawn on the device without
materialising its weights.

Speculative sampling (Leviathan et al. 2023, Alg. 1) emits, after a row's accepted drafts, a
token drawn from the residual norm(max(0, p - q)) at the first rejected draft, or from p after the
last draft (the bonus token); ``tandem.verify.stop_weights`` builds those weights in PyTorch ops:
a copy of each row's p row and q row out of ``[B, Q, V]`` and ``[B, K, V]`` (20 µs each for 64
rows of 49,152 on an H100), the residual, its sum and a select, then the inverse-CDF draw. Here
the two launches of the inverse-CDF draw (``tandem.sampling_kernels``: each chunk's total, then
the chunk where the drawn point falls walks its columns) read p and q in place and make the
weights as they go, with the same sums in the same order, so the draws are those of the draw
over the materialised weights (``tests/test_sampling_kernels.py``, under Triton's interpreter and
on the GPU).
"""

from __future__ import annotations

import functools

import torch

from . import sampling_kernels
from .models import kernels


_residual = _read = _row = None  # device functions, made with the kernels (jit functions call each other via globals)


@functools.lru_cache(maxsize=1)
def _stop_token_kernels():
    """The token a verified row emits after its accepted drafts, drawn without materialising its
    weights: the inverse-CDF draw's two kernels over a ``(rows, chunks)`` grid, reading the row's p
    at its stop position and, where a draft was rejected there, q of that draft (the residual
    max(0, p - q), or p without the rejected token when q is one-hot), in place."""
    global _residual, _read, _row
    triton, tl = kernels._modules()
    sampling_kernels._inverse_cdf_kernels()  # (makes sampling_kernels._chunk_owner, which the walk calls)

    @triton.jit
    def _residual(p, q, cols, tok, HAS_Q: tl.constexpr):
        # max(0, p - q) of the rejected draft; with q one-hot, p without the rejected token
        if HAS_Q:
            return tl.maximum(p - q, 0.0)
        else:
            return tl.where(cols == tok, 0.0, p)

    @triton.jit
    def _read(p_src, q_src, cols, ok, tok, HAS_Q: tl.constexpr):
        # p at cols, and the residual there
        p = tl.load(p_src + cols, mask=ok, other=0.0)
        q = p
        if HAS_Q:
            q = tl.load(q_src + cols, mask=ok, other=0.0)
        return p, _residual(p, q, cols, tok, HAS_Q)

    @triton.jit
    def _row(p_ptr, q_ptr, tok_ptr, acc_ptr, lens_ptr, row, p_sb, p_sq, q_sb, q_sk, tok_sb, tok_sk, Q):
        s = tl.load(acc_ptr + row)  # drafts accepted: p's row of the emitted token
        rejected = s < tl.load(lens_ptr + row)
        at = tl.minimum(s, Q - 2)  # the rejected draft's position (meaningless on a bonus row)
        tok = tl.load(tok_ptr + row * tok_sb + at * tok_sk)
        return p_ptr + row * p_sb + s * p_sq, q_ptr + row * q_sb + at * q_sk, tok, rejected

    @triton.jit
    def stop_sums_kernel(p_ptr, q_ptr, tok_ptr, acc_ptr, lens_ptr, ps_ptr, pl_ptr, V, p_sb, p_sq, q_sb, q_sk, tok_sb,
                         tok_sk, Q, C, HAS_Q: tl.constexpr, CHUNK_: tl.constexpr, BLOCK: tl.constexpr):
        # each chunk's total and last positive index, of the residual (slot 0) and of p (slot 1)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        p_src, q_src, tok, _ = _row(p_ptr, q_ptr, tok_ptr, acc_ptr, lens_ptr, row, p_sb, p_sq, q_sb, q_sk, tok_sb,
                                    tok_sk, Q)
        tr = tl.zeros([BLOCK], tl.float32)
        tp = tl.zeros([BLOCK], tl.float32)
        lr = tl.full([BLOCK], -1, tl.int32)
        lp = tl.full([BLOCK], -1, tl.int32)
        for start in range(c * CHUNK_, tl.minimum(c * CHUNK_ + CHUNK_, V), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p, r = _read(p_src, q_src, cols, (cols < V) & (cols < c * CHUNK_ + CHUNK_), tok, HAS_Q)
            tr += r
            tp += p
            lr = tl.maximum(lr, tl.where(r > 0, cols, -1))
            lp = tl.maximum(lp, tl.where(p > 0, cols, -1))
        base = (row * C + c) * 2
        tl.store(ps_ptr + base, tl.sum(tr, axis=0))
        tl.store(ps_ptr + base + 1, tl.sum(tp, axis=0))
        tl.store(pl_ptr + base, tl.max(lr, axis=0))
        tl.store(pl_ptr + base + 1, tl.max(lp, axis=0))

    @triton.jit
    def stop_walk_kernel(p_ptr, q_ptr, tok_ptr, acc_ptr, lens_ptr, u_ptr, ps_ptr, pl_ptr, out_ptr, V, p_sb, p_sq,
                         q_sb, q_sk, tok_sb, tok_sk, Q, C, HAS_Q: tl.constexpr, CHUNK_: tl.constexpr,
                         BLOCK: tl.constexpr, CP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        p_src, q_src, tok, rejected = _row(p_ptr, q_ptr, tok_ptr, acc_ptr, lens_ptr, row, p_sb, p_sq, q_sb, q_sk,
                                           tok_sb, tok_sk, Q)
        i = tl.arange(0, CP)
        base = (row * C + i) * 2
        # the residual where a draft was rejected and it is not empty (p == q up to rounding), else p
        residual = rejected & (tl.sum(tl.load(ps_ptr + base, mask=i < C, other=0.0), axis=0) > 0)
        pick = 1 - residual.to(tl.int32)  # the slot of the chosen weights' sums
        last = tl.max(tl.load(pl_ptr + base + pick, mask=i < C, other=-1), axis=0)
        last = tl.where(last >= 0, last, V - 1)  # the last positive index (the last index when none)
        x, owner, run = sampling_kernels._chunk_owner(ps_ptr + pick, 2, row, C, tl.load(u_ptr + row))
        if owner == c:
            found = V + 0 * c
            for start in range(c * CHUNK_, tl.minimum(c * CHUNK_ + CHUNK_, V), BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = (cols < V) & (cols < c * CHUNK_ + CHUNK_)
                p, r = _read(p_src, q_src, cols, ok, tok, HAS_Q)
                w = tl.where(residual, r, p)
                cs = tl.cumsum(w, axis=0) + run
                found = tl.minimum(found, tl.min(tl.where(ok & (cs > x), cols, V), axis=0))
                run = tl.max(tl.where(ok, cs, run), axis=0)
            # past the chunk's end, or on a weight of 0 (the scan's rounding): the last positive index
            idx = tl.minimum(found, V - 1)
            p_idx = tl.load(p_src + idx)
            q_idx = p_idx
            if HAS_Q:
                q_idx = tl.load(q_src + idx)
            w_idx = tl.where(residual, _residual(p_idx, q_idx, idx, tok, HAS_Q), p_idx)
            tl.store(out_ptr + row, tl.where((found < V) & (w_idx > 0), idx, last).to(tl.int64))
        elif (owner == C) & (c == C - 1):  # past the total (rounding), or no weight at all
            tl.store(out_ptr + row, last.to(tl.int64))

    return stop_sums_kernel, stop_walk_kernel


def readable(p: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor) -> bool:
    """Whether ``sample_stop_tokens`` reads these tensors: float32 p ``[B, Q >= 2, V]``, drafts
    ``[B, Q - 1]`` and q ``[B, Q - 1, V]`` (or None), rows contiguous."""
    B, Q, V = p.shape
    return (Q >= 2 and p.stride(-1) == 1 and p.dtype == torch.float32 and tuple(draft_tokens.shape) == (B, Q - 1)
            and (draft_probs is None or (tuple(draft_probs.shape) == (B, Q - 1, V) and draft_probs.stride(-1) == 1
                                         and draft_probs.dtype == torch.float32)))


def sample_stop_tokens(p: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                       draft_lens: torch.Tensor, num_accepted: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``sample_inverse_cdf(stop_weights(p, draft_probs, draft_tokens, draft_lens, num_accepted),
    uniform)`` (``tandem.verify``) without materialising the weights: each row reads its p row at
    ``num_accepted`` and, where that draft was rejected, q of it in place (two launches over the
    inverse-CDF draw's chunks; the same sums in the same order, so the same draws).

    Args:
        p: ``[B, Q, V]`` float32 target probabilities, Q >= 2 (the last dimension contiguous).
        draft_probs: ``[B, Q - 1, V]`` float32 q of the drafts, or None (q one-hot: the residual
            is p without the rejected token).
        draft_tokens: ``[B, Q - 1]`` int64; draft_lens / num_accepted: ``[B]`` int64.
        uniform: ``[B]`` float32 in [0, 1).

    Returns:
        ``[B]`` int64 on ``p``'s device (CUDA, or the CPU under Triton's interpreter).

    Raises:
        ValueError: shapes or layouts it cannot read (``readable``).
    """
    B, Q, V = p.shape
    if not readable(p, draft_probs, draft_tokens):
        raise ValueError(f"sample_stop_tokens: p {tuple(p.shape)} {p.dtype}, drafts {tuple(draft_tokens.shape)}, q "
                         f"{None if draft_probs is None else tuple(draft_probs.shape)}: needs float32 [B, Q >= 2, V] "
                         "and [B, Q - 1(, V)] with contiguous rows")
    out = torch.empty(B, dtype=torch.int64, device=p.device)
    if not B:
        return out
    sums, walk = _stop_token_kernels()
    C = -(-V // sampling_kernels.CHUNK)
    ps = torch.empty((B, C, 2), dtype=torch.float32, device=p.device)
    pl = torch.empty((B, C, 2), dtype=torch.int32, device=p.device)
    q = draft_probs if draft_probs is not None else p  # (any pointer without q)
    args = (p, q, draft_tokens, num_accepted.contiguous(), draft_lens.contiguous())
    strides = (V, p.stride(0), p.stride(1), q.stride(0), q.stride(1), draft_tokens.stride(0), draft_tokens.stride(1),
               Q, C)
    meta = dict(HAS_Q=draft_probs is not None, CHUNK_=sampling_kernels.CHUNK, BLOCK=sampling_kernels.INVERSE_CDF_BLOCK,
                num_warps=sampling_kernels.CHUNK_WARPS)
    sums[(B, C)](*args, ps, pl, *strides, **meta)
    walk[(B, C)](*args, uniform.float().contiguous(), ps, pl, out, *strides, CP=max(2, 1 << (C - 1).bit_length()),
                 **meta)
    return out
