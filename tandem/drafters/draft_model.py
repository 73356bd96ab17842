"""Draft-model drafter: a small causal LM sharing the target's tokenizer, run by our own model
runner with its own KV cache (slot numbering mirrors the target's) and rollback.

Each round it syncs its cache to the sequence (truncating to the longest common prefix: the
rejected drafts of the previous round are dropped in O(1)), then drafts autoregressively, one
batched forward per draft position across all sequences. Greedy requests draft by argmax;
sampled requests draw from q = the request's sampling transform of the draft logits, and q is
returned for speculative sampling.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..models.config import ModelLoadError
from ..models.runner import ModelRunner, RunnerConfig
from ..models.weights import Checkpoint, load_checkpoint
from ..sampling import sampling_probs
from .base import DraftProposal, DraftRequest, Drafter, distribution_features

PREFILL_THRESHOLD = 16  # sync feeds longer than this go through batched prefill


def truncated_checkpoint(checkpoint: Checkpoint, num_layers: int) -> Checkpoint:
    """The target's first ``num_layers`` blocks + its final norm and LM head: a training-free
    early-exit draft model (LayerSkip-style self-speculation).

    Raises:
        ModelLoadError: ``num_layers`` is not in [1, target layers).
    """
    total = checkpoint.config.num_layers
    if not 1 <= num_layers < total:
        raise ModelLoadError(f"a truncated draft needs 1..{total - 1} layers, got {num_layers}")
    keep = {k: v for k, v in checkpoint.tensors.items()
            if not k.startswith("layers.") or int(k.split(".")[1]) < num_layers}
    return Checkpoint(path=checkpoint.path, config=replace(checkpoint.config, num_layers=num_layers),
                      tensors=keep, chat_template=checkpoint.chat_template)


def load_draft_checkpoint(spec: str, target: Checkpoint) -> Checkpoint:
    """Resolve ``--draft-model``: a path (GGUF / HF directory) or ``truncate:N`` (the target's first
    N layers).

    Raises:
        ModelLoadError: bad spec, unloadable model, or a vocabulary that does not match the target.
    """
    if spec.startswith("truncate:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ModelLoadError(f"bad draft model spec {spec!r}; use truncate:N with an integer N") from None
        return truncated_checkpoint(target, n)
    draft = load_checkpoint(spec)
    check_compatible(draft, target)
    return draft


def check_compatible(draft: Checkpoint, target: Checkpoint) -> None:
    """Raise ModelLoadError unless the draft shares the target's vocabulary and special ids."""
    d, t = draft.config, target.config
    if d.vocab_size != t.vocab_size:
        raise ModelLoadError(f"draft model vocabulary ({d.vocab_size}) differs from the target's ({t.vocab_size}); "
                             "a draft model must share the target's tokenizer")
    if d.eos_token_ids and t.eos_token_ids and set(d.eos_token_ids) != set(t.eos_token_ids):
        raise ModelLoadError(f"draft model EOS ids {d.eos_token_ids} differ from the target's {t.eos_token_ids}")
    if d.bos_token_id is not None and t.bos_token_id is not None and d.bos_token_id != t.bos_token_id:
        raise ModelLoadError(f"draft model BOS id {d.bos_token_id} differs from the target's {t.bos_token_id}")


class DraftModelDrafter(Drafter):
    """Autoregressive drafting with a small LM.

    Args:
        checkpoint: the draft model (same vocabulary as the target).
        config: runner settings (use the target's device, dtype, slots and context limit).
    """

    name = "draft-model"

    def __init__(self, checkpoint: Checkpoint, config: RunnerConfig, top_m: int = 4) -> None:
        self.top_m = top_m  # candidates kept per position for hard-position branching
        # Draft numerics never change the output, so the draft runner skips exact-kernel padding.
        self.runner = ModelRunner(checkpoint, replace(config, compile=False, fixed_step_tokens=0))
        self.cached: dict[int, list[int]] = {}  # slot -> tokens held in the draft cache

    def release(self, slot: int) -> None:
        if slot in self.cached:
            del self.cached[slot]
            self.runner.cache.free(slot)

    def _sync(self, reqs: list[DraftRequest]) -> dict[int, torch.Tensor]:
        """Bring each slot's cache to ``token_ids`` and return the logits after its last token."""
        cache = self.runner.cache
        feeds: dict[int, list[int]] = {}
        for r in reqs:
            if r.slot not in self.cached:
                cache.claim(r.slot)
                self.cached[r.slot] = []
            held = self.cached[r.slot]
            common = 0
            limit = min(len(held), len(r.token_ids) - 1)  # feed at least the last token
            while common < limit and held[common] == r.token_ids[common]:
                common += 1
            cache.truncate(r.slot, common)
            del held[common:]
            feeds[r.slot] = r.token_ids[common:]
            held.extend(feeds[r.slot])
        logits: dict[int, torch.Tensor] = {}
        long = {s: f for s, f in feeds.items() if len(f) > PREFILL_THRESHOLD}
        short = {s: f for s, f in feeds.items() if len(f) <= PREFILL_THRESHOLD}
        if long:
            out = self.runner.prefill(long)
            for i, s in enumerate(sorted(long)):
                logits[s] = out[i]
        if short:
            out = self.runner.step(short)
            for s, f in short.items():
                logits[s] = out.logits[s, len(f) - 1].clone()
        return logits

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        active = [r for r in requests if r.max_draft > 0]
        if not active:
            return [DraftProposal.empty() for _ in requests]
        logits = self._sync(active)
        tokens: dict[int, list[int]] = {r.slot: [] for r in active}
        probs: dict[int, list[torch.Tensor]] = {r.slot: [] for r in active}
        feats: dict[int, list[torch.Tensor]] = {r.slot: [] for r in active}
        tops: dict[int, list[torch.Tensor]] = {r.slot: [] for r in active}
        live = list(active)
        for pos in range(1, max(r.max_draft for r in active) + 1):
            for r in live:
                lg = logits[r.slot][None]
                if r.params.greedy:
                    q = lg.softmax(-1)
                    tok = int(lg.argmax())
                else:
                    dev = lg.device
                    q = sampling_probs(lg, torch.tensor([r.params.temperature], device=dev),
                                       torch.tensor([r.params.top_k], device=dev),
                                       torch.tensor([r.params.top_p], device=dev))
                    tok = int(torch.multinomial(q[0], 1, generator=r.generator))
                    probs[r.slot].append(q[0])
                tokens[r.slot].append(tok)
                feats[r.slot].append(distribution_features(q, pos))
                tops[r.slot].append(q[0].topk(min(self.top_m, q.shape[-1])).indices.cpu())
            live = [r for r in live if len(tokens[r.slot]) < r.max_draft]
            if not live:
                break
            out = self.runner.step({r.slot: [tokens[r.slot][-1]] for r in live})
            for r in live:
                self.cached[r.slot].append(tokens[r.slot][-1])
                logits[r.slot] = out.logits[r.slot, 0].clone()
        result = []
        for r in requests:
            if r.max_draft <= 0:
                result.append(DraftProposal.empty())
                continue
            q = torch.stack(probs[r.slot]) if probs[r.slot] else None
            result.append(DraftProposal(tokens[r.slot], q, torch.cat(feats[r.slot]), torch.stack(tops[r.slot])))
        return result
