"""Programmatic dependent launch of our decode/verify kernels (``RunnerConfig.pdl``): the setting
is checked and resolved on any machine; on a Hopper GPU the dependent launches leave every logit
and K/V bit of a step as it was, eager and from CUDA graphs."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.errors import ConfigError
from tandem.models import load_checkpoint
from tandem.models.kernels import fused_unavailable_reason
from tandem.models.runner import ModelRunner, RunnerConfig
from tandem.models.runner_config import PDL_DEFAULT, pdl_unavailable_reason, resolve_pdl

FUSED_SHAPE = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, intermediate_size=512)
needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and fused_unavailable_reason(torch.device("cuda"), 64, torch.bfloat16) is None
         and torch.cuda.get_device_capability()[0] >= 9),
    reason="needs CUDA with triton on a GPU of compute capability 9.0+")


def test_pdl_setting_is_checked_and_resolved(tiny_checkpoint):
    """Asked for where it cannot run it is a ConfigError saying why, never ignored; unset it follows
    ``PDL_DEFAULT`` where it can run and is off elsewhere."""
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    with pytest.raises(ConfigError, match="--pdl cannot run here: the reference path launches none of our kernels"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, pdl=True))
    runner = ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, pdl=False))
    assert runner.pdl is False and runner.model.pdl is False
    assert ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32)).pdl is False
    assert "CUDA launch attribute; the device is cpu" in pdl_unavailable_reason(RunnerConfig(device="cpu"), "fused")
    assert resolve_pdl(RunnerConfig(device="cpu"), "fused") is False  # the interpreter: no launch attributes
    assert resolve_pdl(RunnerConfig(device="cpu", pdl=True), "reference") is False
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert resolve_pdl(RunnerConfig(device="cuda"), "fused") is (PDL_DEFAULT and hopper)
        assert resolve_pdl(RunnerConfig(device="cuda", pdl=True), "fused-linear") is hopper
        assert resolve_pdl(RunnerConfig(device="cuda", pdl=False), "fused-linear") is False


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kernels_path", ["fused", "fused-linear"])
def test_dependent_launches_leave_every_bit(tiny_checkpoint, graphs, kernels_path):
    """The same prompts and decode/verify steps with and without dependent launches: bitwise equal
    logits and K/V at every step (each kernel waits for the one before it before reading)."""
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    runners = [ModelRunner(ckpt, RunnerConfig(device="cuda", dtype=torch.bfloat16, max_batch_size=4, max_seq_len=256,
                                              cuda_graphs=graphs, kernels=kernels_path, pdl=on))
               for on in (False, True)]
    assert [r.pdl for r in runners] == [False, True]
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
        for name in ("k", "v"):
            assert torch.equal(getattr(runners[0].cache, name)[:, s, :, :n], getattr(runners[1].cache, name)[:, s, :, :n])
