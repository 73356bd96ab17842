"""In-process engine: continuous batching over the model runner.

Requests join and leave between steps. One ``step()`` admits waiting requests into free KV
cache slots (prefill + first token), then runs one batched decode forward over every running
request. Stop rules live in ``tandem.stopping``; the sampling transform in ``tandem.sampling``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from .admission import AdmissionPolicy
from .engine_admission import Admissions
from .control import DraftPolicy
from .drafters.base import DraftProposal, Drafter, TargetStates
from .errors import InvalidRequestError
from .metrics import SpecDecodeStats
from .predictor import VerificationRecord
from .models.runner import RunnerConfig, default_runner_config
from .models.weights import Checkpoint, load_checkpoint
from .sampling import SamplingParams
from .structured import GrammarCompiler, constrain_drafts
from .requests import Completion, Request, RequestOutput, RoundSummary, _Round, new_request  # noqa: F401 (re-exported)
from .engine_api import EngineConveniences, Prompt
from .host_drafting import HostDrafting
from .target import LocalTarget, Target
from .target_items import ChainedItem, VerifyItem
from .telemetry import span
from .tokenizer import CHAT_ROLES, Tokenizer, load_tokenizer  # noqa: F401 (CHAT_ROLES re-exported)


# what a chained round's requests carry (their drafts never reach the host); shared, read-only
_NO_PROPOSAL = DraftProposal.empty()
# Chained rounds under a draft policy or a router's width: a round's graph is as wide as the widest
# width planned over this many rounds, so a per-round choice (a device-side cap) rarely needs a
# graph of a new shape (capturing one mid-run costs tens of ms: docs/benchmarks.md, "Context-aware ablation").
WIDTH_WINDOW = 64


class Engine(Admissions, HostDrafting, EngineConveniences):
    """Continuous-batching generation over one target model.

    Args:
        checkpoint: a loaded checkpoint, or a path (GGUF file / HF directory), or None for the
            bundled SmolLM2-135M-Instruct.
        runner_config: device, dtype, batch and context limits (defaults per device).
        tokenizer: reuse an already loaded tokenizer.
        drafter: speculative decoding drafter (None: target-only decoding).
        num_draft_tokens: draft tokens per sequence per round at most (k).
        draft_policy: context-aware lengths (predictor + θ + batch allocation); None = fixed k.
        chained_rounds: chain rounds on the device where the configuration allows it
            (``chains_rounds``); False keeps host-drafted rounds.
        verification_sink: called with a ``VerificationRecord`` per verified draft (logs that
            train the difficulty predictor).
        target: run prefill and verification here instead of building a local model: a
            ``tandem.target.Target`` already built (a ``LocalTarget``, as
            ``tandem.speculation.build_engine`` and verifier replicas make); then
            ``checkpoint`` and ``runner_config`` must be None and ``tokenizer`` is required.

    Raises:
        ModelLoadError: the model cannot be loaded.
        ValueError: ``num_draft_tokens`` < 1 with a drafter; ``target`` with a checkpoint, or
            without a tokenizer; a drafter that reads target states the given local target does
            not tap.
    """

    def __init__(self, checkpoint: Checkpoint | str | None = None, runner_config: RunnerConfig | None = None,
                 tokenizer: Tokenizer | None = None, drafter: Drafter | None = None,
                 num_draft_tokens: int = 4, draft_policy: DraftPolicy | None = None,
                 verification_sink: Callable[[VerificationRecord], None] | None = None,
                 *, target: Target | None = None, chained_rounds: bool = True) -> None:
        if target is None:
            if not isinstance(checkpoint, Checkpoint):
                checkpoint = load_checkpoint(checkpoint)
            self.runner_config = runner_config or default_runner_config()
            if drafter is not None and drafter.target_taps:  # a drafter reading the target's hidden states
                self.runner_config = replace(self.runner_config, taps=tuple(drafter.target_taps))
            target = LocalTarget(checkpoint, self.runner_config)
            self.tokenizer = tokenizer or load_tokenizer(checkpoint)
        else:
            if checkpoint is not None or runner_config is not None:
                raise ValueError("give either a target or a checkpoint / runner_config, not both")
            if tokenizer is None:
                raise ValueError("an engine over a given target needs its tokenizer")
            # a local target keeps its runner's settings; a remote one has none here
            self.runner_config = target.runner.config if isinstance(target, LocalTarget) else None
            self.tokenizer = tokenizer
        self.target = target
        self.checkpoint = getattr(target, "checkpoint", None)  # None for a remote target
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.requests: dict[str, Request] = {}
        self._held_outputs: list[RequestOutput] = []  # deltas generate / stream stepped past: the next step's
        self.max_running = self.target.info.num_slots  # admission limit (<= KV cache slots)
        self.admission = AdmissionPolicy()  # when waiting requests join while others run
        if drafter is not None and num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.drafter = drafter
        if drafter is not None and drafter.target_taps:  # reads the target's hidden states: needs them in-process
            if not isinstance(self.target, LocalTarget):
                raise ValueError(f"the {drafter.name} drafter reads the target's hidden states; it needs a local target")
            drafter.bind(self.runner)
        self.num_draft_tokens = num_draft_tokens
        # drafts per sequence per round at most, set from outside (a verifier replica applies its
        # router's draft-token budget here; read at each round, so a plain int assignment from
        # another thread is safe); None: the configuration's limit alone
        self.width_cap: int | None = None
        # chained rounds always take the capped graph variant, so a cap that arrives later (a router's
        # width) finds its graphs captured (a verifier replica sets it; else the plain variant is lighter)
        self.cap_rounds = False
        self.draft_policy = draft_policy
        self._width_plan = None  # the next chained round's WidthPlan under a draft policy (None: draft_limit)
        # the last planned widths: a chained round's graph is as wide as the widest (its own plan caps on the device)
        self._recent_widths: deque[int] = deque(maxlen=WIDTH_WINDOW)
        self.verification_sink = verification_sink
        self.on_round: Callable[[RoundSummary], None] | None = None  # e.g. Prometheus counters
        self.overlap_drafting = True  # call drafter.prefetch before each verification (no-op for local drafters)
        self.chained_rounds = chained_rounds  # False: host-drafted rounds (the bench's ``*-host`` configurations)
        self.stats = SpecDecodeStats()  # aggregate over every finished request
        self._collected: _Round | None = None  # the last round's results, before their stop rules
        self._launched: _Round | None = None  # a chained round in flight (queued, not collected)
        self._in_flight: set[int] = set()  # slots of launched rounds (between launch and collect)
        self._last_collect = 0.0  # perf_counter at the end of the last collect (round wall times)
        self._deferred_release: list[Request] = []  # finished while their slot was in flight
        self._structured: set[str] = set()  # structured requests holding a slot: rounds are host-driven meanwhile
        self.num_rounds = 0  # decode rounds run (verify steps over the running batch)
        self.round_wall_s = 0.0  # their wall time, draft to observe (s)
        self.round_rows = 0  # their rows (sequences) in all: round_rows / num_rounds is the batch's occupancy
        self._ids = itertools.count()

    @property
    def chains_rounds(self) -> bool:
        """Rounds are queued one ahead from the target's device state (``Target.launch_chained``):
        target-only decoding, or a drafter that drafts on the device (n-gram from the token
        history, SpecFormer from the verify pass), without verification logs, on a target that
        keeps its round state on the device, and without a draft policy unless it chains too
        (``_policy_chains``: it then sets each round's width). The host then never waits between
        rounds: it runs round n's stop rules while the device runs n + 1."""
        # (verification logs need the host drafter's per-draft features: they keep the host path)
        drafts_ok = self.drafter is None or (self.drafter.drafts_on_device and self.verification_sink is None)
        # tapped states are only read inside the round, by a drafter that drafts from the verify pass
        # (without a drafter nobody reads them: a tapping engine run target-only, e.g. --compare)
        taps_ok = not (self.runner_config is not None and self.runner_config.taps) or (
            self.drafter is None or self.drafter.drafts_from_verify)
        # a structured request's grammar lives on the host: its rounds need the host between them
        return (self.chained_rounds and drafts_ok and taps_ok and self._policy_chains and self.target.chains_rounds
                and not self._structured)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured requests' grammars against this engine's tokenizer and vocabulary."""
        return GrammarCompiler(self.tokenizer.hf, self.target.info.vocab_size, list(self.tokenizer.eos_token_ids))

    @property
    def _policy_chains(self) -> bool:
        """No draft policy, or one that picks chained rounds' widths (``DraftPolicy.plan_width``)
        from what the drafter leaves on the device: its drafts' predicted acceptance
        (``Drafter.scores_on_device``: SpecFormer with the policy's device scorer), or nothing at
        all (the random-length baseline)."""
        policy = self.draft_policy
        return policy is None or (policy.chains and self.drafter is not None and self.drafter.drafts_on_device
                                  and (not policy.needs_scores or self.drafter.scores_on_device))

    @property
    def configured_draft_limit(self) -> int:
        """Draft tokens per sequence per round the configuration allows: ``num_draft_tokens``
        capped by the drafter's own limit (``Drafter.max_draft_tokens``; 0 without a drafter)."""
        if self.drafter is None:
            return 0
        cap = self.drafter.max_draft_tokens
        return self.num_draft_tokens if cap is None else min(self.num_draft_tokens, cap)

    @property
    def draft_limit(self) -> int:
        """Draft tokens per sequence per round at most: ``configured_draft_limit``, capped by
        ``width_cap`` when set (a router's draft-token budget; in chained rounds a device-side cap
        inside a graph as wide as the widest of the last ``WIDTH_WINDOW`` rounds, as a draft
        policy's plans: no capture mid-run, and the verify pass narrows once a window is lower)."""
        limit = self.configured_draft_limit
        return limit if self.width_cap is None else min(limit, max(0, self.width_cap))

    @property
    def _observes(self) -> bool:
        """The drafter is fed the target's states of every accepted position (SpecFormer)."""
        return (self.drafter is not None and bool(self.drafter.target_taps) and self.runner_config is not None
                and bool(self.runner_config.taps))

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Prompt | None = None, params: SamplingParams | None = None, *,
                    prompt_ids: Sequence[int] | None = None, chat: bool = True,
                    request_id: str | None = None, logprobs: bool = False, top_logprobs: int = 0,
                    final_only: bool = False) -> str:
        """Queue a request; it joins the running batch at the next step with a free slot.

        Same arguments and errors as ``make_request``; returns the request id.
        """
        return self.submit(self.make_request(prompt, params, prompt_ids=prompt_ids, chat=chat, request_id=request_id,
                                             logprobs=logprobs, top_logprobs=top_logprobs, final_only=final_only))

    def submit(self, req: Request) -> str:
        """Queue a request built by ``make_request``.

        Raises:
            InvalidRequestError: duplicate request id.
        """
        if req.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return req.request_id

    def make_request(self, prompt: Prompt | None = None, params: SamplingParams | None = None, *,
                     prompt_ids: Sequence[int] | None = None, chat: bool = True,
                     request_id: str | None = None, logprobs: bool = False, top_logprobs: int = 0,
                     resumed: int = 0, final_only: bool = False) -> Request:
        """Validate and tokenize a request without touching the engine's queues (a server
        thread can do this while another thread steps the engine): ``tandem.requests.new_request``
        with this engine's tokenizer, vocabulary and context limit.

        Args:
            prompt: text or chat messages (or pass ``prompt_ids``).
            params: sampling parameters (default: greedy, 256 tokens).
            prompt_ids: pre-tokenized prompt.
            chat: apply the chat template to a plain-text prompt.
            request_id: caller's id (default: a counter).
            logprobs: also return the target's log-probability of each output token (raw
                logits, before the sampling transform).
            top_logprobs: also return, per output token, this many most likely tokens at its
                position with their log-probabilities (0 .. ``MAX_TOP_LOGPROBS`` = 20; > 0
                implies ``logprobs``).
            resumed: the last ``resumed`` prompt tokens are output the request already emitted
                elsewhere (a request resumed after a replica failure): its grammar and penalties
                count them as output.
            final_only: its output is read once it has finished (``generate``): ``step`` returns
                one delta for it, the last, with every token and the text; without stop strings or
                logprobs that text is decoded once, then (``OutputState``), not token by token.

        Returns:
            The request, ready for ``submit``.

        Raises:
            InvalidRequestError: empty prompt, prompt at or over the context limit, token ids
                outside the vocabulary, duplicate request id, ``top_logprobs`` out of range.
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if isinstance(rid, str) and rid in self.requests:  # (another type: new_request refuses it)
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        return new_request(self.tokenizer, self.target.info.vocab_size, self.max_seq_len, rid, prompt, params,
                           prompt_ids=prompt_ids, chat=chat, logprobs=logprobs, top_logprobs=top_logprobs,
                           device=self.target.info.device, resumed=resumed, final_only=final_only,
                           grammars=self.grammars if getattr(params, "structure", None) is not None else None)

    def abort(self, request_id: str) -> None:
        """Drop a request (queued or running) and free its KV slot. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._structured.discard(request_id)
        if req in self.waiting:
            self.waiting.remove(req)
        req.pending = None  # a collected round's tokens for it are void, and its held deltas
        self._held_outputs = [o for o in self._held_outputs if o.request_id != request_id]
        if req.slot is not None:
            self._release(req)
        self._settle()

    def _release(self, req: Request) -> None:
        self.running.pop(req.slot, None)
        if self._holds_for_admission(req):  # its prefill still runs beside the rounds: freed at the join
            return
        if req.slot in self._in_flight:  # a launched round still uses the slot: free it when it is back
            self._deferred_release.append(req)
            return
        self.target.free(req.slot)
        if self.drafter is not None:
            self.drafter.release(req.slot)
        req.slot = None

    def has_unfinished(self) -> bool:
        pending = self._collected is not None and any(r.pending is not None for r in self._collected.reqs)
        return bool(self.waiting or self.running or pending or self._launched is not None or self._held_outputs
                    or self._admitting is not None)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Admit what fits, then one decode round. Returns its deltas and those ``generate`` / ``stream`` held.
        (While the admission policy's intake window holds the waiting requests back and nothing
        else is in flight, it does nothing: ``intake_wait_s`` says how long.)"""
        held, self._held_outputs = self._held_outputs, []
        try:
            return held + self._step()
        except BaseException:
            self._held_outputs = held + self._held_outputs
            raise

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self.max_running = max(1, min(self.max_running, self.target.info.num_slots))
        if self._overlaps_admission():  # admissions beside the rounds: _step_chained runs them
            return self._step_chained(overlap=True)
        reqs = self._take_waiting()
        admitted = {r.slot for r in reqs}
        prefilled = None
        if self.waiting and self.running and not reqs:
            self.admission.note_round(self._free_slots(), len(self.waiting))
        if reqs:
            handle, results = self._admit_now(reqs)
            if self.chains_rounds:  # they join the round queued next; their first tokens are read after that launch
                self.running.update((r.slot, r) for r in reqs)
                prefilled = (reqs, handle, results)
            else:
                outputs.extend(self._admit(reqs, results or self.target.collect_prefill(handle)))
        if self.chains_rounds or self._launched is not None:
            outputs.extend(self._step_chained(prefilled))
            return outputs
        # Overlapped rounds: launch round n + 1 (its inputs need only round n's token ids), run the
        # host work of round n (stop rules, detokenisation, streaming, metrics) while the device
        # runs it, then wait for its results. A request that turns out finished in round n has
        # its round n + 1 result discarded; its slot is freed once that round is back.
        previous, self._collected = self._collected, None
        decoding = {s: r for s, r in self.running.items()
                    if s not in admitted and not (previous is not None and previous.surely_finishes(r))}
        launched = None
        with span("round", batch_size=len(decoding)) if decoding else contextlib.nullcontext():
            if decoding:
                try:
                    launched = self._launch(decoding)
                except BaseException:  # the previous round's results stay for the next step: nothing is lost
                    self._collected = previous
                    raise
            if previous is not None:
                outputs.extend(self._finish(previous))
            if launched is not None:
                self._collected = self._collect(launched)
        return outputs

    def _step_chained(self, prefilled=None, overlap: bool = False) -> list[RequestOutput]:
        """One step of chained rounds: queue round n + 1 from the target's device state while
        round n is still in flight, then wait for round n and run its stop rules, detokenisation
        and metrics while the device runs n + 1. A request that round n finishes ran n + 1 for
        nothing: that result is discarded and its slot freed when it is back. Requests admitted
        this step (``prefilled``: the requests, their ``PrefillHandle`` and its results if already
        read) join at once: their prefill left their first token on the device, and the host reads
        it after queueing n + 1, so admission never leaves the device idle.

        With ``overlap`` (``tandem.engine_admission``): an admission whose prefill ran beside the
        rounds joins first if it is done (or nothing else runs), so its requests are in round
        n + 1; after n + 1 is queued, waiting requests due for admission start theirs."""
        outputs: list[RequestOutput] = []
        if self._collected is not None:  # a host-drafted round's results (the drafter was just removed)
            outputs.extend(self._finish(self._collected))
            self._collected = None
        if overlap and self._admitting is not None:
            prefilled = self._join_admission(wait=not self.running and self._launched is None)
        previous, self._launched = self._launched, None
        # a round emits at least one token: a request that the round in flight brings to its token
        # limit even so surely finishes there and stays out of the next one
        decoding = {} if not self.chains_rounds else {
            s: r for s, r in self.running.items()
            if not (previous is not None and s in previous.slots and r.num_tokens + 1 >= r.output.max_new_tokens)}
        launched = admit_error = None
        with span("round", batch_size=len(decoding)) if decoding else contextlib.nullcontext():
            if decoding:
                t0 = time.perf_counter()
                slots = sorted(decoding)
                reqs = [decoding[s] for s in slots]
                plan, k, cap = self._width_plan, self.draft_limit, None
                if self.draft_policy is not None or self.width_cap is not None or self.cap_rounds:
                    # the graph: the widest recent width; this round's own (the policy's plan, a
                    # router's width) as a device-side cap (every round capped: one graph a shape)
                    cap = k if plan is None else min(plan.width, k)
                    self._recent_widths.append(cap)
                    k = max(self._recent_widths)
                try:
                    with span("verify", batch_size=len(reqs), drafter=self.drafter.name if k else "none",
                              draft_width=k, draft_cap=k if cap is None else min(cap, k)):
                        handle = self.target.launch_chained([ChainedItem(s, r.logprobs is not None, k, r.top_logprobs)
                                                             for s, r in zip(slots, reqs)], self.drafter, cap)
                except BaseException:
                    self._launched = previous  # still in flight: collected by the next step
                    raise
                launched = _Round(reqs, [_NO_PROPOSAL] * len(reqs), [], handle, t0, chained=True, plan=plan)
                self._in_flight |= launched.slots
            if overlap and self._admitting is None:  # the next admission's prefill, behind one or two rounds queued
                try:
                    reqs_new = self._take_waiting(overlap=True)
                    if reqs_new:
                        self._start_admission(reqs_new)
                    elif self.waiting and self.running:
                        self.admission.note_round(self._free_slots(), len(self.waiting))
                except BaseException as exc:  # raised once the rounds in flight are collected: nothing lost
                    admit_error = exc
            if prefilled is not None:  # the admitted requests' first tokens, read after the round was queued
                reqs_in, handle_in, results = prefilled
                outputs.extend(self._admit(reqs_in, results or self.target.collect_prefill(handle_in)))
            if previous is None:
                self._launched = launched
            else:
                try:
                    rnd = self._collect(previous, still_in_flight=launched.slots if launched is not None else set())
                finally:
                    self._launched = launched
                outputs.extend(self._finish(rnd))
        self._settle()  # (also a round queued only for requests their prefill finished)
        if admit_error is not None:
            self._held_outputs.extend(outputs)  # (``step`` gives them with the next step's)
            raise admit_error
        return outputs

    def _settle(self) -> None:
        """A chained round in flight whose requests have all finished or been aborted has nothing
        left to give: collect it now, so its slots are free and the engine is idle."""
        rnd = self._launched
        if rnd is not None and all(r.finished or r.slot is None or r.request_id not in self.requests
                                   for r in rnd.reqs):
            self._launched = None
            self._collect(rnd)

    def _launch(self, decoding: dict[int, Request]) -> "_Round":
        """Drafts, then the target forward over [last token + drafts] of every running request,
        queued without waiting for it (``Target.launch_verify``)."""
        t0 = time.perf_counter()
        slots = sorted(decoding)
        reqs = [decoding[s] for s in slots]
        proposals = self._propose(reqs)
        # structured requests: drafts cut by their grammars, whose masks are walked while the forward runs
        masks = constrain_drafts(reqs, proposals)
        if self.drafter is not None and self.overlap_drafting and self.drafter.prefetches:
            self._prefetch(reqs, proposals)
        held = [len(r.prompt_ids) + r.num_tokens - 1 for r in reqs]  # tokens each slot holds before the round
        with span("verify", batch_size=len(reqs), draft_tokens=sum(len(p.tokens) for p in proposals)):
            handle = self.target.launch_verify(
                [VerifyItem(s, r.last_token, p, r.params, r.logprobs is not None, r.top_logprobs)
                 for s, r, p in zip(slots, reqs, proposals)], masks)
        self._in_flight = set(slots)
        return _Round(reqs, proposals, held, handle, t0)

    def _collect(self, rnd: "_Round", still_in_flight: set[int] = frozenset()) -> "_Round":
        """Wait for a launched round; keep its results for the stop rules, feed the verify pass's
        states to a drafter that reads them (SpecFormer), and free the slots of requests that
        finished while it ran (unless ``still_in_flight``: a later chained round uses them)."""
        try:
            rnd.results = self.target.collect(rnd.handle)
        finally:
            self._in_flight = set(still_in_flight)
            deferred, self._deferred_release = self._deferred_release, []
            for req in deferred:
                self._release(req)
        live = [i for i, r in enumerate(rnd.reqs) if r.slot is not None and not r.finished]
        for i in live:
            rnd.reqs[i].pending = rnd.results[i].tokens
            if rnd.reqs[i].grammar is not None:  # the next round's masks start after these
                rnd.reqs[i].grammar.advance(rnd.results[i].tokens)
        # (a chained round's drafter read the verify pass on the device: nothing to observe here)
        observed = [TargetStates(rnd.reqs[i].slot, rnd.held[i], rnd.results[i].extras["taps"], rnd.results[i].tokens)
                    for i in live] if self._observes and not rnd.chained else []
        if observed:  # the drafter reads the verify pass's states (SpecFormer): its own span in traces
            with span("observe", batch_size=len(observed), drafter=self.drafter.name):
                self.drafter.observe(observed)
        now = time.perf_counter()
        rnd.wall_s = now - max(rnd.t0, self._last_collect)  # chained rounds overlap: count each span once
        self._last_collect = now
        return rnd

    def _finish(self, rnd: "_Round") -> list[RequestOutput]:
        """The stop rules over each accepted run of a collected round, metrics and outputs.
        Requests aborted or finished since it was launched are skipped (their result is void)."""
        outputs = []
        emitted = 0
        drafting = SpecDecodeStats()  # the rows that drafted, as the stop rules cut them (one step each)
        for req, prop, res in zip(rnd.reqs, rnd.proposals, rnd.results):
            if req.pending is None or req.finished or req.slot is None:
                continue
            req.pending = None
            if self.verification_sink is not None and (n_chain := prop.chain_length):
                self.verification_sink(VerificationRecord(prop.features[:n_chain], min(res.num_accepted, n_chain),
                                                          self.drafter.name,
                                                          None if prop.states is None else prop.states[:n_chain]))
            spec = req.spec
            emitted0, drafted0, accepted0 = spec.num_emitted, spec.num_drafted, spec.num_accepted
            drafted = res.num_drafts if res.num_drafts is not None else len(prop.tokens)
            self._append(outputs, req, res.tokens, drafted, res.num_accepted, res.logprobs, res.top_logprobs)
            kept = spec.num_emitted - emitted0  # kept by the stop rules (a stream may hold some back)
            emitted += kept
            if spec.num_drafted > drafted0:
                drafting.record(spec.num_drafted - drafted0, spec.num_accepted - accepted0, kept)
        round_ms = rnd.wall_s * 1e3
        if self.draft_policy is not None:
            if not rnd.chained or rnd.plan is not None:  # (a chained round before any plan: nothing to learn)
                self.draft_policy.observe(emitted, round_ms, rnd.plan, drafting)
            if rnd.chained:  # the width of the round after the one in flight, from the drafts this one made
                live = [res.draft_scores for req, res in zip(rnd.reqs, rnd.results) if not req.finished and req.slot is not None]
                scores = [x for x in live if x is not None]
                self._width_plan = self.draft_policy.plan_width(scores or None, self.draft_limit, len(live))
        if self.on_round is not None:
            plan = rnd.plan
            self.on_round(RoundSummary(drafting.num_drafted, drafting.num_accepted, drafting.accepted_per_pos, emitted,
                                       len(rnd.reqs), round_ms, drafting.num_steps, None if plan is None else plan.width,
                                       None if plan is None else plan.acceptance_threshold))
        self.num_rounds += 1
        self.round_wall_s += rnd.wall_s
        self.round_rows += len(rnd.reqs)
        return outputs

    def _append(self, outputs: list[RequestOutput], req: Request, tokens: list[int], drafted: int | None = None,
                accepted: int = 0, logprobs: list[float] | None = None, top: list | None = None) -> None:
        """Append a run of tokens through the stop rules; ``drafted`` is None for the prefill token.
        ``logprobs`` (one per token) and ``top`` (each token's alternatives) are kept for requests
        that asked for them, cut with the tokens. The request's delta goes to ``outputs`` (none for
        a ``final_only`` request still running)."""
        out = req.output
        kept = out.append(tokens)
        if req.logprobs is not None:
            req.logprobs.extend(list(logprobs[:kept]) if logprobs is not None else [float("nan")] * kept)
            del req.logprobs[len(out.token_ids):]  # a stop string also cuts tokens of earlier runs
        if req.top is not None:
            req.top.extend(list(top[:kept]) if top is not None else [[] for _ in range(kept)])
            del req.top[len(out.token_ids):]
        if drafted is not None:  # metrics are cut at the stop boundary too
            req.spec.record_run(drafted, accepted, len(tokens), kept)
        finished = out.finish_reason is not None
        if req.first_token_time is None or finished:  # (a clock read a request, not a request a round)
            now = time.perf_counter()
            if req.first_token_time is None:
                req.first_token_time = now
            if finished:
                self._structured.discard(req.request_id)
                req.finish_time = now
                self.stats.merge(req.spec)
                if req.slot is not None:
                    self._release(req)
        if req.final_only and not finished:
            return
        text, lo, hi = out.take_delta()
        if req.logprobs is None:  # each token's text goes with its log-probability only (OpenAI logprobs)
            outputs.append(RequestOutput(req.request_id, out.token_ids[lo:hi], text, finished, out.finish_reason,
                                         stop_reason=out.stop_reason))
        else:
            outputs.append(RequestOutput(req.request_id, out.token_ids[lo:hi], text, finished, out.finish_reason,
                                         req.logprobs[lo:hi], out.token_texts(lo, hi), out.stop_reason,
                                         None if req.top is None else req.top[lo:hi]))
