"""Cost model, batch-wide draft allocation (optimality by brute force) and the online τ controller."""

import itertools
import math
import random

import pytest

from tandem.control import (CostModel, DraftPolicy, RandomLengthPolicy, WidthPlan,
                            allocate_draft_lengths, best_width, entropy_score, expected_emitted, threshold_cut)
from tandem.threshold import ThresholdController


def linear_cost(base=1.0, per_token=0.25, per_row=0.01, draft_step_ms=0.0):
    """T(b, q) = base + per_row*b + per_token*b*(q-1): verification cost grows with tokens."""
    table = {b: {q: base + per_row * b + per_token * b * (q - 1) for q in range(1, 10)} for b in (1, 2, 4, 8)}
    return CostModel(table, draft_step_ms)


def test_expected_emitted_counts_bonus_and_survival():
    assert expected_emitted([0.5, 0.5], 0) == 1.0
    assert expected_emitted([0.5, 0.5], 1) == pytest.approx(1.5)
    assert expected_emitted([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_emitted([1.0] * 4, 4) == 5.0


def test_threshold_cut_per_token_and_cumulative():
    p = [0.9, 0.8, 0.3, 0.9]
    assert threshold_cut(p, 0.5) == 2
    assert threshold_cut(p, 0.0) == 4
    assert threshold_cut(p, 0.95) == 0
    assert threshold_cut(p, 0.7, cumulative=True) == 2  # 0.9, 0.72, 0.216
    assert threshold_cut(p, 0.75, cumulative=True) == 1


def test_cost_model_interpolates_batch_and_tokens():
    cm = CostModel({1: {1: 1.0, 3: 2.0}, 4: {1: 2.0, 3: 4.0}})
    assert cm.verify_ms(1, 2) == pytest.approx(1.5)
    assert cm.verify_ms(2, 1) == pytest.approx(1 + 1 / 3)
    assert cm.verify_ms(8, 3) == 4.0  # clamped to the largest measured batch
    assert cm.verify_ms(1, 5) == pytest.approx(3.0)  # extrapolated with the last slope
    with pytest.raises(ValueError):
        CostModel({})


def brute_force(probs, cost, acceptance_threshold, budget=None):
    caps = [threshold_cut(p, acceptance_threshold) for p in probs]
    best = -1.0
    for lengths in itertools.product(*[range(c + 1) for c in caps]):
        if budget is not None and sum(lengths) > budget:
            continue
        tokens = sum(expected_emitted(p, n) for p, n in zip(probs, lengths))
        best = max(best, tokens / cost.round_ms(len(probs), max(lengths)))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_allocation_is_optimal_on_small_random_batches(seed):
    rng = random.Random(seed)
    b = rng.randint(1, 4)
    probs = [[rng.random() ** 0.5 for _ in range(rng.randint(0, 4))] for _ in range(b)]
    cost = linear_cost(per_token=rng.choice([0.01, 0.1, 0.4]), draft_step_ms=rng.choice([0.0, 0.05]))
    acceptance_threshold = rng.choice([0.0, 0.3, 0.6])
    budget = rng.choice([None, 2, 5])
    alloc = allocate_draft_lengths(probs, cost, acceptance_threshold=acceptance_threshold, max_total_tokens=budget)
    assert alloc.tokens_per_ms == pytest.approx(brute_force(probs, cost, acceptance_threshold, budget), rel=1e-9)
    assert all(0 <= n <= len(p) for n, p in zip(alloc.lengths, probs))
    if budget is not None:
        assert sum(alloc.lengths) <= budget


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("cumulative", [False, True])
def test_best_width_is_the_allocations_longest_row(seed, cumulative):
    """``best_width`` (vectorised, chained rounds) picks the width of ``allocate_draft_lengths``'s
    choice and its predicted time, on batches of up to 64 rows with equal-length drafts; without
    a cost model, the longest θ-cut length."""
    import numpy as np

    rng = random.Random(seed)
    b, L = rng.randint(1, 64), rng.randint(1, 6)
    probs = [[rng.random() ** rng.choice([0.3, 1.0, 3.0]) for _ in range(L)] for _ in range(b)]
    cost = linear_cost(per_token=rng.choice([0.001, 0.01, 0.1, 0.4]), draft_step_ms=rng.choice([0.0, 0.05]))
    cost.overhead_ms = rng.choice([0.0, 0.5])
    theta = rng.choice([0.0, 0.3, 0.6, 0.95])
    alloc = allocate_draft_lengths(probs, cost, acceptance_threshold=theta, cumulative=cumulative)
    width, modelled = best_width(np.array(probs), cost, theta, cumulative)
    assert width == max(alloc.lengths)
    assert modelled == pytest.approx(alloc.predicted_ms - cost.overhead_ms)
    caps = [threshold_cut(p, theta, cumulative) for p in probs]
    assert best_width(np.array(probs), None, theta, cumulative) == (max(caps), None)


def test_chained_policy_plans_widths_and_learns_from_their_rounds():
    """``DraftPolicy.plan_width``: without a cost model, the controller's θ for that round and the
    longest θ-cut length, clamped to the draft limit, and ``observe`` with the plan credits that θ
    (not the last one chosen); with a cost model, the width the cost model prefers (a learned θ
    does not cut: it would cut the whole batch; a fixed θ does) and the per-round cost fitted
    against the plan's modelled time. The random-length baseline draws widths in 0..limit."""
    import numpy as np

    policy = DraftPolicy(entropy_score, controller=ThresholdController(grid=[0.0, 0.5, 0.9]),
                         device_score=entropy_score)
    assert policy.chains and policy.needs_scores
    scores = np.array([[0.95, 0.9, 0.4, 0.1], [0.7, 0.6, 0.55, 0.2]])
    plans = [policy.plan_width(scores, limit=3) for _ in range(3)]
    assert [p.acceptance_threshold for p in plans] == [0.0, 0.0, 0.0]  # an untried candidate until observed
    assert [p.width for p in plans] == [3, 3, 3]
    assert policy.plan_width(None, limit=4) == WidthPlan(4, 0.0)
    first = policy.plan_width(scores, limit=4)
    policy.observe(10, 2.0, first)
    second = policy.plan_width(scores, limit=4)
    assert (second.acceptance_threshold, second.width) == (0.5, 3)  # the next untried candidate
    policy.observe(1, 2.0, second)
    assert policy.controller.counts[0] > 0.99 and policy.controller.counts[1] > 0.99
    assert policy.controller.tokens[0] > policy.controller.tokens[1]
    third = policy.plan_width(scores, limit=4)
    assert (third.acceptance_threshold, third.width) == (0.9, 2)
    budget = DraftPolicy(entropy_score, controller=ThresholdController(grid=[0.9]),
                         cost=linear_cost(per_token=0.0001), device_score=entropy_score)  # width almost free
    plan = budget.plan_width(scores, limit=4)
    assert plan.acceptance_threshold == 0.0 and plan.width == best_width(scores, budget.cost)[0] == 4
    budget.observe(10, 2.0, plan)
    assert budget.overhead_ms > 0  # 2 ms measured against a modelled linear cost below it
    fixed = DraftPolicy(entropy_score, acceptance_threshold=0.96, cost=linear_cost(per_token=0.0001))
    assert fixed.plan_width(scores, limit=4).width == 0  # a θ the user fixed still cuts under a cost model
    expensive = DraftPolicy(entropy_score, acceptance_threshold=0.0, cost=linear_cost(per_token=5.0),
                            device_score=entropy_score)
    assert expensive.plan_width(scores, limit=4).width < 4  # a costly width is not worth its last positions
    fixed = DraftPolicy(entropy_score, acceptance_threshold=0.5, device_score=entropy_score)
    assert fixed.plan_width(scores, limit=4).width == 3  # the longest per-token cut at θ = 0.5
    assert not DraftPolicy(entropy_score, branch_top_m=3).chains
    rnd = RandomLengthPolicy(seed=1)
    assert not rnd.needs_scores
    widths = {rnd.plan_width(None, limit=4).width for _ in range(200)}
    assert widths == {0, 1, 2, 3, 4}


def test_allocation_hand_made_cases():
    free = CostModel({1: {q: 1.0 for q in range(1, 9)}, 8: {q: 1.0 for q in range(1, 9)}})
    # verification free in q: draft everything that passes τ
    assert allocate_draft_lengths([[0.9, 0.1, 0.9], [0.5]], free, acceptance_threshold=0.2).lengths == [1, 1]
    # very expensive extra tokens: verify none
    steep = CostModel({2: {1: 1.0, 2: 10.0, 3: 20.0}})
    assert allocate_draft_lengths([[0.5, 0.5], [0.5, 0.5]], steep).lengths == [0, 0]
    # a budget of 2 goes to the most likely positions across the batch
    assert allocate_draft_lengths([[0.95, 0.9], [0.3, 0.3]], free, max_total_tokens=2).lengths == [2, 0]
    assert allocate_draft_lengths([], free).lengths == []


def simulate(acceptance_threshold, phase, rng, cost, k_max=8):
    """One round of a synthetic acceptance process: position acceptance probabilities are
    drawn per position (easy or hard text), the predictor knows them, τ cuts the draft."""
    lo, hi = phase
    p = [rng.uniform(lo, hi) for _ in range(k_max)]
    n = threshold_cut(p, acceptance_threshold)
    emitted = 1
    for i in range(n):
        if rng.random() < p[i]:
            emitted += 1
        else:
            break
    return emitted, cost.round_ms(1, n)


def best_threshold(phase, cost, grid):
    rng = random.Random(0)
    scores = {}
    for acceptance_threshold in grid:
        tok = ms = 0.0
        for _ in range(4000):
            e, t = simulate(acceptance_threshold, phase, rng, cost)
            tok += e
            ms += t
        scores[acceptance_threshold] = tok / ms
    return max(scores, key=scores.get), scores


def test_threshold_controller_tracks_a_difficulty_change():
    cost = linear_cost(per_token=0.05, draft_step_ms=0.02)
    easy, hard = (0.85, 1.0), (0.0, 0.8)
    grid = [round(0.05 * i, 2) for i in range(0, 20)]
    threshold_easy, s_easy = best_threshold(easy, cost, grid)
    threshold_hard, s_hard = best_threshold(hard, cost, grid)
    # easy text: any τ below 0.85 drafts everything; hard text: the optimum is near 0.3 and a
    # τ near 0 loses > 5% (too many doomed drafts), so τ must come down and then go back up
    assert s_easy[0.9] < 0.7 * max(s_easy.values())
    assert s_hard[0.05] < 0.95 * max(s_hard.values()) and s_hard[0.9] < 0.8 * max(s_hard.values())

    ctl = ThresholdController()
    rng = random.Random(1)
    seen = []
    for phase, rounds in ((easy, 3000), (hard, 3000)):
        for _ in range(rounds):
            e, t = simulate(ctl.current(), phase, rng, cost)
            ctl.observe(e, t)
        seen.append(ctl.acceptance_threshold)
    def near_opt(acceptance_threshold, scores):  # goodput at the learned τ within 5% of the best on the grid
        nearest = min(scores, key=lambda g: abs(g - acceptance_threshold))
        return scores[nearest] >= 0.95 * max(scores.values())
    assert near_opt(seen[0], s_easy), (seen, threshold_easy)
    assert near_opt(seen[1], s_hard), (seen, threshold_hard)


def test_threshold_controller_state_round_trip():
    a = ThresholdController()
    for i in range(20):
        a.current()
        a.observe(2 + i % 3, 1.0)
    b = ThresholdController()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert not any(math.isnan(g) for g in b.goodput())


def test_policy_uses_drafter_scores_when_given():
    """Proposals that carry their drafter's acceptance scores are cut by those, not by the
    policy's own score of their features."""
    import torch

    from tandem.control import DraftPolicy
    from tandem.drafters.base import DraftProposal, one_hot_features

    policy = DraftPolicy(lambda f: torch.zeros(f.shape[0]), acceptance_threshold=0.5)  # own score: reject everything
    scored = DraftProposal([1, 2, 3], None, one_hot_features(3), scores=torch.tensor([0.9, 0.8, 0.1]))
    plain = DraftProposal([1, 2, 3], None, one_hot_features(3))
    out = policy.apply([scored, plain])
    assert [len(p.tokens) for p in out] == [2, 0]
    assert out[0].scores.tolist() == pytest.approx([0.9, 0.8])


def test_round_overhead_is_fitted_online_and_lengthens_drafts():
    """A round costs a fixed host part on top of T(b, q). DraftPolicy fits it from measured round
    times (EMA of measured - modelled) and allocates with it: against a large fixed cost a verified
    draft is cheap, so drafts that the bare T(b, q) model would cut are kept."""
    import torch

    from tandem.control import DraftPolicy

    cost = linear_cost(base=1.0, per_token=0.5, per_row=0.0)  # T(1, q) = 0.5 + 0.5 q
    probs = [0.6, 0.5, 0.45, 0.4]
    bare = allocate_draft_lengths([probs], cost)
    heavy = allocate_draft_lengths([probs], CostModel(cost.table, overhead_ms=20.0))
    assert bare.lengths == [1] and heavy.lengths == [4]  # brute force below agrees
    for c, got in ((cost, bare), (CostModel(cost.table, overhead_ms=20.0), heavy)):
        best = max(range(5), key=lambda n: expected_emitted(probs, n) / c.round_ms(1, n))
        assert got.lengths == [best] and got.predicted_ms == pytest.approx(c.round_ms(1, best))

    policy = DraftPolicy(lambda f: f[:, 0], cost=cost, acceptance_threshold=0.0)
    features = [torch.tensor([[p] for p in probs])]
    assert policy.lengths(features) == [1] and policy.overhead_ms == 0.0
    for _ in range(60):  # every round really takes the modelled time + 20 ms
        n = policy.lengths(features)[0]
        policy.observe(1, cost.round_ms(1, n) + 20.0)
    assert policy.overhead_ms == pytest.approx(20.0, rel=0.02)
    assert policy.lengths(features) == [4]
    assert cost.overhead_ms == 0.0  # the shared cost model is never modified
    for _ in range(100):  # rounds faster than modelled pull the estimate down to 0, never below
        policy.lengths(features)
        policy.observe(1, 0.1)
    assert 0.0 <= policy.overhead_ms < 0.01 and policy.lengths(features) == [1]
    with pytest.raises(ValueError, match="overhead_rate"):
        DraftPolicy(lambda f: f[:, 0], overhead_rate=0.0)


def test_batch_width_policy_widens_where_width_is_free_and_narrows_where_it_costs():
    """BatchWidthPolicy: the full limit until every position has evidence; then the width of most
    expected tokens per predicted ms: all six slots where T(b, q) is flat (batch 1), fewer where a
    verify position costs (batch 128); positions no longer drafted keep their estimates."""
    import numpy as np
    import torch

    from tandem.batch_width import BatchWidthPolicy
    from tandem.metrics import SpecDecodeStats

    cost = CostModel({1: {q: 1.0 for q in range(1, 8)}, 128: {q: 2.0 + 0.5 * q for q in range(1, 8)}})
    policy = BatchWidthPolicy(cost, decay=0.1, min_evidence=8)
    assert policy.plan_width(None, 6, rows=64).width == 6 and not policy.needs_scores
    survive = [0.6, 0.45, 0.35, 0.25, 0.2, 0.15]  # share of rows whose first i + 1 drafts were accepted
    for _ in range(20):
        round_stats = SpecDecodeStats()
        for row in range(20):  # 20 rows drafting 6, accepting as many as ``survive`` says
            accepted = sum(row < 20 * s for s in survive)
            round_stats.record(6, accepted, accepted + 1)
        policy.observe(40, 1.0, None, round_stats)
    assert np.allclose(policy._accepted / policy._drafted, survive)
    assert policy.plan_width(None, 6, rows=1).width == 6
    narrow = policy.plan_width(None, 6, rows=128)
    tokens = 1 + np.concatenate([[0], np.cumsum(survive)])
    ms = np.array([2.0 + 0.5 * (m + 1) for m in range(7)])
    assert narrow.width == int(np.argmax(tokens / ms)) < 6 and narrow.modelled_ms == pytest.approx(ms[narrow.width])
    before = policy._drafted.copy()
    short = SpecDecodeStats()
    short.record(2, 1, 2)  # a round that drafted two positions: the later ones keep their counts
    policy.observe(2, 1.0, narrow, short)
    assert (policy._drafted[2:] == before[2:]).all() and (policy._drafted[:2] != before[:2]).all()
    lens = policy.lengths([torch.zeros(6, 4), torch.zeros(3, 4)])  # host-drafted rounds: cut to the width
    assert lens == [min(6, policy.width(2, 6)[0]), min(3, policy.width(2, 6)[0])]


def test_batch_width_policy_keeps_its_width_through_near_ties():
    """A width in use stays unless another is predicted ``hysteresis`` faster: a width that flips
    between near ties would ask for verify shapes (CUDA graphs) the warm-up did not capture."""
    import numpy as np

    from tandem.batch_width import BatchWidthPolicy
    from tandem.metrics import SpecDecodeStats

    # batch 8: m = 2 and 3 nearly tie (1.9 / 1.3 against 2.2 / 1.52 tokens per ms); batch 64: m = 1 wins clearly
    cost = CostModel({8: {1: 1.0, 2: 1.1, 3: 1.3, 4: 1.52}, 64: {1: 1.0, 2: 1.2, 3: 2.0, 4: 3.0}})
    survive = [0.6, 0.3, 0.3]

    def trained(hysteresis):
        policy = BatchWidthPolicy(cost, decay=0.1, min_evidence=8, hysteresis=hysteresis)
        for _ in range(20):  # rounds at batch 8 that explore at the full width until the evidence is in
            plan = policy.plan_width(None, 3, rows=8)
            stats = SpecDecodeStats()
            for row in range(20):
                accepted = sum(row < 20 * s for s in survive)
                stats.record(3, accepted, accepted + 1)
            policy.observe(40, 1.0, plan, stats)
        policy.overhead_ms = 0.0  # the table alone decides
        return policy

    tokens = 1 + np.concatenate([[0], np.cumsum(survive)])
    rate8 = tokens / np.array([1.0, 1.1, 1.3, 1.52])
    assert int(np.argmax(rate8)) == 2 and rate8[2] < rate8[3] * 1.03  # a near tie the plain argmax breaks
    eager, steady = trained(0.0), trained(0.03)
    assert eager.width(8, 3)[0] == 2 and steady.width(8, 3)[0] == 3  # the explored width (3) is kept
    assert steady.width(64, 3)[0] == 1 and steady.width(8, 3)[0] == 1  # a clear gain moves it; then it stays
    assert steady.width(8, 3)[1] == pytest.approx(1.1)  # modelled: T(8, 2), the overhead left out
    with pytest.raises(ValueError, match="hysteresis"):
        BatchWidthPolicy(cost, hysteresis=-0.1)


def test_chained_plan_width_keeps_its_width_through_near_ties():
    """``DraftPolicy.plan_width`` (the scoring policies' chained rounds) holds the width in use
    unless the cost model predicts another more than ``hysteresis`` faster, as batch-width does."""
    import numpy as np

    cost = CostModel({4: {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.06, 5: 1.083}})
    ms = np.array([1.0, 1.0, 1.0, 1.06, 1.083])  # T(4, m + 1), m = 0 .. 4

    def rates(p):  # expected tokens per ms of each width for 4 rows scored p
        return (4 + 4 * np.concatenate([[0], np.cumsum(np.cumprod(p))])) / ms

    likely, near, far = [0.9] * 4, [0.7, 0.5, 0.3, 0.2], [0.3, 0.05, 0.05, 0.05]
    assert rates(likely).argmax() == 4
    assert rates(near).argmax() == 2 and rates(near)[2] < rates(near)[4] * 1.03  # a near tie
    assert rates(far).argmax() == 2 and rates(far)[2] > rates(far)[4] * 1.03  # a clear gain
    for hysteresis, after_near in ((0.0, 2), (0.03, 4)):
        policy = DraftPolicy(lambda f: f[:, 0], cost=cost, acceptance_threshold=0.0, hysteresis=hysteresis)
        assert policy.plan_width(np.array([likely] * 4), 4).width == 4
        assert policy.plan_width(np.array([near] * 4), 4).width == after_near
        assert policy.plan_width(np.array([far] * 4), 4).width == 2
    with pytest.raises(ValueError, match="hysteresis"):
        DraftPolicy(lambda f: f[:, 0], hysteresis=-1.0)
