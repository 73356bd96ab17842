"""``tandem bench``: decoding configurations (``tandem.bench.configs``) compared on Spec-Bench
prompts per batch size, or earlier results merged (``--from-results``)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click
from tqdm import tqdm

from ..admission import ADMISSION_DEFAULTS
from ..data import bundled_spec_bench, load_prompts
from ..errors import InvalidRequestError
from .common import (console, device_option, dtype_option, err_console, fail, graph_options, init_tracing, kernels_option,
                     model_option, out_dir,
                     torch_dtype, with_admission_options, with_drafter_options, with_sampling_options)

# tandem.bench.configs.CA_DRAFTERS, spelled here so the options parse without importing torch
# (tests/test_bench.py checks that the two agree)
CA_DRAFTER_CHOICES = ("draft-model", "ngram", "specformer")


@click.command()
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="Spec-Bench style JSONL (default: the bundled Spec-Bench copy).")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="Prompts at batch 1 (batch b runs max(limit, 2b)), round-robin across the Spec-Bench tasks.")
@click.option("--batch-sizes", default="1,16,64", show_default=True, help="Comma-separated batch sizes.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@with_sampling_options
@click.option("--configs", "configs_spec", default=None, metavar="NAME,...",
              help="Configurations to compare: target, ngram, draft-model, specformer, context-aware, hf-generate, "
                   "hf-prompt-lookup; target-host, ngram-host, specformer-host run host-drafted rounds instead of "
                   "chained device rounds; ngram-router-budget, specformer-router-budget (--mode distributed: "
                   "the router's batch budget sets the width); the ablation's rows (fixed-k=<n>, random-length, entropy-threshold, "
                   "predictor-fixed-tau, predictor-online-tau, batch-width, budget, full-system) over --ca-drafter "
                   "(target always runs: it is the baseline). Default: target,ngram (+ hf-generate; n-gram needs no "
                   "weights of its own).")
@click.option("--hf-baseline/--no-hf-baseline", default=None,
              help="Add (or drop) hf-generate in --configs; on by default when --configs is not given.")
@click.option("--hf-limit", type=click.IntRange(min=1), default=5, show_default=True,
              help="Prompts for the HF references (batch 1 only: they are slow).")
@click.option("--specformer", "specformer_path", default=None, metavar="PATH",
              help="SpecFormer head for the specformer configuration (default: the one shipped for the bundled model).")
@click.option("--ca-drafter", type=click.Choice(CA_DRAFTER_CHOICES), default="draft-model", show_default=True,
              help="Drafter the context-aware configuration controls.")
@click.option("--exact-kernels", is_flag=True,
              help="Run every decode step of every configuration (target-only too) with one shape, [b, k+1], and "
                   "prefill prompts one by one, so bf16 GPU outputs are identical token for token (slower).")
@click.option("--cost-table", is_flag=True, help="Also measure the verifier step time T(b, q) for q = 1..k+1.")
@click.option("--warmup", type=click.Choice(["full", "short", "none", "server"]), default="full", show_default=True,
              help="Warm-up passes before each timed pass, repeated (at most 3) while one captures CUDA graphs "
                   "(in the bench's process, or the verifier replica's with --mode distributed): full = the same "
                   "prompts (every CUDA graph and compile is made before timing); short = max(2b, 4) of them "
                   "(faster; later context lengths are captured inside the timing); none = no warm-up (CPU runs, "
                   "output checks); server = full, after capturing every decode-round shape first as a verifier "
                   "replica does before it serves (in process with CUDA graphs; a replica always does).")
@click.option("--mode", type=click.Choice(["inproc", "distributed"]), default="inproc", show_default=True,
              help="inproc: one process; distributed: through the gRPC services (tandem serve).")
@click.option("--stream", is_flag=True,
              help="--mode distributed: the clients stream each step's tokens through the router (TTFT and TPOT as a "
                   "streaming client sees them) instead of taking each answer whole, as the in-process run does.")
@model_option
@device_option
@graph_options
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
@dtype_option
@kernels_option
@click.option("--attention-chunk", type=click.IntRange(min=0), default=None,
              help="Split-KV for our decode/verify attention over fixed chunks of this many cache positions (a "
                   "multiple of 64; 0 = none): more programs for few rows or long contexts, still batch-invariant. "
                   "Default: where our attention kernel runs (fused, fused-linear), 128 for a batch size up to 4 "
                   "and 256 above (the runner's, never the step's), else none. In-process mode only.")
@click.option("--ablation", is_flag=True,
              help="The context-aware ablation as the configuration set: target, fixed-k=1 .. fixed-k=<k>, "
                   "random-length, entropy-threshold, predictor-fixed-tau, predictor-online-tau, batch-width, budget, "
                   "full-system over --drafter (or --ca-drafter) at k = --num-draft-tokens; the predictor rows "
                   "use --predictor PATH|auto.")
@with_drafter_options
@with_admission_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Write results.json, results.md and the PNG plots here.")
@click.option("--from-results", "from_results", default=None, metavar="FILE,...",
              help="Run nothing: merge these results.json files (e.g. batch sizes run in separate calls) and write "
                   "the tables and plots to --out.")
def bench(prompts_file, limit, batch_sizes, max_tokens, temperature, top_p, top_k, seed, configs_spec, hf_baseline, hf_limit, specformer_path, ca_drafter,
          exact_kernels, cost_table, warmup, mode, stream, model, device, cuda_graphs, compile_, prefill_graphs,
          prefill_varlen, max_seq_len, dtype, kernels, attention_chunk, ablation, drafter, draft_model, num_draft_tokens, predictor, acceptance_threshold, branch_top_m, admission_share,
          admission_wait_rounds, admission_overlap, admission_intake_ms, out, from_results) -> None:
    """Compare decoding configurations on Spec-Bench prompts: TPS, speedup over target-only,
    acceptance, latency, memory and the lossless check, per batch size. Greedy by default; with
    --temperature > 0 every request samples (one seed, --seed or 0, so that each configuration's
    run is reproducible), and outputs are not compared token for token (speculative sampling keeps
    the target's distribution, not its draws)."""
    if out is not None:
        if not out.strip():
            fail("--out is empty: give the directory to write results.json and the tables to")
        out_dir(out)  # before anything runs
    if from_results:
        ctx = click.get_current_context()
        ignored = sorted(p.opts[0] for p in ctx.command.params
                         if p.name not in ("from_results", "out")
                         and ctx.get_parameter_source(p.name) is click.core.ParameterSource.COMMANDLINE)
        if ignored:  # nothing runs: the files' own settings stand
            err_console.print(f"note: {', '.join(ignored)} do{'es' if len(ignored) == 1 else ''} nothing with "
                              "--from-results (the results files' own settings stand)", highlight=False, soft_wrap=True)
        _bench_from_results(from_results, out)
        return
    init_tracing()
    sampling = _sampling(temperature, top_p, top_k, seed)

    try:
        given = [int(b) for b in batch_sizes.split(",")]  # an empty item is an error, not skipped
        if not given or min(given) < 1:
            raise ValueError
    except ValueError:
        fail(f"--batch-sizes must be positive integers separated by commas, got {batch_sizes!r}")
        return
    if len(set(given)) != len(given):
        fail(f"--batch-sizes names a batch size twice: {batch_sizes!r}")
    sizes = sorted(given)
    try:
        records = load_prompts(prompts_file or bundled_spec_bench())
    except InvalidRequestError as exc:
        fail(str(exc))
        return
    if not records:
        fail(f"the prompts file {prompts_file or bundled_spec_bench()} has no prompts")
    if ablation:  # the paper's ablation rows are configurations on the same engines (tandem.bench.configs)
        from ..bench.configs import ablation_configs  # torch

        if configs_spec:
            fail("--ablation runs its own configuration set; drop --configs")
        if acceptance_threshold != "auto":
            fail("--ablation rows set θ themselves (the online controller, or none); drop --acceptance-threshold")
        configs_spec, hf_baseline = ",".join(ablation_configs(num_draft_tokens)), False
        if drafter != "none":
            ca_drafter, drafter = drafter, "none"
        elif click.get_current_context().get_parameter_source("drafter") is click.core.ParameterSource.COMMANDLINE:
            fail("--ablation compares draft policies over a drafter: --drafter none has none to compare "
                 "(--ca-drafter or --drafter ngram, draft-model or specformer)")
        if predictor == "auto":  # the predictor saved next to the drafter's weights
            predictor = None
    _bench_configs(records, str(prompts_file or bundled_spec_bench()), limit, sizes, max_tokens, configs_spec,
                   hf_baseline, hf_limit, specformer_path, ca_drafter, exact_kernels, cost_table, mode, model, device, cuda_graphs,
                   compile_, max_seq_len, dtype, drafter, draft_model, num_draft_tokens, predictor, acceptance_threshold, branch_top_m,
                   out, warmup, kernels, prefill_graphs, attention_chunk, stream, prefill_varlen,
                   (admission_share, admission_wait_rounds, admission_overlap, admission_intake_ms / 1e3), sampling)


def _sampling(temperature: float, top_p: float, top_k: int, seed: int | None) -> dict:
    """The bench's sampling settings (``run_benchmark``'s ``sampling``): empty for greedy decoding; a
    sampled run gets seed 0 unless one is given, so that its rounds are reproducible (the round-cost
    pass runs the batch twice) and runs of it compare."""
    if temperature == 0:
        given = [f for f, on in (("--seed", seed is not None), ("--top-p", top_p < 1), ("--top-k", top_k > 0)) if on]
        if given:
            err_console.print(f"note: {', '.join(given)} do{'es' if len(given) == 1 else ''} nothing under greedy "
                              "decoding (--temperature 0)", highlight=False, soft_wrap=True)
        return {}
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": 0 if seed is None else seed}
    from ..sampling import SamplingParams  # torch

    try:
        SamplingParams(**sampling)  # a bad value is refused before the model loads
    except InvalidRequestError as exc:
        fail(str(exc))
    return sampling


def _bench_configs(records, prompts_file, limit, sizes, max_tokens, configs_spec, hf_baseline, hf_limit,
                   specformer_path, ca_drafter, exact_kernels, cost_table, mode, model, device, cuda_graphs, compile_,
                   max_seq_len, dtype, drafter, draft_model, num_draft_tokens, predictor, acceptance_threshold, branch_top_m, out,
                   warmup, kernels="auto", prefill_graphs=None, attention_chunk=None, stream=False,
                   prefill_varlen=None, admission=ADMISSION_DEFAULTS, sampling=None) -> None:
    """``tandem bench`` without --ablation: every configuration at every batch size (tandem.bench)."""
    # torch-backed
    from ..bench.configs import BenchOptions, parse_configs, predictor_path
    from ..bench.report import tables, write_json, write_report
    from ..bench.spec_bench import check_mode, run_benchmark
    from ..models.runner import check_runner_config, default_runner_config
    from ..models.runner_config import varlen_batch_sizes
    from ..models.weights import load_checkpoint
    from ..tokenizer import load_tokenizer

    if drafter != "none":
        fail("--drafter is for --ablation; choose configurations with --configs")
    if configs_spec is not None:
        parse_configs(configs_spec)  # an empty list or item is an error before anything else
    names = [n.strip() for n in (configs_spec or "target,ngram").split(",")]
    if hf_baseline or (hf_baseline is None and configs_spec is None):
        names.append("hf-generate")
    elif hf_baseline is False:
        names = [n for n in names if n != "hf-generate"]
    refs = [n for n in names if n.startswith("hf-")]
    if sampling and refs:  # the HF references decode greedily: nothing to set a sampled run against
        if hf_baseline or any(n.strip() in refs for n in (configs_spec or "").split(",")):
            fail(f"{', '.join(refs)} decode{'s' if len(refs) == 1 else ''} greedily; drop "
                 f"{'--hf-baseline' if hf_baseline else 'it from --configs'} to bench with --temperature > 0")
        names = [n for n in names if n not in refs]
        err_console.print("note: hf-generate (greedy) is left out of a sampled bench"
                          + ("; only target runs (name the configurations to compare with --configs)"
                             if names == ["target"] else ""), highlight=False, soft_wrap=True)
    configs = parse_configs(",".join(names))
    check_mode(mode)
    if attention_chunk is not None and mode != "inproc":
        fail("--attention-chunk applies to --mode inproc (the services take the default attention)")
    if stream and mode != "distributed":
        fail("--stream applies to --mode distributed (in process, each answer is taken whole)")
    predictor = None if predictor == "auto" else predictor  # None: the one saved next to the drafter, if any
    options = BenchOptions(num_draft_tokens=num_draft_tokens, draft_model=draft_model, specformer=specformer_path,
                           ca_drafter=ca_drafter, predictor=predictor, acceptance_threshold=acceptance_threshold, branch_top_m=branch_top_m)
    cfg = default_runner_config(device, max_batch_size=max(sizes), max_seq_len=max_seq_len, cuda_graphs=cuda_graphs,
                                compile=compile_, dtype=torch_dtype(dtype), kernels=kernels,
                                prefill_graphs=prefill_graphs, prefill_varlen=prefill_varlen,
                                attention_chunk=attention_chunk)
    checkpoint = load_checkpoint(model)
    check_runner_config(cfg, checkpoint.config)  # the kernel settings, before anything is printed or built
    uses_predictor = any(c.uses_predictor for c in configs)
    options = replace(options,  # the results record which predictor ran (none when no configuration uses one)
                      predictor=predictor_path(options, checkpoint) if uses_predictor else None)
    packed = varlen_batch_sizes(cfg, checkpoint.config, sizes)
    err_console.print(f"device {cfg.device}, dtype {cfg.dtype}, CUDA graphs {cfg.cuda_graphs}, compile {cfg.compile}, "
                      f"prefills {'varlen (packed)' if packed == sizes else f'varlen at batch {packed}' if packed else 'padded'}; "
                      f"configurations {', '.join(c.name for c in configs)}; batch sizes {sizes}"
                      + (f"; mode distributed, {'clients streaming' if stream else 'answers whole'}"
                         if mode == "distributed" else ""), highlight=False,
                      soft_wrap=True)
    report = run_benchmark(checkpoint, load_tokenizer(checkpoint), cfg, records, configs, sizes, options,
                           max_tokens=max_tokens, limit=limit, hf_limit=hf_limit, exact_kernels=exact_kernels,
                           cost_table=cost_table, mode=mode, prompts_file=prompts_file, warmup=warmup, stream=stream,
                           admission=admission, sampling=sampling,
                           say=lambda msg: tqdm.write(msg, file=sys.stderr),
                           on_result=(lambda partial: write_json(partial, out)) if out else None)
    for t in tables(report):
        console.print(t.to_rich())
    if out:
        written = write_report(report, out)
        console.print("wrote " + ", ".join(str(p) for p in written), highlight=False)


def _bench_from_results(files: str, out) -> None:
    """``tandem bench --from-results``: merge results.json files into one set of tables and plots."""
    from ..bench.report import tables, write_report  # torch
    from ..bench.results import BenchReport, merge_reports

    if not out:
        fail("--from-results needs --out")
    reports = []
    names = [f.strip() for f in files.split(",") if f.strip()]
    for name in names:
        try:
            text = Path(name).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"--from-results {name}: {exc}")
            return
        try:
            data = json.loads(text)
        except ValueError as exc:
            fail(f"--from-results {name}: not JSON, so not a tandem bench results.json ({exc})")
            return
        try:
            reports.append(BenchReport.from_dict(data))
        except ValueError as exc:
            fail(f"--from-results {name}: {exc}")
            return
    try:
        report = merge_reports(reports)
    except ValueError as exc:
        fail(f"--from-results {', '.join(names) or files!r}: {exc}")
        return
    for t in tables(report):
        console.print(t.to_rich())
    console.print("wrote " + ", ".join(str(p) for p in write_report(report, out)), highlight=False)
