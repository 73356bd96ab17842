"""What a ``tandem bench`` run measured, as data: per (configuration, batch size) results, per
Spec-Bench task figures, the run's settings, and their results.json form (``to_dict`` /
``from_dict``, which checks a file read back), with the merge of runs split across calls.
Metric definitions: docs/architecture.md ("Metrics")."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace


@dataclass(frozen=True)
class TaskStats:
    """Acceptance on one Spec-Bench task (``tandem.data.spec_bench_task``)."""

    task: str
    prompts: int
    drafted: int
    accepted: int
    acceptance_rate: float  # α; NaN when nothing was drafted
    mean_accepted_length: float  # τ_acc, bonus token included
    # decode time per output token over the task's requests (ms; each request's time from its first
    # token to its last over its tokens after the first, summed before dividing), and target-only's
    # over this one for the same task, run and batch size (NaN in results written before them)
    tpot_ms: float = math.nan
    speedup: float = math.nan


@dataclass(frozen=True)
class RunResult:
    """One (configuration, batch size) measurement; latencies in ms, memory in GiB.

    ``speedup`` is TPS over target-only TPS at the same batch size in the same run;
    ``lossless_share`` the share of prompts whose output tokens equal target-only's (NaN for a
    sampled run: not compared), and ``mismatched_prompt_ids`` the others. Acceptance fields are NaN where unknown (HF). The
    ``round_*`` fields come from ``round_cost.measure_round_cost`` over one full batch of the
    same prompts after the timed pass (engine configurations, in-process only).
    """

    config: str
    batch_size: int
    k: int
    prompts: int
    output_tokens: int
    wall_s: float
    tps: float
    speedup: float
    acceptance_rate: float
    mean_accepted_length: float
    drafted: int
    accepted: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    peak_mem_gib: float
    lossless_share: float
    mismatched_prompt_ids: list[str]
    per_task: list[TaskStats] = field(default_factory=list)
    # per decode round (``round_cost.RoundCost``; NaN in results written before they were measured)
    rounds: int = 0
    round_wall_ms: float = math.nan
    round_gpu_ms: float = math.nan
    round_host_ms: float = math.nan  # host time a round not spent waiting for its results
    graph_launches_per_round: float = math.nan
    host_syncs_per_round: float = math.nan
    # per step graph (``tandem.profiling.StepTimeline``): GPU span (kernel gaps included), GPU idle
    # before the next step graph (the host behind), host time in the launch call
    step_gpu_span_ms: float = math.nan
    step_gpu_idle_ms: float = math.nan
    step_launch_ms: float = math.nan
    gpu_ops_per_round: float = math.nan  # kernels, memcpys and memsets a round (the profiled run)
    round_cost_captures: int = 0  # graphs the round-cost batch's first run captured (it was then run again)
    # admission during the timed pass (``tandem.admission``): prefills run and their mean host time
    prefills: int = 0
    prefill_host_ms: float = math.nan
    # the timed pass's decode rounds and their mean rows (sequences a round: the batch's occupancy);
    # wall_s less timed_rounds x (timed_gpu_span_ms + timed_gpu_idle_ms) is what the run spent
    # before its first round and after its last
    timed_rounds: int = 0
    timed_rows_per_round: float = math.nan
    # the timed pass's step graphs (``StepTimeline``): mean GPU span, mean and median GPU idle before
    # the next one (admissions' prefills included), and graphs captured during it (0 once the warm-up
    # passes stopped capturing)
    timed_gpu_span_ms: float = math.nan
    timed_gpu_idle_ms: float = math.nan
    timed_gpu_idle_p50_ms: float = math.nan
    # GPU ms an admission's window took on the rounds' stream (``StepTimeline.admission_ms`` over
    # the timed pass's admissions): its prefill and a drafter's prompt work, inside the idle time
    # above; with overlapped prefills (``AdmissionPolicy.overlap``) what is left there (the round
    # state's admission, the drafter's prompt work), the prefill's own window beside the rounds in
    # ``timed_admission_side_gpu_ms`` (NaN without any)
    timed_admission_gpu_ms: float = math.nan
    timed_admission_side_gpu_ms: float = math.nan
    timed_captures: int = 0
    # what those graphs were (``CapturedCall.labels``: "round b64 q5 ctx768", "specformer prime ...");
    # in process only (a replica reports its count)
    timed_capture_labels: list[str] = field(default_factory=list)
    warmup_passes: int = 0  # warm-up passes run before the timed pass (``warmup_passes_then_timed``)
    startup_captures: int = 0  # round graphs captured before the warm-up (``--warmup server``: every round shape)
    # rounds queued from the device round state (``Engine.chains_rounds``); None: not our in-process engine
    chained: bool | None = None
    router_draft_width: int | None = None  # distributed: the width the router's budget last set (None: none set)
    # distributed, the timed pass: the replicas' engine steps, seconds inside them and after them
    # handing events to the streams, and each process's CPU seconds (``DistributedRun``)
    replica_steps: int = 0
    replica_step_s: float = math.nan
    replica_deliver_s: float = math.nan
    process_cpu_s: dict[str, float] | None = None

    @property
    def lossless_text(self) -> str:
        """The lossless check as the tables print it: "matching/prompts", or "–" (a sampled run)."""
        if math.isnan(self.lossless_share):
            return "–"
        return f"{round(self.lossless_share * self.prompts)}/{self.prompts}"

    @property
    def round_overhead(self) -> float:
        """``round_wall_ms / round_gpu_ms``: 1.0 when a round costs exactly its GPU work."""
        return self.round_wall_ms / self.round_gpu_ms if self.round_gpu_ms > 0 else math.nan


@dataclass(frozen=True)
class BenchMeta:
    """What was run, where."""

    model: str
    device: str
    gpu: str
    dtype: str
    cuda_graphs: bool
    compile: bool
    exact_kernels: bool
    fixed_step_tokens: int
    mode: str
    configs: list[str]
    batch_sizes: list[int]
    max_tokens: int
    prompts_file: str
    options: dict
    torch: str
    date_utc: str
    warmup: str = "short"  # results written before the option existed ran the short warm-up
    kernels: str = "reference"  # decode/verify path (RunnerConfig.kernels resolved); older results ran the reference
    attention: str = "sdpa-masked"  # attention backend of decode/verify steps
    prefill_graphs: bool = False  # prefills from CUDA graphs (RunnerConfig.prefill_graphs, resolved); older results: eager
    prefill_varlen: bool = False  # fresh prompts packed end to end at some batch size (RunnerConfig.prefill_varlen)
    prefill_varlen_batch_sizes: list[int] = field(default_factory=list)  # the batch sizes that packed them (resolved
    # per engine: one slot keeps the padded buckets); older results: every batch size when prefill_varlen
    # a round's prompt lookup and greedy verification: "triton" (lookup_kernel, verify_kernel: CUDA with
    # Triton) or "plain" (PyTorch ops; the CPU, and every result before the kernels)
    round_kernels: str = "plain"
    # distributed mode: the clients streamed each step's tokens (True) or took each answer whole, as
    # the in-process engine's generate does (False); distributed results before the option streamed
    stream: bool = False
    # continuous batching (``tandem.admission.AdmissionPolicy``): {"share": ..., "wait_rounds": ..., "overlap": ...,
    # "intake_ms": ...} (a key absent from results written before it existed is read as its default);
    # empty in results written before ``--admission-share`` existed (they ran share 1/8, 64 rounds)
    admission: dict = field(default_factory=dict)
    # sampled decoding: {"temperature": ..., "top_p": ..., "top_k": ..., "seed": ...}; empty = greedy
    # (every result before ``--temperature`` existed)
    sampling: dict = field(default_factory=dict)

    def decoding(self) -> str:
        """"greedy", or the sampling settings ("sampled, T=0.7, top-p 0.9, seed 0")."""
        s = self.sampling
        if not s:
            return "greedy"
        return ("sampled, T=" + f"{s['temperature']:g}" + (f", top-p {s['top_p']:g}" if s.get("top_p", 1) < 1 else "")
                + (f", top-k {s['top_k']}" if s.get("top_k") else "") + f", seed {s['seed']}")


@dataclass
class BenchReport:
    """Everything one ``tandem bench`` run measured. ``cost_table[b][q]`` = T(b, q) in ms."""

    meta: BenchMeta
    results: list[RunResult]
    cost_table: dict[int, dict[int, float]] | None = None

    def get(self, config: str, batch_size: int) -> RunResult | None:
        return next((r for r in self.results if r.config == config and r.batch_size == batch_size), None)

    def to_dict(self) -> dict:
        """JSON-ready (NaN becomes null)."""
        return json_safe({"meta": asdict(self.meta), "results": [asdict(r) for r in self.results],
                           "cost_table": self.cost_table})

    @classmethod
    def from_dict(cls, data: dict) -> "BenchReport":
        """Inverse of ``to_dict`` (null becomes NaN).

        Raises:
            ValueError: not a ``tandem bench`` results.json.
        """
        def floats(kind, row: dict) -> dict:
            # null is NaN for float fields only: an optional one (the router's width, ``chained``)
            # keeps its None; results written before "kappa" was dropped: it was τ_acc again
            if not isinstance(row, dict):
                raise TypeError(f"a result row is a {type(row).__name__}")
            numbers = {f.name for f in fields(kind) if f.type in ("float", float, "int", int)}
            nan_ok = {f.name for f in fields(kind) if f.type in ("float", float)}
            for k, v in row.items():  # a hand-edited figure: named here, not a traceback when printed
                if k in numbers and v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    raise TypeError(f"{k} is {v!r}, not a number")
            return {k: float("nan") if v is None and k in nan_ok else v for k, v in row.items() if k != "kappa"}

        try:
            results = [RunResult(**{**floats(RunResult, r),
                                    "per_task": [TaskStats(**floats(TaskStats, t)) for t in r["per_task"]]})
                       for r in data["results"]]
            table = data.get("cost_table")
            meta = _checked_meta(data["meta"])
            if meta.get("admission"):  # settings recorded before a key existed ran at its default
                meta["admission"] = {"overlap": False, "intake_ms": 0.0} | meta["admission"]
            meta = BenchMeta(**{"stream": meta.get("mode") == "distributed"} | meta)
            unknown = sorted({r.config for r in results} - set(meta.configs))
            if unknown:
                raise TypeError(f"results of {', '.join(unknown)}, not among meta.configs")
            return cls(meta, results,
                       {int(b): {int(q): t for q, t in row.items()} for b, row in table.items()} if table else None)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a tandem bench results.json ({exc})") from None


_META_TYPES = {"str": str, "bool": bool, "int": int, "dict": dict, "list[str]": str, "list[int]": int}


def _checked_meta(meta) -> dict:
    """A results.json's ``meta`` object, each known field of its ``BenchMeta`` type (a hand-edited
    value is named here rather than printed into the report's header; unknown fields are left for
    ``BenchMeta`` to refuse).

    Raises:
        TypeError: not an object, or a field of the wrong type.
    """
    if not isinstance(meta, dict):
        raise TypeError(f"meta is a {type(meta).__name__}")
    for f in fields(BenchMeta):
        if f.name not in meta:
            continue
        v, want = meta[f.name], _META_TYPES[f.type]
        items = v if f.type.startswith("list[") and isinstance(v, list) else [v]
        if f.type.startswith("list[") and not isinstance(v, list) or any(
                not isinstance(x, want) or (want is int and isinstance(x, bool)) for x in items):
            raise TypeError(f"meta.{f.name} is {v!r}, not a {f.type}")
    return meta


def merge_reports(reports: list[BenchReport]) -> BenchReport:
    """One report from runs of the same model and settings (e.g. batch sizes split across
    calls): results concatenated (a later (configuration, batch size) replaces an earlier one),
    batch sizes, configurations and cost-table rows united.

    Raises:
        ValueError: no reports, or reports of different models / devices / dtypes / token limits /
            exact-kernel settings / modes / decode, attention or round kernels / admission or sampling
            settings (the merged header names one of each).
    """
    if not reports:
        raise ValueError("nothing to merge")
    first = reports[0].meta
    same = ("model", "device", "dtype", "max_tokens", "exact_kernels", "mode", "kernels", "attention", "round_kernels",
            "stream", "admission", "sampling")
    for r in reports[1:]:
        diff = [k for k in same if getattr(r.meta, k) != getattr(first, k)]
        if diff:
            raise ValueError(f"cannot merge runs that differ in {', '.join(diff)}")
    results: dict[tuple[str, int], RunResult] = {}
    table: dict[int, dict[int, float]] = {}
    for r in reports:
        results.update({(x.config, x.batch_size): x for x in r.results})
        table.update(r.cost_table or {})
    configs = list(dict.fromkeys(c for r in reports for c in r.meta.configs))
    sizes = sorted({b for r in reports for b in r.meta.batch_sizes})
    packed = sorted({b for r in reports for b in (r.meta.prefill_varlen_batch_sizes
                                                   or (r.meta.batch_sizes if r.meta.prefill_varlen else []))})
    return BenchReport(replace(first, configs=configs, batch_sizes=sizes, prefill_varlen=bool(packed),
                               prefill_varlen_batch_sizes=packed), list(results.values()), table or None)


def json_safe(x):
    """``x`` with NaN and infinities as None (strict JSON), dict keys as strings."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
