"""``tandem bench``: the configuration registry, the Spec-Bench runner, its files, exact kernels.

CPU only, on the tiny random checkpoints of conftest.py (float32, greedy: every configuration
must reproduce target-only output exactly).
"""

import json
import math
import re

import pytest
import torch
from click.testing import CliRunner

from tandem.bench import configs as bench_configs
from tandem.bench.configs import BenchOptions, BuildContext, parse_configs, prepare_configs
from tandem.bench.results import BenchReport, merge_reports
from tandem.bench.spec_bench import (MAX_WARMUP_PASSES, bench_prompts, check_mode, run_benchmark, warmup_passes_then_timed,
                                     warmup_share)
from tandem.models.graphs import CapturedCall
from tandem.cli import main
from tandem.data import load_prompts
from tandem.drafters import NgramDrafter
from tandem.engine import Engine
from tandem.metrics import SpecDecodeStats
from tandem.errors import ConfigError, InvalidRequestError
from tandem.models import load_checkpoint
from tandem.models.config import ModelLoadError
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams
from tandem.tokenizer import load_tokenizer

from conftest import DATA_DIR, SPEC_BENCH
from helpers import check_acceptance_figures


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: these runs are many tiny forwards, where a second OpenMP thread only
    spins (10x slower on a loaded 2-core machine). Outputs are compared within one setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint):
    return str(tiny_checkpoint("llama", with_tokenizer=True))


@pytest.fixture(scope="module")
def short_prompts(tmp_path_factory):
    """The first Spec-Bench row of every category, cut to 200 characters (long RAG and
    summarization prompts would only slow the CPU tests down)."""
    rows = {}
    for line in SPEC_BENCH.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["category"], {**row, "turns": [row["turns"][0][:200]]})
    path = tmp_path_factory.mktemp("prompts") / "spec_bench_short.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    return path


def test_bench_cli_writes_results_tables_and_plots(tiny_dir, short_prompts, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, [
        "bench", "--model", tiny_dir, "--prompts", str(short_prompts), "--device", "cpu", "--limit", "3", "--batch-sizes", "1,2", "--max-tokens", "8",
        "--configs", "target,ngram,draft-model", "--draft-model", "truncate:1", "--num-draft-tokens", "3",
        "--max-seq-len", "256", "--cost-table", "--out", str(out)])
    assert res.exit_code == 0, res.output + str(res.exception)
    data = json.loads((out / "results.json").read_text())
    rows = {(r["config"], r["batch_size"]): r for r in data["results"]}
    assert set(rows) == {(c, b) for c in ("target", "ngram", "draft-model") for b in (1, 2)}
    assert data["meta"]["configs"] == ["target", "ngram", "draft-model"] and data["meta"]["exact_kernels"] is False
    assert data["meta"]["warmup"] == "full"
    assert data["meta"]["prefill_varlen"] is False and data["meta"]["prefill_varlen_batch_sizes"] == []  # a CPU: padded
    for (name, b), r in rows.items():
        assert r["prompts"] == (3 if b == 1 else 4)  # max(limit, 2b)
        assert r["tps"] > 0 and r["output_tokens"] > 0 and r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert r["lossless_share"] == 1.0 and r["mismatched_prompt_ids"] == [], r  # greedy fp32: lossless
        if name == "target":
            assert r["speedup"] == 1.0 and r["mean_accepted_length"] == 1.0 and "kappa" not in r and r["drafted"] == 0 and r["acceptance_rate"] is None
        else:
            assert r["speedup"] == pytest.approx(r["tps"] / rows[("target", b)]["tps"])
            assert r["drafted"] > 0 and r["k"] == (3 if name == "ngram" else 4)
            check_acceptance_figures(r["drafted"], r["accepted"], r["acceptance_rate"], r["mean_accepted_length"],
                                     r["output_tokens"], r["prompts"], r["k"])
            tasks = r["per_task"]  # the per-task split adds up to the row
            assert [sum(t[f] for t in tasks) for f in ("prompts", "drafted", "accepted")] == \
                [r["prompts"], r["drafted"], r["accepted"]]
            # each task's decode speedup: target-only's time per output token over this one's, same task
            base = {t["task"]: t["tpot_ms"] for t in rows[("target", b)]["per_task"]}
            for t in tasks:
                assert t["tpot_ms"] > 0 and t["speedup"] == pytest.approx(base[t["task"]] / t["tpot_ms"])
        if name == "target":
            assert all(t["speedup"] == 1.0 and t["tpot_ms"] > 0 for t in r["per_task"])
        # per decode round, measured over one full batch of the same prompts
        assert r["rounds"] >= 1 and r["round_wall_ms"] > 0 and r["round_gpu_ms"] is None  # no GPU here
        assert r["round_host_ms"] == pytest.approx(r["round_wall_ms"])  # nothing waits for a device on a CPU
        assert r["graph_launches_per_round"] == 0.0  # no CUDA graphs on a CPU
        assert r["round_cost_captures"] == 0 and r["timed_captures"] == 0
        # the timed pass's rounds, each with at most the batch's rows, their tokens the pass's
        assert r["timed_rounds"] * b * (r["k"] + 1) >= r["output_tokens"] - r["prompts"]  # (prefills make the rest)
        assert 1.0 <= r["timed_rows_per_round"] <= b and r["timed_gpu_span_ms"] is None and r["timed_gpu_idle_p50_ms"] is None
        # the verify round's one copy: every configuration chains (the draft model drafts inside the round)
        assert r["host_syncs_per_round"] <= 1.0, r
    # the n-gram rows count exactly the drafts and acceptances of the same decoding run in-process on
    # the same prompts (per request they do not depend on the batch: greedy tokens, and lookups and
    # the draft room rule that read only the request's own tokens)
    records = load_prompts(short_prompts)
    ref = Engine(tiny_dir, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=256), drafter=NgramDrafter(),
                 num_draft_tokens=3)
    for b in (1, 2):
        stats = SpecDecodeStats()
        for c in ref.generate([p.text for p in bench_prompts(records, b, 3)], SamplingParams(max_tokens=8)):
            stats.merge(c.spec)
        r = rows[("ngram", b)]
        assert (r["drafted"], r["accepted"]) == (stats.num_drafted, stats.num_accepted), b
        assert r["mean_accepted_length"] == pytest.approx(stats.mean_accepted_length), b
    # T(b, q) for b in the batch sizes and q = 1..k+1 (k = --num-draft-tokens)
    assert sorted(data["cost_table"]) == ["1", "2"] and sorted(data["cost_table"]["2"]) == ["1", "2", "3", "4"]
    assert all(t > 0 for row in data["cost_table"].values() for t in row.values())
    md = (out / "results.md").read_text()
    assert "| method | batch | k | τ_acc | TPS | speedup | acceptance | lossless | round ms | GPU ms | wall/GPU |" in md
    assert "per Spec-Bench task (batch 1)" in md and "per Spec-Bench task (batch 2)" in md and "T(b, q)" in md
    assert re.search(r"\| \d\.\d{3} / \d\.\d{2} / \d+\.\d{2}x \|", md)  # α / τ_acc / decode speedup cells
    for png in ("speedup.png", "acceptance_by_task.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Not a terminal: no progress-bar redraws, one plain line per finished run, tables on stdout.
    assert "\r" not in res.stderr and res.stderr.count("lossless") == 6
    assert "Spec-Bench, greedy" in res.stdout and "wrote" in res.stdout


def test_warmup_repeats_while_it_captures(monkeypatch):
    """A warm-up pass that captured a graph is followed by another (a moving width meets new
    shapes), up to MAX_WARMUP_PASSES; the timed pass comes last, once."""
    monkeypatch.setattr(CapturedCall, "made", 0)

    def run(captures_per_pass: list[int]) -> list[str]:
        labels = []
        for i, (label, items) in enumerate(warmup_passes_then_timed(["w"], ["t"])):
            labels.append(label)
            assert items == (["w"] if label == "warm-up" else ["t"])
            if label == "warm-up":
                CapturedCall.made += captures_per_pass[i]
        return labels

    assert run([0]) == ["warm-up", "timed"]  # nothing new captured: one pass
    assert run([5, 2, 0]) == ["warm-up"] * 3 + ["timed"]
    assert run([5] * 10) == ["warm-up"] * MAX_WARMUP_PASSES + ["timed"]  # bounded
    assert [label for label, _ in warmup_passes_then_timed([], ["t"])] == ["timed"]  # warm-up "none"


def test_warmup_share():
    """full: the timed prompts themselves (every graph shape made before timing); short: max(2b, 4);
    none: no warm-up pass."""
    items = list(range(10))
    assert warmup_share(items, 16) == items and warmup_share(items, 16, "full") == items
    assert warmup_share(items, 1, "short") == items[:4] and warmup_share(items, 3, "short") == items[:6]
    assert warmup_share(items, 64, "short") == items
    assert warmup_share(items, 4, "none") == []
    assert warmup_share(items, 1, "server") == items  # (after every round shape is captured: the engine's part)
    with pytest.raises(ValueError, match="warm-up mode 'cold'"):
        warmup_share(items, 1, "cold")
    # results.json written before the option existed load as the short warm-up they ran
    old = json.loads((DATA_DIR.parent / "docs/results/2026-12-01/bench-16-128/results.json").read_text())
    assert "warmup" not in old["meta"] and BenchReport.from_dict(old).meta.warmup == "short"
    # and those written with the "kappa" copy of τ_acc and the "tau" option name still load
    assert "kappa" in old["results"][0] and "tau" in old["meta"]["options"]
    report = BenchReport.from_dict(old)
    assert report.results[0].mean_accepted_length == old["results"][0]["kappa"]
    assert report.meta.options["tau"] == old["meta"]["options"]["tau"]
    # null is NaN for float fields only: the optional ones come back as None (no "(router nan)" cell)
    fresh = json.loads((DATA_DIR.parent / "docs/results/2026-12-05/step-timeline/pass4-0c110d5-h100/std/results.json")
                       .read_text())
    back = BenchReport.from_dict(fresh)
    assert fresh["results"][0]["router_draft_width"] is None and back.results[0].router_draft_width is None
    assert math.isnan(back.results[0].acceptance_rate)  # target-only: null, a float field
    again = back.to_dict()  # (per-task rows and meta gained fields since: compared field by field)
    assert {k: again["meta"][k] for k in fresh["meta"]} == fresh["meta"] and again["meta"]["round_kernels"] == "plain"
    assert all(again["results"][i][k] == v for i, r in enumerate(fresh["results"])
               for k, v in r.items() if k != "per_task")
    # admission settings recorded before the intake window existed load as the default they ran
    before = json.loads((DATA_DIR.parent / "docs/results/2026-12-08/sampling-search-h100/call3/new/results.json")
                        .read_text())
    assert "intake_ms" not in before["meta"]["admission"]
    loaded = BenchReport.from_dict(before)
    assert loaded.meta.admission == {"share": 0.125, "wait_rounds": 64, "overlap": False, "intake_ms": 0.0}
    assert merge_reports([loaded, BenchReport.from_dict(loaded.to_dict())]).meta.admission == loaded.meta.admission
    from tandem.bench.report import _k_cell

    assert "router" not in _k_cell(back.results[1])


def test_context_aware_and_hf_references_are_lossless(tiny_dir, short_prompts):
    ck = load_checkpoint(tiny_dir)
    records = load_prompts(short_prompts)
    configs = parse_configs("context-aware,hf-generate,hf-prompt-lookup")
    report = run_benchmark(ck, load_tokenizer(ck), RunnerConfig(device="cpu", max_seq_len=256), records, configs, [1],
                           BenchOptions(num_draft_tokens=3, ca_drafter="ngram"), max_tokens=8, limit=2, hf_limit=2,
                           progress=False, warmup="none", admission=(0.5, 8))
    assert [r.config for r in report.results] == ["target", "context-aware", "hf-generate", "hf-prompt-lookup"]
    assert report.meta.admission == {"share": 0.5, "wait_rounds": 8, "overlap": False, "intake_ms": 0.0}
    ca = report.get("context-aware", 1)
    assert ca.lossless_share == 1.0 and ca.k == 3 and ca.speedup == pytest.approx(ca.tps / report.get("target", 1).tps)
    check_acceptance_figures(ca.drafted, ca.accepted, ca.acceptance_rate, ca.mean_accepted_length, ca.output_tokens,
                             ca.prompts, ca.k)
    for name in ("hf-generate", "hf-prompt-lookup"):
        r = report.get(name, 1)
        assert r.prompts == 2 and r.output_tokens > 0 and r.tps > 0
        assert r.lossless_share == 1.0, r.mismatched_prompt_ids  # fp32: HF greedy == our greedy
        assert math.isnan(r.acceptance_rate)  # HF does not expose its acceptance counts
    assert report.cost_table is None  # measured for context-aware, reported only with cost_table=True
    json.dumps(report.to_dict(), allow_nan=False)  # NaN is written as null


def test_config_registry_errors(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="unknown configuration 'eagle'"):
        parse_configs("ngram,eagle")
    with pytest.raises(ConfigError, match="empty"):
        parse_configs(" , ")
    assert [c.name for c in parse_configs("ngram,target,ngram")] == ["target", "ngram"]  # target first, no repeats
    assert [c.name for c in parse_configs("fixed-k=2,fixed-k=16")] == ["target", "fixed-k=2", "fixed-k=16"]
    for bad in ("fixed-k=0", "fixed-k=17", "fixed-k=abc", "fixed-k=", "fixed-k=-1"):
        with pytest.raises(ConfigError, match=r"fixed-k=<n> takes an integer n in 1\.\.16"):
            parse_configs(bad)
    ctx = BuildContext(load_checkpoint(tiny_dir), BenchOptions())  # not the bundled target: nothing shipped for it
    with pytest.raises(InvalidRequestError, match="draft-model needs --draft-model PATH"):
        prepare_configs(parse_configs("draft-model"), ctx)
    with pytest.raises(InvalidRequestError, match="draft-model needs --draft-model PATH"):  # context-aware's default
        prepare_configs(parse_configs("context-aware"), ctx)
    with pytest.raises(InvalidRequestError, match="specformer needs --specformer PATH"):
        prepare_configs(parse_configs("specformer"), ctx)
    with pytest.raises(ModelLoadError, match="no SpecFormer head"):
        prepare_configs(parse_configs("specformer"), BuildContext(ctx.checkpoint, BenchOptions(specformer=str(tmp_path))))
    with pytest.raises(ConfigError, match="--acceptance-threshold must be"):
        prepare_configs(parse_configs("context-aware"), BuildContext(ctx.checkpoint, BenchOptions(ca_drafter="ngram",
                                                                                                  acceptance_threshold="2")))
    with pytest.raises(ConfigError, match="cannot load predictor"):
        prepare_configs(parse_configs("context-aware"), BuildContext(
            ctx.checkpoint, BenchOptions(ca_drafter="ngram", predictor=str(tmp_path / "missing.safetensors"))))
    with pytest.raises(ConfigError, match="--mode must be"):
        check_mode("ray")


def test_bench_cli_sampled_run(tiny_dir, short_prompts, tmp_path):
    """--temperature > 0: every request samples with one seed; rows report speed and acceptance and
    their round cost (a seeded batch makes the same draws twice), not a token-for-token check."""
    out = tmp_path / "sampled"
    res = CliRunner().invoke(main, [
        "bench", "--model", tiny_dir, "--prompts", str(short_prompts), "--device", "cpu", "--limit", "3",
        "--batch-sizes", "1,2", "--max-tokens", "8", "--configs", "target,ngram,draft-model",
        "--draft-model", "truncate:1", "--num-draft-tokens", "3", "--max-seq-len", "256",
        "--temperature", "0.8", "--top-p", "0.9", "--seed", "7", "--out", str(out)])
    assert res.exit_code == 0, res.output + str(res.exception)
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 0, "seed": 7}
    assert "sampled, T=0.8, top-p 0.9, seed 7" in (out / "results.md").read_text()
    rows = {(r["config"], r["batch_size"]): r for r in data["results"]}
    assert set(rows) == {(c, b) for c in ("target", "ngram", "draft-model") for b in (1, 2)}
    for (name, b), r in rows.items():
        assert r["lossless_share"] is None and r["mismatched_prompt_ids"] == []  # not compared when sampling
        assert r["tps"] > 0 and r["output_tokens"] > 0 and r["rounds"] >= 1 and r["round_wall_ms"] > 0
        if name == "draft-model":  # (n-gram finds little to look up in a random model's samples)
            assert r["drafted"] > 0
            check_acceptance_figures(r["drafted"], r["accepted"], r["acceptance_rate"], r["mean_accepted_length"],
                                     r["output_tokens"], r["prompts"], r["k"])
    assert "| – |" in (out / "results.md").read_text()  # the lossless cell of a sampled row
    report = BenchReport.from_dict(data)  # back from JSON: the settings, and NaN for the unchecked share
    assert report.meta.decoding() == "sampled, T=0.8, top-p 0.9, seed 7"
    assert math.isnan(report.results[0].lossless_share) and report.results[0].lossless_text == "–"


@pytest.mark.parametrize("args,message", [
    (["--temperature", "0.7", "--configs", "target,hf-generate"], "hf-generate decodes greedily"),
    (["--temperature", "0.7", "--hf-baseline"], "drop --hf-baseline"),
    (["--temperature", "nan"], "must be a finite number"),
    (["--temperature", "3"], "--temperature"),
    (["--temperature", "0.5", "--seed", "-3"], "seed must be an integer in [0, 2**63)"),
])
def test_bench_cli_sampling_errors(tiny_dir, args, message):
    res = CliRunner().invoke(main, ["bench", "--model", tiny_dir, "--device", "cpu", *args])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and "Traceback" not in res.output


def test_from_results_says_which_options_do_nothing(tmp_path):
    """--from-results runs nothing: run options given beside it are named, not silently dropped."""
    src = tmp_path / "a"
    src.mkdir()
    report = {"meta": {"model": "m", "device": "cpu", "gpu": "cpu", "dtype": "float32", "cuda_graphs": False,
                       "compile": False, "exact_kernels": False, "fixed_step_tokens": 0, "mode": "inproc",
                       "configs": ["target"], "batch_sizes": [1], "max_tokens": 8, "prompts_file": "p",
                       "options": {}, "torch": "2", "date_utc": "2026-12-07T00:00:00+00:00"},
              "results": []}
    (src / "results.json").write_text(json.dumps(report))
    res = CliRunner().invoke(main, ["bench", "--from-results", str(src / "results.json"), "--temperature", "0.3",
                                    "--configs", "target", "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output + str(res.exception)
    assert "--configs, --temperature do nothing with --from-results" in res.stderr


def test_sampled_bench_needs_a_seed(tiny_dir, short_prompts):
    ck = load_checkpoint(tiny_dir)
    with pytest.raises(ValueError, match="needs temperature > 0 and a seed"):
        run_benchmark(ck, load_tokenizer(ck), RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=256),
                      load_prompts(short_prompts), parse_configs("target"), [1], BenchOptions(),
                      sampling={"temperature": 0.7}, progress=False)


@pytest.mark.parametrize("args,message", [
    (["--configs", "eagle"], "unknown configuration 'eagle'"),
    (["--configs", "ngram", "--drafter", "ngram"], "--drafter is for --ablation"),
    (["--configs", "specformer"], "specformer needs --specformer PATH"),
    (["--configs", "specformer", "--specformer", "README.md"], "cannot read SpecFormer head"),
    (["--mode", "distributed", "--configs", "ngram,ngram-host"], "not 'ngram-host' (the ablations"),
    (["--configs", "ngram-router-budget"], "ngram-router-budget runs only with --mode distributed"),
    (["--stream"], "--stream applies to --mode distributed"),
])
def test_bench_cli_config_errors(tiny_dir, args, message):
    res = CliRunner().invoke(main, ["bench", "--model", tiny_dir, "--device", "cpu", "--no-hf-baseline", *args])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and "Traceback" not in res.output


def test_exact_kernels_leave_outputs_unchanged(tiny_dir, short_prompts):
    """--exact-kernels pads every step to [slots, k+1] and prefills prompts one by one: on CPU
    float32 target-only output is unchanged, and speculative output (a draft model, k = 3) still
    equals it."""
    from tandem.drafters import DraftModelDrafter, truncated_checkpoint

    ck = load_checkpoint(tiny_dir)
    prompts = [r.text for r in load_prompts(short_prompts, 5)]
    params = SamplingParams(max_tokens=10)
    plain = Engine(ck, RunnerConfig(device="cpu", max_batch_size=3, max_seq_len=256))
    exact = Engine(ck, RunnerConfig(device="cpu", max_batch_size=3, max_seq_len=256, fixed_step_tokens=4),
                   tokenizer=plain.tokenizer)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    assert [c.token_ids for c in exact.generate(prompts, params)] == want
    slot = exact.cache.allocate()
    exact.cache.lengths[slot] = 3
    assert tuple(exact.runner.step({slot: [1]}).logits.shape[:2]) == (3, 4)  # every slot, 4 tokens per row
    exact.cache.free(slot)
    exact.drafter, exact.num_draft_tokens = DraftModelDrafter(truncated_checkpoint(ck, 1), exact.runner_config), 3
    assert [c.token_ids for c in exact.generate(prompts, params)] == want
    assert exact.stats.num_drafted > 0


def test_context_aware_over_a_draft_model_uses_the_verifier_cost_model(tiny_dir):
    """context-aware = the shared DraftPolicy (online τ, entropy score without a predictor) with
    the verifier cost model; the draft model drafts every position before the allocation, so its
    time is part of the fitted per-round overhead, not a per-position price."""
    from tandem.bench.spec_bench import measure_cost_table
    from tandem.control import entropy_score

    ck = load_checkpoint(tiny_dir)
    cfg = RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=256)
    ctx = BuildContext(ck, BenchOptions(draft_model="truncate:1", num_draft_tokens=3))
    ctx.cost = measure_cost_table(ck, cfg, [1, 2], 4, iters=2)
    assert sorted(ctx.cost.table) == [1, 2] and sorted(ctx.cost.table[2]) == [1, 2, 3, 4]
    ctx.engine = Engine(ck, cfg)
    decoding = bench_configs.CONFIGS["context-aware"].build(ctx)
    policy = decoding.draft_policy
    assert decoding.drafter.name == "draft-model" and decoding.num_draft_tokens == 3
    assert policy.score is entropy_score and policy.controller is not None
    assert policy.cost is ctx.cost and policy.cost.draft_step_ms == 0 and policy.overhead_ms == 0


@pytest.mark.slow
def test_bench_on_the_real_model(short_prompts, tmp_path):
    """The bundled SmolLM2 (chat template, real tokenizer): n-gram drafting reproduces target-only
    output on two Spec-Bench prompts."""
    res = CliRunner().invoke(main, ["bench", "--device", "cpu", "--prompts", str(short_prompts), "--limit", "2", "--batch-sizes", "1", "--max-tokens",
                                    "12", "--configs", "target,ngram", "--no-hf-baseline", "--max-seq-len", "512",
                                    "--warmup", "none", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output + str(res.exception)
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["config"], r["lossless_share"]) for r in rows] == [("target", 1.0), ("ngram", 1.0)]
    assert all(r["output_tokens"] == rows[0]["output_tokens"] for r in rows)


def test_runs_split_by_batch_size_merge_into_one_report(tiny_dir, short_prompts, tmp_path):
    base = ["bench", "--model", tiny_dir, "--prompts", str(short_prompts), "--device", "cpu", "--limit", "2", "--max-tokens", "4", "--configs",
            "target,ngram", "--no-hf-baseline", "--max-seq-len", "256", "--warmup", "none"]
    for b in ("1", "2"):
        res = CliRunner().invoke(main, base + ["--batch-sizes", b, "--out", str(tmp_path / f"b{b}")])
        assert res.exit_code == 0, res.output + str(res.exception)
    files = f"{tmp_path / 'b1' / 'results.json'},{tmp_path / 'b2' / 'results.json'}"
    res = CliRunner().invoke(main, ["bench", "--from-results", files, "--out", str(tmp_path / "all")])
    assert res.exit_code == 0, res.output + str(res.exception)
    data = json.loads((tmp_path / "all" / "results.json").read_text())
    assert data["meta"]["batch_sizes"] == [1, 2] and data["meta"]["prefill_varlen_batch_sizes"] == []
    packed = json.loads((tmp_path / "b2" / "results.json").read_text())  # as a GPU run packs at batch 2 only
    packed["meta"].update(prefill_varlen=True, prefill_varlen_batch_sizes=[2])
    (tmp_path / "packed.json").write_text(json.dumps(packed))
    res = CliRunner().invoke(main, ["bench", "--from-results", f"{tmp_path / 'b1' / 'results.json'},{tmp_path / 'packed.json'}",
                                    "--out", str(tmp_path / "mixed")])
    assert res.exit_code == 0, res.output + str(res.exception)
    mixed = json.loads((tmp_path / "mixed" / "results.json").read_text())["meta"]
    assert mixed["prefill_varlen"] is True and mixed["prefill_varlen_batch_sizes"] == [2]
    assert "varlen prefills at batch 2," in (tmp_path / "mixed" / "results.md").read_text()
    assert sorted((r["config"], r["batch_size"]) for r in data["results"]) == [
        ("ngram", 1), ("ngram", 2), ("target", 1), ("target", 2)]
    assert (tmp_path / "all" / "speedup.png").is_file() and "| ngram | 2 |" in (tmp_path / "all" / "results.md").read_text()
    md = tmp_path / "all" / "results.md"
    res = CliRunner().invoke(main, ["bench", "--from-results", f"{files},{md}", "--out", "x"])
    assert res.exit_code == 2 and f"--from-results {md}: not JSON" in res.stderr  # the bad file named
    # a hand-edited figure, or a row of a configuration the run did not list: one line, the file named
    bad = json.loads((tmp_path / "all" / "results.json").read_text())
    bad["results"][0]["tps"] = "abc"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    res = CliRunner().invoke(main, ["bench", "--from-results", str(tmp_path / "bad.json"), "--out", "x"])
    assert res.exit_code == 2 and "bad.json: not a tandem bench results.json (tps is 'abc', not a number)" in res.stderr
    bad["results"][0]["tps"], bad["results"][0]["config"] = 1.0, "bogus"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    res = CliRunner().invoke(main, ["bench", "--from-results", str(tmp_path / "bad.json"), "--out", "x"])
    assert res.exit_code == 2 and "results of bogus, not among meta.configs" in res.stderr
    # a hand-edited setting of the wrong type, named (not printed into the header)
    bad["results"][0]["config"] = "target"
    for key, value, want in [("round_kernels", 5, "meta.round_kernels is 5, not a str"),
                             ("kernels", ["x"], "meta.kernels is ['x'], not a str"),
                             ("batch_sizes", [1, "2"], "meta.batch_sizes is [1, '2'], not a list[int]"),
                             ("cuda_graphs", "yes", "meta.cuda_graphs is 'yes', not a bool")]:
        (tmp_path / "bad.json").write_text(json.dumps({**bad, "meta": {**bad["meta"], key: value}}))
        res = CliRunner().invoke(main, ["bench", "--from-results", str(tmp_path / "bad.json"), "--out", "x"])
        assert res.exit_code == 2 and want in res.stderr, (key, res.stderr)
    # runs of other kernels are not merged under one header
    other = json.loads((tmp_path / "b2" / "results.json").read_text())
    other["meta"]["round_kernels"] = "triton"
    (tmp_path / "other.json").write_text(json.dumps(other))
    res = CliRunner().invoke(main, ["bench", "--from-results", f"{tmp_path / 'b1' / 'results.json'},{tmp_path / 'other.json'}",
                                    "--out", "x"])
    assert res.exit_code == 2 and "cannot merge runs that differ in round_kernels" in res.stderr


def test_specformer_runs_on_its_own_engine_and_is_lossless(tiny_dir, short_prompts, tmp_path):
    """SpecFormer (drafts from the verify pass: the engine taps the target) beside target-only,
    also under exact kernels and under the context-aware policy; a random head is enough to check
    the wiring and losslessness."""
    from tandem.models.specformer import SpecFormerConfig, SpecFormerHead, save_specformer

    ck = load_checkpoint(tiny_dir)
    save_specformer(SpecFormerHead(SpecFormerConfig.for_target(ck.config)), tmp_path / "head", dtype=torch.float32)
    cfg = RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=256)
    tok = load_tokenizer(ck)
    options = BenchOptions(specformer=str(tmp_path / "head"), ca_drafter="specformer")
    for exact, names in ((False, "specformer,context-aware"), (True, "specformer")):
        report = run_benchmark(ck, tok, cfg, load_prompts(short_prompts), parse_configs(names), [2], options,
                               max_tokens=8, limit=3, exact_kernels=exact, progress=False, warmup="none")
        assert report.meta.fixed_step_tokens == (5 if exact else 0)
        sf = report.get("specformer", 2)
        assert sf.lossless_share == 1.0 and sf.drafted > 0 and sf.k == 4, (exact, sf)
        if not exact:  # context-aware over SpecFormer; a random head's drafts are rightly mostly cut
            assert report.get("context-aware", 2).lossless_share == 1.0


def test_ablation_over_specformer_chains_every_policy_row(tiny_dir, short_prompts, tmp_path):
    """``tandem bench --ablation --ca-drafter specformer``: every row is lossless, and every row
    but ``full-system`` (token trees) runs chained rounds, the policy rows setting widths from the
    scores the head makes inside the round."""
    import numpy as np

    from tandem.bench.configs import ablation_configs
    from tandem.models.specformer import SpecFormerConfig, SpecFormerHead, save_specformer
    from tandem.predictor import train_predictor

    ck = load_checkpoint(tiny_dir)
    save_specformer(SpecFormerHead(SpecFormerConfig.for_target(ck.config)), tmp_path / "head", dtype=torch.float32)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (300, 4)).astype(np.float32)
    predictor, report = train_predictor(x, (rng.uniform(size=300) < x[:, 1]).astype(np.float32), epochs=2)
    predictor.save(tmp_path / "p.safetensors", report)
    options = BenchOptions(specformer=str(tmp_path / "head"), ca_drafter="specformer", num_draft_tokens=2,
                           predictor=str(tmp_path / "p.safetensors"))
    names = ablation_configs(2)
    report = run_benchmark(ck, load_tokenizer(ck), RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=256),
                           load_prompts(short_prompts), parse_configs(",".join(names)), [2], options,
                           max_tokens=6, limit=2, progress=False, warmup="none")
    rows = {r.config: r for r in report.results}
    assert list(rows) == list(names)
    assert all(r.lossless_share == 1.0 for r in rows.values()), rows
    assert {n for n, r in rows.items() if not r.chained} == {"full-system"}


def test_bench_distributed_mode(tiny_dir, short_prompts, tmp_path):
    """--mode distributed runs each configuration through real verifier / drafter / router
    processes over loopback gRPC: same greedy output as target-only, acceptance reported; its
    warm-up passes counted against the replica's captures (none on a CPU: one pass, none timed)."""
    out = tmp_path / "dist"
    res = CliRunner().invoke(main, [
        "bench", "--model", tiny_dir, "--prompts", str(short_prompts), "--device", "cpu", "--limit", "2",
        "--batch-sizes", "2", "--max-tokens", "8", "--configs", "target,ngram,ngram-router-budget", "--mode", "distributed",
        "--warmup", "short", "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "results.json").read_text())
    assert report["meta"]["mode"] == "distributed" and report["meta"]["stream"] is False  # answers taken whole
    assert report["meta"]["admission"] == {"share": 0.125, "wait_rounds": 64, "overlap": False, "intake_ms": 0.0}  # the defaults, the replica's too
    assert "answers whole, admission share 0.125, wait 64 rounds" in (out / "results.md").read_text()
    assert all(r["warmup_passes"] == 1 and r["timed_captures"] == 0 for r in report["results"])
    for r in report["results"]:  # the timed pass as the replica saw it, and the processes' CPU time
        # two prompts of <= 8 tokens at batch 2: >= 4 steps (each a prefill or a round), <= 2 x 9
        assert 4 <= r["replica_steps"] <= 18 and 0 < r["replica_step_s"] < r["wall_s"], r
        assert 0 <= r["replica_deliver_s"] < r["replica_step_s"], r
        # its decode rounds (<= the steps: a step may only admit) over both rows, and its admissions
        assert 4 <= r["timed_rounds"] <= r["replica_steps"] and 1 <= r["timed_rows_per_round"] <= 2, r
        assert r["prefills"] >= 1 and r["prefill_host_ms"] > 0, r
        assert set(r["process_cpu_s"]) == {"router", "verifier", "client"}, r["process_cpu_s"]
        # (answers taken whole: the router's share of two short requests may be under the clock's tick)
        assert r["process_cpu_s"]["verifier"] > 0 and all(v >= 0 for v in r["process_cpu_s"].values()), r
    rows = {r["config"]: r for r in report["results"]}
    assert rows["target"]["speedup"] == 1.0 and rows["ngram"]["lossless_share"] == 1.0
    # the router's budget over the same drafter: lossless too; with 2 prompts it has seen too few drafts to
    # set a width (its decisions are tested in test_budget.py), so the replica's k stood
    assert rows["ngram-router-budget"]["lossless_share"] == 1.0 and rows["ngram-router-budget"]["drafted"] > 0
    assert rows["ngram-router-budget"]["router_draft_width"] is None and rows["ngram"]["router_draft_width"] is None
    r = rows["ngram"]
    check_acceptance_figures(r["drafted"], r["accepted"], r["acceptance_rate"], r["mean_accepted_length"],
                             r["output_tokens"], r["prompts"], r["k"])
    # through the processes, the same drafts and acceptances as the same decoding run in-process
    ref = Engine(tiny_dir, RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=256), drafter=NgramDrafter(),
                 num_draft_tokens=r["k"])
    stats = SpecDecodeStats()
    for c in ref.generate([p.text for p in bench_prompts(load_prompts(short_prompts), 2, 2)],
                          SamplingParams(max_tokens=8)):
        stats.merge(c.spec)
    assert (r["drafted"], r["accepted"]) == (stats.num_drafted, stats.num_accepted) and r["drafted"] > 0
    assert r["ttft_p50_ms"] > 0

    # clients that stream each step's tokens: the same output
    res = CliRunner().invoke(main, [
        "bench", "--model", tiny_dir, "--prompts", str(short_prompts), "--device", "cpu", "--limit", "2",
        "--batch-sizes", "2", "--max-tokens", "8", "--configs", "target", "--mode", "distributed", "--stream",
        "--warmup", "none", "--out", str(tmp_path / "streamed")])
    assert res.exit_code == 0, res.output
    streamed = json.loads((tmp_path / "streamed" / "results.json").read_text())
    assert streamed["meta"]["stream"] is True and streamed["results"][0]["ttft_p50_ms"] > 0
    assert "mode distributed, clients streaming" in res.stderr
    assert streamed["results"][0]["output_tokens"] == rows["target"]["output_tokens"]


def test_prompts_read_from_gzip_jsonl(tmp_path):
    """``load_prompts`` reads ``.jsonl.gz`` as it reads ``.jsonl`` (the repository's copy of the
    training prompts is compressed), and a ``.gz`` name over other bytes is a clear error."""
    import gzip

    from tandem.errors import InvalidRequestError

    rows = "".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}\u2028line two"}) + "\n" for i in range(3))
    (tmp_path / "p.jsonl").write_text(rows, encoding="utf-8")
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    assert load_prompts(tmp_path / "p.jsonl.gz") == load_prompts(tmp_path / "p.jsonl")
    (tmp_path / "bad.jsonl.gz").write_text(rows)
    with pytest.raises(InvalidRequestError, match="cannot be read as gzip"):
        load_prompts(tmp_path / "bad.jsonl.gz")


def test_summary_line_of_a_distributed_run_names_the_replicas_captures():
    """A distributed row has no in-process timed-pass figures; its summary line still says how
    many warm-up passes ran and how many graphs the replica captured inside the timed pass."""
    import math

    from tandem.bench.results import RunResult
    from tandem.bench.spec_bench import _summary

    nan = math.nan
    r = RunResult("target", 64, 0, 256, 1000, 1.0, 1000.0, 1.0, nan, 1.0, 0, 0, 1, 2, 1, 2, nan, 1.0, [],
                  warmup_passes=3, timed_captures=2)
    assert _summary(r).endswith("lossless 256/256; 2 graphs captured in the timed pass, after 3 warm-up passes")
    clean = RunResult("target", 64, 0, 256, 1000, 1.0, 1000.0, 1.0, nan, 1.0, 0, 0, 1, 2, 1, 2, nan, 1.0, [],
                      warmup_passes=1, timed_captures=0)
    assert _summary(clean).endswith("lossless 256/256")
    counted = RunResult("target", 64, 0, 256, 1000, 1.0, 1000.0, 1.0, nan, 1.0, 0, 0, 1, 2, 1, 2, nan, 1.0, [],
                        warmup_passes=1, replica_steps=300, replica_step_s=0.61, replica_deliver_s=0.05,
                        timed_rounds=290, timed_rows_per_round=48.5, prefills=10, prefill_host_ms=3.25,
                        process_cpu_s={"router": 0.9, "verifier": 1.2, "client": 0.8})
    assert _summary(counted).endswith("lossless 256/256; replica 300 steps, 0.61 s in them, 0.05 s handing out "
                                      "events, 290 rounds of 48.5 rows, 10 prefills of 3.2 ms host; CPU s router "
                                      "0.90, verifier 1.20, client 0.80")


def test_bench_meta_names_each_batch_sizes_attention():
    """The split-KV chunk is the runner's, by its slot count: the bench's metadata names the attention
    of each batch size when they differ, one name when they do not."""
    from tandem.bench.spec_bench import _attention_names

    cfg = RunnerConfig(device="cuda", dtype=torch.bfloat16)
    assert _attention_names(cfg, "fused", [1, 16, 64]) == ("triton-gqa-split128 (batch 1), "
                                                           "triton-gqa-split256 (batch 16, 64)")
    assert _attention_names(cfg, "fused", [64, 128]) == "triton-gqa-split256"
    assert _attention_names(RunnerConfig(attention_chunk=0), "fused", [1, 64]) == "triton-gqa"
    assert _attention_names(cfg, "reference", [1, 64]) == "sdpa-masked"


def test_cost_table_times_each_batch_size_with_its_engines_attention(tiny_dir, monkeypatch):
    """The bench's T(b, q) table is timed on a runner per split-KV chunk the batch sizes' engines
    take (a runner of few slots splits finer), each sized for the largest batch of its group; the
    table covers every batch size."""
    from tandem.bench import spec_bench
    from tandem.control import CostModel
    from tandem.models.runner_config import SMALL_BATCH, SMALL_BATCH_ATTENTION_CHUNK, DEFAULT_ATTENTION_CHUNK

    built = []

    class Runner:  # records the settings the table's runners are built with
        def __init__(self, checkpoint, config):
            built.append(config)
            self.config = config

    def measure(runner, sizes, max_q, iters):
        return CostModel({b: {q: runner.config.attention_chunk + b + q for q in range(1, max_q + 1)} for b in sizes})

    monkeypatch.setattr(spec_bench, "ModelRunner", Runner)
    monkeypatch.setattr(spec_bench, "resolve_kernels", lambda config, model: "fused")
    monkeypatch.setattr(CostModel, "measure", staticmethod(measure))
    ck = load_checkpoint(tiny_dir)
    cost = spec_bench.measure_cost_table(ck, RunnerConfig(device="cpu"), [1, SMALL_BATCH, 16, 64], 2)
    assert [(c.max_batch_size, c.attention_chunk) for c in built] == [(SMALL_BATCH, SMALL_BATCH_ATTENTION_CHUNK),
                                                                     (64, DEFAULT_ATTENTION_CHUNK)]
    assert cost.table[1][2] == SMALL_BATCH_ATTENTION_CHUNK + 3 and cost.table[64][1] == DEFAULT_ATTENTION_CHUNK + 65
    assert sorted(cost.table) == [1, SMALL_BATCH, 16, 64]


def test_bench_rejects_an_unknown_ca_drafter_when_it_parses():
    """--ca-drafter is checked with the options, before any model loads, whichever configurations run;
    its choices are the context-aware drafters the configurations build."""
    from tandem.bench.configs import CA_DRAFTERS
    from tandem.cli.bench import CA_DRAFTER_CHOICES

    assert sorted(CA_DRAFTER_CHOICES) == sorted(CA_DRAFTERS)
    for configs in ("target", "context-aware"):
        res = CliRunner().invoke(main, ["bench", "--configs", configs, "--ca-drafter", "target"])
        assert res.exit_code == 2 and "Invalid value for '--ca-drafter'" in res.stderr and "'target'" in res.stderr
    # called from Python (no CLI), the configurations still refuse it, with the same one-line reason
    with pytest.raises(ConfigError, match="--ca-drafter must be one of ngram, draft-model, specformer"):
        bench_configs._ca_base(BuildContext(None, BenchOptions(ca_drafter="target")))


def test_an_in_process_rows_summary_names_the_graphs_its_timed_pass_captured():
    """Graphs captured inside a timed pass distort it: the row counts them and names each
    (``CapturedCall.labels``), in its summary line and through results.json; an eager call (no
    capture) names nothing."""
    import math

    from tandem.bench.results import BenchMeta, BenchReport, RunResult
    from tandem.bench.spec_bench import _summary

    made, labels = CapturedCall.made, list(CapturedCall.labels)
    CapturedCall(lambda x: x + 1, (torch.zeros(2),), capture=False, label="round b1 q1 ctx256")
    assert (CapturedCall.made, CapturedCall.labels) == (made, labels)
    nan = math.nan
    r = RunResult("specformer", 64, 4, 256, 1000, 1.0, 1000.0, 1.0, 0.3, 2.4, 10, 3, 1, 2, 1, 2, nan, 1.0, [],
                  round_wall_ms=1.7, timed_rounds=350, timed_rows_per_round=41.1, prefills=8, prefill_host_ms=15.4,
                  timed_captures=2, timed_capture_labels=["round b64 q5 ctx1536", "specformer prime False False False"],
                  warmup_passes=3)
    assert ("8 prefills of 15.4 ms host, 2 graphs captured (round b64 q5 ctx1536, specformer prime False False "
            "False), after 3 warm-up passes") in _summary(r)
    meta = BenchMeta(model="m", device="cpu", gpu="cpu", dtype="float32", cuda_graphs=False, compile=False,
                     exact_kernels=False, fixed_step_tokens=0, mode="inproc", configs=["specformer"], batch_sizes=[64],
                     max_tokens=256, prompts_file="p", options={}, torch="2", date_utc="2026-12-07T00:00:00+00:00")
    back = BenchReport.from_dict(json.loads(json.dumps(BenchReport(meta, [r]).to_dict())))
    assert back.results[0].timed_capture_labels == r.timed_capture_labels
    from tandem.bench.spec_bench import _first_labels

    assert _first_labels([f"g{i}" for i in range(9)]) == "g0, g1, g2, g3, g4, g5 and 3 more"


def test_server_warmup_runs_every_round_shape_first_and_changes_no_output(tiny_dir, short_prompts, monkeypatch):
    """--warmup server: before its warm-up pass each in-process engine meets every decode-round shape
    (``capture_round_shapes``, as a verifier replica before it serves; on a CPU the rounds run
    eagerly and nothing is captured), leaves nothing behind, and the outputs stay target-only's;
    the CLI offers exactly the bench's warm-up modes."""
    from tandem import warmup as warmup_mod
    from tandem.bench import spec_bench
    from tandem.cli.bench import bench as bench_cmd

    engines = []

    def spy(engine, *args, **kw):
        engines.append(engine)
        return warmup_mod.capture_round_shapes(engine, *args, **kw)

    monkeypatch.setattr(spec_bench, "capture_round_shapes", spy)
    ck = load_checkpoint(tiny_dir)
    report = run_benchmark(ck, load_tokenizer(ck), RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=256),
                           load_prompts(short_prompts), parse_configs("ngram"), [2], BenchOptions(num_draft_tokens=3),
                           max_tokens=8, limit=2, progress=False, warmup="server")
    assert len(engines) == 2 and all(e.chains_rounds for e in engines)  # target-only and n-gram
    ngram = report.get("ngram", 2)
    assert ngram.lossless_share == 1.0 and ngram.warmup_passes == 1 and ngram.startup_captures == 0
    assert report.meta.warmup == "server"
    choices = next(p for p in bench_cmd.params if p.name == "warmup").type.choices
    assert tuple(choices) == spec_bench.WARMUP_MODES
