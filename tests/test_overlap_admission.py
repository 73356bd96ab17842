"""Admissions beside the rounds (``tandem.engine_admission``, ``AdmissionPolicy.overlap``): the
prefill is launched after the next round is queued, the running requests' rounds go on while it
runs, and its requests join the first round after its event has fired. On a CPU the prefill runs
in line, so these tests defer the join as a GPU would: the handle's event fires only after a few
polls. What a user sees never depends on it."""

from __future__ import annotations

import pytest
from test_bench import short_prompts, tiny_dir  # noqa: F401 (fixtures)
from test_chained import _case, _engine, _run, _specformer_engine

from tandem.sampling import SamplingParams
from tandem.target import LocalTarget


class _FiresLater:
    """A CUDA event's stand-in: ``query()`` is True from its ``polls``-th call on."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls <= 0


def _defer_joins(engine, monkeypatch, polls: int = 3) -> dict:
    """Make ``engine``'s target overlap admissions as on a GPU (its prefill's round state written
    only at ``join_prefill``, its event firing after ``polls`` polls); returns counters: overlapped
    launches, and steps that ran a round while one was in flight."""
    target = engine.target
    engine.admission.overlap = True
    monkeypatch.setattr(LocalTarget, "overlaps_admission", property(lambda self: True))
    seen = {"launches": 0, "rounds_beside": 0}
    plain = target.launch_prefill

    def launch(items, overlap=False):
        if not overlap:
            return plain(items)
        handle, admit = target._prefill(items, target._pinned_admission)
        handle.admit, handle.ready = admit, _FiresLater(polls)
        seen["launches"] += 1
        return handle

    target.launch_prefill = launch
    step = engine.step

    def counted():
        pending = engine._admitting is not None
        rounds = engine.num_rounds
        out = step()
        seen["rounds_beside"] += pending and engine._admitting is not None and engine.num_rounds > rounds
        return out

    engine.step = counted
    return seen


@pytest.mark.parametrize("drafter", ["none", "ngram", "specformer"])
def test_overlapped_admissions_change_nothing_a_user_sees(target_dir, word_dir, real_tokenizer, drafter,
                                                          monkeypatch):
    """Three times as many requests as slots (greedy, sampled with seeds, stop strings, EOS, one
    token), one aborted mid-generation: with admissions beside the rounds every other request
    gets the tokens, text, finish reason and logprobs of serial admission; admissions did overlap
    rounds; every slot is free at the end."""
    if drafter == "specformer":
        make = lambda: _specformer_engine(target_dir, chained=True)  # noqa: E731
        prompts, params = _case("none", target_dir, word_dir, real_tokenizer.eos_token_ids[0])[1:]
    else:
        model, prompts, params = _case(drafter, target_dir, word_dir, real_tokenizer.eos_token_ids[0])
        make = lambda: _engine(model, chained=True, drafter=drafter)  # noqa: E731
    prompts, params = prompts * 3, params * 3
    serial = make()
    want, _ = _run(serial, prompts, params, abort_at={0: 4})
    engine = make()
    seen = _defer_joins(engine, monkeypatch)
    got, _ = _run(engine, prompts, params, abort_at={0: 4})
    assert seen["launches"] >= 3 and seen["rounds_beside"] >= 3
    assert got[0][0][0] == "aborted"
    for (g, gs), (w, _), p in zip(got[1:], want[1:], prompts[1:]):
        assert g[:3] == w[:3], p
        assert g[3] == pytest.approx(w[3], abs=1e-5)
        assert gs == g[0]
    if drafter != "none":
        assert engine.stats.num_accepted > 0
    assert engine._admitting is None and not engine.running and not engine._in_flight
    assert engine.cache.num_free() == engine.cache.num_slots


def test_a_request_aborted_during_its_prefill_frees_its_slot_at_the_join(target_dir, monkeypatch):
    """A request aborted while its prefill runs beside the rounds streams nothing; its slot stays
    taken until the join (the prefill still writes it), then is free; the others finish as if it
    had never been sent."""
    engine = _engine(target_dir, chained=True, slots=4)
    _defer_joins(engine, monkeypatch, polls=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = [engine.add_request(p, params) for p in ("Say hi", "Count to five.")]
    engine.step()  # admitted in line: nothing runs yet
    late = engine.add_request("Name a colour.", params)
    keep = engine.add_request("What is 2+2?", params)
    outputs = engine.step()  # a round, then their prefill beside it
    assert engine._admitting is not None and {r.request_id for r in engine._admitting.reqs} == {late, keep}
    slot = engine.requests[late].slot
    engine.abort(late)
    assert engine.cache.num_free() == 0  # its slot too: the prefill in flight still writes it
    while engine.has_unfinished():
        outputs += engine.step()
    assert late not in {o.request_id for o in outputs}
    done = {r: engine.completion(r).token_ids for r in [*first, keep]}
    assert all(len(t) == 12 for t in done.values())
    assert engine.cache.num_free() == engine.cache.num_slots
    alone = _engine(target_dir, chained=True, slots=4)
    assert done[keep] == alone.generate(["What is 2+2?"], params)[0].token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["none", "specformer"])
def test_overlapped_admissions_on_the_gpu_are_lossless(real_checkpoint, drafter):
    """On the GPU (bf16, CUDA graphs, varlen prefill from graphs on the admission stream), 48
    Spec-Bench prompts through 8 slots: admissions ran beside the rounds (their prefill launched
    overlapped, rounds run while it was in flight) and every greedy output is the one serial
    admission gives, target-only and with the shipped SpecFormer head."""
    from conftest import spec_bench_prompts

    from tandem.drafters.specformer import SpecFormerDrafter
    from tandem.engine import Engine
    from tandem.models.runner import default_runner_config

    prompts = spec_bench_prompts(48)
    # lengths that differ, so requests finish (and slots free) while others run
    params = [SamplingParams(max_tokens=16 + (13 * i) % 48, ignore_eos=True) for i in range(len(prompts))]

    def run(overlap: bool) -> tuple[list[list[int]], int, int]:
        cfg = default_runner_config("cuda", max_batch_size=8, max_seq_len=1024)
        engine = Engine(real_checkpoint, cfg, drafter=SpecFormerDrafter.load() if drafter == "specformer" else None)
        assert engine.target.overlaps_admission, "no admission stream (varlen prefill from CUDA graphs)"
        engine.admission.overlap = overlap
        launched, beside = 0, 0
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=f"r{i}")
        while engine.has_unfinished():
            pending, rounds = engine._admitting, engine.num_rounds
            engine.step()
            beside += pending is not None and engine._admitting is pending and engine.num_rounds > rounds
            launched += engine._admitting is not None and engine._admitting is not pending
        return [engine.completion(f"r{i}").token_ids for i in range(len(prompts))], launched, beside

    want, serial_launched, _ = run(False)
    got, launched, beside = run(True)
    assert serial_launched == 0 and launched >= 3 and beside >= 3
    same = sum(g == w for g, w in zip(got, want))
    assert same == len(prompts), f"{len(prompts) - same} of {len(prompts)} outputs differ"


def test_the_bench_reports_overlap_only_where_it_ran(tiny_dir, short_prompts):
    """``--admission-overlap`` on a CPU (no CUDA graphs, no varlen prefill) runs every prefill in
    line: the bench says so and its report records what ran (``meta.admission["overlap"]`` False)."""
    from tandem.bench.configs import BenchOptions, parse_configs
    from tandem.bench.spec_bench import run_benchmark
    from tandem.data import load_prompts
    from tandem.models.runner import RunnerConfig
    from tandem.models.weights import load_checkpoint
    from tandem.tokenizer import load_tokenizer

    ck = load_checkpoint(tiny_dir)
    notes: list[str] = []
    report = run_benchmark(ck, load_tokenizer(ck), RunnerConfig(device="cpu", max_seq_len=256),
                           load_prompts(short_prompts), parse_configs("target"), [2], BenchOptions(), max_tokens=4,
                           limit=2, progress=False, warmup="none", admission=(0.125, 64, True), say=notes.append)
    assert report.meta.admission == {"share": 0.125, "wait_rounds": 64, "overlap": False, "intake_ms": 0.0}
    assert any("--admission-overlap has no effect here" in n for n in notes)
