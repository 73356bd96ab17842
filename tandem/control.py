"""Draft-length control: verifier cost model, batch-wide draft-token allocation, the draft policy.

Implements the adaptive-length and batch-budget parts of two papers (Context-aware drafting, ACL
2025; SpecFormer, AAAI 2026): the context-aware paper's threshold on predicted acceptance
probability, here θ = ``acceptance_threshold`` in [0, 1] (fixed, or learned online by
``tandem.threshold.ThresholdController``; the paper writes it τ, a letter this project keeps for the mean accepted
length τ_acc of ``tandem.metrics``), and the
SpecFormer observation that at large batch the verifier's cost grows with the tokens verified,
so draft tokens must be spent where they are most likely accepted across the whole batch.

Expected emitted tokens of one sequence verifying drafts with predicted per-position acceptance
probabilities p_1..p_n is ``E(n) = 1 + Σ_{i≤n} Π_{j≤i} p_j`` (the 1 is the bonus token).
"""

from __future__ import annotations

import bisect
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from .state import best_effort
from .threshold import ThresholdController

log = logging.getLogger(__name__)


@dataclass
class CostModel:
    """Predicted time of one decoding round in ms: a fixed per-round cost, the verifier's forward
    T(b, q) (b = batch rows, q = tokens per row, padded), and the drafter's cost per draft position
    that the allocation can still avoid.

    ``table[b][q]`` holds measurements; other batch sizes are interpolated linearly between the
    nearest measured ones (clamped at the ends), and q beyond the table extrapolates linearly.
    ``overhead_ms`` is the part of a round that does not depend on the allocation (host work of
    drafting, packing, verification and rollback; drafts already made): ``DraftPolicy`` fits it
    online from measured round times. ``draft_step_ms`` is for drafters that draft only the
    allocated positions (0 for positions drafted before the allocation runs, as in the engine:
    that time is part of the overhead; ``DraftPolicy.begin_round`` saves drafting instead, by
    stopping a position-by-position drafter at θ).
    """

    table: dict[int, dict[int, float]]
    draft_step_ms: float = 0.0
    overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.table or any(not row for row in self.table.values()):
            raise ValueError("cost table needs at least one batch size with one measurement")
        self._bs = sorted(self.table)

    @classmethod
    def measure(cls, runner, batch_sizes: Sequence[int], max_tokens_per_row: int, context: int = 512,
                iters: int = 10, draft_step_ms: float = 0.0, repeats: int = 3) -> "CostModel":
        """Time ``runner.measure_step_ms`` for every (b, q), q = 1..max_tokens_per_row (the
        context is capped so it fits the runner's cache). Each entry is the minimum of ``repeats``
        timings (each the mean of ``iters`` steps), taken in interleaved sweeps over the table:
        scheduling noise only ever adds time, and on a busy host one preempted timing made T(1, 2)
        ten times T(1, 1), which stopped all drafting."""
        context = max(0, min(context, runner.cache.capacity - max_tokens_per_row))
        shapes = [(b, q) for b in batch_sizes if b <= runner.cache.num_slots for q in range(1, max_tokens_per_row + 1)]
        best: dict[tuple[int, int], float] = {}
        for _ in range(max(1, repeats)):
            for b, q in shapes:
                t = runner.measure_step_ms(b, q, context, iters)
                best[b, q] = min(t, best.get((b, q), math.inf))
        table: dict[int, dict[int, float]] = {}
        for (b, q), t in best.items():
            table.setdefault(b, {})[q] = t
        return cls(table, draft_step_ms)

    def _row(self, b: int, q: int) -> float:
        row = self.table[b]
        if q in row:
            return row[q]
        qs = sorted(row)
        if q < qs[0]:
            return row[qs[0]]
        lo = max(x for x in qs if x <= q)
        hi = next((x for x in qs if x > q), None)
        if hi is None:  # extrapolate with the last slope (or flat with one point)
            if len(qs) == 1:
                return row[lo]
            a, c = qs[-2], qs[-1]
            return row[c] + (row[c] - row[a]) / (c - a) * (q - c)
        return row[lo] + (row[hi] - row[lo]) * (q - lo) / (hi - lo)

    def verify_ms(self, b: int, q: int) -> float:
        """T(b, q) in ms."""
        bs = self._bs
        if b <= bs[0]:
            return self._row(bs[0], q)
        if b >= bs[-1]:
            return self._row(bs[-1], q)
        i = bisect.bisect_left(bs, b)
        if bs[i] == b:
            return self._row(b, q)
        lo, hi = bs[i - 1], bs[i]
        return self._row(lo, q) + (self._row(hi, q) - self._row(lo, q)) * (b - lo) / (hi - lo)

    def round_ms(self, b: int, max_draft: int) -> float:
        """Predicted time of one round: the fixed per-round cost, drafting ``max_draft`` positions
        (``draft_step_ms`` each) and verifying them."""
        return self.overhead_ms + self.verify_ms(b, max_draft + 1) + self.draft_step_ms * max_draft


def expected_emitted(probs: Sequence[float], n: int) -> float:
    """E(n) = 1 + Σ_{i≤n} Π_{j≤i} p_j: expected tokens emitted verifying the first n drafts."""
    total, survive = 1.0, 1.0
    for p in probs[:n]:
        survive *= p
        total += survive
    return total


def threshold_cut(probs: Sequence[float], acceptance_threshold: float, cumulative: bool = False) -> int:
    """Draft length under threshold θ: stop before the first position whose predicted acceptance
    (per token, or the survival product Π p_j with ``cumulative``) falls below θ."""
    survive = 1.0
    for i, p in enumerate(probs):
        survive *= p
        if (survive if cumulative else p) < acceptance_threshold:
            return i
    return len(probs)


@dataclass(frozen=True)
class Allocation:
    """Chosen draft lengths and the objective they reach."""

    lengths: list[int]
    expected_tokens: float  # Σ E_i(n_i) over the batch
    predicted_ms: float  # predicted round time
    tokens_per_ms: float  # the objective: expected emitted tokens per ms


def allocate_draft_lengths(probs: Sequence[Sequence[float]], cost: CostModel, acceptance_threshold: float = 0.0,
                           cumulative: bool = False, max_total_tokens: int | None = None) -> Allocation:
    """Choose every sequence's draft length to maximise expected emitted tokens per unit of
    predicted round time across the batch.

    The verifier pads the batch to the longest row, so a round costs ``round_ms(b, max_i n_i)``.
    For a fixed longest length m every sequence should verify ``min(m, L_i)`` drafts (each extra
    position adds Π p ≥ 0 expected tokens at no extra cost), where ``L_i`` is its θ-cut length;
    the optimum is the best m. With ``max_total_tokens`` (SpecFormer's fixed budget k per batch),
    within each m the budget goes to the positions of largest survival product first, which is
    optimal because survival products decrease along each chain.

    Args:
        probs: per sequence, predicted acceptance probability of each proposed draft position.
        cost: verifier / drafter cost model.
        acceptance_threshold: per-position threshold (0 keeps everything).
        cumulative: apply θ to the survival product instead of each p.
        max_total_tokens: cap on draft tokens summed over the batch (None: no cap).

    Returns:
        The allocation (lengths in input order).
    """
    b = len(probs)
    if b == 0:
        return Allocation([], 0.0, 0.0, 0.0)
    if max_total_tokens is None:  # the width sweep of best_width over the ragged rows
        width = max(len(p) for p in probs)
        padded = np.full((b, width), -1.0)  # past a row's end: below any θ, so its cut
        for i, p in enumerate(probs):
            padded[i, :len(p)] = p
        caps, tokens, ms = _width_sweep(padded, cost, acceptance_threshold, cumulative)
        m = most_tokens_per_ms(tokens, ms)
        return Allocation([min(m, int(c)) for c in caps], float(tokens[m]), float(ms[m]),
                          float(tokens[m] / ms[m]) if ms[m] > 0 else math.inf)
    caps = [threshold_cut(p, acceptance_threshold, cumulative) for p in probs]
    best: Allocation | None = None
    for m in range(0, max(caps) + 1):
        lengths = [min(m, c) for c in caps]
        if max_total_tokens is not None and sum(lengths) > max_total_tokens:
            lengths = _budgeted(probs, lengths, max_total_tokens)
        if max(lengths) < m:
            continue  # the same allocation is reached at a smaller m, more cheaply
        tokens = sum(expected_emitted(p, n) for p, n in zip(probs, lengths))
        ms = cost.round_ms(b, m)
        cand = Allocation(lengths, tokens, ms, tokens / ms if ms > 0 else math.inf)
        if best is None or cand.tokens_per_ms > best.tokens_per_ms + 1e-12:
            best = cand
    return best  # type: ignore[return-value]


def _budgeted(probs: Sequence[Sequence[float]], limits: list[int], budget: int) -> list[int]:
    """Greedy by survival product under a total-token budget (optimal: gains decrease per chain)."""
    gains = []
    for i, (p, lim) in enumerate(zip(probs, limits)):
        survive = 1.0
        for j in range(lim):
            survive *= p[j]
            gains.append((survive, i, j))
    gains.sort(key=lambda g: (-g[0], g[1], g[2]))
    lengths = [0] * len(limits)
    for _, i, _ in gains[:budget]:
        lengths[i] += 1
    return lengths


@dataclass(frozen=True)
class WidthPlan:
    """A chained round's draft width, chosen by ``DraftPolicy.plan_width`` from the predicted
    acceptance of the drafts the device made (one round behind: the round that needs the width is
    queued before the scores of the drafts it verifies are back).

    Attributes:
        width: draft tokens every row of the round may verify (0 .. the drafter's l_d).
        acceptance_threshold: θ the choice was made under (the controller learns it from that round).
        modelled_ms: the cost model's time for the round without the fitted per-round cost (None
            without a cost model).
    """

    width: int
    acceptance_threshold: float
    modelled_ms: float | None = None


def best_width(probs: np.ndarray, cost: CostModel | None, acceptance_threshold: float = 0.0,
               cumulative: bool = False, held: int | None = None, hysteresis: float = 0.0) -> tuple[int, float | None]:
    """The longest row of ``allocate_draft_lengths``'s choice, vectorised over the batch: the
    width m of a padded verify round (every row pays for m drafts, so every row verifies
    ``min(m, L_i)``, L_i its θ-cut length) that maximises expected emitted tokens per predicted ms
    (``cost.round_ms(b, m)``); without a cost model, the longest θ-cut length.

    Args:
        probs: ``[b, L]`` predicted acceptance probability of each row's L draft positions.
        cost: the cost model (its ``overhead_ms`` included), or None.
        acceptance_threshold, cumulative: θ and whether it applies to the survival product.
        held, hysteresis: the width in use, kept unless another is predicted more than
            ``hysteresis`` faster (with a cost model; ``most_tokens_per_ms``).

    Returns:
        ``(m, modelled_ms)``: the width and its predicted round time without ``cost.overhead_ms``
        (None without a cost model). An empty batch gives ``(0, None)``.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[0] == 0 or probs.shape[1] == 0:
        return 0, None
    if cost is None:
        return int(_cuts(probs, acceptance_threshold, cumulative)[0].max()), None
    _, tokens, ms = _width_sweep(probs, cost, acceptance_threshold, cumulative)
    m = most_tokens_per_ms(tokens, ms, held, hysteresis)
    return m, float(ms[m] - cost.overhead_ms)


def _cuts(probs: np.ndarray, acceptance_threshold: float, cumulative: bool) -> tuple[np.ndarray, np.ndarray]:
    """``threshold_cut`` of every row of ``probs`` ``[b, L]`` and the rows' survival products."""
    survive = np.cumprod(probs, axis=1)
    below = (survive if cumulative else probs) < acceptance_threshold
    return np.where(below.any(axis=1), below.argmax(axis=1), probs.shape[1]), survive


def _width_sweep(probs: np.ndarray, cost: CostModel, acceptance_threshold: float,
                 cumulative: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every width m = 0 .. the longest θ-cut length of ``probs`` ``[b, L]``: the rows' cut
    lengths ``[b]``, expected emitted tokens when every row verifies ``min(m, its cut)`` drafts,
    and ``cost.round_ms(b, m)`` (the last two ``[top + 1]``)."""
    b = probs.shape[0]
    caps, survive = _cuts(probs, acceptance_threshold, cumulative)
    gained = np.concatenate([np.zeros((b, 1)), np.cumsum(survive, axis=1)], axis=1)  # [b, L + 1]
    widths = np.arange(int(caps.max()) + 1)
    lens = np.minimum(widths[None, :], caps[:, None])  # [b, top + 1]
    tokens = b + gained[np.arange(b)[:, None], lens].sum(axis=0)
    return caps, tokens, np.array([cost.round_ms(b, int(m)) for m in widths])


def most_tokens_per_ms(tokens: np.ndarray, ms: np.ndarray, held: int | None = None, hysteresis: float = 0.0) -> int:
    """The width of most expected tokens per ms (ties: the narrower, the first); the width in use
    ``held`` stays unless the best is predicted more than ``hysteresis`` (a fraction) faster."""
    rate = tokens / np.maximum(ms, 1e-9)
    m = int(np.argmax(rate))
    if held is not None and 0 <= held < len(rate) and rate[m] <= rate[held] * (1.0 + hysteresis):
        return held
    return m


class DraftPolicy:
    """Context-aware draft lengths for the engine: score each proposed position, cut by θ and
    allocate across the batch, then learn θ from the measured round goodput.

    Args:
        score: ``features [n, F] -> acceptance probabilities [n]`` (the learned predictor's
            ``predict``; ``entropy_score`` for the entropy-only rule).
        controller: online threshold θ (None: the fixed ``acceptance_threshold``).
        cost: verifier cost model for the batch-wide allocation (None: θ cut only).
        acceptance_threshold: fixed threshold when there is no controller.
        cumulative: cut on the survival product instead of each position's probability.
        max_total_tokens: draft tokens per round over the whole batch (None: no cap).
        branch_top_m: hard-position enhancement: where θ cut a draft, verify the m most likely
            tokens of that position together as leaves of a small token tree (0/1: off). The
            extra tokens count against ``max_total_tokens``.
        store, store_key: keep the threshold controller's state in a ``tandem.state`` store (Redis:
            it outlives the replica): loaded at start, saved every ``sync_every`` rounds. A store
            that is down is logged and skipped; θ keeps learning locally.
        overhead_rate: weight of each round in the online fit of the fixed per-round cost.
        device_score: ``score`` as device work (``features [n, F]`` on any device -> ``[n]``
            probabilities there, no host transfer), for chained rounds: a drafter that drafts
            from the verify pass scores its drafts inside the round with it
            (``SpecFormerDrafter.set_acceptance_scorer``) and the policy then picks each round's
            width from those scores (``plan_width``). None: host-drafted rounds only.
        hysteresis: chained rounds keep the width in use unless the cost model predicts another
            at least this much faster (a fraction): near ties are equally good, and every width a
            round uses is a verify shape (a CUDA graph per batch bucket and context) to capture —
            measured on an H100, 3-4 captures inside a timed pass cost 10-25% of its throughput.

    Two ways to apply it. In host-drafted rounds the drafts' features reach the host, every
    sequence's drafts are cut to its own length (``apply``) and the round verifies each row as
    long as it was cut. In chained rounds (``Engine.chains_rounds``; the drafter scores on the
    device) the host never waits for the drafts: the round's one copy brings back the predicted
    acceptance of the drafts the device made for the next round, and ``plan_width`` picks the
    width of the round after that (one round behind): a padded verify round costs its widest row,
    so the width is the decision that can save time: the θ cut, then the cost model where there is
    one (a θ learned online does not cut then; ``plan_width``).

    θ from outside. While ``threshold_override`` is set (a router's cluster-wide choice, renewed
    with every ``Load`` poll) it replaces the controller's next candidate; the controller goes on
    learning from the rounds run under it, so when the override lapses the replica's own θ picks
    up with everything the cluster's choice taught it.

    Round-cost calibration. T(b, q) is measured at start-up, but a round also carries host work
    (drafting, packing, verification, rollback) that does not depend on how many drafts are
    verified. Left out, it makes every verified draft look expensive relative to the round and the
    allocation cuts drafts that would have paid (measured on the H200: at batch 64 a round took
    29.5 ms against T(64, 6) = 4.6 ms). After every round the policy updates
    ``overhead_ms ← (1 − r) · overhead_ms + r · max(0, measured − modelled)``, where modelled is
    the cost model's prediction for the allocation it chose without the overhead, and allocates the
    next round with that overhead in ``CostModel.round_ms``.
    """

    def __init__(self, score, controller: ThresholdController | None = None, cost: CostModel | None = None,
                 acceptance_threshold: float = 0.5, cumulative: bool = False, max_total_tokens: int | None = None,
                 branch_top_m: int = 0, store=None, store_key: str = "acceptance_threshold", sync_every: int = 32,
                 overhead_rate: float = 0.1, device_score=None, hysteresis: float = 0.03) -> None:
        if not 0.0 < overhead_rate <= 1.0:
            raise ValueError(f"overhead_rate must be in (0, 1], got {overhead_rate}")
        if not hysteresis >= 0.0:
            raise ValueError(f"hysteresis must be >= 0, got {hysteresis}")
        self.hysteresis = hysteresis
        self._held_width: int | None = None  # the chained rounds' width in use (None: none yet)
        self.branch_top_m = branch_top_m
        self.overhead_rate = overhead_rate
        self.overhead_ms = 0.0  # fitted fixed per-round cost (see the class docstring)
        self._modelled_ms: float | None = None  # the last allocation's predicted time without it
        self.store, self.store_key, self.sync_every = store, store_key, sync_every
        self._rounds = 0
        if store is not None and controller is not None:
            state = best_effort(store.get_json, store_key, why="θ starts from its prior")
            if state:
                try:
                    controller.load_state_dict(state)
                except (KeyError, ValueError) as exc:
                    log.warning("ignoring θ state in the store (%s)", exc)
        self.score = score
        self.device_score = device_score
        self.controller = controller
        self.cost = cost
        self.fixed_threshold = acceptance_threshold
        self.cumulative = cumulative
        self.max_total_tokens = max_total_tokens
        self._threshold_used = acceptance_threshold
        # θ set from outside (a router's cluster-wide choice, ``services.router.budget``): used in place
        # of the controller's next candidate while set; the controller still learns from those rounds
        self.threshold_override: float | None = None
        self._round_open = False  # begin_round chose θ for a round that lengths() has not closed
        self._scored: dict[int, list[float]] = {}  # slot -> keep_drafting's p per position this round

    def begin_round(self):
        """Choose this round's θ (the controller's next candidate, or the fixed θ) and return the
        keep-drafting rule for ``Drafter.propose``'s ``keep_drafting``: draft a sequence while its
        last position's predicted acceptance (or, with ``cumulative``, its survival product) is at
        least θ. The first position below θ is still drafted, so ``lengths`` can cut there and
        branch on its top candidates; ``lengths`` then uses the same θ."""
        self._threshold_used = self._learned_threshold() if self.controller is not None else self.fixed_threshold
        self._round_open = True
        self._scored = {}
        return self.keep_drafting

    def keep_drafting(self, slots: Sequence[int], features) -> list[bool]:
        """The early-stop rule of ``begin_round``: ``features`` ``[n, F]`` of the position just drafted
        for each slot in ``slots`` -> keep drafting it?"""
        if len(slots) == 0:
            return []
        out = []
        for slot, p in zip(slots, self.score(features).tolist()):
            scored = self._scored.setdefault(slot, [])
            scored.append(p)
            out.append((math.prod(scored) if self.cumulative else p) >= self._threshold_used)  # survival: Π p so far
        return out

    def lengths(self, features: Sequence, scores: Sequence | None = None) -> list[int]:
        """Draft length per sequence from each sequence's features ``[n_i, F]``; a sequence whose
        ``scores[i]`` (``[n_i]`` acceptance probabilities its drafter computed) is given uses
        those instead of ``score(features)``."""
        import torch

        if not self._round_open:  # no begin_round this round (e.g. a caller without early stop)
            self.begin_round()
        self._round_open = False
        self._scored = {}
        acceptance_threshold = self._threshold_used
        sizes = [f.shape[0] for f in features]
        if not any(sizes):
            return sizes
        given = list(scores) if scores is not None else [None] * len(sizes)
        todo = [f for f, g in zip(features, given) if f.shape[0] and g is None]
        flat = self.score(torch.cat(todo)).tolist() if todo else []
        probs, i = [], 0
        for n, g in zip(sizes, given):
            if g is not None:
                probs.append([float(x) for x in g[:n]])
                continue
            probs.append(flat[i:i + n])
            i += n
        if self.cost is None:
            return [threshold_cut(p, acceptance_threshold, self.cumulative) for p in probs]
        cost = replace(self.cost, overhead_ms=self.overhead_ms)  # never mutates a shared cost model
        alloc = allocate_draft_lengths(probs, cost, acceptance_threshold, self.cumulative, self.max_total_tokens)
        self._modelled_ms = alloc.predicted_ms - self.overhead_ms
        return alloc.lengths

    def apply(self, proposals: list, slots: Sequence[int] | None = None) -> list:
        """Cut every proposal to its allocated length, then branch at hard positions.

        ``slots`` (one per proposal) lets a proposal without ``scores`` reuse the acceptance
        probabilities ``keep_drafting`` already computed for its slot this round (same features,
        same score), so a drafter that stops early is not scored twice per round; a slot whose
        recorded count differs from its proposal's length is scored afresh."""
        scores = [p.scores for p in proposals]
        if slots is not None and self._round_open:  # the scores of this round's begin_round only
            for i, (p, s) in enumerate(zip(proposals, slots)):
                recorded = self._scored.get(s)
                if scores[i] is None and recorded is not None and len(recorded) == len(p.tokens):
                    scores[i] = recorded
        keep = self.lengths([p.features for p in proposals], scores)
        out = [p.truncated(n) for p, n in zip(proposals, keep)]
        if self.branch_top_m > 1:
            spare = None if self.max_total_tokens is None else self.max_total_tokens - sum(len(p.tokens) for p in out)
            for i, (p, n) in enumerate(zip(proposals, keep)):
                if n < len(p.tokens) and p.top_tokens is not None and (spare is None or spare >= self.branch_top_m - 1):
                    out[i] = p.branched(n, self.branch_top_m)
                    if spare is not None:
                        spare -= len(out[i].tokens) - n
        return out

    @property
    def chains(self) -> bool:
        """The policy can run in chained rounds (``plan_width``): not with hard-position
        branching, whose token trees are built on the host from each draft's features
        (host-drafted rounds)."""
        return self.branch_top_m <= 1

    @property
    def needs_scores(self) -> bool:
        """``plan_width`` reads the drafts' predicted acceptance (the drafter must score them)."""
        return True

    def plan_width(self, scores, limit: int, rows: int | None = None) -> WidthPlan:
        """The width of a chained round, at most ``limit``, from the predicted acceptance
        ``scores`` ``[b, L]`` of the drafts the device made for its b rows: ``best_width``, the θ
        cut and then, with a cost model, the width that maximises expected emitted tokens per
        predicted ms (with the fitted per-round cost). θ is the fixed θ, or the controller's next
        candidate when θ is learned online and there is no cost model; a learned θ under a cost
        model is 0 (no cut: the cost model alone decides). No scores (no row drafted yet): ``limit``.

        Why a learned θ does not cut under a cost model here: a chained round's width is one
        decision for the whole batch, so a θ the controller explores (0.9, say) cuts every row's
        drafts at once; measured on the H200 at batch 64 that exploration cost a quarter of the
        throughput (docs/benchmarks.md, "Context-aware ablation over SpecFormer"), while the cost
        model already prices each extra position against what the batch expects to gain from it."""
        if self.controller is None:
            acceptance_threshold = self.fixed_threshold
        else:
            acceptance_threshold = 0.0 if self.cost is not None else self._learned_threshold()
        if scores is None or len(scores) == 0:
            self._held_width = limit
            return WidthPlan(limit, acceptance_threshold)
        cost = None if self.cost is None else replace(self.cost, overhead_ms=self.overhead_ms)
        width, modelled = best_width(np.asarray(scores)[:, :limit], cost, acceptance_threshold, self.cumulative,
                                     self._held_width, self.hysteresis)
        self._held_width = width
        return WidthPlan(width, acceptance_threshold, modelled)

    def _learned_threshold(self) -> float:
        """θ for a round when θ is learned: the outside choice while one is set, else the
        controller's next candidate."""
        return self.threshold_override if self.threshold_override is not None else self.controller.current()

    @property
    def learns_threshold(self) -> bool:
        """θ is learned online (a controller), so an outside θ (``threshold_override``) applies."""
        return self.controller is not None

    def observe(self, emitted_tokens: int, round_ms: float, plan: WidthPlan | None = None, drafting=None) -> None:
        """Feed one round's outcome (tokens emitted, measured round time in ms) to the θ
        controller and to the fit of the fixed per-round cost; ``plan`` is the chained round's
        ``plan_width`` (None: the host-drafted round ``lengths`` last allocated); ``drafting``
        the round's ``SpecDecodeStats`` of the rows that drafted (``BatchWidthPolicy`` reads it)."""
        modelled = self._modelled_ms if plan is None else plan.modelled_ms
        threshold = self._threshold_used if plan is None else plan.acceptance_threshold
        if modelled is not None and round_ms > 0:
            residual = max(0.0, round_ms - modelled)
            self.overhead_ms += self.overhead_rate * (residual - self.overhead_ms)
        if plan is None:
            self._modelled_ms = None
        if self.controller is not None:
            self.controller.observe(emitted_tokens, round_ms, acceptance_threshold=threshold)
            self._rounds += 1
            if self.store is not None and self._rounds % self.sync_every == 0:
                best_effort(self.store.set_json, self.store_key, self.controller.state_dict(), why="θ stays local")


class RandomLengthPolicy(DraftPolicy):
    """Draft length drawn uniformly from 0..n per sequence (n = the proposal's length): the
    context-aware ablation's "random length" row (``SpeculativeConfig(policy="random")``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(score=None)
        self._rng = random.Random(seed)

    def begin_round(self):
        return None  # lengths are drawn after drafting: no early stop

    def lengths(self, features, scores=None) -> list[int]:
        return [self._rng.randint(0, f.shape[0]) for f in features]

    @property
    def needs_scores(self) -> bool:
        return False

    def plan_width(self, scores, limit: int, rows: int | None = None) -> WidthPlan:
        """Chained rounds: the round's width drawn uniformly from 0..``limit`` (scores unread)."""
        return WidthPlan(self._rng.randint(0, limit), self.fixed_threshold)


def entropy_score(features):
    """The entropy-only rule as a probability: exp(−entropy of q) (1 for a one-hot draft)."""
    return (-features[:, 0]).exp()


def parse_acceptance_threshold(acceptance_threshold: str | float) -> float | None:
    """``--acceptance-threshold``: None for "auto" (the online ``ThresholdController``), else the
    fixed threshold.

    Raises:
        ConfigError: not "auto" and not a number in [0, 1].
    """
    from .errors import ConfigError

    if acceptance_threshold == "auto":
        return None
    try:
        value = float(acceptance_threshold)
    except (TypeError, ValueError):
        value = -1.0
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ConfigError(f"--acceptance-threshold must be a number in [0, 1] or auto, got {acceptance_threshold!r}")
    return value
