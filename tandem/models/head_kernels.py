"""Fused kernels for the SpecFormer head's glue: the small elementwise steps between its matmuls.

At batch 64 a chained round's head ran ~80 kernels, a third of them elementwise steps of a few
microseconds each over a few hundred rows (per-tap norms and the copies feeding them, the
concatenation, the lookup continuation's embedding, mask, norm and match embedding, three adds
and the draft norm). Two kernels take their place:

- ``tap_rmsnorm``: each tapped target state's RMSNorm, written straight into the concatenated
  layout the downsampling projection reads (was one contiguous copy and one norm per tap, then a
  concatenation: 2 x taps + 1 launches);
- ``draft_input``: the draft slots' input stream (context state + position embedding + the
  lookup continuation's normalised embedding + the match-length embedding) and its pre-attention
  RMSNorm (was 12 launches).

Each reproduces the plain ops' roundings (every add and every norm rounded to the storage dtype
where the unfused op would round), so the fused head drafts as the plain one does (within the
reduction order of the norms' sums): ``tests/test_kernels.py`` checks each against the launches it
replaces (bitwise under Triton's interpreter, within a bf16 rounding on a GPU) and
``tests/test_specformer_fused.py`` the fused head's drafts against the plain ops'. CUDA, or the CPU
under the interpreter.
"""

from __future__ import annotations

import functools

import torch

from . import kernels
from .kernels import _jit_helpers, _modules, _pow2


@functools.lru_cache(maxsize=1)
def _kernels():
    triton, tl = _modules()
    global rms_scaled  # the kernels below call it by this global name (kernels._jit_helpers)
    _jit_helpers()
    rms_scaled = kernels.rms_scaled  # the norm as the plain ops round it

    @triton.jit
    def tap_rmsnorm_kernel(x_ptr, w_ptr, out_ptr, n_cols, n_taps, eps, BLOCK: tl.constexpr):
        # one program per (position, tap) row of d: RMSNorm with the tap's weight; the rows of a
        # position's taps are consecutive, so the output is the concatenation [..., taps * d]
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + (row % n_taps) * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, rms_scaled(x, w, n_cols, eps, out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def draft_input_kernel(h_ptr, pos_ptr, cont_ptr, match_ptr, emb_ptr, lw_ptr, mt_ptr, dw_ptr,
                           x_ptr, out_ptr, n_cols, slots, max_match, eps,
                           LOOKUP: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (sequence, slot): x = h + pos (+ lookup_norm(embed[cont]) + match_table[match]),
        # each add rounded to the storage dtype; out = RMSNorm(x) with the draft norm's weight
        row = tl.program_id(0).to(tl.int64)
        seq = row // slots
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        dt = x_ptr.dtype.element_ty
        h = tl.load(h_ptr + seq * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        p = tl.load(pos_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        x = (h + p).to(dt).to(tl.float32)
        if LOOKUP:
            tok = tl.load(cont_ptr + row)
            e = tl.load(emb_ptr + tl.maximum(tok, 0) * n_cols + cols, mask=m, other=0.0).to(tl.float32)
            e = tl.where(tok >= 0, e, 0.0)  # no continuation: a zero row, whose norm is zero
            lw = tl.load(lw_ptr + cols, mask=m, other=0.0).to(tl.float32)
            x = (x + rms_scaled(e, lw, n_cols, eps, dt).to(tl.float32)).to(dt).to(tl.float32)
            k = tl.minimum(tl.maximum(tl.load(match_ptr + seq), 0), max_match)
            me = tl.load(mt_ptr + k * n_cols + cols, mask=m, other=0.0).to(tl.float32)
            x = (x + me).to(dt).to(tl.float32)
        tl.store(x_ptr + row * n_cols + cols, x.to(dt), mask=m)
        dw = tl.load(dw_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, rms_scaled(x, dw, n_cols, eps, dt), mask=m)

    return tap_rmsnorm_kernel, draft_input_kernel


def tap_rmsnorm(taps: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-tap RMSNorm (Zhang & Sennrich 2019) concatenated over the taps, in one launch:
    ``cat([norm_t(taps[..., t, :]) for t], -1)`` with tap t's weight ``weight[t]``.

    Args:
        taps: ``[..., T, d]`` tapped states (made contiguous if they are not).
        weight: ``[T, d]`` the taps' norm weights, contiguous.
        eps: the norms' epsilon (one for all taps).

    Returns:
        ``[..., T * d]`` in ``taps``' dtype.
    """
    T, d = taps.shape[-2:]
    if weight.shape != (T, d):
        raise ValueError(f"tap_rmsnorm: weight {tuple(weight.shape)} for taps {tuple(taps.shape)}")
    taps = taps.contiguous()
    out = torch.empty(taps.shape[:-2] + (T * d,), dtype=taps.dtype, device=taps.device)
    rows = taps.numel() // d
    if rows:
        _kernels()[0][(rows,)](taps, weight, out, d, T, eps, BLOCK=_pow2(d))
    return out


def draft_input(h: torch.Tensor, pos: torch.Tensor, draft_weight: torch.Tensor, eps: float,
                lookup: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A SpecFormer head's draft-slot input and its RMSNorm in one launch:
    ``x = h[:, None] + pos`` (``+ lookup_norm(embed(cont) * (cont >= 0)) + match_table[clamp(match)][:, None]``
    for a lookup head), then ``draft_norm(x)``, with the plain ops' roundings.

    Args:
        h: ``[N, d]`` context states; pos: ``[N, L, d]`` the position projection's output.
        draft_weight: ``[d]`` the draft norm's weight; eps: the norms' epsilon.
        lookup: (a ``lookup_tokens`` head) ``cont`` ``[N, L]`` long continuation ids (-1: none),
            ``match`` ``[N]`` long match lengths (clamped to the table), the target's embedding
            ``[V, d]``, the lookup norm's weight ``[d]`` and the match table ``[max_match + 1, d]``.

    Returns:
        ``(x, normed)``, both ``[N, L, d]`` in ``h``'s dtype: the slots' residual stream and its norm.
    """
    N, L, d = pos.shape
    pos = pos.contiguous()
    x = torch.empty_like(pos)
    out = torch.empty_like(pos)
    if N:
        if lookup is not None:
            cont, match, embed, lookup_w, table = lookup
            args = (cont.contiguous(), match.contiguous(), embed, lookup_w, table, table.shape[0] - 1)
        else:  # LOOKUP off: the kernel never reads these pointers
            args = (h, h, h, draft_weight, h, 0)
        cont, match, embed, lookup_w, table, max_match = args
        _kernels()[1][(N * L,)](h.contiguous(), pos, cont, match, embed, lookup_w, table, draft_weight, x, out,
                                d, L, max_match, eps, LOOKUP=lookup is not None, BLOCK=_pow2(d))
    return x, out
