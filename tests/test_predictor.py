"""Difficulty predictor: metrics, training, persistence, and the engine's draft policy."""

import itertools
import random

import numpy as np
import pytest
import torch

from tandem.control import CostModel, DraftPolicy, entropy_score
from tandem.threshold import ThresholdController
from tandem.drafters import NgramDrafter
from tandem.engine import Engine
from tandem.models.runner import RunnerConfig
from tandem.predictor import (AcceptancePredictor, VerificationRecord, expected_calibration_error, roc_auc,
                              train_predictor)
from tandem.sampling import SamplingParams


def test_roc_auc_matches_pairwise_definition_with_ties():
    rng = random.Random(0)
    scores = [rng.choice([0.1, 0.2, 0.5, 0.7, 0.9]) for _ in range(60)]
    labels = [rng.random() < 0.4 for _ in range(60)]
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    pairwise = sum((p > n) + 0.5 * (p == n) for p, n in itertools.product(pos, neg)) / (len(pos) * len(neg))
    assert roc_auc(np.array(scores), np.array(labels)) == pytest.approx(pairwise)
    assert np.isnan(roc_auc(np.array([0.1, 0.2]), np.array([1, 1])))


def test_expected_calibration_error():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=20000)
    y = (rng.uniform(size=20000) < p).astype(float)
    assert expected_calibration_error(p, y) < 0.02  # calibrated by construction
    assert expected_calibration_error(np.full(100, 0.9), np.zeros(100)) == pytest.approx(0.9)


def synthetic_logs(n, seed):
    """Acceptance depends on top-1 probability and position, which entropy alone cannot see."""
    rng = np.random.default_rng(seed)
    entropy = rng.uniform(0, 3, n)
    top1 = rng.uniform(0.1, 1.0, n)
    margin = top1 * rng.uniform(0.2, 1.0, n)
    pos = rng.integers(1, 6, n).astype(float)
    logit = 4 * (top1 - 0.55) - 0.6 * (pos - 3) - 0.2 * entropy
    labels = (rng.uniform(size=n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return np.stack([entropy, top1, margin, pos], 1).astype(np.float32), labels


def test_trained_predictor_beats_entropy_rule_on_held_out_data():
    x, y = synthetic_logs(6000, 0)
    model, report = train_predictor(x, y, epochs=30)
    assert report.auc > report.entropy_auc + 0.1
    assert 0.0 <= report.position_auc <= 1.0  # the position-only baseline is reported beside it
    assert report.ece < 0.05
    xt, yt = synthetic_logs(3000, 1)  # a fresh draw: the model generalises
    held_out = roc_auc(model.predict(torch.from_numpy(xt)).numpy(), yt)
    assert held_out > roc_auc(-xt[:, 0], yt) + 0.1
    assert report.cost_us_per_token < 100


def test_train_predictor_rejects_bad_data():
    x, y = synthetic_logs(100, 0)
    with pytest.raises(ValueError, match="single class"):
        train_predictor(x, np.ones_like(y))
    with pytest.raises(ValueError, match=">= 20"):
        train_predictor(x[:5], y[:5])


def test_predictor_save_load_round_trip(tmp_path):
    x, y = synthetic_logs(500, 0)
    model, report = train_predictor(x, y, epochs=3)
    path = tmp_path / "p.safetensors"
    model.save(path, report)
    again = AcceptancePredictor.load(path)
    torch.testing.assert_close(again.predict(torch.from_numpy(x[:20])), model.predict(torch.from_numpy(x[:20])))
    assert (tmp_path / "p.safetensors.json").is_file()
    with pytest.raises(FileNotFoundError):
        AcceptancePredictor.load(tmp_path / "missing.safetensors")


def test_verification_record_labels_stop_after_first_rejection():
    feats = torch.arange(20, dtype=torch.float32).view(5, 4)
    x, y = VerificationRecord(feats, 2, "d").labelled()
    assert y.tolist() == [1.0, 1.0, 0.0] and x.shape == (3, 4)
    x, y = VerificationRecord(feats, 5, "d").labelled()
    assert y.tolist() == [1.0] * 5


def test_draft_policy_cuts_by_threshold_and_allocates():
    feats = [torch.tensor([[0.0, 1, 1, i] for i in range(1, 5)]), torch.zeros(0, 4)]
    decay = lambda f: 0.9 ** f[:, 3]  # 0.9, 0.81, 0.73, 0.66
    assert DraftPolicy(decay, acceptance_threshold=0.75).lengths(feats) == [2, 0]
    free = CostModel({1: {q: 1.0 for q in range(1, 9)}})
    assert DraftPolicy(decay, cost=free, acceptance_threshold=0.0).lengths(feats) == [4, 0]
    steep = CostModel({2: {1: 1.0, 2: 50.0, 3: 60.0, 4: 70.0, 5: 80.0}})
    assert DraftPolicy(decay, cost=steep, acceptance_threshold=0.0).lengths(feats) == [0, 0]
    ctl = ThresholdController(grid=[0.0, 0.7])
    pol = DraftPolicy(decay, controller=ctl)
    pol.lengths(feats)
    pol.observe(3, 2.0)
    assert sum(ctl.counts) == 1.0
    # entropy rule: exp(-entropy) of a one-hot draft is 1
    assert entropy_score(torch.zeros(3, 4)).tolist() == [1.0, 1.0, 1.0]


def test_engine_with_draft_policy_is_lossless_and_logs(tiny_checkpoint):
    d = str(tiny_checkpoint("llama", with_tokenizer=True))
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=96)
    base = Engine(d, cfg)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11], [3, 4], [7] * 12]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [base.add_request(prompt_ids=p, params=params) for p in prompts]
    while base.has_unfinished():
        base.step()
    want = [base.completion(i).token_ids for i in ids]

    logs = []
    decay = lambda f: 0.9 ** f[:, 3]
    eng = Engine(d, cfg, tokenizer=base.tokenizer, drafter=NgramDrafter(), num_draft_tokens=6,
                 draft_policy=DraftPolicy(decay, controller=ThresholdController(grid=[0.5, 0.7, 0.85])),
                 verification_sink=logs.append)
    ids = [eng.add_request(prompt_ids=p, params=params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    got = [eng.completion(i) for i in ids]
    assert [g.token_ids for g in got] == want
    # τ ≥ 0.5 with p = 0.9^position never lets more than 6 drafts through, and τ = 0.85 only 1
    assert all(len(r.features) <= 6 for r in logs)
    assert eng.stats.num_drafted == sum(len(r.features) for r in logs)
    assert sum(eng.draft_policy.controller.counts) > 0


def test_predictor_reads_a_projection_of_the_drafter_states(tmp_path):
    """Where acceptance depends on a direction of the drafter's hidden state that the distribution
    features cannot see, the predictor with a state projection finds it and the report gives the
    features-only AUC of the same split beside its own; it saves and loads with its projection,
    and serving's loader (features only) refuses it with the reason."""
    rng = np.random.default_rng(3)
    n, d = 6000, 24
    x, _ = synthetic_logs(n, 0)
    states = rng.normal(size=(n, d)).astype(np.float32)
    direction = rng.normal(size=d).astype(np.float32)
    logit = 3 * states @ direction / np.linalg.norm(direction)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    model, report = train_predictor(x, y, epochs=20, states=states.astype(np.float16), state_proj=4)
    assert model.state_dim == d and model.state_proj == 4
    assert report.auc > 0.8 and report.features_only_auc < 0.6
    path = tmp_path / "p.safetensors"
    model.save(path, report)
    again = AcceptancePredictor.load(path)
    feats, st = torch.from_numpy(x[:16]), torch.from_numpy(states[:16])
    torch.testing.assert_close(again.predict(feats, st), model.predict(feats, st))
    with pytest.raises(ValueError, match="reads the drafter's states"):
        again.predict(feats)
    with pytest.raises(ValueError, match="serving does not supply"):
        AcceptancePredictor.load(path, features_only=True)
    with pytest.raises(ValueError, match=r"states must be \[N, d\]"):
        train_predictor(x, y, states=states[:10])
    plain, plain_report = train_predictor(x, y, epochs=2)  # without states: no projection, no features-only AUC
    assert plain.state_dim == 0 and np.isnan(plain_report.features_only_auc)
    plain.save(tmp_path / "q.safetensors")
    assert AcceptancePredictor.load(tmp_path / "q.safetensors", features_only=True).state_dim == 0


def test_verification_record_states_follow_the_labels():
    feats, states = torch.zeros(5, 4), torch.arange(15, dtype=torch.float32).view(5, 3)
    rec = VerificationRecord(feats, 1, "specformer", states)
    x, y = rec.labelled()
    assert rec.labelled_states().tolist() == states[:2].tolist() and len(y) == 2
    assert VerificationRecord(feats, 1, "ngram").labelled_states() is None


def test_train_predictor_refuses_damaged_logs_and_writes_strict_json(tmp_path):
    """A logs file cut short, damaged, or not an archive at all is a one-line error (no traceback,
    no advice to unpickle); collect-logs over a file with no prompts says so; a report's figure
    that was not measured is null in strict JSON."""
    import json

    from click.testing import CliRunner

    from tandem.cli import main

    x, y = synthetic_logs(400, 0)
    good = tmp_path / "logs.npz"
    np.savez_compressed(good, features=x, labels=y)
    raw = good.read_bytes()
    (tmp_path / "cut.npz").write_bytes(raw[:len(raw) // 2])
    damaged = bytearray(raw)
    damaged[200:260] = bytes(60)  # inside the first member's compressed data
    (tmp_path / "damaged.npz").write_bytes(bytes(damaged))
    (tmp_path / "text.npz").write_text("hello\n")
    runner = CliRunner()
    for name in ("cut.npz", "damaged.npz", "text.npz"):
        res = runner.invoke(main, ["train", "predictor", "--logs", str(tmp_path / name), "--out", str(tmp_path / "p.st")])
        assert res.exit_code == 2, (name, res.output)
        assert "is not a collect-logs file" in res.output and "Traceback" not in res.output and "pickle" not in res.output
    res = runner.invoke(main, ["train", "predictor", "--logs", str(good), "--out", str(tmp_path / "p.st"), "--epochs", "2"])
    assert res.exit_code == 0, res.output
    assert "80 held-out positions: AUC and ECE this few are rough" in res.stderr  # 20% of 400
    report = json.loads((tmp_path / "p.st.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert report["features_only_auc"] is None and 0.0 <= report["auc"] <= 1.0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    res = runner.invoke(main, ["collect-logs", "--prompts", str(empty), "--drafter", "ngram", "--out", str(tmp_path / "l.npz")])
    assert res.exit_code == 2 and f"the prompts file {empty} has no prompts" in res.output


def test_a_predictor_loads_from_its_drafters_weights_directory(tmp_path):
    """``AcceptancePredictor.load`` takes a drafter's weights directory as well as the file in it
    (what a user passing ``--predictor tandem/drafters/weights/ngram-smollm2-135m`` means); an
    empty directory is a clear FileNotFoundError."""
    from pathlib import Path

    from tandem.predictor import AcceptancePredictor

    shipped = Path(__file__).resolve().parents[1] / "tandem/drafters/weights/ngram-smollm2-135m"
    by_dir = AcceptancePredictor.load(shipped)
    by_file = AcceptancePredictor.load(shipped / "predictor.safetensors")
    assert by_dir.mean.equal(by_file.mean)
    with pytest.raises(FileNotFoundError, match="a directory without predictor.safetensors"):
        AcceptancePredictor.load(tmp_path)


def test_a_predictor_names_its_drafter_and_says_when_it_scores_another(tmp_path, caplog):
    """train predictor saves the drafter its logs came from (collect-logs records it); every
    shipped predictor names its own; a predictor used over another drafter runs (the features are
    the same) but logs a warning that its calibration is not for those drafts."""
    import logging
    from pathlib import Path

    from click.testing import CliRunner

    from tandem.cli import main
    from tandem import speculation
    from tandem.speculation import SpeculativeConfig, load_predictor

    x, y = synthetic_logs(400, 0)
    logs = tmp_path / "logs.npz"
    np.savez_compressed(logs, features=x, labels=y, drafter="draft-model")
    res = CliRunner().invoke(main, ["train", "predictor", "--logs", str(logs), "--out", str(tmp_path / "p.st"),
                                    "--epochs", "1"])
    assert res.exit_code == 0, res.output
    assert AcceptancePredictor.load(tmp_path / "p.st").drafter == "draft-model"
    weights = Path(__file__).resolve().parents[1] / "tandem/drafters/weights"
    for name, drafter in (("ngram-smollm2-135m", "ngram"), ("specformer-smollm2-135m", "specformer"),
                          ("specformer-smollm2-135m-ld6", "specformer"), ("specformer-smollm2-135m-ld8", "specformer"),
                          ("draft-model-smollm2-135m", "draft-model")):
        assert AcceptancePredictor.load(weights / name).drafter == drafter, name
    speculation._WARNED_PREDICTORS.clear()  # said once a process: another test may have met the pair
    with caplog.at_level(logging.WARNING, logger="tandem.speculation"):
        load_predictor(SpeculativeConfig(drafter="draft-model", policy="predictor", predictor=str(tmp_path / "p.st")))
        assert not caplog.records  # its own drafter: nothing to say
        load_predictor(SpeculativeConfig(drafter="ngram", policy="predictor",
                                          predictor=str(weights / "specformer-smollm2-135m")))
        load_predictor(SpeculativeConfig(drafter="ngram", policy="predictor",
                                          predictor=str(weights / "specformer-smollm2-135m")))  # said already
    said = [r for r in caplog.records
            if "trained on the specformer drafter's verification logs and now scores the ngram" in r.getMessage()]
    assert len(said) == 1
