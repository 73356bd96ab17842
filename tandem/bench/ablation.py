"""Context-aware drafting ablation, shaped like the context-aware paper's ablation table:
fixed k; random length; entropy threshold without the learned predictor; predictor without
enhancement; the full system (predictor + online τ + batch allocation + hard-position
branching) — all on the same prompts, drafter and engine, beside target-only decoding.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..control import CostModel, DraftPolicy, TauController, entropy_score
from ..drafters.base import Drafter
from ..engine import Engine
from ..metrics import SpecDecodeStats
from ..models.runner import RunnerConfig
from ..models.weights import Checkpoint
from ..predictor import AcceptancePredictor
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer


class RandomLengthPolicy(DraftPolicy):
    """Draft length drawn uniformly from 0..n per sequence (the paper's "random length" row)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(score=None)
        self._rng = random.Random(seed)

    def lengths(self, features, scores=None) -> list[int]:
        return [self._rng.randint(0, f.shape[0]) for f in features]


@dataclass(frozen=True)
class AblationRow:
    """One configuration's result (greedy; speedup over target-only in the same run)."""

    name: str
    output_tokens: int
    wall_s: float
    tps: float
    speedup: float
    acceptance_rate: float
    mean_accepted_length: float
    drafted: int
    identical: int
    prompts: int

    def to_dict(self) -> dict:
        return asdict(self)


def run_ablation(checkpoint: Checkpoint, tokenizer: Tokenizer, runner_config: RunnerConfig,
                 make_drafter: Callable[[], Drafter], predictor: AcceptancePredictor, prompts: list[str],
                 max_tokens: int = 256, k: int = 5, batch_size: int = 1, branch_top_m: int = 3,
                 progress: Callable[[str], None] | None = None) -> list[AblationRow]:
    """Run every configuration over ``prompts`` (greedy) and compare with target-only.

    Each configuration runs twice and the second pass is timed (the first warms caches and CUDA
    graphs). Outputs are compared token for token with target-only decoding.
    """
    params = SamplingParams(max_tokens=max_tokens)

    def timed(engine: Engine):
        engine.max_running = batch_size
        engine.generate(prompts, params)
        engine.stats = SpecDecodeStats()
        t0 = time.perf_counter()
        res = engine.generate(prompts, params)
        return res, time.perf_counter() - t0

    base_engine = Engine(checkpoint, runner_config, tokenizer=tokenizer)
    cost = CostModel.measure(base_engine.runner, [batch_size], k + branch_top_m + 1, iters=3)
    base, base_wall = timed(base_engine)
    base_tokens = sum(r.completion_tokens for r in base)
    base_tps = base_tokens / base_wall
    rows = [AblationRow("target-only", base_tokens, base_wall, base_tps, 1.0, float("nan"), 1.0, 0, len(base), len(base))]
    del base_engine
    configs: list[tuple[str, Callable[[], DraftPolicy | None]]] = [
        (f"fixed k={k}", lambda: None),
        ("random length", lambda: RandomLengthPolicy(seed=0)),
        ("entropy threshold (no predictor)", lambda: DraftPolicy(entropy_score, controller=TauController())),
        ("predictor, no enhancement", lambda: DraftPolicy(predictor.predict, controller=TauController(), cost=cost)),
        (f"full system (+ top-{branch_top_m} branching)",
         lambda: DraftPolicy(predictor.predict, controller=TauController(), cost=cost, branch_top_m=branch_top_m)),
    ]
    for name, make_policy in configs:
        if progress is not None:
            progress(name)
        engine = Engine(checkpoint, runner_config, tokenizer=tokenizer, drafter=make_drafter(), num_draft_tokens=k,
                        draft_policy=make_policy())
        res, wall = timed(engine)
        tokens = sum(r.completion_tokens for r in res)
        st = engine.stats
        rows.append(AblationRow(name, tokens, wall, tokens / wall, (tokens / wall) / base_tps, st.acceptance_rate,
                                st.mean_accepted_length, st.num_drafted,
                                sum(a.token_ids == b.token_ids for a, b in zip(res, base)), len(res)))
    return rows
