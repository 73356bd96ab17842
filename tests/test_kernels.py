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
from tandem.models.kernels import MAX_FUSED_TOKENS, flash_available, fused_unavailable_reason, gqa_attention
from tandem.models.runner import ModelRunner, RunnerConfig

# head_dim 64 with 3 query heads per KV head, as the bundled SmolLM2 (the flash-attn build's shape)
FUSED_SHAPE = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, intermediate_size=512)


def _fused_ready() -> bool:
    return torch.cuda.is_available() and fused_unavailable_reason(torch.device("cuda"), 64, torch.bfloat16) is None


needs_fused = pytest.mark.skipif(not _fused_ready(), reason="needs CUDA with triton")
# the fused kernels with our attention, and with flash-attn's (where it is importable)
FUSED_PATHS = ["fused", pytest.param("fused-flash", marks=pytest.mark.skipif(
    not (_fused_ready() and flash_available(64)), reason="needs flash-attn"))]


def test_kernel_choice_on_cpu(tiny_checkpoint):
    """A CPU runner takes the reference path under "auto", refuses "fused" with the reason, and
    refuses an unknown choice."""
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    runner = ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32))
    assert runner.kernels == "reference" and runner.attention_backend == "sdpa-masked"
    with pytest.raises(ConfigError, match="not a CUDA device"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, kernels="fused"))
    with pytest.raises(ConfigError, match="not a CUDA device"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, kernels="fused-flash"))
    with pytest.raises(ConfigError, match="kernels must be one of"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, kernels="fast"))


def _runner(ckpt, kernels: str, slots: int, graphs: bool = False, taps: tuple[int, ...] = (),
            dtype: torch.dtype = torch.bfloat16) -> ModelRunner:
    return ModelRunner(ckpt, RunnerConfig(device="cuda", dtype=dtype, max_batch_size=slots, max_seq_len=512,
                                          cuda_graphs=graphs, kernels=kernels, taps=taps))


def _rel_err(x: torch.Tensor, exact: torch.Tensor) -> float:
    return ((x.float() - exact.float()).norm() / exact.float().norm()).item()


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("q_len", [1, 2, 5, 16, 70])
def test_gqa_attention_matches_float32_attention(q_len):
    """The GQA-packed attention kernel against float32 attention over expanded K/V with a causal
    mask aligned at each row's end: ragged lengths (one row as short as its new tokens), 3 query
    heads per KV head, decode (1 token), verify (2 ... 16) and a prefill-sized step (70). Stale
    positions past a row's length hold large values, which must not leak into the result."""
    gen = torch.Generator(device="cuda").manual_seed(q_len)
    B, heads, kv_heads, hd, positions = 5, 6, 2, 64, 600

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    seqlens = torch.tensor([q_len, q_len + 1, 64 + q_len, 333, 600], device="cuda", dtype=torch.int32)
    q = randn(B, q_len, heads, hd).bfloat16()
    k, v = randn(B, kv_heads, positions, hd).bfloat16(), randn(B, kv_heads, positions, hd).bfloat16()
    for b, n in enumerate(seqlens.tolist()):
        k[b, :, n:], v[b, :, n:] = 1e4, -1e4
    got = gqa_attention(q, k, v, seqlens).float()
    g = heads // kv_heads
    keys = torch.arange(positions, device="cuda")
    pos = seqlens[:, None].long() - q_len + torch.arange(q_len, device="cuda")[None, :]  # [B, Q]
    mask = keys[None, None, :] <= pos[:, :, None]  # [B, Q, L]
    qf = q.float().transpose(1, 2)  # [B, heads, Q, hd]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask[:, None]).transpose(1, 2)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < 2e-2, err  # bf16 inputs and P, fp32 accumulation
    bf16_ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
        attn_mask=mask[:, None]).transpose(1, 2).float()
    assert err <= max(1.5 * (bf16_ref - want).abs().max().item(), 1e-3)


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("kernels", FUSED_PATHS)
def test_fused_forward_is_as_accurate_as_the_reference(tiny_checkpoint, kernels):
    """Against a float32 forward, the fused kernels' logits, tapped states and cache contents are
    as accurate as the bf16 reference forward's (relative error at most 1.5x the reference's; the
    random tiny model's bf16 logits are ~7% off float32 on either path): a wide prefill (padded rows), then ragged verify steps (idle rows, a rollback
    between steps). bf16 rounds differently in the two bf16 paths, so they are compared through
    the exact result rather than with each other."""
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    taps = (0, 1, 2)
    exact, ref, fused = (_runner(ckpt, "reference", 4, taps=taps, dtype=torch.float32),
                         _runner(ckpt, "reference", 4, taps=taps), _runner(ckpt, kernels, 4, taps=taps))
    attention = {"fused": "triton-gqa", "fused-flash": "flash-attn"}[kernels]
    assert fused.kernels == kernels and fused.attention_backend == attention and ref.kernels == "reference"
    rng = random.Random(0)
    vocab = ckpt.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((37, 5, 300))}
    runners = (exact, ref, fused)
    for r in runners:
        for s in prompts:
            r.cache.allocate()
        r.prefill(prompts)

    def check(want, ref_out, got, what):
        e_ref, e_fused = _rel_err(ref_out, want), _rel_err(got, want)
        assert e_fused <= max(1.5 * e_ref, 1e-3), (what, e_ref, e_fused)

    for step in range(4):
        app = {s: [rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for s in prompts if rng.random() < 0.8}
        app = app or {0: [1]}
        outs = [r.step(app) for r in runners]
        for s, toks in app.items():
            n = len(toks)
            check(*(o.logits[s, :n] for o in outs), ("logits", step, s))
            check(*(o.taps[s, :n] for o in outs), ("taps", step, s))
        s = next(iter(app))
        for r in runners:  # roll one slot back: its next step overwrites the dropped positions
            r.cache.truncate(s, r.cache.lengths[s] - len(app[s]) + 1)
    for s in prompts:
        n = exact.cache.lengths[s]
        assert ref.cache.lengths[s] == fused.cache.lengths[s] == n
        for name in ("k", "v"):
            check(*(getattr(r.cache, name)[:, s, :, :n] for r in runners), (name, s))


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kernels", FUSED_PATHS)
def test_fused_rows_are_batch_and_width_invariant(tiny_checkpoint, graphs, kernels):
    """One row (the same context, the same tokens) verified alone or among 2 ... 128 rows, at any
    slot of the batch, with 1 ... 8 tokens: the logits of its common positions are bitwise equal.
    Every slot holds the same prompt, so any slot can carry the row; other rows get random tokens
    and widths; each step is rolled back."""
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    runner = _runner(ckpt, kernels, 128, graphs=graphs)
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


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("probs", [False, True])
def test_draft_features_kernel_matches_the_plain_definition(probs):
    """``draft_features`` (one pass over the vocabulary per row: entropy, top-1, top-1 - top-2,
    position) gives ``device_features`` of the same distribution: peaked, flat, tied and masked
    rows, bf16 logits or float32 probabilities, a vocabulary that is not a multiple of the block."""
    from tandem.drafters.base import device_features
    from tandem.models.kernels import draft_features

    torch.manual_seed(0)
    R, V = 67, 49152 + 13
    logits = torch.randn(R, V, device="cuda") * torch.linspace(0.1, 12.0, R, device="cuda")[:, None]
    logits[3] = 0.0  # flat
    logits[4, :2] = 30.0  # a tie at the top
    logits[5, 100:] = float("-inf")  # a filtered row
    pos = torch.arange(R, device="cuda", dtype=torch.float32) % 6 + 1
    if probs:
        x = logits.float().softmax(-1)
        want = device_features(x, pos)
    else:
        x = logits.to(torch.bfloat16)
        want = device_features(x.float().softmax(-1), pos)
    got = draft_features(x, pos, probs=probs)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert got[4, 2].abs() < 1e-6  # tied top candidates: margin 0
