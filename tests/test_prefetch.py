"""Weights prefetched into L2 a layer ahead (``tandem.models.prefetch``): the setting's checks and
defaults on any machine; on a GPU, the prefetch leaves every logit bit of a step as it was, eager
and from CUDA graphs, and a captured step's side stream is joined."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.errors import ConfigError
from tandem.models import load_checkpoint
from tandem.models.kernels import fused_unavailable_reason
from tandem.models.prefetch import MAX_TENSORS, LayerPrefetcher, l2_prefetch
from tandem.models.runner import ModelRunner, RunnerConfig
from tandem.models.runner_config import WEIGHT_PREFETCH_DEFAULT, resolve_weight_prefetch

FUSED_SHAPE = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, intermediate_size=512)
needs_fused = pytest.mark.skipif(
    not (torch.cuda.is_available() and fused_unavailable_reason(torch.device("cuda"), 64, torch.bfloat16) is None),
    reason="needs CUDA with triton")


def test_weight_prefetch_setting_is_checked_and_resolved(tiny_checkpoint):
    """Asked for where it cannot run (a CPU, the reference path) it is a ConfigError, never ignored;
    unset it follows the default where a fused path runs on CUDA, and is off elsewhere."""
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    with pytest.raises(ConfigError, match="--weight-prefetch needs a fused path on a CUDA GPU"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, weight_prefetch=True))
    runner = ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, weight_prefetch=False))
    assert runner.weight_prefetch is False and runner.model.weight_prefetch is False
    assert ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32)).weight_prefetch is False
    cuda = RunnerConfig(device="cuda")
    assert resolve_weight_prefetch(cuda, "fused") is WEIGHT_PREFETCH_DEFAULT
    assert resolve_weight_prefetch(cuda, "fused-linear") is WEIGHT_PREFETCH_DEFAULT
    assert resolve_weight_prefetch(RunnerConfig(device="cuda", weight_prefetch=True), "fused") is True
    assert resolve_weight_prefetch(RunnerConfig(device="cuda", weight_prefetch=False), "fused") is False
    assert resolve_weight_prefetch(cuda, "reference") is False
    assert resolve_weight_prefetch(RunnerConfig(device="cpu"), "fused") is False  # the interpreter: no L2 to fill


def test_prefetcher_does_nothing_off_cuda_and_the_launcher_checks_its_input():
    """Over CPU tensors a ``LayerPrefetcher`` is off and its calls do nothing; ``l2_prefetch`` takes
    at most ``MAX_TENSORS`` contiguous CUDA tensors and says what it got otherwise."""
    layers = [[torch.zeros(4, 4), torch.zeros(8)] for _ in range(3)]
    pre = LayerPrefetcher(layers)
    assert pre.enabled is False
    pre.begin()
    for i in range(3):
        pre.layer(i)
    pre.end()
    l2_prefetch([])  # nothing to ask for: nothing launched
    with pytest.raises(ValueError, match="contiguous CUDA tensors, got one on cpu"):
        l2_prefetch([torch.zeros(4)])
    with pytest.raises(ValueError, match=f"at most {MAX_TENSORS} tensors"):
        l2_prefetch([torch.zeros(4)] * (MAX_TENSORS + 1))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"contiguous: False"):
            l2_prefetch([torch.zeros(4, 4, device="cuda").t()])


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kernels_path", ["fused", "fused-linear"])
def test_prefetch_leaves_every_logit_bit(tiny_checkpoint, graphs, kernels_path):
    """The same prompts and decode/verify steps with and without the prefetch: bitwise equal
    logits and K/V at every step (a prefetch moves no data the kernels read), from CUDA graphs too
    (the side stream forks and joins inside the capture)."""
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    runners = [ModelRunner(ckpt, RunnerConfig(device="cuda", dtype=torch.bfloat16, max_batch_size=4, max_seq_len=256,
                                              cuda_graphs=graphs, kernels=kernels_path, weight_prefetch=on))
               for on in (False, True)]
    assert [r.weight_prefetch for r in runners] == [False, True]
    rng = random.Random(3)
    vocab = ckpt.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(rng.randint(5, 60))] for s in range(4)}
    for r in runners:
        for _ in range(4):
            r.cache.allocate()
        r.prefill(prompts)
    for _ in range(6):
        app = {s: [rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for s in range(4)}
        off, on = (r.step(app).logits.float().cpu() for r in runners)
        assert torch.equal(off, on)
    for s in range(4):
        n = runners[0].cache.lengths[s]
        assert runners[1].cache.lengths[s] == n
        assert torch.equal(runners[0].cache.k[:, s, :, :n], runners[1].cache.k[:, s, :, :n])
