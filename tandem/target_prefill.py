"""A ``LocalTarget``'s prefill: the prompts' forward and first tokens, the device round state's
admission, and the same work beside the rounds on a second CUDA stream (an overlapped admission).

An overlapped admission runs the forward, the first tokens' sampling and their copy to the host
on ``ModelRunner.admission_stream`` while the main stream goes on with the rounds of the running
requests. What it writes there is disjoint from what a round writes: the admitted slots' K/V rows
(a round's idle rows write only their scratch position), their sampling settings (a round reads
those of idle rows and discards the result) and its own outputs. The round state (each slot's
last token and length) is the exception: a round rewrites every row of it, idle ones with their
old values, so a write to an idle row from the other stream could be lost. ``join_prefill``
makes that write on the main stream, after the prefill's event, and hands the prefill's output
tensors to the main stream (``Tensor.record_stream``), whose later work reads them (a drafter's
observe of the prompts' states).
"""

from __future__ import annotations

import dataclasses

import torch

from .logprobs import logprob_columns, read_logprob_columns, wants_logprobs
from .models.transfer import HostCopy, to_device
from .profiling import close_admission, open_admission
from .structured import step_masks
from .target_items import PrefillHandle, PrefillItem, TargetResult
from .verify import sample_tokens


class LocalPrefill:
    """``LocalTarget``'s prefill half (a mixin: it uses the target's ``runner``, ``cache``,
    ``sampling``, ``state``, ``_info`` and ``_pinned``)."""

    @property
    def overlaps_admission(self) -> bool:
        """Whether ``launch_prefill(..., overlap=True)`` runs beside the rounds
        (``ModelRunner.admission_stream``)."""
        return self.runner.admission_stream is not None

    def launch_prefill(self, items: list[PrefillItem], overlap: bool = False) -> PrefillHandle:
        """See ``Target.launch_prefill``: the prompts' forward, the first tokens (sampled on the
        device), the device round state's admission, and one non-blocking copy of the first tokens
        (and their log-probabilities) to the host; every host-to-device copy goes through pinned
        memory, so nothing here waits for a round in flight.

        With ``overlap`` where the runner allows it (``overlaps_admission``), the work runs on the
        admission stream and the round state is not written yet: the caller polls
        ``prefill_ready`` and calls ``join_prefill`` before any round of these slots (the module
        docstring). The first admission that makes the sampling settings allocate their logit
        adjustments (``SlotSampling.adjust``, which every later round reads) runs in line.

        Raises:
            CacheFullError: a prompt does not fit its slot; ValueError: an empty prompt.
        """
        stream = self.runner.admission_stream if overlap else None
        if stream is not None and self.sampling.adjust is None and any(it.params.adjusts_logits for it in items):
            stream = None
        if stream is None:
            handle, admit = self._prefill(items, self._pinned)
            self.state.admit(*admit)
            return handle
        with torch.cuda.stream(stream):  # (the admission window of a bench's timeline: this stream's)
            window = open_admission(side=True)
            # first tokens read back rounds later: pinned buffers apart from the rounds' ring
            handle, admit = self._prefill(items, self._pinned_admission)
            close_admission(window)
            handle.ready = torch.cuda.Event()
            handle.ready.record(stream)
        handle.admit = admit
        return handle

    def prefill_ready(self, handle: PrefillHandle) -> bool:
        """Whether an overlapped prefill's device work is done (never waits); True for one run in line."""
        return handle.ready is None or handle.ready.query()

    def join_prefill(self, handle: PrefillHandle) -> None:
        """After an overlapped ``launch_prefill``: the main stream waits for the prefill (no wait
        once ``prefill_ready``), takes its output tensors over and writes the round state of its
        slots. Idempotent; a no-op for a prefill run in line."""
        if handle.admit is None:
            return
        index, firsts, prompts, max_new = handle.admit
        if index.is_cuda:
            main = torch.cuda.current_stream()
            main.wait_event(handle.ready)
            for t in (index, firsts, *(v for ex in handle.extras for v in ex.values())):
                t.record_stream(main)  # once freed, not reused on the admission stream before main has read them
        self.state.admit(index, firsts, prompts, max_new)
        handle.admit = None

    def _prefill(self, items: list[PrefillItem], pinned: dict) -> tuple[PrefillHandle, tuple]:
        """The prefill's device work on the current stream; returns its handle (its first tokens
        copied through ``pinned``, a ``HostCopy`` ring) and the arguments of its ``RoundState.admit``."""
        order = sorted(range(len(items)), key=lambda i: items[i].slot)
        slots = [items[i].slot for i in order]
        self.sampling.admit(slots, [items[i].params for i in order], [items[i].prompt_ids for i in order],
                            [items[i].stop_ids for i in order], [items[i].resumed for i in order])
        taps: dict[int, torch.Tensor] | None = {} if self.runner.config.taps else None
        prompts = {it.slot: it.prompt_ids for it in items}
        if self.runner.config.fixed_step_tokens:  # exact kernels: one prompt per forward (RunnerConfig)
            logits = torch.cat([self.runner.prefill({s: prompts[s]}, taps) for s in sorted(prompts)])
        else:
            logits = self.runner.prefill(prompts, taps)  # rows in ascending slot order
        dev = logits.device
        index = to_device(torch.tensor(slots, dtype=torch.int64), dev)
        positions = to_device(torch.tensor([len(prompts[s]) for s in slots], dtype=torch.int64), dev)
        sampling = self.sampling.rows(self.cache.num_slots, slots).rows(index)
        allowed = step_masks([items[i] for i in order], 1, self._info.vocab_size, dev)
        if allowed is not None:
            sampling = dataclasses.replace(sampling, allowed=allowed)
        firsts = sample_tokens(logits, positions, sampling)
        self.sampling.record(firsts[:, None], torch.ones_like(firsts[:, None], dtype=torch.bool), index)
        admit = (index, firsts, [prompts[s] for s in slots],
                 [min(items[i].params.max_tokens, self.cache.capacity - len(items[i].prompt_ids)) for i in order])
        out = firsts[:, None].double()
        if any(wants_logprobs(it) for it in items):
            out = torch.cat([out, logprob_columns(logits[:, None], firsts[:, None],
                                                  any(it.top_logprobs for it in items))], dim=1)
        extras = [{} for _ in items]
        if taps:  # what a SpecFormer head's observe needs, all on the device: no wait for the first tokens
            nexts = self._next_tokens(slots, prompts, firsts)
            extras = [{"taps": taps[it.slot], "next_tokens": nexts[it.slot]} for it in items]
        return PrefillHandle(extras, (items, order, extras, HostCopy(out, pinned))), admit

    @staticmethod
    def _next_tokens(slots: list[int], prompts: dict[int, list[int]], firsts: torch.Tensor) -> dict[int, torch.Tensor]:
        """Slot -> ``[len(prompt)]`` int64 on the device: each prompt position's next token, i.e.
        the prompt shifted by one and ended by the first generated token (``firsts`` ``[n]``, row
        i for ``slots[i]``, still on the device: written there, never read back)."""
        lens = [len(prompts[s]) for s in slots]
        flat = to_device(torch.tensor([t for s in slots for t in prompts[s][1:] + [0]], dtype=torch.int64),
                         firsts.device)
        ends = to_device(torch.tensor(lens, dtype=torch.int64).cumsum(0) - 1, firsts.device)
        flat[ends] = firsts
        return dict(zip(slots, flat.split(lens)))

    def collect_prefill(self, handle: PrefillHandle) -> list[TargetResult]:
        """See ``Target.collect_prefill``: waits for the first tokens' copy."""
        items, order, extras, copy = handle.payload
        host = copy.wait()
        results: list[TargetResult | None] = [None] * len(items)
        for row, i in enumerate(order):
            lp = top = None
            if wants_logprobs(items[i]):
                lp, top = read_logprob_columns(host[row], 1, 1, 1, items[i].top_logprobs)
            results[i] = TargetResult([int(host[row][0])], logprobs=lp, extras=extras[i], top_logprobs=top)
        return results  # type: ignore[return-value]
