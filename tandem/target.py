"""The target side of speculative decoding, as the engine's scheduler sees it.

The engine decides *what* runs each round (admission, drafts, stop rules); a ``Target`` runs it:
prefill of new sequences (and their first token), and one verification step over
``[last token + drafts]`` of every running sequence, with verification (``tandem.verify``) and
the KV rollback of rejected drafts done next to the weights. ``LocalTarget`` is the in-process
implementation (model runner + KV cache); ``services.verifier`` serves one over gRPC and
``services.router`` reaches it through a client with the same interface, so the router *is*
the engine's scheduler with remote parts.

Slots are the target's KV cache slots: the engine allocates one per admitted request and frees
it when the request finishes or is aborted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from .drafters.base import DraftProposal
from .models.kv_cache import KVCache
from .models.runner import ModelRunner, RunnerConfig
from .models.weights import Checkpoint
from .sampling import SamplingParams, sampling_probs
from .verify import verify_batch


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
        generator: the request's random generator (sampled requests); a remote target creates
            its own from ``params.seed`` instead.
    """

    slot: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    return_logprobs: bool = False


@dataclass
class VerifyItem:
    """Verify one sequence's drafts: ``last_token`` (emitted, not yet in the cache) + ``proposal``."""

    slot: int
    last_token: int
    proposal: DraftProposal
    params: SamplingParams
    generator: torch.Generator | None = None
    return_logprobs: bool = False


@dataclass
class TargetResult:
    """What the target produced for one sequence.

    Attributes:
        tokens: after prefill, the first token; after verification, the accepted drafts then the
            bonus (or correction) token: ``num_accepted + 1`` tokens.
        num_accepted: accepted draft tokens (0 after prefill).
        logprobs: the target's log-probability (raw logits, before the sampling transform) of
            each token, when the item asked for them; else None.
        extras: optional tensors a drafter needs from the target (e.g. SpecFormer's context
            vectors), keyed by name; empty by default.
    """

    tokens: list[int]
    num_accepted: int = 0
    logprobs: list[float] | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


class Target(ABC):
    """Prefill and verification over a slot-addressed KV cache (see the module docstring)."""

    @property
    @abstractmethod
    def info(self) -> TargetInfo:
        """Model name, vocabulary, slots and context limit."""

    @abstractmethod
    def num_free(self) -> int:
        """Free slots."""

    @abstractmethod
    def allocate(self) -> int:
        """Take the lowest free slot. Raises CacheFullError when none is free."""

    @abstractmethod
    def free(self, slot: int) -> None:
        """Release ``slot`` (its sequence finished or was aborted)."""

    @abstractmethod
    def prefill(self, items: list[PrefillItem]) -> list[TargetResult]:
        """Append every prompt to its slot and pick each first token (results in item order).

        Raises:
            CacheFullError: a prompt does not fit its slot. TargetUnavailable: remote failure.
        """

    @abstractmethod
    def verify(self, items: list[VerifyItem]) -> list[TargetResult]:
        """One batched forward over ``[last token + drafts]`` of every item, verification, and
        rollback of the rejected drafts' KV entries (results in item order).

        Raises:
            TargetUnavailable: remote failure.
        """


def sample_first_tokens(logits: torch.Tensor, params: list[SamplingParams],
                        generators: list[torch.Generator | None]) -> list[int]:
    """Next token per sequence from ``logits`` ``[n, vocab]``: argmax for greedy requests, else a
    draw from the request's sampling transform with its generator."""
    out = logits.argmax(dim=-1).tolist()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        dev = logits.device
        ps = [params[i] for i in sampled]
        probs = sampling_probs(
            logits[sampled],
            torch.tensor([p.temperature for p in ps], device=dev),
            torch.tensor([p.top_k for p in ps], device=dev),
            torch.tensor([p.top_p for p in ps], device=dev),
        )
        for row, i in enumerate(sampled):
            out[i] = int(torch.multinomial(probs[row], 1, generator=generators[i]))
    return out


class LocalTarget(Target):
    """The target model in this process: model runner, KV cache, ``tandem.verify``.

    Args:
        checkpoint: loaded target weights.
        config: runner settings (device, dtype, slots, context limit).
        name: model name reported in ``info`` (default: the checkpoint path).
    """

    def __init__(self, checkpoint: Checkpoint, config: RunnerConfig, name: str | None = None) -> None:
        self.checkpoint = checkpoint
        self.runner = ModelRunner(checkpoint, config)
        self._info = TargetInfo(name or str(checkpoint.path), checkpoint.config.vocab_size, self.cache.num_slots,
                                self.cache.capacity, str(self.runner.device))

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    @property
    def info(self) -> TargetInfo:
        return self._info

    def num_free(self) -> int:
        return self.cache.num_free()

    def allocate(self) -> int:
        return self.cache.allocate()

    def free(self, slot: int) -> None:
        self.cache.free(slot)

    def prefill(self, items: list[PrefillItem]) -> list[TargetResult]:
        """See ``Target.prefill``; with a tapping runner (``RunnerConfig.taps``) each result's
        ``extras["taps"]`` holds the prompt's tapped states ``[len(prompt), len(taps), d]``."""
        order = sorted(range(len(items)), key=lambda i: items[i].slot)
        taps: dict[int, torch.Tensor] | None = {} if self.runner.config.taps else None
        prompts = {it.slot: it.prompt_ids for it in items}
        if self.runner.config.fixed_step_tokens:  # exact kernels: one prompt per forward (RunnerConfig)
            logits = torch.cat([self.runner.prefill({s: prompts[s]}, taps) for s in sorted(prompts)])
        else:
            logits = self.runner.prefill(prompts, taps)  # rows in ascending slot order
        firsts = sample_first_tokens(logits, [items[i].params for i in order], [items[i].generator for i in order])
        results: list[TargetResult | None] = [None] * len(items)
        for row, (i, tok) in enumerate(zip(order, firsts)):
            lp = None
            if items[i].return_logprobs:
                lp = [float(logits[row].float().log_softmax(-1)[tok])]
            results[i] = TargetResult([tok], logprobs=lp, extras={"taps": taps[items[i].slot]} if taps else {})
        return results  # type: ignore[return-value]

    def verify(self, items: list[VerifyItem]) -> list[TargetResult]:
        """See ``Target.verify``; with a tapping runner each result's ``extras["taps"]`` holds the
        tapped states ``[num_accepted + 1, len(taps), d]`` of the positions it keeps (the last
        token and the accepted drafts): what a SpecFormer head drafts the next round from."""
        slots = [it.slot for it in items]
        props = [it.proposal for it in items]
        lengths = [self.cache.lengths[s] for s in slots]
        trees = {it.slot: [-1] + [x + 1 for x in it.proposal.parents] for it in items if it.proposal.parents is not None}
        out = self.runner.step({it.slot: [it.last_token] + it.proposal.tokens for it in items}, trees or None)
        results = verify_batch([p.tokens for p in props], [p.probs for p in props], [it.params for it in items],
                               [it.generator for it in items], out.logits, out.argmax, slots,
                               [p.parents for p in props] if trees else None)
        for slot, length, res in zip(slots, lengths, results):
            if res.path:  # token tree: move the accepted branch's K/V to consecutive positions
                moves = [(length + 1 + i, length + d) for d, i in enumerate(res.path, start=1) if i + 1 != d]
                self.cache.move(slot, [a for a, _ in moves], [b for _, b in moves])
            self.cache.truncate(slot, length + 1 + res.num_accepted)  # drop rejected drafts' KV
        kept = [[0] + ([1 + i for i in res.path] if res.path else list(range(1, res.num_accepted + 1)))
                for res in results]  # step rows whose tokens stay in the cache
        taps: list[dict[str, torch.Tensor]] = [{} for _ in items]
        if out.taps is not None:  # one gather for every sequence
            gathered = out.taps[torch.tensor([s for s, rows in zip(slots, kept) for _ in rows]),
                                torch.tensor([r for rows in kept for r in rows])]
            taps = [{"taps": t} for t in gathered.split([len(rows) for rows in kept])]
        outs = []
        for it, res, extras, rows in zip(items, results, taps, kept):
            lp = None
            if it.return_logprobs:  # row j of the forward predicts the token after the j-th input
                logp = out.logits[it.slot, rows].float().log_softmax(-1)
                lp = logp.gather(-1, torch.tensor(res.tokens, device=logp.device)[:, None])[:, 0].tolist()
            outs.append(TargetResult(list(res.tokens), res.num_accepted, lp, extras))
        return outs
