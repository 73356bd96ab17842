"""Admission for ``tandem.engine.Engine``: waiting requests into free KV slots, their prefill and
first token, a drafter's prompt work, and, where the target can, the prefill beside the rounds.

In line (``Engine._admit_now``): the prefill, the drafter's observe of the prompts and its first
drafts are queued on the rounds' stream, so the rounds queued behind them wait for them (at batch
64 with a SpecFormer head an admission took ~6 ms of GPU time against a round's ~1.8 ms:
docs/benchmarks.md, "What bounds batch 64").

Overlapped (``AdmissionPolicy.overlap`` and ``Target.overlaps_admission``, while requests run on
chained rounds): the prefill runs on the target's admission stream (``LocalTarget.launch_prefill``
with ``overlap``) while the running requests' rounds go on; each step polls its event, and once
it has fired (never waiting for it while rounds run) the requests join: the round state's writes,
the drafter's prompt work (on the rounds' stream: a drafter's chained buffers are rewritten over
every row each round), and they are in the next round queued. One admission is in flight at a
time. A request aborted meanwhile keeps its slot until the join, which frees it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .drafters.base import TargetStates
from .profiling import close_admission, open_admission
from .requests import Request, RequestOutput
from .target_items import PrefillHandle, PrefillItem
from .telemetry import span


@dataclass
class _Admission:
    """An overlapped admission between its launch and its join."""

    reqs: list[Request]  # in slot order
    handle: PrefillHandle
    host_s: float  # host time of its launch
    dropped: dict[int, Request] = field(default_factory=dict)  # slot -> request aborted before the join


class Admissions:
    """Mixed into ``Engine``: reads its ``waiting``, ``running``, ``target``, ``drafter``,
    ``admission`` (``AdmissionPolicy``), ``max_running``, its rounds in flight (``_launched``,
    ``_collected``, ``_held_outputs``) and drafting properties."""

    _admitting: _Admission | None = None

    def _free_slots(self) -> int:
        """Slots a waiting request could take now (free KV slots within the running limit, the
        requests of an admission in flight counted as running)."""
        pending = len(self._admitting.reqs) if self._admitting is not None else 0
        return min(self.target.num_free(), self.max_running - len(self.running) - pending)

    def _intake_deadline(self) -> float | None:
        """When the admission policy's intake window, holding the waiting requests back while
        more arrive, ends (``time.perf_counter`` seconds); None when it holds nothing back."""
        if self.admission.intake_s <= 0.0 or not self.waiting:
            return None
        free = self._free_slots()
        if len(self.waiting) >= free:  # (they fill the batch: nothing to wait for, and no scan of a long queue)
            return None
        return self.admission.intake_deadline(free, len(self.waiting), self.waiting[0].arrival_time,
                                              max(r.arrival_time for r in self.waiting), time.perf_counter())

    def intake_wait_s(self) -> float:
        """Seconds until the admission policy's intake window lets the waiting requests in, when
        nothing else is in flight (no running request, round or admission, no held output): how
        long a caller whose only work is admitting may wait for more arrivals before its next
        ``step`` (0: step now). A step meanwhile would do nothing. A replica waits on its inbox for
        that long (taking arrivals and aborts as they come); ``generate`` and ``stream``, whose
        requests are all queued already, sleep it out."""
        if (self.running or self._admitting is not None or self._launched is not None or self._collected is not None
                or self._held_outputs):
            return 0.0
        end = self._intake_deadline()
        return 0.0 if end is None else max(0.0, end - time.perf_counter())

    def wait_for_intake(self) -> None:
        """Sleep ``intake_wait_s()`` (callers with nothing else to do: every request is queued)."""
        wait = self.intake_wait_s()
        if wait > 0.0:
            time.sleep(wait)

    def _admission_due(self) -> bool:
        """Whether waiting requests are admitted this step (``AdmissionPolicy``; its intake window first)."""
        if self._intake_deadline() is not None:
            return False
        if not self.running:
            return True
        return self.admission.due(self._free_slots(), len(self.waiting), self.max_running,
                                  self.round_wall_s / self.num_rounds if self.num_rounds else 0.0)

    def _overlaps_admission(self) -> bool:
        """Whether this step admits beside the rounds (or has such an admission in flight). A
        structured request next in line is admitted in line (its rounds need the host)."""
        return self._admitting is not None or bool(
            self.running and self.admission.overlap and self.chains_rounds and self.target.overlaps_admission
            and not (self.waiting and self.waiting[0].grammar is not None))

    def _take_waiting(self, overlap: bool = False) -> list[Request]:
        """Pop the waiting requests admitted now into free slots (each gets its slot), in slot
        order; for an overlapped admission (``overlap``), none from a structured request on."""
        admitted: dict[int, Request] = {}
        while (self.waiting and self.target.num_free() and len(self.running) + len(admitted) < self.max_running
               and (admitted or self._admission_due()) and not (overlap and self.waiting[0].grammar is not None)):
            req = self.waiting.popleft()
            req.slot = self.target.allocate()
            admitted[req.slot] = req
            if req.grammar is not None:  # from now on its rounds need the host between them
                self._structured.add(req.request_id)
        return [admitted[s] for s in sorted(admitted)]

    def _launch_prefill(self, reqs: list[Request], overlap: bool = False) -> PrefillHandle:
        """Queue the prefill of ``reqs``; on failure their slots go back (the caller decides what
        happens to the requests)."""
        try:
            items = [PrefillItem(r.slot, r.prompt_ids, r.params, r.logprobs is not None, r.top_logprobs,
                                 tuple(sorted(r.output.stop_ids)),
                                 r.grammar.masks([])[0] if r.grammar is not None else None, r.resumed)
                     for r in reqs]
            with span("prefill", batch_size=len(reqs), overlapped=overlap):
                return self.target.launch_prefill(items, overlap=overlap)
        except BaseException:
            for r in reqs:
                self.target.free(r.slot)
                r.slot = None
                self._structured.discard(r.request_id)
            raise

    def _seed_drafter(self, reqs: list[Request], handle: PrefillHandle) -> list | None:
        """A drafter's work on the prefilled prompts, on the rounds' stream: SpecFormer observes
        the prompts' target states (and, chained, makes its first drafts); a draft model of
        chained rounds fills its own cache and makes its first drafts. Returns the prefill's
        results when they had to be read for it (else None)."""
        results = None
        if self._observes:  # SpecFormer: the prompt's target states (and the first token) seed its context
            if all("next_tokens" in ex for ex in handle.extras):  # on the device: no wait for the prefill
                nexts = [ex["next_tokens"] for ex in handle.extras]
            else:
                results = self.target.collect_prefill(handle)
                nexts = [[*r.prompt_ids[1:], res.tokens[0]] for r, res in zip(reqs, results)]
            self.drafter.observe([TargetStates(r.slot, 0, ex["taps"], nx)
                                  for r, ex, nx in zip(reqs, handle.extras, nexts)])
            if self.chains_rounds:  # their first drafts, on the device, before their first round
                self.target.prime_drafts([r.slot for r in reqs], self.drafter)
        elif self.chains_rounds and self.drafter is not None and self.drafter.drafts_from_verify:
            # a draft model: its own cache filled with the prompts, then their first drafts
            self.drafter.set_draft_limit(self.configured_draft_limit)
            self.drafter.admit({r.slot: list(r.prompt_ids) for r in reqs})
            self.target.prime_drafts([r.slot for r in reqs], self.drafter)
        return results

    def _admit_now(self, reqs: list[Request]) -> tuple[PrefillHandle, list | None]:
        """An admission in line: prefill, the drafter's prompt work; returns ``(handle, results)``
        (the results when the drafter's work had to read them, else None)."""
        t0 = time.perf_counter()
        window = open_admission()  # (a bench timing the admissions' device work)
        handle = self._launch_prefill(reqs)
        results = self._seed_drafter(reqs, handle)
        close_admission(window)
        self.admission.note_prefill(time.perf_counter() - t0)
        return handle, results

    def _start_admission(self, reqs: list[Request]) -> None:
        """Launch an overlapped admission of ``reqs`` (their prefill beside the rounds)."""
        t0 = time.perf_counter()
        handle = self._launch_prefill(reqs, overlap=True)
        self._admitting = _Admission(reqs, handle, time.perf_counter() - t0)

    def _join_admission(self, wait: bool) -> tuple[list[Request], PrefillHandle, list | None] | None:
        """The admission in flight joins if its prefill is done (or ``wait``: nothing else would
        run): the round state, the drafter's prompt work, its live requests running. Returns
        ``(requests, handle, results)`` for their first tokens (None while it is not done)."""
        adm = self._admitting
        if adm is None or not (wait or self.target.prefill_ready(adm.handle)):
            return None
        t0 = time.perf_counter()
        window = open_admission()
        self.target.join_prefill(adm.handle)
        results = self._seed_drafter(adm.reqs, adm.handle)  # (aborted ones too: their slots are still theirs)
        close_admission(window)
        self._admitting = None
        self.admission.note_prefill(adm.host_s + time.perf_counter() - t0)
        self.running.update((r.slot, r) for r in adm.reqs if r.slot not in adm.dropped)
        for req in adm.dropped.values():  # (after: a release forgets the request's slot)
            self._release(req)
        return adm.reqs, adm.handle, results

    def _holds_for_admission(self, req: Request) -> bool:
        """``_release`` of a request whose overlapped prefill is in flight: its slot is freed at the join."""
        adm = self._admitting
        if adm is None or all(r.slot != req.slot for r in adm.reqs):  # (a slot is one request's until freed)
            return False
        adm.dropped[req.slot] = req
        return True

    def _admit(self, reqs: list[Request], results: list) -> list[RequestOutput]:
        """Append the prefill's first token of each admitted request (stop rules included); the
        ones it does not finish run. Requests aborted since (no longer known) are skipped."""
        outputs = []
        for req, res in zip(reqs, results):
            if self.requests.get(req.request_id) is not req:
                continue
            if req.grammar is not None:
                req.grammar.advance(res.tokens[:1])
            self._append(outputs, req, res.tokens[:1], logprobs=res.logprobs, top=res.top_logprobs)
            if not req.finished:
                self.running[req.slot] = req
        return outputs
