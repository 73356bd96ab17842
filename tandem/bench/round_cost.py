"""Per-round cost of a configuration: wall time against GPU-busy time, graph launches, host syncs.

A round should cost its GPU work and nothing more. ``measure_round_cost`` runs one full batch of
prompts twice on a warm engine (three times when the first run captured CUDA graphs: all at once,
the batch meets shapes a continuously batched run may not have had, and a capture is not a
round's cost): once plainly (wall time per decode round, the host's share of it,
CUDA-graph launches per round), once under ``torch.profiler`` with a ``HostSyncCounter``
(GPU-busy time per round: the device time of every kernel and copy; blocking host reads per
round). Greedy decoding (or a seeded sampling: every draw a function of the seed and the
position) makes both runs the same rounds, so ``round_wall_ms / round_gpu_ms`` is the share of a round that is not GPU
work. The host's share, ``round_host_ms``, is the wall time less the time the host spent blocked
waiting for the round's results (``tandem.profiling.blocked_wait_s``): when it reaches
``round_gpu_ms`` the rounds are bound by the host's work, not the GPU's. Other blocking reads in a
round (a host-drafted draft model's rows, sampled token trees walked on the host: ``host_syncs_per_round``
above 1) are not taken off, so there it is an upper bound that includes some GPU time; nor is a
graph launch that blocks (``step_launch_ms``). The plain run also puts CUDA events around each
step graph (``tandem.profiling.StepTimeline``): ``step_gpu_span_ms`` is the GPU's time on a
step's graph, the gaps between its kernels included (busy time leaves them out), and
``step_gpu_idle_ms`` the GPU's idle time between one step's graph and the next: near 0 when the
host keeps the device fed, whatever ``round_host_ms`` says. Prefill (the first step) is outside
every measurement.

With ``TANDEM_KERNEL_TABLES=DIR`` in the environment, the profiled run's table of operators and
kernels by total GPU time (``torch.profiler``'s ``key_averages``) is also written to
``DIR/<label>.txt`` (``tandem bench`` labels it ``<configuration>-b<batch>``): where a round's
GPU time goes.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine import Engine
from ..models.runner import CapturedCall
from ..profiling import HostSyncCounter, StepTimeline, blocked_wait_s, gpu_work
from ..sampling import SamplingParams


@dataclass(frozen=True)
class RoundCost:
    """Per decode round, averaged over the rounds of one batch (ms; counts per round).

    Attributes:
        rounds: decode rounds measured.
        round_wall_ms: wall time per round (draft, verify, observe, host work).
        round_gpu_ms: GPU-busy time per round (NaN on CPU).
        round_host_ms: host time per round not spent waiting for the round's results (the wall
            time on a CPU, where nothing waits for a device; an upper bound where
            ``host_syncs_per_round`` > 1, see the module docstring).
        graph_launches_per_round: CUDA-graph replays per round (0 without graphs).
        host_syncs_per_round: blocking host reads of device tensors per round.
        step_gpu_span_ms: GPU time per decode/verify step graph, start to end (NaN without
            CUDA graphs).
        step_gpu_idle_ms: GPU idle time between consecutive step graphs (NaN without graphs).
        step_launch_ms: host time per step graph's launch call (NaN without graphs).
        gpu_ops_per_round: kernels, memcpys and memsets per round (NaN on CPU): with the span,
            what the gaps between them cost.
        round_cost_captures: graphs the batch's first run captured (then run again: the figures
            are the second run's); 0 when the first run met only graphs already made.
    """

    rounds: int
    round_wall_ms: float
    round_gpu_ms: float
    round_host_ms: float
    graph_launches_per_round: float
    host_syncs_per_round: float
    step_gpu_span_ms: float = math.nan
    step_gpu_idle_ms: float = math.nan
    step_launch_ms: float = math.nan
    gpu_ops_per_round: float = math.nan
    round_cost_captures: int = 0


def _admit_then(engine: Engine, prompt_ids: list[list[int]], params: SamplingParams, body) -> tuple[int, float]:
    for ids in prompt_ids:
        engine.add_request(prompt_ids=ids, params=params, final_only=True)  # as generate's, the timed run's
    engine.wait_for_intake()  # (an admission intake window: every request is queued already)
    engine.step()  # prefill and the first round: not measured
    rounds0 = engine.num_rounds
    body_out = body()
    return engine.num_rounds - rounds0, body_out


def _drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.wait_for_intake()
        for out in engine.step():
            if out.finished:
                engine.completion(out.request_id)


def measure_round_cost(engine: Engine, texts: list[str] | list[list[int]], params: SamplingParams,
                       label: str = "round") -> RoundCost:
    """Measure the rounds of ``texts`` run as one batch (see the module docstring).

    Args:
        engine: a warm engine (graphs captured) with the configuration set.
        texts: prompts, at most the engine's running-batch limit: texts, or token ids already
            encoded (``tandem bench`` passes the ones its timed pass ran).
        params: greedy sampling parameters, or sampled ones with a seed (every draw a function of
            the seed and the position, so both runs make the same draws and the same rounds).
        label: the kernel table's file name (``TANDEM_KERNEL_TABLES``; see the module docstring).

    Raises:
        ValueError: sampled ``params`` without a seed (the two runs would not make the same rounds).
    """
    if not params.greedy and params.seed is None:
        raise ValueError("round cost is measured with greedy decoding or a seeded sampling")
    prompt_ids = [engine.encode_prompt(t) if isinstance(t, str) else list(t) for t in texts]
    dev = engine.runner.device
    cuda = dev.type == "cuda"

    timeline = None

    def timed() -> tuple[float, float, int, int]:
        nonlocal timeline
        timeline = StepTimeline() if cuda else None
        launches0, made0 = CapturedCall.replays, CapturedCall.made
        if cuda:
            torch.cuda.synchronize(dev)
        wall0, blocked0 = engine.round_wall_s, blocked_wait_s()
        with timeline if timeline is not None else contextlib.nullcontext():
            _drain(engine)
        return (engine.round_wall_s - wall0, blocked_wait_s() - blocked0, CapturedCall.replays - launches0,
                CapturedCall.made - made0)

    # one batch admitted at once meets shapes (batch bucket x context bucket) a continuously batched
    # run may not have: a run that captured graphs is run again, and the second one is measured
    rounds, (wall_s, blocked_s, launches, captured) = _admit_then(engine, prompt_ids, params, timed)
    if captured:
        rounds, (wall_s, blocked_s, launches, _) = _admit_then(engine, prompt_ids, params, timed)
    span_ms, idle_ms, launch_ms = timeline.summary() if timeline is not None else (math.nan,) * 3
    counter = HostSyncCounter(dev.type)

    def profiled() -> tuple[float, float]:
        if not cuda:
            with counter:
                _drain(engine)
            return math.nan, math.nan
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(dev)
        rounds0 = engine.num_rounds
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, counter:
            _drain(engine)
            torch.cuda.synchronize(dev)
        tables = os.environ.get("TANDEM_KERNEL_TABLES")
        if tables:
            Path(tables).mkdir(parents=True, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "round"
            averages = prof.key_averages()
            (Path(tables) / f"{name}.txt").write_text(
                f"{engine.num_rounds - rounds0} rounds\n\nby GPU time\n"
                + averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
                + "\n\nby host time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=25,
                                                          max_name_column_width=70))
        return gpu_work(prof)

    rounds_p, (busy_ms, ops) = _admit_then(engine, prompt_ids, params, profiled)
    n = max(rounds, 1)
    return RoundCost(rounds, wall_s * 1e3 / n, busy_ms / max(rounds_p, 1), max(wall_s - blocked_s, 0.0) * 1e3 / n,
                     launches / n, counter.count / max(rounds_p, 1), span_ms, idle_ms, launch_ms,
                     ops / max(rounds_p, 1), captured)
