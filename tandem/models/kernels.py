"""Fused GPU kernels for the decode and verify forward (Triton), and the attention entry point.

A plain PyTorch layer issues about forty small kernels per decode step (RMSNorm alone is seven:
cast, square, mean, add, rsqrt, multiply, scale), and at the bundled model's size each costs a few
microseconds of GPU time and about as much CPU time inside a CUDA-graph launch. The fused path
issues nine per layer: add+RMSNorm, the QKV GEMM, RoPE+KV-cache write, attention, the output GEMM,
add+RMSNorm, the gate/up GEMM, SiLU-multiply, the down GEMM (GEMMs stay cuBLAS).

Every kernel here processes one token row per program with a fixed block size, so a row's result
does not depend on how many rows share the launch (batch- and width-invariant, as in Thinking
Machines' "Defeating Nondeterminism in LLM Inference", 2025).

Attention of decode and verify steps is our own GQA-packed kernel (``gqa_attention``): one
program per (row, KV head) holds the query rows of *all* the row's new tokens and of all the query
heads that share that KV head (``Q x group`` rows, packed in tiles of 16), so every K/V block is
read once per KV head whatever the number of tokens verified, with the causal limit of each packed
row applied in registers (no mask tensor). FlashAttention-2's ``flash_attn_with_kvcache`` (Dao
2023) folds the query heads of a KV head only for one new token; for 2 .. 16 it reads the cache
once per query head, which made verifying 2 tokens at batch 64 cost 1.8x a decode step. flash-attn
(``tandem[flash-attn]``) still runs the prefill where it is importable, and can be chosen for
decode/verify too (``RunnerConfig.kernels = "fused-flash"``) with a fixed split count
(``ATTN_SPLITS``): its own heuristic picks the split count from the batch size.

The kernels are for CUDA devices: ``fused_unavailable_reason()`` says whether this process can use
the path (CUDA, Triton, a supported head size). With ``TRITON_INTERPRET=1`` (``interpreted()``)
Triton's interpreter runs the very same kernels on CPU tensors, in float32 or float16 (NumPy has no
bfloat16), orders of magnitude slower: that is how the CPU tests check them, against the float32
reference forward in ``transformer.py``, on machines without a GPU.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch

from .kv_cache import KV_SLACK

log = logging.getLogger(__name__)

ATTN_SPLITS = 1  # flash-attn split-KV chunks: fixed, so a row's attention does not depend on the batch
MAX_FUSED_TOKENS = KV_SLACK  # tokens per row the fused forward takes (decode and verify; prefill is wider)
FUSED_HEAD_DIMS = (64, 128)  # head sizes the fused kernels take (powers of two; flash-attn's build: 64)
FLASH_HEAD_DIMS = (64,)  # head sizes the bundled flash-attn build was compiled for
ATTN_BACKENDS = ("triton", "flash", "flash-heuristic")  # decode/verify attention (``attention_with_kvcache``)
ATTN_BLOCK_M = 16  # packed query rows (token x query head) per tile: the smallest tensor-core tile
ATTN_BLOCK_N = 64  # keys per step of the attention loop
ATTN_STAGES = 2  # software-pipelining stages of the attention loop (Triton's num_stages)


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


@functools.lru_cache(maxsize=1)
def _flash():
    """flash-attn's ``flash_attn_with_kvcache``, or None when it is not importable."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception as exc:  # ImportError, or a flash-attn build that does not load here
        log.info("flash-attn unavailable (prefill takes the Triton attention): %s", exc)
        return None
    return flash_attn_with_kvcache


def flash_available(head_dim: int) -> bool:
    """Whether flash-attn's kernel is importable here and built for ``head_dim``."""
    return head_dim in FLASH_HEAD_DIMS and _flash() is not None


_BACKEND_OF = {"fused": "triton", "fused-flash": "flash", "fused-heuristic": "flash-heuristic",  # kernels choice
               "fused-linear": "triton"}
_BACKEND_NAMES = {"triton": "triton-gqa", "flash": "flash-attn", "flash-heuristic": "flash-attn-heuristic"}


def attention_backend_for(kernels: str) -> str:
    """The ``attention_with_kvcache`` backend of a resolved ``RunnerConfig.kernels`` path ("fused",
    "fused-flash", "fused-heuristic"; "triton" for "reference", whose forward never calls it)."""
    return _BACKEND_OF.get(kernels, "triton")


def attention_name(kernels: str, chunk: int = 0) -> str:
    """The decode/verify attention a resolved ``kernels`` path uses, as reported in bench metadata:
    "triton-gqa" (with "-split<chunk>" under a split-KV ``chunk``), "flash-attn",
    "flash-attn-heuristic", or "sdpa-masked" for "reference"."""
    if kernels not in _BACKEND_OF:
        return "sdpa-masked"
    name = _BACKEND_NAMES[_BACKEND_OF[kernels]]
    return f"{name}-split{chunk}" if chunk and _BACKEND_OF[kernels] == "triton" else name


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
def _kernels():
    triton, tl = _modules()

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
        var = tl.sum(x * x, axis=0) / n_cols
        y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (w * y).to(out_ptr.dtype.element_ty), mask=m)

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


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  write_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  heads: int, kv_heads: int) -> torch.Tensor:
    """Rotate q and k (RoPE, Su et al. 2021, rotate-half layout) and write k, v into the cache.

    Args:
        qkv: ``[B, Q, (heads + 2 * kv_heads) * head_dim]`` the fused projection's output.
        cos, sin: ``[max_positions, head_dim]`` tables.
        pos: ``[B, Q]`` int64 rotary position of each token.
        write_pos: ``[B, Q]`` int64 cache position each token's K/V goes to.
        k_cache, v_cache: one layer's rows ``[B, kv_heads, positions, head_dim]`` (last dim contiguous).

    Returns:
        Rotated q ``[B, Q, heads, head_dim]``.
    """
    return _rope_kv(qkv, cos, sin, pos.contiguous(), write_pos.contiguous(), k_cache, v_cache, heads, kv_heads)


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


def _rope_kv(qkv, cos, sin, pos, write, k_cache, v_cache, heads, kv_heads, scratch: int | None = None):
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
                             HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=hd, SPANS=spans)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` over ``[..., 2 * I]`` rows (gate first) -> ``[..., I]``."""
    _, _, silu_mul_kernel = _kernels()
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(gate_up.shape[:-1] + (inter,), dtype=gate_up.dtype, device=gate_up.device)
    block = min(_pow2(inter), 1024)
    silu_mul_kernel[(rows, -(-inter // block))](gate_up.contiguous(), out, inter, BLOCK=block)
    return out


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # split-KV arrival counters per device (``prepare_counters``)
_RETIRED: list[torch.Tensor] = []  # counters replaced by larger ones: graphs captured over them still count there
COUNTERS = 1 << 16  # the least (row, KV head, tile) triples the counters hold


def _device_key(device) -> torch.device:
    """``device`` with its index (``cuda`` is the current CUDA device), as tensors name theirs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def prepare_counters(device, size: int = COUNTERS) -> torch.Tensor:
    """The split-KV attention's arrival counters on ``device``: at least ``size`` (and
    ``COUNTERS``) int32 zeros, one per (row, KV head, tile) of a launch, which every launch leaves
    at zero. Made outside CUDA-graph capture, before the first step: the runner calls this with
    what its largest decode, verify and prefill steps need. A larger request replaces the buffer
    and keeps the old one alive, for the graphs captured over it."""
    key = _device_key(device)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < size:
        if have is not None:
            _RETIRED.append(have)
        _COUNTERS[key] = torch.zeros(max(size, COUNTERS), dtype=torch.int32, device=key)
    return _COUNTERS[key]


def counters_needed(rows: int, kv_heads: int, group: int, step_tokens: int, prefill_positions: int) -> int:
    """Counters (``prepare_counters``) that split-KV steps of a runner can use at once: ``rows``
    rows of at most ``step_tokens`` tokens (a tree step: a tile per token), or a prefill of at most
    ``prefill_positions`` rows x positions over at most ``rows`` rows, each with ``kv_heads`` KV
    heads of ``group`` query heads."""
    per_token = -(-group // ATTN_BLOCK_M)
    decode = rows * step_tokens * per_token
    prefill = prefill_positions * group // ATTN_BLOCK_M + rows
    return kv_heads * max(decode, prefill)


def _counters(device: torch.device, needed: int) -> torch.Tensor:
    """``prepare_counters``' buffer for a launch over ``needed`` (row, KV head, tile) triples.

    Raises:
        RuntimeError: a CUDA graph capture needs more counters than ``prepare_counters`` made.
    """
    key = _device_key(device)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < needed:
        if key.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a split-KV attention captured over {needed} (row, KV head, tile) triples: "
                               f"kernels.prepare_counters({key}, {needed}) was not called before the capture")
        return prepare_counters(key, needed)
    return have


@functools.lru_cache(maxsize=1)
def _attention_kernel():
    triton, tl = _modules()

    @triton.jit(do_not_specialize=["n_tokens", "n_chunks"])
    def gqa_attention_kernel(q_ptr, k_ptr, v_ptr, seqlen_ptr, tree_ptr, out_ptr, part_ptr, ml_ptr, count_ptr,
                             n_tokens, n_chunks, scale_log2, k_sb, k_sh, k_sp, GROUP: tl.constexpr, HEADS: tl.constexpr,
                             HEAD_DIM: tl.constexpr, HAS_TREE: tl.constexpr, CHUNK: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # program (row b, KV head, tile): BLOCK_M packed query rows r = token * GROUP + g (query head
        # kv_head * GROUP + g) against the row's cache, online softmax over BLOCK_N-key blocks at fixed
        # absolute positions. Packed row r sees keys 0 .. seqlen - n_tokens + token. A block past a
        # row's limit is an exact no-op for it (alpha = 1, p = 0), so its result is the same whatever
        # the tile holds besides it: batch- and width-invariant. With HAS_TREE (a token tree) a tile
        # holds one token's GROUP query heads, and the token sees the cache before the new tokens
        # then, at the positions a chain would give them, the new tokens its bits name (its
        # ancestors and itself, in depth order): key position first_new + j reads the K/V of its
        # ancestor at depth j. So a tree token's attention is the chain's it stands for, term for
        # term in the same order: its logits are bitwise the chain row's, not merely close.
        # With CHUNK > 0 the program covers keys [chunk * CHUNK, (chunk + 1) * CHUNK) only (fixed
        # absolute bounds, whole BLOCK_N blocks) and writes its unnormalised partial (m, l, acc);
        # the last of the tile's chunk programs to finish (an acquire-release count per (row, KV
        # head, tile) after the CTA's stores) merges the chunks' partials in chunk order and writes
        # the output: split-KV whose split points do not depend on the batch, in one launch.
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        tile = tl.program_id(2)
        chunk = 0
        if CHUNK > 0:
            chunk = tile % n_chunks
            tile = tile // n_chunks
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        seqlen = tl.load(seqlen_ptr + b)
        first_new = seqlen - n_tokens  # the position of the first new token
        if HAS_TREE:  # one token a tile (TPT tiles when GROUP > BLOCK_M)
            TPT: tl.constexpr = (GROUP + BLOCK_M - 1) // BLOCK_M
            g = (tile % TPT) * BLOCK_M + tl.arange(0, BLOCK_M)
            tok = tile // TPT + 0 * rows
            live = g < GROUP
            bits = tl.load(tree_ptr + b * n_tokens + tile // TPT)  # int32: the token's ancestors and itself
            depth = 0
            for t in range(0, n_tokens):
                depth += (bits >> t) & 1
            depth -= 1
            last = first_new + depth + 0 * rows  # the chain position the token stands for
            end = first_new + depth + 1
        else:
            g = rows % GROUP
            tok = rows // GROUP
            live = tok < n_tokens
            last = first_new + tok  # the last key each packed row sees
            end = first_new + tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, n_tokens - 1) + 1
        q_rows = (b * n_tokens + tok) * HEADS + kvh * GROUP + g
        d = tl.arange(0, HEAD_DIM)
        qv = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
        k_base = k_ptr + b * k_sb + kvh * k_sh
        v_base = v_ptr + b * k_sb + kvh * k_sh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        lo = 0
        hi = end
        if CHUNK > 0:
            lo = chunk * CHUNK
            hi = tl.minimum(end, lo + CHUNK)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            at = n  # the cache position each key is read from
            if HAS_TREE:  # new-token position first_new + j reads the ancestor at depth j (bit rank j)
                if start + BLOCK_N > first_new:  # a block of the cache alone reads itself
                    rel = n - first_new
                    rank = 0
                    for t in range(0, n_tokens):
                        bit = (bits >> t) & 1
                        at = tl.where((rel == rank) & (bit != 0), first_new + t, at)
                        rank += bit
            kb = tl.load(k_base + at[:, None] * k_sp + d[None, :], mask=n_ok[:, None], other=0.0)
            s = tl.dot(qv, tl.trans(kb)) * scale_log2
            s = tl.where(n[None, :] <= last[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # with a tree or chunks a live row may have seen no key yet (a chunk past its limit): it
            # stays at m = -inf with nothing added, instead of -inf - -inf; a row with a key seen is
            # unchanged by this (the plain kernel keeps the plain step: one select fewer, no spill)
            if HAS_TREE or CHUNK > 0:
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:  # every live row sees key 0 in the first block (dead rows are not stored)
                m_ref = m_new
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(v_base + at[:, None] * k_sp + d[None, :], mask=n_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m_i = m_new
        if CHUNK > 0:  # the partial of (b, kvh, chunk) for each packed row of the tile
            # only the chunks that hold the tile's keys take part: one past them would add an exact
            # zero to the merge (m = -inf, l = 0), so leaving them out keeps every bit
            n_used = tl.cdiv(end, CHUNK)
            used = (rows * 0 + chunk) < n_used  # [BLOCK_M]
            rows_pad = (tl.num_programs(2) // n_chunks) * BLOCK_M  # the launch's tiles x BLOCK_M
            base = (b * tl.num_programs(1) + kvh) * n_chunks
            prow = (base + chunk) * rows_pad + rows
            tl.store(part_ptr + prow[:, None] * HEAD_DIM + d[None, :], acc, mask=used[:, None])
            tl.store(ml_ptr + prow * 2, m_i, mask=used)
            tl.store(ml_ptr + prow * 2 + 1, l_i, mask=used)
            tl.debug_barrier()
            counter = count_ptr + (b * tl.num_programs(1) + kvh) * (tl.num_programs(2) // n_chunks) + tile
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu", mask=chunk < n_used)
            tl.store(counter, 0, mask=(chunk < n_used) & (arrived == n_used - 1))  # ready for the next launch
            tl.debug_barrier()
            merge = used & ((rows * 0 + arrived) == n_used - 1)  # [BLOCK_M]: this program is the tile's last
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for c in range(0, n_used):
                m = tl.maximum(m, tl.load(ml_ptr + ((base + c) * rows_pad + rows) * 2, mask=merge,
                                          other=float("-inf"), cache_modifier=".cg"))
            m_ref = tl.where(m == float("-inf"), 0.0, m)
            l_sum = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            for c in range(0, n_used):
                prow = (base + c) * rows_pad + rows
                w = tl.exp2(tl.load(ml_ptr + prow * 2, mask=merge, other=float("-inf"), cache_modifier=".cg") - m_ref)
                l_sum += tl.load(ml_ptr + prow * 2 + 1, mask=merge, other=0.0, cache_modifier=".cg") * w
                acc += tl.load(part_ptr + prow[:, None] * HEAD_DIM + d[None, :], mask=merge[:, None], other=0.0,
                               cache_modifier=".cg") * w[:, None]
            out = acc / tl.where(merge, l_sum, 1.0)[:, None]
            tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=(live & merge)[:, None])
        else:
            out = acc / l_i[:, None]
            tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=live[:, None])

    return gqa_attention_kernel


def gqa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  seqlens: torch.Tensor, tree_bits: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """Causal attention of each row's new tokens over its KV cache, query heads packed per KV head.

    Args:
        q: ``[B, Q, heads, head_dim]`` (any Q >= 1); token j of row b is at position
            ``seqlens[b] - Q + j``.
        k_cache, v_cache: ``[B, kv_heads, positions, head_dim]``, last dim contiguous, the new
            tokens' K/V already written; ``positions >= max(seqlens)``; every position finite
            (``KVCache`` zero-fills).
        seqlens: ``[B]`` int32, keys each row's last token may see (causal alignment at the end);
            ``seqlens[b] >= Q``.
        tree_bits: token-tree verification: ``[B, Q]`` int32, bit j of ``tree_bits[b, i]`` set =
            new token i may see new token j (itself and its ancestors; j <= i, Q <= 31; bit 0, the
            step's first token, set in every row); the cache before the new tokens is seen by all.
            Token i attends as the last token of a chain of its ancestors and itself at
            consecutive positions would, so its result is bitwise that chain row's; a tree step
            takes one tile per token. None: causal (a chain), which equals bits ``2**(i + 1) - 1``
            bitwise.
        chunk: 0, or split-KV over fixed chunks of this many cache positions (a multiple of
            ``ATTN_BLOCK_N``): one program per (row, KV head, tile, chunk), the last of a tile's
            programs to finish merging the chunks in order (one launch; ``prepare_counters``). More
            programs for few rows or long contexts; the split points are absolute positions, so the
            result stays batch- and width-invariant (but is not bitwise the unsplit kernel's).

    Returns:
        ``[B, Q, heads, head_dim]``, softmax(q k^T / sqrt(head_dim)) v per query head; K/V read once
        per KV head (GQA, Ainslie et al. 2023) for all Q tokens; fp32 accumulation.

    Raises:
        ValueError: ``chunk`` not a multiple of ``ATTN_BLOCK_N``.
        RuntimeError: a split-KV launch captured into a CUDA graph with more (row, KV head, tile)
            triples than ``prepare_counters`` made room for.
    """
    kernel = _attention_kernel()
    B, Q, heads, hd = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    # a chain packs its tokens' query heads into tiles; a tree takes a tile (or more) per token
    tiles = Q * -(-group // ATTN_BLOCK_M) if tree_bits is not None else -(-Q * group // ATTN_BLOCK_M)
    tree = tree_bits.contiguous() if tree_bits is not None else seqlens
    scale = math.log2(math.e) / math.sqrt(hd)
    meta = dict(GROUP=group, HEADS=heads, HEAD_DIM=hd, BLOCK_M=ATTN_BLOCK_M)
    if not chunk:
        kernel[(B, kv_heads, tiles)](q, k_cache, v_cache, seqlens, tree, out, out, out, seqlens, Q, 1, scale,
                                     k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                     HAS_TREE=tree_bits is not None, CHUNK=0, BLOCK_N=ATTN_BLOCK_N, **meta,
                                     num_warps=4, num_stages=ATTN_STAGES)
        return out
    if chunk % ATTN_BLOCK_N:
        raise ValueError(f"attention chunk must be a multiple of {ATTN_BLOCK_N} positions, got {chunk}")
    n_chunks = -(-k_cache.shape[2] // chunk)  # from the cache's size: the same grid for every step
    part = torch.empty((B, kv_heads, n_chunks, tiles * ATTN_BLOCK_M, hd), dtype=torch.float32, device=q.device)
    ml = torch.empty((B, kv_heads, n_chunks, tiles * ATTN_BLOCK_M, 2), dtype=torch.float32, device=q.device)
    counters = _counters(q.device, B * kv_heads * tiles)
    kernel[(B, kv_heads, tiles * n_chunks)](q, k_cache, v_cache, seqlens, tree, out, part, ml, counters, Q, n_chunks,
                                            scale, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                            HAS_TREE=tree_bits is not None, CHUNK=chunk, BLOCK_N=ATTN_BLOCK_N, **meta,
                                            num_warps=4, num_stages=ATTN_STAGES)
    return out


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           seqlens: torch.Tensor, backend: str = "triton",
                           tree_bits: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """Causal attention of new tokens over their rows' KV cache, GQA-aware, no mask tensor.

    Args:
        q: ``[B, Q, heads, head_dim]``; token j of row b is at position ``seqlens[b] - Q + j``.
        k_cache, v_cache: ``[B, kv_heads, positions, head_dim]`` (the K/V of the new tokens already
            written); ``positions >= max(seqlens)``.
        seqlens: ``[B]`` int32, keys each row's last token may see (causal alignment at the end).
        backend: "triton" (``gqa_attention``), "flash" (FlashAttention-2's
            ``flash_attn_with_kvcache`` with ``ATTN_SPLITS`` split-KV chunks) or "flash-heuristic"
            (flash-attn choosing the split count from the batch size: a row's numerics then depend
            on its batch; only for measuring what invariance costs).
        tree_bits: a token tree's visibility (``gqa_attention``); flash-attn has no tree mask, so a
            step with one takes ``gqa_attention`` whatever the backend.
        chunk: ``gqa_attention``'s fixed split-KV chunk (0: none); flash-attn's split is its own.

    Returns:
        ``[B, Q, heads, head_dim]``.

    Raises:
        ValueError: an unknown backend.
    """
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTN_BACKENDS}, got {backend!r}")
    if backend == "triton" or tree_bits is not None:
        return gqa_attention(q, k_cache, v_cache, seqlens, tree_bits, chunk)
    return _flash()(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), cache_seqlens=seqlens, causal=True,
                    num_splits=ATTN_SPLITS if backend == "flash" else 0)


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


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p
