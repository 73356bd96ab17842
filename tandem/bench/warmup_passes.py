"""The bench's warm-up before a timed pass: which prompts a warm-up pass runs (``warmup_share``)
and how many passes run (``warmup_passes_then_timed``)."""

from __future__ import annotations

from collections.abc import Callable

from ..models.graphs import CapturedCall


WARMUP_MODES = ("full", "short", "none", "server")


def warmup_share(items: list, batch_size: int, mode: str = "full") -> list:
    """The prompts a warm-up pass runs before the timed pass over ``items``.

    ``full`` (default): all of them. Greedy decoding and the scheduler are deterministic, so the
    timed pass then meets only CUDA graphs (batch bucket x tokens per row x context bucket) and
    compiled shapes the warm-up already made: a capture or a compile never lands inside the timing
    (a policy whose width moves may meet new shapes in a second pass: the in-process bench repeats
    the warm-up while it captures, ``warmup_passes_then_timed``).
    ``short``: the first ``max(2 * batch_size, 4)`` (the batch fills and drains through every batch
    bucket, but context buckets first met later are captured inside the timed pass; about half the
    wall time, for quick runs). Measured on the H200 (2026-12-01, commit 9377310): at batch 16 with
    ``short`` a fresh engine's captures and its batch-1 compile fell inside the timed pass.
    ``none``: no warm-up pass (a CPU run with nothing to capture or compile, or a check of outputs
    rather than speed: timings then include first-call costs, and an online threshold starts cold).
    ``server``: as ``full``, after capturing every decode-round shape of the engine first, as a
    verifier replica does before it serves (``tandem.warmup.capture_round_shapes``, in process with
    CUDA graphs and device-chained rounds; a distributed run's replica always does): shapes a pass
    meets only in some runs (larger admission groups, other context buckets) are made before any
    pass, so in-process and distributed runs start from the same graphs.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in WARMUP_MODES:
        raise ValueError(f"warm-up mode {mode!r}: expected one of {', '.join(WARMUP_MODES)}")
    if mode == "none":
        return []
    return list(items[:max(2 * batch_size, 4)]) if mode == "short" else list(items)


MAX_WARMUP_PASSES = 3


def warmup_passes_then_timed(warm: list, timed: list, max_passes: int = MAX_WARMUP_PASSES,
                             captured: Callable[[], int] = lambda: CapturedCall.made):
    """Yield ``("warm-up", warm)`` until a warm-up pass captures no CUDA graph (``captured()``, by
    default this process's ``CapturedCall.made``, unchanged across it; a distributed run counts its
    replicas' captures) or ``max_passes`` ran, then ``("timed", timed)``; no warm-up pass when
    ``warm`` is empty. The caller runs each pass before asking for the next.

    One full warm-up meets every shape of a fixed draft length, but a policy whose width moves
    with the batch and with the acceptance seen so far (``batch-width``, the predictor's) meets
    some (batch bucket, width, context bucket) graphs for the first time in the next pass: measured
    on an H100 (2026-12-06, ab586f2), 3-4 such captures inside a 1.5 s timed pass at batch 128
    cost 10-24% of its throughput. A server captures them once in its first minutes; the bench
    keeps warming until the shapes stop being new, as a server's steady state has.
    """
    if warm:
        for _ in range(max_passes):
            before = captured()
            yield "warm-up", warm
            if captured() == before:
                break
    yield "timed", timed
