"""Admission batching (``Engine._admission_due``, ``tandem.admission.AdmissionPolicy``): while
requests run, a prefill waits for a share of the slots to be free, for the idle slots to have cost
the batch as much as a prefill does, or for its oldest request to have waited a number of rounds;
outputs do not depend on it."""

from __future__ import annotations

import time

import pytest
from test_chained import PROMPTS

from tandem.admission import AdmissionPolicy
from tandem.engine import Engine
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams


def _run(target_dir: str, share: float, chained: bool, wait: int = 1000) -> tuple[list[list[int]], list[int]]:
    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=16, max_seq_len=96))
    if not chained:
        engine.target.chains_rounds = False
    engine.admission = AdmissionPolicy(share, wait, balance=False)
    sizes: list[int] = []
    launch = engine.target.launch_prefill
    engine.target.launch_prefill = lambda items, overlap=False: sizes.append(len(items)) or launch(items, overlap=overlap)
    prompts = (PROMPTS * 5)[:40]
    params = [SamplingParams(max_tokens=3 + (7 * i) % 17, ignore_eos=True) for i in range(len(prompts))]
    return [c.token_ids for c in engine.generate(prompts, params)], sizes


def test_admission_waits_for_a_batch_of_free_slots(target_dir):
    """With 16 slots and a share of 1/4 (no wait limit), every prefill after the first admits at
    least 4 requests (the last: what is left of the queue) instead of one per freed slot, and the
    tokens equal those of immediate admission (share 0), chained and host-driven. With a share
    no freeing reaches (all 16 slots) the wait limit still admits the queue."""
    for chained in (True, False):
        want, single = _run(target_dir, 0.0, chained)
        got, batched = _run(target_dir, 0.25, chained)
        assert got == want
        assert sum(batched) == sum(single) == 40
        assert len(batched) < len(single)
        assert batched[0] == 16 and all(n >= 4 for n in batched[1:-1])
    want, _ = _run(target_dir, 0.0, True)
    got, waited = _run(target_dir, 1.0, True, wait=3)
    assert got == want and sum(waited) == 40 and len(waited) > 2


def test_balance_admits_once_idle_slots_cost_a_prefill():
    """The cost balance: with a prefill measured at 10 ms, rounds of 2 ms and a batch of 64, the
    waiting requests are admitted once the idle slot-rounds reach 64 * 10 / 2 = 320 (not before,
    and not by the share or the wait cap, set out of reach); a prefill resets the count; without
    a measured prefill, or with no free slot, the balance never admits."""
    policy = AdmissionPolicy(share=1.0, wait_rounds=10**6)
    assert not policy.due(free=3, waiting=5, max_running=64, round_s=0.002)  # nothing measured
    policy.note_prefill(0.010)
    rounds = 0
    while not policy.due(free=4, waiting=9, max_running=64, round_s=0.002):
        policy.note_round(free=4, waiting=9)
        rounds += 1
    assert rounds == 80 and policy.idle_slot_rounds == 320  # 4 idle slots a round
    assert not policy.due(free=0, waiting=9, max_running=64, round_s=0.002)
    policy.note_prefill(0.020)  # smoothed: 0.8 * 10 ms + 0.2 * 20 ms
    assert policy.idle_slot_rounds == 0 and policy.idle_rounds == 0 and abs(policy.prefill_s - 0.012) < 1e-12
    assert AdmissionPolicy(share=1 / 8).due(free=8, waiting=20, max_running=64, round_s=0.0)


def test_wait_cap_counts_rounds_with_a_slot_idle():
    """The wait cap counts rounds in which a slot sat free while requests waited, not the time
    since the requests arrived: a burst queued long before any slot frees is not admitted one
    freed slot at a time. Rounds with the batch full do not count; a prefill resets the count."""
    policy = AdmissionPolicy(share=1.0, wait_rounds=5, balance=False)
    for _ in range(100):  # the batch is full: the queue waits, the cap does not run
        policy.note_round(free=0, waiting=30)
    assert not policy.due(free=1, waiting=30, max_running=64, round_s=0.002)
    for i in range(5):
        assert not policy.due(free=1, waiting=30, max_running=64, round_s=0.002), i
        policy.note_round(free=1, waiting=30)
    assert policy.due(free=1, waiting=30, max_running=64, round_s=0.002)
    policy.note_prefill(0.01)
    assert not policy.due(free=1, waiting=30, max_running=64, round_s=0.002)



def test_intake_window_holds_admission_while_requests_arrive():
    """The intake window: admission waits while the newest waiting request came less than a
    window ago and slots stay free, never past four windows after the oldest one's arrival; not
    when the waiting requests fill the free slots; not at all when off (the default)."""
    policy = AdmissionPolicy(intake_s=0.002)
    assert policy.intake_deadline(free=60, waiting=3, oldest_s=10.0, newest_s=10.004, now=10.005) == pytest.approx(10.006)
    assert policy.intake_deadline(free=60, waiting=3, oldest_s=10.0, newest_s=10.004, now=10.0061) is None
    # arrivals go on, but the oldest has waited four windows
    assert policy.intake_deadline(free=60, waiting=30, oldest_s=10.0, newest_s=10.0075, now=10.0079) == pytest.approx(10.008)
    assert policy.intake_deadline(free=60, waiting=30, oldest_s=10.0, newest_s=10.0079, now=10.0081) is None
    assert policy.intake_deadline(free=4, waiting=4, oldest_s=10.0, newest_s=10.004, now=10.005) is None
    assert AdmissionPolicy().intake_deadline(free=60, waiting=3, oldest_s=10.0, newest_s=10.004, now=10.005) is None


def test_intake_window_gathers_requests_that_arrive_one_by_one(target_dir):
    """With an intake window, an idle engine's step admits nothing while the window is open
    (``intake_wait_s`` says how long; ``wait_for_intake`` sleeps it out); requests arriving one a
    step while others run are held back until arrivals pause for a window, then admitted in one
    prefill (not one prefill a step, as with the window off); the tokens are the same as without
    the window."""
    def run(intake_s: float) -> tuple[list[list[int]], list[int]]:
        engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=16, max_seq_len=96))
        engine.admission = AdmissionPolicy(share=0.0, wait_rounds=0, intake_s=intake_s, balance=False)
        sizes: list[int] = []
        launch = engine.target.launch_prefill
        engine.target.launch_prefill = lambda items, overlap=False: sizes.append(len(items)) or launch(items, overlap=overlap)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        ids = [engine.add_request(PROMPTS[0], params)]
        if intake_s:
            assert engine.step() == [] and sizes == []  # the window is open: nothing admitted
            assert 0.0 < engine.intake_wait_s() <= intake_s
            engine.wait_for_intake()
            assert engine.intake_wait_s() == 0.0
        engine.step()
        assert sizes == [1]
        for prompt in PROMPTS[1:4]:  # one arrives a step while the first runs
            ids.append(engine.add_request(prompt, params))
            engine.step()
        if intake_s:
            assert sizes == [1] and engine.intake_wait_s() == 0.0  # held back (a request runs: no wait to sleep)
            time.sleep(intake_s * 1.2)
            engine.step()
            assert sizes == [1, 3]
        while engine.has_unfinished():
            engine.step()
        return [engine.completion(i).token_ids for i in ids], sizes

    got, gathered = run(0.25)  # (wide enough that a step on a loaded machine stays inside it)
    want, single = run(0.0)
    assert got == want and single == [1, 1, 1, 1] and gathered == [1, 3]


def test_intake_window_on_a_replica_gathers_a_burst_and_takes_aborts(target_dir):
    """A replica (``ReplicaEngine``) whose requests arrive 20 ms apart, with a 200 ms intake
    window: its thread keeps taking arrivals while the window is open, so the four requests are
    prefilled together, and a request aborted inside the window is never prefilled; all four
    complete."""
    import threading

    from services.common import Done
    from services.verifier.replica import ReplicaEngine

    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=8, max_seq_len=96))
    engine.admission = AdmissionPolicy(intake_s=0.2)
    sizes: list[int] = []
    launch = engine.target.launch_prefill
    engine.target.launch_prefill = lambda items, overlap=False: sizes.append(len(items)) or launch(items, overlap=overlap)
    replica = ReplicaEngine(engine)
    try:
        done: list[str] = []
        finished = threading.Event()

        def sink(events):
            done.extend(rid for rid, e in events if isinstance(e, Done))
            if len(done) == 4:
                finished.set()

        params = SamplingParams(max_tokens=4, ignore_eos=True)
        reqs = [engine.make_request(p, params) for p in PROMPTS[:5]]
        for req in reqs[:4]:
            replica.submit(req, sink)
            time.sleep(0.02)
        replica.submit(reqs[4], sink)
        replica.abort(reqs[4].request_id)
        assert finished.wait(60)
        assert sizes == [4] and sorted(done) == sorted(r.request_id for r in reqs[:4])
    finally:
        replica.stop()


@pytest.mark.parametrize("share, wait, intake", [(-0.1, 64, 0.0), (1.5, 64, 0.0), (float("nan"), 64, 0.0),
                                                 (0.5, -1, 0.0), (0.5, 64, -0.001), (0.5, 64, 1.5),
                                                 (0.5, 64, float("nan"))])
def test_bad_settings_are_refused(share, wait, intake):
    """A share outside [0, 1] (NaN included), a negative wait or an intake window outside [0, 1] s
    (NaN included) is a ValueError, not a policy that admits at random; the bounds themselves are
    allowed."""
    with pytest.raises(ValueError, match="admission"):
        AdmissionPolicy(share, wait, intake_s=intake)
    assert AdmissionPolicy(0.0, 0).share == 0.0 and AdmissionPolicy(1.0, 0).share == 1.0


def test_a_replica_and_the_bench_take_the_admission_settings():
    """``tandem bench`` hands its admission settings to a distributed run's verifier replica as
    ``tandem serve verifier`` options (the in-process engines take them directly)."""
    from tandem.bench.spec_bench import replica_runner_options
    from tandem.cli import main

    opts = replica_runner_options(RunnerConfig(device="cpu"), (0.25, 16))
    at = opts.index("--admission-share")
    assert opts[at:at + 5] == ("--admission-share", "0.25", "--admission-wait-rounds", "16", "--no-admission-overlap")
    assert "--admission-overlap" in replica_runner_options(RunnerConfig(device="cpu"), (0.25, 16, True))
    opts = replica_runner_options(RunnerConfig(device="cpu"), (0.25, 16, False, 0.002))
    assert opts[opts.index("--admission-intake-ms") + 1] == "2.0"
    from click.testing import CliRunner
    res = CliRunner().invoke(main, ["serve", "verifier", "--help"])
    assert all(o in res.output for o in ("--admission-share", "--admission-wait-rounds", "--admission-overlap",
                                         "--admission-intake-ms"))
