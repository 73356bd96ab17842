"""What crosses between the engine's scheduler and a ``tandem.target.Target``: the work items of
a round (prefill, verify, chained), the results, and what the scheduler must know of the target.
Plain data, shared by the in-process target, the verifier service and its client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .drafters.base import DraftProposal
from .sampling import SamplingParams


class TargetUnavailable(RuntimeError):
    """The target (a remote verifier) cannot serve: its requests fail, others are unaffected."""


@dataclass(frozen=True)
class TargetInfo:
    """What the scheduler must know about a target.

    Attributes:
        model: the model's name (path or id) as clients see it.
        vocab_size: token ids are in ``[0, vocab_size)``.
        num_slots: sequences that can run at once (KV cache slots).
        max_seq_len: tokens per slot (prompt + output), the context limit.
        device: where per-request random generators live (the verifier's device).
    """

    model: str
    vocab_size: int
    num_slots: int
    max_seq_len: int
    device: str = "cpu"


@dataclass
class PrefillItem:
    """Admit one sequence: append its prompt to ``slot`` and pick its first token.

    Attributes:
        params: the request's sampling parameters; a sampled request's random numbers are keyed
            by ``params.seed`` (``tandem.sampling.counter_uniform``; the engine gives every sampled
            request a seed, and a target draws one for a request that comes without).
    """

    slot: int
    prompt_ids: list[int]
    params: SamplingParams
    return_logprobs: bool = False
    top_logprobs: int = 0  # also the top_logprobs most likely tokens at each position (<= MAX_TOP_LOGPROBS)
    stop_ids: tuple[int, ...] = ()  # the ids that end it (EOS, stop token ids): masked before params.min_tokens
    allowed: torch.Tensor | None = None  # [1, words] int32 grammar bitmask of the first token (structured output)
    resumed: int = 0  # the prompt's last tokens are output emitted elsewhere (they count for the penalties)


@dataclass
class VerifyItem:
    """Verify one sequence's drafts: ``last_token`` (emitted, not yet in the cache) + ``proposal``.
    ``params`` must be the ones its slot was prefilled with."""

    slot: int
    last_token: int
    proposal: DraftProposal
    params: SamplingParams
    return_logprobs: bool = False
    top_logprobs: int = 0
    # [len(proposal.tokens) + 1, words] int32 grammar bitmask of each verified position (structured output)
    allowed: torch.Tensor | None = None


class ChainedItem(NamedTuple):
    """One sequence of a chained round (``Target.launch_chained``): its last token and position
    come from the target's device state, so only the slot and what to return are named. (A
    named tuple: the engine makes one per running request per round.)"""

    slot: int
    return_logprobs: bool = False
    max_draft: int = 0  # drafts allowed at most (the device also applies the token and context limits)
    top_logprobs: int = 0


@dataclass
class TargetResult:
    """What the target produced for one sequence.

    Attributes:
        tokens: after prefill, the first token; after verification, the accepted drafts then the
            bonus (or correction) token: ``num_accepted + 1`` tokens.
        num_accepted: accepted draft tokens (0 after prefill).
        logprobs: the target's log-probability (raw logits, before the sampling transform) of
            each token, when the item asked for them; else None.
        top_logprobs: per token, the item's ``top_logprobs`` most likely tokens at its position
            as ``(token id, log-probability)`` pairs, most likely first (raw logits, as
            ``logprobs``), when the item asked for them; else None.
        extras: optional tensors a drafter needs from the target (e.g. SpecFormer's context
            vectors), keyed by name; empty by default.
        num_drafts: drafts verified, when the target drafted them itself (chained rounds); None
            when they came with the item.
        draft_scores: predicted acceptance of the drafts the round left on the device for this
            sequence's next round (chained rounds of a drafter that scores its drafts,
            ``Drafter.scores_on_device``); None otherwise.
    """

    tokens: list[int]
    num_accepted: int = 0
    logprobs: list[float] | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    num_drafts: int | None = None
    draft_scores: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class PrefillHandle:
    """A prefill between ``Target.launch_prefill`` and ``collect_prefill``: ``extras`` per item
    (e.g. the prompt's tapped states, on the device) and the target's own ``payload``; for one
    that overlaps the rounds (``launch_prefill(..., overlap=True)``), what ``prefill_ready`` polls
    (``ready``: a CUDA event) and what ``join_prefill`` still writes (``admit``; None once joined)."""

    extras: list[dict[str, torch.Tensor]]
    payload: object
    ready: object = None
    admit: tuple | None = None
