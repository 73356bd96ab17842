"""CPU quick run of the context-aware ablation (the full run is on the GPU, docs/benchmarks.md).

The ablation rows are `tandem bench` configurations (tandem.bench.configs.ablation_configs): they
share each batch size's target engine and warm-up, and report like every other configuration.
"""

import gzip
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tandem.bench import replay as replay_mod
from tandem.bench.configs import BenchOptions, ablation_configs, parse_configs
from tandem.bench.spec_bench import run_benchmark
from tandem.cli import main
from tandem.data import PromptRecord
from tandem.models import load_checkpoint
from tandem.models.runner import RunnerConfig
from tandem.predictor import train_predictor
from tandem.tokenizer import load_tokenizer

from helpers import check_acceptance_figures


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
                           parse_configs(",".join(ablation_configs(3))), [1, 2], options, max_tokens=10, limit=2,
                           progress=False, warmup="none")
    for b in (1, 2):
        rows = [r for r in report.results if r.batch_size == b]
        assert [r.config for r in rows] == list(ablation_configs(3))
        for r in rows:
            assert r.lossless_share == 1.0, r  # greedy: every row is lossless
            assert r.output_tokens == rows[0].output_tokens
            assert r.speedup == pytest.approx(r.tps / rows[0].tps)  # rows[0]: target-only
            check_acceptance_figures(r.drafted, r.accepted, r.acceptance_rate, r.mean_accepted_length,
                                     r.output_tokens, r.prompts, r.k)
        assert [r.k for r in rows[1:4]] == [1, 2, 3]  # the fixed-length sweep
        assert all(r.k == 3 for r in rows[4:])
        assert report.get("fixed-k=3", b).drafted > 0


def test_ablation_cli(setup, tmp_path):
    target, draft, predictor = setup
    base = ["bench", "--ablation", "--model", str(target), "--device", "cpu", "--drafter", "draft-model",
            "--draft-model", str(draft), "--num-draft-tokens", "3", "--batch-sizes", "2", "--limit", "2",
            "--max-tokens", "6", "--warmup", "none"]
    res = CliRunner().invoke(main, base + ["--predictor", str(predictor), "--out", str(tmp_path / "abl")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "abl" / "results.json").read_text())
    assert [r["config"] for r in data["results"]] == list(ablation_configs(3))
    assert data["meta"]["options"]["ca_drafter"] == "draft-model"
    assert data["meta"]["options"]["predictor"] == str(predictor)
    # a predictor row picked with --configs records the predictor it ran too
    res = CliRunner().invoke(main, ["bench", "--configs", "target,budget", "--ca-drafter", "draft-model",
                                    "--model", str(target), "--device", "cpu", "--draft-model", str(draft),
                                    "--predictor", str(predictor), "--batch-sizes", "1", "--limit", "1",
                                    "--max-tokens", "4", "--warmup", "none", "--out", str(tmp_path / "one")])
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "one" / "results.json").read_text())["meta"]
    assert meta["configs"] == ["target", "budget"] and meta["options"]["predictor"] == str(predictor)
    # no predictor given and none next to the draft model's weights: refused before anything runs
    res = CliRunner().invoke(main, base + ["--predictor", "auto"])
    assert res.exit_code == 2 and "predictor rows need --predictor" in res.output
    res = CliRunner().invoke(main, base + ["--configs", "target,ngram"])
    assert res.exit_code == 2 and "drop --configs" in res.output


def test_ablation_cli_refuses_bad_options(setup, tmp_path):
    target, draft, predictor = setup
    base = ["bench", "--ablation", "--model", str(target), "--device", "cpu", "--batch-sizes", "1", "--limit", "1",
            "--max-tokens", "4"]
    garbage = tmp_path / "g.safetensors"
    garbage.write_text("not a predictor")
    for extra, message in ((["--drafter", "draft-model", "--draft-model", str(draft), "--predictor", str(garbage)],
                            "is not a Tandem acceptance predictor"),
                           (["--drafter", "draft-model", "--draft-model", str(draft), "--acceptance-threshold", "0.5"], "drop --acceptance-threshold"),
                           (["--drafter", "ngram"], "trained on n-gram verification logs"),
                           (["--drafter", "none"], "--drafter none has none to compare")):  # not read as the default
        res = CliRunner().invoke(main, base + extra)
        assert res.exit_code == 2 and message in res.output, (extra, res.output)


def test_replay_cli_checks_its_input(setup, tmp_path):
    """tandem replay: traces are recorded with the model's fingerprint and checked when read back;
    bad files, ids outside the vocabulary, conflicting options and unwritable outputs are refused."""
    target, _, _ = setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n"
                               for c, p in (("a", "count: 1 2 3 1 2 3"), ("b", "hello hello"))))
    base = ["replay", "--model", str(target), "--device", "cpu", "--drafter", "ngram"]
    res = CliRunner().invoke(main, base + ["--prompts", str(prompts), "--max-tokens", "8",
                                           "--save-traces", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "r.json").read_text())  # strict JSON (no NaN)
    assert data["prompts"] == 2 and data["drafters"]["ngram"]["k"] == 4
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert all(len(json.loads(line)["model"]) == 64 for line in lines)
    res = CliRunner().invoke(main, base + ["--traces", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "r2.json")])
    assert res.exit_code == 0, res.output
    gz = tmp_path / "t.jsonl.gz"  # gzip-compressed traces (as committed) read the same
    gz.write_bytes(gzip.compress((tmp_path / "t.jsonl").read_bytes()))
    res = CliRunner().invoke(main, base + ["--traces", str(gz), "--out", str(tmp_path / "r3.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r3.json").read_text()) == json.loads((tmp_path / "r2.json").read_text())
    # --limit takes the first N traces round robin over their categories (here one, of category "a")
    res = CliRunner().invoke(main, base + ["--traces", str(gz), "--limit", "1", "--out", str(tmp_path / "r4.json")])
    assert res.exit_code == 0, res.output
    one = json.loads((tmp_path / "r4.json").read_text())
    assert one["prompts"] == 1 and list(one["drafters"]["ngram"]["per_category"]) == ["a"], one
    saved = replay_mod.save_traces(replay_mod.load_traces(tmp_path / "t.jsonl"), tmp_path / "s.jsonl.gz")
    assert gzip.decompress(saved.read_bytes()) == (tmp_path / "t.jsonl").read_bytes()  # a .gz name is written gzipped
    (tmp_path / "notgz.jsonl.gz").write_text(lines[0])
    res = CliRunner().invoke(main, base + ["--traces", str(tmp_path / "notgz.jsonl.gz")])
    assert res.exit_code == 2 and "cannot read traces file" in res.output, res.output
    bad = {"types": '{"category": "x", "prompt_ids": [1], "output_ids": "abc", "max_tokens": 5}',
           "vocab": '{"category": "x", "prompt_ids": [1], "output_ids": [99999999], "max_tokens": 5}',
           "json": 'not json', "other model": lines[0].replace(json.loads(lines[0])["model"], "0" * 64)}
    for name, line in bad.items():
        (tmp_path / "bad.jsonl").write_text(line + "\n")
        res = CliRunner().invoke(main, base + ["--traces", str(tmp_path / "bad.jsonl")])
        assert res.exit_code == 2 and "Traceback" not in res.output, (name, res.output)
    for extra, message in ((["--traces", str(tmp_path / "t.jsonl"), "--max-tokens", "4"], "do not apply"),
                           (["--traces", str(tmp_path / "missing.jsonl")], "does not exist"),
                           (["--traces", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "no" / "r.json")],
                            "directory does not exist"),
                           (["--drafter", "ngram:/x"], "takes no weights path"),
                           (["--drafter", "specformer:"], "the weights path after ':' is empty"),
                           (["--branch-ceiling", "2"], "applies to SpecFormer heads"),
                           (["--drafter", "specformer", "--branch-ceiling", "1"], "--branch-ceiling")):
        res = CliRunner().invoke(main, base + extra)
        assert res.exit_code == 2 and message in res.output, (extra, res.output)
