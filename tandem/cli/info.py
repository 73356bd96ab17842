"""``tandem info`` (the model, device and KV cache) and ``tandem trace-report`` (per-phase
latency from trace files)."""

from __future__ import annotations

import json

import click
import torch
from rich.table import Table

from ..models.kernels import round_kernels_on
from ..trace_report import TraceFileError, build_report, read_spans, render_table
from .common import _engine, console, device_option, fail, model_option


@click.command()
@model_option
@device_option
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="KV cache slots (default per device).")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
def info(model, device, batch_size, max_seq_len) -> None:
    """Show the model, architecture, device, dtype, the kernels a round runs and the KV cache size."""
    engine = _engine(model, device, batch_size, max_seq_len)  # a ModelLoadError is one line (the group)
    cfg = engine.checkpoint.config
    rc = engine.runner_config
    n_params = sum(p.numel() for p in engine.runner.model.parameters())
    table = Table(show_header=False)
    rows = [
        ("model", str(engine.checkpoint.path)),
        ("architecture", cfg.architecture),
        ("parameters", f"{n_params / 1e6:.1f} M"),
        ("layers / hidden / intermediate", f"{cfg.num_layers} / {cfg.hidden_size} / {cfg.intermediate_size}"),
        ("heads / kv heads / head dim", f"{cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"),
        ("vocab", str(cfg.vocab_size)),
        ("rope theta / scaling", f"{cfg.rope_theta:g} / {cfg.rope_scaling.kind if cfg.rope_scaling else 'none'}"),
        ("tied embeddings", str(cfg.tie_word_embeddings)),
        ("trained context", str(cfg.max_position_embeddings)),
        ("chat template", "yes" if engine.tokenizer.has_chat_template else "no"),
        ("eos ids", ", ".join(map(str, engine.tokenizer.eos_token_ids))),
        ("device / dtype", f"{rc.device} / {str(rc.dtype).removeprefix('torch.')}"),
        ("CUDA graphs / compile", f"{rc.cuda_graphs} / {rc.compile}"),
        ("decode kernels / attention", f"{engine.runner.kernels} / {engine.runner.attention_backend}"),
        ("round kernels", "triton (prompt lookup, greedy verification)"
         if round_kernels_on(torch.device(rc.device)) else "plain PyTorch ops"),
        ("KV cache", f"{engine.cache.num_slots} slots x {engine.cache.capacity} tokens = "
                     f"{engine.runner.kv_cache_bytes() / 2**20:.1f} MiB"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)




@click.command("trace-report")
@click.argument("trace_files", metavar="FILE...", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
def trace_report_cmd(trace_files, as_json) -> None:
    """Per-phase latency of decode rounds (request, prefill, round, draft, allocate, verify, network:
    count, p50, p99, mean ms) and the share of round time on the network, from OTLP JSON trace files
    (the OpenTelemetry collector's file exporter output, or TANDEM_TRACE_FILE). Give every service's
    file of one run together: RPC client and server spans are paired across them."""
    try:
        report = build_report([s for path in trace_files for s in read_spans(path)])
    except TraceFileError as exc:
        fail(str(exc))
        return
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    console.print(render_table(report, f"{', '.join(trace_files)}: {report.num_spans} spans, "
                                       f"{report.num_traces} traces"))
    share = report.network_share
    console.print("network: " + ("no RPC or network spans inside rounds" if share is None
                                 else f"{100 * share:.1f}% of round time"), highlight=False)
