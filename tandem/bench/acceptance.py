"""Drafter quality on a prompt set: acceptance rate and mean accepted length, overall and per
category (docs/architecture.md ("Metrics") definitions; Spec-Bench categories)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..data import PromptRecord
from ..metrics import SpecDecodeStats
from ..sampling import SamplingParams


@dataclass
class AcceptanceReport:
    """Speculative decoding quality of one drafter on ``prompts`` prompts (greedy).

    Attributes:
        drafter: drafter name; num_draft_tokens: k (or l_d).
        overall / per_category: ``SpecDecodeStats.to_dict()`` (acceptance_rate, mean_accepted_length, ...).
        wall_s: wall time of the run (s); output_tokens: tokens generated.
    """

    drafter: str
    num_draft_tokens: int
    prompts: int
    max_tokens: int
    wall_s: float
    output_tokens: int
    overall: dict
    per_category: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def measure_acceptance(engine, records: list[PromptRecord], max_tokens: int = 256,
                       on_finish=None) -> tuple[AcceptanceReport, list]:
    """Run ``records`` greedily (chat template) through ``engine`` and aggregate the speculative
    decoding counters per category (all 1.0 / zero for an engine without a drafter).

    Returns:
        The report and the completions (record order; their token ids serve lossless checks).
    """
    t0 = time.perf_counter()
    results = engine.generate([r.text for r in records], SamplingParams(max_tokens=max_tokens), on_finish=on_finish)
    wall = time.perf_counter() - t0
    overall, per_cat = SpecDecodeStats(), {}
    for rec, c in zip(records, results):
        overall.merge(c.spec)
        per_cat.setdefault(rec.category, SpecDecodeStats()).merge(c.spec)
    name = engine.drafter.name if engine.drafter is not None else "none"
    report = AcceptanceReport(name, engine.num_draft_tokens, len(records), max_tokens, wall,
                              sum(c.completion_tokens for c in results), overall.to_dict(),
                              {k: v.to_dict() for k, v in sorted(per_cat.items())})
    return report, results
