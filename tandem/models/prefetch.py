"""Weights prefetched into the GPU's L2 cache one layer ahead, beside the layer that runs.

A decode or verify step of a small model is latency-bound: each GEMM of a layer reads its weights
(a layer of the bundled 135M model holds 7 MB; an H100's L2 holds 50 MB) from HBM only when it
starts, so every projection waits out a memory round trip per step of its reduction while most of
the chip idles. Here a side stream runs, at the start of layer ``i``, one small kernel that asks
the L2 for every 128-byte line of layer ``i + 1``'s weights (PTX ``prefetch.global.L2``: no
registers, no result, the kernel ends as soon as the requests are issued); by the time layer
``i + 1``'s GEMMs run, their weights come from L2. The idea is PRESERVE's (Yüzügüler et al., 2025,
"PRESERVE: Prefetching Model Weights and KV-Cache in Distributed LLM Serving"), which prefetches
the next layer's weights into L2 on a concurrent stream; here the stream forks and joins inside the
step's CUDA graph, so a replay runs the prefetches in parallel with the layers.

Numerics are untouched (a prefetch moves no data the kernels see), so the batch invariance of the
fused path holds with or without it. ``LayerPrefetcher`` is a no-op off CUDA (CPU, Triton's
interpreter): the L2 is a GPU's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .kernels import _modules

LINE_BYTES = 128  # an L2 line (the unit a prefetch asks for)
PROGRAMS = 64  # programs of a prefetch launch: each issues a share of the lines, 128 a loop step
MAX_TENSORS = 4  # tensors one launch prefetches (a layer's four projection weights)
# Of the LM head (the bundled model's is 57 MB, past the L2), the first rows prefetched beside the
# last layer: about half an H100's L2, which the last layer's own weights leave free.
TAIL_BYTES = 24 << 20

# The kernel's device function, made with it (``_kernel``): a @triton.jit function calls another
# through its module's globals, which is where Triton looks for it.
_prefetch_lines = None


@functools.lru_cache(maxsize=1)
def _kernel():
    global _prefetch_lines
    triton, tl = _modules()

    @triton.jit
    def _prefetch_lines(ptr, nbytes, pid, nprog, BLOCK: tl.constexpr, LINE: tl.constexpr, EVICT_LAST: tl.constexpr):
        # lines pid*BLOCK ... of the byte range [ptr, ptr + nbytes), a stride of nprog*BLOCK lines;
        # a lane past the end re-asks for the last line (a prefetch has no mask)
        nlines = tl.cdiv(nbytes, LINE)
        for start in range(pid * BLOCK, nlines, nprog * BLOCK):
            line = tl.minimum(start + tl.arange(0, BLOCK), nlines - 1).to(tl.int64)
            if EVICT_LAST:  # kept over lines of normal priority (a batch's K/V streaming past)
                tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2::evict_last [$1];", "=r,l",
                                          [ptr + line * LINE], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptr + line * LINE],
                                          dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def l2_prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, COUNT: tl.constexpr, BLOCK: tl.constexpr,
                           LINE: tl.constexpr, EVICT_LAST: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        _prefetch_lines(p0, n0, pid, nprog, BLOCK, LINE, EVICT_LAST)
        if COUNT > 1:
            _prefetch_lines(p1, n1, pid, nprog, BLOCK, LINE, EVICT_LAST)
        if COUNT > 2:
            _prefetch_lines(p2, n2, pid, nprog, BLOCK, LINE, EVICT_LAST)
        if COUNT > 3:
            _prefetch_lines(p3, n3, pid, nprog, BLOCK, LINE, EVICT_LAST)

    return l2_prefetch_kernel


def l2_prefetch(tensors: Sequence[torch.Tensor], programs: int = PROGRAMS, evict_last: bool = False) -> None:
    """Ask the L2 for every line of ``tensors`` (CUDA, contiguous, at most ``MAX_TENSORS``) on the
    current stream, without waiting for the lines: the kernel returns once its requests are issued.
    ``evict_last``: the lines come in at the L2's evict-last priority (PTX ``L2::evict_last``).

    Raises:
        ValueError: more than ``MAX_TENSORS`` tensors, or one not contiguous on a CUDA device.
    """
    if not tensors:
        return
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"one prefetch launch takes at most {MAX_TENSORS} tensors, got {len(tensors)}")
    for t in tensors:
        if t.device.type != "cuda" or not t.is_contiguous():
            raise ValueError(f"l2_prefetch takes contiguous CUDA tensors, got one on {t.device} "
                             f"(contiguous: {t.is_contiguous()})")
    args = []
    for t in tensors:
        args += [t, t.numel() * t.element_size()]
    args += [tensors[0], 0] * (MAX_TENSORS - len(tensors))
    # byte pointers: each tensor's storage seen as uint8, so a line is LINE_BYTES elements away
    args = [a.detach().view(-1).view(torch.uint8) if isinstance(a, torch.Tensor) else a for a in args]
    _kernel()[(programs,)](*args, COUNT=len(tensors), BLOCK=128, LINE=LINE_BYTES, EVICT_LAST=evict_last, num_warps=4)


class LayerPrefetcher:
    """Prefetches each layer's weights into L2 from a side stream while the layer before it runs.

    Call ``begin()`` before the first layer, ``layer(i)`` at the start of layer ``i`` (it prefetches
    layer ``i + 1``, or at the last layer the ``tail``), and ``end()`` after the last: the side stream forks from the current stream at
    each call (so a prefetch never runs ahead of the step that asked for it) and joins it at
    ``end`` (a CUDA-graph capture needs every forked stream joined). With ``enabled`` False, or off
    CUDA, every call does nothing.

    Args:
        layers: per layer, the weight tensors to prefetch (``[[wqkv, wo, w13, w2], ...]``).
        tail: what the step reads after the layers (the LM head's first rows), prefetched beside
            the last layer.
        enabled: prefetch at all.
        programs: programs of each prefetch launch.
        evict_last: prefetch at the L2's evict-last priority.
    """

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], tail: Sequence[torch.Tensor] = (),
                 enabled: bool = True, programs: int = PROGRAMS, evict_last: bool = False) -> None:
        self.layers = [list(ws) for ws in layers] + ([list(tail)] if tail else [])
        self.programs = programs
        self.evict_last = evict_last
        on_cuda = bool(self.layers) and all(w.device.type == "cuda" for ws in self.layers for w in ws)
        self.enabled = enabled and on_cuda and _modules() is not None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._forked = False

    def _side(self) -> torch.cuda.Stream:
        dev = self.layers[0][0].device
        if dev not in self._streams:
            self._streams[dev] = torch.cuda.Stream(dev)
        return self._streams[dev]

    def _fork(self, index: int) -> None:
        if not self.enabled or not 0 <= index < len(self.layers):
            return
        side = self._side()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            l2_prefetch(self.layers[index], self.programs, self.evict_last)
        self._forked = True

    def begin(self) -> None:
        """Prefetch the first layer's weights (forked from the current stream)."""
        self._fork(0)

    def layer(self, index: int) -> None:
        """Layer ``index`` starts: prefetch layer ``index + 1``'s weights beside it."""
        self._fork(index + 1)

    def end(self) -> None:
        """Join the side stream into the current one (after the last layer)."""
        if self._forked:
            torch.cuda.current_stream().wait_stream(self._side())
            self._forked = False
