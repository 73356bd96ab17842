"""The fused decode/verify kernels (``tandem.models.kernels``) on a GPU: they match the reference
forward within bf16 tolerance, and a row's logits are bitwise identical whatever batch it runs in,
wherever it sits in the batch and however many tokens it verifies (batch- and width-invariance:
what makes greedy speculative output equal target-only output in the fast mode).

The CPU test checks what runs everywhere: the choice of path and its errors."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.errors import ConfigError
from tandem.models import load_checkpoint
from tandem.models.kernels import MAX_FUSED_TOKENS, fused_unavailable_reason
from tandem.models.runner import ModelRunner, RunnerConfig

# head_dim 64 with 3 query heads per KV head, as the bundled SmolLM2 (the flash-attn build's shape)
FUSED_SHAPE = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, intermediate_size=512)


def _fused_ready() -> bool:
    return torch.cuda.is_available() and fused_unavailable_reason(torch.device("cuda"), 64, torch.bfloat16) is None


needs_fused = pytest.mark.skipif(not _fused_ready(), reason="needs CUDA with triton and flash-attn")


def test_kernel_choice_on_cpu(tiny_checkpoint):
    """A CPU runner takes the reference path under "auto", refuses "fused" with the reason, and
    refuses an unknown choice."""
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    runner = ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32))
    assert runner.kernels == "reference" and runner.attention_backend == "sdpa-masked"
    with pytest.raises(ConfigError, match="not a CUDA device"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, kernels="fused"))
    with pytest.raises(ConfigError, match="kernels must be one of"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, kernels="fast"))


def _runner(ckpt, kernels: str, slots: int, graphs: bool = False, taps: tuple[int, ...] = ()) -> ModelRunner:
    return ModelRunner(ckpt, RunnerConfig(device="cuda", dtype=torch.bfloat16, max_batch_size=slots,
                                          max_seq_len=512, cuda_graphs=graphs, kernels=kernels, taps=taps))


@pytest.mark.gpu
@needs_fused
def test_fused_forward_matches_reference(tiny_checkpoint):
    """Ragged verify steps through the fused kernels give the reference forward's logits, tapped
    states and cache contents within bf16 tolerance (padded rows, idle rows, several steps with a
    rollback between them)."""
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    ref, fused = _runner(ckpt, "reference", 4, taps=(0, 1, 2)), _runner(ckpt, "fused", 4, taps=(0, 1, 2))
    assert fused.kernels == "fused" and fused.attention_backend == "flash-attn"
    rng = random.Random(0)
    vocab = ckpt.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((37, 5, 300))}
    for r in (ref, fused):
        for s in prompts:
            r.cache.allocate()
        r.prefill(prompts)
    for step in range(4):
        app = {s: [rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for s in prompts if rng.random() < 0.8}
        app = app or {0: [1]}
        outs = [r.step(app) for r in (ref, fused)]
        for s, toks in app.items():
            want, got = (o.logits[s, :len(toks)].float() for o in outs)
            scale = want.abs().max().item()
            assert (want - got).abs().max().item() <= 0.02 * scale + 0.05, (step, s)
            wt, gt = (o.taps[s, :len(toks)].float() for o in outs)
            assert (wt - gt).abs().max().item() <= 0.02 * wt.abs().max().item() + 0.05
        for r in (ref, fused):  # roll one slot back: its next step overwrites the dropped positions
            s = next(iter(app))
            r.cache.truncate(s, r.cache.lengths[s] - len(app[s]) + 1)
    for s in prompts:
        n = ref.cache.lengths[s]
        assert fused.cache.lengths[s] == n
        for a, b in ((ref.cache.k, fused.cache.k), (ref.cache.v, fused.cache.v)):
            x, y = a[:, s, :, :n].float(), b[:, s, :, :n].float()
            assert (x - y).abs().max().item() <= 0.02 * x.abs().max().item() + 0.02


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_fused_rows_are_batch_and_width_invariant(tiny_checkpoint, graphs):
    """One row (the same context, the same tokens) verified alone or among 2 ... 128 rows, at any
    slot of the batch, with 1 ... 8 tokens: the logits of its common positions are bitwise equal.
    Every slot holds the same prompt, so any slot can carry the row; other rows get random tokens
    and widths; each step is rolled back."""
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    runner = _runner(ckpt, "fused", 128, graphs=graphs)
    rng = random.Random(1)
    vocab = ckpt.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(150)]
    for _ in range(128):
        runner.cache.allocate()
    runner.prefill({s: prompt for s in range(128)})
    row = [rng.randrange(vocab) for _ in range(8)]
    reference = None
    for batch in (1, 2, 7, 16, 64, 128):
        for width in (1, 3, 5, 8):
            slot = rng.randrange(batch)
            app = {s: [rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for s in range(batch)
                   if rng.random() < 0.9}
            app[slot] = row[:width]
            logits = runner.step(app).logits[slot, :width].float().cpu()
            for s, toks in app.items():
                runner.cache.truncate(s, len(prompt))
            if reference is None or width > reference.shape[0]:
                if reference is not None:
                    assert torch.equal(logits[:reference.shape[0]], reference), (batch, width, slot)
                reference = logits
            else:
                assert torch.equal(logits, reference[:width]), (batch, width, slot)
    assert reference.shape[0] == 8 <= MAX_FUSED_TOKENS
