"""The batch-width draft policy: every row's draft width from the batch size alone, under the
verifier cost model and the acceptance per draft position seen so far (no drafts scored)."""

from __future__ import annotations

import numpy as np

from .control import CostModel, DraftPolicy, WidthPlan, most_tokens_per_ms


class BatchWidthPolicy(DraftPolicy):
    """Every row's draft width from the batch size alone (``SpeculativeConfig(policy="batch-width")``):
    the width m that maximises expected tokens per predicted ms, (1 + Σ_{i<m} S_i) /
    ``cost.round_ms(b, m)``, where S_i is the share of row-rounds whose first i + 1 drafts were all
    accepted (decayed counts over the rounds so far, ``observe``) and the round time is the verifier's
    T(b, m + 1) plus the fitted per-round cost. Nothing is scored, so the policy adds no device work:
    the width moves with the batch size (a six-slot SpecFormer head verifies six at batch 1, where
    T(1, 7) ≈ T(1, 5), and fewer where width costs) and with the drifting acceptance. A position
    seen in fewer than ``min_evidence`` row-rounds (at the start) is drafted to the full limit; one no
    longer drafted keeps its last estimate.

    The width in use is kept unless another is predicted at least ``hysteresis`` faster: widths
    within the cost model's error of each other are equally good, and every width a round uses is
    a verify shape (a CUDA graph per batch bucket and context) that must have been captured — a
    width that flips between near ties asks for new graphs mid-run (measured on an H100: 3-4
    captures in a timed pass cost 10% of the throughput at batch 64 and 128).

    Args:
        cost: the verifier cost model T(b, q) (its ``overhead_ms`` fitted online, as ``DraftPolicy``).
        decay: weight each round's counts lose per round (1 / decay rounds of memory).
        min_evidence: row-rounds a position needs before its estimate is used.
        hysteresis: how much faster (predicted tokens per ms, as a fraction) another width must be
            to replace the one in use (``DraftPolicy``).

    Raises:
        ValueError: ``decay`` outside (0, 1) or a negative ``hysteresis``.
    """

    def __init__(self, cost: CostModel, decay: float = 0.02, min_evidence: float = 32.0,
                 hysteresis: float = 0.03) -> None:
        super().__init__(score=None, cost=cost, acceptance_threshold=0.0, hysteresis=hysteresis)
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay, self.min_evidence = decay, min_evidence
        self._drafted = np.zeros(0)  # decayed row-rounds with >= i + 1 drafts, per position i
        self._accepted = np.zeros(0)  # of them, the row-rounds whose first i + 1 drafts were accepted
        self._width_ms: dict[tuple[int, int], np.ndarray] = {}  # (b, limit) -> round ms less the overhead, per m

    def begin_round(self):
        return None  # no early stop: the width is known before drafting

    @property
    def needs_scores(self) -> bool:
        return False

    def lengths(self, features, scores=None) -> list[int]:
        """Host-drafted rounds: every proposal cut to the width for this batch."""
        m, self._modelled_ms = self.width(len(features), max((f.shape[0] for f in features), default=0))
        return [min(f.shape[0], m) for f in features]

    def plan_width(self, scores, limit: int, rows: int | None = None) -> WidthPlan:
        """Chained rounds: ``width`` for ``rows`` rows (None: as many as ``scores`` has; scores unread)."""
        m, modelled = self.width(len(scores or ()) if rows is None else rows, limit)
        return WidthPlan(m, 0.0, modelled)

    def width(self, b: int, limit: int) -> tuple[int, float | None]:
        """``(m, modelled_ms)``: the width for a round of ``b`` rows, at most ``limit``, and its
        predicted time without the fitted per-round cost (None while exploring: ``limit``)."""
        if b <= 0 or limit <= 0:
            return limit, None
        if len(self._drafted) < limit or (self._drafted[:limit] < self.min_evidence).any():
            self._held_width = limit  # exploring: the full width is the one in use
            return limit, None
        survive = self._accepted[:limit] / self._drafted[:limit]
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(survive)])  # per row, for m = 0 .. limit
        width_ms = self._width_ms.get((b, limit))
        if width_ms is None:  # T(b, m + 1) and the drafting, per m: fixed for a batch size
            width_ms = self._width_ms[b, limit] = np.array(
                [self.cost.round_ms(b, m) - self.cost.overhead_ms for m in range(limit + 1)])
        m = most_tokens_per_ms(tokens, width_ms + self.overhead_ms, self._held_width, self.hysteresis)
        self._held_width = m
        return m, float(width_ms[m])

    def observe(self, emitted_tokens: int, round_ms: float, plan: WidthPlan | None = None, drafting=None) -> None:
        super().observe(emitted_tokens, round_ms, plan)
        if drafting is None or not drafting.drafted_per_pos:
            return
        drafted = np.asarray(drafting.drafted_per_pos, dtype=np.float64)
        grow = len(drafted) - len(self._drafted)
        if grow > 0:
            self._drafted = np.concatenate([self._drafted, np.zeros(grow)])
            self._accepted = np.concatenate([self._accepted, np.zeros(grow)])
        n = len(drafted)
        seen = drafted > 0  # positions this round drafted: the others keep their counts
        keep = np.where(seen, 1.0 - self.decay, 1.0)
        self._drafted[:n] = self._drafted[:n] * keep + drafted
        self._accepted[:n] = self._accepted[:n] * keep + np.asarray(drafting.accepted_per_pos, dtype=np.float64)
