"""A greedy round's verification, round-state update and packed results as one Triton kernel
(``tandem.verify_kernel``): bit for bit what ``verify_chains``, ``RoundState.advance`` and the
pack of plain ops give, for any accepted prefix, idle rows, non-chain rows and widths; chosen by
default on CUDA for all-greedy rounds only; and engines whose rounds verify through it emit what
they emit without it (target-only, n-gram, SpecFormer, greedy and sampled requests mixed).

Each comparison runs on a GPU (marked ``gpu``) and, where Triton is installed, on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, which the tests' conftest turns on without a GPU).
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem import target as target_mod
from tandem import verify_kernel
from tandem.models import kernels
from tandem.round_state import RoundState, SlotSampling
from tandem.sampling import SamplingParams
from tandem.verify import verify_chains


def _state(n: int, capacity: int, device, g: torch.Generator) -> RoundState:
    s = RoundState(n + 1, capacity, device)
    s.history.copy_(torch.randint(0, 50, s.history.shape, generator=g))
    s.length.copy_(torch.randint(0, capacity, s.length.shape, generator=g))
    s.last.copy_(torch.randint(0, 50, s.last.shape, generator=g))
    return s


def _clone(s: RoundState) -> RoundState:
    c = RoundState(s.length.shape[0], s.capacity, s.length.device)
    for name in ("history", "length", "last", "room_end"):
        getattr(c, name).copy_(getattr(s, name))
    return c


def test_kernel_equals_the_plain_ops(triton_device):
    """Accepted counts, emitted tokens, packed rows and the round state after the update are the
    plain ops' for random rounds: every accepted prefix length, rows that ran nothing (q_len 0),
    rows off the chain path, widths 1 .. 9, input rows wider than the step (tree columns)."""
    device = triton_device
    rng = random.Random(0)
    for case in range(60):
        g = torch.Generator().manual_seed(case)
        n, Q, capacity = rng.randint(1, 7), rng.randint(1, 9), 40
        K = Q - 1
        extra = rng.choice([0, 0, 3])
        inputs = torch.zeros((n, 2 + Q + extra), dtype=torch.int64)
        argmax = torch.randint(0, 6, (n, Q), generator=g)
        for r in range(n):
            q_len = rng.choice([0, rng.randint(1, Q)])
            inputs[r, 0] = rng.randint(0, capacity - Q - 1)
            inputs[r, 1] = q_len
            inputs[r, 2] = rng.randint(0, 49)
            agree = rng.randint(0, K)  # drafts equal to the argmax up to here, then random
            other = torch.randint(0, 6, (K,), generator=g)
            inputs[r, 3:3 + K] = torch.where(torch.arange(K) < agree, argmax[r, :K], other)
        chain = torch.rand(n, generator=g) < 0.8
        inputs, argmax, chain = inputs.to(device), argmax.to(device), chain.to(device)
        state = _state(n, capacity, device, g)
        plain_state = _clone(state)
        sampling = SlotSampling(n + 1, device, 64).rows(n, flags=(False, False, False))
        draft_lens = (inputs[:, 1] - 1).clamp_min(0) * chain
        want = verify_chains(torch.zeros(n, Q, 2, device=device), argmax, inputs[:, 3:2 + Q], draft_lens,
                             inputs[:, 0] + 1, sampling)
        plain_state.advance(inputs[:, :2], chain, want.num_accepted, want.tokens)
        want_packed = torch.cat([inputs[:, :2], want.num_accepted[:, None], want.tokens], dim=1)
        got, packed = verify_kernel.greedy_round(argmax, inputs, chain, state)
        assert torch.equal(got.num_accepted, want.num_accepted), case
        assert torch.equal(got.tokens, want.tokens), case
        assert torch.equal(packed, want_packed), case
        assert torch.equal(state.length, plain_state.length) and torch.equal(state.last, plain_state.last), case
        # (the plain update scatters the tokens it does not keep into the scratch column)
        assert torch.equal(state.history[:, :capacity + 1], plain_state.history[:, :capacity + 1]), case


def test_only_greedy_rounds_on_cuda_take_the_kernel(monkeypatch):
    """The kernel is the default for a round with no sampled row, no logit adjustment and no
    grammar mask, on CUDA only; asking for it where it cannot run says where it can."""
    import dataclasses

    monkeypatch.setattr(kernels, "_modules", lambda: object())  # Triton imports (as on a GPU host)
    greedy = SlotSampling(4, torch.device("cpu"), 8).rows(2, flags=(False, False, False))
    sampled = SlotSampling(4, torch.device("cpu"), 8).rows(2, flags=(True, False, False))
    masked = dataclasses.replace(greedy, allowed=torch.ones(2, 1, 8, dtype=torch.bool))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert target_mod._greedy_on_kernel(greedy, cuda)
    assert not target_mod._greedy_on_kernel(greedy, cpu)
    assert not target_mod._greedy_on_kernel(sampled, cuda) and not target_mod._greedy_on_kernel(masked, cuda)
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA with Triton, or TRITON_INTERPRET=1"):
        verify_kernel.greedy_round(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64),
                                   torch.ones(1, dtype=torch.bool), RoundState(1, 8, torch.device("cpu")))


# ----------------------------------------------------------------------- engines on the kernel


@pytest.fixture
def kernel_everywhere(round_kernels_everywhere):
    """Greedy rounds verify through the kernel on this CPU too (the interpreter), as on a GPU; its calls."""
    return round_kernels_everywhere["verify"]


@pytest.mark.parametrize("drafter", ["none", "ngram", "specformer"])
def test_engines_verifying_on_the_kernel_emit_what_they_emit_without_it(target_dir, word_dir, kernel_everywhere,
                                                                        monkeypatch, drafter):
    """Chained rounds whose greedy verification runs through the kernel: the same tokens, text and
    finish reasons as the plain ops, greedy and sampled requests in one batch (a round with a
    sampled row takes the plain path), stop strings and token limits inside accepted runs; the
    drafters read the kernel's accepted counts and tokens (SpecFormer drafts from them)."""
    from test_chained import PROMPTS, WORD_PROMPTS, _engine, _specformer_engine

    def make():
        if drafter == "specformer":
            return _specformer_engine(target_dir, chained=True)
        return _engine(word_dir if drafter == "ngram" else target_dir, chained=True, drafter=drafter)

    prompts = WORD_PROMPTS[:5] if drafter == "ngram" else PROMPTS[:5]
    params = [SamplingParams(max_tokens=18, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True),
              SamplingParams(max_tokens=14, stop=["w7" if drafter == "ngram" else "e"], ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True)]
    engine = make()
    got = [(c.token_ids, c.text, c.finish_reason) for c in engine.generate(prompts, params)]
    assert kernel_everywhere
    monkeypatch.setattr(target_mod, "_greedy_on_kernel", lambda sampling, device: False)
    plain = make()
    assert [(c.token_ids, c.text, c.finish_reason) for c in plain.generate(prompts, params)] == got
    assert engine.stats.num_accepted == plain.stats.num_accepted
    assert engine.stats.num_drafted == plain.stats.num_drafted
