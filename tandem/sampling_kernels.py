"""A sampled round's per-row work in Triton kernels: counter-based uniforms in one launch.

``tandem.sampling.counter_uniform`` in PyTorch ops is four 32-bit integer hashes of int64 tensors,
each multiply in 16-bit halves so that no product overflows: about 115 element-wise launches a
call, ~1 µs each on an H100 whatever the size, and a sampled round calls it two or three times
(the accept tests, the token drawn after them, a device drafter's drafts). Measured on an H100
(2026-12-07, docs/benchmarks.md, "Sampled decoding"), that took a target-only sampled step from
254 to 455 GPU operations. Here the same arithmetic, operation for operation on int64 lanes, is
one launch, so its numbers are the PyTorch ops' bit for bit (``tests/test_sampling_kernels.py``,
on the GPU and under Triton's interpreter).
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


def stream_key(stream: int) -> int:
    """The 32-bit constant a stream mixes into the seed (``sampling.counter_uniform``'s)."""
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
