"""The SpecFormer drafter's chained path: its work inside a round captured on the device.

After each verification the head reads the verify pass's tapped states of the accepted
positions, extends its context-attention cache and drafts the next round's l_d tokens (and, for
sampled requests, their q; with a scorer, their predicted acceptance) into device buffers the next
round reads: no host round trip between verify and draft (``device_after_verify``,
``device_prime``, ``device_drafts``, ``device_draft_probs``, ``device_draft_scores``).
Mixed into ``tandem.drafters.specformer.SpecFormerDrafter``, whose buffers and graphs it uses.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..models import kernels
from ..sampling import STREAM_DRAFT, counter_uniform, sample_inverse_cdf, sampling_probs
from .base import BufferedDrafts, VerifiedStep, chained_draft_features
from .lookup import lookup_drafts

# Attention backends for the drafter's attention calls while serving. Their shapes change from
# round to round (requests, accepted lengths, context buckets), and cuDNN attention builds an
# execution plan per new shape (tens of ms: the head's observe had a p99 of 51 ms at batch 1 before
# these backends; docs/benchmarks.md, "What changed the figures", a0fd552); these
# backends need no plan. MATH takes whatever the others cannot (e.g. GQA with a mask).
SERVING_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class ChainedHead(BufferedDrafts):
    """Mixed into ``SpecFormerDrafter``: reads its ``head``, ``_target``, ``_state``, caches,
    draft buffers and ``_replay``."""

    def set_acceptance_scorer(self, score, width: int = 0) -> None:
        """Score the drafts of chained rounds on the device: ``score`` maps predictor features
        ``[N, NUM_FEATURES]`` (``tandem.drafters.base.distribution_features`` of each draft's q:
        softmax of the draft logits for greedy requests, the sampling transform for sampled ones;
        position 1..l_d) to acceptance probabilities ``[N]`` on their device
        (``DraftPolicy.device_score``: ``AcceptancePredictor.probabilities`` or the entropy rule).
        Each round then leaves ``[slots, l_d]`` scores beside its drafts (``device_draft_scores``;
        ``width`` is not read: the head always drafts l_d). Call before ``bind``."""
        if self._target is not None:
            raise RuntimeError("set_acceptance_scorer after bind()")
        self._scorer = score

    @torch.inference_mode()
    @sdpa_kernel(SERVING_SDPA)
    def device_after_verify(self, step: VerifiedStep) -> None:
        """The head's work inside a chained round (the paper's design: the drafts come out of the
        pass that verifies): its context layers over each kept row's accepted positions (K/V into
        its cache, as ``observe``), then its draft part after the new last token, with the lookup
        continuation from the target's device history (``lookup_drafts``); greedy requests draft
        the argmax, sampled ones draw from q (the request's sampling transform of the draft
        logits) with ``counter_uniform(seed, position, STREAM_DRAFT)``. On CUDA one graph per
        (batch bucket, tokens per row, context, sampling flags)."""
        if self._target is None:
            raise RuntimeError("SpecFormerDrafter.device_after_verify before bind()")
        n, Q = step.tokens.shape
        sampling = step.sampling
        self._ensure_q(sampling.any_sampled)
        values = (step.start, step.taps, step.num_accepted, step.tokens, step.keep)

        def run(start, taps, num_accepted, tokens, keep):
            self._chained_rows(start, taps, num_accepted, tokens, keep, step.attn_len, step.state, sampling)

        # inside the target's capture of the round (the usual case) the work joins that graph
        if self._static and not (self.k_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
            key = ("chained", n, Q, step.attn_len, sampling.any_sampled, sampling.filtered)

            def fill(inputs):
                for buf, v in zip(inputs, values):
                    buf.copy_(v)

            self._replay(key, run, lambda: tuple(torch.empty_like(v) for v in values), fill)
            if self._static:  # else the capture failed (logged): from now on the head runs eagerly
                return
        run(*values)

    def _chained_rows(self, start: torch.Tensor, taps: torch.Tensor, num_accepted: torch.Tensor,
                      tokens: torch.Tensor, keep: torch.Tensor, attn_len: int, state, sampling) -> None:
        """``device_after_verify``'s device work (see ``VerifiedStep`` for the arguments)."""
        n = tokens.shape[0]
        q_lens = (num_accepted + 1) * keep
        packed = torch.cat([start[:, None], q_lens[:, None], self._slot_ids[:n, None], tokens], dim=1)
        h = self._observe_rows(taps.to(self._state.dtype), packed, attn_len, rows_are_slots=True)  # [n, d]
        state_rows = self._state[:n]
        torch.where(keep[:, None], h, state_rows, out=state_rows)  # in place: one launch, no copy
        self._draft_next(keep, state, sampling, attn_len + 1)

    @torch.inference_mode()
    def device_prime(self, keep: torch.Tensor, state, sampling, width: int) -> None:
        """Drafts for slots just prefilled (``keep`` ``[n]`` bool over rows ``0 .. n-1``), from the
        context states ``observe`` left, so their first chained round already verifies drafts.
        ``state``/``sampling`` as in ``VerifiedStep``; ``width`` > every kept row's length.

        With CUDA graphs and every slot's row (``n`` = slots), one graph per sampling flags
        replays it, captured at its first use (a warm-up's admissions, ``tandem.warmup``, meet the
        greedy one): its lookup reads each row's whole history (a row's continuation depends only
        on its tokens up to its last), so no shape depends on the prompts. Eagerly it is ~50
        launches of host work an admission."""
        self._ensure_q(sampling.any_sampled)
        if self._static and self.k_cache.is_cuda and keep.shape[0] == self._num_slots:
            full = state.history.shape[1] - 1  # the last column is scratch

            def fill(inputs):
                inputs[0].copy_(keep)

            self._replay(("prime", sampling.any_sampled, sampling.filtered, self._scorer is not None),
                         lambda k: self._draft_next(k, state, sampling, full),
                         lambda: (torch.zeros_like(keep),), fill)
            if self._static:  # else the capture failed (logged): from now on the head runs eagerly
                return
        self._draft_next(keep, state, sampling, width)

    def prepare_round(self, sampled: bool) -> None:
        """The q buffer before a sampled chained round is captured (``Drafter.prepare_round``)."""
        self._ensure_q(sampled)

    def _ensure_q(self, sampled: bool) -> None:
        """The q buffer, made when the first sampled request drafts (outside any graph capture)."""
        if sampled and self._draft_q is None:
            cfg = self.head.config
            self._draft_q = torch.zeros((self._num_slots, cfg.num_draft_tokens, cfg.vocab_size),
                                        dtype=torch.float32, device=self.k_cache.device)

    def _draft_next(self, keep: torch.Tensor, state, sampling, width: int) -> None:
        """The next round's drafts (and q) of the kept rows, from their context states and the
        lookup continuation of ``state.history[:, :width]``."""
        cfg = self.head.config
        n = keep.shape[0]
        ld = cfg.num_draft_tokens
        dev = keep.device
        ctx = self._state[:n]
        length = state.length[:n]  # the new last token sits at history[length]
        last = (length * keep).clamp(max=width - 1)
        if cfg.lookup_tokens:
            cont, _, match = lookup_drafts(state.history[:n, :width], last, self._full_room[:n], ld)
        else:
            cont, match = torch.full((n, ld), -1, dtype=torch.long, device=dev), torch.zeros_like(last)
        ids = torch.cat([cont, match[:, None], state.last[:n, None]], dim=1)
        logits = self._draft_rows(ctx, ids, float32=False)  # [n, ld, V]; sampling_probs upcasts
        drafts = kernels.row_argmax(logits) if self._fused else logits.argmax(-1)
        V = logits.shape[-1]
        q = None
        if sampling.any_sampled:
            rep = lambda t: t[:, None].expand(n, ld).reshape(-1)  # noqa: E731
            # the kept rows' q written into the q buffer in place (the others keep theirs; their
            # draws below are discarded with their drafts)
            q = sampling_probs(logits.reshape(n * ld, V), rep(sampling.temperature), rep(sampling.top_k),
                               rep(sampling.top_p), sampling.filtered, out=self._draft_q[:n].view(n * ld, V),
                               rows=rep(keep))
            u = counter_uniform(sampling.seed, length[:, None] + 1 + torch.arange(ld, device=dev)[None, :], STREAM_DRAFT)
            drawn = sample_inverse_cdf(q, u.reshape(-1)).view(n, ld)
            drafts = torch.where(sampling.greedy[:, None], drafts, drawn)
        if self._scorer is not None:  # the predictor's features of each draft's q, as draft_rows makes them
            pos = torch.arange(1, ld + 1, dtype=torch.float32, device=dev).repeat(n)
            feats = self._features(logits.reshape(n * ld, V), pos, probs=False)  # greedy rows: softmax(logits)
            if q is not None:  # sampled rows: their sampling transform q
                feats = torch.where(sampling.greedy[:, None].expand(n, ld).reshape(-1, 1), feats,
                                    self._features(q, pos, probs=True))
            scores = self._scorer(feats).view(n, ld)
            score_rows = self._draft_scores[:n]
            torch.where(keep[:, None], scores.float(), score_rows, out=score_rows)
        # the kept rows' drafts written in place (a where into its own input row by row, then no copy)
        token_rows = self._draft_tokens[:n]
        torch.where(keep[:, None], drafts, token_rows, out=token_rows)
        self._draft_lens[:n].masked_fill_(keep, ld)

    def _features(self, x: torch.Tensor, pos: torch.Tensor, probs: bool) -> torch.Tensor:
        """Predictor features ``[R, 4]`` of draft logits ``x`` ``[R, V]`` (or probabilities, with
        ``probs``): ``chained_draft_features`` on the head's path."""
        return chained_draft_features(x, pos, probs, self._fused)
