"""Train a SpecFormer head on self-distilled data (SpecFormer, AAAI 2026, §3.3).

The target is frozen; its tapped hidden states feed the head, and every position ``t`` of an
answer learns to predict ``x[t+2+j]`` in draft slot ``j`` (multi-position next-token
cross-entropy through the target's frozen final norm and LM head). Only tokens of the target's
own answers are labels; prompt positions still feed the head's context attention.
"""

from __future__ import annotations

import numpy as np
import torch

from ..drafters.lookup import lookup_continuations
from ..models.specformer import SpecFormerConfig, SpecFormerHead, lookup_inputs
from ..models.transformer import Transformer
from .distill import DistilledSequence
from .loop import pad_batch


@torch.no_grad()
def init_context_from_target(head: SpecFormerHead, target) -> None:
    """Start a ``context_init`` head from the target: context block i copies target block
    ``config.context_init[i]`` (attention norm, fused q/k/v, output projection, MLP norm and
    SwiGLU weights; the shapes match by construction), so the context stack begins as a pruned
    copy of the target, as the context-aware paper's draft model does.

    For ``context_next_token`` heads the stream then starts as the draft model's input: the
    downsampler starts at zero (the taps enter as training finds them useful) and the next-token
    branch passes each embedding through at its typical scale (``next_proj`` = identity,
    ``next_norm`` = the embeddings' mean RMS), so at step 0 every draft slot reads the pruned
    target's prediction after x[t+1].

    Args:
        head: a head made with ``SpecFormerConfig.for_target(..., context_init=...)``.
        target: the target ``Transformer`` (any device and dtype; copied to the head's).

    Raises:
        ValueError: the head has no ``context_init`` blocks, or they do not fit the target.
    """
    cfg = head.config
    if not cfg.context_init:
        raise ValueError("this SpecFormer head has no context init blocks (SpecFormerConfig.context_init)")
    if (len(target.layers), target.config.hidden_size) != (cfg.target_layers, cfg.hidden_size):
        raise ValueError("the target does not match the head's config")
    pairs = {"norm.weight": "attn_norm.weight", "qkv.weight": "wqkv.weight", "o.weight": "wo.weight",
             "mlp.norm.weight": "ffn_norm.weight", "mlp.w13.weight": "w13.weight", "mlp.w2.weight": "w2.weight"}
    for layer, idx in zip(head.ctx, cfg.context_init):
        src = dict(target.layers[idx].named_parameters())
        dst = dict(layer.named_parameters())
        for ours, theirs in pairs.items():
            if dst[ours].shape != src[theirs].shape:
                raise ValueError(f"context block {ours} {tuple(dst[ours].shape)} cannot copy target block {idx} "
                                 f"{theirs} {tuple(src[theirs].shape)}")
            dst[ours].copy_(src[theirs].to(dst[ours].dtype))
    if cfg.context_next_token:
        head.down.weight.zero_()
        head.next_proj.weight.copy_(torch.eye(cfg.hidden_size))
        emb = target.embed.weight.float()
        head.next_norm.weight.fill_(float(emb.pow(2).mean(-1).sqrt().mean()))


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
                          select: torch.Tensor | None = None,
                          target_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The head's draft states for every (selected) position of whole sequences, as the engine
    would produce them round by round: the frozen target's taps (no grad), RoPE tables in the
    taps' dtype, the embedding of x[t+1] at position t (the bonus token for ``bonus_token``
    heads; every position's next token for ``context_next_token`` heads) and, for
    ``lookup_tokens`` heads, the context lookup continuation of ``x[..t+1]``.

    Args:
        tokens: ``[B, T]`` ids from position 0 (right padding is harmless).
        select: optional ``[B, T]`` bool, the positions needed.
        target_out: ``target.forward_causal(tokens, taps=head.config.taps)`` when the caller
            already ran it (no grad).

    Returns:
        ``[N, l_d, d]`` states before the target's final norm (N = B*T or the selected count).
    """
    B, T = tokens.shape
    if target_out is None:
        with torch.no_grad():
            target_out = target.forward_causal(tokens, taps=head.config.taps)
    taps = target_out[1]
    cos = target.rope_cos[:T].to(taps.dtype).expand(B, T, -1)
    sin = target.rope_sin[:T].to(taps.dtype).expand(B, T, -1)
    cfg = head.config
    nxt = tokens[:, (torch.arange(T, device=tokens.device) + 1).clamp(max=T - 1)]  # x[t+1] at position t
    bonus = next_emb = None
    if cfg.bonus_token:
        bonus = target.embed(nxt[select] if select is not None else nxt.reshape(-1))
    if cfg.context_next_token:
        next_emb = target.embed(nxt)
    lookup = None
    if cfg.lookup_tokens:
        cont, match = lookup_rows(tokens, cfg.num_draft_tokens)
        if select is not None:
            keep = select.reshape(-1).cpu().numpy()
            cont, match = cont[keep], match[keep]
        lookup = lookup_inputs(target.embed, cont, match)
    return head.forward_train(taps, cos, sin, select, bonus, next_emb, lookup)


def lookup_rows(tokens: torch.Tensor, num_draft: int) -> tuple[np.ndarray, np.ndarray]:
    """Context lookup continuations of every position ``t`` of ``tokens`` ``[B, T]``, read after
    ``x[t+1]`` (what a round at ``t`` drafts with: the bonus token is known): ``[B*T, num_draft]``
    ids (-1: none) and ``[B*T]`` match lengths, row-major. Right padding only affects rows past
    each sequence's end (the lookup reads no later token)."""
    x = tokens.cpu().numpy()
    B, T = x.shape
    cont = np.full((B, T, num_draft), -1, np.int64)
    match = np.zeros((B, T), np.int64)
    c, m = lookup_continuations(x, num_draft)  # every row at once
    cont[:, :-1], match[:, :-1] = c[:, 1:], m[:, 1:]  # row t reads x[..t+1]
    return cont.reshape(B * T, num_draft), match.reshape(B * T)


class SpecFormerObjective:
    """Loss over a batch of distilled sequences: target forward (no grad) -> head -> CE.

    The loss of draft slot ``j`` at position ``t`` is ``(1 - soft_weight)`` times the
    cross-entropy against the distilled token ``x[t+2+j]`` plus ``soft_weight`` times the
    cross-entropy against the target's own next-token distribution at position ``t+1+j``
    (soft-label knowledge distillation, Hinton et al. 2015; its argmax is the distilled greedy
    token, the rest of it says which near-misses the target considers).

    Args:
        head: the head being trained (float32 master weights).
        target: the frozen target ``Transformer`` (bf16 on GPU), on the same device.
        amp: bf16 autocast for the head (CUDA).
        soft_weight: weight of the soft-label term in [0, 1] (0: hard labels only, the paper's loss).

    Raises:
        ValueError: ``soft_weight`` outside [0, 1].
    """

    def __init__(self, head: SpecFormerHead, target: Transformer, amp: bool, soft_weight: float = 0.0) -> None:
        if not 0.0 <= soft_weight <= 1.0:
            raise ValueError(f"soft_weight must lie in [0, 1], got {soft_weight}")
        self.head, self.target, self.amp, self.soft_weight = head, target, amp, soft_weight
        self.device = next(target.parameters()).device

    def __call__(self, batch: list[DistilledSequence]) -> tuple[torch.Tensor, dict]:
        cfg = self.head.config
        tokens, lengths, prompt_lens = pad_batch(batch, self.device)
        labels, valid = specformer_labels(tokens, lengths, prompt_lens, cfg.num_draft_tokens)
        select = valid.any(-1)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            with torch.no_grad():
                target_out = self.target.forward_causal(tokens, taps=cfg.taps)
            states = teacher_forced_states(self.head, self.target, tokens, select, target_out)
            logits = self.target.logits(self.target.norm(states))  # [N, l_d, vocab] fp32
        lab, ok = labels[select], valid[select]
        logp = logits.log_softmax(-1)
        ce = -logp.gather(-1, lab[..., None])[..., 0]  # [N, l_d]
        if self.soft_weight > 0:
            ce = (1 - self.soft_weight) * ce + self.soft_weight * self._soft_ce(logp, target_out[0], select)
        loss = (ce * ok).sum() / ok.sum().clamp_min(1)
        with torch.no_grad():
            hit = (logits.argmax(-1) == lab) & ok
            acc = hit.sum(0).float() / ok.sum(0).clamp_min(1)  # per-slot top-1 accuracy
            chain = torch.cumprod(hit | ~ok, dim=-1) & ok  # slot j right and every earlier one too
            metrics = {f"acc_slot{j + 1}": float(acc[j]) for j in range(cfg.num_draft_tokens)}
            metrics["expected_accepted"] = float(chain.sum() / ok[:, 0].sum().clamp_min(1))
        return loss, metrics

    def _soft_ce(self, logp: torch.Tensor, hidden: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """``[N, l_d]`` cross-entropy of the head's ``logp`` against the target's distribution at
        position ``t+1+j`` (``hidden``: the target's final-norm states ``[B, T, d]``)."""
        T = select.shape[1]
        b, t = select.nonzero(as_tuple=True)
        out = []
        for j in range(self.head.config.num_draft_tokens):  # one slot at a time: [N, vocab] temporaries
            idx = (t + 1 + j).clamp(max=T - 1)  # past-the-end slots are masked by the caller
            with torch.no_grad():
                teacher = self.target.logits(hidden[b, idx]).softmax(-1)
            out.append(-(teacher * logp[:, j]).sum(-1))
        return torch.stack(out, dim=1)


def new_head(target_config, num_draft_tokens: int = 4, taps: tuple[int, ...] | None = None,
             causal_draft: bool = False, seed: int = 0, bonus_token: bool = False, **shape) -> SpecFormerHead:
    """A freshly initialised head for ``target_config`` (seeded); ``shape``: further
    ``SpecFormerConfig.for_target`` arguments (``context_next_token``, ``context_layers``, ...).

    Raises:
        ValueError: see ``SpecFormerConfig.for_target``.
    """
    torch.manual_seed(seed)
    return SpecFormerHead(SpecFormerConfig.for_target(target_config, num_draft_tokens, taps, causal_draft,
                                                      bonus_token=bonus_token, **shape))


def load_start(head: SpecFormerHead, start: SpecFormerHead) -> None:
    """Start ``head``'s training from the trained ``start`` (``tandem train specformer --init-from``):
    the same configuration, or the same but for more draft slots (l_d 4 -> 6 or 8). Every weight is
    ``start``'s; a new slot's rows of ``pos_ffn`` (the only per-slot weight: slot j's offset from
    the context state) start as the last trained slot's, so the new slots begin by drafting what
    the last one drafts and fine-tuning moves them further ahead.

    Raises:
        ValueError: the configurations differ otherwise, or ``head`` has fewer slots than ``start``.
    """
    from dataclasses import asdict

    differ = {k: v for k, v in asdict(start.config).items() if getattr(head.config, k) != v}
    grow = head.config.num_draft_tokens - start.config.num_draft_tokens
    if set(differ) - {"num_draft_tokens"} or grow < 0:
        raise ValueError("--init-from is another head: " + "; ".join(
            f"{k} {v!r} (there) vs {getattr(head.config, k)!r} (these options)" for k, v in differ.items())
            + ("" if grow >= 0 else " (a head can grow draft slots, not lose them)"))
    state = start.state_dict()
    if grow:
        d = head.config.hidden_size
        w = state["pos_ffn.weight"]  # [l_d * d, d], slot-major
        state["pos_ffn.weight"] = torch.cat([w] + [w[-d:]] * grow)
    head.load_state_dict(state)
