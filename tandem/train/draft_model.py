"""A small draft LM distilled from the target (the drafter of the context-aware paper).

The draft model shares the target's tokenizer, embeddings and LM head (frozen and not stored:
they are read from the target at load time), and has a few transformer blocks initialised from
chosen target blocks plus the target's final norm. It is trained to match the target's
next-token distribution on the target's own answers: soft-label cross-entropy against the
target's softmax (= KL(target || draft) + const), which also teaches the argmax that greedy
verification checks.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..drafters.draft_model import SHARED
from ..models.config import ModelLoadError
from ..models.transformer import Transformer
from ..models.weights import Checkpoint
from .distill import DistilledSequence
from .loop import pad_batch



def init_draft_model(target: Checkpoint, init_layers: tuple[int, ...], max_positions: int) -> Transformer:
    """A ``len(init_layers)``-block LM: block i copies target block ``init_layers[i]``; embeddings,
    final norm and LM head copy the target's (embeddings and LM head frozen).

    Raises:
        ModelLoadError: a layer index outside the target.
    """
    L = target.config.num_layers
    if not init_layers or not all(0 <= i < L for i in init_layers):
        raise ModelLoadError(f"init layers {init_layers} must be target block indices in [0, {L})")
    cfg = replace(target.config, num_layers=len(init_layers))
    tensors = {k: v for k, v in target.tensors.items() if not k.startswith("layers.")}
    for new, old in enumerate(init_layers):
        prefix = f"layers.{old}."
        tensors.update({f"layers.{new}.{k[len(prefix):]}": v for k, v in target.tensors.items() if k.startswith(prefix)})
    model = Transformer(cfg, max_positions)
    model.load_weights(tensors)
    for name, p in model.named_parameters():
        p.requires_grad = name not in SHARED
    return model


class DraftModelObjective:
    """Soft-label cross-entropy of the draft model against the frozen target on answer tokens.

    Args:
        draft: the draft ``Transformer`` (float32 master weights).
        target: the frozen target ``Transformer`` on the same device.
        amp: bf16 autocast (CUDA).
    """

    def __init__(self, draft: Transformer, target: Transformer, amp: bool) -> None:
        self.draft, self.target, self.amp = draft, target, amp
        self.device = next(target.parameters()).device

    def __call__(self, batch: list[DistilledSequence]) -> tuple[torch.Tensor, dict]:
        tokens, lengths, prompt_lens = pad_batch(batch, self.device)
        T = tokens.shape[1]
        nxt = torch.arange(T, device=self.device)[None] + 1  # position t predicts token t + 1
        mask = (nxt < lengths[:, None]) & (nxt >= prompt_lens[:, None])  # [B, T]: the next token is an answer token
        with torch.no_grad():
            hidden, _ = self.target.forward_causal(tokens)
            teacher = self.target.logits(hidden[mask]).softmax(-1)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            h, _ = self.draft.forward_causal(tokens)
            logits = self.draft.logits(h[mask])
        loss = F.cross_entropy(logits, teacher)
        with torch.no_grad():
            agree = float((logits.argmax(-1) == teacher.argmax(-1)).float().mean())
        return loss, {"top1_agreement": agree}
