"""Drafter interface: propose draft tokens for running sequences.

A drafter is told each round, per running sequence, the full token sequence so far (prompt +
accepted output; its last token is the one the target has not consumed yet) and how many draft
tokens it may propose. Drafters that keep state (a draft model's KV cache) sync to that sequence
themselves: whatever they cached beyond the longest common prefix was rejected and is rolled back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams

NUM_FEATURES = 4  # entropy, top-1 probability, top-1 minus top-2 margin, position (1-based)


@dataclass(frozen=True)
class DraftRequest:
    """What the drafter is asked for one sequence.

    Attributes:
        slot: the sequence's KV cache slot (stable while it runs; drafters may reuse it).
        token_ids: prompt + output so far; the last token is not yet in the target's cache.
        max_draft: draft tokens allowed this round (0 means propose nothing).
        params: the request's sampling parameters (drafts follow the same transform).
        generator: the request's random generator (None for greedy requests).
    """

    slot: int
    token_ids: list[int]
    max_draft: int
    params: SamplingParams
    generator: torch.Generator | None = None


@dataclass
class DraftProposal:
    """Drafts for one sequence.

    Attributes:
        tokens: 0..max_draft draft token ids.
        probs: ``[len(tokens), vocab]`` float32 draft distribution q each token was drawn from
            (after the request's sampling transform), or None for a deterministic drafter
            (q is then one-hot at each token).
        features: ``[len(tokens), NUM_FEATURES]`` float32 predictor features per position.
        top_tokens: ``[len(tokens), m]`` int64, the m most likely draft tokens at each position
            (for branching at hard positions), or None.
        parents: token-tree parent index of each token (-1: the sequence's last token), or
            None for a chain.
    """

    tokens: list[int]
    probs: torch.Tensor | None
    features: torch.Tensor
    top_tokens: torch.Tensor | None = None
    parents: list[int] | None = None

    @property
    def chain_length(self) -> int:
        """Drafts before the first node that has siblings (all of them for a chain)."""
        if self.parents is None:
            return len(self.tokens)
        return next((i for i, p in enumerate(self.parents) if self.parents.count(p) > 1), len(self.tokens))

    def truncated(self, n: int) -> "DraftProposal":
        """The first ``n`` drafts (a draft is only valid with every draft before it)."""
        if n >= len(self.tokens):
            return self
        if self.parents is not None:
            raise ValueError("truncate token trees by rebuilding them")
        return DraftProposal(self.tokens[:n], None if self.probs is None else self.probs[:n], self.features[:n],
                             None if self.top_tokens is None else self.top_tokens[:n])

    def branched(self, n: int, m: int) -> "DraftProposal":
        """Keep the first ``n`` drafts as a chain and branch position ``n + 1`` into its ``m``
        most likely tokens (leaves of a small token tree), each verified as a one-hot proposal.

        Raises:
            ValueError: no ``top_tokens``, or ``n`` is not a drafted position.
        """
        if self.top_tokens is None or not 0 <= n < len(self.tokens):
            raise ValueError("branching needs top_tokens at a drafted position")
        cands = list(dict.fromkeys(self.top_tokens[n, :m].tolist()))  # unique, best first
        chain = self.truncated(n)
        probs = None
        if chain.probs is not None:
            onehot = torch.zeros(len(cands), chain.probs.shape[1], dtype=chain.probs.dtype, device=chain.probs.device)
            onehot[torch.arange(len(cands)), torch.tensor(cands)] = 1.0
            probs = torch.cat([chain.probs, onehot])
        feats = torch.cat([chain.features, self.features[n:n + 1].expand(len(cands), -1)])
        return DraftProposal(chain.tokens + cands, probs, feats, None,
                             list(range(-1, n - 1)) + [n - 1] * len(cands))

    @staticmethod
    def empty() -> "DraftProposal":
        return DraftProposal([], None, torch.zeros(0, NUM_FEATURES))


def distribution_features(probs: torch.Tensor, start_position: int = 1) -> torch.Tensor:
    """Predictor features of draft distributions (ACL 2025 context-aware drafting, §3).

    Args:
        probs: ``[n, vocab]`` draft probabilities at n consecutive draft positions.
        start_position: 1-based draft position of the first row.

    Returns:
        ``[n, NUM_FEATURES]``: entropy (nats), top-1 probability, top-1 minus top-2, position.
    """
    n = probs.shape[0]
    p = probs.float()
    entropy = -(p * p.clamp_min(1e-20).log()).sum(-1)
    top2 = p.topk(min(2, p.shape[-1]), dim=-1).values
    top1 = top2[:, 0]
    second = top2[:, 1] if top2.shape[1] > 1 else torch.zeros_like(top1)
    pos = torch.arange(start_position, start_position + n, dtype=torch.float32, device=p.device)
    return torch.stack([entropy, top1, top1 - second, pos], dim=-1).cpu()


def one_hot_features(n: int) -> torch.Tensor:
    """Features of a deterministic drafter's n positions (q one-hot: entropy 0, top-1 1)."""
    pos = torch.arange(1, n + 1, dtype=torch.float32)
    return torch.stack([torch.zeros(n), torch.ones(n), torch.ones(n), pos], dim=-1)


class Drafter(ABC):
    """Proposes draft tokens; see the module docstring for the sync contract."""

    name: str = "drafter"

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """One proposal per request, in order. Requests with ``max_draft == 0`` get an empty one."""

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` finished or was aborted: drop its state."""

    def prefetch(self, requests: list[DraftRequest]) -> None:
        """Optional overlap: start drafting the next round while this round is being verified.

        Each request's ``token_ids`` is the sequence as it will be if every draft of this round is
        accepted (without the bonus token, which is not known yet); ``max_draft`` counts a guess of
        the bonus token plus the next round's drafts. A drafter that can work in the background
        (a remote one) may use the result in the next ``propose`` where the guess came true. The
        default does nothing.
        """
