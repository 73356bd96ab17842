"""The projections of a decoder layer fused with their neighbours (Triton): five kernels a layer.

The fused path of ``kernels.py`` keeps the four projections in cuBLAS, so a decode step at batch 1
is nine kernels a layer, each a few microseconds of latency against well under a microsecond of
weight reading for a 135M-parameter model (0.87 ms of GPU a step, 52% of it in the GEMMs: the
per-kernel table docs/results/2026-12-03/rope-logits/tables/target-b1.txt). Here each projection reads its input, applies what stands before it and writes what
stands after it, in one kernel:

1. RMSNorm + QKV projection + RoPE + K/V-cache write (``norm_qkv_rope``): a program per (16-row
   tile, head of q, k or v, part of the head); the norm's statistic is gathered from the row in the
   same pass as the projection and applied to its accumulators (``RMSNorm(x) @ W^T = rstd * ((x *
   w_norm) @ W^T)``), each part's columns of the two rotate-half halves are computed together so
   RoPE is applied in registers, and k/v heads go straight to the cache;
2. attention (``attention.gqa_attention``);
3. O projection + residual add (``linear_residual``);
4. RMSNorm + gate/up projection + SiLU-multiply (``norm_gate_up``): gate and up columns of the same
   index in one program;
5. down projection + residual add (``linear_residual``).

A batch-1 step is latency-bound (a layer's 7 MB of weights read in ~2 µs at full bandwidth, and a
small kernel costs about that much by itself). Each launch gathers the norm's statistic in the
projection's own pass and keeps several reduction steps of loads in flight (``DECODE_TILES``, the
best of a sweep of cuts: ``scripts/time_fused_linear.py``). Measured on an H100 (2026-12-07,
docs/benchmarks.md) it does not beat the cuBLAS path it replaces: a layer's projections and what
stands around them take 24 µs against 23 at 1-16 rows, 28 against 24 at 64 and 2-3x as long at
320-640 rows (a 16-row tile re-reads the weights for every 16 rows), so it stays a choice
(``kernels="fused-linear"``), not the default.

As in the rest of the fused path every program owns whole rows of a fixed tile (16 rows) and
reduces over K in a fixed order, so a row's result does not depend on how many rows share the
launch or on its place among them (batch- and width-invariant). Values are rounded to the storage
dtype where the unfused ops round (each projection's output, the residual sum), so the two fused
paths are close but not bitwise equal: losslessness needs one path for target-only and
speculative rounds alike, which the runner's ``kernels`` choice gives.

Decode and verify steps run 16-row tiles; prefills run 64-row tiles (``PREFILL_BLOCK_M``: a
prefill has thousands of rows, and each tile reads the layer's weights once). Either way the
tile size is fixed, so a prompt's K/V and first token do not depend on the prompts it was
prefilled with: the cuBLAS GEMMs of the plain fused path choose their kernel by the number of
rows, which can move a row's last bits with the batch. Shapes: hidden and intermediate sizes
multiples of the widest column tile (32), head size 64 or 128 (``unsupported_reason``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .kernels import _modules

BLOCK_M = 16  # rows a program holds in a decode or verify step: the smallest tensor-core tile
PREFILL_BLOCK_M = 64  # rows a program holds in a prefill: each weight tile is read once per 64 rows


class Tiles(NamedTuple):
    """How a launch of these kernels is cut: ``block_m`` rows by ``block_n`` output columns a program
    (``norm_qkv_rope``: ``block_n`` columns of each rotate-half half of a head), the reduction in
    ``block_k`` steps (a last partial step masked: a masked column adds an exact zero), ``stages``
    steps of loads in flight (Triton's software pipelining), ``warps`` warps a program."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int


# Decode and verify (16-row tiles): five reduction steps of loads in flight beside the one in use.
# The best cut of the sweep at every row count from 1 to 640 (H100): 16 columns a program (twice
# the programs) was no faster at 1-16 rows and 1.2-2x slower from 64 rows on, 8 warps slower still.
DECODE_TILES = Tiles(BLOCK_M, 32, 64, 6, 4)
# Prefill (64-row tiles): thousands of rows, so each program's weight tile serves 64 of them.
PREFILL_TILES = Tiles(PREFILL_BLOCK_M, 32, 64, 3, 8)


def tiles_for(block_m: int) -> Tiles:
    """The tiles of a launch whose programs hold ``block_m`` rows (``BLOCK_M`` or ``PREFILL_BLOCK_M``).

    Raises:
        ValueError: another ``block_m``.
    """
    for t in (DECODE_TILES, PREFILL_TILES):
        if t.block_m == block_m:
            return t
    raise ValueError(f"fused-linear tiles hold {BLOCK_M} or {PREFILL_BLOCK_M} rows, got {block_m}")


def unsupported_reason(hidden: int, intermediate: int, head_dim: int) -> str | None:
    """Why a model's shapes do not fit these kernels, or None when they do."""
    widest = max(t.block_n for t in (DECODE_TILES, PREFILL_TILES))
    if hidden % widest:
        return f"hidden size {hidden} (the fused-linear kernels take multiples of {widest})"
    if intermediate % widest:
        return f"intermediate size {intermediate} (the fused-linear kernels take multiples of {widest})"
    if head_dim not in (64, 128):
        return f"head dim {head_dim} (the fused-linear kernels take 64 or 128)"
    return None


# The kernels' shared device function, made with them (``_kernels``): a @triton.jit function calls
# another through its module's globals, which is where Triton (and its interpreter) look for it.
_norm_dot2 = None


@functools.lru_cache(maxsize=1)
def _kernels():
    global _norm_dot2
    triton, tl = _modules()

    @triton.jit
    def _norm_dot2(x_ptr, nw_ptr, w_ptr, rows, row_ok, na, nb, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        # (x * norm weight) @ w[na]^T and @ w[nb]^T over the row tile, and each row's sum of squares:
        # RMSNorm(x) @ w^T = rstd * ((x * norm weight) @ w^T), so the row's statistic is gathered in
        # the projection's own pass and applied to the accumulators after it
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        sq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            xk = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            xf = xk.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
            xs = (xf * tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(xk.dtype)
            wa = tl.load(w_ptr + na[:, None] * K + kk[None, :], mask=k_ok[None, :], other=0.0)
            wb = tl.load(w_ptr + nb[:, None] * K + kk[None, :], mask=k_ok[None, :], other=0.0)
            acc_a = tl.dot(xs, tl.trans(wa), acc_a)
            acc_b = tl.dot(xs, tl.trans(wb), acc_b)
        return acc_a, acc_b, sq

    @triton.jit
    def norm_qkv_rope_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, write_ptr, q_out_ptr, k_ptr,
                             v_ptr, n_rows, K, eps, tokens_per_row, k_sb, k_sh, k_sp,
                             HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             STAGES: tl.constexpr):
        # program (row tile, head, part): head < HEADS is q head h, then KV_HEADS k heads, then v
        # heads (the fused projection's column order); the part's columns d of the first rotate-half
        # half and d + HEAD_DIM / 2 of the second are computed together, so RoPE runs in registers
        tile = tl.program_id(0)
        h = tl.program_id(1)
        half: tl.constexpr = HEAD_DIM // 2
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        rows = rows.to(tl.int64)
        d = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n1 = h * HEAD_DIM + d
        acc1, acc2, sq = _norm_dot2(x_ptr, nw_ptr, w_ptr, rows, row_ok, n1, n1 + half, K,
                                    BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        rstd = tl.rsqrt(sq / K + eps)[:, None]
        acc1 = acc1 * rstd
        acc2 = acc2 * rstd
        dt = q_out_ptr.dtype.element_ty
        if HAS_BIAS:  # (Qwen2's q/k/v bias) added before the rounding, as a GEMM's epilogue adds it
            acc1 += tl.load(b_ptr + n1).to(tl.float32)[None, :]
            acc2 += tl.load(b_ptr + n1 + half).to(tl.float32)[None, :]
        x1 = acc1.to(dt).to(tl.float32)  # the projection's output, rounded as a GEMM's
        x2 = acc2.to(dt).to(tl.float32)
        wpos = tl.load(write_ptr + rows, mask=row_ok, other=0)
        dst = (rows // tokens_per_row) * k_sb + wpos * k_sp  # the row's cache position (+ head below)
        if h >= HEADS + KV_HEADS:  # v head: as projected
            vh = h - HEADS - KV_HEADS
            o = v_ptr + dst[:, None] + vh * k_sh + d[None, :]
            tl.store(o, x1.to(dt), mask=row_ok[:, None])
            tl.store(o + half, x2.to(dt), mask=row_ok[:, None])
        else:
            pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            cs = pos[:, None] * HEAD_DIM + d[None, :]
            cos1 = tl.load(cos_ptr + cs, mask=row_ok[:, None], other=0.0).to(tl.float32)
            cos2 = tl.load(cos_ptr + cs + half, mask=row_ok[:, None], other=0.0).to(tl.float32)
            sin1 = tl.load(sin_ptr + cs, mask=row_ok[:, None], other=0.0).to(tl.float32)
            sin2 = tl.load(sin_ptr + cs + half, mask=row_ok[:, None], other=0.0).to(tl.float32)
            r1 = (x1 * cos1 - x2 * sin1).to(dt)
            r2 = (x2 * cos2 + x1 * sin2).to(dt)
            if h < HEADS:
                o = q_out_ptr + (rows[:, None] * HEADS + h) * HEAD_DIM + d[None, :]
                tl.store(o, r1, mask=row_ok[:, None])
                tl.store(o + half, r2, mask=row_ok[:, None])
            else:
                o = k_ptr + dst[:, None] + (h - HEADS) * k_sh + d[None, :]
                tl.store(o, r1, mask=row_ok[:, None])
                tl.store(o + half, r2, mask=row_ok[:, None])

    @triton.jit
    def linear_residual_kernel(a_ptr, w_ptr, res_ptr, out_ptr, n_rows, K, N,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               STAGES: tl.constexpr):
        # program (row tile, column tile): out = res + a @ w^T, the product rounded before the add
        # and the sum after, as a GEMM followed by an add
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        rows = rows.to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(a_ptr + rows[:, None] * K + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        dt = out_ptr.dtype.element_ty
        r = tl.load(res_ptr + rows[:, None] * N + n[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        y = acc.to(dt).to(tl.float32) + r
        tl.store(out_ptr + rows[:, None] * N + n[None, :], y.to(dt), mask=row_ok[:, None])

    @triton.jit
    def norm_gate_up_kernel(x_ptr, nw_ptr, w_ptr, out_ptr, n_rows, K, n_inter, eps,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            STAGES: tl.constexpr):
        # program (row tile, column tile j): silu(gate_j) * up_j of RMSNorm(x), gate rows j and up
        # rows n_inter + j of the fused [gate | up] weight; the norm's statistic gathered in the same
        # pass (``_norm_dot2``), each projection rounded before the activation
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        rows = rows.to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc_g, acc_u, sq = _norm_dot2(x_ptr, nw_ptr, w_ptr, rows, row_ok, n, n + n_inter, K,
                                      BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        rstd = tl.rsqrt(sq / K + eps)[:, None]
        dt = out_ptr.dtype.element_ty
        g = (acc_g * rstd).to(dt).to(tl.float32)
        u = (acc_u * rstd).to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * n_inter + n[None, :], (s * u).to(dt), mask=row_ok[:, None])

    return norm_qkv_rope_kernel, linear_residual_kernel, norm_gate_up_kernel


def norm_qkv_rope(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, wqkv: torch.Tensor,
                  bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, write_pos: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                  block_m: int = BLOCK_M, tiles: Tiles | None = None) -> torch.Tensor:
    """RMSNorm(x) @ wqkv^T, RoPE on q and k, k and v written into the cache: one kernel.

    Args:
        x: ``[B, Q, d]`` the residual stream (contiguous).
        norm_weight: ``[d]`` the attention norm's weight; ``eps`` its epsilon.
        wqkv: ``[(heads + 2 * kv_heads) * head_dim, d]`` the fused projection's weight (q, k, v);
            bias: its ``[(heads + 2 * kv_heads) * head_dim]`` bias or None.
        cos, sin: ``[max_positions, head_dim]`` rotate-half RoPE tables.
        pos: ``[B, Q]`` int64 rotary position of each token; write_pos: ``[B, Q]`` int64 cache
            position its K/V goes to.
        k_cache, v_cache: one layer's ``[B, kv_heads, positions, head_dim]`` (last dim contiguous).
        block_m: rows a program holds (``BLOCK_M``, or ``PREFILL_BLOCK_M`` in a prefill).
        tiles: the launch's cut, when not ``tiles_for(block_m)`` (for timing other cuts).

    Returns:
        Rotated q ``[B, Q, heads, head_dim]``.
    """
    norm_qkv_rope_kernel, _, _ = _kernels()
    B, Q, d = x.shape
    hd = cos.shape[-1]
    rows = B * Q
    q = torch.empty((B, Q, heads, hd), dtype=x.dtype, device=x.device)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and x.is_contiguous()
    t = tiles or tiles_for(block_m)
    half = hd // 2
    bn = min(t.block_n, half)
    grid = (-(-rows // t.block_m), heads + 2 * kv_heads, half // bn)
    norm_qkv_rope_kernel[grid](x, norm_weight, wqkv, wqkv if bias is None else bias, cos, sin, pos.contiguous(),
                               write_pos.contiguous(), q, k_cache, v_cache, rows, d, eps, Q, k_cache.stride(0),
                               k_cache.stride(1), k_cache.stride(2), HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=hd,
                               HAS_BIAS=bias is not None, BLOCK_M=t.block_m, BLOCK_N=bn, BLOCK_K=t.block_k,
                               STAGES=t.stages, num_warps=t.warps)
    return q


def linear_residual(a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    block_m: int = BLOCK_M, tiles: Tiles | None = None) -> torch.Tensor:
    """``residual + a @ weight^T`` in one kernel (the O and down projections with their residual add).

    Args:
        a: ``[..., K]`` contiguous; weight: ``[N, K]``; residual: ``[..., N]`` contiguous.
        block_m: rows a program holds (``BLOCK_M``, or ``PREFILL_BLOCK_M`` in a prefill).
        tiles: the launch's cut, when not ``tiles_for(block_m)`` (for timing other cuts).

    Returns:
        The new residual stream ``[..., N]`` (a new tensor: earlier ones stay valid as taps).
    """
    _, linear_residual_kernel, _ = _kernels()
    N, K = weight.shape
    rows = a.numel() // K
    out = torch.empty_like(residual)
    assert a.is_contiguous() and residual.is_contiguous()
    t = tiles or tiles_for(block_m)
    linear_residual_kernel[(-(-rows // t.block_m), N // t.block_n)](
        a, weight, residual, out, rows, K, N, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        STAGES=t.stages, num_warps=t.warps)
    return out


def norm_gate_up(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w13: torch.Tensor,
                 block_m: int = BLOCK_M, tiles: Tiles | None = None) -> torch.Tensor:
    """SwiGLU's activation ``silu(h @ gate^T) * (h @ up^T)`` of ``h = RMSNorm(x)`` in one kernel.

    Args:
        x: ``[..., d]`` the residual stream (contiguous); norm_weight ``[d]`` and ``eps``: the FFN norm.
        w13: ``[2 * I, d]`` the fused [gate | up] weight.
        block_m: rows a program holds (``BLOCK_M``, or ``PREFILL_BLOCK_M`` in a prefill).
        tiles: the launch's cut, when not ``tiles_for(block_m)`` (for timing other cuts).

    Returns:
        ``[..., I]``, the input of the down projection.
    """
    _, _, norm_gate_up_kernel = _kernels()
    d = x.shape[-1]
    inter = w13.shape[0] // 2
    rows = x.numel() // d
    out = torch.empty(x.shape[:-1] + (inter,), dtype=x.dtype, device=x.device)
    assert x.is_contiguous()
    t = tiles or tiles_for(block_m)
    norm_gate_up_kernel[(-(-rows // t.block_m), inter // t.block_n)](
        x, norm_weight, w13, out, rows, d, inter, eps, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        STAGES=t.stages, num_warps=t.warps)
    return out
