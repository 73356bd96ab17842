"""N-gram drafter: prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` speculator).

Proposes what followed an earlier occurrence of the sequence's last n tokens (prompt and
generated text), by the one prompt-lookup rule of ``tandem.drafters.lookup``: on the host through
a ``LookupIndex`` per sequence, on the device through ``lookup_drafts`` over the target's token
history (chained rounds: a round's drafts are ready without the host;
``tandem.target.LocalTarget.launch_chained``). q is one-hot, so speculative sampling accepts draft
token x with probability p(x).
"""

from __future__ import annotations

import torch

from .base import DraftProposal, DraftRequest, Drafter, KeepDrafting, one_hot_features, synced_index
from .lookup import MAX_N, MIN_N, LookupIndex, check_sizes, lookup_drafts


class NgramDrafter(Drafter):
    """Prompt-lookup drafter. Keeps one ``LookupIndex`` per KV slot, extended with the tokens
    accepted since the previous round (rebuilt if the slot's sequence is not an extension of
    what it indexed, e.g. after the slot was reused); nothing to roll back, since only accepted
    tokens are ever indexed.

    Args:
        max_n, min_n: n-gram sizes to match, longest first (1 <= min_n <= max_n).

    Raises:
        ValueError: bad n-gram sizes.
    """

    name = "ngram"
    drafts_on_device = True  # ``device_drafts``: chained rounds draft without the host

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N) -> None:
        check_sizes(max_n, min_n)
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[int, LookupIndex] = {}

    def release(self, slot: int) -> None:
        self._index.pop(slot, None)

    def device_drafts(self, history: torch.Tensor, last: torch.Tensor, room: torch.Tensor,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``propose``'s drafts computed on the device from the target's token history
        (``lookup_drafts``: the same rule, the same tokens); ``[B, k]`` ids (0 past each row's
        length) and ``[B]`` lengths."""
        cont, lens, _ = lookup_drafts(history, last, room, k, self.max_n, self.min_n)
        return cont.clamp(min=0), lens

    def _synced(self, req: DraftRequest) -> LookupIndex:
        return synced_index(self._index, req, lambda: LookupIndex(self.max_n, self.min_n))

    def propose(self, requests: list[DraftRequest], keep_drafting: KeepDrafting | None = None) -> list[DraftProposal]:
        out = []
        for req in requests:
            if req.max_draft <= 0 or len(req.token_ids) < 2:
                out.append(DraftProposal.empty())
                continue
            toks, _ = self._synced(req).lookup(req.max_draft)
            out.append(DraftProposal(toks, None, one_hot_features(len(toks))))
        return out
