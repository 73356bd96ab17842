"""What a drafter training run needs around its training loop (``tandem train specformer |
draft-model``): the frozen target and the distilled data it was made from, and, after training,
the optional acceptance evaluation and the model card beside the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidRequestError
from ..models.runner import RunnerConfig, default_runner_config
from ..models.transformer import Transformer
from ..models.weights import Checkpoint, load_checkpoint
from .card import model_card
from .distill import DistillManifest, model_fingerprint, read_distilled


@dataclass
class TrainTarget:
    """The frozen target a drafter trains against, and its data.

    Attributes:
        checkpoint: the target's checkpoint.
        model: the target ``Transformer`` on the device (bfloat16 on CUDA, float32 on CPU), frozen,
            with room for the longest distilled sequence.
        sequences, manifest: the distilled data (``read_distilled``).
        amp: training runs in bfloat16 autocast (CUDA).
        runner_config: the device settings (``default_runner_config``).
    """

    checkpoint: Checkpoint
    model: Transformer
    sequences: list
    manifest: DistillManifest
    amp: bool
    runner_config: RunnerConfig


def load_train_target(model: str | None, device: str | None, data_dir: str) -> TrainTarget:
    """Load the distilled data in ``data_dir`` and the frozen target that made it.

    Raises:
        InvalidRequestError: the data was distilled from another target model.
        ModelLoadError: the target cannot be loaded; ValueError / OSError: unreadable data.
    """
    manifest, seqs = read_distilled(data_dir)
    ck = load_checkpoint(model)
    if manifest.target.get("sha256") != model_fingerprint(ck.path):
        raise InvalidRequestError(f"{data_dir} was distilled from another target model ({manifest.target.get('path')})")
    cfg = default_runner_config(device)
    amp = cfg.device.startswith("cuda")
    longest = max(len(s.tokens) for s in seqs) if seqs else 1
    target = Transformer(ck.config, max_positions=longest + 1)
    target.load_weights(ck.tensors)
    target = target.to(cfg.device, torch.bfloat16 if amp else torch.float32).eval().requires_grad_(False)
    return TrainTarget(ck, target, seqs, manifest, amp, cfg)


def evaluate_drafter(kind: str, weights: str, num_draft_tokens: int, model: str | None, device: str | None,
                     limit: int, max_tokens: int, batch_size: int | None) -> dict:
    """Acceptance of a trained drafter on the first ``limit`` bundled Spec-Bench prompts (round
    robin over categories, greedy): ``AcceptanceReport.to_dict()``.

    Raises:
        ModelLoadError / InvalidRequestError / ConfigError: the drafter cannot be built.
    """
    from ..bench.acceptance import measure_acceptance
    from ..data import bundled_spec_bench, load_prompts, round_robin_by_category
    from ..speculation import SpeculativeConfig, build_engine

    on_gpu = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
    cfg = default_runner_config(device, max_batch_size=batch_size or (64 if on_gpu else 8), max_seq_len=2048)
    engine = build_engine(SpeculativeConfig(kind, draft_model=weights, num_draft_tokens=num_draft_tokens),
                          load_checkpoint(model), cfg)
    records = round_robin_by_category(load_prompts(bundled_spec_bench()), limit)
    return measure_acceptance(engine, records, max_tokens)[0].to_dict()


def write_card(kind: str, out: str, result, manifest: DistillManifest, train_cfg: dict, extra: dict, command: str,
               evaluation: dict | None) -> str:
    """Write the model card (``card.json`` and ``README.md``) beside the weights in ``out``;
    returns the one-line summary of the run (steps, loss, and the evaluation when given).

    Args:
        result: the training loop's ``TrainResult``.
        train_cfg, extra: the training settings and the drafter's own (its config).
        command: the command line that trained it.
        evaluation: ``evaluate_drafter``'s report, or None.
    """
    card = {"kind": kind, "command": command, "data": {
                "answers": len(manifest.records), "answer_tokens": sum(r.answer_len for r in manifest.records),
                "target": manifest.target, "settings": manifest.settings},
            "training": dict(train_cfg, **result.to_dict()), "extra": extra, "spec_bench": evaluation}
    Path(out, "card.json").write_text(json.dumps(card, indent=2))
    Path(out, "README.md").write_text(model_card(card))
    line = f"{kind}: {result.steps} steps in {result.wall_s:.0f} s, loss {result.first_loss:.3f} -> {result.final_loss:.3f}"
    if evaluation:
        o = evaluation["overall"]
        line += (f"; Spec-Bench ({evaluation['prompts']} prompts): acceptance rate {o['acceptance_rate']:.3f}, "
                 f"mean accepted length {o['mean_accepted_length']:.2f}")
    return line + f" -> {out}"
