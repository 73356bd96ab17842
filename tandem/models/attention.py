"""Attention of decode and verify steps over the per-slot KV cache (Triton), and its entry point.

Our own GQA-packed kernel (``gqa_attention``): one program per (row, KV head) holds the query rows of *all* the row's new tokens and of all the query
heads that share that KV head (``Q x group`` rows, packed in tiles of 16), so every K/V block is
read once per KV head whatever the number of tokens verified, with the causal limit of each packed
row applied in registers (no mask tensor). FlashAttention-2's ``flash_attn_with_kvcache`` (Dao
2023) folds the query heads of a KV head only for one new token; for 2 .. 16 it reads the cache
once per query head, which made verifying 2 tokens at batch 64 cost 1.8x a decode step. flash-attn
(``tandem[flash-attn]``) still runs the prefill where it is importable, and can be chosen for
decode/verify too (``RunnerConfig.kernels = "fused-flash"``) with a fixed split count
(``ATTN_SPLITS``): its own heuristic picks the split count from the batch size.

Split-KV (``chunk``): one program per (row, KV head, tile, chunk of cache positions); the last of a
tile's programs to finish merges the chunks in chunk order in the same launch, counting arrivals
in a buffer the runner makes before any CUDA-graph capture (``prepare_counters``). Token trees:
a tile per token, which reads its ancestors at the positions its chain would give them, so a
tree row is bitwise the chain row it stands for.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

from .kernels import _modules

log = logging.getLogger(__name__)

ATTN_SPLITS = 1  # flash-attn split-KV chunks: fixed, so a row's attention does not depend on the batch
FLASH_HEAD_DIMS = (64,)  # head sizes the bundled flash-attn build was compiled for
ATTN_BACKENDS = ("triton", "flash", "flash-heuristic")  # decode/verify attention (``attention_with_kvcache``)
ATTN_BLOCK_M = 16  # packed query rows (token x query head) per tile: the smallest tensor-core tile
ATTN_BLOCK_N = 64  # keys per step of the attention loop
ATTN_STAGES = 2  # software-pipelining stages of the attention loop (Triton's num_stages)
ATTN_WARPS = 4  # warps a program (a 16-row tile of packed queries against 64-key blocks)
MAX_NEW = 16  # new tokens a row of ``gqa_attention_rope`` (a decode or verify step: ``MAX_FUSED_TOKENS``)


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


@functools.lru_cache(maxsize=1)
def _flash_varlen():
    """flash-attn's ``flash_attn_varlen_func``, or None when it is not importable."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:
        log.info("flash-attn varlen unavailable (prefills stay padded): %s", exc)
        return None
    return flash_attn_varlen_func


def varlen_available(head_dim: int) -> bool:
    """Whether flash-attn's variable-length kernel is importable here and built for ``head_dim``."""
    return head_dim in FLASH_HEAD_DIMS and _flash_varlen() is not None


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int) -> torch.Tensor:
    """Causal self-attention of packed sequences (a varlen prefill): sequence i is tokens
    ``cu_seqlens[i] : cu_seqlens[i + 1]`` and attends only to itself, GQA without expanding K/V.

    FlashAttention-2's ``flash_attn_varlen_func`` (Dao 2023) where it is importable: its forward
    kernel for more than one query token per sequence never splits the keys, so a sequence's result
    does not depend on the others packed with it. Elsewhere (a CPU) the reference: one causal
    ``scaled_dot_product_attention`` per sequence (it reads ``cu_seqlens`` on the host).

    Args:
        q: ``[T, heads, head_dim]``; k, v: ``[T, kv_heads, head_dim]`` (last dim contiguous).
        cu_seqlens: ``[S + 1]`` int32, ascending, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] <= T``
            (tokens past it are not attended and their output is undefined).
        max_len: a bound on every sequence's length (flash-attn sizes its grid by it).

    Returns:
        ``[T, heads, head_dim]``.
    """
    fn = _flash_varlen() if q.is_cuda else None
    if fn is not None:
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=True)
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds, bounds[1:]):
        if hi > lo:
            out[lo:hi] = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1),
                is_causal=True, enable_gqa=True).transpose(0, 1)
    return out


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


_rope_rows = None  # the kernel's RoPE device function, made with it (a jit function calls another through module globals)


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
                               f"attention.prepare_counters({key}, {needed}) was not called before the capture")
        return prepare_counters(key, needed)
    return have


@functools.lru_cache(maxsize=1)
def _attention_kernel():
    global _rope_rows
    triton, tl = _modules()

    @triton.jit
    def _rope_rows(src, cos_ptr, sin_ptr, pos, ok, HEAD_DIM: tl.constexpr):
        # rows src[i, :HEAD_DIM] (pointers [R, 1] to each row's head) rotated at positions pos [R]
        # (rotate-half RoPE), rounded to the storage dtype: the RoPE kernel's arithmetic, term for term
        half: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HEAD_DIM)
        x = tl.load(src + d[None, :], mask=ok[:, None], other=0.0)
        xp = tl.load(src + ((d + half) % HEAD_DIM)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        at = pos.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
        cs = tl.load(cos_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        return tl.where(d[None, :] < half, xf * cs - xp * sn, xf * cs + xp * sn).to(x.dtype)

    @triton.jit(do_not_specialize=["n_tokens", "n_chunks", "qlen_stride"])
    def gqa_attention_kernel(q_ptr, k_ptr, v_ptr, seqlen_ptr, tree_ptr, out_ptr, part_ptr, ml_ptr, count_ptr,
                             cos_ptr, sin_ptr, qlen_ptr, qlen_stride, n_tokens, n_chunks, scale_log2, k_sb, k_sh, k_sp, qkv_stride,
                             max_pos, GROUP: tl.constexpr, HEADS: tl.constexpr,
                             HEAD_DIM: tl.constexpr, HAS_TREE: tl.constexpr, CHUNK: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, NEW: tl.constexpr):
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
        # With ROPE (a chain step) q_ptr is the fused QKV projection's output and the kernel does
        # the RoPE + K/V-write kernel's work too: each program rotates its queries in registers and
        # writes the real new tokens of its key range (rotated the same way; ``qlen_ptr``: each
        # row's real token count) into the cache before its loop reads them there.
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
        k_base = k_ptr + b * k_sb + kvh * k_sh
        v_base = v_ptr + b * k_sb + kvh * k_sh
        if ROPE:
            n_kv = tl.num_programs(1)
            src = q_ptr + (b * n_tokens + tok)[:, None] * qkv_stride + (kvh * GROUP + g)[:, None] * HEAD_DIM
            qv = _rope_rows(src, cos_ptr, sin_ptr, tl.minimum(first_new + tok, max_pos - 1), live, HEAD_DIM)
            # the real new tokens whose positions this program reads, into the cache before it reads
            # them (every program over a chunk writes the same bits there; a CTA barrier makes its
            # own writes visible to all its threads): the loop below then reads the cache alone
            jt = tl.arange(0, NEW)
            wpos = first_new + jt
            wlo = 0
            whi = seqlen
            if CHUNK > 0:
                wlo = chunk * CHUNK
                whi = wlo + CHUNK
            wm = (jt < tl.load(qlen_ptr + b * qlen_stride)) & (jt < n_tokens) & (wpos >= wlo) & (wpos < whi)
            row = (b * n_tokens + jt)[:, None] * qkv_stride
            kn = _rope_rows(q_ptr + row + (HEADS + kvh) * HEAD_DIM, cos_ptr, sin_ptr,
                            tl.minimum(wpos, max_pos - 1), wm, HEAD_DIM)
            vn = tl.load(q_ptr + row + (HEADS + n_kv + kvh) * HEAD_DIM + d[None, :], mask=wm[:, None], other=0.0)
            tl.store(k_base + wpos[:, None] * k_sp + d[None, :], kn, mask=wm[:, None])
            tl.store(v_base + wpos[:, None] * k_sp + d[None, :], vn, mask=wm[:, None])
            tl.debug_barrier()
        else:
            qv = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
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
                  seqlens: torch.Tensor, tree_bits: torch.Tensor | None = None, chunk: int = 0,
                  warps: int | None = None) -> torch.Tensor:
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
        warps: warps a program (default ``ATTN_WARPS``; another count may move a result's last
            bits, the same way for every row: for timing).

    Returns:
        ``[B, Q, heads, head_dim]``, softmax(q k^T / sqrt(head_dim)) v per query head; K/V read once
        per KV head (GQA, Ainslie et al. 2023) for all Q tokens; fp32 accumulation.

    Raises:
        ValueError: ``chunk`` not a multiple of ``ATTN_BLOCK_N``.
        RuntimeError: a split-KV launch captured into a CUDA graph with more (row, KV head, tile)
            triples than ``prepare_counters`` made room for.
    """
    B, Q, heads, hd = q.shape
    return _launch(q.contiguous(), None, k_cache, v_cache, seqlens, heads, Q, tree_bits, chunk, warps)


def gqa_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_lens: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor, heads: int,
                       chunk: int = 0, warps: int | None = None) -> torch.Tensor:
    """``gqa_attention`` of a chain step straight from the fused QKV projection, with the RoPE +
    K/V-write kernel's work done inside (``kernels.rope_kv_write_spans``): one launch a layer
    instead of two. Each program rotates its queries in registers and, before its loop, writes the
    real new tokens of its key range into the cache at ``seqlens - Q + j`` (keys rotated as that
    kernel rotates them, term for term; every program over a chunk writes the same bits, a CTA
    barrier makes them visible to the program's own threads), so the loop reads the cache alone,
    block for block as ``gqa_attention`` does: a row's result is the two kernels' and stays batch-
    and width-invariant.

    Args:
        qkv: ``[B, Q, (heads + 2 * kv_heads) * head_dim]`` (Q <= ``MAX_NEW``); token j of row b is
            at position ``seqlens[b] - Q + j`` and rotated at ``min(that, len(cos) - 1)``.
        cos, sin: ``[max_positions, head_dim]`` rotate-half RoPE tables.
        q_lens: ``[B]`` int64 real tokens of each row, any stride (a column of a step's packed inputs
            is read in place; the rest of a row is padding: not written, and seen
            only by padded queries, whose output is ignored).
        k_cache, v_cache, seqlens, chunk, warps: as ``gqa_attention``.
        heads: query heads.

    Returns:
        ``[B, Q, heads, head_dim]``.

    Raises:
        ValueError: Q over ``MAX_NEW``; ``chunk`` not a multiple of ``ATTN_BLOCK_N``.
    """
    Q = qkv.shape[1]
    if Q > MAX_NEW:
        raise ValueError(f"gqa_attention_rope takes at most {MAX_NEW} tokens a row, got {Q}")
    return _launch(qkv.contiguous(), (cos, sin, q_lens), k_cache, v_cache, seqlens, heads, Q, None,
                   chunk, warps)


def _launch(q: torch.Tensor, rope: tuple | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
            seqlens: torch.Tensor, heads: int, Q: int, tree_bits: torch.Tensor | None, chunk: int,
            warps: int | None) -> torch.Tensor:
    """The attention kernel's launch for ``gqa_attention`` (``q`` the rotated queries) and
    ``gqa_attention_rope`` (``q`` the QKV projection, ``rope`` its tables and real token counts)."""
    kernel = _attention_kernel()
    B = q.shape[0]
    hd = k_cache.shape[-1]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty((B, Q, heads, hd), dtype=q.dtype, device=q.device)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    # a chain packs its tokens' query heads into tiles; a tree takes a tile (or more) per token
    tiles = Q * -(-group // ATTN_BLOCK_M) if tree_bits is not None else -(-Q * group // ATTN_BLOCK_M)
    tree = tree_bits.contiguous() if tree_bits is not None else seqlens
    scale = math.log2(math.e) / math.sqrt(hd)
    cos, sin, q_lens = rope if rope is not None else (q, q, seqlens)
    qlens = (q_lens, q_lens.stride(0))  # read in place: a step's q_lens is a column of its packed inputs
    meta = dict(GROUP=group, HEADS=heads, HEAD_DIM=hd, BLOCK_M=ATTN_BLOCK_M, ROPE=rope is not None, NEW=MAX_NEW,
                num_warps=warps or ATTN_WARPS, num_stages=ATTN_STAGES)
    tail = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q.shape[-1], cos.shape[0])
    if not chunk:
        kernel[(B, kv_heads, tiles)](q, k_cache, v_cache, seqlens, tree, out, out, out, seqlens, cos, sin, *qlens, Q,
                                     1, scale, *tail, HAS_TREE=tree_bits is not None, CHUNK=0,
                                     BLOCK_N=ATTN_BLOCK_N, **meta)
        return out
    if chunk % ATTN_BLOCK_N:
        raise ValueError(f"attention chunk must be a multiple of {ATTN_BLOCK_N} positions, got {chunk}")
    n_chunks = -(-k_cache.shape[2] // chunk)  # from the cache's size: the same grid for every step
    part = torch.empty((B, kv_heads, n_chunks, tiles * ATTN_BLOCK_M, hd), dtype=torch.float32, device=q.device)
    ml = torch.empty((B, kv_heads, n_chunks, tiles * ATTN_BLOCK_M, 2), dtype=torch.float32, device=q.device)
    counters = _counters(q.device, B * kv_heads * tiles)
    kernel[(B, kv_heads, tiles * n_chunks)](q, k_cache, v_cache, seqlens, tree, out, part, ml, counters, cos, sin,
                                            *qlens, Q, n_chunks, scale, *tail, HAS_TREE=tree_bits is not None,
                                            CHUNK=chunk, BLOCK_N=ATTN_BLOCK_N, **meta)
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
