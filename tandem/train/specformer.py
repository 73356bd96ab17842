"""Train a SpecFormer head on self-distilled data (SpecFormer, AAAI 2026, §3.3).

The target is frozen; its tapped hidden states feed the head, and every position ``t`` of an
answer learns to predict ``x[t+2+j]`` in draft slot ``j`` (multi-position next-token
cross-entropy through the target's frozen final norm and LM head). Only tokens of the target's
own answers are labels; prompt positions still feed the head's context attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..drafters.specformer import SpecFormerConfig, SpecFormerHead
from ..models.transformer import Transformer
from .distill import DistilledSequence
from .loop import pad_batch


def specformer_labels(tokens: torch.Tensor, lengths: torch.Tensor, prompt_lens: torch.Tensor,
                      num_draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and validity of every (position, draft slot).

    Args:
        tokens: ``[B, T]``; lengths, prompt_lens: ``[B]``.
        num_draft: l_d.

    Returns:
        ``labels`` ``[B, T, l_d]`` (``tokens[b, t + 2 + j]``) and ``valid`` ``[B, T, l_d]`` bool
        (the label exists and is an answer token).
    """
    B, T = tokens.shape
    idx = torch.arange(T, device=tokens.device)[:, None] + 2 + torch.arange(num_draft, device=tokens.device)[None]
    labels = tokens.gather(1, idx.clamp(max=T - 1).reshape(1, -1).expand(B, -1)).view(B, T, num_draft)
    valid = (idx[None] < lengths[:, None, None]) & (idx[None] >= prompt_lens[:, None, None])
    return labels, valid


def teacher_forced_states(head: SpecFormerHead, target: Transformer, tokens: torch.Tensor,
                          select: torch.Tensor | None = None) -> torch.Tensor:
    """The head's draft states for every (selected) position of whole sequences, as the engine
    would produce them round by round: the frozen target's taps (no grad), RoPE tables in the
    taps' dtype, and for bonus-token heads the embedding of x[t+1].

    Args:
        tokens: ``[B, T]`` ids from position 0 (right padding is harmless).
        select: optional ``[B, T]`` bool, the positions needed.

    Returns:
        ``[N, l_d, d]`` states before the target's final norm (N = B*T or the selected count).
    """
    B, T = tokens.shape
    with torch.no_grad():
        _, taps = target.forward_causal(tokens, taps=head.config.taps)
    cos = target.rope_cos[:T].to(taps.dtype).expand(B, T, -1)
    sin = target.rope_sin[:T].to(taps.dtype).expand(B, T, -1)
    bonus = None
    if head.config.bonus_token:  # position t's bonus token is x[t+1] (the target's own next token)
        nxt = tokens[:, (torch.arange(T, device=tokens.device) + 1).clamp(max=T - 1)]
        bonus = target.embed(nxt[select] if select is not None else nxt.reshape(-1))
    return head.forward_train(taps, cos, sin, select, bonus)


class SpecFormerObjective:
    """Loss over a batch of distilled sequences: target forward (no grad) -> head -> CE.

    Args:
        head: the head being trained (float32 master weights).
        target: the frozen target ``Transformer`` (bf16 on GPU), on the same device.
        amp: bf16 autocast for the head (CUDA).
    """

    def __init__(self, head: SpecFormerHead, target: Transformer, amp: bool) -> None:
        self.head, self.target, self.amp = head, target, amp
        self.device = next(target.parameters()).device

    def __call__(self, batch: list[DistilledSequence]) -> tuple[torch.Tensor, dict]:
        cfg = self.head.config
        tokens, lengths, prompt_lens = pad_batch(batch, self.device)
        labels, valid = specformer_labels(tokens, lengths, prompt_lens, cfg.num_draft_tokens)
        select = valid.any(-1)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            logits = self.target.logits(self.target.norm(teacher_forced_states(self.head, self.target, tokens,
                                                                               select)))  # [N, l_d, vocab] fp32
        lab, ok = labels[select], valid[select]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="none").view_as(lab)
        loss = (ce * ok).sum() / ok.sum().clamp_min(1)
        with torch.no_grad():
            hit = (logits.argmax(-1) == lab) & ok
            acc = hit.sum(0).float() / ok.sum(0).clamp_min(1)  # per-slot top-1 accuracy
            chain = torch.cumprod(hit | ~ok, dim=-1) & ok  # slot j right and every earlier one too
            metrics = {f"acc_slot{j + 1}": float(acc[j]) for j in range(cfg.num_draft_tokens)}
            metrics["expected_accepted"] = float(chain.sum() / ok[:, 0].sum().clamp_min(1))
        return loss, metrics


def new_head(target_config, num_draft_tokens: int = 4, taps: tuple[int, ...] | None = None,
             causal_draft: bool = False, seed: int = 0, bonus_token: bool = False) -> SpecFormerHead:
    """A freshly initialised head for ``target_config`` (seeded)."""
    torch.manual_seed(seed)
    return SpecFormerHead(SpecFormerConfig.for_target(target_config, num_draft_tokens, taps, causal_draft,
                                                      bonus_token=bonus_token))
