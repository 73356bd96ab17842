"""Speculative decoding building blocks, without the engine: n-gram lookup, greedy and
speculative-sampling verification, metrics, drafter features, draft checkpoint checks."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import chi_square_pvalue, total_variation

from tandem.drafters import (NUM_FEATURES, DraftRequest, LookupIndex, NgramDrafter, distribution_features,
                             load_draft_checkpoint, truncated_checkpoint)
from tandem.drafters.base import one_hot_features
from tandem.drafters.draft_model import check_compatible
from tandem.metrics import SpecDecodeStats
from tandem.models import ModelLoadError, load_checkpoint
from tandem.sampling import SamplingParams
from tandem.verify import RowSampling, verify_chains


def test_chi_square_helper_sanity():
    p = torch.tensor([0.5, 0.3, 0.2])
    assert chi_square_pvalue([500, 300, 200], p) == pytest.approx(1.0)
    assert chi_square_pvalue([300, 300, 400], p) < 1e-10
    assert chi_square_pvalue([0, 0, 1], torch.tensor([0.5, 0.5, 0.0])) == 0.0
    # chi-square with 2 degrees of freedom: survival function is exp(-x / 2)
    counts = [520, 290, 190]
    stat = sum((o - e) ** 2 / e for o, e in zip(counts, [500, 300, 200]))
    assert chi_square_pvalue(counts, p) == pytest.approx(math.exp(-stat / 2), rel=1e-6)


# ----------------------------------------------------------------------------- n-gram lookup


def _arr(*xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def scan_lookup(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """Reference: a scan of the whole sequence. Continuation of an earlier occurrence of the longest matching suffix: the most recent one
    that still has ``k`` tokens after it, else the earliest (in a loop the most recent match ends
    just before the sequence's end and would propose almost nothing).

    Args:
        tokens: ``[T]`` int64 sequence.
        max_n, min_n: suffix lengths to try, longest first.
        k: tokens to propose at most.

    Returns:
        Up to k token ids (empty when no suffix of length >= min_n recurs).
    """
    T = len(tokens)
    for n in range(min(max_n, T - 1), min_n - 1, -1):
        suffix = tokens[T - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:T - 1], n)  # starts 0..T-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < T]  # a continuation must exist
        if hits.size:
            full = hits[hits + n + k <= T]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


def ngram_lookup(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """The drafter's incremental index over ``tokens`` (the code under test)."""
    index = LookupIndex(max_n, min_n)
    index.extend(tokens.tolist())
    return index.lookup(k)[0]


def test_ngram_longest_match_wins():
    # suffix [1, 2, 3]: the 3-gram occurs at 0 (-> 7); the 1-gram [3] occurs later at 6 (-> 9)
    toks = _arr(1, 2, 3, 7, 8, 5, 3, 9, 1, 2, 3)
    assert ngram_lookup(toks, max_n=3, min_n=1, k=2) == [7, 8]
    assert ngram_lookup(toks, max_n=1, min_n=1, k=2) == [9, 1]  # only 1-grams: the most recent [3]


def test_ngram_most_recent_occurrence():
    toks = _arr(4, 5, 10, 4, 5, 11, 4, 5, 12, 4, 5)
    assert ngram_lookup(toks, max_n=2, min_n=2, k=1) == [12]
    assert ngram_lookup(toks, max_n=2, min_n=1, k=3) == [12, 4, 5]


def test_ngram_no_match_is_empty():
    assert ngram_lookup(_arr(1, 2, 3, 4, 5), max_n=4, min_n=1, k=4) == []
    # the 1-gram [5] recurs, but min_n = 2 forbids using it
    assert ngram_lookup(_arr(5, 6, 7, 5), max_n=3, min_n=2, k=4) == []
    assert ngram_lookup(_arr(5, 6, 7, 5), max_n=3, min_n=1, k=4) == [6, 7, 5]


def test_ngram_k_cap_and_end_of_sequence():
    toks = _arr(1, 2, 3, 4, 5, 6, 1)
    assert ngram_lookup(toks, max_n=4, min_n=1, k=3) == [2, 3, 4]
    assert ngram_lookup(toks, max_n=4, min_n=1, k=1) == [2]
    assert ngram_lookup(toks, max_n=4, min_n=1, k=100) == [2, 3, 4, 5, 6, 1]
    # the continuation of the most recent match runs into the end of the sequence: fewer than k
    assert ngram_lookup(_arr(1, 1, 1, 1), max_n=3, min_n=1, k=4) == [1]


def test_ngram_sequences_shorter_than_the_window():
    assert ngram_lookup(_arr(7), max_n=4, min_n=1, k=4) == []
    assert ngram_lookup(_arr(7, 7), max_n=4, min_n=1, k=4) == [7]
    assert ngram_lookup(_arr(7, 8), max_n=4, min_n=1, k=4) == []
    assert ngram_lookup(_arr(7, 8, 7), max_n=4, min_n=3, k=4) == []


def test_ngram_drafter_requests():
    d = NgramDrafter(max_n=3, min_n=1)
    sp = SamplingParams()
    reqs = [DraftRequest(0, [1, 2, 3, 1], 2, sp), DraftRequest(1, [1, 2, 3, 1], 0, sp),
            DraftRequest(2, [9], 4, sp), DraftRequest(3, [1, 2, 3], 4, sp)]
    props = d.propose(reqs)
    assert [p.tokens for p in props] == [[2, 3], [], [], []]
    assert all(p.probs is None for p in props)
    for p in props:
        assert p.features.shape == (len(p.tokens), NUM_FEATURES)
    # the evidence: one earlier occurrence of "1", continuing 2 3: each draft's share 1 / (1 + 1)
    torch.testing.assert_close(props[0].features, torch.tensor([[0.6931, 0.5, 0.0, 1], [0.6931, 0.5, 0.0, 2]]),
                               atol=1e-4, rtol=0)
    with pytest.raises(ValueError):
        NgramDrafter(max_n=2, min_n=3)
    with pytest.raises(ValueError):
        NgramDrafter(max_n=2, min_n=0)


# ----------------------------------------------------------------------------- greedy verification


def _rows(n: int, greedy: bool | list[bool] = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
          seed0: int = 0) -> RowSampling:
    g = torch.tensor([greedy] * n if isinstance(greedy, bool) else greedy)
    return RowSampling(g, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p),
                       torch.arange(seed0, seed0 + n), any_sampled=not bool(g.all()),
                       filtered=top_k > 0 or top_p < 1)


def _one_hot_logits(argmax_rows: list[list[int]], vocab: int) -> torch.Tensor:
    logits = torch.full((len(argmax_rows), len(argmax_rows[0]), vocab), -10.0)
    for b, row in enumerate(argmax_rows):
        for pos, tok in enumerate(row):
            logits[b, pos, tok] = 10.0
    return logits


def _emitted(res, b: int) -> list[int]:
    return res.tokens[b, :int(res.num_accepted[b]) + 1].tolist()


def test_verify_chains_greedy():
    """Longest prefix equal to the argmax, then the argmax (bonus or correction); ragged lengths."""
    argmax = [[5, 6, 7, 8], [5, 9, 7, 8], [4, 6, 7, 8], [3, 1, 1, 1], [5, 6, 2, 2]]
    logits = _one_hot_logits(argmax, 10)
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [0, 0, 0], [5, 6, 7]])
    lens = torch.tensor([3, 3, 3, 0, 2])
    res = verify_chains(logits, logits.argmax(-1), drafts, lens, torch.zeros(5, dtype=torch.long), _rows(5))
    assert res.num_accepted.tolist() == [3, 1, 0, 0, 2]
    assert [_emitted(res, b) for b in range(5)] == [[5, 6, 7, 8], [5, 9], [4], [3], [5, 6, 2]]


def test_verify_chains_rows_and_mixed_params():
    """Each row follows its own settings; sampling that can only pick the argmax (top-k 1) agrees
    with greedy rows beside it."""
    logits = _one_hot_logits([[1, 2, 3, 4], [5, 5, 0, 0]], 6)
    drafts, lens = torch.tensor([[1, 2, 0], [5, 0, 0]]), torch.tensor([3, 2])
    for greedy in ([True, False], [False, True]):
        sampling = _rows(2, greedy, temperature=1.0, top_k=1)
        res = verify_chains(logits, logits.argmax(-1), drafts, lens, torch.tensor([7, 3]), sampling)
        assert _emitted(res, 0) == [1, 2, 3] and _emitted(res, 1) == [5, 5]


P = torch.tensor([0.05, 0.40, 0.00, 0.25, 0.20, 0.10])  # target at the first position
P_NEXT = torch.tensor([0.30, 0.05, 0.15, 0.00, 0.10, 0.40])  # target at the second position
Q = torch.tensor([0.30, 0.10, 0.25, 0.05, 0.20, 0.10])  # draft (puts mass where p has none)
Q_NEXT = torch.tensor([0.10, 0.10, 0.10, 0.40, 0.10, 0.20])
TRIALS = 50_000


def _sampled_batch(n: int, drafts: torch.Tensor, q: torch.Tensor | None):
    target = torch.stack([P, P_NEXT, Q])[:drafts.shape[1] + 1].log()[None].expand(n, -1, -1)
    lens = torch.full((n,), drafts.shape[1])
    return verify_chains(target, target.argmax(-1), drafts, lens, torch.zeros(n, dtype=torch.long),
                         _rows(n, False), None if q is None else q[None].expand(n, -1, -1))


def _check(counts, probs, what):
    pv = chi_square_pvalue(counts, probs)
    assert pv > 1e-4, f"{what}: p-value {pv:.2e}, TV {total_variation(counts, probs):.3f}, counts {counts.tolist()}"


def test_verify_chains_sampling_with_draft_probs_emits_target_distribution():
    g = torch.Generator().manual_seed(0)
    qs = torch.stack([Q, Q_NEXT])
    drafts = torch.stack([torch.multinomial(qs[i], TRIALS, replacement=True, generator=g) for i in range(2)], 1)
    res = _sampled_batch(TRIALS, drafts, qs)
    first = torch.bincount(res.tokens[:, 0], minlength=6)
    _check(first, P, "first token")
    ok = res.num_accepted >= 1
    _check(torch.bincount(res.tokens[ok, 1], minlength=6), P_NEXT, "second token given the first draft accepted")
    alpha = float(torch.minimum(P, Q).sum())  # P(first draft accepted) = sum_x min(p(x), q(x))
    assert abs(float(ok.double().mean()) - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / TRIALS)
    assert first[2] == 0  # p(2) = 0: never emitted, although the draft proposes it a quarter of the time


@pytest.mark.parametrize("draft_token", [1, 2, 5])  # likely, impossible (p = 0), unlikely under p
def test_verify_chains_one_hot_draft_emits_target_distribution(draft_token):
    res = _sampled_batch(TRIALS, torch.full((TRIALS, 1), draft_token), None)
    _check(torch.bincount(res.tokens[:, 0], minlength=6), P, f"first token with the deterministic draft {draft_token}")
    rate = float((res.num_accepted == 1).double().mean())
    assert abs(rate - float(P[draft_token])) < 4 * math.sqrt(0.25 / TRIALS) + 1e-9


def test_verify_chains_sampling_exact_cases():
    one_hot = torch.nn.functional.one_hot(torch.tensor([3, 1, 4]), 6).float()
    logits = (one_hot.clamp_min(1e-30).log())[None].expand(50, -1, -1)
    zeros = torch.zeros(50, dtype=torch.long)

    def run(drafts, q=None):
        d = torch.tensor(drafts)[None].expand(50, -1)
        return verify_chains(logits, logits.argmax(-1), d, torch.full((50,), 2), zeros, _rows(50, False),
                             None if q is None else q[None].expand(50, -1, -1))

    res = run([3, 1])  # p one-hot on the draft: always accepted, then the bonus from row 2
    assert res.num_accepted.tolist() == [2] * 50 and (res.tokens == torch.tensor([3, 1, 4])).all()
    res = run([3, 2])  # p(2) = 0 at the second position: rejected, corrected to p's only token
    assert res.num_accepted.tolist() == [1] * 50 and (res.tokens[:, :2] == torch.tensor([3, 1])).all()
    assert run([3, 1], one_hot[:2]).num_accepted.tolist() == [2] * 50  # p == q: always accepted


# ----------------------------------------------------------------------------- metrics


def test_spec_decode_stats_record():
    st = SpecDecodeStats()
    assert st.mean_accepted_length == 1.0 and math.isnan(st.acceptance_rate)
    st.record(drafted=4, accepted=2, emitted=3)
    st.record(drafted=2, accepted=2, emitted=3)
    st.record(drafted=0, accepted=0, emitted=1)
    assert (st.num_steps, st.num_emitted, st.num_drafted, st.num_accepted) == (3, 7, 6, 4)
    assert st.drafted_per_pos == [2, 2, 1, 1]
    assert st.accepted_per_pos == [2, 2, 0, 0]
    assert st.acceptance_per_pos == [1.0, 1.0, 0.0, 0.0]
    assert st.acceptance_rate == pytest.approx(4 / 6)
    assert st.mean_accepted_length == pytest.approx(7 / 3)
    d = st.to_dict()
    assert d["num_steps"] == 3 and d["mean_accepted_length"] == pytest.approx(7 / 3)
    assert d["acceptance_per_pos"] == [1.0, 1.0, 0.0, 0.0]


def test_spec_decode_stats_merge():
    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.record(2, 1, 2)
    b.record(4, 3, 4)
    b.record(1, 0, 1)
    total = SpecDecodeStats()
    total.merge(a)
    total.merge(b)
    assert (total.num_steps, total.num_emitted, total.num_drafted, total.num_accepted) == (3, 7, 7, 4)
    assert total.drafted_per_pos == [3, 2, 1, 1]
    assert total.accepted_per_pos == [2, 1, 1, 0]
    # merging in the other order (shorter into longer) gives the same counters
    other = SpecDecodeStats()
    other.merge(b)
    other.merge(a)
    assert other == total
    # merging an empty record changes nothing; a no-speculation run has tau = 1
    total.merge(SpecDecodeStats())
    assert total.num_steps == 3
    plain = SpecDecodeStats()
    for _ in range(5):
        plain.record(0, 0, 1)
    assert plain.mean_accepted_length == 1.0 and math.isnan(plain.acceptance_rate)
    assert plain.acceptance_per_pos == []


# ----------------------------------------------------------------------------- features


def test_distribution_features_values():
    vocab = 8
    uniform = torch.full((1, vocab), 1 / vocab)
    one_hot = torch.nn.functional.one_hot(torch.tensor([3]), vocab).float()
    two = torch.tensor([[0.7, 0.2, 0.1, 0, 0, 0, 0, 0]])
    f = distribution_features(torch.cat([uniform, one_hot, two]), start_position=2)
    assert f.shape == (3, NUM_FEATURES) and f.dtype == torch.float32
    torch.testing.assert_close(f[0], torch.tensor([math.log(vocab), 1 / vocab, 0.0, 2.0]))
    torch.testing.assert_close(f[1], torch.tensor([0.0, 1.0, 1.0, 3.0]))
    h = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    torch.testing.assert_close(f[2], torch.tensor([h, 0.7, 0.5, 4.0]))
    assert distribution_features(torch.zeros(0, vocab)).shape == (0, NUM_FEATURES)
    # a one-token vocabulary has no second choice: margin = top-1
    torch.testing.assert_close(distribution_features(torch.ones(2, 1)),
                               torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 2.0]]))


def test_one_hot_features_match_distribution_features():
    n, vocab = 3, 5
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 4, 2]), vocab).float()
    torch.testing.assert_close(one_hot_features(n), distribution_features(one_hot))
    assert one_hot_features(0).shape == (0, NUM_FEATURES)


# ----------------------------------------------------------------------------- draft checkpoints


def test_truncated_checkpoint(tiny_checkpoint):
    ck = load_checkpoint(tiny_checkpoint("llama"))
    assert ck.config.num_layers == 2
    for bad in (0, -1, 2, 3):
        with pytest.raises(ModelLoadError, match="1..1 layers"):
            truncated_checkpoint(ck, bad)
    t = truncated_checkpoint(ck, 1)
    assert t.config.num_layers == 1 and t.config.vocab_size == ck.config.vocab_size
    assert not any(k.startswith("layers.1.") for k in t.tensors)
    assert all(t.tensors[k] is ck.tensors[k] for k in t.tensors)  # shared, not copied
    assert {k for k in ck.tensors if not k.startswith("layers.1.")} == set(t.tensors)
    assert load_draft_checkpoint("truncate:1", ck).config.num_layers == 1
    for spec in ("truncate:x", "truncate:", "truncate:1.5"):
        with pytest.raises(ModelLoadError, match="truncate:N"):
            load_draft_checkpoint(spec, ck)
    with pytest.raises(ModelLoadError):
        load_draft_checkpoint("truncate:2", ck)


def test_check_compatible(tiny_checkpoint, small_vocab_checkpoint, tmp_path):
    small = load_checkpoint(tiny_checkpoint("llama"))  # vocab TINY_VOCAB
    other = load_checkpoint(tiny_checkpoint("llama", seed=1))
    check_compatible(other, small)  # same vocabulary and special ids
    mismatch = small_vocab_checkpoint()  # vocab SMALL_VOCAB
    with pytest.raises(ModelLoadError, match="vocabulary"):
        check_compatible(load_checkpoint(mismatch), small)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        load_draft_checkpoint(str(mismatch), small)
    assert load_draft_checkpoint(str(tiny_checkpoint("llama", seed=1)), small).config.vocab_size == 1000
    eos = replace(other, config=replace(other.config, eos_token_ids=(5,)))
    base = replace(small, config=replace(small.config, eos_token_ids=(7,)))
    with pytest.raises(ModelLoadError, match="EOS"):
        check_compatible(eos, base)
    bos = replace(other, config=replace(other.config, bos_token_id=1))
    with pytest.raises(ModelLoadError, match="BOS"):
        check_compatible(bos, replace(small, config=replace(small.config, bos_token_id=2)))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_draft_checkpoint(str(tmp_path / "missing"), small)


def test_ngram_in_a_loop_proposes_a_full_draft():
    # the most recent match of [17, 17] ends at the sequence's end; an earlier one has k tokens after it
    toks = _arr(3, 17, 17, 17, 17, 17, 17)
    assert ngram_lookup(toks, max_n=2, min_n=1, k=3) == [17, 17, 17]


def test_ngram_index_equals_full_scan():
    """The drafter's incremental index answers exactly what a scan of the whole sequence answers,
    for every prefix of random low-entropy sequences (many repeats) and every k."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        seq = rng.integers(0, 1 + trial % 6, size=int(rng.integers(2, 80))).tolist()
        max_n, min_n = int(rng.integers(1, 5)), 1
        min_n = int(rng.integers(1, max_n + 1))
        index = LookupIndex(max_n, min_n)
        for t in range(len(seq)):
            index.extend([seq[t]])
            if t + 1 < 2:
                continue
            for k in (1, 3, 8):
                assert index.lookup(k)[0] == scan_lookup(np.asarray(seq[:t + 1]), max_n, min_n, k), (seq[:t + 1], k)


def test_ngram_drafter_rebuilds_for_a_reused_slot():
    from tandem.drafters.base import DraftRequest
    from tandem.sampling import SamplingParams

    d = NgramDrafter(max_n=3, min_n=1)
    ask = lambda toks: d.propose([DraftRequest(0, toks, 3, SamplingParams(), None)])[0].tokens  # noqa: E731
    assert ask([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert ask([1, 2, 3, 1, 2, 3]) == [1, 2, 3]  # extended in place
    assert ask([7, 8, 9, 7]) == [8, 9, 7]  # another sequence in the same slot: index rebuilt
    d.release(0)
    assert ask([5, 5]) == [5]


def test_extreme_sampling_settings_stay_finite():
    """A temperature below SAMPLING_EPS decodes greedily (a float32 division by it would overflow
    to NaN probabilities), and a top_p that rounds to 0 in float32 still keeps the most likely token."""
    from tandem.sampling import SAMPLING_EPS, sampling_probs

    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=SAMPLING_EPS / 2).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = sampling_probs(logits, torch.full((3,), SAMPLING_EPS), torch.tensor([0, 5, 0]), torch.tensor([1e-50, 1e-50, 1.0]))
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(3))
    assert (p[:2].argmax(-1) == logits[:2].argmax(-1)).all() and ((p[:2] > 0).sum(-1) == 1).all()
    for bad in (dict(temperature=True), dict(top_p=True)):
        with pytest.raises(Exception, match="must be"):
            SamplingParams(**bad)


def test_request_generator_is_the_one_per_request_stream():
    """``request_generator``: none for greedy requests; a seeded request's generator repeats its
    draws; the drafter's stream for the same seed is another one (its draws must not reuse the
    verifier's)."""
    from tandem.sampling import SamplingParams, request_generator

    assert request_generator(SamplingParams(), "cpu") is None
    params = SamplingParams(temperature=1.0, seed=7)
    draw = lambda g: torch.rand(8, generator=g).tolist()  # noqa: E731
    assert draw(request_generator(params, "cpu")) == draw(request_generator(params, "cpu"))
    assert draw(request_generator(params, "cpu", drafter=True)) == draw(request_generator(params, "cpu", drafter=True))
    assert draw(request_generator(params, "cpu")) != draw(request_generator(params, "cpu", drafter=True))


def test_counter_uniform_several_streams_in_one_call():
    """A tensor of streams gives, row by row, exactly the numbers of one call per stream (what
    the host tree verifier relies on), for several seeds and positions."""
    from tandem.sampling import counter_uniform

    seed = torch.tensor([0, 7, 2**40 + 3], dtype=torch.int64)
    pos = torch.arange(12, dtype=torch.int64).view(1, 12).expand(3, 12)
    each = torch.stack([counter_uniform(seed, pos, s) for s in range(5)], dim=1)  # [3, 5, 12]
    together = counter_uniform(seed, pos[:, None, :], torch.arange(5)[None, :, None])
    assert torch.equal(together, each) and len(set(each.flatten().tolist())) > 150
