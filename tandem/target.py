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

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from . import verify_kernel
from .drafters.base import VerifiedStep
from .models import kernels
from .models.kv_cache import KVCache
from .models.runner import ModelRunner, RunnerConfig
from .models.transfer import HostCopy, to_device
from .models.weights import Checkpoint
from .round_state import RoundState, SlotSampling  # noqa: F401 (re-exported: the target's device state)
from .sampling import adjust_logits
from .logprobs import MAX_TOP_LOGPROBS, logprob_columns, logprob_mode, read_logprob_columns, wants_logprobs
from .structured import with_masks, step_masks
from .target_prefill import LocalPrefill
from .target_items import (ChainedItem, PrefillHandle, PrefillItem, TargetInfo, TargetResult,  # noqa: F401
                           TargetUnavailable, VerifyItem)
from .verify import (ChainVerification, RowSampling, VerifyResult, target_probs, tree_path,
                     verify_chains, verify_tree_sampling, verify_trees_greedy)


class Target(ABC):
    """Prefill and verification over a slot-addressed KV cache (see the module docstring)."""

    _info: TargetInfo  # set by each implementation's constructor

    @property
    def info(self) -> TargetInfo:
        """Model name, vocabulary, slots and context limit."""
        return self._info

    @abstractmethod
    def _slot_pool(self):
        """What numbers this target's slots: a ``SlotPool``, or the ``KVCache`` that holds one."""

    def num_free(self) -> int:
        """Free slots."""
        return self._slot_pool().num_free()

    def allocate(self) -> int:
        """Take the lowest free slot. Raises CacheFullError when none is free."""
        return self._slot_pool().allocate()

    def free(self, slot: int) -> None:
        """Release ``slot`` (its sequence finished or was aborted)."""
        self._slot_pool().free(slot)

    @abstractmethod
    def prefill(self, items: list[PrefillItem]) -> list[TargetResult]:
        """Append every prompt to its slot and pick each first token (results in item order).

        Raises:
            CacheFullError: a prompt does not fit its slot. TargetUnavailable: remote failure.
        """

    def launch_prefill(self, items: list[PrefillItem], overlap: bool = False) -> "PrefillHandle":
        """Start ``prefill(items)``: a target that can queue the work (the GPU) returns before the
        first tokens are known, so a chained round can be queued behind it before the host reads
        them (``collect_prefill``). The handle's ``extras`` (per item, as ``TargetResult.extras``)
        are usable at once. The default runs ``prefill`` now.

        Args:
            overlap: where the target can (``overlaps_admission``), run it beside the rounds in
                flight; then no round may include these slots before ``join_prefill``.

        Raises:
            As ``prefill``.
        """
        results = self.prefill(items)
        return PrefillHandle([r.extras for r in results], results)

    overlaps_admission = False  # ``launch_prefill(..., overlap=True)`` runs beside the rounds

    def prefill_ready(self, handle: "PrefillHandle") -> bool:
        """Whether an overlapped prefill is done on the device (never waits)."""
        return True

    def join_prefill(self, handle: "PrefillHandle") -> None:
        """Make an overlapped prefill's slots ready for rounds (a no-op where nothing overlaps)."""

    def collect_prefill(self, handle: "PrefillHandle") -> list[TargetResult]:
        """The results of a ``launch_prefill`` (blocks until its first tokens are on the host)."""
        return handle.payload

    @abstractmethod
    def verify(self, items: list[VerifyItem]) -> list[TargetResult]:
        """One batched forward over ``[last token + drafts]`` of every item, verification, and
        rollback of the rejected drafts' KV entries (results in item order).

        Raises:
            TargetUnavailable: remote failure.
        """

    def launch_verify(self, items: list[VerifyItem], masks=None) -> object:
        """Start ``verify(items)`` and return a handle for ``collect``; a target that can queue
        the work (the GPU) returns before it is done, so the caller's host work overlaps it. The
        items' slots must not be touched until ``collect``. The default runs ``verify`` at once.

        Args:
            masks: structured requests' grammar masks still being computed
                (``tandem.structured.MaskWalk``: ``result()`` maps a slot to its item's
                ``allowed``); a target that can queue the forward waits for them only after.
        """
        return self.verify(with_masks(items, masks))

    def collect(self, handle: object) -> list[TargetResult]:
        """The results of a ``launch_verify`` or ``launch_chained`` (blocks until they are ready)."""
        return handle  # type: ignore[return-value]

    chains_rounds = False  # the target keeps round state on its device (``launch_chained``)

    def launch_chained(self, items: list["ChainedItem"], drafter=None, draft_cap: int | None = None) -> object:
        """Queue a round whose inputs are the target's own device state: each slot's last token
        (the one its prefill or its previous round emitted, whether that round has been collected
        or not) at its device-side length, and, with a ``drafter`` that drafts on the device
        (``Drafter.drafts_on_device``), up to ``max_draft`` drafts it computes there from the
        slot's token history (and at most ``draft_cap``, a draft policy's width for this round,
        which changes what is verified but not the round's shape). Lets the scheduler queue round
        n + 1 before it reads round n (the host never waits between rounds). Only targets with
        ``chains_rounds`` implement it.

        Raises:
            NotImplementedError: this target does not keep device round state.
        """
        raise NotImplementedError(f"{type(self).__name__} does not chain rounds on its device")

    def prime_drafts(self, slots: list[int], drafter) -> None:
        """Let a drafter that drafts from the verify pass make the first drafts of just-prefilled
        ``slots`` on the target's device (chaining targets; a no-op elsewhere)."""


class LocalTarget(LocalPrefill, Target):
    """The target model in this process: model runner, KV cache, ``tandem.verify``.

    A verify round makes one device-to-host copy (start positions, accepted lengths, emitted tokens
    and, when asked, their log-probabilities, in one tensor), non-blocking between
    ``launch_verify`` and ``collect``; verification itself runs on the device (``verify_chains``)
    and updates the device round state (``RoundState``), so a chained round
    (``launch_chained``) can be queued before the previous one is collected. Greedy token trees
    are verified with the chains, on the device (``verify_trees_greedy``); sampled ones are walked
    on the host (``verify_tree_sampling``).

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
        self.sampling = SlotSampling(self.cache.num_slots, self.runner.device, checkpoint.config.vocab_size)
        self.state = RoundState(self.cache.num_slots, self.cache.capacity, self.runner.device)
        # launch_chained's draft_cap: a device scalar, written from a ring of pinned host scalars (at
        # most two rounds are in flight, so an entry's copy has run before the entry is written again)
        self._draft_cap = torch.zeros((), dtype=torch.int64, device=self.runner.device)
        pin = self.runner.device.type == "cuda"
        self._cap_host = [torch.zeros((), dtype=torch.int64, pin_memory=pin) for _ in range(HostCopy.RING)]
        self._cap_turn = 0
        self._all_chain = torch.ones(self.cache.num_slots, dtype=torch.bool, device=self.runner.device)  # read only
        self._queued: dict[int, int] = {}  # slot -> tokens of its launched, uncollected rounds
        self._pinned: dict[tuple, list] = {}  # result buffers by shape, used in turn (HostCopy)
        self._pinned_admission: dict[tuple, list] = {}  # the same for overlapped prefills' first tokens

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    def _slot_pool(self) -> KVCache:
        return self.cache

    def prefill(self, items: list[PrefillItem]) -> list[TargetResult]:
        """See ``Target.prefill`` (``LocalPrefill``); with a tapping runner (``RunnerConfig.taps``) each result's
        ``extras["taps"]`` holds the prompt's tapped states ``[len(prompt), len(taps), d]``."""
        return self.collect_prefill(self.launch_prefill(items))

    def _draft_probs(self, items: list[VerifyItem], n: int, K: int, draft_tokens: torch.Tensor) -> torch.Tensor | None:
        """``[n, K, V]`` q of every row's drafts (row = slot), or None when every draft is
        deterministic. Rows without q (deterministic drafts in a batch with sampled ones) get q
        one-hot at their drafts; rows past their drafts stay 0 (never read)."""
        with_q = [it for it in items if it.proposal.probs is not None and it.proposal.tokens]
        if not with_q:
            return None
        V = self._info.vocab_size
        dev = draft_tokens.device
        q = torch.zeros(n, K, V, dtype=torch.float32, device=dev)
        lens = [len(it.proposal.tokens) for it in with_q]
        flat = torch.cat([it.proposal.probs.to(device=dev, dtype=torch.float32) for it in with_q])
        rows = torch.tensor([it.slot for it, m in zip(with_q, lens) for _ in range(m)], dtype=torch.int64)
        cols = torch.tensor([j for m in lens for j in range(m)], dtype=torch.int64)
        q[to_device(rows, dev), to_device(cols, dev)] = flat
        missing = [it.slot for it in items if it.proposal.probs is None and it.proposal.tokens]
        if missing:
            m = to_device(torch.tensor(missing, dtype=torch.int64), dev)
            q[m] = torch.nn.functional.one_hot(draft_tokens[m], V).to(torch.float32)
        return q

    def verify(self, items: list[VerifyItem]) -> list[TargetResult]:
        """See ``Target.verify``; with a tapping runner each result's ``extras["taps"]`` holds the
        tapped states ``[num_accepted + 1, len(taps), d]`` of the positions it keeps (the last
        token and the accepted drafts): what a SpecFormer head drafts the next round from."""
        return self.collect(self.launch_verify(items))

    chains_rounds = True

    def launch_verify(self, items: list[VerifyItem], masks=None) -> "_LaunchedVerify":
        """Queue the forward, the verification and one non-blocking device-to-host copy of the
        results (into pinned memory, on CUDA); ``collect`` waits for that copy only. Grammar
        ``masks`` still being computed (see ``Target.launch_verify``) are waited for after the
        forward is queued, so their host work overlaps the device's. A round with token trees
        whose rows are all greedy, with no logit adjustment or grammar, verifies inside the step's
        own graph (``ModelRunner.step``'s epilogue)."""
        trees = {it.slot: [-1] + [x + 1 for x in it.proposal.parents] for it in items if it.proposal.parents is not None}
        tokens = {it.slot: [it.last_token] + it.proposal.tokens for it in items}
        flags = self.sampling.flags([it.slot for it in items]) if trees else None
        if trees and not any(flags) and masks is None and all(it.allowed is None for it in items):
            # every row greedy, no logit adjustment or grammar: the verification reads only device
            # state, so it runs as the step's epilogue, captured in its graph (one launch a round)
            logprobs = logprob_mode(items)

            def verify(out) -> torch.Tensor:
                n = out.argmax.shape[0]
                every = self._all_chain[:n]
                return self._verify_device(out, every, self.sampling.rows(n, flags=flags), None, None, logprobs, every)

            out = self.runner.step(tokens, trees, patch_key=("trees", logprobs), epilogue=verify)
            return self._launched(items, out, trees, None)
        out = self.runner.step(tokens, trees or None)
        return self._verify_step(with_masks(items, masks), out, trees)

    def launch_chained(self, items: list[ChainedItem], drafter=None, draft_cap: int | None = None) -> "_LaunchedVerify":
        """See ``Target.launch_chained``: one step whose start positions, tokens and drafts the
        device fills from ``RoundState`` (``ModelRunner.step``'s ``patch``), then verification and
        the results' copy, as ``launch_verify``. Any number of chained rounds may be in flight;
        ``collect`` them in launch order.

        A drafter that drafts from the verify pass (``Drafter.drafts_from_verify``: SpecFormer)
        reads the step's tapped states on the device after verification
        (``Drafter.device_after_verify``) and leaves the next round's drafts there; its sampled
        drafts' q comes from ``Drafter.device_draft_probs``.

        Raises:
            ValueError: the runner taps hidden states for a drafter that does not read them inside
                the round (the next round's forward would overwrite them before collect; without a
                drafter nobody reads them); drafts asked for without a device drafter.
        """
        if self.runner.config.taps and drafter is not None and not drafter.drafts_from_verify:
            raise ValueError("chained rounds do not return tapped states")
        k = max(it.max_draft for it in items)
        if k and (drafter is None or not drafter.drafts_on_device):
            raise ValueError("chained drafts need a drafter that drafts on the device")
        flags = self.sampling.flags([it.slot for it in items])
        logprobs = logprob_mode(items)
        if drafter is not None:
            drafter.prepare_round(flags[0])  # its buffers exist before any graph is captured
        capped = draft_cap is not None and k > 0
        if capped:  # a device scalar the round's graph reads: a new cap needs no new graph
            self._cap_turn = (self._cap_turn + 1) % len(self._cap_host)
            src = self._cap_host[self._cap_turn]  # pinned, reused in turn: no allocation a round
            src.fill_(min(max(draft_cap, 0), k))
            self._draft_cap.copy_(src, non_blocking=True)

        def verify(out) -> torch.Tensor:  # captured with the forward: the round is one graph launch
            n, Q = out.argmax.shape
            sampling = self.sampling.rows(n, flags=flags)
            q = drafter.device_draft_probs(n, Q - 1) if drafter is not None and flags[0] else None
            return self._verify_device(out, self._all_chain[:n], sampling, q, drafter, logprobs)

        out = self.runner.step({it.slot: [0] * (1 + it.max_draft) for it in items},
                               patch=lambda inputs, attn_len: self.state.feed(inputs, attn_len, drafter, k,
                                                                              self._draft_cap if capped else None),
                               patch_key=("chained", id(drafter) if drafter is not None else None, k, flags, logprobs,
                                          capped),
                               epilogue=verify)
        return self._launched(items, out, {}, None)

    def prime_drafts(self, slots: list[int], drafter) -> None:
        """After ``prefill`` of ``slots`` and the drafter's ``observe`` of it: a drafter that drafts
        from the verify pass makes those slots' first drafts on the device
        (``SpecFormerDrafter.device_prime``: from a CUDA graph), so their first chained round
        verifies drafts."""
        if not slots or not drafter.drafts_from_verify:
            return
        # with CUDA graphs every row, the admitted ones kept (one shape whatever the slots: the head
        # replays one graph); eagerly only the rows up to the highest admitted slot
        n = self.cache.num_slots if self.runner.config.cuda_graphs else max(slots) + 1
        keep = torch.zeros(n, dtype=torch.bool, device=self.runner.device)
        # a scalar fill: ``keep[index] = True`` would copy a host scalar to the device and wait for the stream
        keep.index_fill_(0, to_device(torch.tensor(slots, dtype=torch.int64), keep.device), True)
        drafter.device_prime(keep, self.state, self.sampling.rows(n, slots),
                             max(self.cache.lengths[s] for s in slots) + 1)

    def _verify_step(self, items: list[VerifyItem], out, trees: dict[int, list[int]]) -> "_LaunchedVerify":
        """Verification of a queued host-drafted step (its drafts and q came from the host), the
        device round state's update and the results' copy. Greedy token trees are verified with
        the chains, on the device (``verify_trees_greedy``); sampled ones are walked on the host
        at collect."""
        n, Q = out.argmax.shape
        walked = {it.slot for it in items if it.slot in trees and not it.params.greedy}
        sampling = self.sampling.rows(n, [it.slot for it in items])
        tree_rows = None
        if trees and not sampling.any_sampled:  # every row is verified as a tree (a chain is one)
            chain = tree_rows = self._all_chain[:n]
        else:
            # made on the device: a copy from pageable host memory may make the driver wait for the
            # stream, i.e. for the round in flight, which would undo the chaining
            chain = torch.ones(n, dtype=torch.bool, device=out.inputs.device)
        if trees and sampling.any_sampled:  # tree rows are no chains; the greedy ones are verified as trees
            chain.index_fill_(0, to_device(torch.tensor(sorted(trees), dtype=torch.int64), chain.device), False)
            if len(walked) < len(trees):
                tree_rows = torch.zeros_like(chain).index_fill_(0, to_device(torch.tensor(
                    sorted(set(trees) - walked), dtype=torch.int64), chain.device), True)
        by_slot = [None] * n
        for it in items:
            by_slot[it.slot] = it
        allowed = step_masks(by_slot, Q, self._info.vocab_size, out.inputs.device)
        if allowed is not None:
            sampling = dataclasses.replace(sampling, allowed=allowed)
        q = self._draft_probs([it for it in items if it.slot not in trees], n, Q - 1, out.inputs[:, 3:2 + Q])
        packed = self._verify_device(out, chain, sampling, q, None, logprob_mode(items), tree_rows)
        if walked:  # host walks read the logits at collect: they must not be overwritten before
            out = out._replace(logits=out.logits.clone())
        return self._launched(items, out._replace(epilogue=packed), trees, sampling, walked)

    def _verify_trees(self, out, tree_rows: torch.Tensor | None, sampling: RowSampling, logprobs: int
                      ) -> tuple[ChainVerification, torch.Tensor | None]:
        """Every row verified as a greedy token tree on the device (``verify_trees_greedy``, over
        the logits after the rows' adjustments, each node seeing its ancestors as output; a chain
        row's tree is its chain), the accepted branches' K/V of rows ``tree_rows`` (``[n]`` bool;
        None: every row) moved to consecutive positions, and, with ``logprobs``, the logits of
        each row's kept positions (the last token, then its accepted branch) for
        ``logprob_columns``, else None."""
        n, Q = out.argmax.shape
        inputs = out.inputs  # start, q_len, the Q tokens, their depths, the Q x Q visibility mask
        tokens, depth = inputs[:, 2:2 + Q], inputs[:, 2 + Q:2 + 2 * Q]
        visible = inputs[:, 2 + 2 * Q:2 + 2 * Q + Q * Q].view(n, Q, Q) > 0
        argmax = out.argmax
        if sampling.adjust is not None or sampling.allowed is not None:
            j = torch.arange(Q, device=inputs.device)
            argmax = sampling.constrain(out.logits, inputs[:, :1] + 1 + depth, tokens[:, None, :].expand(n, Q, Q),
                                        visible & (j > 0)).argmax(-1)
        res, path = verify_trees_greedy(argmax, tokens, depth, visible, inputs[:, 1])
        # the accepted token at depth d moves from position start + path[d - 1] to start + d (the
        # rest copy a row's start onto itself): one gather and one scatter for every row and layer
        d = torch.arange(1, Q, device=inputs.device)
        moved = d[None, :] <= res.num_accepted[:, None]
        if tree_rows is not None:
            moved = moved & tree_rows[:, None]
        start = inputs[:, :1]
        src = torch.where(moved, start + path, start)
        dst = torch.where(moved, start + d, start)
        self.cache.move_rows(torch.arange(n, device=inputs.device)[:, None], src, dst)
        kept = None
        if logprobs:
            positions = torch.cat([torch.zeros_like(start), torch.where(moved, path, d)], dim=1)
            kept = out.logits.gather(1, positions[:, :, None].expand_as(out.logits))
        return res, kept

    def _verify_device(self, out, chain: torch.Tensor, sampling: RowSampling, q: torch.Tensor | None, drafter,
                       logprobs: int, tree_rows: torch.Tensor | None = None) -> torch.Tensor:
        """A verify round's device work after its forward, with no host synchronisation (a chained
        round captures it in the step's graph): ``verify_chains`` over the chain rows (``chain``
        ``[n]`` bool; other rows verify no drafts), greedy token trees over ``tree_rows`` (``[n]``
        bool, or None: ``_verify_trees``; in a round without sampled rows every row is verified
        as a tree, a chain being one), the round state's update, a verify-pass
        drafter's next drafts (``Drafter.device_after_verify``), and the results packed for the
        host: ``[n, 3 + Q (+ Q) (+ L)]`` rows of start, q_len, accepted, the Q emitted-token
        slots, then (``logprobs``: ``_logprob_mode``) their log-probabilities and, for mode 2,
        the top alternatives at each position (``logprob_columns``), then (a drafter that scores its device
        drafts, ``Drafter.device_draft_scores``) the predicted acceptance of the L drafts it made
        for the next round; int64, or float64 where log-probabilities or scores follow."""
        n, Q = out.argmax.shape
        inputs = out.inputs  # [n, 2 + Q (+ tree columns)] on the device: start, q_len, tokens
        packed = kept = None
        if tree_rows is not None and not sampling.any_sampled:  # a chain is a tree: one pass verifies every row
            res, kept = self._verify_trees(out, None, sampling, logprobs)
            chain = self._all_chain[:n]
            self.state.advance(inputs[:, :2], chain, res.num_accepted, res.tokens)
        elif _greedy_on_kernel(sampling, inputs.device):  # accept, bonus, round state and pack: one kernel
            res, packed = verify_kernel.greedy_round(out.argmax, inputs, chain, self.state)
        else:
            draft_lens = (inputs[:, 1] - 1).clamp_min(0) * chain
            res = verify_chains(out.logits, out.argmax, inputs[:, 3:2 + Q], draft_lens, inputs[:, 0] + 1, sampling, q)
            if tree_rows is not None:  # greedy trees beside sampled rows: merged into the chains' results
                tree, kept = self._verify_trees(out, tree_rows, sampling, logprobs)
                res = ChainVerification(torch.where(tree_rows, tree.num_accepted, res.num_accepted),
                                        torch.where(tree_rows[:, None], tree.tokens, res.tokens))
                chain = chain | tree_rows
            self.state.advance(inputs[:, :2], chain, res.num_accepted, res.tokens)
        logits = out.logits if kept is None else kept
        if sampling.adjust is not None:  # the output's token counts, for the penalties of later rounds
            emitted = torch.arange(Q, device=inputs.device)[None, :] <= res.num_accepted[:, None]
            self.sampling.record(res.tokens, emitted & (chain & (inputs[:, 1] > 0))[:, None])
        if drafter is not None and drafter.drafts_from_verify:
            drafter.device_after_verify(VerifiedStep(inputs[:, 0], out.taps, res.num_accepted, res.tokens,
                                                     chain & (inputs[:, 1] > 0), out.attn_len, self.state, sampling))
        if packed is None:
            packed = torch.cat([inputs[:, :2], res.num_accepted[:, None], res.tokens], dim=1)
        scores = drafter.device_draft_scores(n) if drafter is not None else None
        if logprobs or scores is not None:  # float columns follow: the whole row is float64
            packed = packed.double()
        if logprobs:  # row j of the forward predicts the token after the j-th input
            packed = torch.cat([packed, logprob_columns(logits, res.tokens, logprobs == 2)], dim=1)
        if scores is not None:  # the next round's drafts' predicted acceptance (a chained draft policy)
            packed = torch.cat([packed, scores.double()], dim=1)
        return packed

    def _launched(self, items: list, out, trees: dict[int, list[int]], sampling,
                  walked: set[int] = frozenset()) -> "_LaunchedVerify":
        """Queue the copy of a round's packed results (``out.epilogue``) for ``collect``."""
        steps = [_step_tokens(it) for it in items]
        queued = self._queued
        for it, step in zip(items, steps):  # the runner grew the host lengths by the step's tokens; collect corrects them
            queued[it.slot] = queued.get(it.slot, 0) + step
        copy = HostCopy(out.epilogue, self._pinned)
        Q = out.argmax.shape[1]
        mode = logprob_mode(items)
        scored = out.epilogue.shape[1] - 3 - Q - (Q if mode else 0) - (2 * Q * MAX_TOP_LOGPROBS if mode == 2 else 0)
        return _LaunchedVerify(items, [it.slot for it in items], trees, out, sampling, copy, Q, steps, scored, walked)

    def collect(self, handle: "_LaunchedVerify") -> list[TargetResult]:
        """The results of ``launch_verify`` or ``launch_chained``: waits for its copy (the round's
        one blocking wait), rolls back the rejected drafts' KV and gathers the kept positions'
        tapped states. One pass over the rows, building each row's result where it is read (a
        round's host work grows with the batch: this is on the host's critical path at large
        batch sizes)."""
        items, slots, trees, out, Q = handle.items, handle.slots, handle.trees, handle.out, handle.width
        walked = handle.walked
        host = handle.copy.wait()  # per row: start, q_len, accepted, Q tokens, (Q logprobs), (scores)
        ints = handle.copy.host.dtype == torch.int64  # no float columns: token ids need no conversion
        chained = isinstance(items[0], ChainedItem)
        queued, truncate = self._queued, self.cache.truncate
        num_scores = handle.num_scores
        # (a chained round's taps were read on the device, and a later round may have overwritten them)
        gather = out.taps is not None and not chained
        kept: list[list[int]] = []  # per row, the step rows whose tokens stay in the cache (taps, trees)
        outs: list[TargetResult] = []
        for it, slot, step in zip(items, slots, handle.steps):
            row = host[slot]
            length = int(row[0])  # what the slot held before the round
            path = None
            if slot in walked:  # a sampled tree
                r = self._verify_tree(it, out, handle.sampling, length)
                tokens, m, path = r.tokens, r.num_accepted, r.path
                if path:  # move the accepted branch's K/V to consecutive positions
                    moves = [(length + 1 + i, length + d) for d, i in enumerate(path, start=1) if i + 1 != d]
                    self.cache.move(slot, [a for a, _ in moves], [b for _, b in moves])
                    self.state.set(slot, length, tokens)
                if self.sampling.adjust is not None:  # (a chain row's tokens were counted on the device)
                    dev = self.runner.device
                    self.sampling.record(to_device(torch.tensor([tokens]), dev),
                                         torch.ones(1, len(tokens), dtype=torch.bool, device=dev),
                                         to_device(torch.tensor([slot]), dev))
            else:
                m = int(row[2])
                tokens = row[3:m + 4] if ints else [int(t) for t in row[3:m + 4]]
                if slot in trees:  # a greedy tree, verified (and its branch's K/V moved) on the device
                    path = tree_path(it.proposal.tokens, it.proposal.parents, tokens[:m])
            # drop rejected drafts' KV; a later round still in flight keeps its share of the length
            left = queued[slot] - step
            truncate(slot, length + 1 + m + left)
            if left:
                queued[slot] = left
            else:
                del queued[slot]
            rows = None
            if gather or path is not None:
                rows = [0] + [1 + i for i in path] if path else list(range(m + 1))
                kept.append(rows)
            lp = top = None
            if it.return_logprobs or it.top_logprobs > 0:  # (wants_logprobs, inline: once a row a round)
                if slot in walked:
                    cols = logprob_columns(out.logits[slot, rows][None], torch.tensor(
                        tokens, device=out.logits.device)[None], it.top_logprobs > 0)[0].tolist()
                    lp, top = read_logprob_columns(cols, 0, len(rows), len(rows), it.top_logprobs)
                else:
                    lp, top = read_logprob_columns(row, Q + 3, Q, len(tokens), it.top_logprobs)
            outs.append(TargetResult(tokens, m, lp, {}, int(row[1]) - 1 if chained else None,
                                     row[-num_scores:] if num_scores else None, top))
        if gather:  # one gather for every sequence
            gathered = out.taps[torch.tensor([s for s, rows in zip(slots, kept) for _ in rows]),
                                torch.tensor([r for rows in kept for r in rows])]
            for res, t in zip(outs, gathered.split([len(rows) for rows in kept])):
                res.extras = {"taps": t}
        return outs

    def _verify_tree(self, it: VerifyItem, out, sampling: RowSampling, start: int) -> VerifyResult:
        """One sampled token tree, walked on the host (``verify_tree_sampling``)."""
        prop = it.proposal
        width = len(prop.tokens) + 1
        index = to_device(torch.tensor([it.slot], dtype=torch.int64), out.logits.device)
        rows = sampling.rows(index)
        logits = out.logits[index, :width]
        if rows.adjust is not None:  # each node sees its ancestors (and itself) as output
            paths = [[]]
            for tok, parent in zip(prop.tokens, prop.parents):
                paths.append(paths[parent + 1] + [tok])
            depth = max(len(path) for path in paths)
            prefix = torch.tensor([[path + [0] * (depth - len(path)) for path in paths]], dtype=torch.int64)
            valid = torch.tensor([[[i < len(path) for i in range(depth)] for path in paths]])
            positions = torch.tensor([[start + 1 + len(path) for path in paths]], dtype=torch.int64)
            dev = logits.device
            logits = adjust_logits(logits, rows.adjust, positions.to(dev), prefix.to(dev), valid.to(dev))
        p = target_probs(logits, rows)[0]
        return verify_tree_sampling(prop.tokens, prop.parents, prop.probs, p, self.sampling.seeds[it.slot], start + 1)


def _step_tokens(it) -> int:
    """Tokens a round appends to the item's slot: the last token and its drafts."""
    return 1 + (len(it.proposal.tokens) if isinstance(it, VerifyItem) else it.max_draft)


@dataclass
class _LaunchedVerify:
    """A verify round between ``LocalTarget.launch_verify`` and ``collect``."""

    items: list  # VerifyItem or ChainedItem
    slots: list[int]
    trees: dict[int, list[int]]
    out: object  # the runner's StepOutput (static buffers in graph mode: read before the next step)
    sampling: RowSampling
    copy: HostCopy
    width: int
    steps: list[int]  # tokens the round appends to each item's slot (``_step_tokens``)
    num_scores: int = 0  # trailing columns of predicted acceptance of the next drafts (a scoring drafter)
    walked: set[int] = frozenset()  # slots of the trees walked on the host at collect (sampled ones)


def _greedy_on_kernel(sampling: RowSampling, device: torch.device) -> bool:
    """Whether a round's verification runs as ``verify_kernel.greedy_round``: every row greedy,
    no logit adjustment or grammar mask (host flags of the step), on CUDA where Triton imports."""
    return (not sampling.any_sampled and sampling.adjust is None and sampling.allowed is None
            and kernels.round_kernels_on(device))
