"""Speculative decoding metrics, named and defined as in docs/architecture.md ("Metrics").

- acceptance rate α = accepted draft tokens / drafted tokens;
- mean accepted length τ_acc = emitted tokens / target verification steps (bonus included;
  1.0 without speculation; tokens cut by a stop rule are not counted);
- SpecFormer's κ (tokens per target forward under a fixed draft budget) is τ_acc here, since every
  decode step is one target forward: it has no name of its own.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counters for one request or a whole run (``merge`` adds them up)."""

    num_steps: int = 0  # target verification (decode) forwards that emitted tokens
    num_emitted: int = 0  # tokens emitted by those steps
    num_drafted: int = 0
    num_accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)  # index i: drafts at position i+1
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        """One verification step: ``drafted`` drafts, ``accepted`` of them kept, ``emitted`` tokens."""
        self.num_steps += 1
        self.num_emitted += emitted
        self.num_drafted += drafted
        self.num_accepted += accepted
        grow = drafted - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for i in range(drafted):
            self.drafted_per_pos[i] += 1
            if i < accepted:
                self.accepted_per_pos[i] += 1

    def record_run(self, drafted: int, accepted: int, emitted: int, kept: int) -> None:
        """One verification step whose run of ``emitted`` tokens the stop rules cut to ``kept``
        (``kept == emitted`` when no rule fired inside it): the draft counters are cut at the same
        boundary, so a stop token inside an accepted run ends the count there. The one place the
        engine (``Engine._append``) and replay (``tandem.bench.replay.walk``) record a step."""
        if kept < emitted:
            drafted, accepted = min(drafted, kept), min(accepted, kept)
        self.record(drafted, accepted, kept)

    def merge(self, other: "SpecDecodeStats") -> None:
        self.num_steps += other.num_steps
        self.num_emitted += other.num_emitted
        self.num_drafted += other.num_drafted
        self.num_accepted += other.num_accepted
        grow = len(other.drafted_per_pos) - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for i, (d, a) in enumerate(zip(other.drafted_per_pos, other.accepted_per_pos)):
            self.drafted_per_pos[i] += d
            self.accepted_per_pos[i] += a

    def draft_length_counts(self) -> list[int]:
        """Verify steps by how many draft tokens they verified: index n counts the steps with n
        (0 .. the longest seen; every token of a token tree counts). From ``drafted_per_pos``:
        the steps with at least i + 1 drafts are ``drafted_per_pos[i]``."""
        d = self.drafted_per_pos
        if not d:
            return [self.num_steps]
        return [self.num_steps - d[0]] + [d[i] - d[i + 1] for i in range(len(d) - 1)] + [d[-1]]

    @property
    def acceptance_rate(self) -> float:
        """α; NaN when nothing was drafted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """τ_acc (1.0 when no decode step ran)."""
        return self.num_emitted / self.num_steps if self.num_steps else 1.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        """Share of drafts accepted at each draft position."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def to_dict(self) -> dict:
        return {
            "num_steps": self.num_steps, "num_emitted": self.num_emitted, "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted, "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_pos": self.acceptance_per_pos,
        }


ACCEPTANCE_WINDOW = 256  # finished requests an AcceptanceWindow keeps by default (the most recent)


class AcceptanceWindow:
    """Per-position drafted / accepted counts of the last ``window`` finished requests (their
    ``SpecDecodeStats``), for decisions that follow recent acceptance (a router's draft budget; a
    verifier replica reports its window with every ``Load`` poll). Thread-safe.

    Args:
        window: requests kept (the most recent).
    """

    def __init__(self, window: int = ACCEPTANCE_WINDOW) -> None:
        self._recent: deque = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, spec: SpecDecodeStats) -> None:
        """Count a finished request's drafts per position (requests that drafted nothing are skipped)."""
        if spec.drafted_per_pos:
            with self._lock:
                self._recent.append((list(spec.drafted_per_pos), list(spec.accepted_per_pos)))

    def totals(self) -> tuple[list[int], list[int]]:
        """(drafted, accepted) per draft position, summed over the window."""
        with self._lock:
            recent = list(self._recent)
        L = max((len(d) for d, _ in recent), default=0)
        drafted, accepted = [0] * L, [0] * L
        for d, a in recent:
            for i, (x, y) in enumerate(zip(d, a)):
                drafted[i] += x
                accepted[i] += y
        return drafted, accepted


def conditional_acceptance(drafted, accepted) -> list[float]:
    """Per-position conditional acceptance from per-position counts: position i's accepted drafts
    over the drafts examined there (drafted at i with every earlier one accepted); 0 where none was
    examined."""
    out, prev = [], None
    for i, (d, a) in enumerate(zip(drafted, accepted)):
        examined = d if i == 0 else min(d, prev)
        out.append(a / examined if examined > 0 else 0.0)
        prev = a
    return out


def draft_length_lines(spec: SpecDecodeStats, policy: str, k: int | None = None) -> list[str]:
    """What the draft policy chose, over every verification step of the run: the share of steps
    by draft length, and the acceptance at each draft position (no lines without a step). With
    ``k`` (the drafts a step at most), lengths past it are said to be token trees' tokens."""
    counts = spec.draft_length_counts()
    steps = sum(counts)
    if not steps:
        return []
    shares = " | ".join(f"{n}: {c / steps:.0%}" for n, c in enumerate(counts))
    mean = sum(n * c for n, c in enumerate(counts)) / steps
    trees = (f"; more than k = {k} where a token tree branched (its sibling candidates count as drafts)"
             if k is not None and len(counts) > k + 1 else "")
    lines = [f"draft lengths chosen (policy {policy}), share of {steps} verification steps: {shares}; "
             f"mean {mean:.2f} drafts a step (fewer than k where the drafter proposed fewer, as n-gram does without a match, "
             f"or the policy or the room left cut them{trees})"]
    if spec.drafted_per_pos:
        by_pos = " | ".join(f"{i + 1}: {a / d:.2f}" for i, (d, a) in
                            enumerate(zip(spec.drafted_per_pos, spec.accepted_per_pos)) if d)
        lines.append(f"acceptance by draft position (accepted / drafted there): {by_pos}")
    return lines
