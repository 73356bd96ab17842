"""A sampled round's Triton kernels (``tandem.sampling_kernels``) against the PyTorch ops they
stand for: counter-based uniforms bit for bit.

Each comparison runs on a GPU (marked ``gpu``) and, where Triton is installed, on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, which the tests' conftest turns on without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tandem import sampling, sampling_kernels
from tandem.sampling import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE


def _plain_uniform(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """``sampling.counter_uniform`` in its PyTorch ops, whatever the device."""
    shape = (-1,) + (1,) * (position.dim() - 1)
    lo = (seed & sampling._MASK32).view(shape)
    hi = ((seed >> 32) & sampling._MASK32).view(shape)
    key = sampling._hash32(sampling._hash32(lo ^ sampling_kernels.stream_key(stream)) ^ hi)
    return (sampling._hash32(key ^ (position & sampling._MASK32)) >> 8).to(torch.float32) * (1.0 / (1 << 24))


@pytest.mark.parametrize("stream", [STREAM_ACCEPT, STREAM_SAMPLE, STREAM_DRAFT])
def test_counter_uniform_kernel_is_the_plain_ops(triton_device, stream):
    """Seeds over the whole range (both 32-bit halves, 0 and 2**63 - 1), positions up to 2**32 - 1,
    shapes [B] and [B, K] (a strided view too), and the result lands where the ops' does."""
    g = torch.Generator().manual_seed(stream)
    seed = torch.cat([torch.tensor([0, 1, 2**32 - 1, 2**32, 2**63 - 1]),
                      torch.randint(0, 2**62, (6,), generator=g) * 2 + torch.randint(0, 2, (6,), generator=g)])
    B = seed.shape[0]
    pos_1d = torch.cat([torch.tensor([0, 1, 2**31, 2**32 - 1]), torch.randint(0, 2**32, (B - 4,), generator=g)])
    pos_2d = torch.randint(0, 2**32, (B, 7), generator=g)
    for pos in (pos_1d, pos_2d, pos_2d[:, ::2], pos_2d[:, :1] + torch.arange(5)[None, :]):
        want = _plain_uniform(seed, pos, stream)
        got = sampling_kernels.counter_uniform(seed.to(triton_device), pos.to(triton_device), stream)
        assert got.shape == pos.shape and got.dtype == torch.float32
        assert torch.equal(got.cpu(), want), (stream, pos.shape)
    assert ((want >= 0) & (want < 1)).all()


def test_counter_uniform_takes_the_kernel_on_cuda_only(monkeypatch):
    """``sampling.counter_uniform`` launches the kernel where a round's kernels run (CUDA), for one
    stream at a time; a tensor of streams, and every CPU, keep the ops (whose numbers it equals)."""
    calls = []
    monkeypatch.setattr(sampling_kernels, "counter_uniform", lambda *a: calls.append(a) or torch.zeros(a[1].shape))
    seed, pos = torch.tensor([3, 4]), torch.tensor([[5, 6], [7, 8]])
    want = _plain_uniform(seed, pos, STREAM_SAMPLE)
    assert torch.equal(sampling.counter_uniform(seed, pos, STREAM_SAMPLE), want) and not calls
    monkeypatch.setattr(sampling, "_round_kernels_on", lambda device: True)
    sampling.counter_uniform(seed, pos, STREAM_SAMPLE)
    assert len(calls) == 1 and calls[0][2] == STREAM_SAMPLE
    streams = torch.arange(2)[:, None]
    assert sampling.counter_uniform(torch.tensor([3]), torch.tensor([5, 6])[None, :], streams).shape == (2, 2)
    assert len(calls) == 1  # several streams at once: the ops


def test_counter_uniform_kernel_refuses_a_row_count_it_cannot_read():
    with pytest.raises(ValueError, match="needs seed's"):
        sampling_kernels.counter_uniform(torch.tensor([1, 2]), torch.tensor([[1, 2, 3]]), STREAM_SAMPLE)
