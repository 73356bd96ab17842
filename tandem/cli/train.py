"""Training commands: ``tandem collect-logs`` (verification logs for the acceptance predictor),
``tandem train predictor | specformer | draft-model`` and ``tandem distill-data`` (the
self-distillation data drafters train on). The training itself lives in ``tandem.train``."""

from __future__ import annotations

import signal
import sys
import time
import zipfile
import zlib
from dataclasses import asdict
from pathlib import Path

import click
from tqdm import tqdm

from ..data import load_prompts
from ..errors import InvalidRequestError
from ..speculation import TARGET_ONLY, build_engine
from ..state import StateStoreUnavailable, open_store
from .common import (_engine, _run_file, command_line, console, device_option, dtype_option, err_console, fail, finite,
                     log, model_option, speculative_config, torch_dtype, with_drafter_options)


@click.command("collect-logs")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), required=True,
              help="JSONL prompts (e.g. data/train_prompts.jsonl.gz; never a benchmark set).")
@click.option("--limit", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Output .npz (features, labels).")
@model_option
@device_option
@with_drafter_options
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--states", "record_states", is_flag=True,
              help="Also record the drafter's hidden state at each drafted position (SpecFormer only: the "
                   "head's normed draft-slot states, float16) for a predictor that reads them "
                   "(tandem train predictor --state-projection).")
def collect_logs(prompts_file, limit, out, model, device, drafter, draft_model, num_draft_tokens, predictor, acceptance_threshold,
                 branch_top_m, max_tokens, batch_size, max_seq_len, record_states) -> None:
    """Run speculative decoding and record, per drafted position, the predictor features and the
    label (accepted 1, first rejected 0; later positions unlabelled)."""
    import numpy as np  # and the torch-backed modules:

    from ..predictor import FEATURE_NAMES
    from ..sampling import SamplingParams

    if drafter == "none":
        fail("collect-logs needs a --drafter")
    if record_states and drafter != "specformer":
        fail(f"--states records the SpecFormer head's states; the {drafter} drafter has none to record")
    spec = speculative_config(drafter, draft_model, num_draft_tokens, predictor, acceptance_threshold, branch_top_m)
    records = []
    store = open_store()  # TANDEM_REDIS_URL set: the logs also go to the capped Redis stream

    def sink(record) -> None:
        records.append(record)
        x, y = record.labelled()
        try:
            store.append_log(f"vlog:{record.drafter}", {"features": x.tolist(), "labels": y.tolist()})
        except StateStoreUnavailable as exc:
            log.warning("verification log not streamed: %s", exc)

    try:
        prompts = load_prompts(prompts_file, limit)
        if not prompts:
            fail(f"the prompts file {prompts_file} has no prompts")
        engine = _engine(model, device, batch_size, max_seq_len, spec, verification_sink=sink)
    except InvalidRequestError as exc:
        fail(str(exc))
        return
    if record_states:
        engine.drafter.record_states = True
    fits = [r for r in prompts if len(engine.encode_prompt(r.text)) < engine.max_seq_len]
    if len(fits) < len(prompts):  # a data job over a training set: skip what cannot fit, say so, go on
        log.warning("skipped %d of %d prompts longer than the context limit (%d tokens; raise --max-seq-len)",
                    len(prompts) - len(fits), len(prompts), engine.max_seq_len)
    if not fits:
        fail("no prompt fits the context limit; raise --max-seq-len")
    results, wall = _run_file(engine, fits, SamplingParams(max_tokens=max_tokens), True, desc="collecting")
    if not records:
        fail("no drafts were verified; nothing to log")
    feats, labels = zip(*(r.labelled() for r in records))
    x, y = np.concatenate(feats), np.concatenate(labels)
    extra = {"states": np.concatenate([r.labelled_states() for r in records])} if record_states else {}
    np.savez_compressed(out, features=x, labels=y, feature_names=np.array(FEATURE_NAMES), drafter=engine.drafter.name,
                        **extra)
    console.print(f"{len(y)} labelled positions ({y.mean():.3f} accepted) from {len(results)} prompts in "
                  f"{wall:.1f} s -> {out}", highlight=False)


@click.group()
def train() -> None:
    """Train drafters and the difficulty predictor."""


# held-out positions under which train predictor says its AUC / ECE are rough (the AUC's standard
# error at AUC ~0.85 is ~0.02 with 500 positions, Hanley & McNeil 1982)
MIN_TRUSTED_HELD_OUT = 500


@train.command("predictor")
@click.option("--logs", "logs_file", type=click.Path(dir_okay=False, exists=True), required=True,
              help=".npz written by tandem collect-logs.")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Predictor .safetensors path.")
@click.option("--hidden", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=40, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--state-projection", type=click.IntRange(min=1), default=None,
              help="Also read the drafter's states in the logs (collect-logs --states) through a learned "
                   "projection this wide; the report gives the features-only AUC beside it. Serving does "
                   "not supply states yet: such a predictor is for study, refused by --predictor.")
def train_predictor_cmd(logs_file, out, hidden, epochs, seed, state_projection) -> None:
    """Fit the acceptance predictor; writes the model, a JSON report and a reliability diagram."""
    import numpy as np  # and the torch-backed modules:
    import torch

    from ..predictor import reliability_diagram, train_predictor, validation_split

    if not zipfile.is_zipfile(logs_file):
        fail(f"{logs_file} is not a collect-logs file (not an .npz archive)")
    try:
        data = np.load(logs_file, allow_pickle=False)
        x, y = data["features"], data["labels"]
        states = data["states"] if state_projection and "states" in data.files else None
        drafter = str(data["drafter"]) if "drafter" in data.files else None  # saved with the predictor
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:  # damaged or cut short
        fail(f"{logs_file} is not a collect-logs file: {exc}")
        return
    if state_projection and states is None:
        fail(f"{logs_file} has no drafter states; collect them with tandem collect-logs --states")
    try:
        model, report = train_predictor(x, y, hidden=hidden, epochs=epochs, seed=seed, states=states,
                                        state_proj=state_projection or 8)
    except ValueError as exc:
        fail(str(exc))
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    model.drafter = drafter
    model.save(out, report)
    png = str(Path(out).with_suffix(".reliability.png"))
    val, _ = validation_split(len(y), seed=seed)  # the held-out rows the report was computed on
    s_val = None if states is None else torch.from_numpy(states[val].astype(np.float32))
    reliability_diagram(model.predict(torch.from_numpy(x[val]), s_val).numpy(), y[val], png)
    with_states = "" if states is None else f"features only {report.features_only_auc:.3f}, "
    console.print(f"AUC {report.auc:.3f} ({with_states}entropy-only {report.entropy_auc:.3f}, position alone "
                  f"{report.position_auc:.3f}), ECE {report.ece:.3f}, "
                  f"{report.cost_us_per_token:.2f} µs/token; wrote {out}, {out}.json, {png}", highlight=False)
    if report.n_val < MIN_TRUSTED_HELD_OUT:
        err_console.print(f"note: {report.n_val} held-out positions: AUC and ECE this few are rough (collect logs "
                          f"over more prompts for {MIN_TRUSTED_HELD_OUT} or more)", highlight=False, soft_wrap=True)


@click.command("distill-data")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), required=True,
              help="JSONL training prompts (data/train_prompts.jsonl.gz); benchmark prompts are dropped.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/distill", show_default=True,
              help="Output directory (shards + manifest.json); an existing one is resumed.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="First N prompts of the file.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True, help="Answer length limit.")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Longer prompts (after the chat template) are skipped.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Running requests at most (default: 256 on GPU, 8 on CPU).")
@model_option
@device_option
@dtype_option
def distill_data(prompts_file, out, limit, max_tokens, max_prompt_tokens, batch_size, model, device, dtype) -> None:
    """Self-distillation data: the target answers every prompt greedily (chat template) and the
    token ids are written with a manifest (prompt ids, lengths, target model hash)."""
    import torch  # and the torch-backed modules:

    from ..models.runner import default_runner_config
    from ..models.weights import load_checkpoint
    from ..train.distill import distill

    def _stop(signum, frame):  # SIGTERM (e.g. `timeout`): flush what is finished, then exit
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    records = load_prompts(prompts_file, limit)
    if not records:
        fail(f"the prompts file {prompts_file} has no prompts")
    on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    cfg = default_runner_config(device, max_batch_size=batch_size or (256 if on_gpu else 8),
                                max_seq_len=max_prompt_tokens + max_tokens + 1,
                                dtype=torch_dtype(dtype))
    engine = build_engine(TARGET_ONLY, load_checkpoint(model), cfg)
    t0 = time.perf_counter()
    with tqdm(total=len(records), desc="distilling", unit="prompt", file=sys.stderr) as bar:
        manifest = distill(engine, records, out, max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens,
                           settings={"command": command_line(), "dtype": str(cfg.dtype), "device": cfg.device,
                                     "prompts_file": str(prompts_file)},
                           on_record=lambda n: bar.update())
    wall = time.perf_counter() - t0
    answers = sum(r.answer_len for r in manifest.records)
    console.print(f"{len(manifest.records)} answers, {answers} answer tokens ({manifest.num_tokens} with prompts) "
                  f"in {len(manifest.shards)} shards; skipped {manifest.skipped}; {wall:.0f} s this run -> {out}",
                  highlight=False)


train_options = [
    click.option("--data", "data_dir", type=click.Path(file_okay=False), default="runs/distill", show_default=True,
                 help="Directory written by tandem distill-data."),
    click.option("--out", type=click.Path(file_okay=False), required=True, help="Output directory (weights + model card)."),
    click.option("--epochs", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
                 callback=finite),
    click.option("--max-steps", type=click.IntRange(min=1), default=None,
                 help="Stop after N optimiser steps (default: the steps of --epochs). N sets the learning-rate "
                      "schedule; a run in --out resumes only with the same N and the same other options "
                      "(--no-resume starts over)."),
    click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None, callback=finite,
                 help="Peak learning rate (default: 1e-3 for specformer, 3e-4 for draft-model)."),
    click.option("--batch-tokens", type=click.IntRange(min=64), default=8192, show_default=True,
                 help="Padded tokens per batch."),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--max-answer-tokens", type=click.IntRange(min=1), default=None,
                 help="Train on the first N tokens of each answer only (default: all); long answers of a small "
                      "target often end in repetition loops."),
    click.option("--no-resume", is_flag=True, help="Ignore a checkpoint.pt in --out and start over."),
    click.option("--val-fraction", type=click.FloatRange(min=0, max=0.5), default=0.02, show_default=True,
                 help="Share of the distilled answers held out (at most 256 answers); the weights of the step with the "
                      "lowest held-out loss are kept."),
    click.option("--eval-limit", type=click.IntRange(min=0), default=0, show_default=True,
                 help="After training, measure acceptance on the first N Spec-Bench prompts (round robin over "
                      "categories, greedy, --eval-max-tokens) and put it in the model card."),
    click.option("--eval-max-tokens", type=click.IntRange(min=1), default=256, show_default=True),
    click.option("--eval-batch-size", type=click.IntRange(min=1), default=None,
                 help="Running requests during the evaluation (default 64 on GPU, 8 on CPU)."),
    model_option,
    device_option,
]


def with_train_options(fn):
    """Add ``train_options`` (data, output, schedule, evaluation) to a training command."""
    for opt in reversed(train_options):
        fn = opt(fn)
    return fn


def _finish_training(kind, out, result, t, train_cfg, extra, model, device, eval_limit, eval_max_tokens,
                     eval_batch_size, num_draft_tokens) -> None:
    """Evaluate (``--eval-limit``) and write the model card beside the weights (``tandem.train.run``)."""
    from ..train.run import evaluate_drafter, write_card

    evaluation = None
    if eval_limit:
        evaluation = evaluate_drafter(kind, out, num_draft_tokens, model, device, eval_limit, eval_max_tokens,
                                      eval_batch_size)
    console.print(write_card(kind, out, result, t.manifest, train_cfg, extra, command_line(), evaluation),
                  highlight=False)


@train.command("specformer")
@with_train_options
@click.option("--num-draft-tokens", "num_draft", type=click.IntRange(min=1, max=16), default=4, show_default=True,
              help="Draft slots per position (l_d).")
@click.option("--causal", is_flag=True, help="Causal mask across the draft slots (ablation of the bidirectional default).")
@click.option("--taps", default=None, help="Target depths read, comma separated (default 0,L/2,L-1,L).")
@click.option("--bonus-token/--no-bonus-token", default=False,
              help="Also condition the draft slots on the bonus token's embedding (an extension beyond the paper; "
                   "default off).")
@click.option("--context-next-token", is_flag=True,
              help="Add each position's next token embedding to the context stream (EAGLE-style; beyond the paper).")
@click.option("--context-layers", type=click.IntRange(min=1, max=8), default=None,
              help="Context causal attention sub-layers (default 1, as in the paper).")
@click.option("--context-init-layers", default=None,
              help="Make the context sub-layers whole decoder blocks copied from these target blocks, comma "
                   "separated, at most 8 (e.g. 0,29; sets the context layer count and --context-mlp); meant "
                   "with --context-next-token, whose stream then starts as the draft model's; beyond the paper.")
@click.option("--context-mlp", is_flag=True, help="A SwiGLU MLP after each context attention sub-layer.")
@click.option("--lookup-tokens", is_flag=True,
              help="Also feed draft slot j the j-th token of the context lookup continuation (what followed the "
                   "latest earlier occurrence of the last 1-4 tokens, as prompt lookup would draft it; nothing where "
                   "no suffix recurs) and every slot the match length, so the head learns when to copy from the "
                   "context; beyond the paper.")
@click.option("--intermediate-size", type=click.IntRange(min=1), default=None,
              help="SwiGLU width of the head (default 2 x the target's hidden size).")
@click.option("--soft-labels", "soft_weight", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="Weight W of the soft-label term: loss = (1 - W) x cross-entropy against the distilled token "
                   "+ W x cross-entropy against the target's own distribution (0 = hard labels only, the paper's "
                   "loss).")
@click.option("--init-from", type=click.Path(), default=None,
              help="Start from this trained head (a directory with model.safetensors) instead of a fresh one: "
                   "fine-tuning, e.g. on more distilled data with a lower --lr. The other head options must "
                   "describe the same head, except a larger --num-draft-tokens (a head grown from l_d = 4 to 6 or "
                   "8: its new slots start as copies of its last); the copy of --context-init-layers from the "
                   "target is skipped.")
def train_specformer_cmd(data_dir, out, epochs, max_steps, lr, batch_tokens, seed, max_answer_tokens, no_resume,
                         val_fraction, eval_limit, eval_max_tokens, eval_batch_size, model, device, num_draft, causal,
                         taps, bonus_token, context_next_token, context_layers, context_init_layers, context_mlp,
                         lookup_tokens, intermediate_size, soft_weight, init_from) -> None:
    """Train a SpecFormer head on self-distilled data (the target frozen)."""
    from ..drafters.base import weights_file  # torch-backed
    from ..drafters.specformer import load_specformer, save_specformer
    from ..train.distill import model_fingerprint
    from ..train.loop import TrainConfig, train as run_training
    from ..train.run import load_train_target
    from ..train.specformer import SpecFormerObjective, init_context_from_target, load_start, new_head

    try:
        tap_list = tuple(int(t) for t in taps.split(",")) if taps is not None else None
    except ValueError:
        fail(f"--taps must be comma-separated integers, got {taps!r}")
        return
    try:
        init_list = tuple(int(t) for t in context_init_layers.split(",")) if context_init_layers is not None else ()
    except ValueError:
        init_list = None
    if init_list is None or (context_init_layers is not None and not init_list):
        fail(f"--context-init-layers must be comma-separated target block indices, got {context_init_layers!r}")
        return
    if len(init_list) > 8:
        fail(f"--context-init-layers names {len(init_list)} blocks; at most 8 (as --context-layers)")
        return
    if init_from is not None and not init_from.strip():
        fail("--init-from is empty; give a trained head's directory (with model.safetensors)")
        return
    start = load_specformer(init_from) if init_from is not None else None  # before the target: fail early
    t = load_train_target(model, device, data_dir)
    try:
        head = new_head(t.checkpoint.config, num_draft, tap_list, causal, seed, bonus_token,
                        context_next_token=context_next_token, context_layers=context_layers,
                        context_mlp=context_mlp, intermediate_size=intermediate_size, context_init=init_list,
                        lookup_tokens=lookup_tokens)
        if start is not None:  # the same head, or the same with more draft slots (load_start)
            load_start(head, start)
        elif init_list:
            init_context_from_target(head, t.model)
        head = head.to(t.runner_config.device)
    except ValueError as exc:
        fail(str(exc))
        return
    tcfg = TrainConfig(epochs=epochs, max_steps=max_steps, lr=lr or 1e-3, max_batch_tokens=batch_tokens, seed=seed,
                       val_fraction=val_fraction, max_answer_tokens=max_answer_tokens)
    try:
        run = dict({f"head.{k}": v for k, v in asdict(head.config).items()}, soft_label_weight=soft_weight)
        started = {}
        if init_from is not None:  # a resume must start from the same weights
            started = {"init_from": str(init_from), "init_from_sha256": model_fingerprint(weights_file(init_from))}
            run["init_from_sha256"] = started["init_from_sha256"]
        result = run_training(head, SpecFormerObjective(head, t.model, t.amp, soft_weight), t.sequences, tcfg, out,
                              resume=not no_resume, settings=run)
    except ValueError as exc:
        fail(str(exc))
        return
    save_specformer(head, out, extra={"train": result.to_dict(), "soft_label_weight": soft_weight})
    _finish_training("specformer", out, result, t, dict(asdict(tcfg), soft_label_weight=soft_weight, **started),
                     asdict(head.config), model, device, eval_limit, eval_max_tokens, eval_batch_size, num_draft)


@train.command("draft-model")
@with_train_options
@click.option("--init-layers", default="0,1", show_default=True,
              help="Target blocks the draft model's blocks start from (comma separated; the count sets its depth).")
@click.option("--num-draft-tokens", type=click.IntRange(min=1, max=16), default=4, show_default=True,
              help="k used by the optional evaluation.")
def train_draft_model_cmd(data_dir, out, epochs, max_steps, lr, batch_tokens, seed, max_answer_tokens, no_resume,
                          val_fraction, eval_limit, eval_max_tokens, eval_batch_size, model, device, init_layers,
                          num_draft_tokens) -> None:
    """Distil a small draft LM (target tokenizer, embeddings and LM head shared) from the target."""
    import torch  # and the torch-backed modules:

    from ..drafters.draft_model import save_draft_model
    from ..train.draft_model import DraftModelObjective, init_draft_model
    from ..train.loop import TrainConfig, train as run_training
    from ..train.run import load_train_target

    try:
        layers = tuple(int(t) for t in init_layers.split(","))
    except ValueError:
        fail(f"--init-layers must be comma-separated integers, got {init_layers!r}")
        return
    t = load_train_target(model, device, data_dir)
    torch.manual_seed(seed)
    draft = init_draft_model(t.checkpoint, layers, t.model.max_positions).to(t.runner_config.device)
    tcfg = TrainConfig(epochs=epochs, max_steps=max_steps, lr=lr or 3e-4, max_batch_tokens=batch_tokens, seed=seed,
                       val_fraction=val_fraction, max_answer_tokens=max_answer_tokens)
    try:
        result = run_training(draft, DraftModelObjective(draft, t.model, t.amp), t.sequences, tcfg, out,
                              resume=not no_resume, settings={"init_layers": layers})
    except ValueError as exc:
        fail(str(exc))
        return
    save_draft_model(draft, out, layers, extra={"train": result.to_dict()})
    _finish_training("draft-model", out, result, t, asdict(tcfg), {"init_layers": list(layers)}, model,
                     device, eval_limit, eval_max_tokens, eval_batch_size, num_draft_tokens)
