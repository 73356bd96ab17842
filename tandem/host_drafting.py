"""Host-side drafting for a round whose drafts reach the host (``Engine`` rounds that are not
chained on the device): the draft asks, the drafter call with its faults contained, malformed
proposals dropped, the draft policy's allocation, and the remote drafter's prefetch.

A drafter that fails, or returns proposals of the wrong number, shape or vocabulary, costs this
round its drafts (decoded target-only), never output: speculative decoding stays lossless.
"""

from __future__ import annotations

import logging

from .drafters.base import DraftProposal, DraftRequest
from .requests import Request
from .stopping import draft_room
from .telemetry import span

log = logging.getLogger(__name__)


class HostDrafting:
    """Mixed into ``tandem.engine.Engine``: reads its ``drafter``, ``draft_policy``,
    ``draft_limit``, ``max_seq_len`` and ``target``."""

    def _draft_room(self, r: Request, num_tokens: int) -> int:
        """Draft tokens a request may get in a round that starts with ``num_tokens`` output tokens
        (the last one not yet in the cache): ``tandem.stopping.draft_room``."""
        return draft_room(self.draft_limit, self.max_seq_len, len(r.prompt_ids), num_tokens, r.output.max_new_tokens)

    def _prefetch(self, reqs: list[Request], proposals: list[DraftProposal]) -> None:
        """Let the drafter draft the next round on the assumption that every draft of this one is
        accepted, while the target verifies (``Drafter.prefetch``). Token trees are skipped."""
        asks = []
        for r, p in zip(reqs, proposals):
            if p.parents is not None:
                continue
            room = self._draft_room(r, r.num_tokens + len(p.tokens) + 1)  # after full acceptance + the bonus
            if room > 0:
                asks.append(DraftRequest(r.slot, r.prompt_ids + r.token_ids + p.tokens, room + 1, r.params,
                                         r.generator))
        if asks:
            try:
                self.drafter.prefetch(asks)
            except Exception:  # an optimisation only: never fatal
                log.exception("drafter %s failed to prefetch", self.drafter.name)

    def _propose(self, reqs: list[Request]) -> list[DraftProposal]:
        if self.drafter is None:
            return [DraftProposal.empty() for _ in reqs]
        with span("draft", batch_size=len(reqs), drafter=self.drafter.name):
            return self._collect_proposals(reqs)

    def _collect_proposals(self, reqs: list[Request]) -> list[DraftProposal]:
        asks = [DraftRequest(r.slot, r.prompt_ids + r.token_ids, max(self._draft_room(r, r.num_tokens), 0), r.params,
                             r.generator) for r in reqs]
        # adaptive length: a drafter that drafts position by position stops where θ says (the policy's rule)
        rule = self.draft_policy.begin_round() if self.draft_policy is not None else None
        try:
            proposals = self.drafter.propose(asks, rule)
        except Exception:  # a failing drafter costs speed, never output: decode target-only this round
            log.exception("drafter %s failed; decoding this round without drafts", self.drafter.name)
            return [DraftProposal.empty() for _ in reqs]
        if len(proposals) != len(asks):
            log.error("drafter %s returned %d proposals for %d requests; decoding this round without drafts",
                      self.drafter.name, len(proposals), len(asks))
            return [DraftProposal.empty() for _ in reqs]
        vocab = self.target.info.vocab_size

        def usable(p: DraftProposal, a: DraftRequest) -> bool:  # malformed drafter output is dropped, not fatal
            n = len(p.tokens)
            return (n <= a.max_draft and all(0 <= t < vocab for t in p.tokens)
                    and (p.probs is None or tuple(p.probs.shape) == (n, vocab)))

        proposals = [p if usable(p, a) else DraftProposal.empty() for p, a in zip(proposals, asks)]
        if self.draft_policy is not None:
            with span("allocate", batch_size=len(reqs)):
                proposals = self.draft_policy.apply(proposals, [r.slot for r in reqs])
        return proposals
