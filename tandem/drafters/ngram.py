"""N-gram drafter: prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` speculator).

Proposes what followed an earlier occurrence of the sequence's last n tokens (prompt and
generated text), by the one prompt-lookup rule of ``tandem.drafters.lookup``: on the host through
a ``LookupIndex`` per sequence, on the device through ``lookup_drafts`` over the target's token
history (chained rounds: a round's drafts are ready without the host;
``tandem.target.LocalTarget.launch_chained``). q is one-hot, so speculative sampling accepts draft
token x with probability p(x).

The acceptance predictor's features of a draft come from the evidence behind it, not from q (one-hot
says nothing): how many earlier occurrences of the matched n-gram agree with the drafts so far and
continue with this one (``lookup.support_features``). With a scorer (``set_acceptance_scorer``)
chained rounds score their drafts on the device, over the policy's full width whatever the
round's own width, so a context-aware policy can set the widths of n-gram rounds without the host.
"""

from __future__ import annotations

import torch

from .base import DraftProposal, DraftRequest, Drafter, KeepDrafting, synced_index
from .lookup import MAX_N, MIN_N, LookupIndex, check_sizes, lookup_drafts, lookup_drafts_with_support, support_features


class NgramDrafter(Drafter):
    """Prompt-lookup drafter. Keeps one ``LookupIndex`` per KV slot, extended with the tokens
    accepted since the previous round (rebuilt if the slot's sequence is not an extension of
    what it indexed, e.g. after the slot was reused); nothing to roll back, since only accepted
    tokens are ever indexed.

    Args:
        max_n, min_n: n-gram sizes to match, longest first (1 <= min_n <= max_n).
        top_m: candidates per position for hard-position branching (host-drafted rounds): the
            draft, then the other continuations of the earlier occurrences that agree with the
            drafts before it, most frequent first (``LookupIndex.lookup_with_support``).

    Raises:
        ValueError: bad n-gram sizes.
    """

    name = "ngram"
    drafts_on_device = True  # ``device_drafts``: chained rounds draft without the host

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N, top_m: int = 4) -> None:
        check_sizes(max_n, min_n)
        self.max_n, self.min_n, self.top_m = max_n, min_n, top_m
        self._index: dict[int, LookupIndex] = {}
        self._scorer = None  # features [N, 4] -> acceptance [N] on the device (set_acceptance_scorer)
        self.score_width = 0  # drafts a chained round scores per row (the policy's k)
        self._scores: torch.Tensor | None = None  # [B, score_width] of the round being queued

    def release(self, slot: int) -> None:
        self._index.pop(slot, None)

    def device_drafts(self, history: torch.Tensor, last: torch.Tensor, room: torch.Tensor,
                      k: int, score_room: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``propose``'s drafts computed on the device from the target's token history
        (``lookup_drafts``: the same rule, the same tokens); ``[B, k]`` ids (0 past each row's
        length) and ``[B]`` lengths.

        With a scorer and ``score_room`` (``[B]``: the drafts each row could verify at the policy's
        full width), the lookup runs at that room and every position up to ``score_width`` is
        scored (``device_draft_scores``); the round's drafts are the first ``room`` of that
        continuation (the occurrence is chosen for the full width)."""
        if self._scorer is None or score_room is None:
            cont, lens, _ = lookup_drafts(history, last, room, k, self.max_n, self.min_n)
            return cont.clamp(min=0), lens
        width = max(k, self.score_width)
        cont, full, _, support, survivors = lookup_drafts_with_support(history, last, score_room, width,
                                                                       self.max_n, self.min_n)
        B = cont.shape[0]
        j = torch.arange(1, width + 1, device=cont.device)
        feats = support_features(support, survivors, j[None, :].expand(B, -1))
        scores = self._scorer(feats.reshape(-1, feats.shape[-1])).reshape(B, width).float()
        self._scores = torch.where(j[None, :] <= full[:, None], scores, torch.zeros_like(scores))
        return cont[:, :k].clamp(min=0), torch.minimum(full, room)

    def set_acceptance_scorer(self, score, width: int = 0) -> None:
        """Score the drafts of chained rounds on the device with ``score`` (features ``[N, 4]``
        from ``support_features`` -> acceptance ``[N]``; ``DraftPolicy.device_score``), ``width``
        positions a row (the policy's k): ``device_draft_scores``. None turns it off."""
        self._scorer, self.score_width = score, int(width)

    @property
    def scores_on_device(self) -> bool:
        return self._scorer is not None

    def device_draft_scores(self, n: int) -> torch.Tensor | None:
        """``[n, score_width]`` predicted acceptance of the drafts of the chained round being
        queued (0 past each row's continuation); read in the same round (its epilogue packs
        them), so the tensor is that round's own."""
        return None if self._scorer is None or self._scores is None else self._scores[:n]

    def _synced(self, req: DraftRequest) -> LookupIndex:
        return synced_index(self._index, req, lambda: LookupIndex(self.max_n, self.min_n))

    def propose(self, requests: list[DraftRequest], keep_drafting: KeepDrafting | None = None) -> list[DraftProposal]:
        out = []
        for req in requests:
            if req.max_draft <= 0 or len(req.token_ids) < 2:
                out.append(DraftProposal.empty())
                continue
            toks, _, support, survivors, cands = self._synced(req).lookup_with_support(req.max_draft, self.top_m)
            if not toks:
                out.append(DraftProposal.empty())
                continue
            feats = support_features(torch.tensor(support), torch.tensor(survivors), torch.arange(1, len(toks) + 1))
            out.append(DraftProposal(toks, None, feats, torch.tensor(cands, dtype=torch.int64)))
        return out
