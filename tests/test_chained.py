"""Chained rounds: decode rounds queued one ahead from the device round state.

``Engine.step`` queues round n + 1 (``Target.launch_chained``: last tokens, start positions and,
for a drafter that drafts on the device (n-gram), the drafts come from
``tandem.target.RoundState`` on the device) before it waits for round n, then runs round n's stop
rules while n + 1 runs. These tests pin down that this changes nothing a user sees: the
same tokens, text, finish reasons, log-probabilities and usage as rounds launched only once the
previous one is back (the host-driven path, forced by a target that says it cannot chain), with
stop strings, stop ids, EOS and max_tokens cutting runs, aborts while a round is in flight, slots
reused, and the host and device views of the KV cache lengths in agreement afterwards.
"""

from __future__ import annotations

import pytest
import torch

from tandem.drafters import NgramDrafter
from tandem.drafters.lookup import LookupIndex, lookup_drafts
from tandem.engine import Engine
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams

PROMPTS = ["Write a haiku about rust.", "List three prime numbers.", "What is 2+2?", "Name a colour.",
           "Say hi", "Count to five.", "Tell me a story about a cat", "Why is the sky blue?"]


# for the 32-word model (n-gram drafts recur and get accepted there): "w1" .. "w31"
WORD_PROMPTS = ["w1 w2 w3 w1 w2 w3 w1", "w5 w9 w5 w9", "w7", "w3 w4 w5 w6 w3 w4", "w11 w12 w11 w12 w11",
                "w2 w2 w2 w2", "w20 w21 w22 w23 w20 w21", "w8 w9 w10"]


def _params(eos_id: int, stop: str = "e") -> list[SamplingParams]:
    return [SamplingParams(max_tokens=24, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=0.8, seed=3),
            SamplingParams(max_tokens=1),
            SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True),  # a stop string inside the text
            SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7),
            SamplingParams(max_tokens=12, top_k=5, temperature=0.7, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=1.5, seed=5),  # may stop on EOS
            SamplingParams(max_tokens=9, stop_token_ids=[eos_id + 1, 13], ignore_eos=True)]


def _case(drafter: str, target_dir: str, word_dir: str, eos_id: int):
    """(model directory, prompts, params): target-only on the tiny model with the real tokenizer;
    n-gram on the 32-word model, whose outputs repeat n-grams so drafts are accepted."""
    if drafter == "ngram":
        return word_dir, WORD_PROMPTS, _params(0, stop="w7")
    return target_dir, PROMPTS, _params(eos_id)


def _engine(target_dir: str, chained: bool, drafter: str = "none", slots: int = 4, k: int = 4) -> Engine:
    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=slots, max_seq_len=96),
                    drafter=NgramDrafter() if drafter == "ngram" else None, num_draft_tokens=k)
    if not chained:
        engine.target.chains_rounds = False  # the host-driven path: launch only after the previous collect
    assert engine.chains_rounds is chained
    return engine


def _run(engine: Engine, prompts: list[str], params: list[SamplingParams], abort_at: dict[int, int] | None = None):
    """Every request's (tokens, text, finish reason, logprobs, streamed tokens); ``abort_at`` maps a
    request index to the step at which it is aborted (its entry is then what it had streamed)."""
    ids = [engine.add_request(p, sp, logprobs=True, top_logprobs=3 * (i % 2)) for i, (p, sp) in
           enumerate(zip(prompts, params))]
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    done: dict[str, tuple] = {}
    step, overlapped = 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                c = engine.completion(out.request_id)
                done[out.request_id] = (c.token_ids, c.text, c.finish_reason, c.logprobs, c.completion_tokens,
                                        c.top_logprobs)
        step += 1
        overlapped += engine._launched is not None and bool(engine._in_flight)
        for i, at in (abort_at or {}).items():
            if step == at and ids[i] not in done:
                engine.abort(ids[i])
                done[ids[i]] = ("aborted", streamed[ids[i]])
        assert step < 400
    return [(done[i], streamed[i]) for i in ids], overlapped


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_chained_rounds_change_nothing_a_user_sees(target_dir, word_dir, real_tokenizer, drafter):
    model, prompts, params = _case(drafter, target_dir, word_dir, real_tokenizer.eos_token_ids[0])
    host = _engine(model, chained=False, drafter=drafter)
    want, _ = _run(host, prompts, params)
    engine = _engine(model, chained=True, drafter=drafter)
    got, overlapped = _run(engine, prompts, params)
    # the same drafts were verified (the device n-gram lookup is the host index's rule)
    assert (engine.stats.num_drafted, engine.stats.num_accepted) == (host.stats.num_drafted, host.stats.num_accepted)
    if drafter == "ngram":
        assert engine.stats.num_accepted > 0
    assert overlapped > 5  # a round really was in flight while the host ran the previous one's stop rules
    for (g, gs), (w, ws), p in zip(got, want, prompts):
        assert g[:3] == w[:3], p  # tokens, text, finish reason
        assert g[4] == w[4] == len(g[0])  # usage counts what was kept
        assert g[3] == pytest.approx(w[3], abs=1e-5)  # logprobs cut at the same boundary
        if g[5] is not None:  # so are the top alternatives (every other request asks for 3)
            assert [[t for t, _ in a] for a in g[5]] == [[t for t, _ in a] for a in w[5]]
            assert len(g[5]) == len(g[0]) and all(len(a) == 3 for a in g[5])
        assert gs == g[0]  # the stream carried exactly the kept tokens
    reasons = {w[0][2] for w in want}
    assert reasons == {"stop", "length"}
    assert not engine.target._queued and not engine._in_flight and not engine.running
    assert engine.cache.num_free() == engine.cache.num_slots


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_more_requests_than_slots_and_abort_in_flight(target_dir, word_dir, real_tokenizer, drafter):
    """Twice as many requests as slots (slots are freed while a round that used them may still be
    in flight, and reused), one aborted mid-generation: every other request gets what it gets on
    the host-driven path, and the aborted one streamed a prefix of its own output."""
    model, prompts, params = _case(drafter, target_dir, word_dir, real_tokenizer.eos_token_ids[0])
    params, prompts = params * 2, prompts * 2
    want, _ = _run(_engine(model, chained=False, drafter=drafter), prompts, params)
    engine = _engine(model, chained=True, drafter=drafter)
    got, _ = _run(engine, prompts, params, abort_at={0: 4})
    assert got[0][0][0] == "aborted" and 0 < len(got[0][1]) < len(want[0][0][0])
    assert got[0][1] == want[0][0][0][:len(got[0][1])]
    for (g, _), (w, _), p in zip(got[1:], want[1:], prompts[1:]):
        assert g[:3] == w[:3], p
    assert engine.cache.num_free() == engine.cache.num_slots


def test_host_and_device_lengths_agree_between_rounds(target_dir):
    """While a request runs with one round in flight, its slot's host-side KV length
    (``KVCache.lengths``) less that round's tokens is what the collected output implies, and the
    device round state is one round ahead of it."""
    engine = _engine(target_dir, chained=True)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    rid = engine.add_request("Count to ten slowly", sp)
    prompt_len = len(engine.requests[rid].prompt_ids)
    for _ in range(6):
        engine.step()
    req = engine.requests[rid]
    slot = req.slot
    queued = engine.target._queued.get(slot, 0)
    assert queued == 1  # exactly one round in flight
    engine.step()
    held = engine.cache.lengths[slot] - engine.target._queued.get(slot, 0)
    # after the step: every collected token but the last is in the cache
    assert held == prompt_len + req.num_tokens - 1
    # the device state already counts the round in flight (on the CPU its work ran when it was queued)
    assert int(engine.target.state.length[slot]) == held + 1
    while engine.has_unfinished():
        engine.step()
    assert engine.completion(rid).completion_tokens == 30


def test_device_lookup_is_the_host_index_rule():
    """``lookup_drafts`` (one batched device pass: the n-gram drafter's and SpecFormer's chained
    rounds) gives ``LookupIndex.lookup``'s continuation and match length for random sequences over
    small vocabularies (many recurring n-grams), every n-gram range and room, sequences of one
    token included."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        B, C, k = 6, 40, rng.randint(1, 5)
        max_n = rng.randint(1, 4)
        min_n = rng.randint(1, max_n)
        history = torch.randint(0, 5, (B, C), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        last = torch.tensor([rng.randint(0, C - 3) for _ in range(B)])
        room = torch.tensor([rng.randint(0, k) for _ in range(B)])
        cont, lens, match = lookup_drafts(history, last, room, k, max_n, min_n)
        for b in range(B):
            seq = history[b, :last[b] + 1].tolist()
            index = LookupIndex(max_n, min_n)
            index.extend(seq)
            toks, n = index.lookup(max(1, int(room[b])))
            want = toks if room[b] > 0 else []
            assert cont[b, :lens[b]].tolist() == want, (seq, int(room[b]), max_n, min_n)
            assert (cont[b, lens[b]:] == -1).all() and int(match[b]) == n


def test_the_device_draft_room_is_the_draft_room_rule():
    """``draft_room_end`` (what a chained round's feed computes the room from: min(limit, end -
    held)) gives ``draft_room`` for every limit, context, prompt length, output length and token
    limit, ints and tensors alike."""
    import itertools

    from tandem.stopping import draft_room, draft_room_end

    cases = list(itertools.product(range(-1, 6), (8, 12), range(1, 8), range(1, 10), range(1, 10)))
    for limit, context, prompt_len, num_tokens, max_new in cases:
        held = prompt_len + num_tokens - 1
        want = draft_room(limit, context, prompt_len, num_tokens, max_new)
        assert min(limit, draft_room_end(context, prompt_len, max_new) - held) == want
    limit, context, prompt_len, num_tokens, max_new = (torch.tensor(c) for c in zip(*cases))
    end = draft_room_end(12, prompt_len, max_new)
    want = draft_room(limit, 12, prompt_len, num_tokens, max_new)
    assert torch.equal(torch.minimum(limit, end - (prompt_len + num_tokens - 1)), want)


def test_ngram_rounds_near_the_context_limit(word_dir):
    """Requests that run into the context limit (prompt + output = max_seq_len) with drafts on:
    the device's draft-room rule keeps every write inside the cache, the output is what the
    host-driven path gives, and nothing is left in flight."""
    def make(chained: bool) -> Engine:
        e = Engine(word_dir, RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=40),
                   drafter=NgramDrafter(), num_draft_tokens=5)
        if not chained:
            e.target.chains_rounds = False
        return e

    prompts = ["w1 w2 w3 w1 w2 w3 w1 w2 w3 w1 w2 w3", "w4 w4 w4 w4 w4 w4 w4 w4 w4 w4 w4 w4 w4 w4"]
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    want = make(False).generate(prompts, params)
    engine = make(True)
    got = engine.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason == "length"
        assert g.prompt_tokens + len(g.token_ids) == 40
    assert engine.stats.num_accepted > 0
    assert not engine.has_unfinished() and engine.cache.num_free() == 2


@pytest.mark.parametrize("policy", [False, True])
def test_chained_ngram_through_the_graph_path(word_dir, monkeypatch, policy):
    """The CUDA-graph path of a chained n-gram round (the device patch captured with the forward,
    one captured call per shape and patch key), with the capture stood in by eager calls so it
    runs on the CPU: the same tokens as the host-driven path, each shape made once; with a
    context-aware policy, the drafts' scores made and packed inside the same captured call."""
    import tandem.models.runner as runner_mod
    from tandem.control import DraftPolicy, entropy_score

    prompts, params = WORD_PROMPTS[:4], SamplingParams(max_tokens=20, ignore_eos=True)
    want = [c.token_ids for c in _engine(word_dir, chained=False, drafter="ngram").generate(prompts, params)]
    engine = _engine(word_dir, chained=True, drafter="ngram")
    if policy:  # θ 0: every draft kept, so the tokens and drafts match the policy-free rounds
        engine.draft_policy = DraftPolicy(entropy_score, acceptance_threshold=0.0, device_score=entropy_score)
        engine.drafter.set_acceptance_scorer(entropy_score, 4)
        assert engine.chains_rounds
    object.__setattr__(engine.runner.config, "cuda_graphs", True)  # RunnerConfig refuses it on a CPU
    made, real = [], runner_mod.CapturedCall
    monkeypatch.setattr(runner_mod, "CapturedCall",
                        lambda fn, inputs, capture=True, pool=None, warmup=2, label="": made.append(1) or real(fn, inputs, capture=False))
    assert [c.token_ids for c in engine.generate(prompts, params)] == want
    assert engine.stats.num_accepted > 0
    assert made and len(made) == len(engine.runner._graphs)
    assert all(key[4] is not None for key in engine.runner._graphs)  # every decode step ran chained
    if policy:
        assert engine.drafter.scores_on_device and engine._width_plan is not None  # widths planned from scores


# ----------------------------------------------------------------------------- SpecFormer in the round


def _specformer_engine(target_dir: str, chained: bool, variant: str = "lookup", slots: int = 4) -> Engine:
    from test_specformer import VARIANTS, _random_head

    from tandem.drafters.specformer import SpecFormerDrafter
    from tandem.models.weights import load_checkpoint

    ck = load_checkpoint(target_dir)
    engine = Engine(ck, RunnerConfig(device="cpu", max_batch_size=slots, max_seq_len=128),
                    drafter=SpecFormerDrafter(_random_head(ck.config, **VARIANTS[variant])), num_draft_tokens=4)
    if not chained:
        engine.target.chains_rounds = False
    assert engine.chains_rounds is chained
    return engine


@pytest.mark.parametrize("variant", ["paper", "lookup"])
def test_chained_specformer_drafts_what_the_host_path_drafts(target_dir, real_tokenizer, variant):
    """A chained SpecFormer round runs the head's context layers and draft part on the device after
    verification (``device_after_verify``) and primes a new slot's drafts after its prefill: greedy
    requests get the same tokens, text, stop cuts and logprobs as the host path (observe, then
    propose), and the same drafts are verified (equal drafted and accepted counts, in float32)."""
    prompts = PROMPTS
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (24, 5, 1, 30, 20, 12, 40, 9)]
    params[3] = SamplingParams(max_tokens=30, stop=["e"], ignore_eos=True)
    _same_as_host_rounds(lambda chained: _specformer_engine(target_dir, chained=chained, variant=variant),
                         prompts, params)


def _same_as_host_rounds(make, prompts: list[str], params: list[SamplingParams]) -> tuple[Engine, Engine]:
    """Run ``prompts`` on ``make(chained=False)`` and ``make(chained=True)``: the chained engine
    gives every request the host path's tokens, text, finish reason, logprobs and stream, with the
    same drafts verified (equal drafted and accepted counts) and rounds really in flight; returns
    (host, chained) engines."""
    host = make(False)
    want, _ = _run(host, prompts, params)
    engine = make(True)
    got, overlapped = _run(engine, prompts, params)
    assert host.stats.num_drafted > 50
    assert (engine.stats.num_drafted, engine.stats.num_accepted) == (host.stats.num_drafted, host.stats.num_accepted)
    assert overlapped > 5
    for (g, gs), (w, _), p in zip(got, want, prompts):
        assert g[:3] == w[:3], p
        assert g[3] == pytest.approx(w[3], abs=1e-5)
        assert gs == g[0]
    assert not engine.target._queued and engine.cache.num_free() == engine.cache.num_slots
    return host, engine


@pytest.mark.parametrize("drafter", ["specformer", "draft-model"])
def test_chained_sampled_requests_draw_their_drafts_on_the_device(target_dir, drafter):
    """Sampled requests in chained SpecFormer or draft-model rounds draft from q on the device
    (``STREAM_DRAFT``) and are verified against that q: drafts are accepted, a seeded request gives
    the same tokens alone and in a batch with others, and greedy neighbours keep the target's own
    output."""
    make = (lambda: _specformer_engine(target_dir, chained=True)) if drafter == "specformer" else (
        lambda: _draft_model_engine(target_dir, chained=True))
    seeded = SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=5, ignore_eos=True)
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    alone = make().generate([PROMPTS[0]], seeded)[0].token_ids
    engine = make()
    outs = engine.generate(PROMPTS[:4], [seeded, greedy, SamplingParams(max_tokens=25, temperature=1.2, seed=9), greedy])
    assert outs[0].token_ids == alone
    base = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128))
    want = base.generate([PROMPTS[1], PROMPTS[3]], greedy)
    assert [outs[1].token_ids, outs[3].token_ids] == [w.token_ids for w in want]
    assert engine.stats.num_accepted > 0 and engine.drafter._draft_q is not None


def test_chained_specformer_through_the_graph_path(target_dir, monkeypatch):
    """The head's per-round device work goes through its captured-call path (one per batch bucket,
    tokens per row, context and sampling flags; capture stood in by eager calls on the CPU): the
    same tokens and drafts as without it."""
    import tandem.drafters.specformer as sf

    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = _specformer_engine(target_dir, chained=True)
    want = [c.token_ids for c in plain.generate(PROMPTS[:3], params)]
    engine = _specformer_engine(target_dir, chained=True)
    engine.drafter._static = True
    real = sf.CapturedCall
    monkeypatch.setattr(sf, "CapturedCall", lambda fn, inputs, capture=True, pool=None, warmup=2, label="": real(fn, inputs, capture=False))
    assert [c.token_ids for c in engine.generate(PROMPTS[:3], params)] == want
    assert engine.stats.num_drafted == plain.stats.num_drafted
    assert any(key[0] == "chained" for key in engine.drafter._captured)


def test_first_drafts_cover_every_row_only_for_graphs(target_dir, monkeypatch):
    """An admission's first drafts (``LocalTarget.prime_drafts``) run over every slot's row where
    CUDA graphs replay them (one shape), and eagerly over the rows up to the highest admitted slot
    only (no draft work for the empty rows above it)."""
    engine = _specformer_engine(target_dir, chained=True, slots=8)
    rows = []
    prime = engine.drafter.device_prime
    monkeypatch.setattr(engine.drafter, "device_prime", lambda keep, *a: (rows.append(keep.tolist()), prime(keep, *a)))
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert rows == [[True, True]]  # slots 0 and 1, admitted together
    rows.clear()
    from dataclasses import replace

    # (the shape only: prime_drafts reads the flag; on the CPU the head still runs eagerly)
    monkeypatch.setattr(engine.runner, "config", replace(engine.runner.config, cuda_graphs=True))
    engine.target.prime_drafts([2], engine.drafter)
    assert rows == [[False, False, True] + [False] * 5]


def test_device_lookup_at_full_width_in_a_padded_batch():
    """``lookup_drafts`` at full width (SpecFormer's chained rounds read l_d tokens) gives
    ``LookupIndex``'s answer at the end of random rows of a padded batch over several vocabulary
    sizes."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        B, C = 4, 40
        history = torch.randint(0, 5, (B, C + 2), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        last, want = [], []
        for b in range(B):
            T = rng.randint(1, C)
            x = [rng.randrange(rng.choice([2, 3, 5, 20])) for _ in range(T)]
            history[b, :T] = torch.tensor(x)
            index = LookupIndex()
            index.extend(x)
            want.append(index.lookup(6))
            last.append(T - 1)
        last = torch.tensor(last)
        cont, lens, match = lookup_drafts(history, last, torch.full_like(last, 6), 6)
        got = [(cont[b, :lens[b]].tolist(), int(match[b])) for b in range(B)]
        assert got == want


# ------------------------------------------------- context-aware widths over SpecFormer, chained


def _context_aware_engine(target_dir: str, policy, slots: int = 4) -> Engine:
    """A chained SpecFormer engine under ``policy``, its drafter scoring drafts on the device
    (what ``build_speculation`` sets up for a policy with a device scorer)."""
    from test_specformer import VARIANTS, _random_head

    from tandem.drafters.specformer import SpecFormerDrafter
    from tandem.models.weights import load_checkpoint

    ck = load_checkpoint(target_dir)
    drafter = SpecFormerDrafter(_random_head(ck.config, **VARIANTS["lookup"]))
    if policy.device_score is not None:
        drafter.set_acceptance_scorer(policy.device_score)
    engine = Engine(ck, RunnerConfig(device="cpu", max_batch_size=slots, max_seq_len=128), drafter=drafter,
                    num_draft_tokens=4, draft_policy=policy)
    assert engine.chains_rounds
    return engine


def _widths(engine: Engine) -> list[tuple[int, int | None]]:
    """Record (graph width, draft cap) of every chained round the engine queues."""
    seen: list[tuple[int, int | None]] = []
    launch = engine.target.launch_chained

    def spy(items, drafter=None, draft_cap=None):
        seen.append((max(it.max_draft for it in items), draft_cap))
        return launch(items, drafter, draft_cap)

    engine.target.launch_chained = spy
    return seen


@pytest.mark.parametrize("theta", [0.0, 1.0, "auto"])
def test_chained_context_aware_specformer_sets_widths_and_stays_lossless(target_dir, theta):
    """A context-aware policy over SpecFormer chains (no host-drafted rounds): the head scores its
    drafts inside the round, the round's one copy brings the scores back and the policy picks the
    width of a later round from them: a device-side cap on the drafts, inside a graph as wide as
    the widest recent plan. θ = 0 drafts every position (the same drafts as fixed k), θ = 1 none
    (no score reaches 1; the graph narrows once a window of plans wanted nothing), the online θ
    several widths; greedy output is always the target's, and every round still makes one
    blocking read."""
    import tandem.engine as engine_mod
    from tandem.control import DraftPolicy, entropy_score
    from tandem.threshold import ThresholdController
    from tandem.profiling import HostSyncCounter

    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (24, 5, 30, 20)]
    want = [c.token_ids for c in _specformer_engine(target_dir, chained=True).generate(PROMPTS[:4], params)]
    fixed_k = _specformer_engine(target_dir, chained=True)
    with HostSyncCounter("cpu") as fixed_reads:
        fixed_k.generate(PROMPTS[:4], params)
    controller = ThresholdController(grid=[0.0, 0.3, 1.0], c=0.5) if theta == "auto" else None
    policy = DraftPolicy(entropy_score, controller=controller, acceptance_threshold=0.5 if theta == "auto" else theta,
                         device_score=entropy_score)
    engine = _context_aware_engine(target_dir, policy)
    engine._recent_widths = engine_mod.deque(maxlen=8)  # a short window, so this short run narrows its graph
    launched = _widths(engine)
    summaries = []
    engine.on_round = summaries.append  # what the metrics exporters see (tandem_draft_width, ...)
    with HostSyncCounter("cpu") as counter:
        got = [c.token_ids for c in engine.generate(PROMPTS[:4], params)]
    assert got == want
    assert engine.drafter._draft_scores is not None
    graphs, caps = [g for g, _ in launched], [c for _, c in launched]
    # the first two rounds are queued before any score is back (the width lags one round): full width
    assert caps[:2] == [4, 4] and graphs[:2] == [4, 4]
    reported = [r.draft_width for r in summaries if r.draft_width is not None]  # planned rounds, in launch order
    assert len(reported) >= 5 and reported == caps[2:2 + len(reported)]
    if theta == 0.0:
        assert set(graphs) == {4} and set(caps[2:]) == {4}
        assert (engine.stats.num_drafted, engine.stats.num_accepted) == (fixed_k.stats.num_drafted,
                                                                         fixed_k.stats.num_accepted)
    elif theta == 1.0:
        assert set(caps[2:]) == {0}
        # the window of 8 widths (the two unplanned rounds' full width first) forgets the full width
        assert graphs[2:9] == [4] * 7 and set(graphs[9:]) == {0}
        assert engine.stats.num_drafted <= fixed_k.stats.num_drafted / 4
    else:
        assert len(set(caps[2:])) >= 2 and sum(controller.counts) > 0
        assert all(c <= g for g, c in launched[2:])
    # the policy adds no host read: as many reads a round as fixed-k chained rounds (one, + admissions)
    assert counter.count / engine.num_rounds <= fixed_reads.count / fixed_k.num_rounds + 1e-9, counter.sites
    assert not engine.target._queued and engine.cache.num_free() == engine.cache.num_slots


def test_chained_predictor_scores_on_the_device_as_on_the_host(target_dir):
    """The learned predictor scores a chained round's drafts on the device with the features the
    host path computes for the same drafts (``draft_rows``): the scores the round brings back are
    ``AcceptancePredictor.predict`` of those features."""
    from tandem.control import DraftPolicy
    from tandem.drafters.base import draft_rows
    from tandem.predictor import AcceptancePredictor

    torch.manual_seed(0)
    predictor = AcceptancePredictor(hidden=8)
    policy = DraftPolicy(predictor.predict, acceptance_threshold=0.0, device_score=predictor.probabilities)
    engine = _context_aware_engine(target_dir, policy, slots=2)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()  # admission: the prompt's first drafts and their scores
    drafter = engine.drafter
    slot = engine.requests[rid].slot
    ld = drafter.head.config.num_draft_tokens
    scores = drafter.device_draft_scores(slot + 1)[slot]
    ctx = drafter._state[slot:slot + 1]
    history, length = engine.target.state.history, engine.target.state.length
    from tandem.drafters.lookup import lookup_drafts

    last = length[slot:slot + 1]
    cont, _, match = lookup_drafts(history[slot:slot + 1, :int(last) + 1], last, torch.full_like(last, ld), ld)
    ids = torch.cat([cont, match[:, None], engine.target.state.last[slot:slot + 1, None]], dim=1)
    logits = drafter._draft_rows(ctx, ids)[0]
    rows = draft_rows(logits, [SamplingParams()] * ld, [None] * ld, list(range(1, ld + 1)))
    assert torch.allclose(scores, predictor.predict(rows.features), atol=1e-5)
    while engine.has_unfinished():
        engine.step()


def test_chained_policy_widths_reuse_one_graph_per_shape(target_dir, monkeypatch):
    """Through the CUDA-graph path (capture stood in by eager calls, so it runs on the CPU) a
    chained context-aware round reads its draft cap from a device scalar: the policy's widths
    change from round to round (θ 0: all drafts, θ 1: none) while every captured round keeps one
    width per batch shape, and the output is still the target's."""
    import tandem.drafters.specformer as sf
    import tandem.models.runner as runner_mod
    from tandem.control import DraftPolicy, entropy_score
    from tandem.threshold import ThresholdController

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [c.token_ids for c in _specformer_engine(target_dir, chained=True).generate(PROMPTS[:3], params)]
    policy = DraftPolicy(entropy_score, controller=ThresholdController(grid=[0.0, 1.0], c=1.0),
                         device_score=entropy_score)
    engine = _context_aware_engine(target_dir, policy)
    object.__setattr__(engine.runner.config, "cuda_graphs", True)  # RunnerConfig refuses it on a CPU
    engine.drafter._static = True
    for mod in (runner_mod, sf):
        real = mod.CapturedCall
        monkeypatch.setattr(mod, "CapturedCall", lambda fn, inputs, capture=True, pool=None, warmup=2, label="", real=real:
                            real(fn, inputs, capture=False))
    launched = _widths(engine)
    assert [c.token_ids for c in engine.generate(PROMPTS[:3], params)] == want
    caps = {c for _, c in launched if c is not None}
    assert {0, 4} <= caps  # the plans moved between widths ...
    chained = [key for key in engine.runner._graphs if key[4] is not None and key[4][0] == "chained"]
    assert chained and {key[1] for key in chained} == {5}  # ... inside graphs of one width (k + 1 tokens a row)
    assert all(key[4][-1] for key in chained)  # every one of them reads the cap


# ------------------------------------------------- context-aware widths over n-gram, chained


def test_ngram_drafts_carry_their_evidence_on_host_and_device():
    """The evidence behind each n-gram draft (earlier occurrences of the matched n-gram that agree
    with the drafts so far, and those that continue with this one) is the same from the host index
    (``LookupIndex.lookup_with_support``) and from the device (``lookup_drafts_with_support``),
    and a well-attested draft scores above a one-off (``support_features``)."""
    import random

    from tandem.drafters.lookup import lookup_drafts_with_support, support_features

    rng = random.Random(0)
    for _ in range(200):
        T, V, k = rng.randint(2, 60), rng.choice([2, 3, 5]), rng.randint(1, 6)
        seq = [rng.randrange(V) for _ in range(T)]
        room = rng.randint(1, k)
        index = LookupIndex()
        index.extend(seq)
        drafts, n, support, survivors = index.lookup_with_support(room)
        C = T + rng.randint(0, 5)
        cont, lens, match, S, N = lookup_drafts_with_support(torch.tensor([seq + [0] * (C - T)]), torch.tensor([T - 1]),
                                                             torch.tensor([room]), k)
        L = int(lens[0])
        assert (cont[0, :L].tolist(), int(match[0])) == (drafts, n)
        assert (S[0, :L].tolist(), N[0, :L].tolist()) == (support, survivors) and not S[0, L:].any()
        assert all(1 <= s <= m for s, m in zip(support, survivors))  # the source occurrence always agrees
    index = LookupIndex()
    index.extend([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])  # the longest match, "2 3 1 2", recurs twice, each time then 3
    assert index.lookup_with_support(1) == ([3], 4, [2], [2])
    seen_once = support_features(torch.tensor([1]), torch.tensor([1]), torch.tensor([1]))
    seen_thrice = support_features(torch.tensor([3]), torch.tensor([3]), torch.tensor([1]))
    contradicted = support_features(torch.tensor([1]), torch.tensor([4]), torch.tensor([1]))
    assert contradicted[0, 1] < seen_once[0, 1] < seen_thrice[0, 1]  # the draft's share of the evidence


def test_chained_context_aware_ngram_scores_on_the_device_and_stays_lossless(word_dir):
    """A context-aware policy over n-gram chains: the drafter scores its drafts from their
    evidence inside the round (over the policy's full width, whatever the round's cap), the round's
    one copy brings the scores back and the policy sets later rounds' widths; greedy output is
    target-only's, and the scores equal the policy's score of the host features of the same
    drafts."""
    from tandem.control import DraftPolicy, entropy_score
    from tandem.threshold import ThresholdController

    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (24, 16, 30, 20)]
    prompts = WORD_PROMPTS[:4]
    want = [c.token_ids for c in _engine(word_dir, chained=True).generate(prompts, params)]
    score = lambda f: f[:, 1]  # the draft's share of the evidence  # noqa: E731
    policy = DraftPolicy(score, controller=ThresholdController(grid=[0.0, 0.6], c=0.5), acceptance_threshold=0.5,
                         device_score=score)
    drafter = NgramDrafter()
    drafter.set_acceptance_scorer(policy.device_score, 4)
    engine = Engine(word_dir, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=96), drafter=drafter,
                    num_draft_tokens=4, draft_policy=policy)
    assert engine.chains_rounds  # no host-drafted rounds under the policy
    launched = _widths(engine)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert got == want
    caps = [c for _, c in launched]
    assert caps[:2] == [4, 4] and len(set(caps[2:])) >= 2, caps  # widths planned from the scores, and varied
    assert engine.stats.num_accepted > 0 and sum(policy.controller.counts) > 0
    # the device scores of one round are the policy's score of the host features of the same drafts
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    slot = engine.requests[rid].slot
    state = engine.target.state
    last = state.length[slot:slot + 1].clone()
    history = state.history[slot:slot + 1, :int(last) + 1].clone()
    while engine.has_unfinished():
        engine.step()
    index = LookupIndex()
    index.extend(history[0].tolist())
    drafts, _, support, survivors = index.lookup_with_support(4)
    assert drafts  # the pattern recurs: there is something to score
    from tandem.drafters.lookup import support_features

    host = score(support_features(torch.tensor(support), torch.tensor(survivors), torch.arange(1, len(drafts) + 1)))
    tokens, lens = drafter.device_drafts(history, last, torch.full_like(last, 4), 4, score_room=torch.full_like(last, 4))
    assert tokens[0, :int(lens[0])].tolist() == drafts
    assert torch.allclose(drafter.device_draft_scores(1)[0, :len(drafts)], host)


def _draft_model_engine(target_dir: str, chained: bool, same_as_target: bool = False, slots: int = 4) -> Engine:
    """The tiny target with a draft model: its first layer (correlated), or the target itself."""
    from tandem.drafters import DraftModelDrafter
    from tandem.drafters.draft_model import truncated_checkpoint
    from tandem.models import load_checkpoint

    cfg = RunnerConfig(device="cpu", max_batch_size=slots, max_seq_len=96)
    ck = load_checkpoint(target_dir)
    engine = Engine(ck, cfg, drafter=DraftModelDrafter(ck if same_as_target else truncated_checkpoint(ck, 1), cfg),
                    num_draft_tokens=3)
    if not chained:
        engine.target.chains_rounds = False
    assert engine.chains_rounds is chained
    return engine


def test_chained_draft_model_drafts_what_the_host_path_drafts(target_dir):
    """A chained round runs the draft model's k steps on the device after verification (a
    two-token step from the round state, then one a draft) and primes a new slot after its
    prefill: the same tokens, text, stop cuts, logprobs and stream as host-drafted rounds, the
    same drafts verified (equal drafted and accepted counts, in float32), slots reused; and a
    draft model equal to the target has every draft accepted (its cache holds exactly the
    accepted sequence each round, the all-accepted round's last draft included)."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (24, 5, 1, 30, 20, 12, 40, 9)]
    params[3] = SamplingParams(max_tokens=30, stop=["e"], ignore_eos=True)
    prompts, params = PROMPTS * 2, params * 2  # twice the slots: slots freed and reused mid-run
    host, engine = _same_as_host_rounds(lambda chained: _draft_model_engine(target_dir, chained=chained),
                                        prompts, params)
    assert host.stats.num_accepted > 0
    assert not engine.drafter.cached and engine.drafter.runner.cache.num_free() == engine.cache.num_slots
    same = _draft_model_engine(target_dir, chained=True, same_as_target=True)
    twenty = SamplingParams(max_tokens=20, ignore_eos=True)
    base = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=96))
    assert [c.token_ids for c in same.generate(PROMPTS, twenty)] == [c.token_ids for c in base.generate(PROMPTS, twenty)]
    assert same.stats.num_drafted > 50 and same.stats.num_accepted == same.stats.num_drafted



def test_chained_draft_model_scores_its_drafts_as_the_host_path_does(target_dir):
    """Under a draft policy with a device scorer the draft model scores each chained round's
    drafts on the device (``set_acceptance_scorer``, as ``build_speculation`` sets it up), so the
    context-aware policy over it chains: the drafts and their scores equal the host path's
    (``propose`` from the same sequence: its drafts, ``AcceptancePredictor.predict`` of its
    features), and the output is target-only's."""
    from tandem.control import DraftPolicy
    from tandem.drafters import DraftModelDrafter, DraftRequest
    from tandem.drafters.draft_model import truncated_checkpoint
    from tandem.models import load_checkpoint
    from tandem.predictor import AcceptancePredictor

    torch.manual_seed(0)
    predictor = AcceptancePredictor(hidden=8)
    policy = DraftPolicy(predictor.predict, acceptance_threshold=0.0, device_score=predictor.probabilities)
    ck = load_checkpoint(target_dir)
    cfg = RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=96)
    drafter = DraftModelDrafter(truncated_checkpoint(ck, 1), cfg)
    drafter.set_acceptance_scorer(policy.device_score)
    engine = Engine(ck, cfg, drafter=drafter, num_draft_tokens=3, draft_policy=policy)
    assert engine.chains_rounds and drafter.scores_on_device
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    rid = engine.add_request(PROMPTS[0], params)
    engine.step()  # admission: the prompt's first drafts (and the first round, queued from them)
    slot = engine.requests[rid].slot
    state = engine.target.state
    seq = state.history[slot, :int(state.length[slot]) + 1].tolist()  # the sequence the current drafts follow
    host = DraftModelDrafter(truncated_checkpoint(ck, 1), cfg).propose([DraftRequest(slot, seq, 3, SamplingParams())])[0]
    assert drafter._draft_tokens[slot, :3].tolist() == host.tokens
    assert torch.allclose(drafter.device_draft_scores(slot + 1)[slot], predictor.predict(host.features), atol=1e-5)
    while engine.has_unfinished():
        engine.step()
    want = Engine(ck, cfg).generate([PROMPTS[0]], params)[0].token_ids
    assert engine.completion(rid).token_ids == want and engine.stats.num_drafted > 0
