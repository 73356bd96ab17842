"""Speculative decoding in the engine: lossless greedy and sampled output for both drafters,
acceptance metrics, stop rules and length limits inside accepted runs, context limits, drafter
failures, streaming, draft-cache rollback, and the CLI."""

from __future__ import annotations

import json
import random
import warnings
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from conftest import SMALL_VOCAB, SPEC_BENCH, reset_engine
from helpers import chi_square_pvalue, total_variation

from tandem.control import DraftPolicy, entropy_score
from tandem.threshold import ThresholdController
from tandem.drafters import (NUM_FEATURES, DraftModelDrafter, DraftProposal, DraftRequest, Drafter, NgramDrafter,
                             distribution_features, load_draft_checkpoint, truncated_checkpoint)
from tandem.drafters.base import one_hot_features
from tandem.engine import Completion, Engine
from tandem.metrics import SpecDecodeStats
from tandem.models import load_checkpoint
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams, sampling_probs
from tandem.stopping import OutputState
from tandem.tokenizer import Tokenizer

K = 4  # draft tokens per round in most tests


# ----------------------------------------------------------------------------- drafters for tests


class Recorder(Drafter):
    """Wraps a drafter; records (slot, tokens known, max_draft, drafts proposed) per request."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.asks: list[tuple[int, int, int, int]] = []

    def propose(self, requests, keep_drafting=None):
        props = self.inner.propose(requests, keep_drafting)
        assert len(props) == len(requests)
        for r, p in zip(requests, props):
            assert len(p.tokens) <= r.max_draft
            self.asks.append((r.slot, len(r.token_ids), r.max_draft, len(p.tokens)))
        return props

    def release(self, slot):
        self.inner.release(slot)


class OracleDrafter(Drafter):
    """Proposes the continuation of whichever reference sequence (prompt + target-only output)
    extends the request's tokens: the target's own greedy continuation.

    mode: "right" (as is), "wrong" (first draft replaced by another token, so nothing is ever
    accepted), "noisy" (every third position replaced: partial acceptance), "overlong" (two
    tokens more than allowed, which the engine must discard).
    """

    name = "oracle"

    def __init__(self, sequences, mode: str = "right", vocab: int = 1000) -> None:
        self.sequences = [list(s) for s in sequences]
        self.mode, self.vocab = mode, vocab
        self.asks: list[tuple[int, int, int, int]] = []  # (slot, tokens known, max_draft, proposed)

    def continuation(self, ids: list[int], n: int) -> list[int]:
        for s in self.sequences:
            if len(s) > len(ids) and s[:len(ids)] == ids:
                return s[len(ids):len(ids) + n]
        return []

    def propose(self, requests, keep_drafting=None):
        out = []
        for r in requests:
            n = r.max_draft + 2 if self.mode == "overlong" else r.max_draft
            toks = self.continuation(r.token_ids, n) if r.max_draft > 0 else []
            if self.mode == "wrong" and toks:
                toks[0] = (toks[0] + 1) % self.vocab
            if self.mode == "noisy":
                toks = [(t + 1) % self.vocab if (len(r.token_ids) + i) % 3 == 2 else t for i, t in enumerate(toks)]
            self.asks.append((r.slot, len(r.token_ids), r.max_draft, len(toks)))
            out.append(DraftProposal(toks, None, one_hot_features(len(toks))))
        return out


class FailingDrafter(Drafter):
    """Raises on the calls numbered in ``fail`` (1-based; None: always), before or after running
    ``inner`` (after: the inner drafter's state moved on although its drafts are lost)."""

    name = "failing"

    def __init__(self, inner: Drafter | None = None, fail=None, after: set[int] = frozenset()) -> None:
        self.inner, self.fail, self.after = inner, fail, after
        self.calls = 0

    def propose(self, requests, keep_drafting=None):
        self.calls += 1
        failing = self.fail is None or self.calls in self.fail
        if failing and self.calls not in self.after:
            raise RuntimeError("drafter down")
        props = self.inner.propose(requests, keep_drafting)
        if failing:
            raise RuntimeError("drafter died after drafting")
        return props

    def release(self, slot):
        if self.inner is not None:
            self.inner.release(slot)


# ----------------------------------------------------------------------------- helpers


def run(engine: Engine, requests) -> list[Completion]:
    """Queue ``(prompt_ids, params)`` pairs together, step to completion, results in order."""
    ids = [engine.add_request(prompt_ids=p, params=sp) for p, sp in requests]
    done: dict[str, Completion] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = engine.completion(out.request_id)
    assert set(done) == set(ids)
    check_drained(engine)
    return [done[i] for i in ids]


def run_alone(engine: Engine, requests) -> list[Completion]:
    return [run(engine, [r])[0] for r in requests]


def check_drained(engine: Engine) -> None:
    assert not engine.has_unfinished() and not engine.requests
    assert engine.cache.num_free() == engine.cache.num_slots
    inner = getattr(engine.drafter, "inner", engine.drafter)
    if isinstance(inner, DraftModelDrafter):  # every draft slot was released with its request
        assert inner.cached == {}
        assert inner.runner.cache.num_free() == inner.runner.cache.num_slots


def assert_same_outputs(got: list[Completion], expected: list[Completion]) -> None:
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.token_ids == e.token_ids, f"request {i}: {g.token_ids} != {e.token_ids}"
        assert g.text == e.text, f"request {i}"
        assert g.finish_reason == e.finish_reason, f"request {i}"
        assert g.prompt_tokens == e.prompt_tokens


def schedule_stats(prompt_len: int, n_out: int, max_new: int, k: int, capacity: int) -> SpecDecodeStats:
    """The metrics of an always-right drafter: each decode step proposes as many drafts as the
    engine allows, all are accepted, and the output ends after ``n_out`` tokens (a stop rule
    cuts the last run there; ``max_new`` is the request's token limit)."""
    st = SpecDecodeStats()
    pos = 1  # the first token comes from prefill, not from a decode step
    while pos < n_out:
        room = max(0, min(k, capacity - prompt_len - pos, max_new - pos - 1))
        kept = min(room + 1, n_out - pos)
        if kept == room + 1:
            st.record(room, room, kept)
        else:  # cut inside the accepted drafts: drafts, acceptances and tokens all end there
            st.record(kept, kept, kept)
        pos += kept
    return st


def sequences(requests, completions) -> list[list[int]]:
    return [list(p) + c.token_ids for (p, _), c in zip(requests, completions)]


def make_engine(base: Engine, drafter=None, k: int = K, slots: int = 8, max_seq_len: int | None = None,
                tokenizer: Tokenizer | None = None) -> Engine:
    """An engine over ``base``'s checkpoint; ``drafter`` may be a callable ``(RunnerConfig) -> Drafter``."""
    cfg = replace(base.runner_config, max_batch_size=slots, max_seq_len=max_seq_len or base.runner_config.max_seq_len)
    if callable(drafter) and not isinstance(drafter, Drafter):
        drafter = drafter(cfg)
    return Engine(base.checkpoint, cfg, tokenizer=tokenizer or base.tokenizer, drafter=drafter, num_draft_tokens=k)


def _rows(indices: list[int]) -> list[str]:
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    return [rows[i]["turns"][0] for i in indices]


# ----------------------------------------------------------------------------- tiny model fixtures


@pytest.fixture(scope="module")
def tiny(tiny_engine) -> Engine:
    """Target-only engine over the tiny random llama (real tokenizer): 8 slots, 96 tokens."""
    return make_engine(tiny_engine)


@pytest.fixture(autouse=True)
def _clean_tiny(request):
    """After each test, abort whatever it left in the module's shared engine."""
    yield
    if "tiny" in request.fixturenames:
        reset_engine(request.getfixturevalue("tiny"))


@pytest.fixture(scope="module")
def tiny_drafters(tiny_checkpoint, tiny_engine):
    """Drafter factories ``(RunnerConfig) -> Drafter`` for the tiny target."""
    other = load_checkpoint(tiny_checkpoint("llama", with_tokenizer=True, seed=1))  # another random model
    early_exit = truncated_checkpoint(tiny_engine.checkpoint, 1)  # the target's first layer: correlated
    return {
        "ngram": lambda cfg: NgramDrafter(),
        "draft-random": lambda cfg: DraftModelDrafter(other, cfg),
        "draft-truncated": lambda cfg: DraftModelDrafter(early_exit, cfg),
    }


@pytest.fixture(scope="module")
def tiny_requests(tiny):
    """Eight requests of mixed prompt lengths (1 .. 60 tokens); two of them never draft (one
    finishes at prefill, one has max_tokens 2 so no room for drafts)."""
    tok = tiny.tokenizer
    long_text = " ".join(_rows([50, 122]))
    repetitive = tok.encode("the cat sat on the mat and the cat sat on the mat and the cat sat on the")
    prompts = [tok.encode("Hello")[:1], tok.encode("Hello world")[:2], repetitive, tok.encode(long_text)[:40],
               tok.encode(long_text)[40:100], tok.encode(long_text)[:25], tok.encode(long_text)[5:10],
               tok.encode(long_text)[60:90]]
    assert [len(p) for p in prompts] == [1, 2, len(repetitive), 40, 60, 25, 5, 30]
    max_tokens = [24, 24, 24, 24, 24, 2, 1, 17]
    return [(p, SamplingParams(max_tokens=m, ignore_eos=(i % 2 == 0)))
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]


@pytest.fixture(scope="module")
def tiny_reference(tiny, tiny_requests) -> list[Completion]:
    """Target-only greedy output of each tiny request, run alone."""
    return run_alone(tiny, tiny_requests)


# ----------------------------------------------------------------------------- greedy: identical output (tiny)


@pytest.mark.parametrize("drafter, batch", [("ngram", 1), ("ngram", 8), ("draft-truncated", 1),
                                            ("draft-truncated", 8), ("draft-random", 8)])
def test_greedy_identical_tiny(tiny, tiny_drafters, tiny_requests, tiny_reference, drafter, batch):
    rec = Recorder(tiny_drafters[drafter](tiny.runner_config))
    eng = make_engine(tiny, rec)
    got = run(eng, tiny_requests) if batch == 8 else run_alone(eng, tiny_requests)
    assert_same_outputs(got, tiny_reference)
    # the drafter ran, was told to draft nothing where there is no room, and proposed within limits
    assert rec.asks
    assert any(max_draft == 0 for _, _, max_draft, _ in rec.asks)
    assert all(0 <= n <= max_draft <= K for _, _, max_draft, n in rec.asks)
    assert got[6].spec.num_steps == 0 and got[5].spec.num_drafted == 0  # max_tokens 1 and 2
    for c in got:
        assert c.spec.num_emitted == len(c.token_ids) - 1  # every token but the prefill one
        assert c.spec.num_accepted <= c.spec.num_drafted
    if drafter != "draft-random":  # the random draft model rarely agrees with the target
        assert sum(c.spec.num_accepted for c in got) > 0, "speculation never accepted a draft"


@pytest.mark.parametrize("cumulative", [False, True], ids=["per-token", "survival"])
def test_draft_model_stops_drafting_below_threshold(tiny, tiny_drafters, tiny_requests, tiny_reference, cumulative):
    """Adaptive length as the context-aware paper drafts it: with a policy, the draft model stops a
    sequence after the first position whose predicted acceptance (or survival product) is below τ,
    so the draft-model forwards past it never run. That position is still drafted (the policy cuts
    there and may branch on it). Output stays identical to target-only."""
    scored_rows = []

    def score(f):  # position 1 likely, later positions unlikely
        scored_rows.append(f.shape[0])
        return torch.where(f[:, 3] <= 1, 0.9, 0.3)

    def drafted_run(policy):
        drafter = tiny_drafters["draft-truncated"](tiny.runner_config)
        calls = []  # draft-model forwards: runner steps and a chained round's one-token forwards
        real_step, real_forward = drafter.runner.step, drafter.runner.forward_packed
        drafter.runner.step = lambda batch, *a, **kw: (calls.append(len(batch)), real_step(batch, *a, **kw))[1]
        drafter.runner.forward_packed = lambda packed, *a: (calls.append(packed.shape[0]), real_forward(packed, *a))[1]
        eng = make_engine(tiny, drafter)
        eng.draft_policy = policy
        eng.chained_rounds = False  # the host-drafted path, where the rule cuts the draft model's steps
        rule_set = []
        real_propose = drafter.propose

        def propose(asks, keep_drafting=None):
            rule_set.append(keep_drafting is not None)
            return real_propose(asks, keep_drafting)

        drafter.propose = propose
        got = run(eng, tiny_requests)
        assert rule_set and all(rule_set) == (policy is not None)  # a rule handed to every round, as a value
        return got, len(calls)

    plain, plain_steps = drafted_run(None)
    policy = DraftPolicy(score, acceptance_threshold=0.5, cumulative=cumulative)
    proposed = []
    real_apply = policy.apply
    policy.apply = lambda props, slots=None: (proposed.append(sum(len(p.tokens) for p in props)),
                                              real_apply(props, slots))[1]
    adaptive, adaptive_steps = drafted_run(policy)
    # every drafted position is scored once, while drafting: the cut reuses those scores
    assert proposed and sum(scored_rows) == sum(proposed)
    assert_same_outputs(plain, tiny_reference)
    assert_same_outputs(adaptive, tiny_reference)
    assert adaptive_steps < plain_steps  # draft forwards past the τ cut were never run
    for c in adaptive:
        assert c.spec.num_drafted <= c.spec.num_steps  # one verified draft per round at most (τ cut)
    # the rule itself: per token, 0.9 keeps and 0.3 stops; survival 0.9 * 0.3 stops too
    policy.begin_round()
    feats = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    assert policy.keep_drafting([3, 4], feats) == [True, True]
    assert policy.keep_drafting([3], feats[:1] + torch.tensor([0.0, 0.0, 0.0, 1.0])) == [False]


# ----------------------------------------------------------------------------- oracle drafters and metrics


@pytest.fixture(scope="module")
def oracle_setup(tiny, tiny_requests):
    """Three requests with ignore_eos and their target-only references (batched run)."""
    max_tokens = 1 + 4 * (K + 1)  # 21: four full runs of k + 1 tokens after the prefill token
    reqs = [(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p, _ in tiny_requests[2:5]]
    return reqs, run(tiny, reqs)


def test_oracle_drafter_accepts_everything(tiny, oracle_setup):
    reqs, ref = oracle_setup
    oracle = OracleDrafter(sequences(reqs, ref))
    eng = make_engine(tiny, oracle)
    got = run(eng, reqs)
    assert_same_outputs(got, ref)
    for c in got:
        assert c.spec.mean_accepted_length == K + 1
        assert c.spec.acceptance_rate == 1.0
        assert c.spec.num_steps == 4 and c.spec.num_drafted == 4 * K
        assert c.spec.acceptance_per_pos == [1.0] * K
    assert eng.stats.mean_accepted_length == K + 1 and eng.stats.num_steps == 12


@pytest.mark.parametrize("max_tokens", [2, 3, 6, 8, 12, 13])
def test_oracle_drafter_room_limited_runs(tiny, oracle_setup, max_tokens):
    """max_tokens not of the form 1 + m(k + 1): the last run is shortened by the engine, never
    overshoots, and the metrics follow the exact schedule."""
    reqs, ref = oracle_setup
    oracle = OracleDrafter(sequences(reqs, ref))
    eng = make_engine(tiny, oracle)
    sub = [(p, replace(sp, max_tokens=max_tokens)) for p, sp in reqs]
    got = run(eng, sub)
    for (p, _), c, r in zip(sub, got, ref):
        assert c.token_ids == r.token_ids[:max_tokens]
        assert c.finish_reason == "length" and c.completion_tokens == max_tokens
        assert c.spec == schedule_stats(len(p), max_tokens, max_tokens, K, eng.max_seq_len)
    for slot, known, max_draft, _ in oracle.asks:  # never asked for drafts past max_tokens
        generated = known - len(sub[slot][0])  # requests were admitted together: slot i = request i
        assert generated + max_draft + 1 <= max_tokens


@pytest.mark.parametrize("drafter", ["always-wrong", "none"])
def test_mean_accepted_length_is_one_without_accepted_drafts(tiny, oracle_setup, drafter):
    """An always-wrong drafter (every draft rejected) and no drafter at all: one token per step."""
    reqs, ref = oracle_setup
    wrong = drafter == "always-wrong"
    eng = make_engine(tiny, OracleDrafter(sequences(reqs, ref), mode="wrong", vocab=tiny.checkpoint.config.vocab_size)
                      if wrong else None)
    got = run(eng, reqs)
    assert_same_outputs(got, ref)
    for c in got:
        assert c.spec.mean_accepted_length == 1.0 and (c.spec.num_drafted > 0) == wrong
        assert not wrong or c.spec.acceptance_rate == 0.0
        assert c.spec.num_steps == c.completion_tokens - 1
    assert eng.stats.mean_accepted_length == 1.0


def test_noisy_oracle_partial_acceptance(tiny, oracle_setup):
    """Drafts wrong at every third position: partial runs, KV rollback after each rejection."""
    reqs, ref = oracle_setup
    eng = make_engine(tiny, OracleDrafter(sequences(reqs, ref), mode="noisy", vocab=tiny.checkpoint.config.vocab_size))
    got = run(eng, reqs)
    assert_same_outputs(got, ref)
    for c in got:
        assert 1.0 < c.spec.mean_accepted_length < K + 1
        assert 0.0 < c.spec.acceptance_rate < 1.0


def test_overlong_proposals_are_discarded(tiny, oracle_setup):
    reqs, ref = oracle_setup
    eng = make_engine(tiny, OracleDrafter(sequences(reqs, ref), mode="overlong"))
    got = run(eng, reqs)
    assert_same_outputs(got, ref)
    assert all(c.spec.num_drafted == 0 and c.spec.mean_accepted_length == 1.0 for c in got)


# ----------------------------------------------------------------------------- stop rules inside accepted runs


def _mid_run_index(candidates, ref_tokens) -> int:
    """First index j >= 2 whose token first occurs at j and that lies strictly inside an
    always-right drafter's run (runs cover output indices 1..k+1, k+2..2k+2, ...)."""
    for j in range(2, len(ref_tokens)):
        if (j - 1) % (K + 1) != K and ref_tokens[j] not in ref_tokens[:j] and j in candidates:
            return j
    raise AssertionError("no usable stop token in the reference output")


@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
def test_stop_token_inside_accepted_run(tiny, oracle_setup, how):
    """The oracle's drafts run past the stop token; the output is cut right after it (the stop
    token kept, as for EOS), with the metrics cut at the same boundary."""
    reqs, ref = oracle_setup
    prompt, sp = reqs[0]
    full = ref[0].token_ids
    j = _mid_run_index(range(2, 20), full)
    if how == "stop_token_ids":
        tokenizer, params = tiny.tokenizer, replace(sp, stop_token_ids=(full[j],))
    else:  # the token is the model's EOS
        tokenizer, params = Tokenizer(tiny.tokenizer.hf, [full[j]]), replace(sp, ignore_eos=False)
    base = make_engine(tiny, tokenizer=tokenizer)
    oracle = OracleDrafter(sequences(reqs, ref))
    eng = make_engine(tiny, oracle, tokenizer=tokenizer)
    expected = run(base, [(prompt, params)])[0]
    got = run(eng, [(prompt, params)])[0]
    assert expected.token_ids == full[:j + 1] and expected.finish_reason == "stop"
    assert_same_outputs([got], [expected])
    # the last round proposed drafts beyond the stop token, and they were dropped
    last = oracle.asks[-1]
    assert last[1] - len(prompt) + last[3] > j + 1
    assert got.spec == schedule_stats(len(prompt), j + 1, sp.max_tokens, K, eng.max_seq_len)
    assert got.spec.num_emitted == j
    assert eng.stats == got.spec


def test_stop_string_inside_accepted_run(tiny, oracle_setup):
    reqs, ref = oracle_setup
    prompt, sp = reqs[1]
    full = ref[1]
    # a 3-character stop string that first completes at a token strictly inside a run
    choice = None
    for i in range(len(full.text) - 3):
        stop = full.text[i:i + 3]
        if not stop.strip() or "\ufffd" in stop:
            continue
        st = OutputState(tiny.tokenizer, replace(sp, stop=(stop,)), sp.max_tokens)
        kept = st.append(full.token_ids)
        j = kept - 1
        if st.finish_reason == "stop" and j >= 2 and (j - 1) % (K + 1) not in (0, K):
            choice = stop, j
            break
    assert choice is not None, f"no usable stop string in {full.text!r}"
    stop, j = choice
    params = replace(sp, stop=(stop,))
    expected = run(tiny, [(prompt, params)])[0]
    assert expected.finish_reason == "stop" and expected.token_ids == full.token_ids[:j + 1]
    assert expected.text == full.text[:full.text.index(stop)]
    eng = make_engine(tiny, OracleDrafter(sequences(reqs, ref)))
    got = run(eng, [(prompt, params)])[0]
    assert_same_outputs([got], [expected])
    assert got.spec == schedule_stats(len(prompt), j + 1, sp.max_tokens, K, eng.max_seq_len)


def test_ngram_prompt_shorter_than_window(tiny):
    rec = Recorder(NgramDrafter(max_n=4, min_n=1))
    eng = make_engine(tiny, rec)
    reqs = [([t], SamplingParams(max_tokens=12, ignore_eos=True)) for t in (9906, 13)]
    reqs += [([13, 13], SamplingParams(max_tokens=12, ignore_eos=True))]
    assert_same_outputs(run(eng, reqs), run(tiny, reqs))
    assert_same_outputs(run_alone(eng, reqs), run_alone(tiny, reqs))
    assert min(known for _, known, _, _ in rec.asks) == 2  # asked with fewer tokens than max_n + 1


# ----------------------------------------------------------------------------- context limit


@pytest.mark.parametrize("drafter", ["oracle", "ngram", "draft-truncated"])
def test_drafts_never_overrun_the_context(tiny, tiny_drafters, drafter):
    """Small context (32 tokens): requests near the limit get exactly the target-only output,
    no CacheFullError, and the drafter is never asked for drafts that would not fit."""
    cap = 32
    base = make_engine(tiny, max_seq_len=cap)
    lengths = [31, 30, 29, 28, 27, 25, 22, 16]
    reqs = [(list(range(1000 + 7 * n, 1000 + 8 * n)), SamplingParams(max_tokens=100, ignore_eos=True)) for n in lengths]
    expected = run(base, reqs)
    for (p, _), c in zip(reqs, expected):
        assert c.finish_reason == "length" and len(p) + c.completion_tokens == cap
    if drafter == "oracle":
        rec = Recorder(OracleDrafter(sequences(reqs, expected)))
    else:
        rec = Recorder(tiny_drafters[drafter](base.runner_config))
    eng = make_engine(tiny, rec, max_seq_len=cap)
    got = run(eng, reqs)  # raises CacheFullError if a verification overran a slot
    assert_same_outputs(got, expected)
    assert all(max_draft <= cap - known for _, known, max_draft, _ in rec.asks)
    assert any(0 < max_draft < K for _, _, max_draft, _ in rec.asks)  # the limit shortened some rounds
    if drafter == "oracle":
        for (p, _), c in zip(reqs, got):
            assert c.spec == schedule_stats(len(p), cap - len(p), cap - len(p), K, cap)
    got = run_alone(eng, reqs[:3])
    assert_same_outputs(got, expected[:3])


# ----------------------------------------------------------------------------- drafter failures


def test_failing_drafter_falls_back_to_target_only(tiny, tiny_requests, tiny_reference):
    eng = make_engine(tiny, FailingDrafter())
    got = run(eng, tiny_requests)
    assert_same_outputs(got, tiny_reference)
    assert eng.drafter.calls > 0
    assert all(c.spec.num_drafted == 0 and c.spec.mean_accepted_length == 1.0 for c in got)
    # sampled requests too: a drafter that fails before drawing anything changes nothing
    sampled = [(p, replace(sp, temperature=0.8, seed=i)) for i, (p, sp) in enumerate(tiny_requests)]
    assert_same_outputs(run(eng, sampled), run(tiny, sampled))


def test_flaky_draft_model_recovers(tiny, tiny_drafters, tiny_requests):
    """A draft model that fails in some rounds, twice after its cache already moved on, then for
    18 rounds in a row (its catch-up feed afterwards is long enough to go through prefill):
    output unchanged, and it drafts (and gets drafts accepted) again once it recovers."""
    reqs = [(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p, _ in tiny_requests[:4]]
    expected = run(tiny, reqs)
    inner = Recorder(tiny_drafters["draft-truncated"](tiny.runner_config))
    flaky = FailingDrafter(inner, fail={2, 3, *range(5, 23)}, after={2, 3})
    eng = make_engine(tiny, flaky)
    got = run(eng, reqs)
    assert_same_outputs(got, expected)
    assert flaky.calls > 23
    resumed = inner.asks[4 * 4:]  # the inner drafter ran in calls 1 .. 4, then from call 23 on (4 requests each)
    assert len(resumed) > 0
    assert any(n > 0 for *_, n in resumed)
    assert sum(c.spec.num_accepted for c in got) > 0
    check_drained(eng)
    assert inner.inner.cached == {}


class MalformedDrafter(Drafter):
    """Returns proposals the engine cannot verify as they are (a buggy or remote drafter)."""

    name = "malformed"

    def __init__(self, kind: str, vocab: int) -> None:
        self.kind, self.vocab = kind, vocab

    def propose(self, requests, keep_drafting=None):
        if self.kind == "too-few-proposals":
            return []
        out = []
        for r in requests:
            if r.max_draft < 2:
                out.append(DraftProposal.empty())
            elif self.kind == "token-out-of-vocab":
                out.append(DraftProposal([self.vocab + 5], None, one_hot_features(1)))
            elif self.kind == "negative-token":
                out.append(DraftProposal([-1], None, one_hot_features(1)))
            else:  # "probs-shape": q rows do not match the drafts
                out.append(DraftProposal([1, 2], torch.full((1, self.vocab), 1 / self.vocab), one_hot_features(2)))
        return out


@pytest.mark.parametrize("kind", ["too-few-proposals", "token-out-of-vocab", "negative-token", "probs-shape"])
def test_malformed_drafter_output_falls_back_to_target_only(tiny, tiny_requests, tiny_reference, kind):
    """Drafts that cannot be verified are a drafter failure like an exception: the engine drops
    them and decodes target-only (same output), instead of failing the whole batch's step."""
    eng = make_engine(tiny, MalformedDrafter(kind, tiny.checkpoint.config.vocab_size))
    reqs = tiny_requests[:4] + [(p, replace(sp, temperature=0.9, seed=7)) for p, sp in tiny_requests[4:]]
    expected = tiny_reference[:4] + run(tiny, reqs[4:])
    got = run(eng, reqs)
    assert_same_outputs(got, expected)
    assert all(c.spec.num_accepted == 0 for c in got)


def test_engine_rejects_bad_num_draft_tokens(tiny):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        make_engine(tiny, NgramDrafter(), k=0)
    make_engine(tiny, None, k=0)  # no drafter: k is unused


def test_seeded_speculative_sampling_reproducible_across_batches(tiny, tiny_drafters, tiny_requests, tiny_reference):
    """Greedy and seeded sampled requests share a batch: greedy outputs stay exactly target-only,
    and each sampled output depends on its seed only, not on what else is in the batch."""
    eng = make_engine(tiny, tiny_drafters["draft-truncated"](tiny.runner_config))
    sampled = [(p, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=11 + i, ignore_eos=True))
               for i, (p, _) in enumerate(tiny_requests[:4])]
    mixed = [r for pair in zip(tiny_requests[:4], sampled) for r in pair]
    got = run(eng, mixed)
    assert_same_outputs(got[0::2], tiny_reference[:4])
    alone = run_alone(eng, sampled)
    assert_same_outputs(got[1::2], alone)
    assert sum(c.spec.num_accepted for c in got[1::2]) > 0
    p, sp = sampled[3]
    assert run(eng, [(p, replace(sp, seed=sp.seed + 100))])[0].token_ids != alone[3].token_ids  # the seed matters


def test_abort_releases_draft_model_slots(tiny, tiny_drafters):
    drafter = tiny_drafters["draft-truncated"](tiny.runner_config)
    eng = make_engine(tiny, drafter)
    stream = eng.stream("hello there", SamplingParams(max_tokens=40, ignore_eos=True))
    other = eng.add_request(prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        next(stream)
    assert len(drafter.cached) == 2
    stream.close()  # aborts the streamed request
    eng.abort(other)
    check_drained(eng)


# ----------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("drafter", ["oracle", "ngram"])
def test_stream_with_drafter(tiny, drafter):
    prompt = "Write a short story about a robot who learns to paint."
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = tiny.generate([prompt], sp)[0]
    ids = tiny.encode_prompt(prompt)
    d = OracleDrafter([ids + ref.token_ids]) if drafter == "oracle" else NgramDrafter()
    eng = make_engine(tiny, d)
    outs = list(eng.stream(prompt, sp))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.text_delta for o in outs) == ref.text
    assert [t for o in outs for t in o.new_token_ids] == ref.token_ids  # every token exactly once
    if drafter == "oracle":
        assert max(len(o.new_token_ids) for o in outs) == K + 1
        assert len(outs) == 1 + -(-(len(ref.token_ids) - 1) // (K + 1))
    check_drained(eng)


def test_stream_with_drafter_and_stop_string(tiny):
    prompt = "Tell me about the sea."
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = tiny.generate([prompt], sp)[0]
    ids = tiny.encode_prompt(prompt)
    # stop at a string completing inside the output; the oracle's runs straddle it
    stop = next(ref.text[i:i + 2] for i in range(len(ref.text) // 3, len(ref.text) - 2)
                if ref.text[i:i + 2].strip() and "\ufffd" not in ref.text[i:i + 2])
    params = replace(sp, stop=(stop,))
    expected = tiny.generate([prompt], params)[0]
    assert expected.finish_reason == "stop"
    eng = make_engine(tiny, OracleDrafter([ids + ref.token_ids]))
    outs = list(eng.stream(prompt, params))
    text = ""
    for o in outs:
        text += o.text_delta
        assert expected.text.startswith(text)  # nothing past the cut is ever streamed
    assert text == expected.text
    assert [t for o in outs for t in o.new_token_ids] == expected.token_ids
    assert outs[-1].finish_reason == "stop"


# ----------------------------------------------------------------------------- draft model drafter unit tests


def test_draft_model_cache_rollback(tiny, monkeypatch):
    ck = truncated_checkpoint(tiny.checkpoint, 1)
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=64)
    d = DraftModelDrafter(ck, cfg)
    cache = d.runner.cache
    prompt = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    sp = SamplingParams()
    first = d.propose([DraftRequest(2, prompt, 4, sp)])[0]
    assert len(first.tokens) == 4 and first.probs is None and first.features.shape == (4, NUM_FEATURES)
    torch.testing.assert_close(first.features[:, 3], torch.arange(1.0, 5.0))
    # the last draft is never fed; the cache holds prompt + first three drafts
    assert cache.lengths[2] == len(prompt) + 3 and d.cached[2] == prompt + first.tokens[:3]
    assert cache.lengths[0] == 0 and cache.is_free(0)  # the slot numbering mirrors the target's

    truncations = []
    real_truncate = cache.truncate
    monkeypatch.setattr(cache, "truncate", lambda slot, n: (truncations.append((slot, n)), real_truncate(slot, n))[1])

    # next round: the target accepted one draft and then emitted another token
    other = next(t for t in range(100, 200) if t != first.tokens[1])
    seq = prompt + [first.tokens[0], other]
    second = d.propose([DraftRequest(2, seq, 1, sp)])[0]
    assert truncations == [(2, len(prompt) + 1)]  # rolled back to the common prefix ...
    assert cache.lengths[2] == len(seq) and d.cached[2] == seq  # ... then fed the new token only
    fresh = DraftModelDrafter(ck, cfg)
    assert second.tokens == fresh.propose([DraftRequest(2, seq, 1, sp)])[0].tokens

    # all drafts accepted plus a bonus token: nothing to roll back
    truncations.clear()
    third = d.propose([DraftRequest(2, seq, 3, sp)])[0]
    assert cache.lengths[2] == len(seq) + 2
    seq2 = seq + third.tokens + [7]
    fourth = d.propose([DraftRequest(2, seq2, 2, sp)])[0]
    assert truncations[-1] == (2, len(seq) + 2)
    assert cache.lengths[2] == len(seq2) + 1
    assert fourth.tokens == fresh.propose([DraftRequest(2, seq2, 2, sp)])[0].tokens

    # release, then a new sequence in the same slot starts from scratch
    d.release(2)
    assert cache.is_free(2) and 2 not in d.cached
    d.release(2)  # releasing twice is harmless
    new = d.propose([DraftRequest(2, seq2[3:], 2, sp)])[0]
    assert new.tokens == DraftModelDrafter(ck, cfg).propose([DraftRequest(2, seq2[3:], 2, sp)])[0].tokens


def test_draft_model_batch_and_sampled_proposals(tiny):
    ck = truncated_checkpoint(tiny.checkpoint, 1)
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=64)
    d = DraftModelDrafter(ck, cfg)
    tok = tiny.tokenizer
    greedy = SamplingParams()
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    reqs = [DraftRequest(0, tok.encode("one two three"), 3, greedy),
            DraftRequest(1, tok.encode("a much longer prompt that goes through the prefill path of the drafter"),
                         2, sampled, torch.Generator().manual_seed(3)),
            DraftRequest(3, tok.encode("zero"), 0, greedy)]
    props = d.propose(reqs)
    assert [len(p.tokens) for p in props] == [3, 2, 0]
    assert 3 not in d.cached  # nothing asked of it, nothing claimed
    q = props[1].probs
    assert q is not None and q.shape == (2, ck.config.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(2))
    assert all(float(q[i, t]) > 0 for i, t in enumerate(props[1].tokens))
    torch.testing.assert_close(props[1].features, distribution_features(q))
    # a batched proposal equals each sequence proposed alone (greedy)
    alone = DraftModelDrafter(ck, cfg).propose([reqs[0]])[0]
    assert alone.tokens == props[0].tokens
    torch.testing.assert_close(alone.features, props[0].features)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_draft_model_chained_proposals_equal_position_at_a_time(tiny, device, monkeypatch):
    """Greedy host-drafted rounds (what a drafter service runs) draft in one step whose epilogue
    chains every draft (``_propose_chained``; on a GPU from a CUDA graph): the same tokens, features
    and top tokens, and the same draft cache (up to the drafts it fed past a row's own limit), as
    drafting a position at a time, over rounds with rejections, all-accepted runs, a long new
    sequence and mixed ``max_draft``; one runner step a round."""
    ck = truncated_checkpoint(tiny.checkpoint, 1)
    cfg = RunnerConfig(device=device, dtype=torch.float32, max_batch_size=4, max_seq_len=96,
                       cuda_graphs=device == "cuda")
    chained, stepwise = DraftModelDrafter(ck, cfg), DraftModelDrafter(ck, cfg)
    every = lambda slots, feats: [True] * len(slots)  # noqa: E731 - a keep_drafting that forces the stepwise path
    rng = random.Random(11)
    vocab = ck.config.vocab_size
    seqs = {0: [rng.randrange(vocab) for _ in range(7)], 1: [rng.randrange(vocab) for _ in range(30)],
            3: [rng.randrange(vocab) for _ in range(3)]}
    steps = []
    real_step = chained.runner.step
    monkeypatch.setattr(chained.runner, "step", lambda *a, **kw: (steps.append(1), real_step(*a, **kw))[1])
    for rnd in range(6):
        limits = {s: rng.choice([1, 3, 4]) for s in seqs}
        reqs = [DraftRequest(s, list(t), limits[s], SamplingParams()) for s, t in seqs.items()]
        steps.clear()
        got, want = chained.propose(reqs), stepwise.propose(reqs, keep_drafting=every)
        assert len(steps) == 1, rnd
        for s, g, w in zip(seqs, got, want):
            assert g.tokens == w.tokens and len(g.tokens) == limits[s], (rnd, s)
            torch.testing.assert_close(g.features, w.features)
            assert torch.equal(g.top_tokens, w.top_tokens) and g.probs is None
            # the chain feeds k - 1 drafts of every row (k: the round's longest), the stepwise path a row's own
            held = stepwise.cached[s]
            assert chained.cached[s][:len(held)] == held
            assert len(chained.cached[s]) == len(seqs[s]) + max(limits.values()) - 1
            assert chained.runner.cache.lengths[s] == len(chained.cached[s])
            assert stepwise.runner.cache.lengths[s] == len(held)
            accepted = rng.randint(0, len(g.tokens))  # the target takes some drafts, then a token of its own
            seqs[s] = seqs[s] + g.tokens[:accepted] + [rng.randrange(vocab)]
    for s in seqs:
        n = stepwise.runner.cache.lengths[s]
        torch.testing.assert_close(chained.runner.cache.k[:, s, :, :n], stepwise.runner.cache.k[:, s, :, :n])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_draft_model_chained_sampled_drafts(tiny, device):
    """Sampled requests draft in the chained round too: each draft is drawn from the q it comes
    with (the request's sampling transform of the draft logits: a distribution, the draft inside
    its support, features of q), a seeded request draws the same drafts alone as beside others,
    and a greedy request beside it drafts what it drafts alone."""
    ck = truncated_checkpoint(tiny.checkpoint, 1)
    cfg = RunnerConfig(device=device, dtype=torch.float32, max_batch_size=4, max_seq_len=96,
                       cuda_graphs=device == "cuda")
    rng = random.Random(5)
    vocab = ck.config.vocab_size
    seq, other = [rng.randrange(vocab) for _ in range(9)], [rng.randrange(vocab) for _ in range(5)]
    sampled = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=17)
    together = DraftModelDrafter(ck, cfg)
    for _ in range(2):  # (on a GPU the second round runs from the step's captured graph)
        both = together.propose([DraftRequest(0, seq, 4, sampled), DraftRequest(1, other, 3, SamplingParams())])
    alone_s = DraftModelDrafter(ck, cfg).propose([DraftRequest(2, seq, 4, sampled)])[0]
    alone_g = DraftModelDrafter(ck, cfg).propose([DraftRequest(3, other, 3, SamplingParams())])[0]
    p, g = both
    assert p.tokens == alone_s.tokens and g.tokens == alone_g.tokens and g.probs is None
    q = p.probs.float().cpu()
    assert q.shape == (4, vocab) and torch.allclose(q.sum(-1), torch.ones(4), atol=1e-5)
    assert all(float(q[i, t]) > 0 for i, t in enumerate(p.tokens)) and int((q[0] > 0).sum()) <= 20
    torch.testing.assert_close(q, alone_s.probs.float().cpu())
    torch.testing.assert_close(p.features, distribution_features(q), atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- speculative sampling is lossless

SAMPLING_N = 2000  # requests (distinct seeds) per configuration
SAMPLING_DEPTH = 4  # tokens examined per request: max_tokens, so every one comes from spec decoding runs
SAMPLING_CONFIGS = {
    "T1.0": SamplingParams(temperature=1.0),
    "T0.7": SamplingParams(temperature=0.7),
    "T1.0-top_p0.9": SamplingParams(temperature=1.0, top_p=0.9),
    # every logit adjustment at once: a bias, the three penalties (the prompt holds every token, so
    # the repetition penalty touches all; the output's counts change from token to token), and
    # min_tokens over the whole output with stop id 11 (never emitted, even when drafted)
    "T0.8-adjusted": SamplingParams(temperature=0.8, logit_bias={3: 2.0, 7: -1.5, 20: 1.0}, presence_penalty=-1.2,
                                    frequency_penalty=-0.6, repetition_penalty=1.3, stop_token_ids=(11,),
                                    min_tokens=SAMPLING_DEPTH, max_tokens=SAMPLING_DEPTH),
}


@pytest.fixture(scope="module")
def sampling_setup(small_vocab_checkpoint):
    """Target (vocab 32), a correlated draft model, a prompt, and the target's exact next-token
    logits after every continuation of up to SAMPLING_DEPTH - 1 tokens (Hugging Face + KV cache).

    The prompt holds every token (the n-gram drafter always finds a match) followed by the
    target's own greedy continuation (so n-gram drafts are sometimes accepted)."""
    import copy

    from transformers import AutoModelForCausalLM

    target_dir = small_vocab_checkpoint(seed=0, logit_scale=1.5)
    draft_dir = small_vocab_checkpoint(seed=0, logit_scale=1.5, perturb=0.02)
    target = Engine(str(target_dir), RunnerConfig(device="cpu", max_batch_size=64, max_seq_len=64))
    prompt = torch.randperm(SMALL_VOCAB, generator=torch.Generator().manual_seed(0)).tolist() + [5, 9, 17]
    prompt += run(target, [(prompt, SamplingParams(max_tokens=16, ignore_eos=True))])[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    logits = []  # logits[t]: [V] * t + [V] next-token logits after prompt + t tokens
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames past_key_values
        out = model(torch.tensor([prompt]), use_cache=True)
        logits.append(out.logits[0, -1].float())
        for t in range(1, SAMPLING_DEPTH):
            tokens = torch.arange(SMALL_VOCAB)
            ctx = torch.cartesian_prod(*[tokens] * t) if t > 1 else tokens[:, None]  # [V ** t, t], row-major
            rows = []
            for chunk in ctx.split(4096):
                cache = copy.deepcopy(out.past_key_values)
                cache.batch_repeat_interleave(chunk.shape[0])
                rows.append(model(chunk, past_key_values=cache, use_cache=True).logits[:, -1].float())
            logits.append(torch.cat(rows).view(*([SMALL_VOCAB] * t), SMALL_VOCAB))
    return target, load_checkpoint(draft_dir), prompt, logits


def adjusted_reference(lg: torch.Tensor, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """``lg`` (``[V] * t + [V]``: next-token logits after each t-token output) under ``params``'
    logit adjustments, restated from their definitions (OpenAI's logit_bias and presence /
    frequency penalties, CTRL's repetition penalty, vLLM's min_tokens) over each output."""
    t, V = lg.dim() - 1, lg.shape[-1]
    outputs = (torch.cartesian_prod(*[torch.arange(V)] * t) if t > 1 else torch.arange(V)[:, None] if t
               else torch.zeros(1, 0, dtype=torch.int64))
    counts = torch.zeros(outputs.shape[0], V, dtype=torch.float64).scatter_add_(
        1, outputs, torch.ones(outputs.shape, dtype=torch.float64))
    x = lg.reshape(-1, V).double().clone()
    for tok, b in params.logit_bias:
        x[:, tok] += b
    seen = (counts > 0) | torch.isin(torch.arange(V), torch.tensor(prompt))[None, :]
    r = params.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
    if t < params.min_tokens:
        x[:, list(params.stop_token_ids)] = float("-inf")
    return x.view(lg.shape)


def exact_distributions(logits: list[torch.Tensor], params: SamplingParams, prompt: list[int] | None = None):
    """Marginal distribution of each generated position and the joint of positions 1 and 2,
    under target-only sampling with ``params`` (its logit adjustments over ``prompt``)."""
    joint = None
    marginals = []
    for t, lg in enumerate(logits):
        if params.adjusts_logits:
            lg = adjusted_reference(lg, prompt, params).float()
        flat = lg.reshape(-1, lg.shape[-1])
        n = flat.shape[0]
        p = sampling_probs(flat, torch.full((n,), float(params.temperature)), torch.full((n,), params.top_k),
                           torch.full((n,), float(params.top_p))).double().view(lg.shape)
        joint = p if joint is None else joint[..., None] * p
        marginals.append(joint.sum(dim=tuple(range(t))) if t else joint)
        if t == 2:
            pair = joint.sum(dim=0)
    return marginals, pair


def sample_first_tokens(engine: Engine, prompt: list[int], params: SamplingParams, n: int) -> torch.Tensor:
    """``[n, SAMPLING_DEPTH]`` tokens of n requests with seeds 0 .. n-1."""
    reqs = [(prompt, replace(params, max_tokens=SAMPLING_DEPTH, seed=s, ignore_eos=True)) for s in range(n)]
    return torch.tensor([c.token_ids for c in run(engine, reqs)])


def check_distributions(samples: torch.Tensor, marginals, pair, what: str) -> None:
    failures = []
    for pos, m in enumerate(marginals):
        counts = torch.bincount(samples[:, pos], minlength=SMALL_VOCAB)
        pv = chi_square_pvalue(counts, m)
        if pv < 1e-4:
            failures.append(f"position {pos}: p-value {pv:.1e}, TV {total_variation(counts, m):.3f}")
    counts = torch.bincount(samples[:, 1] * SMALL_VOCAB + samples[:, 2], minlength=SMALL_VOCAB ** 2)
    pv = chi_square_pvalue(counts, pair)
    if pv < 1e-4:
        failures.append(f"positions (1, 2) jointly: p-value {pv:.1e}")
    assert not failures, f"{what}: sampled tokens do not follow target-only sampling: {failures}"


def _specformer_for(checkpoint, k: int):
    """A SpecFormer head with random weights for the small-vocabulary target (its drafts are
    sampled from a q unrelated to p: the hardest case for the residual)."""
    from tandem.drafters.specformer import SpecFormerDrafter
    from tandem.train.specformer import new_head

    head = new_head(checkpoint.config, k, None, False, 0, False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1.0 if p.ndim == 1 else 0.0))
    return SpecFormerDrafter(head.eval())


@pytest.mark.parametrize("config", list(SAMPLING_CONFIGS))
@pytest.mark.parametrize("drafter", ["draft-model", "ngram", "draft-model-tree", "specformer", "specformer-widths",
                                     "specformer-tree", "ngram-tree"])
def test_speculative_sampling_is_lossless(sampling_setup, drafter, config):
    target, draft_ck, prompt, logits = sampling_setup
    params = SAMPLING_CONFIGS[config]
    k = SAMPLING_DEPTH - 2  # the first decode round verifies k drafts + a bonus: positions 1 .. 3
    policy = None
    if drafter.startswith("specformer"):
        d = _specformer_for(target.checkpoint, k)
    else:
        d = DraftModelDrafter(draft_ck, target.runner_config) if drafter.startswith("draft-model") else NgramDrafter(top_m=3)
    if drafter == "specformer-widths":
        # a context-aware policy in chained rounds: the head scores its drafts on the device and the
        # online θ (0: every draft; 1: none) sets each round's width for the whole batch, so a request
        # is verified with different draft lengths depending on the rounds it shares
        policy = DraftPolicy(entropy_score, controller=ThresholdController(grid=[0.0, 1.0], c=1.0),
                             device_score=entropy_score)
        d.set_acceptance_scorer(policy.device_score)
    if drafter.endswith("-tree"):
        # keep draft 1, call position 2 hard and branch it into its top-3 candidates: a token tree
        # [d1 -> {c1, c2, c3}] verified in one pass (hard-position enhancement); for SpecFormer the
        # candidates are the top-3 of the head's slot distribution at that position
        policy = DraftPolicy(lambda f: torch.where(f[:, 3] <= 1, 0.95, 0.05), acceptance_threshold=0.5, branch_top_m=3)
    eng = Engine(target.checkpoint, target.runner_config, tokenizer=target.tokenizer, drafter=d, num_draft_tokens=k,
                 draft_policy=policy)
    widths = []
    if drafter == "specformer-widths":
        assert eng.chains_rounds
        launch = eng.target.launch_chained
        eng.target.launch_chained = lambda items, dr=None, cap=None: widths.append(cap) or launch(items, dr, cap)
    samples = sample_first_tokens(eng, prompt, params, SAMPLING_N)
    marginals, pair = exact_distributions(logits, params, prompt)
    check_distributions(samples, marginals, pair, f"{drafter}, {config}")
    # speculation really happened, with both accepted and rejected drafts at every position
    st = eng.stats
    if drafter == "specformer-widths":  # rounds of both widths ran, and drafts were verified
        assert {0, k} <= set(widths) and st.num_drafted > SAMPLING_N / 4, (set(widths), st.num_drafted)
        return
    if drafter == "ngram-tree":  # leaves: the continuations of the earlier occurrences, when they differ
        assert not eng.chains_rounds and st.drafted_per_pos[1] > SAMPLING_N / 2 and st.accepted_per_pos[1] > 0, st
        return
    if drafter.endswith("-tree"):  # 1 chain draft + 3 leaves per tree; positions count tree tokens
        assert not eng.chains_rounds  # trees are verified in host-driven rounds
        assert st.num_drafted > 3 * SAMPLING_N and 0.05 < st.acceptance_per_pos[0] < 0.95, st
        # a leaf is accepted, not always (the random head's q is far from p: its leaves rarely pass)
        low = 0.05 if drafter == "draft-model-tree" else 0.003
        assert low < sum(st.accepted_per_pos[1:]) / SAMPLING_N < 0.95, st
        return
    assert st.num_drafted > SAMPLING_N and len(st.acceptance_per_pos) == k
    assert 0.05 < st.acceptance_per_pos[0] < 0.95, st.acceptance_per_pos
    low = 0.05 if drafter == "draft-model" else 0.0  # n-gram (and random-head) drafts rarely survive two positions
    assert all(low < a < 0.95 for a in st.acceptance_per_pos), st.acceptance_per_pos


def test_target_only_sampling_matches_exact_distribution(sampling_setup):
    """The reference the lossless test compares against: target-only sampling in the engine."""
    target, _, prompt, logits = sampling_setup
    params = SAMPLING_CONFIGS["T1.0-top_p0.9"]
    samples = sample_first_tokens(target, prompt, params, SAMPLING_N)
    marginals, pair = exact_distributions(logits, params)
    check_distributions(samples, marginals, pair, "target-only")
    # the check has power: the same samples do not pass for a nearby configuration
    other, other_pair = exact_distributions(logits, replace(params, temperature=0.9))
    with pytest.raises(AssertionError, match="do not follow"):
        check_distributions(samples, other, other_pair, "temperature 0.9")


# ----------------------------------------------------------------------------- real model (slow)

REAL_ROWS = [244, 41, 0, 10, 9]  # qa, coding, writing, roleplay, writing: 39 .. 126 prompt tokens
REAL_MAX_TOKENS = 16


@contextmanager
def drafting(engine: Engine, drafter: Drafter | None, k: int = K):
    """Run the shared real engine with a drafter, restoring it afterwards."""
    saved = engine.drafter, engine.num_draft_tokens
    engine.drafter, engine.num_draft_tokens = drafter, k
    try:
        yield engine
    finally:
        reset_engine(engine)
        engine.drafter, engine.num_draft_tokens = saved


@pytest.fixture(scope="module")
def real_requests(real_engine):
    """The five Spec-Bench prompts, then a raw 1-token prompt, a request with no room to draft
    (max_tokens 2) and one that ends at prefill (max_tokens 1)."""
    prompts = [real_engine.encode_prompt(t) for t in _rows(REAL_ROWS)]
    sp = SamplingParams(max_tokens=REAL_MAX_TOKENS)
    hi = real_engine.encode_prompt("Hi", chat=False)
    assert len(hi) == 1
    return [(p, sp) for p in prompts] + [(hi, sp), (prompts[0], replace(sp, max_tokens=2)),
                                         (prompts[1], replace(sp, max_tokens=1))]


@pytest.fixture(scope="module")
def real_reference(real_engine, real_requests) -> list[Completion]:
    with drafting(real_engine, None):
        return run(real_engine, real_requests)


@pytest.fixture(scope="module")
def real_draft_model(real_checkpoint, real_engine) -> DraftModelDrafter:
    return DraftModelDrafter(load_draft_checkpoint("truncate:4", real_checkpoint), real_engine.runner_config)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [8, 1])
@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_greedy_identical_real(real_engine, real_requests, real_reference, real_draft_model, drafter, batch):
    rec = Recorder(NgramDrafter() if drafter == "ngram" else real_draft_model)
    with drafting(real_engine, rec) as eng:
        if batch == 8:
            got = run(eng, real_requests)
            expected = real_reference
            assert any(max_draft == 0 for _, _, max_draft, _ in rec.asks)
        else:
            got = run_alone(eng, real_requests[:5])
            expected = real_reference[:5]
    assert_same_outputs(got, expected)
    assert sum(c.spec.num_drafted for c in got) > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["right", "noisy"])
def test_oracle_real(real_engine, real_requests, real_reference, mode):
    """Long accepted runs on the real model (5-token verification forwards) reproduce target-only
    decoding exactly; with the noisy oracle, after partial acceptance and rollback too."""
    oracle = OracleDrafter(sequences(real_requests, real_reference), mode=mode,
                           vocab=real_engine.checkpoint.config.vocab_size)
    with drafting(real_engine, oracle) as eng:
        got = run(eng, real_requests)
    assert_same_outputs(got, real_reference)
    for (p, sp), c, ref in zip(real_requests, got, real_reference):
        if mode == "right" and ref.finish_reason == "length":
            assert c.spec == schedule_stats(len(p), sp.max_tokens, sp.max_tokens, K, eng.max_seq_len)
    if mode == "noisy":
        assert 1.0 < sum(c.spec.num_emitted for c in got) / sum(c.spec.num_steps for c in got) < K + 1


# ----------------------------------------------------------------------------- CLI


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"question_id": i, "category": "qa", "turns": [t]} for i, t in enumerate(_rows([244, 248, 276]))]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def cli(*args: str):
    from click.testing import CliRunner

    from tandem.cli import main

    return CliRunner().invoke(main, ["generate", *args])


@pytest.mark.slow
def test_cli_generate_compare(real_checkpoint, prompts_file, monkeypatch):
    """The bundled model (the session's already loaded copy), n-gram drafter, --compare."""
    import tandem.models.weights as weights

    load = weights.load_checkpoint
    monkeypatch.setattr(weights, "load_checkpoint", lambda path=None: real_checkpoint if path is None else load(path))
    res = cli("--prompts-file", str(prompts_file), "--limit", "2", "--max-tokens", "8", "--drafter", "ngram",
              "--compare", "--max-seq-len", "512", "--batch-size", "2")
    assert res.exit_code == 0, res.output
    assert "speedup" in res.stdout
    assert "2/2" in res.stdout  # identical outputs


def test_cli_generate_compare_tiny_draft_model(tiny_checkpoint, prompts_file):
    res = cli("--prompts-file", str(prompts_file), "--limit", "2", "--max-tokens", "8",
              "--model", str(tiny_checkpoint("llama", with_tokenizer=True)), "--max-seq-len", "256",
              "--drafter", "draft-model", "--draft-model", "truncate:1", "--compare")
    assert res.exit_code == 0, res.output
    assert "speedup" in res.stdout and "2/2" in res.stdout


def test_cli_generate_compare_one_prompt(tiny_checkpoint):
    """--compare with --prompt runs the one prompt both ways and prints the comparison table."""
    res = cli("--prompt", "1 2 3 1 2 3 1 2 3", "--max-tokens", "8", "--model",
              str(tiny_checkpoint("llama", with_tokenizer=True)), "--max-seq-len", "256", "--drafter", "ngram",
              "--compare")
    assert res.exit_code == 0, res.output
    assert "speedup" in res.stdout and "1/1" in res.stdout


def test_cli_compare_baseline_runs_without_drafter_or_policy(tiny_checkpoint, prompts_file, monkeypatch):
    """--compare's target-only baseline runs on an engine of its own over the same target, built
    from the target-only configuration: with neither the drafter nor the draft policy (its online
    τ must not learn from target-only rounds); the speculative engine keeps both, untouched. Each
    engine first runs one short prompt untimed (the first run pays one-time costs), then the
    timed runs follow, the speculative engine's first."""
    import tandem.cli.generate as cli_mod

    seen, engines, runs = [], [], []
    run_file = cli_mod._run_file

    def spy(engine, records, params, *args, **kwargs):
        seen.append((engine.drafter, engine.draft_policy))
        engines.append(engine)
        runs.append((len(records), params.max_tokens, kwargs.get("desc")))
        return run_file(engine, records, params, *args, **kwargs)

    monkeypatch.setattr(cli_mod, "_run_file", spy)
    pred = "tandem/drafters/weights/draft-model-smollm2-135m/predictor.safetensors"
    res = cli("--prompts-file", str(prompts_file), "--limit", "2", "--max-tokens", "8",
              "--model", str(tiny_checkpoint("llama", with_tokenizer=True)), "--max-seq-len", "256",
              "--drafter", "draft-model", "--draft-model", "truncate:1", "--predictor", pred, "--compare")
    assert res.exit_code == 0, res.output
    assert runs == [(1, 8, "warm-up"), (1, 8, "warm-up"), (2, 8, None), (2, 8, "target-only")]
    assert seen[:2] == seen[2:] and engines[:2] == engines[2:]
    (drafter, policy), (base_drafter, base_policy) = seen[2:]
    engines = engines[2:]
    assert drafter is not None and policy is not None and policy.controller is not None
    assert base_drafter is None and base_policy is None
    assert engines[0] is not engines[1] and engines[0].target is engines[1].target
    assert (engines[0].drafter, engines[0].draft_policy) == (drafter, policy)
    assert (engines[1].drafter, engines[1].draft_policy) == (None, None)


def test_cli_compare_warms_up_within_the_requests_own_limits(tiny_checkpoint, prompts_file):
    """--compare's short untimed warm-up keeps the request valid: a --min-tokens above its usual
    16 tokens is not refused."""
    res = cli("--prompts-file", str(prompts_file), "--limit", "1", "--max-tokens", "24", "--min-tokens", "20",
              "--model", str(tiny_checkpoint("llama", with_tokenizer=True)), "--max-seq-len", "256",
              "--drafter", "ngram", "--compare")
    assert res.exit_code == 0, res.output + res.stderr
    assert "min_tokens" not in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--drafter", "draft-model"], "needs --draft-model"),
    (["--drafter", "draft-model", "--draft-model", "truncate:5"], "1..1 layers"),
    (["--drafter", "draft-model", "--draft-model", "truncate:two"], "truncate:N"),
    (["--drafter", "draft-model", "--draft-model", "SMALL_VOCAB_MODEL"], "vocabulary"),
    (["--compare"], "--compare needs"),
])
def test_cli_drafter_errors(tiny_checkpoint, small_vocab_checkpoint, prompts_file, args, message):
    args = [str(small_vocab_checkpoint()) if a == "SMALL_VOCAB_MODEL" else a for a in args]
    res = cli("--prompts-file", str(prompts_file), "--limit", "2", "--max-tokens", "8",
              "--model", str(tiny_checkpoint("llama", with_tokenizer=True)), *args)
    assert res.exit_code == 2, res.output
    assert message in res.stderr
    assert "Traceback" not in res.output


def test_draft_length_lines_say_why_a_step_verified_more_than_k():
    """The printed draft lengths: shares of verification steps by length, and, where token trees
    made a step verify more than k tokens (their sibling candidates count as drafts), a note that
    says so instead of leaving lengths past k unexplained."""
    from tandem.metrics import draft_length_lines

    spec = SpecDecodeStats()
    spec.num_steps = 4
    spec.drafted_per_pos = [4, 3, 2, 2, 1, 1]  # a step of 6 drafts at k = 4: a tree branched
    spec.accepted_per_pos = [3, 2, 1, 1, 0, 0]
    line = draft_length_lines(spec, "predictor-fixed-tau", k=4)[0]
    assert "1: 25%" in line and "6: 25%" in line and "more than k = 4 where a token tree branched" in line
    spec.drafted_per_pos, spec.accepted_per_pos = [4, 3, 2, 2], [3, 2, 1, 1]
    assert "token tree" not in draft_length_lines(spec, "fixed", k=4)[0]
