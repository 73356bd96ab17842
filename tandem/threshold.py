"""Online acceptance threshold θ: a discounted-UCB bandit over candidate thresholds, rewarded by
measured goodput (``ThresholdController``), and the merge of several controllers' states that lets
a router choose θ for a whole cluster (``ThresholdController.merged``).

Used by ``tandem.control.DraftPolicy`` (θ learned on a replica's own rounds) and
``services.router.budget`` (θ chosen over every replica's rounds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence


class ThresholdController:
    """Online θ: a discounted-UCB bandit (Garivier & Moulines 2011) over a grid of thresholds,
    rewarded by measured goodput (emitted tokens per ms of draft + verify time).

    Update rule. For every candidate θ_a the controller keeps discounted sums of the rounds it
    was used in (N_a), of their emitted tokens (S_a) and of their durations (M_a); every
    observation first multiplies all sums by γ, so old rounds fade with a half-life of
    ln 2 / (1 − γ) rounds. Goodput of θ_a is S_a / M_a (a ratio of means: rounds weigh by time,
    as throughput does). The next round uses the θ_a maximising
    ``S_a / M_a + c · g_max · sqrt(ln(Σ N) / N_a)`` (untried candidates first), where g_max is the
    best current goodput, so exploration is scaled to the reward. ``acceptance_threshold`` (the value reported
    and shared) is the candidate with the best goodput. When text gets easier or harder, the
    discounted sums forget the old regime and θ moves to the new optimum; a hill climb would
    stall on a plateau (e.g. θ above every prediction drafts nothing and measures no slope).

    The state is a small dict (``state_dict`` / ``load_state_dict``): a verifier replica keeps it
    in the state store and reports it with every ``Load`` poll, and a router sums its replicas'
    states (``merged``) to choose θ for the whole cluster (``services.router.budget``).

    Args:
        grid: candidate thresholds (default 0.0, 0.1, ..., 0.9).
        gamma: discount per observed round.
        c: exploration weight.
    """

    def __init__(self, grid: Sequence[float] | None = None, gamma: float = 0.995, c: float = 0.1) -> None:
        self.grid = [round(x, 4) for x in (grid if grid is not None else [i / 10 for i in range(10)])]
        if not self.grid:
            raise ValueError("the θ grid is empty")
        self.gamma, self.c = gamma, c
        self.counts = [0.0] * len(self.grid)
        self.tokens = [0.0] * len(self.grid)
        self.ms = [0.0] * len(self.grid)
        self._last = 0
        self.observed_at: float | None = None  # time.monotonic() of the last observed round (None: none yet)

    def goodput(self) -> list[float]:
        """Discounted goodput (tokens / ms) per candidate; NaN where untried."""
        return [t / m if m > 0 else math.nan for t, m in zip(self.tokens, self.ms)]

    @property
    def acceptance_threshold(self) -> float:
        """The best θ so far (the first candidate before any data)."""
        g = self.goodput()
        tried = [i for i, x in enumerate(g) if not math.isnan(x)]
        return self.grid[max(tried, key=lambda i: g[i])] if tried else self.grid[0]

    def current(self) -> float:
        """θ to use for the next round."""
        for i, n in enumerate(self.counts):
            if n == 0:
                self._last = i
                return self.grid[i]
        g = self.goodput()
        g_max = max(g)
        total = sum(self.counts)
        scores = [g[i] + self.c * g_max * math.sqrt(math.log(max(total, 1.0)) / self.counts[i])
                  for i in range(len(self.grid))]
        self._last = max(range(len(self.grid)), key=lambda i: scores[i])
        return self.grid[self._last]

    def observe(self, emitted_tokens: float, round_ms: float, acceptance_threshold: float | None = None) -> None:
        """Report one round: tokens emitted and its duration (ms), run with ``acceptance_threshold`` (default: the
        value the last ``current()`` returned)."""
        if round_ms <= 0:
            return
        i = self._last if acceptance_threshold is None else min(range(len(self.grid)), key=lambda j: abs(self.grid[j] - acceptance_threshold))
        for arr in (self.counts, self.tokens, self.ms):
            for j in range(len(arr)):
                arr[j] *= self.gamma
        self.counts[i] += 1.0
        self.tokens[i] += emitted_tokens
        self.ms[i] += round_ms
        self.observed_at = time.monotonic()

    def state_dict(self) -> dict:
        return {"grid": list(self.grid), "counts": list(self.counts), "tokens": list(self.tokens), "ms": list(self.ms)}

    def load_state_dict(self, state: dict) -> None:
        if [round(x, 4) for x in state["grid"]] != self.grid:
            raise ValueError("threshold controller state was saved with another grid")
        if not len(state["counts"]) == len(state["tokens"]) == len(state["ms"]) == len(self.grid):
            raise ValueError("threshold controller state does not match its grid's length")
        self.counts = [float(x) for x in state["counts"]]
        self.tokens = [float(x) for x in state["tokens"]]
        self.ms = [float(x) for x in state["ms"]]

    @classmethod
    def merged(cls, states: Sequence[dict], gamma: float = 0.995, c: float = 0.1) -> "ThresholdController":
        """One controller over the rounds of several (a cluster's verifier replicas): per candidate,
        the sums of their discounted round counts, tokens and ms (each replica's own discounting
        kept), so goodput is the cluster's tokens over its ms and the exploration bonus counts
        every replica's trials. All states must share one grid.

        Raises:
            ValueError: no states, or states of different grids or malformed ones.
        """
        if not states:
            raise ValueError("no threshold controller states to merge")
        out = cls(grid=states[0]["grid"], gamma=gamma, c=c)
        for state in states:
            part = cls(grid=out.grid)
            part.load_state_dict(state)
            for mine, theirs in ((out.counts, part.counts), (out.tokens, part.tokens), (out.ms, part.ms)):
                for j, x in enumerate(theirs):
                    mine[j] += x
        return out
