"""CUDA-graph shapes and capture: the batch and context buckets that keep the number of graphs
small, and ``CapturedCall``, one function replayed from a captured graph."""

from __future__ import annotations

import torch

CONTEXT_BUCKET = 256  # attended context is rounded up to this many positions in graphs


def context_bucket(attn_len: int, capacity: int) -> int:
    """``attn_len`` rounded up to a multiple of ``CONTEXT_BUCKET``, at most ``capacity``: attention
    then sees one shape per bucket (one CUDA graph, one cuDNN plan) instead of one per length."""
    return min(capacity, -(-attn_len // CONTEXT_BUCKET) * CONTEXT_BUCKET)


def batch_bucket(n: int, limit: int) -> int:
    """Round a batch up to a power of two (at most ``limit``) so few graphs cover all sizes."""
    b = 1
    while b < n:
        b *= 2
    return min(b, limit)


class CapturedCall:
    """``fn(*inputs)`` over static input buffers, replayed from a CUDA graph.

    Fill ``inputs`` in place, then call: the graph replays and returns ``fn``'s output tensors,
    which the next call overwrites (copy what must outlive it). Construction runs ``fn`` twice on
    a side stream (warm-up, with the buffers' current contents: fill them first when ``fn``
    writes state, so those runs write real values), then captures it (a capture executes
    nothing: ``out`` holds results only after the first call). With
    ``capture=False`` (CPU, tests) each call simply runs ``fn(*inputs)`` eagerly.

    Args:
        fn: a function of device tensors with no host synchronisation.
        inputs: its static input buffers.
        capture: capture a CUDA graph (CUDA only).
        pool: graph memory pool shared with other captures (``torch.cuda.graph_pool_handle()``).
        warmup: eager runs before the capture (0 when ``fn`` updates state and already ran once).
        stream: the stream to warm up and capture on (default: a pool stream to warm up, the
            capture on torch's one capture stream). A graph's cuBLAS calls keep the workspace of
            the stream it was captured on: graphs replayed at the same time on two streams must
            be captured on two streams (``ModelRunner.admission_stream``).
        label: what the graph is, for ``CapturedCall.labels`` (e.g. ``round b64 q5 ctx768``).
    """

    def __init__(self, fn, inputs: tuple, capture: bool = True, pool=None, warmup: int = 2,
                 stream: torch.cuda.Stream | None = None, label: str = "") -> None:
        self.fn, self.inputs, self.graph, self.out = fn, inputs, None, None
        if not capture:
            return
        CapturedCall.made += 1
        CapturedCall.labels.append(label or getattr(fn, "__name__", "graph"))
        side = stream or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.out = fn(*inputs)

    replays = 0  # CUDA-graph launches by every CapturedCall (a per-round figure for benches)
    made = 0  # CUDA graphs captured (eager calls, capture=False, not counted): a bench checks none is made while it times
    labels: list[str] = []  # each captured graph's label, in capture order (``made`` of them): which shapes a pass met

    def __call__(self):
        if self.graph is None:
            return self.fn(*self.inputs)
        CapturedCall.replays += 1
        self.graph.replay()
        return self.out
