"""Drafter interface: propose draft tokens for running sequences.

A drafter is told each round, per running sequence, the full token sequence so far (prompt +
accepted output; its last token is the one the target has not consumed yet) and how many draft
tokens it may propose. Drafters that keep state (a draft model's KV cache) sync to that sequence
themselves: whatever they cached beyond the longest common prefix was rejected and is rolled back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..models.weights import weights_file  # noqa: F401 (the CLI imports it from here)
from ..sampling import SamplingParams, sampling_probs

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
        scores: ``[len(tokens)]`` float32 predicted acceptance probabilities when the drafter
            scored its own drafts (a drafter service with a predictor), else None (the engine's
            draft policy scores the features).
        states: ``[len(tokens), d]`` float32 drafter hidden states at each draft position (the
            SpecFormer head's normed draft-slot states, what its LM head reads), recorded only
            when the drafter is asked to (``SpecFormerDrafter.record_states``: verification logs
            for a predictor that reads them); else None.
    """

    tokens: list[int]
    probs: torch.Tensor | None
    features: torch.Tensor
    top_tokens: torch.Tensor | None = None
    parents: list[int] | None = None
    scores: torch.Tensor | None = None
    states: torch.Tensor | None = None

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
                             None if self.top_tokens is None else self.top_tokens[:n],
                             scores=None if self.scores is None else self.scores[:n],
                             states=None if self.states is None else self.states[:n])

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
        states = None if self.states is None else torch.cat([chain.states, self.states[n:n + 1].expand(len(cands), -1)])
        return DraftProposal(chain.tokens + cands, probs, feats, None,
                             list(range(-1, n - 1)) + [n - 1] * len(cands), states=states)

    @staticmethod
    def empty() -> "DraftProposal":
        return DraftProposal([], None, torch.zeros(0, NUM_FEATURES))

    @staticmethod
    def concat(parts: list["DraftProposal"]) -> "DraftProposal":
        """Chain proposals drawn position by position into one (all deterministic or all sampled)."""
        if not parts:
            return DraftProposal.empty()
        probs = None if parts[0].probs is None else torch.cat([p.probs for p in parts])
        tops = None if any(p.top_tokens is None for p in parts) else torch.cat([p.top_tokens for p in parts])
        states = None if any(p.states is None for p in parts) else torch.cat([p.states for p in parts])
        return DraftProposal([t for p in parts for t in p.tokens], probs, torch.cat([p.features for p in parts]), tops,
                             states=states)


def device_features(probs: torch.Tensor, start_position: int | torch.Tensor = 1) -> torch.Tensor:
    """``distribution_features`` on ``probs``' device (no host transfer: CUDA graphs can capture it)."""
    n = probs.shape[0]
    p = probs.float()
    entropy = -(p * p.clamp_min(1e-20).log()).sum(-1)
    top2 = p.topk(min(2, p.shape[-1]), dim=-1).values
    top1 = top2[:, 0]
    second = top2[:, 1] if top2.shape[1] > 1 else torch.zeros_like(top1)
    if isinstance(start_position, torch.Tensor):
        pos = start_position.to(device=p.device, dtype=torch.float32)
    else:
        pos = torch.arange(start_position, start_position + n, dtype=torch.float32, device=p.device)
    return torch.stack([entropy, top1, top1 - second, pos], dim=-1)


def distribution_features(probs: torch.Tensor, start_position: int | torch.Tensor = 1) -> torch.Tensor:
    """Predictor features of draft distributions (ACL 2025 context-aware drafting, §3).

    Args:
        probs: ``[n, vocab]`` draft probabilities at n consecutive draft positions.
        start_position: 1-based draft position of the first row, or an ``[n]`` float tensor with
            every row's position.

    Returns:
        ``[n, NUM_FEATURES]`` on the CPU: entropy (nats), top-1 probability, top-1 minus top-2,
        position.
    """
    return device_features(probs, start_position).cpu()


@dataclass
class DraftRows:
    """Draft tokens drawn from ``R`` rows of draft logits in one batched pass.

    Attributes:
        tokens: ``R`` token ids.
        features: ``[R, NUM_FEATURES]`` float32 (CPU) predictor features.
        top_tokens: ``[R, m]`` int64 (CPU) most likely tokens per row.
        probs: row -> ``[vocab]`` q the token was drawn from, for sampled rows only.
    """

    tokens: list[int]
    features: torch.Tensor
    top_tokens: torch.Tensor
    probs: dict[int, torch.Tensor]

    def proposal(self, rows: list[int]) -> DraftProposal:
        """The drafts of these rows (one request's consecutive positions) as a proposal."""
        if not rows:
            return DraftProposal.empty()
        sampled = rows[0] in self.probs
        probs = torch.stack([self.probs[r] for r in rows]) if sampled else None
        idx = torch.tensor(rows)
        return DraftProposal([self.tokens[r] for r in rows], probs, self.features[idx], self.top_tokens[idx])


def draft_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
               positions: Sequence[int], top_m: int = 4) -> DraftRows:
    """Draw one draft token per row of draft logits, batched across requests and positions.

    Greedy rows take the argmax (their q is deterministic, so no probabilities are kept); sampled
    rows draw from q = the row's sampling transform of the logits (``tandem.sampling``, the same
    transform the target gets), kept for speculative sampling (Leviathan et al. 2023). Features
    (ACL 2025 context-aware drafting) come from softmax(logits) for greedy rows and from q for
    sampled rows. All small results reach the CPU in one transfer, whatever ``R``.

    Args:
        logits: ``[R, vocab]`` draft logits.
        params / generators: each row's request sampling parameters and random generator.
        positions: each row's 1-based draft position (a predictor feature).
        top_m: candidates kept per row (for hard-position branching).
    """
    R = logits.shape[0]
    q = logits.float().softmax(-1)
    sampled = [i for i in range(R) if not params[i].greedy]
    probs: dict[int, torch.Tensor] = {}
    tokens_dev = logits.argmax(-1)
    if sampled:
        dev = logits.device
        ps = [params[i] for i in sampled]
        qs = sampling_probs(logits[sampled], torch.tensor([p.temperature for p in ps], device=dev),
                            torch.tensor([p.top_k for p in ps], device=dev),
                            torch.tensor([p.top_p for p in ps], device=dev))
        q[sampled] = qs
        for j, i in enumerate(sampled):
            tokens_dev[i] = torch.multinomial(qs[j], 1, generator=generators[i])[0]
            probs[i] = qs[j]
    feats = device_features(q, torch.tensor(positions, dtype=torch.float32, device=q.device))
    tops = q.topk(min(top_m, q.shape[-1]), dim=-1).indices
    # one copy to the host for all three (ids are exact in float64)
    host = torch.cat([tokens_dev[:, None].double(), feats.double(), tops.double()], dim=1).cpu()
    return DraftRows(host[:, 0].long().tolist(), host[:, 1:1 + NUM_FEATURES].float(),
                     host[:, 1 + NUM_FEATURES:].long(), probs)


_ONE_HOT_FEATURES = torch.stack([torch.zeros(64), torch.ones(64), torch.ones(64),
                                 torch.arange(1, 65, dtype=torch.float32)], dim=-1)


def one_hot_features(n: int) -> torch.Tensor:
    """Features ``[n, 4]`` of a deterministic drafter's n positions (q one-hot: entropy 0, top-1
    1, margin 1, position 1..n). A read-only view of one shared table for n <= 64 (this runs per
    request per round)."""
    if n <= _ONE_HOT_FEATURES.shape[0]:
        return _ONE_HOT_FEATURES[:n]
    pos = torch.arange(1, n + 1, dtype=torch.float32)
    return torch.stack([torch.zeros(n), torch.ones(n), torch.ones(n), pos], dim=-1)


@dataclass
class TargetStates:
    """Tapped target states of newly accepted positions of one sequence.

    Attributes:
        slot: the sequence's KV cache slot.
        start: target position of the first row (the target's cache length before them).
        taps: ``[m, len(taps), d]`` states at positions ``start .. start + m - 1``.
        next_tokens: the ``m`` tokens at positions ``start + 1 .. start + m``, i.e. each row's next
            token; the last is this round's bonus token (the target has not consumed it yet).
            Needed by ``bonus_token`` and ``context_next_token`` heads. A ``[m]`` int64 tensor on
            the taps' device after a prefill (its last token is the prefill's first generated
            token, which the host has not read yet), a list of ints after a host-drafted round.
    """

    slot: int
    start: int
    taps: torch.Tensor
    next_tokens: Sequence[int] | torch.Tensor | None = None


@dataclass(frozen=True)
class VerifiedStep:
    """A chained round's verification, on the device, for drafters that draft from the verify pass
    (``Drafter.drafts_from_verify``); row = KV slot, rows ``0 .. n-1`` of the step's batch bucket.

    Attributes:
        start: ``[n]`` int64, tokens each slot's cache held before the round.
        taps: ``[n, Q, len(taps), d]`` the step's tapped target states (row j: the j-th input).
        num_accepted: ``[n]`` int64 accepted drafts.
        tokens: ``[n, Q]`` int64 emitted tokens (the first ``num_accepted + 1``: row j's next token).
        keep: ``[n]`` bool, the rows that ran this round (others are idle rows of the bucket).
        attn_len: the step's attended context length (>= every kept row's new length + 1).
        state: the target's round state after the round (``tandem.target.RoundState``: ``length``,
            ``last``, ``history``), updated already.
        sampling: rows ``0 .. n-1``'s settings (``tandem.verify.RowSampling``).
    """

    start: torch.Tensor
    taps: torch.Tensor
    num_accepted: torch.Tensor
    tokens: torch.Tensor
    keep: torch.Tensor
    attn_len: int
    state: object
    sampling: object


def chained_draft_features(x: torch.Tensor, pos: torch.Tensor, probs: bool, fused: bool) -> torch.Tensor:
    """Predictor features ``[R, NUM_FEATURES]`` of a chained round's draft distributions: of
    softmax(``x``) for draft logits ``x`` ``[R, V]``, or of ``x`` itself with ``probs`` (a
    sampling transform's q); ``pos`` ``[R]`` the 1-based draft positions. One fused kernel a call
    with ``fused`` (``kernels.draft_features``), the same definition in plain ops otherwise
    (``device_features``, what the host path's ``draft_rows`` computes)."""
    if fused:
        from ..models import kernels

        return kernels.draft_features(x, pos, probs=probs)
    return device_features(x if probs else x.float().softmax(-1), pos)


class BufferedDrafts:
    """Mixed into drafters whose chained rounds draft inside the round before the one that
    verifies the drafts (``Drafter.drafts_from_verify``: SpecFormer, the draft model): the next
    round reads them from device buffers the drafter keeps, ``_draft_tokens`` ``[slots, L]``,
    ``_draft_lens`` ``[slots]``, ``_draft_q`` ``[slots, L, V]`` (sampled requests' q; None until
    one drafted) and, with a scorer (``_scorer``, set by ``set_acceptance_scorer``),
    ``_draft_scores`` ``[slots, L]``."""

    _draft_tokens: torch.Tensor
    _draft_lens: torch.Tensor
    _draft_q: torch.Tensor | None = None
    _scorer = None
    _draft_scores: torch.Tensor | None = None

    def device_drafts(self, history: torch.Tensor, last: torch.Tensor, room: torch.Tensor,
                      k: int, score_room: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts the previous chained round (or the slot's priming) left for rows ``0 ..
        n-1``: ``[n, k]`` tokens (zero-padded past the buffer's width) and ``[n]`` lengths, at
        most ``room`` each (``history``, ``last`` and ``score_room`` are not read: the drafting
        and scoring happened in the previous round). Device work only."""
        n = room.shape[0]
        out = self._draft_tokens[:n, :k]
        if out.shape[1] < k:
            out = torch.cat([out, out.new_zeros(n, k - out.shape[1])], dim=1)
        return out, torch.minimum(room, self._draft_lens[:n])

    def device_draft_probs(self, n: int, k: int) -> torch.Tensor | None:
        """``[n, k, V]`` q of rows ``0 .. n-1``'s device drafts (zeros past the buffer's width;
        greedy rows' are not read), or None before any sampled request drafted."""
        q = self._draft_q
        if q is None:
            return None
        q = q[:n, :k]
        return q if q.shape[1] == k else torch.cat([q, q.new_zeros(n, k - q.shape[1], q.shape[2])], dim=1)

    @property
    def scores_on_device(self) -> bool:
        """Chained rounds score the drafts they make (``set_acceptance_scorer``)."""
        return self._scorer is not None

    def device_draft_scores(self, n: int) -> torch.Tensor | None:
        """``[n, L]`` float32 predicted acceptance of rows ``0 .. n-1``'s device drafts, or None
        without a scorer."""
        return None if self._draft_scores is None else self._draft_scores[:n]


# ``keep_drafting(slots, features) -> [bool]``: called with the ``[n, NUM_FEATURES]`` features of
# the position just drafted for the sequences in ``slots``; False = stop drafting that sequence.
KeepDrafting = Callable[[list[int], torch.Tensor], list[bool]]


class Drafter(ABC):
    """Proposes draft tokens; see the module docstring for the sync contract."""

    name: str = "drafter"
    # Residual-stream depths of the target this drafter reads (SpecFormer); empty for drafters
    # that only see token ids. Non-empty: the engine taps the target, calls ``bind`` once and
    # ``observe`` after every prefill and verification.
    target_taps: tuple[int, ...] = ()
    # Drafts on the device (``device_drafts``): the engine then queues each round before the
    # previous one is back (chained rounds) and never calls propose.
    drafts_on_device: bool = False
    # Its device drafts come from the verify pass itself (SpecFormer): ``device_after_verify`` runs
    # in every chained round, after verification, and leaves the next round's drafts on the device.
    drafts_from_verify: bool = False
    # Drafts per sequence per round at most (None: as many as asked; a SpecFormer head: its l_d):
    # the engine caps k with it.
    max_draft_tokens: int | None = None
    # Overrides ``prefetch`` with real work (a remote drafter): the engine then calls it each round.
    prefetches: bool = False
    # Drafts a chained round scores per row where it makes them (``device_drafts`` with a scorer:
    # n-gram, the policy's k); 0 for drafters that score elsewhere or not at all.
    score_width: int = 0

    @abstractmethod
    def propose(self, requests: list[DraftRequest], keep_drafting: KeepDrafting | None = None) -> list[DraftProposal]:
        """One proposal per request, in order. Requests with ``max_draft == 0`` get an empty one.

        Args:
            keep_drafting: this round's adaptive-length rule ("draft while the predicted acceptance
                is at least θ", the context-aware paper; ``DraftPolicy.begin_round``), or None.
                Drafters that draft position by position (the draft model) call it after each
                position and stop drafting the sequences it answers False for, saving the draft
                steps; the others may ignore it (the policy cuts their drafts afterwards).
        """

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` finished or was aborted: drop its state."""

    def device_drafts(self, history: torch.Tensor, last: torch.Tensor, room: torch.Tensor,
                      k: int, score_room: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts of a batch computed on the device (drafters with ``drafts_on_device``): what
        ``propose`` would draft, as device work only (no host reads; it is queued before the
        previous round's results are known).

        Args:
            history: ``[B, C]`` int64, row b's sequence is ``history[b, :last[b] + 1]``.
            last: ``[B]`` int64 index of each row's last token; room: ``[B]`` int64 drafts allowed.
            k: width of the result (>= every ``room``).
            score_room: ``[B]`` int64 drafts each row could verify at the policy's full width (a
                drafter that scores the drafts it makes here scores that many; None: no scoring).

        Returns:
            ``(tokens [B, k] int64, lens [B] int64)``, deterministic drafts (q one-hot).
        """
        raise NotImplementedError(f"the {self.name} drafter does not draft on the device")

    def device_draft_probs(self, n: int, k: int) -> torch.Tensor | None:
        """``[n, k, V]`` float32 q that rows ``0 .. n-1``'s device drafts were drawn from (for
        speculative sampling), or None when they are deterministic (q one-hot: the default)."""
        return None

    def set_acceptance_scorer(self, score, width: int = 0) -> None:
        """Score the drafts chained rounds make, on the device, with ``score`` (features ->
        acceptance probabilities; ``DraftPolicy.device_score``), ``width`` positions a row (the
        policy's k; a drafter with a width of its own, SpecFormer's l_d, keeps it). A drafter that
        cannot (the default) ignores it: ``scores_on_device`` stays False, and the engine keeps a policy that
        needs scores on host-drafted rounds."""

    @property
    def scores_on_device(self) -> bool:
        """Chained rounds leave the predicted acceptance of the drafts they make on the device
        (``device_draft_scores``); False by default."""
        return False

    def device_draft_scores(self, n: int) -> torch.Tensor | None:
        """``[n, L]`` float32 predicted acceptance of rows ``0 .. n-1``'s next device drafts, made
        by the chained round just queued (``scores_on_device`` drafters), or None."""
        return None

    def prepare_round(self, sampled: bool) -> None:
        """Called before a chained round is queued (``sampled``: some request of it samples):
        allocate any device buffer its device work needs, outside the round's graph capture
        (memory allocated and filled inside a capture would be refilled by every replay). The
        default does nothing."""

    def device_after_verify(self, step: VerifiedStep) -> None:
        """Device work after a chained round's verification (``drafts_from_verify`` drafters):
        read the verify pass, update the drafter's state and leave the next round's drafts where
        ``device_drafts`` finds them. Queues device work only, with no host synchronisation: it
        is captured in the round's CUDA graph. The default does nothing."""

    def set_draft_limit(self, k: int) -> None:
        """The engine's draft limit (k, ``Engine.configured_draft_limit``), given before each
        ``admit``: a drafter that drafts a chained round's tokens before the round that verifies
        them (the draft model, inside the previous round) drafts this many. The default ignores it."""

    def admit(self, prompts: dict[int, list[int]]) -> None:
        """Slots just prefilled, with their prompts (resumed output included), before their first
        chained round (``drafts_from_verify`` drafters without ``target_taps``: a draft model fills
        its own cache here, then ``device_prime`` drafts). The default does nothing."""

    def bind(self, runner) -> None:
        """Attach to the in-process target ``ModelRunner`` (drafters with ``target_taps`` only)."""

    def observe(self, states: list) -> None:
        """Newly accepted positions' tapped target states (``TargetStates``; ``target_taps`` only)."""

    def prefetch(self, requests: list[DraftRequest]) -> None:
        """Optional overlap: start drafting the next round while this round is being verified.

        Each request's ``token_ids`` is the sequence as it will be if every draft of this round is
        accepted (without the bonus token, which is not known yet); ``max_draft`` counts a guess of
        the bonus token plus the next round's drafts. A drafter that can work in the background
        (a remote one) may use the result in the next ``propose`` where the guess came true. The
        default does nothing.
        """


def common_prefix(held: Sequence[int], tokens: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of ``held`` (what a drafter or its mirror holds for a
    sequence) and ``tokens`` (the sequence now), at most ``limit``: how much of what is held
    survives a round (the rest were rejected drafts, or the slot now holds another sequence).
    The common case, ``tokens`` extending ``held``, is one list comparison."""
    n = min(len(held), len(tokens), len(tokens) if limit is None else limit)
    if list(held[:n]) == list(tokens[:n]):
        return n
    return next(i for i in range(n) if held[i] != tokens[i])


def sync_tokens(held: list[int], tokens: Sequence[int], limit: int | None = None) -> int:
    """Bring ``held`` to ``tokens``: cut it to their common prefix (``common_prefix``, at most
    ``limit``), then append the rest of ``tokens``. Returns the kept length n; the tokens to feed
    are ``tokens[n:]``."""
    n = common_prefix(held, tokens, limit)
    del held[n:]
    held.extend(tokens[n:])
    return n


def synced_index(indexes: dict, req: DraftRequest, new):
    """The token index kept for ``req.slot`` in ``indexes``, extended with the tokens ``req`` holds
    beyond it; rebuilt with ``new()`` when the slot's sequence is not an extension of what it
    indexed (the slot was reused). An index has ``tokens`` (a list) and ``extend(ids)``; only
    accepted tokens reach it, so it never rolls back."""
    index = indexes.get(req.slot)
    held = len(index.tokens) if index is not None else 0
    if index is None or common_prefix(index.tokens, req.token_ids) < held:
        index = indexes[req.slot] = new()
        held = 0
    index.extend(req.token_ids[held:])
    return index
