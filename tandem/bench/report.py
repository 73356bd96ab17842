"""Tables and plots of a ``BenchReport``: one set of rows feeds both the rich console tables
and DIR/results.md; plots are matplotlib PNGs (Agg backend)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from ..errors import ConfigError
from .configs import config
from .results import BenchReport, RunResult


@dataclass(frozen=True)
class TextTable:
    """A titled table of preformatted cells (rendered as rich or markdown)."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    caption: str = ""  # a line under the table

    def to_rich(self) -> Table:
        table = Table(title=self.title, caption=self.caption or None)
        for i, h in enumerate(self.headers):  # a narrow terminal wraps a cell, never cuts it ("1.0…")
            table.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
        for row in self.rows:
            table.add_row(*row)
        return table

    def to_markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.headers) + " |",
                 "|" + "|".join(["---"] + ["---:"] * (len(self.headers) - 1)) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.rows]
        return "\n".join(lines + ([f"\n{self.caption}"] if self.caption else [])) + "\n"


def _f(x: float, spec: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _admission_note(m) -> str:
    """The header's admission settings (none for results written before they were recorded)."""
    a = m.admission
    if not a:
        return ""
    overlap = {True: ", prefills overlapped", False: ", prefills serial"}.get(a.get("overlap"), "")
    intake = f", intake window {a['intake_ms']:g} ms" if a.get("intake_ms") else ""
    return f", admission share {a['share']:g}, wait {a['wait_rounds']} rounds{overlap}{intake}"


def main_table(report: BenchReport) -> TextTable:
    """Shaped like the papers' tables: method, batch size, k, τ_acc (the
    papers' κ), TPS, speedup, acceptance,
    lossless share; then per decode round: wall ms, GPU-busy ms, their ratio, host ms (the wall
    time not spent waiting for the round's results), the step graph's GPU span and the GPU's idle
    time after it (``tandem.profiling.StepTimeline``), graph launches and host syncs; then latency
    and memory; then the timed pass's prefills and their mean host time."""
    m = report.meta
    title = (f"Spec-Bench, {m.decoding()}, ≤{m.max_tokens} new tokens, {m.device} {m.dtype}, {m.kernels} kernels "
             f"({m.attention})" + (", exact kernels" if m.exact_kernels else ""))
    headers = ["method", "batch", "k", "τ_acc", "TPS", "speedup", "acceptance", "lossless", "round ms", "GPU ms",
               "wall/GPU", "host ms", "span ms", "idle ms", "launches", "syncs", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "peak GiB",
               "prefills", "prefill ms"]
    rows = [[r.config, str(r.batch_size), _k_cell(r), _f(r.mean_accepted_length, ".2f"), _f(r.tps, ".1f"),
             _f(r.speedup, ".2f") + "x",
             _f(r.acceptance_rate, ".3f"), r.lossless_text,
             _f(r.round_wall_ms, ".2f"), _f(r.round_gpu_ms, ".2f"), _f(r.round_overhead, ".2f"),
             _f(r.round_host_ms, ".2f"), _f(r.step_gpu_span_ms, ".2f"), _f(r.step_gpu_idle_ms, ".3f"),
             _f(r.graph_launches_per_round, ".1f"), _f(r.host_syncs_per_round, ".1f"),
             _f(r.ttft_p50_ms, ".1f"), _f(r.ttft_p99_ms, ".1f"), _f(r.tpot_p50_ms, ".2f"), _f(r.tpot_p99_ms, ".2f"),
             _f(r.peak_mem_gib, ".2f"), str(r.prefills) if r.prefills else "–", _f(r.prefill_host_ms, ".1f")]
            for r in sorted(report.results, key=lambda r: (r.batch_size, report.meta.configs.index(r.config)))]
    return TextTable(title, headers, rows, caption="TTFT counts from submission: every prompt of a batch size is "
                     "queued at once, so it includes the wait for a free slot.")


def _k_cell(r: RunResult) -> str:
    """k, and the width the router's draft budget set where it set one (``4 (router 2)``)."""
    width = getattr(r, "router_draft_width", None)
    if width is not None:
        return f"{r.k} (router {width})"
    try:
        budgeted = config(r.config).router_budget
    except ConfigError:  # a configuration this version does not know (older results)
        budgeted = False
    return f"{r.k} (router: no width set)" if budgeted else str(r.k)


def _drafting(report: BenchReport, batch_size: int) -> list[RunResult]:
    return [r for r in report.results if r.batch_size == batch_size and r.per_task and r.drafted]


def category_table(report: BenchReport, batch_size: int | None = None) -> TextTable | None:
    """Spec-Bench task x method at one batch size (default: the smallest): acceptance rate / mean
    accepted length / decode speedup (target-only's time per output token over the method's, the
    task's requests only; ``TaskStats.speedup``). None when no configuration drafted there."""
    b = min(report.meta.batch_sizes) if batch_size is None else batch_size
    runs = _drafting(report, b)
    if not runs:
        return None
    tasks = sorted({t.task for r in runs for t in r.per_task})
    rows = []
    for task in tasks:
        row = [task]
        for r in runs:
            t = next((t for t in r.per_task if t.task == task), None)
            speedup = _f(t.speedup, ".2f") + "x" if t is not None and not math.isnan(t.speedup) else "–"
            row.append("–" if t is None else f"{_f(t.acceptance_rate, '.3f')} / {_f(t.mean_accepted_length, '.2f')}"
                       f" / {speedup}")
        rows.append(row)
    return TextTable(f"Acceptance rate / mean accepted length / decode speedup per Spec-Bench task (batch {b})",
                     ["task"] + [r.config for r in runs], rows)


def cost_table(report: BenchReport) -> TextTable | None:
    """T(b, q) in ms, and T(b, q_max) / T(b, 1) (the verification overhead of k drafts)."""
    if not report.cost_table:
        return None
    qs = sorted({q for row in report.cost_table.values() for q in row})
    rows = [[str(b)] + [f"{row[q]:.3f}" for q in qs] + [f"{row[qs[-1]] / row[qs[0]]:.2f}"]
            for b, row in sorted(report.cost_table.items())]
    return TextTable("Verifier step time T(b, q) in ms (b rows, q tokens per row)",
                     ["batch"] + [f"q={q}" for q in qs] + [f"T(b,{qs[-1]})/T(b,{qs[0]})"], rows)


def tables(report: BenchReport) -> list[TextTable]:
    """The main table, the per-task table of each batch size, the cost table (those that exist)."""
    found = [main_table(report), *(category_table(report, b) for b in report.meta.batch_sizes), cost_table(report)]
    return [t for t in found if t is not None]


def plot_speedup(report: BenchReport, path: Path) -> None:
    """Speedup over target-only vs batch size, one line per method (references as points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in report.meta.configs:
        rs = sorted((r for r in report.results if r.config == name), key=lambda r: r.batch_size)
        if rs:
            ax.plot([r.batch_size for r in rs], [r.speedup for r in rs], "o-" if len(rs) > 1 else "s", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(report.meta.batch_sizes, [str(b) for b in report.meta.batch_sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over target-only")
    ax.set_title(f"Spec-Bench, {report.meta.decoding()}, {report.meta.device} {report.meta.dtype}")
    if report.results:  # (a merged report may hold no rows: an empty frame, no legend)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_categories(report: BenchReport, path: Path) -> bool:
    """Acceptance rate and mean accepted length per Spec-Bench task (grouped bars per method, at
    the smallest batch size). Returns False (no file) when no configuration drafted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    b = min(report.meta.batch_sizes)
    runs = _drafting(report, b)
    if not runs:
        return False
    tasks = sorted({t.task for r in runs for t in r.per_task})
    x = np.arange(len(tasks))
    width = 0.8 / len(runs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, field, label in ((axes[0], "acceptance_rate", "acceptance rate α"),
                             (axes[1], "mean_accepted_length", "mean accepted length τ_acc")):
        for i, r in enumerate(runs):
            by = {t.task: getattr(t, field) for t in r.per_task}
            ax.bar(x + (i - (len(runs) - 1) / 2) * width, [by.get(t, np.nan) for t in tasks], width, label=r.config)
        ax.set_xticks(x, tasks, rotation=30, ha="right")
        ax.set_ylabel(label)
    axes[0].set_ylim(0, 1)
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Per Spec-Bench task, batch {b}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_json(report: BenchReport, out: str | Path) -> Path:
    """Write DIR/results.json (NaN as null) and return its path."""
    path = Path(out) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_dict(), indent=2))
    return path


def write_report(report: BenchReport, out: str | Path) -> list[Path]:
    """Write DIR/results.json, DIR/results.md, DIR/speedup.png and DIR/acceptance_by_task.png
    (the last only when something drafted). Returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_json(report, out), out / "results.md", out / "speedup.png"]
    m = report.meta
    head = (f"# tandem bench\n\nModel `{m.model}` on {m.gpu} ({m.dtype}, CUDA graphs {m.cuda_graphs}, compile "
            f"{m.compile}, exact kernels {m.exact_kernels}, {m.kernels} decode kernels, attention {m.attention}, "
            f"prefill graphs {m.prefill_graphs}{_varlen_note(m)}, round kernels "
            f"{m.round_kernels}), mode {m.mode}"
            f"{(', streamed' if m.stream else ', answers whole') if m.mode == 'distributed' else ''}"
            f"{_admission_note(m)}, {m.date_utc}, "
            f"torch {m.torch}.\n"
            f"Prompts: `{m.prompts_file}`; configurations: {', '.join(m.configs)}. Speedup is over target-only "
            f"at the same batch size, in TPS over the whole timed pass (prefills included); the per-task "
            f"tables' decode speedup counts decoding only (time per output token after the first); "
            f"decoding {m.decoding()}; lossless = prompts whose tokens equal target-only's"
            f"{' (not compared when sampling: speculative sampling keeps the distribution, not the draws)' if m.sampling else ''}"
            f"; TTFT counts from "
            f"submission (all prompts are queued at once).\n\n")
    described = "".join(f"- `{name}`: {_description(name)}\n" for name in m.configs if _description(name))
    described += "\nOptions: " + ", ".join(f"{k}={v}" for k, v in m.options.items()) + ".\n"
    written[1].write_text(head + described + "\n" + "\n".join(t.to_markdown() for t in tables(report)))
    plot_speedup(report, written[2])
    if plot_categories(report, out / "acceptance_by_task.png"):
        written.append(out / "acceptance_by_task.png")
    return written


def _description(name: str) -> str | None:
    """A configuration's one-line description (None for a name this version does not know)."""
    try:
        return config(name).description
    except ConfigError:
        return None


def _varlen_note(m) -> str:
    """", varlen prefills" and, where some batch sizes kept the padded buckets, the ones that packed."""
    if not m.prefill_varlen:
        return ""
    sizes = m.prefill_varlen_batch_sizes
    return ", varlen prefills" + (f" at batch {', '.join(map(str, sizes))}" if sizes and sizes != m.batch_sizes else "")
