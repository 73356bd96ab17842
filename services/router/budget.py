"""The router's cluster-level draft-token budget: how many drafts per sequence each verifier
replica's rounds may verify, from the acceptance the whole cluster sees and each replica's load
and cost model.

Why at the router: a replica's scheduler only sees its own rounds, while the router sees every
request that finishes on any replica (their per-position acceptance, ``SpecDecodeStats``) and every
replica's load (``Load`` polls); the replicas also report the acceptance of their own recent
requests, whichever router sent them (``DraftBudget``). SpecFormer's result is that at large batch, verifying k drafts
per sequence costs more than it saves unless the batch's draft tokens are budgeted; the budget
here is the width m (drafts per sequence) that maximises a replica's modelled goodput,

    running x E[tokens | m] / T(running, m + 1),

with E from the cluster's per-position acceptance over each replica's last ``WINDOW`` finished requests
(``tandem.control.best_width``: the same sweep a replica's context-aware policy runs per round)
and T(b, q) the replica's measured verify cost (``VerifierInfo.cost``). The replica's draft-token
budget is m x its running requests; its engine caps every round at m (``Engine.width_cap``; a
chained round's graph narrows with it), and its own policy, if any, allocates within. A replica
without a measured cost model, or a cluster with too few drafts seen, gets no budget (its
configuration's k stands). Decisions are sent with the next ``Load`` poll, counted in the router's
metrics (``tandem_router_draft_width{replica}``, ``tandem_router_draft_budget_tokens{replica}``)
and traced (a ``budget`` span per change).

The acceptance threshold θ is the cluster's too. A replica whose policy learns θ online reports its
controller's state with every ``Load`` poll (per candidate θ: discounted rounds, emitted tokens
and ms, ``ThresholdState``); the router sums the states of every healthy replica
(``ThresholdController.merged``) and sends each of them the merged controller's next candidate
(``ThresholdController.current``: the discounted-UCB choice over the cluster's goodput per θ), so
one replica's exploration of a θ informs all of them and a new replica starts from what the
cluster measured. A replica uses the router's θ in place of its own controller's while polls renew
it; its controller still learns from those rounds. Decisions show as
``tandem_router_acceptance_threshold{replica}`` and in the ``budget`` span.
"""

from __future__ import annotations

import logging

import numpy as np

from tandem.control import CostModel, best_width
from tandem.threshold import ThresholdController
from tandem.metrics import ACCEPTANCE_WINDOW, AcceptanceWindow, SpecDecodeStats, conditional_acceptance
from tandem.telemetry import span

log = logging.getLogger(__name__)

WINDOW = ACCEPTANCE_WINDOW  # finished requests whose acceptance the budget reads, per replica (the most recent)
MIN_DRAFTS = 64  # draft tokens seen at position 0 before the budget trusts the acceptance


class DraftBudget:
    """Per-replica draft widths and θ from the cluster's acceptance and each replica's load (see the
    module docstring). Thread-safe: requests finish on the event loop, decisions are made on the
    router's polling thread.

    Where the acceptance comes from: every replica reports the per-position counts of its last
    ``WINDOW`` finished requests with each ``Load`` poll (``LoadReport.recent_drafted_per_pos``), so
    their sum is the cluster's, whichever router sent the requests, and several routers decide from
    the same figures. While the replicas' reports hold fewer than ``min_drafts`` drafts at position
    0, the requests this router saw finish (``observe``) stand in."""

    def __init__(self, window: int = WINDOW, min_drafts: int = MIN_DRAFTS) -> None:
        self._own = AcceptanceWindow(window)
        self.min_drafts = min_drafts
        self.widths: dict[str, int] = {}  # replica address -> the width last decided
        self.thresholds: dict[str, float] = {}  # replica address -> the θ last decided

    def observe(self, spec: SpecDecodeStats) -> None:
        """Count a finished request's drafted / accepted tokens per draft position."""
        self._own.observe(spec)

    def acceptance(self, replicas=()) -> list[float] | None:
        """Per-position conditional acceptance: over the healthy ``replicas``' reported windows,
        else over the requests this router saw finish; None with fewer than ``min_drafts``
        drafts at position 0 either way."""
        drafted: list[int] = []
        accepted: list[int] = []
        for r in replicas:
            if r.healthy and r.report is not None:
                for total, part in ((drafted, r.report.recent_drafted_per_pos),
                                    (accepted, r.report.recent_accepted_per_pos)):
                    total.extend([0] * (len(part) - len(total)))
                    for i, x in enumerate(part):
                        total[i] += int(x)
        if not drafted or drafted[0] < self.min_drafts:
            drafted, accepted = self._own.totals()
        if not drafted or drafted[0] < self.min_drafts:
            return None
        return conditional_acceptance(drafted, accepted)

    def width(self, replica, replicas=()) -> int | None:
        """The width for ``replica`` (a ``services.router.replicas.Replica`` with a recent report
        and its ``VerifierInfo``) under the acceptance of ``replicas`` (``acceptance``), or None
        when there is nothing to decide on (no cost model, no drafter, no report, too little
        acceptance seen)."""
        return self._width(replica, self.acceptance(replicas))

    def _width(self, replica, acc: list[float] | None) -> int | None:
        """``width`` under an acceptance already computed."""
        report, cost = replica.report, replica.cost_model
        if acc is None or report is None or cost is None or not report.draft_limit:
            return None
        limit = int(report.draft_limit)
        acc = (acc + [acc[-1]] * limit)[:limit]  # positions never drafted yet: as the last one seen
        m, _ = best_width(np.tile(np.asarray(acc, dtype=np.float64), (round_batch(report), 1)), cost)
        return int(m)

    def decide(self, replica, metrics=None, replicas=()) -> int | None:
        """``width`` for a healthy ``replica`` (under the acceptance of ``replicas``), recorded
        (gauges, and a ``budget`` span and a log line when it changes); an unhealthy one, or one
        without a decision, has its gauges removed."""
        return self._record(replica, self.width(replica, replicas) if replica.healthy else None, metrics)

    def decide_widths(self, replicas, metrics=None) -> dict[str, int | None]:
        """``decide`` for every replica, under one acceptance summed once over ``replicas``."""
        acc = self.acceptance(replicas)
        return {r.address: self._record(r, self._width(r, acc) if r.healthy else None, metrics) for r in replicas}

    def _record(self, replica, m: int | None, metrics) -> int | None:
        if m is None:
            if metrics is not None:
                metrics.clear_replica_budget(replica.address)
            self.widths.pop(replica.address, None)
            return None
        batch = round_batch(replica.report)
        if metrics is not None:
            metrics.set_replica_budget(replica.address, m, m * batch)
        if self.widths.get(replica.address) != m:
            with span("budget", replica=replica.address, draft_width=m, batch_size=batch,
                      draft_limit=int(replica.report.draft_limit)):
                log.info("replica %s: draft width %d (budget %d draft tokens a round, %d sequence%s a round)",
                         replica.address, m, m * batch, batch, "" if batch == 1 else "s")
            self.widths[replica.address] = m
        return m

    def decide_thresholds(self, replicas, metrics=None) -> dict[str, float]:
        """θ for every healthy replica that learns θ (its report carries ``threshold``): the next
        candidate of the controller merged from all of them (replicas of another grid form their
        own group). Recorded like widths (gauge; a ``budget`` span and a log line on a change)."""
        groups: dict[tuple, list] = {}
        for r in replicas:
            if r.healthy and r.report is not None and r.report.HasField("threshold"):
                groups.setdefault(tuple(round(x, 4) for x in r.report.threshold.grid), []).append(r)
        decided: dict[str, float] = {}
        merged_over: dict[str, int] = {}  # replica -> how many replicas' rounds its θ was chosen over
        for members in groups.values():
            try:
                cluster = ThresholdController.merged([threshold_state(r.report.threshold) for r in members])
            except ValueError as exc:  # a malformed report: those replicas keep their own θ
                log.warning("cannot merge θ controller states of %s: %s", [r.address for r in members], exc)
                continue
            theta = float(cluster.current())
            for r in members:
                decided[r.address], merged_over[r.address] = theta, len(members)
        for r in replicas:
            theta = decided.get(r.address)
            if theta is None:
                self.thresholds.pop(r.address, None)
                if metrics is not None:
                    metrics.clear_replica_threshold(r.address)
                continue
            if metrics is not None:
                metrics.set_replica_threshold(r.address, theta)
            if self.thresholds.get(r.address) != theta:
                n = merged_over[r.address]
                with span("budget", replica=r.address, acceptance_threshold=theta, replicas_merged=n):
                    # debug: the bandit's exploration moves θ every few polls (the span and the gauge keep it)
                    log.debug("replica %s: acceptance threshold %.2f (chosen over the rounds of %d replica%s)",
                             r.address, theta, n, "" if n == 1 else "s")
                self.thresholds[r.address] = theta
        return decided


def threshold_state(m) -> dict:
    """A ``ThresholdState`` message as ``ThresholdController.state_dict`` writes it."""
    return {"grid": [float(x) for x in m.grid], "counts": list(m.rounds), "tokens": list(m.tokens), "ms": list(m.ms)}


def round_batch(report) -> int:
    """Sequences a replica's round verifies as its report implies: its running and waiting
    requests, at most its KV slots (and at least 1: an idle replica's next round)."""
    return max(1, min(int(report.num_slots), int(report.running) + int(report.waiting)))


def cost_model(points) -> CostModel | None:
    """A ``CostModel`` from a replica's ``VerifierInfo.cost`` points (None when it measured none)."""
    table: dict[int, dict[int, float]] = {}
    for p in points:
        table.setdefault(int(p.batch_size), {})[int(p.tokens_per_sequence)] = float(p.ms)
    for row in table.values():  # verifying more tokens never takes less time: timing noise is evened out
        longest = 0.0
        for q in sorted(row):
            longest = row[q] = max(row[q], longest)
    return CostModel(table) if table else None
