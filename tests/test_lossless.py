"""Losslessness with power: the batched verifier (``tandem.verify.verify_chains``) against exact
target distributions, broken samplers that the same test must reject, and a coverage matrix.

The harness is a synthetic language over ``V`` tokens whose target and draft "models" are
first-order Markov chains (next-token logits tables ``L_p`` and ``L_q``, the draft a noisy copy of
the target), so the exact distribution of any run of output tokens is a product of table rows.
Many independent requests (one row each, seeds 0 .. N-1) decode round after round through the
real verifier: drafts are drawn from q (ragged lengths, 0 .. k per round), the target logits of
[last token + drafts] are looked up, ``verify_chains`` accepts / corrects / adds the bonus token,
and the emitted tokens are appended, until every request holds ``T_OUT`` output tokens. The tests
(``group_test``) are Pearson's chi-square over the *joint* of the first ``JOINT_T`` output tokens
(``V ** JOINT_T`` cells), which spans several verify rounds (a wrong bonus row, a correlation
between rounds), and over each later pair of consecutive tokens (t, t + 1) up to ``T_OUT``, where
drafts at positions 4 and later (k = 4, 5) decide the output; Bonferroni over the family.

Power (``test_stated_power_holds``): for any distribution at total-variation distance ``δ`` from
the exact one, the chi-square non-centrality is ``λ = N Σ d_i² / p_i >= 4 N δ²`` (Cauchy-Schwarz),
so with ``N = POWER_N`` requests and ``δ = 0.01``, ``λ >= 180``, and the joint test at ``ALPHA``
over the family (``ALPHA / NUM_TESTS`` each) with ``V ** JOINT_T - 1 = 124`` degrees of freedom
rejects with probability >= 0.99. (Cells with expected count below 5 are pooled; at POWER_N they
hold a mass of about 1e-5, and a bias moved only between them would not be seen.)

What the mutants are: four are verifier bugs patched into ``tandem.verify`` (over-acceptance,
residual from p, bonus from the wrong row, one uniform for two draws); two are drafter bugs where
the q reported to the verifier is not the q the draft was drawn from (at another temperature;
without the top-k / top-p filter the draw used). A drafter that draws from and reports the same q,
whatever its transform, is lossless, and the harness passes it. The harness computes q itself: the
drafters' own transform (``draft_rows``) is covered by the engine-level tests in
test_speculative.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from helpers import chi_square_pvalue, total_variation

import tandem.verify as verify_mod
from tandem.sampling import STREAM_ACCEPT, LogitAdjustments, sampling_probs
from tandem.verify import RowSampling, rejection_weights, verify_chains

V = 5  # vocabulary of the synthetic language
JOINT_T = 3  # the first output tokens whose joint distribution is tested
T_OUT = 6  # output tokens per request (later pairs tested up to here)
NUM_TESTS = 1 + (T_OUT - JOINT_T)  # the joint, then the pairs (2, 3), (3, 4), (4, 5) (0-based)
X0 = 2  # the prompt's last token, for every request
PROMPT_LEN = 10  # tokens the sequence holds before its first output token
POWER_N = 450_000  # requests per powered test
ALPHA = 1e-6  # per-test false-rejection probability
TV_DETECTED = 0.01  # total-variation bias detected with power >= 0.99 at POWER_N and ALPHA


@dataclass(frozen=True)
class Group:
    """Requests that share settings within one simulated batch.

    Attributes:
        temperature / top_k / top_p: sampling settings (temperature 0: greedy).
        k: draft tokens per round at most (each round draws a length in 0 .. k).
        deterministic: drafts are a fixed function of the previous token with q one-hot
            (n-gram-like); else drawn from the draft chain's q.
        n: requests.
        adjusted: the target's logits carry ``ADJUSTMENTS`` (logit_bias, penalties, min_tokens):
            the output is no longer a Markov chain (each token depends on the counts before it),
            and each verified position must see the drafts before it as output.
        masked: a grammar-like mask (``RowSampling.allowed``) forbids token ``masked_token(t)``
            at output index t (structured output's masks, as the verifier sees them).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    k: int = 3
    deterministic: bool = False
    n: int = POWER_N
    adjusted: bool = False
    masked: bool = False


def masked_token(t):
    """The token a masked group may not emit at output index ``t`` (an int or a tensor)."""
    return (2 * t + 1) % V


# The adjusted groups' settings: penalties that favour repeats (so a position that did not see the
# drafts before it would be far off), a bias, the prompt's tokens under the repetition penalty,
# and token SUPPRESSED masked until the output holds MIN_TOKENS tokens.
ADJUSTMENTS = {"bias": [0.5, 0.0, -0.7, 0.0, 0.3], "presence": -0.9, "frequency": -0.4, "repetition": 1.4,
               "prompt": [X0, 0], "min_tokens": 3, "suppressed": 4}


@dataclass(frozen=True)
class Faults:
    """Drafter-side bugs the harness can inject (the verifier-side ones are patched in).

    Attributes:
        q_temperature_scale: the drafter reports q at ``scale x`` the temperature it drew from.
        q_unfiltered: the drafter draws from the top-k / top-p filtered q but reports the
            unfiltered one (the transform applied on one side only).
    """

    q_temperature_scale: float = 1.0
    q_unfiltered: bool = False


def _tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = 1.5 * torch.randn(V, V, generator=g)
    lq = lp + 0.8 * torch.randn(V, V, generator=g)
    return lp, lq


LP, LQ = _tables()
DETERMINISTIC_DRAFT = torch.tensor([(3 * x + 1) % V for x in range(V)])  # the "n-gram" rule


def transform(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``[R, V]`` probabilities of the sampling transform (one-hot argmax for temperature 0)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), V).double()
    R = logits.shape[0]
    return sampling_probs(logits, torch.full((R,), float(temperature)), torch.full((R,), top_k),
                          torch.full((R,), float(top_p))).double()


def reference_logits(outputs: torch.Tensor, g: Group) -> torch.Tensor:
    """``[R, V]`` target logits after each output ``outputs`` ``[R, t]`` (whose last token is the
    one before: X0 when t = 0) with the group's ``ADJUSTMENTS`` and mask, from their definitions."""
    a = ADJUSTMENTS
    R, t = outputs.shape
    last = outputs[:, -1] if t else torch.full((R,), X0)
    x = LP[last].double()
    if g.adjusted:
        counts = torch.zeros(R, V, dtype=torch.float64)
        for j in range(t):
            counts[torch.arange(R), outputs[:, j]] += 1
        x = x + torch.tensor(a["bias"], dtype=torch.float64)
        seen = (counts > 0) | torch.isin(torch.arange(V), torch.tensor(a["prompt"]))
        x = torch.where(seen, torch.where(x > 0, x / a["repetition"], x * a["repetition"]), x)
        x = x - a["frequency"] * counts - a["presence"] * (counts > 0).double()
        if t < a["min_tokens"]:
            x[:, a["suppressed"]] = float("-inf")
    if g.masked:
        x[:, masked_token(t)] = float("-inf")
    return x


def exact_paths(g: Group) -> torch.Tensor:
    """``[V] * T_OUT`` exact probabilities of the whole output of an adjusted or masked group."""
    joint = torch.ones(())
    for t in range(T_OUT):
        outputs = (torch.cartesian_prod(*[torch.arange(V)] * t) if t > 1 else torch.arange(V)[:, None] if t
                   else torch.zeros(1, 0, dtype=torch.int64))
        P = transform(reference_logits(outputs, g).float(), g.temperature, g.top_k, g.top_p)
        joint = joint[..., None] * P.view(*([V] * t), V)
    return joint


def exact_joint(g: Group) -> torch.Tensor:
    """``[V] * JOINT_T`` exact probabilities of the first ``JOINT_T`` output tokens under
    target-only decoding with the group's settings."""
    if g.adjusted or g.masked:
        return exact_paths(g).sum(dim=tuple(range(JOINT_T, T_OUT)))
    P = transform(LP, g.temperature, g.top_k, g.top_p)
    joint = P[X0]
    for _ in range(JOINT_T - 1):  # P(x_{t+1} | x_t) = P[x_t, x_{t+1}]
        joint = joint[..., None] * P.view(*([1] * (joint.dim() - 1)), V, V)
    return joint


def exact_pair(g: Group, t: int) -> torch.Tensor:
    """``[V, V]`` exact probabilities of output tokens t and t + 1 (0-based)."""
    if g.adjusted or g.masked:
        return exact_paths(g).sum(dim=tuple(d for d in range(T_OUT) if d not in (t, t + 1)))
    P = transform(LP, g.temperature, g.top_k, g.top_p)
    marginal = P[X0]
    for _ in range(t):
        marginal = marginal @ P
    return marginal[:, None] * P


def simulate(groups: list[Group], faults: Faults = Faults(), use_none_q: bool = False,
             draft_seed: int = 1, device: str = "cpu") -> torch.Tensor:
    """Decode every group's requests through ``verify_chains``; ``[N, T_OUT]`` output tokens
    (rows in group order, on the CPU). ``use_none_q``: pass ``draft_probs=None`` (every group
    deterministic). ``device``: where the verifier runs (the drafts are drawn on the CPU)."""
    N = sum(g.n for g in groups)
    gid = torch.cat([torch.full((g.n,), i) for i, g in enumerate(groups)])
    per_row = lambda f, dt: torch.cat([torch.full((g.n,), f(g), dtype=dt) for g in groups])  # noqa: E731
    temperature = per_row(lambda g: g.temperature if g.temperature > 0 else 1.0, torch.float32)
    greedy = per_row(lambda g: g.temperature == 0, torch.bool)
    top_k, top_p = per_row(lambda g: g.top_k, torch.int64), per_row(lambda g: g.top_p, torch.float32)
    kmax = per_row(lambda g: g.k, torch.int64)
    det = per_row(lambda g: g.deterministic, torch.bool)
    seed = torch.arange(N, dtype=torch.int64)
    draw = torch.stack([transform(LQ, g.temperature, g.top_k, g.top_p) for g in groups]).float()  # [G, V, V]
    report = draw
    if faults.q_temperature_scale != 1.0 or faults.q_unfiltered:
        report = torch.stack([transform(LQ, g.temperature * faults.q_temperature_scale,
                                        0 if faults.q_unfiltered else g.top_k,
                                        1.0 if faults.q_unfiltered else g.top_p) for g in groups]).float()
    any_filter = any(g.top_k > 0 or g.top_p < 1 for g in groups if g.temperature > 0)
    any_det = any(g.deterministic for g in groups)
    K = max(g.k for g in groups)
    # draws by inversion of q's cumulative sum in float64 (a token of probability 0 is never drawn:
    # its interval [cdf[i - 1], cdf[i]) is empty), a few times cheaper than torch.multinomial
    draw_cdf = draw.double().cumsum(-1)[..., :-1].contiguous()  # [G, V, V - 1]
    gen = torch.Generator().manual_seed(draft_seed)
    out = torch.zeros(N, T_OUT + K + 1, dtype=torch.int64)
    count = torch.zeros(N, dtype=torch.int64)
    last = torch.full((N,), X0, dtype=torch.int64)
    active = torch.arange(N)
    cols = torch.arange(K + 1)
    masked = per_row(lambda g: g.masked, torch.bool)
    adjust = None
    if any(g.adjusted for g in groups):  # every row's adjustments; neutral on the other groups' rows
        a, on_rows = ADJUSTMENTS, per_row(lambda g: g.adjusted, torch.bool)
        neutral = lambda value, off, dt: torch.where(on_rows, torch.tensor(value, dtype=dt),  # noqa: E731
                                                     torch.tensor(off, dtype=dt))
        adjust = LogitAdjustments(
            bias=torch.tensor(a["bias"])[None, :] * on_rows[:, None], counts=torch.zeros(N, V),
            prompt_seen=torch.isin(torch.arange(V), torch.tensor(a["prompt"]))[None, :] & on_rows[:, None],
            suppress=(torch.arange(V) == a["suppressed"])[None, :] & on_rows[:, None],
            prompt_len=torch.full((N,), PROMPT_LEN), min_tokens=neutral(a["min_tokens"], 0, torch.int64),
            presence=neutral(a["presence"], 0.0, torch.float32), frequency=neutral(a["frequency"], 0.0, torch.float32),
            repetition=neutral(a["repetition"], 1.0, torch.float32))
    while active.numel():
        n = active.numel()
        a_gid, a_det = gid[active], det[active]
        lens = (torch.rand(n, generator=gen) * (kmax[active] + 1).float()).long()
        drafts = torch.empty(n, K, dtype=torch.int64)
        qs = torch.empty(n, K, V)
        prev = last[active]
        u = torch.rand(n, K, 1, generator=gen, dtype=torch.float64)
        for j in range(K):
            tok = (draw_cdf[a_gid, prev] <= u[:, j]).sum(-1)
            q = report[a_gid, prev]
            if any_det:
                tok = torch.where(a_det, DETERMINISTIC_DRAFT[prev], tok)
                q = torch.where(a_det[:, None], torch.nn.functional.one_hot(tok, V).float(), q)
            qs[:, j] = q
            drafts[:, j] = tok
            prev = tok
        inputs = torch.cat([last[active, None], drafts], dim=1)
        logits = LP[inputs]  # [n, K + 1, V]
        on = lambda t: t.to(device)  # noqa: E731
        rows_adjust = None if adjust is None else LogitAdjustments(*(on(t) for t in adjust.rows(active).__dict__.values()))
        allowed = None
        if any(g.masked for g in groups):  # the masked rows' forbidden token at each verified position
            index = count[active, None] + cols[None, :]  # output index of the token position j verifies
            allowed = torch.ones(n, K + 1, V, dtype=torch.bool)
            allowed.scatter_(-1, masked_token(index)[..., None], ~masked[active, None, None].expand(n, K + 1, 1))
            allowed = on(allowed)
        sampling = RowSampling(on(greedy[active]), on(temperature[active]), on(top_k[active]), on(top_p[active]),
                               on(seed[active]), any_sampled=bool((~greedy[active]).any()), filtered=any_filter,
                               adjust=rows_adjust, allowed=allowed)
        res = verify_chains(on(logits), on(logits.argmax(-1)), on(drafts), on(lens), on(PROMPT_LEN + count[active]),
                            sampling, None if use_none_q else on(qs))
        res = type(res)(res.num_accepted.cpu(), res.tokens.cpu())
        m = res.num_accepted
        emitted = cols[None, :] <= m[:, None]
        dest = (count[active, None] + cols[None, :]).clamp(max=out.shape[1] - 1)
        rows = active[:, None].expand(-1, K + 1)
        keep = emitted & (dest < T_OUT)
        out[rows[keep], dest[keep]] = res.tokens[keep]
        if adjust is not None:  # the output's counts, as the target records them after each round
            adjust.counts.index_put_((rows[emitted], res.tokens[emitted]), torch.ones(int(emitted.sum())),
                                     accumulate=True)
        last[active] = res.tokens.gather(1, m[:, None])[:, 0]
        count[active] += m + 1
        active = active[count[active] < T_OUT]
    return out[:, :T_OUT]


def joint_counts(tokens: torch.Tensor) -> torch.Tensor:
    flat = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for t in range(tokens.shape[1]):
        flat = flat * V + tokens[:, t]
    return torch.bincount(flat, minlength=V ** tokens.shape[1])


def group_test(g: Group, tokens: torch.Tensor) -> tuple[float, float]:
    """(Bonferroni-adjusted p-value, largest TV) of one group's ``[n, T_OUT]`` tokens: the joint of
    the first ``JOINT_T`` and each later pair of consecutive tokens, against the exact ones."""
    tests = [(joint_counts(tokens[:, :JOINT_T]), exact_joint(g))]
    tests += [(joint_counts(tokens[:, t:t + 2]), exact_pair(g, t)) for t in range(JOINT_T - 1, T_OUT - 1)]
    assert len(tests) == NUM_TESTS
    pv = min(chi_square_pvalue(c, w) for c, w in tests)
    return min(1.0, pv * NUM_TESTS), max(total_variation(c, w) for c, w in tests)


def group_pvalues(groups: list[Group], tokens: torch.Tensor) -> list[tuple[float, float]]:
    """``group_test`` of each group (rows in group order)."""
    out, start = [], 0
    for g in groups:
        out.append(group_test(g, tokens[start:start + g.n]))
        start += g.n
    return out


def chi_square_critical(df: int, alpha: float) -> float:
    """Upper ``alpha`` quantile of chi-square with ``df`` degrees of freedom (bisection)."""
    lo, hi = 0.0, df + 100.0 * math.sqrt(df) + 100
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(mid / 2, dtype=torch.float64))) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


# ----------------------------------------------------------------------------- the power claim


def test_stated_power_holds():
    """The module docstring's claim: λ = 4 N δ² with N = POWER_N, δ = TV_DETECTED, at
    ALPHA / NUM_TESTS over V ** JOINT_T - 1 degrees of freedom, rejects with probability >= 0.99
    (non-central chi-square drawn as a sum of squared shifted normals)."""
    df = V ** JOINT_T - 1
    crit = chi_square_critical(df, ALPHA / NUM_TESTS)
    lam = 4 * POWER_N * TV_DETECTED ** 2
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20_000, df, generator=g, dtype=torch.float64)
    z[:, 0] += math.sqrt(lam)
    power = float(((z ** 2).sum(-1) > crit).double().mean())
    assert power >= 0.99, (crit, lam, power)


def test_harness_exact_distribution_is_a_distribution():
    for g in (Group(), Group(temperature=0.3, top_k=2), Group(temperature=0.0)):
        assert float(exact_joint(g).sum()) == pytest.approx(1.0, abs=1e-6)


# ----------------------------------------------------------------------------- the correct sampler passes

POWERED = {
    "T1.0-sampled-k3": [Group()],
    "T0.8-top_p0.95-deterministic-k4": [Group(temperature=0.8, top_p=0.95, k=4, deterministic=True)],
    "T1.5-top_k3-sampled-k2": [Group(temperature=1.5, top_k=3, k=2)],
    "T0.6-top_k4-top_p0.95-sampled-k5": [Group(temperature=0.6, top_k=4, top_p=0.95, k=5)],
    "T0.9-top_p0.95-adjusted-sampled-k4": [Group(temperature=0.9, top_p=0.95, k=4, adjusted=True)],
    "T1.0-masked-sampled-k4+deterministic": [Group(temperature=1.0, k=4, masked=True),
                                             Group(temperature=0.8, k=3, deterministic=True)],
}


CPU_POWERED = ["T1.0-sampled-k3", "T0.6-top_k4-top_p0.95-sampled-k5", "T0.9-top_p0.95-adjusted-sampled-k4",
               "T1.0-masked-sampled-k4+deterministic"]  # the rest run on the GPU (test_powered_on_gpu)


@pytest.mark.parametrize("name", CPU_POWERED)
def test_speculative_sampling_matches_target_only_with_power(name):
    groups = POWERED[name]
    tokens = simulate(groups)
    for (pv, tv), g in zip(group_pvalues(groups, tokens), groups):
        assert pv > ALPHA, f"{name}: p-value {pv:.2e}, TV {tv:.4f} ({g})"


def test_deterministic_drafts_without_q_rows():
    """``draft_probs=None`` (every draft deterministic: the n-gram path) is the same rule."""
    groups = [Group(temperature=1.0, k=3, deterministic=True, n=POWER_N)]
    (pv, tv), = group_pvalues(groups, simulate(groups, use_none_q=True))
    assert pv > ALPHA, (pv, tv)


def test_greedy_rows_emit_the_argmax_chain_in_a_mixed_batch():
    groups = [Group(temperature=0.0, k=4, n=2000), Group(temperature=1.0, k=4, n=2000),
              Group(temperature=0.0, k=2, deterministic=True, n=2000)]
    tokens = simulate(groups)
    chain = [X0]
    for _ in range(T_OUT):
        chain.append(int(LP[chain[-1]].argmax()))
    assert (tokens[:2000] == torch.tensor(chain[1:])).all()
    assert (tokens[4000:] == torch.tensor(chain[1:])).all()
    assert not (tokens[2000:4000] == torch.tensor(chain[1:])).all()  # sampled rows really sample


def test_seeded_rows_reproduce_in_any_batch():
    """A row's verification depends on its own inputs, seed and position only: 64 rows verified
    alone and scattered among 500 others (other settings, other drafts) give the same tokens."""
    g = torch.Generator().manual_seed(7)
    n, extra, K = 64, 500, 4
    logits = 2 * torch.randn(n + extra, K + 1, V, generator=g)
    drafts = torch.randint(0, V, (n + extra, K), generator=g)
    lens = torch.randint(0, K + 1, (n + extra,), generator=g)
    q = torch.softmax(torch.randn(n + extra, K, V, generator=g), -1)
    positions = torch.randint(0, 1000, (n + extra,), generator=g)
    temperature = torch.rand(n + extra, generator=g) + 0.5
    sampling = RowSampling(torch.zeros(n + extra, dtype=torch.bool), temperature,
                           torch.randint(0, 4, (n + extra,), generator=g), torch.full((n + extra,), 0.9),
                           torch.randint(0, 2 ** 62, (n + extra,), generator=g))
    perm = torch.randperm(n + extra, generator=g)
    alone = verify_chains(logits[:n], logits[:n].argmax(-1), drafts[:n], lens[:n], positions[:n],
                          sampling.rows(torch.arange(n)), q[:n])
    mixed = verify_chains(logits[perm], logits[perm].argmax(-1), drafts[perm], lens[perm], positions[perm],
                          sampling.rows(perm), q[perm])
    where = torch.argsort(perm)[:n]  # the first 64 rows' places in the mixed batch
    assert torch.equal(mixed.num_accepted[where], alone.num_accepted)
    emitted = torch.arange(K + 1)[None, :] <= alone.num_accepted[:, None]
    assert torch.equal(mixed.tokens[where][emitted], alone.tokens[emitted])
    assert 0 < float(alone.num_accepted.float().mean()) < K  # both accepts and rejects happened


# ----------------------------------------------------------------------------- broken samplers must fail


def _over_accept(p_draft, q_draft, u):
    return u * q_draft < 1.05 * p_draft


def _residual_from_p(p_row, q_row, rejected_token, rejected):
    return p_row


def _bonus_from_wrong_row(p, draft_probs, draft_tokens, draft_lens, num_accepted):
    B = p.shape[0]
    rows = torch.arange(B)
    bonus = num_accepted >= draft_lens
    row = torch.where(bonus, (num_accepted - 1).clamp(min=0), num_accepted)  # the last draft's row
    at = num_accepted.clamp(max=max(p.shape[1] - 2, 0))
    q_row = None if draft_probs is None else draft_probs[rows, at]
    return rejection_weights(p[rows, row], q_row, draft_tokens[rows, at], ~bonus)


def _accept_from_fourth(p_draft, q_draft, u):
    ok = u * q_draft < p_draft
    ok[:, 3:] = True
    return ok


MUTANTS = {
    # name: (what is patched in tandem.verify, faults of the drafter, groups where the bug shows)
    "over-acceptance-1.05x": ({"accept_drafts": _over_accept}, Faults(), [Group()]),
    "residual-from-p": ({"rejection_weights": _residual_from_p}, Faults(), [Group()]),
    "bonus-from-wrong-row": ({"stop_weights": _bonus_from_wrong_row}, Faults(), [Group(k=2)]),
    "one-uniform-for-accept-and-sample": ({"STREAM_SAMPLE": STREAM_ACCEPT}, Faults(), [Group(deterministic=True)]),
    "q-reported-at-another-temperature": ({}, Faults(q_temperature_scale=1.3), [Group(temperature=0.8)]),
    "q-reported-without-the-filter-drawn-with": ({}, Faults(q_unfiltered=True),
                                                 [Group(temperature=1.0, top_k=3, top_p=0.9)]),
    # drafts at positions 4 and later: only the later pairs can see these
    "always-accept-from-the-4th-draft": ({"accept_drafts": _accept_from_fourth}, Faults(), [Group(k=5)]),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_broken_sampler_is_rejected(name, monkeypatch):
    patches, faults, groups = MUTANTS[name]
    for attr, value in patches.items():
        monkeypatch.setattr(verify_mod, attr, value)
    (pv, tv), = group_pvalues(groups, simulate(groups, faults))
    assert pv < ALPHA, f"the {name} sampler passed: p-value {pv:.2e}, TV {tv:.4f}"


# ----------------------------------------------------------------------------- coverage matrix

MATRIX_N = 4_000  # requests per cell of the matrix (all cells in one batch)
MATRIX_ALPHA = 1e-6  # per cell (Bonferroni-adjusted); 128 cells -> family-wise false rejection < 1.3e-4
MATRIX = [Group(temperature=t, top_k=tk, top_p=tp, k=k, deterministic=d, n=MATRIX_N)
          for t in (0.3, 0.7, 1.0, 1.5) for tk, tp in ((0, 1.0), (3, 1.0), (0, 0.8), (3, 0.8))
          for k in (2, 3, 4, 5) for d in (False, True)]


def test_coverage_matrix_in_one_mixed_batch():
    """4 temperatures x {none, top-k, top-p, both} x k = 2 .. 5 x {sampled q, one-hot q}: 128
    settings mixed in one batch of 512k requests, each tested on its own: a coverage check (every
    path runs, no zero-probability token is ever emitted, gross biases fail), detecting a TV bias of
    about 0.1 with power 0.99 in a cell of full support; the powered tests above cover 0.01. Some
    cells are nearly deterministic (T 0.3 with top-p 0.8 is a point mass here)."""
    tokens = simulate(MATRIX)
    failures = [f"{g}: p {pv:.1e} TV {tv:.3f}" for (pv, tv), g in zip(group_pvalues(MATRIX, tokens), MATRIX)
                if pv < MATRIX_ALPHA]
    assert not failures, failures


# ----------------------------------------------------------------------------- KV rollback, through the engine


def _greedy_spec_vs_target(tiny_checkpoint) -> tuple[list[list[int]], list[list[int]], int]:
    from tandem.drafters import DraftModelDrafter
    from tandem.engine import Engine
    from tandem.models import load_checkpoint
    from tandem.models.runner import RunnerConfig
    from tandem.sampling import SamplingParams

    target_dir = str(tiny_checkpoint("llama", with_tokenizer=True))
    draft = load_checkpoint(tiny_checkpoint("llama", with_tokenizer=True, seed=1))
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=96)
    base = Engine(target_dir, cfg)
    spec = Engine(base.checkpoint, cfg, tokenizer=base.tokenizer, drafter=DraftModelDrafter(draft, cfg),
                  num_draft_tokens=3)
    spec.chained_rounds = False  # host-drafted rounds: the target's rollback is KVCache.truncate
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [3, 4], [7] * 10]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [base.add_request(prompt_ids=p, params=params) for p in prompts]
    while base.has_unfinished():
        base.step()
    want = [base.completion(i).token_ids for i in ids]
    ids = [spec.add_request(prompt_ids=p, params=params) for p in prompts]
    while spec.has_unfinished():
        spec.step()
    got = [spec.completion(i).token_ids for i in ids]
    rejected = spec.stats.num_drafted - spec.stats.num_accepted
    return want, got, rejected


def test_kv_rollback_off_by_one_is_caught(tiny_checkpoint, monkeypatch):
    """Greedy speculative output equals target-only with the real rollback, and differs when the
    rollback keeps one rejected position (``KVCache.truncate`` off by one)."""
    from tandem.models.kv_cache import KVCache

    want, got, rejected = _greedy_spec_vs_target(tiny_checkpoint)
    assert rejected > 0 and got == want
    real = KVCache.truncate

    def off_by_one(self, slot, length):
        real(self, slot, min(length + 1, self.lengths[slot]))

    monkeypatch.setattr(KVCache, "truncate", off_by_one)
    want, got, rejected = _greedy_spec_vs_target(tiny_checkpoint)
    assert rejected > 0 and got != want


# ----------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
def test_counter_uniform_is_the_same_on_cpu_and_gpu():
    """Integer hashing: a seeded request draws bit-identical numbers on either device."""
    from tandem.sampling import counter_uniform

    seed = torch.randint(0, 2 ** 62, (4096,), generator=torch.Generator().manual_seed(0))
    pos = torch.randint(0, 4096, (4096, 6), generator=torch.Generator().manual_seed(1))
    for stream in (0, 1):
        assert torch.equal(counter_uniform(seed, pos, stream), counter_uniform(seed.cuda(), pos.cuda(), stream).cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(POWERED))
def test_powered_on_gpu(name):
    """The powered test with 10x the requests (TV bias of about 0.003 detected), verifier on CUDA."""
    groups = [replace(g, n=10 * POWER_N) for g in POWERED[name]]
    for (pv, tv), g in zip(group_pvalues(groups, simulate(groups, device="cuda")), groups):
        assert pv > ALPHA, f"{name}: p-value {pv:.2e}, TV {tv:.4f} ({g})"


# ----------------------------------------------------------------------------- logprobs against a reference


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ngram-sampled", "tree-greedy", "stop-cut"])
def test_logprobs_equal_an_independent_log_softmax(real_checkpoint, real_engine, on_real_target, hf_model, mode):
    """The returned log-probabilities and top-5 alternatives equal log_softmax of Hugging Face
    transformers' float32 logits (an independent implementation of the same GGUF) at every emitted
    token: sampled with n-gram speculation, greedy through token trees, and target-only cut with
    the text at a stop string."""
    from tandem.control import DraftPolicy
    from tandem.drafters import DraftModelDrafter, NgramDrafter, load_draft_checkpoint
    from tandem.sampling import SamplingParams

    cfg = real_engine.runner_config  # CPU float32; the engine runs on the session engine's target
    drafter, policy = None, None
    if mode == "ngram-sampled":
        drafter = NgramDrafter()
    if mode == "tree-greedy":  # keep one draft, branch position 2 into its top-3: token trees every round
        drafter = DraftModelDrafter(load_draft_checkpoint("truncate:4", real_checkpoint), cfg)
        policy = DraftPolicy(lambda f: torch.where(f[:, 3] <= 1, 0.95, 0.05), acceptance_threshold=0.5, branch_top_m=3)
    engine = on_real_target(drafter, num_draft_tokens=3, draft_policy=policy)
    prompts = ["List three colours, one per line.", "Write the numbers 1 to 12 separated by spaces."]
    sampled = mode == "ngram-sampled"
    params = SamplingParams(max_tokens=16, temperature=0.8 if sampled else 0.0, top_p=0.9, seed=11,
                            stop=("5",) if mode == "stop-cut" else ())
    top = 5
    ids = [engine.add_request(p, params, logprobs=True, top_logprobs=top) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.completion(i) for i in ids]
    if drafter is not None:
        assert engine.stats.num_drafted > 0  # speculation ran
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == len(out.token_ids) >= 1
        if mode == "stop-cut" and "numbers" in prompt:
            assert out.finish_reason == "stop" and out.text.rstrip().endswith("4") and "5" not in out.text
        seq = engine.encode_prompt(prompt) + out.token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([seq])).logits[0].float()
        n = len(engine.encode_prompt(prompt))
        logp = logits[n - 1:-1].log_softmax(-1)
        ref = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=2e-3, rtol=0)
        assert len(out.top_logprobs) == len(out.token_ids)
        ref_values, ref_ids = logp.topk(top + 1, dim=-1)
        for j, alternatives in enumerate(out.top_logprobs):
            assert len(alternatives) == top
            got_ids, got_values = [t for t, _ in alternatives], [v for _, v in alternatives]
            torch.testing.assert_close(torch.tensor(got_values), ref_values[j, :top], atol=2e-3, rtol=0)
            gaps = ref_values[j, :-1] - ref_values[j, 1:]  # an id is compared where no near-tie can swap it
            for i in range(top):
                if gaps[i] > 5e-3 and (i == 0 or gaps[i - 1] > 5e-3):
                    assert got_ids[i] == int(ref_ids[j, i]), (j, i)
            if out.token_ids[j] in got_ids:  # the emitted token's own entry agrees with its logprob
                assert got_values[got_ids.index(out.token_ids[j])] == pytest.approx(out.logprobs[j], abs=1e-6)


# ----------------------------------------------------------------------------- logit adjustments against a reference


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["target", "ngram", "tree-greedy", "specformer"])
def test_logit_adjustments_equal_an_independent_reference(real_checkpoint, real_engine, on_real_target, hf_model,
                                                          mode):
    """Greedy output with logit_bias, min_tokens and the three penalties equals a step-by-step
    reference over Hugging Face transformers' float32 logits with its own logits processors
    (``RepetitionPenaltyLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``) and OpenAI's
    bias and presence / frequency formulas: target-only, and speculative with n-gram drafts in
    chained rounds, draft-model token trees on the host and the shipped SpecFormer head."""
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    from tandem.control import DraftPolicy
    from tandem.drafters import DraftModelDrafter, NgramDrafter, load_draft_checkpoint
    from tandem.sampling import SamplingParams

    cfg = real_engine.runner_config
    drafter, policy = None, None
    if mode == "ngram":
        drafter = NgramDrafter()
    if mode == "tree-greedy":
        drafter = DraftModelDrafter(load_draft_checkpoint("truncate:4", real_checkpoint), cfg)
        policy = DraftPolicy(lambda f: torch.where(f[:, 3] <= 1, 0.95, 0.05), acceptance_threshold=0.5, branch_top_m=3)
    if mode == "specformer":  # (the head reads the target's hidden states: a tapping target of its own)
        from tandem.speculation import SpeculativeConfig, build_engine

        engine = build_engine(SpeculativeConfig(drafter="specformer", num_draft_tokens=3), share=real_engine)
        drafter = engine.drafter
    else:
        engine = on_real_target(drafter, num_draft_tokens=3, draft_policy=policy)
    eos = engine.tokenizer.eos_token_ids
    cases = [  # (prompt, params): the penalties break the counting; min_tokens holds EOS off a one-word answer
        ("Write the numbers 1 to 12 separated by spaces.",
         SamplingParams(max_tokens=20, frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.15,
                        logit_bias={28: 2.5, 33: -100})),
        ("Answer with one word: is the sky blue?", SamplingParams(max_tokens=12, min_tokens=8, logit_bias={2: 1.0})),
    ]
    ids = [engine.add_request(p, sp) for p, sp in cases]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.completion(i) for i in ids]
    if drafter is not None:
        assert engine.stats.num_drafted > 0
    for (prompt, params), out in zip(cases, outs):
        seq = engine.encode_prompt(prompt)
        n = len(seq)
        repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        min_new = MinNewTokensLengthLogitsProcessor(n, params.min_tokens, list(eos))
        want = []
        for _ in range(params.max_tokens):
            ids_t = torch.tensor([seq])
            with torch.no_grad():
                x = hf_model(ids_t).logits[0, -1].float()[None]
            x = min_new(ids_t, x)
            for tok, b in params.logit_bias:
                x[0, tok] += b
            x = repetition(ids_t, x)
            counts = torch.bincount(torch.tensor(seq[n:], dtype=torch.int64), minlength=x.shape[-1]).float()
            x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
            tok = int(x.argmax())
            want.append(tok)
            seq.append(tok)
            if tok in eos:
                break
        assert out.token_ids == want, (prompt, engine.tokenizer.decode(out.token_ids), engine.tokenizer.decode(want))
    assert outs[1].completion_tokens >= 8
