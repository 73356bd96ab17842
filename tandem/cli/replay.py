"""``tandem replay``: drafters' acceptance by exact greedy replay over the target's own greedy
outputs (``tandem.bench.replay``)."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table

from ..data import bundled_spec_bench, load_prompts, round_robin_by_category
from ..errors import InvalidRequestError
from .common import _engine, console, device_option, fail, fmt, model_option


@click.command("replay")
@click.option("--drafter", "drafters", multiple=True, required=True, metavar="KIND[:PATH]",
              help="specformer or draft-model, optionally with its weights (default: the shipped ones), or ngram; "
                   "repeatable.")
@click.option("--traces", "traces_file", type=click.Path(dir_okay=False), default=None,
              help="Greedy traces (JSONL) from an earlier --save-traces, made with the same --model; the prompt "
                   "options below then do not apply, but --limit does. Default: decode the prompts target-only now.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="Prompt JSONL (default: the bundled Spec-Bench questions).")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Round-robin N prompts (or, with --traces, N traces) over the categories.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="New tokens per prompt [default: 256].")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Target-only decode batch (default per device).")
@click.option("--save-traces", type=click.Path(dir_okay=False), default=None, help="Write the traces here (JSONL).")
@click.option("-k", "--num-draft-tokens", type=click.IntRange(min=1, max=16), default=None,
              help="Draft tokens per round (default: a head's l_d, 4 for the others; a head drafts at most l_d).")
@click.option("--branch-ceiling", "branch_m", type=click.IntRange(min=2, max=8), default=None, metavar="M",
              help="For SpecFormer heads, also what token trees over each slot's top M tokens could add to the "
                   "chain: the mean accepted length with a sibling at the chain's first miss, and with every "
                   "top-M path (tandem.bench.replay.branch_ceiling).")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON.")
@model_option
@device_option
def replay_cmd(drafters, traces_file, prompts_file, limit, max_tokens, batch_size, save_traces, num_draft_tokens,
               branch_m, out, model, device) -> None:
    """Acceptance of drafters on a prompt set by exact greedy replay: one teacher-forced pass over
    the target's own greedy outputs gives every round's accepted length (the engine's counters,
    see tandem.bench.replay), so drafter variants compare in seconds, not decode runs."""
    import torch  # and the torch-backed modules:

    from ..bench.replay import (Replayer, branch_ceiling, load_drafter, load_traces, record_traces, replay,
                                save_traces as write_traces)
    from ..bench.results import json_safe
    from ..models.config import ModelLoadError
    from ..models.runner import default_runner_config
    from ..models.weights import load_checkpoint
    from ..train.distill import model_fingerprint

    if branch_m and not any(d.partition(":")[0] == "specformer" for d in drafters):
        fail("--branch-ceiling applies to SpecFormer heads (--drafter specformer[:PATH])")
    if traces_file and (prompts_file or max_tokens or batch_size):
        fail("--traces replays saved traces: --prompts, --max-tokens and --batch-size do not apply")
    for path in (out, save_traces):
        if path and not Path(path).resolve().parent.is_dir():
            fail(f"cannot write {path}: its directory does not exist")
    specs = []
    for spec in dict.fromkeys(drafters):  # a repeated drafter is replayed once
        kind, colon, path = spec.partition(":")
        if kind not in ("specformer", "draft-model", "ngram"):
            fail(f"--drafter {spec!r}: replay supports specformer, draft-model and ngram")
        if kind == "ngram" and path:
            fail("--drafter ngram takes no weights path")
        specs.append((spec, kind, path if colon else None))  # "KIND:" (empty path) is refused by drafter_weights
    try:
        checkpoint = load_checkpoint(model)
        loaded = {}
        for spec, kind, path in specs:  # every drafter's weights load before anything is decoded
            try:
                loaded[spec] = load_drafter(kind, path, checkpoint)
            except (InvalidRequestError, ModelLoadError) as exc:
                raise InvalidRequestError(f"--drafter {spec}: {exc}") from None
        if traces_file:
            traces = load_traces(traces_file, checkpoint.config.vocab_size)
            made_by = {t.model for t in traces if t.model}
            if made_by and made_by != {model_fingerprint(checkpoint.path)}:
                raise InvalidRequestError(f"{traces_file} was decoded by another target model than --model; "
                                          "replay needs the target's own greedy outputs")
            if limit:
                traces = round_robin_by_category(traces, limit)
        else:
            records = load_prompts(prompts_file or bundled_spec_bench())
            if limit:
                records = round_robin_by_category(records, limit)
            if not records:
                raise InvalidRequestError(f"the prompts file {prompts_file or bundled_spec_bench()} has no prompts")
            engine = _engine(model, device, batch_size or (128 if torch.cuda.is_available() else 8), 2048, compile_=False)
            traces = record_traces(engine, records, max_tokens or 256)
            del engine
        if not traces:
            raise InvalidRequestError(f"{traces_file} holds no traces")
        if save_traces:
            write_traces(traces, save_traces)
        cfg = default_runner_config(device)
        replayer = Replayer(checkpoint, traces, cfg.device, cfg.dtype)
        results = {}
        for spec, kind, path in specs:
            k = num_draft_tokens or 4
            if kind == "specformer":  # a head drafts l_d tokens at most
                k = min(num_draft_tokens or 99, loaded[spec].config.num_draft_tokens)
            top = replayer.drafts(kind, loaded[spec], k, top_m=branch_m) if branch_m and kind == "specformer" else None
            drafts = [d[..., 0] for d in top] if top is not None else replayer.drafts(kind, loaded[spec], k)
            overall, per_cat = replay(traces, drafts, k)  # (a top-M pass's first column is the chain's argmax)
            results[spec] = {"kind": kind, "path": path, "k": k, "overall": overall, "per_category": per_cat}
            if top is not None:
                results[spec]["branch_ceiling"] = {"top_m": branch_m, **branch_ceiling(traces, top, k)}
    except (InvalidRequestError, ModelLoadError, ValueError, OSError) as exc:
        fail(str(exc))
        return
    table = Table(title=f"greedy replay over {len(traces)} prompts (max {traces[0].max_tokens} new tokens)")
    table.add_column("category")
    for spec in results:
        table.add_column(f"{spec}\nacceptance / mean accepted length", justify="right")
    cats = sorted({c for r in results.values() for c in r["per_category"]})
    for cat in cats + ["overall"]:
        cells = []
        for r in results.values():
            st = r["overall"] if cat == "overall" else r["per_category"][cat]
            cells.append(f"{fmt(st['acceptance_rate'], '.3f')} / {st['mean_accepted_length']:.2f}")
        table.add_row(cat or "(none)", *cells)
    console.print(table)
    ceilings = {spec: r["branch_ceiling"] for spec, r in results.items() if "branch_ceiling" in r}
    if ceilings:
        table = Table(title="mean accepted length: the chain against token trees over each slot's top M tokens")
        for name in ("drafter", "chain", "sibling at the first miss", "every top-M path"):
            table.add_column(name, justify="left" if name == "drafter" else "right")
        for spec, c in ceilings.items():
            chain = c["chain"]["mean_accepted_length"]
            table.add_row(f"{spec} (M = {c['top_m']})", f"{chain:.3f}", *(
                f"{c[rule]['mean_accepted_length']:.3f} ({c[rule]['mean_accepted_length'] / chain:.3f}x)"
                for rule in ("branch-at-cut", "any-top-m")))
        console.print(table)
    if out:  # strict JSON: an undefined rate (nothing drafted) is null
        Path(out).write_text(json.dumps(json_safe({"prompts": len(traces), "drafters": results}), indent=1,
                                        allow_nan=False))
