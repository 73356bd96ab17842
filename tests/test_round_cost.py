"""What a decode round costs on the host: blocking reads of the target's tensors per round.

Engine v2's rule: a verify round makes one blocking device-to-host copy (accepted lengths and
tokens together); a per-token host loop (``float(p[tok])``, ``.tolist()`` per sequence) would
show up here as reads that grow with the batch and the draft length. On a CPU engine every
tensor read counts (the target's tensors are CPU tensors), so the count is an upper bound of
what the same round does on a GPU.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tandem.drafters import DraftModelDrafter, NgramDrafter
from tandem.engine import Engine
from tandem.models import load_checkpoint
from tandem.models.runner import RunnerConfig
from tandem.profiling import HostSyncCounter, blocked_wait_s, blocking_wait
from tandem.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13, 14, 15], [3, 4, 3, 4, 3, 4], [7] * 10]


def _decode_reads(engine: Engine, params: SamplingParams) -> tuple[int, int, dict]:
    """(host reads, decode rounds, reads per site) over the decode rounds of four requests."""
    for p in PROMPTS:
        engine.add_request(prompt_ids=p, params=params)
    engine.step()  # admission: prefill + first tokens (one read), then the first round
    rounds0 = engine.num_rounds
    with HostSyncCounter("cpu") as counter:
        while engine.has_unfinished() and not engine.waiting:
            engine.step()
    return counter.count, engine.num_rounds - rounds0, counter.sites


def test_blocking_wait_is_counted_and_timed():
    """A wait inside ``blocking_wait`` is one sync to every active counter and adds its duration to
    the process's blocked time (what ``round_host_ms`` takes off a round's wall time); time outside
    it adds nothing."""
    import time

    before = blocked_wait_s()
    with HostSyncCounter("cpu") as counter:
        t0 = time.perf_counter()
        with blocking_wait("test.wait"):
            time.sleep(0.02)
        waited = time.perf_counter() - t0
        time.sleep(0.02)  # host work, not a wait
    blocked = blocked_wait_s() - before
    assert counter.count == 1 and counter.sites == {"test.wait": 1}
    assert 0.02 <= blocked <= waited, (blocked, waited)  # (a loaded machine may oversleep: no fixed upper bound)
    with pytest.raises(RuntimeError), blocking_wait():  # a failed wait still counts its time
        raise RuntimeError("device lost")
    assert blocked_wait_s() - before >= blocked


def _drafter(kind: str, target_dir: str):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "specformer":
        from test_specformer import _random_head

        from tandem.drafters.specformer import SpecFormerDrafter

        return SpecFormerDrafter(_random_head(load_checkpoint(target_dir).config, lookup_tokens=True,
                                              context_next_token=True))
    return None


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("drafter", ["none", "ngram", "specformer"])
def test_one_blocking_read_per_round(target_dir, drafter, temperature):
    """Target-only, n-gram and SpecFormer rounds (chained: SpecFormer drafts inside the round),
    greedy and sampled: at most one blocking read per decode round."""
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    engine = Engine(target_dir, cfg, drafter=_drafter(drafter, target_dir), num_draft_tokens=4)
    assert engine.chains_rounds
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=temperature, top_k=3, top_p=0.9, seed=1)
    reads, rounds, sites = _decode_reads(engine, params)
    assert rounds >= 5
    assert reads <= rounds, f"{reads} host reads in {rounds} rounds: {sites}"
    if drafter != "none":
        assert engine.stats.num_drafted > 0  # speculation really ran


def test_host_drafted_specformer_reads_are_counted(target_dir):
    """The host-drafted SpecFormer path (kept for the context-aware policy) reads the head's
    drafts back each round: two reads a round, counted; the chained path above makes one."""
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    engine = Engine(target_dir, cfg, drafter=_drafter("specformer", target_dir), num_draft_tokens=4)
    engine.chained_rounds = False
    reads, rounds, sites = _decode_reads(engine, SamplingParams(max_tokens=24, ignore_eos=True))
    assert rounds >= 5 and rounds < reads <= 2 * rounds, sites


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_draft_model_reads_are_counted(target_dir, tiny_checkpoint, temperature):
    """In chained rounds the draft model drafts inside the round that verifies: at most one
    blocking read a round, greedy and sampled. Host-drafted rounds (kept for draft policies that
    score on the host) draft step by step: their reads are counted (per draft position, not per
    token of the batch), which the bench reports as host_syncs_per_round."""
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    draft = load_checkpoint(tiny_checkpoint("llama", with_tokenizer=True, seed=1))
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=temperature, top_k=3, seed=1)
    engine = Engine(target_dir, cfg, drafter=DraftModelDrafter(draft, cfg), num_draft_tokens=3)
    assert engine.chains_rounds
    reads, rounds, sites = _decode_reads(engine, params)
    assert rounds >= 5 and reads <= rounds, f"{reads} host reads in {rounds} rounds: {sites}"
    assert engine.stats.num_drafted > 0
    engine = Engine(target_dir, cfg, drafter=DraftModelDrafter(draft, cfg), num_draft_tokens=3)
    engine.chained_rounds = False
    reads, rounds, sites = _decode_reads(engine, params)
    per_round = reads / rounds
    assert 1 < per_round <= 1 + 3 * 3, sites  # the verify copy + at most 3 reads per draft position


def test_specformer_admission_reads_nothing_before_the_round_is_queued(target_dir):
    """Requests admitted with a SpecFormer head, alone and while others run: the head's context
    starts from the prompt's tapped states and next tokens on the device (the prefill's first token
    is not read back first), so each admitting step queues its round before it reads the prefill's
    results, and the device is never left idle waiting for the host."""
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    engine = Engine(target_dir, cfg, drafter=_drafter("specformer", target_dir), num_draft_tokens=4)
    calls: list[str] = []
    for name in ("collect_prefill", "launch_chained"):
        method = getattr(engine.target, name)

        def spy(*args, _name=name, _method=method, **kwargs):
            calls.append(_name)
            return _method(*args, **kwargs)

        setattr(engine.target, name, spy)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for p in PROMPTS[:2]:
        engine.add_request(prompt_ids=p, params=params)
    engine.step()
    assert calls == ["launch_chained", "collect_prefill"]
    engine.step()
    for p in PROMPTS[2:]:
        engine.add_request(prompt_ids=p, params=params)
    calls.clear()
    engine.step()  # admits the two while the first two run
    assert calls == ["launch_chained", "collect_prefill"]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_drafted > 0


TEXTS = ["Say something about rivers.", "Count to ten.", "Name three colours.", "What is a graph?"]


def test_step_timeline_is_not_measured_on_cpu(target_dir):
    """A CPU engine has no step graphs to time: the round cost's step figures are NaN, the rest set."""
    from tandem.bench.round_cost import measure_round_cost

    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128))
    cost = measure_round_cost(engine, TEXTS, SamplingParams(max_tokens=12, ignore_eos=True))
    assert cost.rounds > 0 and cost.round_wall_ms > 0
    assert all(math.isnan(x) for x in (cost.step_gpu_span_ms, cost.step_gpu_idle_ms, cost.step_launch_ms,
                                       cost.gpu_ops_per_round))


def test_round_cost_runs_the_batch_again_when_its_first_run_captured_graphs(target_dir, monkeypatch):
    """A batch admitted all at once can meet shapes the warm-up did not (a graph captured inside
    the measured run would count as round cost): the batch then runs again and the second run is
    measured; without captures it runs once. (A CPU engine makes no graphs: a capture is counted in
    by hand.)"""
    from tandem.bench import round_cost
    from tandem.models.graphs import CapturedCall

    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    drains = []
    real_drain = round_cost._drain

    def drain(eng):
        drains.append(eng.num_rounds)
        if len(drains) == 1:  # the first run "captures" one graph
            monkeypatch.setattr(CapturedCall, "made", CapturedCall.made + 1)
        real_drain(eng)

    monkeypatch.setattr(round_cost, "_drain", drain)
    cost = round_cost.measure_round_cost(engine, TEXTS, params)
    assert len(drains) == 3 and cost.round_cost_captures == 1  # timed twice, then profiled
    assert cost.rounds == 11  # 12 tokens: the prefill's, then 11 rounds (the measured run's own)
    drains.clear()
    monkeypatch.setattr(round_cost, "_drain", real_drain)
    assert round_cost.measure_round_cost(engine, TEXTS, params).round_cost_captures == 0


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["none", "specformer"])
def test_step_timeline_measures_each_step_graph_on_cuda(target_dir, drafter):
    """On the GPU the round cost carries each step graph's GPU span (> its busy time: the gaps
    between kernels count), the GPU's idle time between step graphs and the host's launch time,
    one step graph a chained round."""
    from tandem.bench.round_cost import measure_round_cost

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = RunnerConfig(device="cuda", max_batch_size=4, max_seq_len=128, cuda_graphs=True)
    engine = Engine(target_dir, cfg, drafter=_drafter(drafter, target_dir), num_draft_tokens=4)
    measure_round_cost(engine, TEXTS, params)  # captures the graphs
    cost = measure_round_cost(engine, TEXTS, params)
    assert cost.round_cost_captures == 0  # the same batch again: every graph made
    assert not math.isnan(cost.step_gpu_idle_ms) and cost.graph_launches_per_round == pytest.approx(1.0, abs=0.2)
    assert cost.step_gpu_span_ms >= 0.8 * cost.round_gpu_ms > 0
    assert 0 <= cost.step_gpu_idle_ms < cost.round_wall_ms and 0 < cost.step_launch_ms < cost.round_wall_ms
    assert cost.gpu_ops_per_round > 20  # a forward's kernels at least
    from tandem.profiling import StepTimeline

    with StepTimeline() as timeline:  # the median gap, as the bench's timed pass reports it
        engine.generate(TEXTS, params)
    span_ms, idle_ms, _ = timeline.summary()
    assert len(timeline.marks) >= 20 and 0 <= timeline.idle_median_ms() < span_ms + idle_ms


@pytest.mark.gpu
@pytest.mark.parametrize("requests", ["plain", "adjusted"])
@pytest.mark.parametrize("drafter", ["none", "ngram", "specformer"])
def test_cuda_admission_and_rounds_never_wait_for_the_stream(target_dir, drafter, requests):
    """On the GPU (CUDA graphs, chained rounds), requests admitted alone and while others run, and
    every round, make no synchronizing CUDA call (torch's sync debug mode: a stream or device
    synchronize, a blocking copy, ``.item()``). The one read a round makes waits on an event, which
    is the point of it; a hidden sync (e.g. ``t[index] = 0``, which copies a host scalar to the
    device) would drain the queued round and leave the GPU idle while the host admits."""
    cfg = RunnerConfig(device="cuda", max_batch_size=4, max_seq_len=128, cuda_graphs=True)
    engine = Engine(target_dir, cfg, drafter=_drafter(drafter, target_dir), num_draft_tokens=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    top = 0
    if requests == "adjusted":  # logit adjustments (device state, counts grown in the round) and top_logprobs
        # The bias keeps a random model's samples on a few tokens, so they recur and n-gram drafts
        # (near-uniform samples over the 49k vocabulary never recur: no round would draft).
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, seed=3,
                                logit_bias={5: 12.0, 6: 12.0, 7: 12.0},
                                presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=4)
        top = 5

    def serve() -> None:
        for p in PROMPTS[:2]:
            engine.add_request(prompt_ids=p, params=params, top_logprobs=top)
        engine.step()
        engine.step()
        for p in PROMPTS[2:]:  # admitted while the first two run
            engine.add_request(prompt_ids=p, params=params, top_logprobs=top)
        while engine.has_unfinished():
            engine.step()

    def prompt_observes() -> set:  # a SpecFormer head's observe graphs of prompts (captured when bound)
        rows_m = engine.drafter.head.config.num_draft_tokens + 1 if drafter == "specformer" else 0
        return {k for k in getattr(engine.drafter, "_captured", {}) if k[0] == "observe" and k[3] != rows_m}

    bound = prompt_observes()
    assert bool(bound) == (drafter == "specformer")
    serve()
    assert prompt_observes() == bound, "an admission captured a prompt observe graph"
    serve()  # every graph of this workload captured (a capture synchronizes)

    def graphs() -> set:  # the keys of the runner's round graphs and of a head's own
        return set(engine.runner._graphs) | {("head", k) for k in getattr(engine.drafter, "_captured", {})}

    before = graphs()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            serve()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphs() == before, f"graphs captured in the checked pass: {sorted(map(str, graphs() - before))}"
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in seen if "synchroniz" in str(w.message).lower()]
    assert not syncs, syncs[:3]
    if drafter != "none":
        assert engine.stats.num_drafted > 0


def test_admissions_are_marked_on_the_step_timeline(target_dir, monkeypatch):
    """While a ``StepTimeline`` records (the bench's timed pass), each admission's device work is
    bracketed by two events: one window per prefill, whose GPU time ``admission_ms`` sums (here
    with stand-in events that take 1.5 ms each, on a CPU)."""
    from tandem.profiling import StepTimeline

    class Event:  # torch.cuda.Event's surface that StepTimeline uses
        def __init__(self, enable_timing: bool = False) -> None:
            self.recorded = False

        def record(self) -> None:
            self.recorded = True

        def elapsed_time(self, other: "Event") -> float:
            assert self.recorded and other.recorded
            return 1.5

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=128))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prefills = engine.admission.prefills
    with StepTimeline() as timeline:
        engine.generate([f"Prompt {i}: tell me something" for i in range(5)], params)
    admitted = engine.admission.prefills - prefills
    assert admitted >= 3 and len(timeline.admissions) == admitted  # 5 requests through 2 slots
    assert timeline.admission_ms() == pytest.approx(1.5 * admitted)
    assert StepTimeline().admission_ms() == 0.0
