"""Host-device copies that do not wait for the device: a host tensor moved to the GPU through
pinned memory (``to_device``), and a small device tensor read back through a ring of pinned
buffers and an event (``HostCopy``). A copy from or to pageable memory makes the driver wait for
the stream, i.e. for a round in flight."""

from __future__ import annotations

import torch

from ..profiling import blocking_wait


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device`` without waiting for the device: on CUDA through pinned
    memory with a non-blocking copy (a copy from pageable memory makes the driver wait for the
    stream, i.e. for a round in flight); a plain move elsewhere."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)



class HostCopy:
    """One non-blocking device-to-host copy of a small tensor: into a pinned buffer of ``pinned``
    with an event on CUDA, so the host goes on until ``wait``; a plain read on the CPU. Buffers are
    reused per shape in a ring of ``RING``: rounds are collected in launch order and at most two
    are in flight (chained rounds), so a buffer is read before a copy into it is queued again."""

    RING = 3

    def __init__(self, t: torch.Tensor, pinned: dict[tuple, list]) -> None:
        self.event = None
        if t.device.type == "cuda":
            key = (tuple(t.shape), t.dtype)
            if key not in pinned:
                pinned[key] = [0, [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for _ in range(self.RING)]]
            entry = pinned[key]
            entry[0] = (entry[0] + 1) % self.RING
            self.host = entry[1][entry[0]]
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def wait(self) -> list:
        if self.event is not None:
            with blocking_wait():
                self.event.synchronize()
        return self.host.tolist()
