"""What a decode round costs beyond its GPU work: host syncs, graph launches, GPU-busy time.

- ``HostSyncCounter`` counts the places where the host reads a device tensor (``tolist``,
  ``item``, ``cpu``, ``int(t)``, ``bool(t)``, ...): each one blocks until the GPU has finished
  everything queued before it; and the waits code reports with ``note_blocking_wait`` (an event
  waited on before a pinned copy is read). It is a ``TorchFunctionMode``, so it sees every read made through
  torch, whoever makes it; it slows the host while active (use it in a profiling pass, not in a
  timed one).
- ``blocked_wait_s`` is the host's total time blocked in waits run inside ``blocking_wait`` (the
  round's result wait; always on: two clock reads a wait), so a round's host work is its wall
  time less that: a round whose host time reaches its GPU time is bound by the host, not the
  device.
- ``tandem.models.graphs.CapturedCall.replays`` counts CUDA-graph launches.
- ``gpu_work`` sums the device time of the kernels and copies ``torch.profiler`` recorded, and counts them.
- ``StepTimeline`` puts CUDA events around each decode/verify step graph's launch: how long the
  GPU spends on a step's graph (the gaps between its kernels included, which busy time leaves
  out), how long it idles between steps (the next one not queued yet: the host is behind), and
  the host's time inside the launch call (a launch may block, e.g. behind a still-running replay).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "__complex__"}


def _is_read(name: str, args: tuple, kwargs: dict) -> bool:
    on_cpu = args[0].device.type == "cpu"
    if name in ("cpu", "numpy"):
        return not on_cpu  # a no-op copy on a CPU tensor (numpy views it)
    if name in _READS:
        return True
    if name == "to" and not on_cpu:  # t.to("cpu") / t.to(device=torch.device("cpu"))
        dev = kwargs.get("device", args[1] if len(args) > 1 else None)
        return isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu"
    return False


_ACTIVE: list["HostSyncCounter"] = []


_BLOCKED_S = [0.0]  # the process's time blocked in ``blocking_wait`` (s)


def note_blocking_wait(what: str = "event.synchronize") -> None:
    """Record a blocking wait that is no tensor read (``torch.cuda.Event.synchronize`` before
    reading a pinned copy): code that waits so calls this, and every active counter counts it."""
    for counter in _ACTIVE:
        counter.count += 1
        counter.sites[what] = counter.sites.get(what, 0) + 1


@contextmanager
def blocking_wait(what: str = "event.synchronize"):
    """Around a wait for the device (``with blocking_wait(): event.synchronize()``): counted as
    ``note_blocking_wait`` counts it, and its duration added to ``blocked_wait_s``."""
    note_blocking_wait(what)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _BLOCKED_S[0] += time.perf_counter() - t0


def blocked_wait_s() -> float:
    """Seconds this process has spent blocked in ``blocking_wait`` so far (a running total: take
    the difference over a span)."""
    return _BLOCKED_S[0]


class HostSyncCounter(TorchFunctionMode):
    """Count host reads of tensors that live on ``device_type`` while active.

    Args:
        device_type: "cuda" on a GPU; "cpu" counts every read of a CPU tensor's values (on a
            CPU-only engine the target's tensors are CPU tensors, so a per-token host loop shows
            up as reads too; ``.cpu()`` of a CPU tensor is no read).

    Attributes:
        count: reads seen; ``sites``: how many per operation name.
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.count = 0
        self.sites: dict[str, int] = {}

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and args[0].device.type == self.device_type \
                and _is_read(name, args, kwargs):
            self.count += 1
            self.sites[name] = self.sites.get(name, 0) + 1
        return func(*args, **kwargs)


def gpu_work(prof) -> tuple[float, int]:
    """``(busy ms, operations)``: the device time (ms) of every CUDA kernel, memcpy and memset a
    ``torch.profiler.profile`` run recorded (CUPTI traces kernels inside CUDA graphs too; overlapping
    work is counted once per kernel, so on one stream this is the GPU-busy time), and how many
    there were (inside a graph, each one is followed by a gap before the next)."""
    total_us, count = 0.0, 0
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            total_us += evt.device_time
            count += 1
    return total_us / 1e3, count


_TIMELINES: list["StepTimeline"] = []


def step_timeline() -> "StepTimeline | None":
    """The ``StepTimeline`` recording now, if any (``ModelRunner`` asks at each step graph's launch)."""
    return _TIMELINES[-1] if _TIMELINES else None


def open_admission(side: bool = False) -> "tuple[StepTimeline, torch.cuda.Event, bool] | None":
    """Mark the start of an admission's device work on the current stream for the recording
    ``StepTimeline`` (None when none records); give the result to ``close_admission`` after its
    last device work there. ``side``: work beside the rounds (an overlapped prefill), recorded
    apart from the work that stops them."""
    timeline = step_timeline()
    return None if timeline is None else (timeline, timeline.open_admission(), side)


def close_admission(mark: "tuple[StepTimeline, torch.cuda.Event, bool] | None") -> None:
    if mark is not None:
        mark[0].close_admission(mark[1], mark[2])


class StepTimeline:
    """Record the step graphs launched while active (``with StepTimeline() as tl:``), CUDA only.

    Per launch, an event before and after the graph on the stream, and the host's time in the
    launch call. After the span (the device synchronised: ``summary`` does it):

    - span: GPU time from a step graph's start to its end, the gaps between its kernels included;
    - idle: GPU time from one step graph's end to the next one's start (the copies between them,
      a few microseconds, included): the device waiting for the host;
    - launch: host time inside the launch call;
    - admission: GPU time from an admission's first device work on the rounds' stream to its
      last (``Engine`` marks them: the prefill, a drafter's prompt work and first drafts, and any
      wait for the host in between), which lies between step graphs and so inside their idle
      time; an overlapped prefill's own window, on the admission stream beside the rounds, is
      recorded apart (``side_admissions``).

    Attributes:
        marks: ``(start event, end event)`` per launch; ``launch_s``: host seconds in launches;
        admissions, side_admissions: ``(start event, end event)`` per admission window.
    """

    def __init__(self) -> None:
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.admissions: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.side_admissions: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.launch_s = 0.0

    def open_admission(self) -> torch.cuda.Event:
        """An event on the stream before an admission's device work (pass it to ``close_admission``)."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def close_admission(self, start: torch.cuda.Event, side: bool = False) -> None:
        """An event after the admission's device work: the window from ``start`` is recorded
        (in ``side_admissions`` for work beside the rounds)."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        (self.side_admissions if side else self.admissions).append((start, end))

    def admission_ms(self, side: bool = False) -> float:
        """GPU ms inside the recorded admission windows on the rounds' stream (``side``: beside
        them), in all (0 without any); waits for the device."""
        windows = self.side_admissions if side else self.admissions
        if not windows:
            return 0.0
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in windows)

    def __enter__(self) -> "StepTimeline":
        _TIMELINES.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _TIMELINES.remove(self)

    def launch(self, replay):
        """``replay()`` between two recorded events, timed on the host; returns its result."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        out = replay()
        self.launch_s += time.perf_counter() - t0
        end.record()
        self.marks.append((start, end))
        return out

    def _idles(self) -> list[float]:
        """GPU idle ms between consecutive step graphs (the device synchronised first)."""
        torch.cuda.synchronize()
        return [e.elapsed_time(s) for (_, e), (s, _) in zip(self.marks, self.marks[1:])]

    def idle_median_ms(self) -> float:
        """The median GPU idle time between consecutive step graphs (ms; NaN with fewer than two
        launches): the steady gap a round leaves, where the mean also carries rare long ones (an
        admission's prefill). Waits for the device."""
        idles = sorted(self._idles()) if len(self.marks) > 1 else []
        return idles[len(idles) // 2] if idles else math.nan

    def summary(self) -> tuple[float, float, float]:
        """``(span_ms, idle_ms, launch_ms)`` per launch, means (NaN without launches); waits for
        the device."""
        if not self.marks:
            return math.nan, math.nan, math.nan
        idles = self._idles()
        spans = [s.elapsed_time(e) for s, e in self.marks]
        n = len(self.marks)
        return sum(spans) / n, sum(idles) / len(idles) if idles else math.nan, self.launch_s * 1e3 / n
