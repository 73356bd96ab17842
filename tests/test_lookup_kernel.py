"""The batch lookup as one Triton kernel (``tandem.drafters.lookup_kernel``): the same continuation,
match length and evidence as the plain-ops form, bit for bit, for every n-gram range, width, room
and row length; chosen by default on CUDA only; and chained n-gram and SpecFormer rounds that
look up through it emit what they emit without it.

Each comparison runs on a GPU (marked ``gpu``) and, where Triton is installed, on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, which the tests' conftest turns on without a GPU).
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.drafters import lookup, lookup_kernel
from tandem.drafters.lookup import lookup_drafts, lookup_drafts_with_support
from tandem.models import kernels
from tandem.sampling import SamplingParams

from helpers import record_calls


def _cases(rng: random.Random, device: torch.device, n: int):
    """Random batches over small vocabularies (recurring n-grams), rows of 1 .. C tokens in a view
    of a wider history (as chained rounds pass ``history[:n, :attn_len]``)."""
    for _ in range(n):
        B, C, k = rng.randint(1, 7), rng.randint(1, 300), rng.randint(0, 8)
        max_n = rng.randint(1, 4)
        min_n = rng.randint(1, max_n)
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        wide = torch.randint(0, rng.choice([2, 3, 5, 40]), (B + 1, C + 2), generator=g).to(device)
        history = wide[:B, :C]
        last = torch.tensor([rng.choice([0, C - 1, rng.randint(0, C - 1)]) for _ in range(B)], device=device)
        room = torch.tensor([rng.randint(0, k) for _ in range(B)], device=device)
        yield history, last, room, k, max_n, min_n


def test_kernel_equals_the_plain_ops(triton_device):
    """``lookup_drafts`` and ``lookup_drafts_with_support`` through the kernel equal their plain-ops
    form exactly (continuation, length, match, support, survivors), rows of one token, rows at the
    end of their history, room 0 and width 0 included."""
    device = triton_device
    rng = random.Random(0)
    for history, last, room, k, max_n, min_n in _cases(rng, device, 80 if device.type == "cuda" else 40):
        args = (history, last, room, k, max_n, min_n)
        plain = lookup_drafts(*args, kernel=False)
        fused = lookup_drafts(*args, kernel=True)
        for name, a, b in zip(("cont", "lens", "match"), plain, fused):
            assert torch.equal(a, b), (name, args)
        plain = lookup_drafts_with_support(*args, kernel=False)
        fused = lookup_drafts_with_support(*args, kernel=True)
        for name, a, b in zip(("cont", "lens", "match", "support", "survivors"), plain, fused):
            assert torch.equal(a, b), (name, args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lookups_take_the_kernel_by_default(monkeypatch):
    """On CUDA with Triton ``lookup_drafts`` launches the kernel unless told not to."""
    if kernels._modules() is None:
        pytest.skip("needs triton")
    calls = record_calls(monkeypatch, lookup_kernel, "ngram_lookup")
    history = torch.randint(0, 3, (4, 64), device="cuda")
    last = torch.full((4,), 60, device="cuda")
    lookup_drafts(history, last, torch.full_like(last, 4), 4)
    lookup_drafts(history, last, torch.full_like(last, 4), 4, kernel=False)
    assert calls == [1]


def test_cpu_lookups_take_the_plain_ops_and_a_kernel_asked_for_where_it_cannot_run_is_an_error(monkeypatch):
    """On a CPU the default is the plain ops (the interpreter is for tests); asking for the kernel
    where it does not run says where it does."""
    calls = []
    monkeypatch.setattr(lookup_kernel, "ngram_lookup", lambda *a, **kw: calls.append(1))
    history = torch.randint(0, 3, (2, 16))
    last = torch.tensor([15, 9])
    cont, lens, match = lookup_drafts(history, last, torch.full_like(last, 3), 3)
    assert not calls and cont.shape == (2, 3)
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA with Triton, or TRITON_INTERPRET=1"):
        lookup_drafts(history, last, torch.full_like(last, 3), 3, kernel=True)


# ------------------------------------------------------------------- chained rounds on the kernel


@pytest.fixture
def kernel_everywhere(round_kernels_everywhere):
    """Device lookups through the kernel on this CPU too (the interpreter), as on a GPU; its calls."""
    return round_kernels_everywhere["lookup"]


@pytest.mark.parametrize("policy", [False, True])
def test_chained_ngram_rounds_through_the_kernel(word_dir, kernel_everywhere, policy):
    """Chained n-gram rounds (with a context-aware policy: the drafts' evidence from the same
    launch) emit the tokens the host-driven path emits, drafting as much."""
    from test_chained import WORD_PROMPTS, _engine

    from tandem.control import DraftPolicy, entropy_score

    prompts, params = WORD_PROMPTS[:4], SamplingParams(max_tokens=20, ignore_eos=True)
    host = _engine(word_dir, chained=False, drafter="ngram")
    want = [c.token_ids for c in host.generate(prompts, params)]
    engine = _engine(word_dir, chained=True, drafter="ngram")
    if policy:  # θ 0: every draft kept
        engine.draft_policy = DraftPolicy(entropy_score, acceptance_threshold=0.0, device_score=entropy_score)
        engine.drafter.set_acceptance_scorer(entropy_score, 4)
    assert [c.token_ids for c in engine.generate(prompts, params)] == want
    assert engine.stats.num_accepted > 0 and kernel_everywhere
    assert engine.stats.num_drafted == host.stats.num_drafted


def test_chained_specformer_rounds_through_the_kernel(target_dir, kernel_everywhere, monkeypatch):
    """The SpecFormer head's lookup input comes from the kernel in chained rounds: the same tokens
    and drafts as with the plain ops."""
    from test_chained import PROMPTS, _specformer_engine

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = _specformer_engine(target_dir, chained=True)
    got = [c.token_ids for c in engine.generate(PROMPTS[:3], params)]
    assert kernel_everywhere
    kernel_everywhere.clear()
    monkeypatch.setattr(lookup, "_on_kernel", lambda history, kernel: False)
    plain = _specformer_engine(target_dir, chained=True)
    assert [c.token_ids for c in plain.generate(PROMPTS[:3], params)] == got
    assert not kernel_everywhere and engine.stats.num_drafted == plain.stats.num_drafted
    assert engine.stats.num_accepted == plain.stats.num_accepted


def test_the_op_count_script_counts_the_plain_lookup():
    """``scripts/count_round_ops.py --lookup`` (the figure docs/benchmarks.md cites for what the
    kernel replaces) runs and counts the plain lookup's operations."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "count_round_ops.py"
    res = subprocess.run([sys.executable, str(script), "--lookup"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "lookup_drafts in plain ops: 61 operations" in res.stdout
    assert "lookup_drafts_with_support in plain ops: 101 operations" in res.stdout
