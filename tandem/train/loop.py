"""One training loop for the drafters we distil (SpecFormer head, small draft model).

AdamW with linear warm-up and cosine decay (``transformers.get_cosine_schedule_with_warmup``),
bf16 autocast on CUDA, gradient clipping, a fixed seed, tqdm progress, and resumable
checkpoints (``checkpoint.pt``: parameters, optimiser, scheduler and step; batches are a pure
function of the seed and epoch, so a resumed run sees exactly the batches it would have seen).
SIGTERM (a job scheduler's time limit, ``timeout``) ends the run after the current step with a
checkpoint, so the weights so far are saved and the same command resumes.

A seeded share of the sequences (``val_fraction``, at most ``max_val_sequences``) is held out:
the objective is evaluated on it at every checkpoint and at the end, and the module ends with the
parameters of the step with the lowest held-out loss (the distilled answers are few, so later
epochs can memorise them).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .distill import DistilledSequence, iter_batches


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings.

    Attributes:
        epochs: passes over the data (the step count follows from it unless ``max_steps`` is set).
        max_steps: stop after this many optimiser steps (None: ``epochs`` decides).
        lr: peak learning rate; warmup_frac: share of steps with linear warm-up (then cosine
            decay to 0).
        weight_decay, grad_clip: AdamW decoupled weight decay and max gradient norm.
        max_batch_tokens: padded tokens (rows x longest row) per batch.
        max_len: sequences are cut to this many tokens.
        max_answer_tokens: only the first N tokens of each answer are trained on (None: all). The
            distilled answers of a small target often end in long repetition loops past a few
            hundred tokens; a cap keeps those loops from dominating the labels.
        seed: batches, initialisation and dropout-free training are reproducible from it.
        checkpoint_every: steps between resumable checkpoints (and held-out evaluations).
        val_fraction: share of sequences held out for validation (0: none).
        max_val_sequences: cap on the held-out sequences (keeps each evaluation to seconds).
    """

    epochs: float = 2.0
    max_steps: int | None = None
    lr: float = 1e-3
    warmup_frac: float = 0.03
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_batch_tokens: int = 8192
    max_len: int = 1536
    max_answer_tokens: int | None = None
    seed: int = 0
    checkpoint_every: int = 200
    val_fraction: float = 0.02
    max_val_sequences: int = 256


@dataclass
class TrainResult:
    """What a run did, resumed runs included: steps, wall time (s, every run's training time
    summed), the mean loss of the first and last 10% of steps and extra metrics;
    ``planned_steps`` exceeds ``steps`` when SIGTERM stopped the run early; ``validation``:
    held-out sequences, the best step and its held-out loss and metrics (empty without a split)."""

    steps: int
    wall_s: float
    first_loss: float
    final_loss: float
    metrics: dict
    planned_steps: int = 0
    validation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def pad_batch(batch: list[DistilledSequence], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` ``[B, T]`` (right-padded with 0), ``lengths`` ``[B]`` and ``prompt_lens`` ``[B]``."""
    T = max(len(s.tokens) for s in batch)
    tokens = np.zeros((len(batch), T), dtype=np.int64)
    for i, s in enumerate(batch):
        tokens[i, :len(s.tokens)] = s.tokens
    lengths = torch.tensor([len(s.tokens) for s in batch], device=device)
    prompt_lens = torch.tensor([s.prompt_len for s in batch], device=device)
    return torch.from_numpy(tokens).to(device), lengths, prompt_lens


def split_validation(seqs: list[DistilledSequence], cfg: TrainConfig) -> tuple[list[DistilledSequence],
                                                                               list[DistilledSequence]]:
    """(training, held-out) sequences: a seeded random ``val_fraction`` share, at most
    ``max_val_sequences``, never all of them."""
    n_val = min(int(len(seqs) * cfg.val_fraction), cfg.max_val_sequences, len(seqs) - 1)
    if n_val <= 0:
        return seqs, []
    held = set(np.random.default_rng([cfg.seed, 7]).permutation(len(seqs))[:n_val].tolist())
    return [s for i, s in enumerate(seqs) if i not in held], [s for i, s in enumerate(seqs) if i in held]


@torch.no_grad()
def evaluate(module: torch.nn.Module, loss_fn, seqs: list[DistilledSequence], cfg: TrainConfig,
             progress: bool = False) -> dict:
    """Mean loss and metrics of ``loss_fn`` over ``seqs`` (batch-weighted), module in eval mode;
    ``progress``: a progress bar over the batches (a CPU evaluation can take minutes)."""
    from tqdm.auto import tqdm

    was_training = module.training
    module.eval()
    losses, metrics = [], {}
    batches = list(iter_batches(seqs, cfg.max_batch_tokens, np.random.default_rng(0), cfg.max_len, cfg.max_answer_tokens))
    for batch in tqdm(batches, disable=not progress, desc="held-out", unit="batch", leave=False):
        loss, m = loss_fn(batch)
        losses.append(float(loss))
        for k, v in m.items():
            metrics.setdefault(k, []).append(float(v))
    module.train(was_training)
    return {"loss": float(np.mean(losses)), "metrics": {k: float(np.mean(v)) for k, v in metrics.items()}}


# TrainConfig fields a resumed run must share with the run that wrote the checkpoint: they change
# the data, the batches or the optimisation (max_steps and epochs are checked through the planned
# step count, which sets the learning-rate schedule; checkpoint_every may change)
_RESUME_FIELDS = ("lr", "warmup_frac", "weight_decay", "grad_clip", "max_batch_tokens", "max_len",
                  "max_answer_tokens", "seed", "val_fraction", "max_val_sequences")


def _check_resume(state: dict, cfg: TrainConfig, total: int, settings: dict, ckpt: Path) -> None:
    """Raise ValueError when ``ckpt`` was written by a run with other data, loss or optimisation
    settings (checkpoints from before a field was recorded are not checked on it)."""
    old_cfg = state.get("config", {})
    new_cfg = asdict(cfg)
    diffs = [f"{k} {old_cfg[k]!r} -> {new_cfg[k]!r}" for k in _RESUME_FIELDS if k in old_cfg and old_cfg[k] != new_cfg[k]]
    if "planned_steps" in state and state["planned_steps"] != total:
        diffs.append(f"planned steps {state['planned_steps']} -> {total}")
    old_settings = state.get("settings", {})
    diffs += [f"{k} {old_settings[k]!r} -> {v!r}" for k, v in settings.items() if k in old_settings and old_settings[k] != v]
    if diffs:
        raise ValueError(f"{ckpt} was written by a run with other settings ({'; '.join(diffs)}); resume with the "
                         "same options, or start over (--no-resume, or another --out)")


def train(module: torch.nn.Module, loss_fn: Callable[[list[DistilledSequence]], tuple[torch.Tensor, dict]],
          seqs: list[DistilledSequence], cfg: TrainConfig, out_dir: str | Path, resume: bool = True,
          progress: bool = True, settings: dict | None = None) -> TrainResult:
    """Train the parameters of ``module`` that require grad on ``loss_fn`` over ``seqs``.

    Args:
        module: the trainable model (frozen parts have ``requires_grad=False``).
        loss_fn: batch -> (scalar loss, metrics to average, e.g. per-slot accuracy).
        seqs: distilled sequences.
        cfg: optimisation settings.
        out_dir: where ``checkpoint.pt`` goes (and is resumed from when ``resume``).
        settings: further options that define the run (e.g. the loss's soft-label weight); kept in
            the checkpoint and, like ``cfg``, required to match on resume.

    Returns:
        ``TrainResult``; metrics are averages over the last 10% of steps (kept in the checkpoint,
        so resuming a finished run reports them again).

    Raises:
        ValueError: no sequences, no trainable parameters, or a checkpoint in ``out_dir`` written
            by a run of another model shape or other settings (when ``resume``).
    """
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    if not seqs:
        raise ValueError("no training sequences")
    seqs, val_seqs = split_validation(seqs, cfg)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no trainable parameters")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_epoch = sum(1 for _ in iter_batches(seqs, cfg.max_batch_tokens, np.random.default_rng(0), cfg.max_len, cfg.max_answer_tokens))
    total = cfg.max_steps or max(1, math.ceil(per_epoch * cfg.epochs))
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    sched = get_cosine_schedule_with_warmup(opt, max(1, int(cfg.warmup_frac * total)), total)
    step = 0
    best: dict = {}  # held-out loss, step, metrics and trainable parameters of the best step so far
    history: dict = {"losses": [], "wall_s": 0.0, "tail": {}}  # of the earlier runs a resumed run continues
    settings = dict(settings or {})
    ckpt = out / "checkpoint.pt"
    if resume and ckpt.is_file():
        try:  # weights_only: a checkpoint found in --out never runs pickled code
            state = torch.load(ckpt, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or "module" not in state:
                raise ValueError("not a training checkpoint")
        except Exception as exc:  # truncated, not a torch file, or foreign objects
            raise ValueError(f"{ckpt} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                             "start over (--no-resume, or another --out)") from None
        _check_resume(state, cfg, total, settings, ckpt)
        try:
            module.load_state_dict(state["module"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
        except (ValueError, RuntimeError):
            raise ValueError(f"{ckpt} was written by a run with another model shape; resume with the same "
                             "options, or start over (--no-resume, or another --out)") from None
        step = state["step"]
        best = state.get("best", {})
        history = state.get("history", history)
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    wall = history["wall_s"]  # training time as of the last checkpoint (a finished run's rerun adds none)

    def validate() -> None:
        if not val_seqs:
            return
        res = evaluate(module, loss_fn, val_seqs, cfg, progress)
        if not best or res["loss"] < best["loss"]:
            params = dict(module.named_parameters())
            best.update(res, step=step, params={k: params[k].detach().to("cpu", copy=True) for k in trainable})
    torch.manual_seed(cfg.seed)
    losses: list[float] = list(history["losses"])  # every step's loss, earlier runs included
    tail: dict[str, list[float]] = {k: list(v) for k, v in history.get("tail", {}).items()}  # last 10% of steps
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=step, disable=not progress, desc="train", unit="step")
    epoch, seen = 0, 0
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    module.train()
    while step < total and not stop.is_set():
        for batch in iter_batches(seqs, cfg.max_batch_tokens, np.random.default_rng([cfg.seed, epoch]),
                                  cfg.max_len, cfg.max_answer_tokens):
            if step >= total:
                break
            seen += 1
            if seen <= step:  # resumed: skip the batches already trained on
                continue
            loss, metrics = loss_fn(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            value = float(loss.detach())
            losses.append(value)
            if step > 0.9 * total:
                for k, v in metrics.items():
                    tail.setdefault(k, []).append(float(v))
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
            if step % cfg.checkpoint_every == 0 or step == total or stop.is_set():
                validate()
                tmp = out / "checkpoint.pt.tmp"
                wall = history["wall_s"] + time.perf_counter() - t0
                torch.save({"module": {k: v for k, v in module.state_dict().items()}, "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "step": step, "config": asdict(cfg), "best": best,
                            "planned_steps": total, "settings": settings,
                            "history": {"losses": losses, "wall_s": wall, "tail": tail}},
                           tmp)
                tmp.replace(ckpt)
            if stop.is_set():
                break
        epoch += 1
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
    bar.close()
    validation = {}
    if best:
        with torch.no_grad():  # end with the best held-out step's parameters
            params = dict(module.named_parameters())
            for k, v in best["params"].items():
                params[k].copy_(v.to(params[k].device))
        validation = {"sequences": len(val_seqs), "best_step": best["step"], "loss": best["loss"],
                      "metrics": best["metrics"]}
    module.eval()
    window = max(1, len(losses) // 10)
    return TrainResult(step, wall,
                       float(np.mean(losses[:window])) if losses else float("nan"),
                       float(np.mean(losses[-window:])) if losses else float("nan"),
                       {k: float(np.mean(v)) for k, v in tail.items()}, total, validation)
