"""Spec-Bench runner: every configuration on the same prompts, at every batch size.

For each batch size b the runner builds one target engine (``b`` KV cache slots), runs
target-only decoding, then each configuration of ``tandem.bench.configs`` on the same prompts
(first turn, chat template, greedy), each as a warm-up pass and a timed pass. Metrics follow
docs/architecture.md ("Metrics"): TPS for the whole batch, speedup over target-only at the same batch size in
the same run, acceptance rate α, mean accepted length τ_acc, TTFT / TPOT p50 and p99, peak
GPU memory, and the lossless check (share of prompts whose tokens equal target-only's).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import importlib.util
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from ..admission import ADMISSION_DEFAULTS, AdmissionPolicy, admission_settings
from ..control import CostModel
from ..data import PromptRecord, round_robin_by_category, spec_bench_task
from ..engine import Completion, Engine
from ..errors import ConfigError
from ..metrics import SpecDecodeStats
from ..models.attention import attention_name
from ..models.kernels import round_kernels_on
from ..models.runner import CapturedCall, ModelRunner, RunnerConfig, resolve_attention_chunk, resolve_kernels
from ..models.runner_config import varlen_batch_sizes
from ..models.weights import Checkpoint
from ..profiling import StepTimeline
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from ..warmup import capture_round_shapes
from ..speculation import SpeculativeConfig, build_engine
from .configs import BenchConfig, BenchOptions, BuildContext, prepare_configs
from .results import BenchMeta, BenchReport, RunResult, TaskStats
from .round_cost import RoundCost, measure_round_cost
from .throughput import bench_hf_generate
from .warmup_passes import MAX_WARMUP_PASSES, WARMUP_MODES, warmup_passes_then_timed, warmup_share  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # the serving stack is optional (tandem[serve])
    from services.launch import ReplicaCounters

MODES = ("inproc", "distributed")


def _attention_names(config: RunnerConfig, kernels: str, sizes: list[int]) -> str:
    """The decode/verify attention of the engines at each batch size, for the bench's metadata:
    one name when every size takes the same (``attention_name``), else ``name (batch b, ...)`` per
    name (the split-KV chunk is the runner's, by its slot count: ``resolve_attention_chunk``)."""
    by_name: dict[str, list[int]] = {}
    for b in sizes:
        name = attention_name(kernels, resolve_attention_chunk(replace(config, max_batch_size=b), kernels))
        by_name.setdefault(name, []).append(b)
    if len(by_name) == 1:
        return next(iter(by_name))
    return ", ".join(f"{n} (batch {', '.join(map(str, bs))})" for n, bs in by_name.items())


def check_mode(mode: str) -> None:
    """Fail early for a mode this installation cannot run.

    Raises:
        ConfigError: an unknown mode, or ``distributed`` without the serving stack.
    """
    if mode not in MODES:
        raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "distributed" and importlib.util.find_spec("services") is None:
        raise ConfigError("distributed mode needs the serving stack (tandem serve): the `services` package is not "
                          "importable here")


DISTRIBUTED_CONFIGS = ("target", "ngram", "draft-model", "specformer", "context-aware", "ngram-router-budget",
                       "specformer-router-budget")


def check_distributed(configs: list[BenchConfig], options: BenchOptions) -> None:
    """Fail before any run for a configuration the service stack cannot run.

    Raises:
        ConfigError: a configuration other than ``DISTRIBUTED_CONFIGS`` (the ablations, the
            *-host round paths and Hugging Face's generate compare variants in one process).
    """
    for c in configs:
        if c.is_reference or c.name in DISTRIBUTED_CONFIGS:
            continue
        raise ConfigError(f"--mode distributed runs {', '.join(DISTRIBUTED_CONFIGS)}, not {c.name!r} (the ablations, "
                          f"the *-host round paths and hf-* compare variants in one process)")


def check_inproc(configs: list[BenchConfig]) -> None:
    """Fail before any run for a configuration that needs the service stack.

    Raises:
        ConfigError: a ``router_budget`` configuration (the router sets its widths).
    """
    for c in configs:
        if c.router_budget:
            raise ConfigError(f"{c.name} runs only with --mode distributed: the router's draft budget sets its widths")


def replica_runner_options(cfg: RunnerConfig, admission: tuple = ADMISSION_DEFAULTS) -> tuple[str, ...]:
    """``tandem serve verifier`` options that give a replica the bench's own runner and admission
    settings, so the distributed run differs from the in-process one only by the processes and the
    network."""
    on = {True: "--", False: "--no-"}
    admission = admission_settings(admission)
    return (("--device", str(cfg.device), "--dtype", str(cfg.dtype).removeprefix("torch."), "--kernels", cfg.kernels,
             "--admission-share", repr(float(admission[0])), "--admission-wait-rounds", str(int(admission[1])),
             f"{on[bool(admission[2])]}admission-overlap", "--admission-intake-ms", repr(1e3 * float(admission[3])),
             f"{on[bool(cfg.cuda_graphs)]}cuda-graphs", f"{on[bool(cfg.compile)]}compile",
             f"{on[bool(cfg.cuda_graphs if cfg.prefill_graphs is None else cfg.prefill_graphs)]}prefill-graphs")
            + ((f"{on[cfg.prefill_varlen]}prefill-varlen",) if cfg.prefill_varlen is not None else ()))


def run_distributed(config: BenchConfig, spec: SpeculativeConfig, options: BenchOptions, model: str,
                    runner_config: RunnerConfig, records: list[PromptRecord], batch_size: int, params: SamplingParams,
                    desc: str, progress: bool, warmup: str = "full", stream: bool = False,
                    prompt_ids: dict[str, list[int]] | None = None,
                    admission: tuple = ADMISSION_DEFAULTS) -> "DistributedRun":
    """Run ``records`` through the disaggregated stack serving ``spec`` (``config``'s
    speculation): ``tandem serve`` verifier replica, router and, for the draft model, a drafter
    service as separate processes on loopback gRPC (``services.launch``), every request in flight
    at once through ``Router.Generate`` with the replica's KV slots (``batch_size``) bounding the
    batch, as in process; warm-up passes (``warmup_share``) repeated while the replica captured
    CUDA graphs during one (``warmup_passes_then_timed`` over its ``Load`` reports, as in
    process), then the timed pass. Each answer comes whole (``final_only``), as the in-process
    ``Engine.generate`` takes it; with ``stream`` the clients stream each step's tokens instead.
    ``prompt_ids`` (by prompt id): the prompts tokenized before the timer, as in process, sent as
    token ids (``GenerateRequest.prompt_ids``); without them the router tokenizes each prompt.
    ``admission``: the replica's ``AdmissionPolicy`` (share, wait_rounds, overlap, intake_s).

    Raises:
        ConfigError: a configuration the stack cannot run (``check_distributed``).
        RuntimeError / TimeoutError: a service failed to start.
    """
    from services.launch import StackConfig, start_stack
    from services.router.client import generate_all

    check_distributed([config], options)
    # replicas learn acceptance_threshold online: the stack serves the configuration with acceptance_threshold "auto"
    stack = start_stack(StackConfig.serving(replace(spec, acceptance_threshold="auto"), model=model, max_batch_size=batch_size,
                                            max_seq_len=runner_config.max_seq_len,
                                            measure_cost=config.uses_cost_model or config.router_budget,
                                            replica_options=replica_runner_options(runner_config, admission)),
                        timeout_s=900)
    warmup_passes = 0
    try:
        for label, run in warmup_passes_then_timed(warmup_share(records, batch_size, warmup), records,
                                                   captured=stack.graphs_captured):
            warmup_passes += label == "warm-up"
            if label == "timed":
                counters0, cpu0, client0 = stack.replica_counters(), stack.cpu_seconds(), time.process_time()
            with tqdm(total=len(run), desc=f"{desc} {label} (distributed)", unit="prompt", leave=False,
                      file=sys.stderr, disable=None if progress else True) as bar:
                t0 = time.perf_counter()
                # every request in flight at once, as the in-process engine holds them all queued: the
                # replica's batch_size KV slots bound the batch, and its admission policy fills them
                comps = generate_all(stack.grpc_address, run, params, len(run), on_finish=lambda _: bar.update(),
                                     final_only=not stream, prompt_ids=prompt_ids)
                wall = time.perf_counter() - t0
        replica = stack.replica_counters() - counters0
        cpu = {name: s - cpu0.get(name, 0.0) for name, s in stack.cpu_seconds().items()}
        cpu["client"] = time.process_time() - client0
        width = _router_draft_width(stack.http_url)
    finally:
        stack.stop()
    return DistributedRun(comps, wall, width, warmup_passes, replica, cpu)


@dataclass
class DistributedRun:
    """What ``run_distributed`` measured: the timed pass's completions (record order; TTFT / TPOT
    measured by the client, network included) and wall time (s), the draft width the router's
    budget had set on the replica when it ended (None: none set), the warm-up passes run before
    it, and during it: the replicas' counters (``services.launch.ReplicaCounters``: CUDA graphs
    captured, 0 when none was timed; engine steps, the seconds inside them and after them handing
    events to the streams; decode rounds and their rows; prefills and their host seconds), and
    each process's CPU seconds (``Stack.cpu_seconds`` by name, and ``client``: this process,
    which sent the requests and read the answers)."""

    completions: list[Completion]
    wall_s: float
    router_draft_width: int | None
    warmup_passes: int
    replica: ReplicaCounters
    process_cpu_s: dict[str, float]


def _router_draft_width(http_url: str) -> int | None:
    """The draft width the stack's router last set on its (one) replica, from its /health."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{http_url}/health", timeout=30) as resp:
        verifiers = json.loads(resp.read())["verifiers"]
    return verifiers[0]["draft_width"] if verifiers else None


def bench_prompts(records: list[PromptRecord], batch_size: int, limit: int) -> list[PromptRecord]:
    """The prompts batch size ``b`` runs: ``limit`` at batch 1, ``max(limit, 2b)`` above (so
    the batch stays full for most of the run), taken round-robin across the Spec-Bench tasks."""
    n = limit if batch_size == 1 else max(limit, 2 * batch_size)
    return round_robin_by_category(records, n, key=lambda r: spec_bench_task(r.category))


def measure_cost_table(checkpoint: Checkpoint, config: RunnerConfig, batch_sizes: list[int], max_q: int,
                       iters: int = 10) -> CostModel:
    """T(b, q) in ms for every b in ``batch_sizes`` and q = 1..``max_q`` (``runner.measure_step_ms``
    via ``CostModel.measure``, context 512), on runners of the engines' settings without exact-kernel
    padding (which would flatten the table): one per split-KV chunk the batch sizes' engines take
    (``resolve_attention_chunk``: a runner of few slots splits finer), sized for the largest batch
    of its group, so each T(b, q) is timed with the attention its engine runs. The runners are
    freed afterwards."""
    kernels = resolve_kernels(config, checkpoint.config)
    groups: dict[int, list[int]] = {}
    for b in batch_sizes:
        groups.setdefault(resolve_attention_chunk(replace(config, max_batch_size=b), kernels), []).append(b)
    table: dict[int, dict[int, float]] = {}
    for chunk, sizes in groups.items():
        runner = ModelRunner(checkpoint, replace(config, max_batch_size=max(sizes), fixed_step_tokens=0,
                                                 attention_chunk=chunk))
        try:
            table.update(CostModel.measure(runner, sizes, max_q, iters=iters).table)
        finally:
            del runner
            _free_memory()
    return CostModel(table)


def run_benchmark(checkpoint: Checkpoint, tokenizer: Tokenizer, config: RunnerConfig, records: list[PromptRecord],
                  configs: list[BenchConfig], batch_sizes: list[int], options: BenchOptions, *,
                  max_tokens: int = 256, limit: int = 20, hf_limit: int = 5, exact_kernels: bool = False,
                  cost_table: bool = False, mode: str = "inproc", prompts_file: str = "", progress: bool = True,
                  warmup: str = "full", stream: bool = False, admission: tuple = ADMISSION_DEFAULTS,
                  sampling: dict | None = None, say: Callable[[str], None] = lambda msg: None,
                  on_result: Callable[[BenchReport], None] | None = None) -> BenchReport:
    """Run every configuration at every batch size (greedy unless ``sampling``, chat template, first turns).

    Args:
        checkpoint, tokenizer: the target.
        config: runner settings (device, dtype, graphs, context); ``max_batch_size`` is set per
            batch size.
        records: the prompt pool; ``bench_prompts`` picks each batch size's share.
        configs: from ``configs.parse_configs`` (``target`` first).
        options: drafter options.
        max_tokens: new tokens per prompt at most.
        limit: prompts at batch 1 (``max(limit, 2b)`` at batch b).
        hf_limit: prompts for the HF references (batch 1 only: they are slow).
        exact_kernels: one decode shape for every step (``RunnerConfig.fixed_step_tokens``).
        cost_table: also measure T(b, q), q = 1..k+1.
        mode: "inproc" (this process) or "distributed" (``run_distributed``).
        progress: tqdm bars on stderr (shown only on a terminal).
        warmup: "full", "short" or "none" (``warmup_share``).
        stream: distributed mode: the clients stream each step's tokens (else each answer comes whole).
        admission: ``(share, wait_rounds, overlap)`` of every engine's ``AdmissionPolicy`` (a replica's too).
        sampling: ``SamplingParams`` fields every request samples with (``temperature`` > 0 and a
            ``seed``, so that each run, and the round-cost pass's two, make the same draws), or
            None / empty for greedy decoding. Sampled outputs are not compared with target-only's
            token for token (``lossless_share`` NaN): speculative sampling keeps the target's
            distribution, not its draws.
        say: receives one line per finished run.
        on_result: receives the report so far after every run (to save partial results).

    Returns:
        The report: one ``RunResult`` per (configuration, batch size) that ran (references at
        batch 1 only), plus the cost table if asked.

    Raises:
        ConfigError, ModelLoadError: a configuration cannot be built (checked before any run).
        ValueError: ``sampling`` greedy or without a seed, or with HF references (they decode greedily).
    """
    check_mode(mode)
    params = SamplingParams(max_tokens=max_tokens, **(sampling or {}))
    if sampling and (params.greedy or params.seed is None):
        raise ValueError(f"a sampled bench needs temperature > 0 and a seed, got {sampling}")
    if sampling and any(c.is_reference for c in configs):
        raise ValueError("the HF references decode greedily: a sampled bench has nothing to compare them with")
    warmup_share([], 1, warmup)  # an unknown mode fails before anything is built
    admission = admission_settings(admission)  # bad settings fail here too
    if not configs or configs[0].name != "target":
        raise ValueError("configs must start with target (configs.parse_configs orders them)")
    sizes = sorted(set(batch_sizes))
    engine_configs = [c for c in configs if not c.is_reference]
    fixed = max(c.tokens_per_row(options) for c in engine_configs) if exact_kernels else 0
    if mode == "distributed":
        check_distributed(configs, options)
    else:
        check_inproc(configs)
    ctx = BuildContext(checkpoint, options)
    prepare_configs(configs, ctx)
    if cost_table or any(c.uses_cost_model for c in configs):
        max_q = max([options.num_draft_tokens + 1] + [c.tokens_per_row(options) for c in configs if c.uses_cost_model])
        say(f"measuring the verifier cost model T(b, q), q = 1..{max_q}")
        ctx.cost = measure_cost_table(checkpoint, config, sizes, max_q)
    rc = config  # the settings every engine shares (batch size aside)
    packed = varlen_batch_sizes(rc, checkpoint.config, sizes)
    kernels = resolve_kernels(rc, checkpoint.config)
    meta = BenchMeta(model=str(checkpoint.path), device=rc.device,
                     gpu=torch.cuda.get_device_name(rc.device) if rc.device.startswith("cuda") else "cpu",
                     dtype=str(rc.dtype).removeprefix("torch."), cuda_graphs=rc.cuda_graphs, compile=rc.compile,
                     exact_kernels=exact_kernels, fixed_step_tokens=fixed, mode=mode, configs=[c.name for c in configs],
                     batch_sizes=sizes, max_tokens=max_tokens, prompts_file=prompts_file, options=asdict(options),
                     torch=torch.__version__, date_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                     warmup=warmup, kernels=kernels, attention=_attention_names(rc, kernels, sizes),
                     prefill_graphs=rc.cuda_graphs if rc.prefill_graphs is None else rc.prefill_graphs,
                     prefill_varlen=bool(packed), prefill_varlen_batch_sizes=packed,
                     round_kernels="triton" if round_kernels_on(torch.device(rc.device)) else "plain",
                     stream=stream and mode == "distributed",
                     # "overlap": whether any engine's target could run it (set below): what ran, not what was asked
                     admission={"share": float(admission[0]), "wait_rounds": int(admission[1]), "overlap": False,
                                "intake_ms": 1e3 * float(admission[3])},
                     sampling=dict(sampling or {}))
    report = BenchReport(meta, [], ctx.cost.table if (cost_table and ctx.cost is not None) else None)
    if 1 not in sizes and any(c.is_reference for c in configs):
        say("the HF references run at batch 1 only; skipped (no batch size 1)")
    runs = sum(1 for b in sizes for c in configs if not c.is_reference or b == 1)
    with tqdm(total=runs, desc="bench", unit="run", file=sys.stderr, disable=None if progress else True) as bar:
        for b in sizes:
            prompts = bench_prompts(records, b, limit)
            engine = Engine(checkpoint, replace(config, max_batch_size=b, fixed_step_tokens=fixed), tokenizer=tokenizer)
            ctx.engine = engine
            if admission[2]:  # (a distributed run's replica gets this runner's settings, hence the same answer)
                if engine.target.overlaps_admission:
                    meta.admission["overlap"] = True
                else:
                    say(f"batch {b}: --admission-overlap has no effect here (it needs CUDA graphs and the varlen "
                        "prefill): every prefill runs in line")
            base: RunResult | None = None
            base_tokens: dict[str, list[int]] = {}
            # distributed: the prompts tokenized once, before any timer, as in process (``_engine_pass``)
            ids = {r.prompt_id: engine.encode_prompt(r.text) for r in prompts} if mode == "distributed" else None
            for c in configs:
                if c.is_reference and b != 1:
                    continue
                bar.set_postfix_str(f"{c.name} b={b}")
                if c.is_reference:
                    res = _reference_run(c, engine, prompts[:hf_limit], max_tokens, options, base, base_tokens)
                elif mode == "distributed":
                    dist = run_distributed(c, c.speculation(ctx), options, str(checkpoint.path), engine.runner_config,
                                           prompts, b, params, f"{c.name} b={b}", progress, warmup, stream, ids,
                                           admission)
                    comps = dist.completions
                    res = _engine_result(c, options, b, prompts, comps, dist.wall_s, math.nan, base, base_tokens,
                                         params.greedy)
                    rep = dist.replica  # the timed pass as the replica's engine ran it
                    res = replace(res, router_draft_width=dist.router_draft_width, warmup_passes=dist.warmup_passes,
                                  timed_captures=rep.graphs_captured, replica_steps=rep.engine_steps,
                                  replica_step_s=rep.engine_step_s, replica_deliver_s=rep.engine_deliver_s,
                                  timed_rounds=rep.engine_rounds,
                                  timed_rows_per_round=rep.engine_round_rows / rep.engine_rounds if rep.engine_rounds
                                  else math.nan, prefills=rep.engine_prefills,
                                  prefill_host_ms=1e3 * rep.engine_prefill_s / rep.engine_prefills
                                  if rep.engine_prefills else math.nan,
                                  process_cpu_s=dist.process_cpu_s)  # peak memory: nan (other processes' memory)
                    if c.name == "target":
                        base = res
                        base_tokens = {r.prompt_id: comp.token_ids for r, comp in zip(prompts, comps)}
                else:
                    spec = c.speculation(ctx)  # on this batch size's target (SpecFormer: a tapping one of its own)
                    run_on = build_engine(spec, share=engine, weights=ctx.weights(spec), cost=ctx.cost)
                    run_on.admission = AdmissionPolicy(*admission)
                    comps, wall, peak, cost, admitted = _engine_pass(run_on, prompts, b, params, f"{c.name} b={b}",
                                                                     progress, warmup)
                    res = replace(_engine_result(c, options, b, prompts, comps, wall, peak, base, base_tokens,
                                                 params.greedy),
                                  **asdict(cost), **admitted, chained=run_on.chains_rounds)
                    run_on = None
                    _free_memory()
                    if c.name == "target":
                        base = res
                        base_tokens = {r.prompt_id: comp.token_ids for r, comp in zip(prompts, comps)}
                report.results.append(res)
                say(_summary(res))
                if on_result is not None:
                    on_result(report)
                bar.update()
            ctx.engine = engine = None
            _free_memory()
    return report


def _engine_pass(engine: Engine, prompts: list[PromptRecord], batch_size: int, params: SamplingParams, desc: str,
                 progress: bool, warmup: str = "full") -> tuple[list[Completion], float, float, RoundCost, dict]:
    """On an engine built for one configuration (``build_engine``), run a warm-up pass
    (``warmup_share``: graphs captured, compiles done, the online threshold θ with rounds behind it), then
    the timed pass, then the round-cost pass (``measure_round_cost``) with ``batch_size``
    requests. Returns (completions, wall s, peak GiB, round cost, the timed pass's own figures:
    ``RunResult``'s prefill and ``timed_*`` fields)."""
    # tokenized before the timer, as Spec-Bench times generation from input ids: tokenizing is not
    # decoding, and every configuration would pay it alike before its first round (256 prompts at
    # batch 128), which only dilutes the ratios between them
    ids = [engine.encode_prompt(r.text) for r in prompts]
    dev = engine.runner.device
    startup = 0
    if warmup == "server" and engine.chains_rounds:  # (without CUDA graphs its rounds run eagerly: 0 captured)
        startup = capture_round_shapes(engine)
    warm = warmup_share(ids, batch_size, warmup)
    warmup_passes = 0
    for label, run in warmup_passes_then_timed(warm, ids):
        if label == "warm-up":
            warmup_passes += 1
        with tqdm(total=len(run), desc=f"{desc} {label}", unit="prompt", leave=False, file=sys.stderr,
                  disable=None if progress else True) as bar:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            n0, s0 = engine.admission.prefills, engine.admission.prefill_total_s
            r0, rows0, made0 = engine.num_rounds, engine.round_rows, CapturedCall.made
            labels0 = len(CapturedCall.labels)
            timeline = (StepTimeline() if label == "timed" and dev.type == "cuda" and engine.runner.config.cuda_graphs
                        else None)
            t0 = time.perf_counter()
            with timeline if timeline is not None else contextlib.nullcontext():
                comps = engine.generate(prompt_ids=run, params=params, on_finish=lambda _: bar.update())
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else math.nan  # GPU memory only
    n, s = engine.admission.prefills - n0, engine.admission.prefill_total_s - s0
    rounds = engine.num_rounds - r0
    span_ms, idle_ms, _ = timeline.summary() if timeline is not None else (math.nan,) * 3
    idle_p50 = timeline.idle_median_ms() if timeline is not None else math.nan
    admission_gpu = timeline.admission_ms() / n if timeline is not None and n else math.nan
    side = timeline.side_admissions if timeline is not None else []
    admission_side = timeline.admission_ms(side=True) / len(side) if side else math.nan
    admitted = dict(prefills=n, prefill_host_ms=1e3 * s / n if n else math.nan, timed_rounds=rounds,
                    timed_rows_per_round=(engine.round_rows - rows0) / rounds if rounds else math.nan,
                    timed_gpu_span_ms=span_ms, timed_gpu_idle_ms=idle_ms, timed_gpu_idle_p50_ms=idle_p50,
                    timed_admission_gpu_ms=admission_gpu, timed_admission_side_gpu_ms=admission_side,
                    timed_captures=CapturedCall.made - made0, timed_capture_labels=CapturedCall.labels[labels0:],
                    warmup_passes=warmup_passes, startup_captures=startup)
    cost = measure_round_cost(engine, ids[:batch_size], params, label=desc.replace(' b=', '-b'))
    return comps, wall, peak, cost, admitted


def _pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``; NaN when empty."""
    return float(np.percentile(values, q)) if values else float("nan")


def _lossless(prompts: list[PromptRecord], outputs: list[list[int]],
              base_tokens: dict[str, list[int]]) -> tuple[float, list[str]]:
    bad = [r.prompt_id for r, toks in zip(prompts, outputs) if base_tokens.get(r.prompt_id) != toks]
    return (1.0 - len(bad) / len(prompts) if prompts else float("nan")), bad


def _engine_result(c: BenchConfig, options: BenchOptions, b: int, prompts: list[PromptRecord],
                   comps: list[Completion], wall: float, peak: float, base: RunResult | None,
                   base_tokens: dict[str, list[int]], greedy: bool = True) -> RunResult:
    total = SpecDecodeStats()
    by_task: dict[str, tuple[int, SpecDecodeStats]] = {}
    decode: dict[str, list[float]] = {}  # task -> [seconds from first to last token, tokens after the first]
    for rec, comp in zip(prompts, comps):
        total.merge(comp.spec)
        task = spec_bench_task(rec.category)
        n, st = by_task.setdefault(task, (0, SpecDecodeStats()))
        st.merge(comp.spec)
        by_task[task] = (n + 1, st)
        after_first = max(comp.completion_tokens - 1, 0)
        d = decode.setdefault(task, [0.0, 0])
        d[0] += comp.tpot_s * after_first
        d[1] += after_first
    tokens = sum(x.completion_tokens for x in comps)
    tps = tokens / wall
    speedup = 1.0 if base is None else tps / base.tps  # (base None: this is the target run)
    if not greedy:  # sampled: the same distribution as target-only, not the same draws
        share, bad = math.nan, []
    elif base is None:
        share, bad = 1.0, []
    else:
        share, bad = _lossless(prompts, [x.token_ids for x in comps], base_tokens)
    tpots = [x.tpot_s * 1e3 for x in comps if x.completion_tokens > 1]
    ttfts = [x.ttft_s * 1e3 for x in comps]
    base_tpot = {t.task: t.tpot_ms for t in base.per_task} if base is not None else {}
    per_task = []
    for t, (n, st) in sorted(by_task.items()):
        secs, toks = decode[t]
        tpot = 1e3 * secs / toks if toks and secs > 0 else math.nan
        if math.isnan(tpot):
            ratio = math.nan
        else:
            ratio = 1.0 if base is None else base_tpot.get(t, math.nan) / tpot
        per_task.append(TaskStats(t, n, st.num_drafted, st.num_accepted, st.acceptance_rate,
                                  st.mean_accepted_length, tpot, ratio))
    return RunResult(c.name, b, c.draft_tokens(options), len(prompts), tokens, wall, tps, speedup,
                     total.acceptance_rate, total.mean_accepted_length, total.num_drafted,
                     total.num_accepted, _pct(ttfts, 50), _pct(ttfts, 99), _pct(tpots, 50), _pct(tpots, 99), peak,
                     share, bad, per_task)


def _reference_run(c: BenchConfig, engine: Engine, prompts: list[PromptRecord], max_tokens: int,
                   options: BenchOptions, base: RunResult, base_tokens: dict[str, list[int]]) -> RunResult:
    """HF generate on the same checkpoint, device and dtype (batch 1; acceptance is not exposed)."""
    res, outs = bench_hf_generate(engine, prompts, 1, max_tokens, prompt_lookup=c.hf_prompt_lookup(options))
    share, bad = _lossless(prompts, outs, base_tokens)
    nan = float("nan")
    return RunResult(c.name, 1, c.draft_tokens(options), len(prompts), res.output_tokens, res.wall_s, res.tps,
                     res.tps / base.tps, acceptance_rate=nan, mean_accepted_length=nan, drafted=0, accepted=0,
                     ttft_p50_ms=nan, ttft_p99_ms=nan, tpot_p50_ms=nan, tpot_p99_ms=nan,
                     peak_mem_gib=res.peak_mem_gib, lossless_share=share, mismatched_prompt_ids=bad)


def _first_labels(labels: list[str], most: int = 6) -> str:
    """The first ``most`` graph labels, then how many more (results.json keeps them all)."""
    more = len(labels) - most
    return ", ".join(labels[:most]) + (f" and {more} more" if more > 0 else "")


def _summary(r: RunResult) -> str:
    acc = "" if math.isnan(r.acceptance_rate) else f", acceptance {r.acceptance_rate:.2f}, τ_acc {r.mean_accepted_length:.2f}"
    rounds = "" if math.isnan(r.round_wall_ms) else (
        f"; round {r.round_wall_ms:.2f} ms wall"
        + ("" if math.isnan(r.round_gpu_ms) else f" / {r.round_gpu_ms:.2f} ms GPU")
        + ("" if math.isnan(r.round_host_ms) else f" / {r.round_host_ms:.2f} ms host")
        + ("" if math.isnan(r.step_gpu_span_ms) else f"; step graph {r.step_gpu_span_ms:.2f} ms GPU span, "
           f"{r.step_gpu_idle_ms:.3f} ms GPU idle after, {r.step_launch_ms:.3f} ms launch, "
           f"{r.gpu_ops_per_round:.0f} GPU ops a round") + ", "
        f"{r.graph_launches_per_round:.1f} launches, {r.host_syncs_per_round:.1f} syncs")
    timed = "" if not r.timed_rounds else (
        f"; timed pass {r.timed_rounds} rounds of {r.timed_rows_per_round:.1f} rows"
        + ("" if math.isnan(r.timed_gpu_span_ms) else
           f" ({r.timed_gpu_span_ms:.2f} ms GPU span, {r.timed_gpu_idle_ms:.3f} ms GPU idle after, "
           f"median {r.timed_gpu_idle_p50_ms:.3f})")
        + f", {r.prefills} prefills of {r.prefill_host_ms:.1f} ms host"
        + ("" if math.isnan(r.timed_admission_gpu_ms) else f" / {r.timed_admission_gpu_ms:.1f} ms GPU")
        + ("" if math.isnan(r.timed_admission_side_gpu_ms) else
           f" + {r.timed_admission_side_gpu_ms:.1f} ms GPU beside the rounds")
        + (f", {r.timed_captures} graphs captured" if r.timed_captures else "")
        + (f" ({_first_labels(r.timed_capture_labels)})" if r.timed_capture_labels else "")
        + (f", after {r.warmup_passes} warm-up passes" if r.warmup_passes > 1 else "")
        + (f", {r.startup_captures} round graphs captured before them" if r.startup_captures else "")
        + (f"; round cost run twice ({r.round_cost_captures} graphs captured)" if r.round_cost_captures else ""))
    if math.isnan(r.round_wall_ms):  # a distributed run (no in-process round cost): the replica's Load reports
        timed = ((f"; {r.timed_captures} graphs captured in the timed pass" if r.timed_captures else "")
                 + (f", after {r.warmup_passes} warm-up passes" if r.warmup_passes > 1 else "")
                 + (f"; replica {r.replica_steps} steps, {r.replica_step_s:.2f} s in them, "
                    f"{r.replica_deliver_s:.2f} s handing out events" if r.replica_steps else "")
                 + (f", {r.timed_rounds} rounds of {r.timed_rows_per_round:.1f} rows, {r.prefills} prefills of "
                    f"{r.prefill_host_ms:.1f} ms host" if r.replica_steps and r.timed_rounds else "")
                 + ("; CPU s " + ", ".join(f"{n} {v:.2f}" for n, v in r.process_cpu_s.items())
                    if r.process_cpu_s else ""))
    return (f"{r.config} b={r.batch_size}: {r.tps:.1f} tok/s, speedup {r.speedup:.2f}x{acc}, "
            f"lossless {r.lossless_text}{rounds}{timed}")


def _free_memory() -> None:
    """Give a finished configuration's device memory back before the next one is built (its
    engine's reference cycles collected, the allocator's cache emptied). Host memory needs no
    help: a full collection costs ~0.2 s in a large process, per configuration and batch size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
