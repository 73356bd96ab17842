"""Speculation configured once: every entry point (tandem generate, the bench configurations, the
router, the local stack) describes it with one ``SpeculativeConfig``, built by
``tandem.speculation``; bad configurations fail when they are made."""

from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from tandem.bench.configs import CONFIGS, BenchOptions, BuildContext
from tandem.cli import main
from tandem.control import CostModel, RandomLengthPolicy, entropy_score
from tandem.errors import ConfigError, InvalidRequestError
from tandem.models.runner import RunnerConfig
from tandem.models.weights import load_checkpoint
from tandem.sampling import SamplingParams
from tandem.speculation import (TARGET_ONLY, SpeculativeConfig, build_draft_policy, build_engine,
                                build_speculation)


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint):
    return str(tiny_checkpoint("llama", with_tokenizer=True))


@pytest.fixture(scope="module")
def predictor_file(tmp_path_factory):
    from tandem.predictor import train_predictor

    rng = torch.Generator().manual_seed(0)
    x = torch.rand(300, 4, generator=rng).numpy()
    y = (torch.rand(300, generator=rng).numpy() < x[:, 1]).astype("float32")
    model, report = train_predictor(x, y, epochs=2)
    path = tmp_path_factory.mktemp("predictor") / "predictor.safetensors"
    model.save(path, report)
    return str(path)


@pytest.mark.parametrize("fields, message", [
    (dict(drafter="eagle"), "unknown drafter 'eagle'"),
    (dict(drafter="ngram", num_draft_tokens=0), "must be an integer in 1..16, got 0"),
    (dict(drafter="ngram", num_draft_tokens=17), "must be an integer in 1..16, got 17"),
    (dict(drafter="ngram", num_draft_tokens=2.0), "must be an integer"),
    (dict(drafter="ngram", policy="entropy", acceptance_threshold="1.5"), "--acceptance-threshold must be a number in [0, 1] or auto"),
    (dict(drafter="ngram", policy="entropy", acceptance_threshold="nan"), "--acceptance-threshold must be a number in [0, 1] or auto"),
    (dict(drafter="ngram", acceptance_threshold="0.5"), "--acceptance-threshold needs a threshold policy"),
    (dict(drafter="ngram", branch_top_m=2), "--branch-top-m needs a threshold policy"),
    (dict(drafter="ngram", policy="entropy", branch_top_m=9), "branch_top_m must be an integer in 0..8"),
    (dict(drafter="ngram", policy="adaptive"), "unknown draft policy 'adaptive'"),
    (dict(drafter="ngram", predictor="p.safetensors"), "--predictor needs --policy predictor"),
    (dict(drafter="ngram", policy="predictor"), "--policy predictor needs --predictor PATH"),
    (dict(drafter="remote", policy="predictor", predictor="auto"), "--predictor auto needs a drafter with a shipped"),
    (dict(policy="entropy"), "a draft policy (entropy) needs a --drafter"),
    (dict(drafter="ngram", draft_model="truncate:1"), "--draft-model needs --drafter draft-model or specformer"),
    (dict(drafter="ngram", policy="batch-width", acceptance_threshold="0.5"), "policy batch-width sets no acceptance"),
    (dict(drafter="ngram", policy="batch-width", cost_model=False), "chooses widths under the verifier cost model"),
    (dict(drafter="ngram", policy="batch-width", predictor="p.safetensors"), "--predictor needs --policy predictor"),
    (dict(policy="batch-width"), "a draft policy (batch-width) needs a --drafter"),
])
def test_invalid_configurations_raise_when_made(fields, message):
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig(**fields)
    assert message in str(err.value)


def test_configs_are_frozen_values():
    spec = SpeculativeConfig("ngram", num_draft_tokens=3)
    with pytest.raises(AttributeError):
        spec.num_draft_tokens = 5
    assert spec == SpeculativeConfig("ngram", None, 3) and hash(spec) == hash(SpeculativeConfig("ngram", None, 3))
    assert TARGET_ONLY == SpeculativeConfig() and not TARGET_ONLY.speculates
    assert SpeculativeConfig("ngram", num_draft_tokens=3, policy="entropy", branch_top_m=3).tokens_per_row == 6


def _cli_spec(monkeypatch, module: str, args: list[str]) -> SpeculativeConfig:
    """The SpeculativeConfig a CLI command hands to the engine builder (captured, nothing loads)."""
    import importlib

    seen = []

    def capture(model, device, batch, seq_len, spec=TARGET_ONLY, **kwargs):
        seen.append(spec)
        raise InvalidRequestError("captured")

    monkeypatch.setattr(importlib.import_module(module), "_engine", capture)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "captured" in res.stderr, res.output
    return seen[0]


@pytest.mark.parametrize("cli_args, config, options", [
    (["--drafter", "ngram", "--num-draft-tokens", "3"], "ngram", BenchOptions(num_draft_tokens=3)),
    (["--drafter", "draft-model", "--draft-model", "truncate:1"], "draft-model", BenchOptions(draft_model="truncate:1")),
    (["--specformer", "HEAD"], "specformer", BenchOptions(specformer="HEAD")),
    (["--drafter", "draft-model", "--draft-model", "truncate:1", "--num-draft-tokens", "3", "--predictor", "PRED",
      "--acceptance-threshold", "0.4", "--branch-top-m", "2"], "context-aware",
     BenchOptions(num_draft_tokens=3, draft_model="truncate:1", predictor="PRED", acceptance_threshold="0.4", branch_top_m=2)),
    (["--drafter", "ngram", "--num-draft-tokens", "5", "--predictor", "PRED"], "context-aware",
     BenchOptions(num_draft_tokens=5, ca_drafter="ngram", predictor="PRED")),
    (["--drafter", "draft-model", "--draft-model", "truncate:1", "--num-draft-tokens", "3"], "fixed-k",
     BenchOptions(num_draft_tokens=3, draft_model="truncate:1")),
    (["--drafter", "ngram", "--predictor", "PRED", "--num-draft-tokens", "2"], "budget",
     BenchOptions(num_draft_tokens=2, ca_drafter="ngram", predictor="PRED")),
])
def test_generate_and_bench_build_the_same_config(monkeypatch, tmp_path, cli_args, config, options):
    """tandem generate's options and the bench configuration with the same options give equal
    SpeculativeConfigs (so both are built by the same build_speculation)."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "model.safetensors").write_bytes(b"")  # found, never read: nothing loads here
    pred = tmp_path / "p.safetensors"
    subst = {"HEAD": str(head), "PRED": str(pred)}
    cli_args = [subst.get(a, a) for a in cli_args]
    options = replace(options, **{k: subst[v] for k, v in vars(options).items() if v in subst})
    spec = _cli_spec(monkeypatch, "tandem.cli.generate", ["generate", "--prompt", "hi", *cli_args])
    assert spec == CONFIGS[config].speculation(BuildContext(None, options))


def test_collect_logs_builds_from_the_same_options(monkeypatch, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    spec = _cli_spec(monkeypatch, "tandem.cli.train", ["collect-logs", "--prompts", str(prompts), "--out",
                                                       str(tmp_path / "l.npz"), "--drafter", "ngram",
                                                       "--num-draft-tokens", "3"])
    assert spec == CONFIGS["ngram"].speculation(BuildContext(None, BenchOptions(num_draft_tokens=3)))


@pytest.mark.parametrize("policy, predictor", [("fixed", None), ("entropy", None), ("predictor", "p.safetensors")])
def test_verifier_replica_and_stack_speak_the_same_config(monkeypatch, policy, predictor):
    """tandem serve verifier builds its SpeculativeConfig from its options: the bench's, with the
    drafter in the replica or, with --drafter-address, behind a drafter service ("remote"); the
    local stack serves exactly that config."""
    import services.processes
    from services.launch import StackConfig

    seen = []
    monkeypatch.setattr(services.processes, "run_verifier", lambda spec, *a, **k: seen.append((spec, k)))
    common = ["--port", "50051", "--num-draft-tokens", "3", "--policy", policy] + (
        ["--predictor", predictor] if predictor else [])
    for extra in (["--drafter", "ngram"], ["--drafter-address", "127.0.0.1:2"]):
        res = CliRunner().invoke(main, ["serve", "verifier", *common, *extra])
        assert res.exit_code == 0, res.output
    options = BenchOptions(num_draft_tokens=3, ca_drafter="ngram", predictor=predictor)
    bench = CONFIGS["fixed-k" if policy == "fixed" else "context-aware"].speculation(BuildContext(None, options))
    (in_replica, _), (remote, kwargs) = seen
    assert in_replica == bench and remote == replace(bench, drafter="remote")
    assert kwargs["drafter_address"] == "127.0.0.1:2"
    assert StackConfig.serving(bench).speculation == bench
    assert StackConfig(drafter="ngram", num_draft_tokens=3, policy=policy, predictor=predictor).speculation == bench


def test_verifier_refuses_a_policy_without_a_drafter(monkeypatch):
    import services.processes

    monkeypatch.setattr(services.processes, "run_verifier", lambda *a, **k: None)
    res = CliRunner().invoke(main, ["serve", "verifier", "--port", "50051", "--drafter", "none", "--policy", "entropy"])
    assert res.exit_code == 2 and "needs a --drafter" in res.stderr


def test_stack_refuses_what_the_services_cannot_run():
    from services.launch import StackConfig

    with pytest.raises(ConfigError, match="runs drafters none, ngram, specformer, draft-model"):
        StackConfig(drafter="eagle").speculation
    with pytest.raises(ConfigError, match="specformer drafter has no drafter service"):
        StackConfig(drafter="specformer", drafter_service=True).speculation
    with pytest.raises(ConfigError, match="cannot be served"):
        StackConfig.serving(SpeculativeConfig("ngram", policy="entropy", branch_top_m=2))
    assert not StackConfig(drafter="specformer").uses_drafter_service and StackConfig(drafter="draft-model").uses_drafter_service


def test_build_speculation(tiny_dir, predictor_file):
    ck = load_checkpoint(tiny_dir)
    cfg = RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=128)
    cost = CostModel({1: {1: 1.0, 2: 1.5}})
    assert build_speculation(TARGET_ONLY, ck, cfg).drafter is None
    s = build_speculation(SpeculativeConfig("draft-model", draft_model="truncate:1", num_draft_tokens=3,
                                            policy="predictor", predictor=predictor_file, acceptance_threshold="0.3",
                                            branch_top_m=2), ck, cfg, cost=cost)
    assert s.drafter.name == "draft-model" and s.num_draft_tokens == 3 and s.chained_rounds
    p = s.draft_policy
    assert p.controller is None and p.fixed_threshold == 0.3 and p.branch_top_m == 2 and p.cost is cost
    s = build_speculation(SpeculativeConfig("ngram", policy="entropy", cost_model=False, chained_rounds=False), ck,
                          cfg, cost=cost)
    assert s.draft_policy.score is entropy_score and s.draft_policy.controller is not None
    assert s.draft_policy.cost is None and not s.chained_rounds
    assert isinstance(build_draft_policy(SpeculativeConfig("ngram", policy="random")), RandomLengthPolicy)
    with pytest.raises(ConfigError, match="cannot load predictor"):
        build_speculation(SpeculativeConfig("ngram", policy="predictor", predictor=str(tiny_dir)), ck, cfg)
    with pytest.raises(ConfigError, match="remote drafter is connected by its caller"):
        build_speculation(SpeculativeConfig("remote"))
    with pytest.raises(ConfigError, match="ngram drafter given for drafter 'draft-model'"):
        build_speculation(SpeculativeConfig("draft-model", draft_model="truncate:1"), ck, cfg,
                          drafter=build_speculation(SpeculativeConfig("ngram")).drafter)
    with pytest.raises(ConfigError, match="no predictor.safetensors"):  # "auto": none beside these weights
        build_speculation(SpeculativeConfig("draft-model", draft_model="truncate:1", policy="predictor",
                                            predictor="auto"), ck, cfg)
    with pytest.raises(ConfigError, match="ships for the bundled model only"):  # n-gram's ships for the bundled target only
        build_speculation(SpeculativeConfig("ngram", policy="predictor", predictor="auto"), ck, cfg)


def test_ngram_predictor_ships_for_the_bundled_target():
    """``--drafter ngram --predictor auto`` on the bundled target finds the shipped n-gram
    predictor, reads the drafts' evidence features and, under a policy that chains, scores the
    drafts inside the round (``scores_on_device``)."""
    from types import SimpleNamespace

    from tandem.drafters.factory import NGRAM_PREDICTOR_DIR
    from tandem.models.weights import default_model_path
    from tandem.predictor import FEATURE_NAMES
    from tandem.speculation import resolve_predictor

    spec = SpeculativeConfig("ngram", policy="predictor", predictor="auto")
    bundled = SimpleNamespace(path=default_model_path(), config=None)
    path = resolve_predictor(spec, bundled)
    assert path == str(NGRAM_PREDICTOR_DIR / "predictor.safetensors")
    s = build_speculation(spec, bundled)
    assert s.drafter.name == "ngram" and s.drafter.scores_on_device and s.drafter.score_width == 4
    p = s.draft_policy.score(torch.tensor([[0.1, 0.9, 0.8, 1.0], [2.3, 0.1, -0.7, 1.0]]))  # attested vs contradicted
    assert p[0] > p[1] and len(FEATURE_NAMES) == 4


def test_build_engine_measures_its_cost_model_and_shares_targets(tiny_dir):
    ck = load_checkpoint(tiny_dir)
    cfg = RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=128)
    spec = SpeculativeConfig("draft-model", draft_model="truncate:1", num_draft_tokens=2, policy="entropy",
                             branch_top_m=2)
    engine = build_engine(spec, ck, cfg)
    cost = engine.draft_policy.cost
    assert sorted(cost.table) == [1, 2] and sorted(cost.table[2]) == [1, 2, 3, 4, 5]  # q <= k + m + 1
    base = build_engine(TARGET_ONLY, share=engine)
    assert base.target is engine.target and base.drafter is None and base.draft_policy is None
    assert engine.draft_policy.cost is cost and engine.drafter.name == "draft-model"  # left as it was
    out = base.generate(["hello there"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out[0].completion_tokens == 4
    engine.add_request("hi")
    with pytest.raises(ValueError, match="idle"):
        build_engine(TARGET_ONLY, share=engine)


@pytest.mark.parametrize("chained", [True, False])
def test_batch_width_engine_learns_per_position_acceptance_and_is_lossless(word_dir, chained):
    """policy "batch-width": build_engine measures T(b, q); the policy chains without scoring
    drafts (no device scorer) or cuts host-drafted proposals to its width, learns the acceptance
    per position from the rounds it runs, and the output is target-only's."""
    from tandem.batch_width import BatchWidthPolicy

    ck, cfg = load_checkpoint(word_dir), RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=128)
    engine = build_engine(SpeculativeConfig("ngram", num_draft_tokens=3, policy="batch-width",
                                            chained_rounds=chained), ck, cfg)
    policy = engine.draft_policy
    assert isinstance(policy, BatchWidthPolicy) and engine.chains_rounds is chained
    assert not engine.drafter.scores_on_device
    assert sorted(policy.cost.table[2]) == [1, 2, 3, 4, 5]
    prompts = ["w1 w2 w3 w1 w2 w3 w1", "w4 w5 w4 w5 w4"]  # the 32-word model repeats n-grams
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    got = engine.generate(prompts, params)
    assert engine.stats.num_drafted > 0 and policy._drafted.sum() > 0
    assert (policy._accepted <= policy._drafted).all()
    base = build_engine(TARGET_ONLY, share=engine)
    assert [c.token_ids for c in got] == [c.token_ids for c in base.generate(prompts, params)]
    with pytest.raises(ConfigError, match="needs the verifier cost model"):
        build_draft_policy(SpeculativeConfig("ngram", policy="batch-width"))


def test_a_shared_chained_engine_hands_over_every_slot(tiny_dir):
    """A chained engine may have launched a round past its last request's end; sharing its target
    collects that round first, so the new engine finds every KV slot free."""
    engine = build_engine(SpeculativeConfig("ngram", num_draft_tokens=3), load_checkpoint(tiny_dir),
                          RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=128))
    assert engine.chains_rounds
    engine.generate(["one two one two one", "three four three four"], SamplingParams(max_tokens=6))
    base = build_engine(TARGET_ONLY, share=engine)
    assert not engine.has_unfinished() and base.target.num_free() == base.target.info.num_slots == 2
    got = base.generate(["one two one two one", "three four three four"], SamplingParams(max_tokens=6))
    assert all(c.completion_tokens >= 1 for c in got)


def test_build_engine_reads_the_predictor_once(word_dir, monkeypatch):
    """A predictor policy with the batch cost model: ``build_engine`` loads the predictor before it
    measures T(b, q) (a bad file fails in a second, not after the timing) and hands that predictor
    to the policy, so the file is read once."""
    from tandem.drafters.specformer import WEIGHTS_DIR
    from tandem.predictor import AcceptancePredictor

    loads = []
    real = AcceptancePredictor.load.__func__

    def counted(cls, *args, **kwargs):
        loads.append(args[0])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AcceptancePredictor, "load", classmethod(counted))
    path = str(WEIGHTS_DIR / "ngram-smollm2-135m" / "predictor.safetensors")
    ck, cfg = load_checkpoint(word_dir), RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=64)
    engine = build_engine(SpeculativeConfig("ngram", num_draft_tokens=2, policy="predictor", predictor=path,
                                            cost_model=True), ck, cfg)
    assert engine.draft_policy is not None and engine.draft_policy.cost is not None
    assert loads == [path]


def test_verifier_gil_switch_interval_from_its_option_or_the_environment(monkeypatch):
    """``tandem serve verifier`` hands its process's GIL switch interval to ``run_verifier``: the
    replica's default (``GIL_SWITCH_INTERVAL_S``), ``--gil-switch-interval`` or
    ``TANDEM_GIL_SWITCH_INTERVAL``; a value out of range is a usage error."""
    import services.processes

    seen = []
    monkeypatch.setattr(services.processes, "run_verifier", lambda *a, **k: seen.append(k["gil_switch_interval_s"]))
    base = ["serve", "verifier", "--port", "50051"]
    assert CliRunner().invoke(main, base).exit_code == 0
    assert CliRunner().invoke(main, [*base, "--gil-switch-interval", "0.005"]).exit_code == 0
    assert CliRunner().invoke(main, base, env={"TANDEM_GIL_SWITCH_INTERVAL": "0.0002"}).exit_code == 0
    assert seen == [services.processes.GIL_SWITCH_INTERVAL_S, 0.005, 0.0002]
    res = CliRunner().invoke(main, [*base, "--gil-switch-interval", "0"])
    assert res.exit_code == 2 and "--gil-switch-interval" in res.stderr
