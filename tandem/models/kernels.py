"""Fused GPU kernels for the decode and verify forward (Triton), attention aside.

A plain PyTorch layer issues about forty small kernels per decode step (RMSNorm alone is seven:
cast, square, mean, add, rsqrt, multiply, scale), and at the bundled model's size each costs a few
microseconds of GPU time and about as much CPU time inside a CUDA-graph launch. The fused path
issues nine per layer: add+RMSNorm, the QKV GEMM, RoPE+KV-cache write, attention, the output GEMM,
add+RMSNorm, the gate/up GEMM, SiLU-multiply, the down GEMM (GEMMs stay cuBLAS); eight in a chain
step whose attention does the RoPE + K/V write itself (``attention.gqa_attention_rope``,
``transformer.ROPE_IN_ATTENTION``).

Every kernel here processes one token row per program with a fixed block size, so a row's result
does not depend on how many rows share the launch (batch- and width-invariant, as in Thinking
Machines' "Defeating Nondeterminism in LLM Inference", 2025).

Attention of decode and verify steps is in ``tandem.models.attention``.

The kernels are for CUDA devices: ``fused_unavailable_reason()`` says whether this process can use
the path (CUDA, Triton, a supported head size). With ``TRITON_INTERPRET=1`` (``interpreted()``)
Triton's interpreter runs the very same kernels on CPU tensors, in float32 or float16 (NumPy has no
bfloat16), orders of magnitude slower: that is how the CPU tests check them, against the float32
reference forward in ``transformer.py``, on machines without a GPU.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .kv_cache import KV_SLACK

log = logging.getLogger(__name__)

MAX_FUSED_TOKENS = KV_SLACK  # tokens per row the fused forward takes (decode and verify; prefill is wider)
FUSED_HEAD_DIMS = (64, 128)  # head sizes the fused kernels take (powers of two; flash-attn's build: 64)


@functools.lru_cache(maxsize=1)
def _modules():
    """``(triton, tl)`` or None when Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # ImportError, or a Triton that does not load here
        log.info("fused decode kernels unavailable: %s", exc)
        return None
    return triton, tl


def interpreted() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET=1`` in the environment when Triton was
    imported) and Triton imports: the kernels then run on CPU tensors, through NumPy. For checking
    them without a GPU; far too slow to serve with."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on") and _modules() is not None


def triton_runs_on(device: torch.device) -> bool:
    """Whether this process runs Triton kernels on tensors of ``device``: CUDA with Triton, or the
    CPU under Triton's interpreter (``interpreted``; for tests, slowly)."""
    if _modules() is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def round_kernels_on(device: torch.device) -> bool:
    """Whether a round's own Triton kernels (``tandem.drafters.lookup_kernel``'s prompt lookup,
    ``tandem.verify_kernel``'s greedy verification) run by default for tensors on ``device``: on
    CUDA where Triton imports; elsewhere the PyTorch ops they equal (the interpreter is for tests)."""
    return device.type == "cuda" and _modules() is not None


def fused_unavailable_reason(device: torch.device, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the fused path cannot run for this model and device, or None when it can: a CUDA device
    in bf16/fp16, or a CPU under Triton's interpreter (``interpreted``) in float32/fp16."""
    on_cpu = device.type == "cpu" and interpreted()
    if device.type != "cuda" and not on_cpu:
        return "not a CUDA device (TRITON_INTERPRET=1 runs the kernels on a CPU, slowly, for tests)"
    if on_cpu and dtype not in (torch.float32, torch.float16):
        return f"dtype {dtype} (Triton's interpreter takes float32/fp16: NumPy has no bfloat16)"
    if not on_cpu and dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (the fused kernels take bf16/fp16)"
    if head_dim not in FUSED_HEAD_DIMS:
        return f"head dim {head_dim} (the fused kernels take {FUSED_HEAD_DIMS})"
    if _modules() is None:
        return "triton is not importable (it comes with PyTorch's CUDA wheels)"
    return None


@functools.lru_cache(maxsize=1)
def _jit_helpers() -> None:
    """Define the device functions the kernels share as module globals (a Triton kernel resolves a
    called ``@triton.jit`` function by its global name, not through a closure)."""
    triton, tl = _modules()
    global rms_scaled

    @triton.jit
    def rms_scaled(x, w, n_cols, eps, DT: tl.constexpr):
        # RMSNorm of a float32 row as the plain ops round it: x / rms(x) rounded to the storage
        # dtype DT, then times the weight w (float32), rounded to DT
        var = tl.sum(x * x, axis=0) / n_cols
        y = (x * tl.rsqrt(var + eps)).to(DT).to(tl.float32)
        return (w * y).to(DT)


@functools.lru_cache(maxsize=1)
def _kernels():
    triton, tl = _modules()
    _jit_helpers()

    @triton.jit
    def add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                           HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        # one row per program: r = x (+ res), rounded to the storage dtype as a plain add would be;
        # out = w * (r / rms(r)) with the normalised value rounded before the scale, as RMSNorm does
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
            x = (x + r).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=m)
            x = x.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, rms_scaled(x, w, n_cols, eps, out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, write_ptr, q_out_ptr, k_ptr, v_ptr,
                       tokens_per_row, k_sb, k_sh, k_sp, qkv_stride, span_stride, max_pos, scratch,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       SPANS: tl.constexpr):
        # program (token, head): head < HEADS rotates that q head into q_out; head = HEADS + h
        # rotates k head h and copies v head h into the cache row at the token's write position
        # (rotate-half RoPE). One program per head keeps a decode step's few tokens on many SMs.
        # SPANS: pos_ptr / write_ptr hold each row's first position and real token count (stride
        # span_stride); token j of a row sits at first + j (rotated at min(first + j, max_pos - 1)),
        # and a token past the count writes to the scratch position.
        tok = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, half)
        if SPANS:
            row = tok // tokens_per_row
            slot_pos = tl.load(pos_ptr + row * span_stride) + tok % tokens_per_row
            pos = tl.minimum(slot_pos, max_pos - 1)
        else:
            pos = tl.load(pos_ptr + tok)
        cos1 = tl.load(cos_ptr + pos * HEAD_DIM + d).to(tl.float32)
        cos2 = tl.load(cos_ptr + pos * HEAD_DIM + half + d).to(tl.float32)
        sin1 = tl.load(sin_ptr + pos * HEAD_DIM + d).to(tl.float32)
        sin2 = tl.load(sin_ptr + pos * HEAD_DIM + half + d).to(tl.float32)
        src = qkv_ptr + tok * qkv_stride + h * HEAD_DIM
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + half + d).to(tl.float32)
        r1 = x1 * cos1 - x2 * sin1
        r2 = x2 * cos2 + x1 * sin2
        if h < HEADS:
            o = q_out_ptr + (tok * HEADS + h) * HEAD_DIM
            tl.store(o + d, r1.to(q_out_ptr.dtype.element_ty))
            tl.store(o + half + d, r2.to(q_out_ptr.dtype.element_ty))
        else:
            kvh = h - HEADS
            if SPANS:
                real = tok % tokens_per_row < tl.load(write_ptr + row * span_stride)
                wpos = tl.where(real, slot_pos, scratch)
            else:
                wpos = tl.load(write_ptr + tok)
            dst = (tok // tokens_per_row) * k_sb + kvh * k_sh + wpos * k_sp
            tl.store(k_ptr + dst + d, r1.to(k_ptr.dtype.element_ty))
            tl.store(k_ptr + dst + half + d, r2.to(k_ptr.dtype.element_ty))
            vb = src + KV_HEADS * HEAD_DIM  # v head kvh sits KV_HEADS heads after k head kvh
            tl.store(v_ptr + dst + d, tl.load(vb + d))
            tl.store(v_ptr + dst + half + d, tl.load(vb + half + d))

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, n_inter, BLOCK: tl.constexpr):
        # program (row, chunk): silu(gate) * up over one BLOCK of the row's [gate | up] halves, each
        # op rounded to the storage dtype as the unfused ops are
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n_inter
        g = tl.load(gu_ptr + row * 2 * n_inter + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * n_inter + n_inter + cols, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * n_inter + cols, (s * u).to(out_ptr.dtype.element_ty), mask=m)

    return add_rmsnorm_kernel, rope_kv_kernel, silu_mul_kernel


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (or ``x``), then RMSNorm(r) (Zhang & Sennrich 2019) in one kernel.

    Args:
        x, residual: ``[..., d]`` contiguous, same dtype; ``residual`` None for the first layer.
        weight: ``[d]``.

    Returns:
        ``(normed [..., d], r [..., d])``: the normalised rows and the new residual stream.
    """
    add_rmsnorm_kernel, _, _ = _kernels()
    d = x.shape[-1]
    rows = x.numel() // d
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    add_rmsnorm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, res_out, d, eps,
                                HAS_RES=residual is not None, BLOCK=_pow2(d))
    return out, res_out


# Warps a program of the elementwise kernels (no reduction: any count gives the same bits). A RoPE
# program handles one (token, head), 32-64 values a half, so one warp holds it and more warps only
# idle while they take the GPU's room for other programs: measured on an H100 (2026-12-07,
# scripts/time_small_kernels.py, docs/benchmarks.md), one warp against four: 3.5 against 4.1 µs a
# call at 320 rows (a batch-64 verify of 5 tokens), 6.1 against 7.1 at 640, the same at 1-5 rows.
# SiLU-multiply's programs hold 1,024 values: four warps were the fastest (1.4 µs at 1 row).
ROPE_KV_WARPS = 1
SILU_MUL_WARPS = 4


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  write_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  heads: int, kv_heads: int, warps: int | None = None) -> torch.Tensor:
    """Rotate q and k (RoPE, Su et al. 2021, rotate-half layout) and write k, v into the cache.

    Args:
        qkv: ``[B, Q, (heads + 2 * kv_heads) * head_dim]`` the fused projection's output.
        cos, sin: ``[max_positions, head_dim]`` tables.
        pos: ``[B, Q]`` int64 rotary position of each token.
        write_pos: ``[B, Q]`` int64 cache position each token's K/V goes to.
        k_cache, v_cache: one layer's rows ``[B, kv_heads, positions, head_dim]`` (last dim contiguous).
        warps: warps a program (default ``ROPE_KV_WARPS``; for timing others: the bits are the same).

    Returns:
        Rotated q ``[B, Q, heads, head_dim]``.
    """
    return _rope_kv(qkv, cos, sin, pos.contiguous(), write_pos.contiguous(), k_cache, v_cache, heads, kv_heads,
                    warps=warps)


def rope_kv_write_spans(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor,
                        q_lens: torch.Tensor, scratch: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        heads: int, kv_heads: int) -> torch.Tensor:
    """``rope_kv_write`` for rows of consecutive positions, made in the kernel: token j of row b is
    rotated at ``min(start[b] + j, len(cos) - 1)`` and written at ``start[b] + j`` when ``j <
    q_lens[b]``, else at ``scratch`` (padding no attention reads); the five to six small kernels
    that would make ``pos`` and ``write_pos`` are not launched. ``start``, ``q_lens``: ``[B]``
    int64 (e.g. two columns of one packed tensor); the rest as ``rope_kv_write``."""
    if start.stride() != q_lens.stride():
        start, q_lens = start.contiguous(), q_lens.contiguous()
    return _rope_kv(qkv, cos, sin, start, q_lens, k_cache, v_cache, heads, kv_heads, scratch=scratch)


def _rope_kv(qkv, cos, sin, pos, write, k_cache, v_cache, heads, kv_heads, scratch: int | None = None,
             warps: int | None = None):
    _, rope_kv_kernel, _ = _kernels()
    B, Q, width = qkv.shape
    hd = cos.shape[-1]
    q = torch.empty((B, Q, heads, hd), dtype=qkv.dtype, device=qkv.device)
    qkv = qkv.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    spans = scratch is not None
    rope_kv_kernel[(B * Q, heads + kv_heads)](qkv, cos, sin, pos, write, q, k_cache, v_cache, Q,
                             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), width,
                             pos.stride(0) if spans else 1, cos.shape[0], scratch if spans else 0,
                             HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=hd, SPANS=spans,
                             num_warps=warps or ROPE_KV_WARPS)
    return q


def silu_mul(gate_up: torch.Tensor, warps: int | None = None) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` over ``[..., 2 * I]`` rows (gate first) -> ``[..., I]``;
    ``warps`` a program (default ``SILU_MUL_WARPS``; for timing others: the bits are the same)."""
    _, _, silu_mul_kernel = _kernels()
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(gate_up.shape[:-1] + (inter,), dtype=gate_up.dtype, device=gate_up.device)
    block = min(_pow2(inter), 1024)
    silu_mul_kernel[(rows, -(-inter // block))](gate_up.contiguous(), out, inter, BLOCK=block,
                                                num_warps=warps or SILU_MUL_WARPS)
    return out


@functools.lru_cache(maxsize=1)
def _draft_features_kernel():
    triton, tl = _modules()

    @triton.jit
    def draft_features_kernel(x_ptr, pos_ptr, out_ptr, n_cols, x_stride,
                              IS_PROBS: tl.constexpr, BLOCK: tl.constexpr):
        # one row per program, one pass over the vocabulary: entropy, top-1 probability and top-1 -
        # top-2 margin of softmax(x) (logits, online max with rescaled sums) or of x itself (IS_PROBS)
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * x_stride
        cols = tl.arange(0, BLOCK)
        neg = float("-inf")
        m = tl.full([], neg, tl.float32)  # running max (logits) ...
        z = tl.full([], 0.0, tl.float32)  # ... sum exp(x - m)
        s = tl.full([], 0.0, tl.float32)  # ... sum exp(x - m) * (x - m); probabilities: sum -p log p
        t1 = tl.full([], neg, tl.float32)
        t2 = tl.full([], neg, tl.float32)
        for start in range(0, n_cols, BLOCK):
            idx = start + cols
            valid = idx < n_cols
            x = tl.load(base + idx, mask=valid, other=neg).to(tl.float32)
            b1 = tl.max(x, axis=0)
            i1 = tl.argmax(x, axis=0)
            b2 = tl.max(tl.where(cols == i1, neg, x), axis=0)
            t2 = tl.maximum(tl.maximum(tl.minimum(t1, b1), t2), b2)
            t1 = tl.maximum(t1, b1)
            if IS_PROBS:
                p = tl.where(valid, x, 0.0)
                s += tl.sum(tl.where(p > 0, -p * tl.log(tl.maximum(p, 1e-20)), 0.0), axis=0)
            else:
                m_new = tl.maximum(m, b1)
                scale = tl.exp(m - m_new)
                e = tl.where(valid, tl.exp(x - m_new), 0.0)
                shift = tl.where(z > 0, z * (m - m_new), 0.0)  # (no -inf * 0 before the first block)
                s = scale * (s + shift) + tl.sum(tl.where(e > 0, e * (x - m_new), 0.0), axis=0)  # masked: 0
                z = z * scale + tl.sum(e, axis=0)
                m = m_new
        if IS_PROBS:
            entropy = s
            p1 = t1
            p2 = tl.maximum(t2, 0.0)
        else:
            entropy = tl.log(z) - s / z
            p1 = tl.exp(t1 - m) / z
            p2 = tl.exp(t2 - m) / z
        o = out_ptr + row * 4
        tl.store(o, entropy)
        tl.store(o + 1, p1)
        tl.store(o + 2, p1 - p2)
        tl.store(o + 3, tl.load(pos_ptr + row).to(tl.float32))

    return draft_features_kernel


def draft_features(x: torch.Tensor, positions: torch.Tensor, probs: bool = False) -> torch.Tensor:
    """Acceptance-predictor features of draft distributions in one pass over the vocabulary per
    row (``tandem.drafters.base.device_features``'s definition: entropy in nats, top-1
    probability, top-1 minus top-2 probability, 1-based draft position), for a chained round's
    draft scoring: one kernel instead of a softmax, a log, a product, a sum and a top-k over
    ``[rows, vocab]`` float32 copies.

    Args:
        x: ``[R, V]`` draft logits (any float dtype; the distribution is their softmax), or with
            ``probs`` the probabilities themselves (float32, rows summing to 1, e.g. a sampling
            transform's q). Rows must be contiguous in the last dimension. CUDA only.
        positions: ``[R]`` draft positions (any numeric dtype).

    Returns:
        ``[R, 4]`` float32 features on ``x``'s device.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, V = x.shape
    out = torch.empty((R, 4), dtype=torch.float32, device=x.device)
    if R:
        _draft_features_kernel()[(R,)](x, positions.contiguous(), out, V, x.stride(0), IS_PROBS=probs,
                                       BLOCK=min(_pow2(V), 4096))
    return out


@functools.lru_cache(maxsize=1)
def _slot_attention_kernel():
    triton, tl = _modules()

    @triton.jit
    def slot_attention_kernel(qkv_ptr, out_ptr, L, scale, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK_L: tl.constexpr, CAUSAL: tl.constexpr):
        # program (sequence, head): attention among a sequence's L slots, read straight from its
        # QKV projection rows [L, 3, HEADS, HEAD_DIM] and written as [L, HEADS * HEAD_DIM] (no
        # permute copies); float32 scores and softmax, each slot's keys summed in slot order
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK_L)
        d = tl.arange(0, HEAD_DIM)
        row = 3 * HEADS * HEAD_DIM
        base = qkv_ptr + n * L * row + h * HEAD_DIM
        live = i < L
        offs = i[:, None] * row + d[None, :]
        q = tl.load(base + offs, mask=live[:, None], other=0.0).to(tl.float32)
        k = tl.load(base + HEADS * HEAD_DIM + offs, mask=live[:, None], other=0.0).to(tl.float32)
        v = tl.load(base + 2 * HEADS * HEAD_DIM + offs, mask=live[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [query slot, key slot]
        ok = live[None, :]
        if CAUSAL:
            ok = ok & (i[None, :] <= i[:, None])
        s = tl.where(ok, s, float("-inf"))
        p = tl.exp(s - tl.max(s, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        o = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [query slot, HEAD_DIM]
        dst = out_ptr + n * L * HEADS * HEAD_DIM + h * HEAD_DIM + i[:, None] * (HEADS * HEAD_DIM) + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=live[:, None])

    return slot_attention_kernel


def slot_attention(qkv: torch.Tensor, heads: int, head_dim: int, causal: bool = False) -> torch.Tensor:
    """Multi-head attention among each sequence's few slots, as SpecFormer's draft part runs it
    (every draft slot attends to the sequence's slots, or to those up to its own with ``causal``;
    the scaled dot-product attention of "Attention Is All You Need" with scale ``head_dim ** -0.5``):
    one launch, one program per (sequence, head), reading q, k and v from the QKV projection's
    output and writing the layout the output projection reads. Where a generic attention kernel
    tiles for long sequences, here L is 4-16 and the whole problem fits one program's registers.

    Args:
        qkv: ``[N, L, 3 * heads * head_dim]`` projection rows laid out ``[3, heads, head_dim]``
            (q, then k, then v), contiguous; CUDA (or the CPU under Triton's interpreter).
        heads: attention heads (q, k and v alike); head_dim: a power of two.

    Returns:
        ``[N, L, heads * head_dim]`` in ``qkv``'s dtype (float32 accumulation).

    Raises:
        ValueError: a shape that does not match ``heads`` and ``head_dim``, or L > 64.
    """
    N, L, width = qkv.shape
    if width != 3 * heads * head_dim or head_dim & (head_dim - 1) or L > 64:
        raise ValueError(f"slot_attention: qkv {tuple(qkv.shape)} for {heads} heads of {head_dim} (L <= 64, "
                         "head_dim a power of two)")
    qkv = qkv.contiguous()
    out = torch.empty((N, L, heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if N:
        _slot_attention_kernel()[(N, heads)](qkv, out, L, head_dim ** -0.5, HEADS=heads, HEAD_DIM=head_dim,
                                             BLOCK_L=max(_pow2(L), 2), CAUSAL=causal)
    return out


# columns a program of row_argmax's first pass reads: 24 programs a row over a 49,152 vocabulary
ARGMAX_BLOCK = 2048


@functools.lru_cache(maxsize=1)
def _row_argmax_kernels():
    triton, tl = _modules()

    @triton.jit
    def argmax_part_kernel(x_ptr, val_ptr, idx_ptr, n_cols, x_stride, parts, BLOCK: tl.constexpr):
        # program (row, part): the maximum of one BLOCK of the row's columns and its first index
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        idx = part * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_stride + idx, mask=idx < n_cols, other=float("-inf")).to(tl.float32)
        tl.store(val_ptr + row * parts + part, tl.max(x, axis=0))
        tl.store(idx_ptr + row * parts + part, tl.argmax(x, axis=0).to(tl.int64) + part * BLOCK)

    @triton.jit
    def argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, parts, PARTS: tl.constexpr):
        # one row per program: the parts in column order; of equal maxima the first part's index,
        # so the row's first maximum, as torch.argmax gives it
        row = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, PARTS)
        live = p < parts
        v = tl.load(val_ptr + row * parts + p, mask=live, other=float("-inf"))
        i = tl.load(idx_ptr + row * parts + p, mask=live, other=0)
        best = tl.max(v, axis=0)
        first = tl.min(tl.where(live & (v == best), p, PARTS), axis=0)
        tl.store(out_ptr + row, tl.sum(tl.where(p == first, i, 0), axis=0))

    return argmax_part_kernel, argmax_merge_kernel


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for ``[..., V]`` logits in two launches: the first reads each row in
    ``ARGMAX_BLOCK``-column parts, one program a part (the maximum and its first index), the second
    merges a row's parts in column order. The first index of each row's maximum, as
    ``torch.argmax`` gives it (rows without NaN). PyTorch's reduction reaches about a third of the
    memory bandwidth on a few hundred rows of a 49k vocabulary, and one program a row sweeping the
    vocabulary waits on 12 dependent 4,096-column loads (14 µs for one row on an H100,
    docs/benchmarks.md); here every part loads at once.

    Args:
        x: ``[..., V]`` float logits, the last dimension contiguous; CUDA (or the CPU under
            Triton's interpreter).

    Returns:
        ``[...]`` int64 on ``x``'s device.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    V = x.shape[-1]
    rows = x.reshape(-1, V)
    n = rows.shape[0]
    out = torch.empty(n, dtype=torch.long, device=x.device)
    if n:
        part_kernel, merge_kernel = _row_argmax_kernels()
        parts = -(-V // ARGMAX_BLOCK)
        vals = torch.empty((n, parts), dtype=torch.float32, device=x.device)
        idx = torch.empty((n, parts), dtype=torch.long, device=x.device)
        part_kernel[(n, parts)](rows, vals, idx, V, rows.stride(0), parts, BLOCK=ARGMAX_BLOCK)
        merge_kernel[(n,)](vals, idx, out, parts, PARTS=max(_pow2(parts), 2), num_warps=1)
    return out.view(x.shape[:-1])


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p
