"""Small helpers shared by the test modules (imported as ``helpers``; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tandem.models import Checkpoint
from tandem.models.runner import ModelRunner, RunnerConfig


def make_runner(checkpoint: Checkpoint, slots: int = 1, max_seq_len: int = 64) -> ModelRunner:
    """A CPU float32 eager runner."""
    return ModelRunner(checkpoint, RunnerConfig(device="cpu", max_batch_size=slots, max_seq_len=max_seq_len))


def our_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of a fresh run of ``ids`` in a fresh slot (one forward)."""
    slot = runner.cache.allocate()
    try:
        return runner.step({slot: list(ids)}).logits[slot, :len(ids)].clone()
    finally:
        runner.cache.free(slot)


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` float32 logits of a Hugging Face causal LM."""
    return model(torch.tensor([ids])).logits[0].float()


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """Copy a checkpoint directory (to corrupt it without touching the shared one)."""
    shutil.copytree(src, dst)
    return dst


def edit_config(d: Path, **changes) -> None:
    """Rewrite keys of ``d/config.json`` (a value of ``None`` deletes the key)."""
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))
