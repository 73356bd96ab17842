"""``tandem.warmup.capture_round_shapes``: a server's decode rounds meet every (batch bucket,
context bucket) once at start-up, and the engine keeps nothing of it."""

from __future__ import annotations

import pytest

from tandem.drafters import NgramDrafter
from tandem.engine import Engine
from tandem.models.graphs import batch_bucket, context_bucket
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams
from tandem.warmup import ROUNDS_PER_SHAPE, capture_round_shapes, round_shapes


def test_round_shapes_cover_every_bucket():
    assert round_shapes(4, 600) == [(b, c) for b in (1, 2, 4) for c in (256, 512, 600)]
    assert round_shapes(64, 2048)[-1] == (64, 2048) and len(round_shapes(64, 2048)) == 7 * 8
    assert round_shapes(3, 96) == [(1, 96), (2, 96), (3, 96)]  # buckets stop at the slots and the context


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_every_round_shape_is_met_and_nothing_is_left_behind(target_dir, drafter):
    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=600),
                    drafter=NgramDrafter() if drafter == "ngram" else None, num_draft_tokens=3)
    prompts = ["Write a haiku about rust.", "List three prime numbers."]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fresh = [c.token_ids for c in engine.generate(prompts, params)]
    before = (engine.num_rounds, engine.round_wall_s, engine.round_rows, engine.stats.num_drafted,
              engine.stats.num_emitted, engine.admission.prefills)
    seen: dict[tuple[int, int], int] = {}
    step = engine.runner.step

    def spy(tokens_per_slot, *args, **kwargs):  # each round's shape as the graphs would key it
        n = max(tokens_per_slot) + 1
        attn = max(engine.cache.lengths[s] + len(t) for s, t in tokens_per_slot.items())
        shape = (batch_bucket(n, engine.cache.num_slots), context_bucket(attn, engine.cache.capacity))
        seen[shape] = seen.get(shape, 0) + 1
        return step(tokens_per_slot, *args, **kwargs)

    engine.runner.step = spy
    rounds_seen = []
    engine.on_round = rounds_seen.append  # a server's metrics: they must not count the synthetic rounds
    assert capture_round_shapes(engine) == 0  # no CUDA graphs on a CPU: the rounds ran eagerly
    engine.runner.step = step
    for shape in round_shapes(4, 600):
        assert seen.get(shape, 0) >= ROUNDS_PER_SHAPE - 1, (shape, seen)
    assert not rounds_seen and engine.on_round == rounds_seen.append
    after = (engine.num_rounds, engine.round_wall_s, engine.round_rows, engine.stats.num_drafted,
             engine.stats.num_emitted, engine.admission.prefills)
    assert after == before and not engine.has_unfinished() and not engine.requests
    assert engine.cache.num_free() == engine.cache.num_slots
    # and the engine serves as before
    assert [c.token_ids for c in engine.generate(prompts, params)] == fresh


def test_only_an_idle_engine_is_warmed_up(target_dir):
    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=96))
    engine.add_request("hello", SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        capture_round_shapes(engine)


def test_a_failed_step_leaves_no_synthetic_request(target_dir):
    """A step that fails mid-warm-up: its error comes out, the synthetic requests are dropped with
    their slots, the engine's counters are restored, and it serves as before."""
    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=300),
                    drafter=NgramDrafter(), num_draft_tokens=3)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = engine.generate(["Name a colour."], params)[0].token_ids
    rounds, step, calls = engine.num_rounds, engine.step, []

    def failing():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return step()

    engine.step = failing
    with pytest.raises(RuntimeError, match="device lost"):
        capture_round_shapes(engine)
    engine.step = step
    assert not engine.requests and not engine.waiting and engine.num_rounds == rounds
    while engine.has_unfinished():  # a round still in flight for the dropped requests settles
        engine.step()
    assert engine.cache.num_free() == engine.cache.num_slots
    assert engine.generate(["Name a colour."], params)[0].token_ids == want


def test_a_replica_captures_before_its_engine_thread_starts(target_dir, monkeypatch, caplog):
    """``ReplicaEngine(capture_rounds=True)`` warms a CUDA-graph engine up once, after it caps its
    rounds (the graphs its rounds will replay) and before its thread runs; a warm-up that fails is
    logged and the replica serves on. Without CUDA graphs nothing is captured."""
    from dataclasses import replace

    import services.verifier.replica as replica_mod

    calls = []

    def spy(engine):
        calls.append(engine.cap_rounds)
        if len(calls) == 2:
            raise RuntimeError("capture failed")
        return 0

    monkeypatch.setattr(replica_mod, "capture_round_shapes", spy)
    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=96))
    replica_mod.ReplicaEngine(engine, capture_rounds=True).stop()
    assert calls == []  # no CUDA graphs: nothing to capture
    engine.runner_config = replace(engine.runner_config, cuda_graphs=True)  # (as a GPU replica's)
    replica_mod.ReplicaEngine(engine, capture_rounds=True).stop()
    assert calls == [True]
    with caplog.at_level("WARNING"):
        replica = replica_mod.ReplicaEngine(engine, capture_rounds=True)
    try:
        assert calls == [True, True] and "not captured at start-up (capture failed)" in caplog.text
        assert replica._thread.is_alive()
    finally:
        replica.stop()
