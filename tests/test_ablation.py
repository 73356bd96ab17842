"""CPU quick run of the context-aware ablation (the full run is on the GPU, docs/benchmarks.md)."""

import math

import numpy as np

from tandem.bench.ablation import run_ablation
from tandem.drafters import DraftModelDrafter
from tandem.models import load_checkpoint
from tandem.models.runner import RunnerConfig
from tandem.predictor import train_predictor
from tandem.tokenizer import load_tokenizer


def test_ablation_quick_run_is_lossless_and_complete(tiny_checkpoint):
    target = load_checkpoint(tiny_checkpoint("llama", with_tokenizer=True))
    draft = load_checkpoint(tiny_checkpoint("llama", with_tokenizer=True, seed=1))
    cfg = RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=128)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (400, 4)).astype(np.float32)
    y = (rng.uniform(size=400) < x[:, 1]).astype(np.float32)
    predictor, _ = train_predictor(x, y, epochs=3)
    rows = run_ablation(target, load_tokenizer(target), cfg, lambda: DraftModelDrafter(draft, cfg), predictor,
                        ["hello there", "count: 1 2 3 4"], max_tokens=10, k=3, batch_size=2, branch_top_m=2)
    names = [r.name for r in rows]
    assert names[0] == "target-only" and len(rows) == 6
    assert any("random" in n for n in names) and any("entropy" in n for n in names) and any("full" in n for n in names)
    for r in rows:
        assert r.identical == r.prompts == 2, r  # greedy: every configuration is lossless
        assert r.output_tokens == rows[0].output_tokens
        assert r.tps > 0 and math.isfinite(r.speedup) and r.mean_accepted_length >= 1.0
