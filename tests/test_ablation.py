"""CPU quick run of the context-aware ablation (the full run is on the GPU, docs/benchmarks.md).

The ablation rows are `tandem bench` configurations (tandem.bench.configs.ABLATION_CONFIGS): they
share each batch size's target engine and warm-up, and report like every other configuration.
"""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tandem.bench.configs import ABLATION_CONFIGS, BenchOptions, parse_configs
from tandem.bench.spec_bench import run_benchmark
from tandem.cli import main
from tandem.data import PromptRecord
from tandem.models import load_checkpoint
from tandem.models.runner import RunnerConfig
from tandem.predictor import train_predictor
from tandem.tokenizer import load_tokenizer


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    """Tiny target, a differently seeded tiny draft model and a predictor file."""
    out = tmp_path_factory.mktemp("ablation")
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (400, 4)).astype(np.float32)
    y = (rng.uniform(size=400) < x[:, 1]).astype(np.float32)
    predictor, report = train_predictor(x, y, epochs=3)
    predictor.save(out / "predictor.safetensors", report)
    target = tiny_checkpoint("llama", with_tokenizer=True)
    draft = tiny_checkpoint("llama", with_tokenizer=True, seed=1)
    return target, draft, out / "predictor.safetensors"


def test_ablation_rows_are_lossless_and_complete(setup):
    target, draft, predictor = setup
    ck = load_checkpoint(target)
    records = [PromptRecord(str(i), c, p) for i, (c, p) in
               enumerate([("writing", "hello there"), ("math", "count: 1 2 3 4"), ("qa", "what is a cat?")])]
    options = BenchOptions(num_draft_tokens=3, draft_model=str(draft), ca_drafter="draft-model",
                           predictor=str(predictor))
    report = run_benchmark(ck, load_tokenizer(ck), RunnerConfig(device="cpu", max_seq_len=128), records,
                           parse_configs(",".join(ABLATION_CONFIGS)), [1, 2], options, max_tokens=10, limit=2,
                           progress=False)
    for b in (1, 2):
        rows = [r for r in report.results if r.batch_size == b]
        assert [r.config for r in rows] == list(ABLATION_CONFIGS)
        for r in rows:
            assert r.lossless_share == 1.0, r  # greedy: every row is lossless
            assert r.output_tokens == rows[0].output_tokens
            assert r.tps > 0 and math.isfinite(r.speedup) and r.mean_accepted_length >= 1.0
        assert all(r.k == 3 for r in rows[1:])
        assert report.get("fixed-k", b).drafted > 0


def test_ablation_cli(setup, tmp_path):
    target, draft, predictor = setup
    base = ["bench", "--ablation", "--model", str(target), "--device", "cpu", "--drafter", "draft-model",
            "--draft-model", str(draft), "--num-draft-tokens", "3", "--batch-sizes", "2", "--limit", "2",
            "--max-tokens", "6"]
    res = CliRunner().invoke(main, base + ["--predictor", str(predictor), "--out", str(tmp_path / "abl")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "abl" / "results.json").read_text())
    assert [r["config"] for r in data["results"]] == list(ABLATION_CONFIGS)
    assert data["meta"]["options"]["ca_drafter"] == "draft-model"
    # no predictor given and none next to the draft model's weights: refused before anything runs
    res = CliRunner().invoke(main, base + ["--predictor", "auto"])
    assert res.exit_code == 2 and "predictor rows need --predictor" in res.output
    res = CliRunner().invoke(main, base + ["--configs", "target,ngram"])
    assert res.exit_code == 2 and "drop --configs" in res.output
