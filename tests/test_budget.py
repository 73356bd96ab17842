"""The router's cluster-level draft budget (``services.router.budget``): the acceptance it reads
from finished requests, the width it picks under a replica's cost model and load, the replica
applying it (``Engine.width_cap``: rounds capped, output unchanged), and the decision reaching a
real replica process over ``Load``; and the cluster's acceptance threshold θ: replicas' θ
controllers merged at the router, its choice sent back and used by the replicas' policies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.router.budget import DraftBudget, cost_model, threshold_state
from services.proto.tandem.v1 import verifier_pb2
from tandem.control import CostModel, DraftPolicy
from tandem.threshold import ThresholdController
from tandem.metrics import SpecDecodeStats
from tandem.sampling import SamplingParams


def _spec(drafted: list[int], accepted: list[int]) -> SpecDecodeStats:
    s = SpecDecodeStats()
    s.drafted_per_pos, s.accepted_per_pos = list(drafted), list(accepted)
    return s


def _replica(running: int, cost: CostModel | None, k: int = 4, slots: int = 64):
    report = verifier_pb2.LoadReport(num_slots=slots, running=running, waiting=0, draft_limit=k)
    return SimpleNamespace(address="r0", report=report, cost_model=cost, healthy=True)


# T(b, q): a verify pass whose cost grows with the tokens it verifies, much more at batch 64
COST = CostModel({1: {1: 1.0, 2: 1.01, 3: 1.02, 4: 1.03, 5: 1.04},
                  64: {1: 4.0, 2: 6.0, 3: 8.0, 4: 10.0, 5: 12.0}})


def test_acceptance_is_conditional_per_position():
    b = DraftBudget(min_drafts=10)
    assert b.acceptance() is None  # nothing seen
    b.observe(_spec([10, 10, 10], [8, 4, 1]))  # 10 rounds: position 0 accepted 8 times, 1 then 4, 2 then 1
    b.observe(_spec([10, 10, 10], [8, 4, 1]))
    assert b.acceptance() == pytest.approx([0.8, 0.5, 0.25])
    assert DraftBudget(min_drafts=100).acceptance() is None


def test_acceptance_comes_from_the_replicas_reports_first():
    """The replicas' reported windows (every router's requests) are the cluster's acceptance; the
    router's own finished requests stand in only while the reports hold too few drafts, and an
    unhealthy replica's report is not read."""
    def reporting(address: str, drafted: list[int], accepted: list[int], healthy: bool = True):
        report = verifier_pb2.LoadReport(num_slots=8, draft_limit=3, recent_drafted_per_pos=drafted,
                                         recent_accepted_per_pos=accepted)
        return SimpleNamespace(address=address, report=report, cost_model=None, healthy=healthy)

    b = DraftBudget(min_drafts=10)
    b.observe(_spec([10, 10, 10], [2, 1, 0]))  # what this router saw: poor acceptance
    a = reporting("a", [8, 8, 8], [8, 8, 4])
    c = reporting("c", [12, 12], [9, 6])
    assert b.acceptance([a, c]) == pytest.approx([17 / 20, 14 / 17, 4 / 8])  # summed: 20 drafts at position 1
    assert b.acceptance([a]) == pytest.approx([0.2, 0.5, 0.0])  # 8 < 10 reported: the router's own requests
    c.healthy = False
    assert b.acceptance([a, c]) == pytest.approx([0.2, 0.5, 0.0])
    assert DraftBudget(min_drafts=10).acceptance([a]) is None


def test_width_follows_acceptance_load_and_cost():
    easy, hard = DraftBudget(min_drafts=1), DraftBudget(min_drafts=1)
    easy.observe(_spec([100] * 4, [95, 90, 86, 81]))
    hard.observe(_spec([100] * 4, [30, 9, 3, 1]))
    assert easy.width(_replica(1, COST)) == 4  # verifying more is nearly free at batch 1
    assert hard.width(_replica(1, COST)) >= 1
    assert hard.width(_replica(64, COST)) == 0  # at batch 64 a rejected draft costs more than it saves
    assert easy.width(_replica(64, COST)) >= 1
    assert easy.width(_replica(64, None)) is None  # no cost model: no budget
    assert easy.width(_replica(64, COST, k=0)) is None  # no drafter
    m = easy.width(_replica(64, COST))
    assert easy.decide(_replica(64, COST)) == m and easy.widths["r0"] == m
    sick = _replica(64, COST)
    sick.healthy = False
    assert easy.decide(sick) is None and "r0" not in easy.widths  # an unhealthy replica: no decision


def test_cost_model_from_info_points():
    pts = [verifier_pb2.CostPoint(batch_size=1, tokens_per_sequence=q, ms=1.0 + q) for q in (1, 2)]
    assert cost_model(pts).verify_ms(1, 2) == 3.0
    assert cost_model([]) is None
    noisy = [verifier_pb2.CostPoint(batch_size=1, tokens_per_sequence=q, ms=ms) for q, ms in ((1, 5.0), (2, 7.0),
                                                                                             (3, 6.0))]
    assert cost_model(noisy).verify_ms(1, 3) == 7.0  # more tokens never verify faster: timing noise evened out


def _controller(grid, rounds) -> ThresholdController:
    """A θ controller that observed ``rounds``: (θ, emitted tokens, ms) each."""
    c = ThresholdController(grid=grid)
    for theta, tokens, ms in rounds:
        c.observe(tokens, ms, acceptance_threshold=theta)
    return c


def test_threshold_controllers_merge_into_the_clusters_goodput():
    """``ThresholdController.merged`` sums each candidate's discounted rounds, tokens and ms, so
    the cluster's goodput for a θ is all replicas' tokens over all their time; malformed or
    mismatched states are refused."""
    a = _controller([0.0, 0.5], [(0.0, 10, 10.0), (0.5, 30, 10.0)])  # replica a: θ 0.5 pays (3 tok/ms against 1)
    b = _controller([0.0, 0.5], [(0.0, 40, 10.0), (0.5, 5, 30.0)] * 3)  # replica b, busier: θ 0.0 pays
    m = ThresholdController.merged([a.state_dict(), b.state_dict()])
    assert m.grid == [0.0, 0.5]
    for j in range(2):
        assert m.counts[j] == pytest.approx(a.counts[j] + b.counts[j])
        assert m.goodput()[j] == pytest.approx((a.tokens[j] + b.tokens[j]) / (a.ms[j] + b.ms[j]))
    assert a.acceptance_threshold == 0.5 and b.acceptance_threshold == 0.0
    assert m.acceptance_threshold == 0.0  # the cluster's best: b's rounds outweigh a's
    with pytest.raises(ValueError, match="another grid"):
        ThresholdController.merged([a.state_dict(), ThresholdController(grid=[0.1, 0.2]).state_dict()])
    with pytest.raises(ValueError, match="no threshold"):
        ThresholdController.merged([])
    with pytest.raises(ValueError, match="length"):
        ThresholdController.merged([{**a.state_dict(), "ms": [1.0]}])


def _learning_replica(address: str, controller: ThresholdController | None, healthy: bool = True):
    report = verifier_pb2.LoadReport(num_slots=8, running=2, draft_limit=4)
    if controller is not None:
        st = controller.state_dict()
        report.threshold.CopyFrom(verifier_pb2.ThresholdState(grid=st["grid"], rounds=st["counts"],
                                                              tokens=st["tokens"], ms=st["ms"]))
    return SimpleNamespace(address=address, report=report, cost_model=None, healthy=healthy)


def test_router_chooses_theta_over_every_replicas_rounds():
    """The router sends every replica that learns θ the next candidate of the merged controller:
    untried candidates first (the cluster explores each θ once, not once per replica), then the
    discounted-UCB choice; a replica of another grid is its own group; a replica with a fixed θ or
    an unhealthy one gets none, and its gauge goes away."""
    from tandem.telemetry import Metrics

    grid = [0.0, 0.5, 0.9]
    a = _controller(grid, [(0.0, 20, 10.0), (0.5, 35, 10.0)])
    b = _controller(grid, [(0.0, 20, 10.0)])
    budget, metrics = DraftBudget(), Metrics()
    replicas = [_learning_replica("a", a), _learning_replica("b", b), _learning_replica("fixed", None),
                _learning_replica("down", a, healthy=False)]
    assert budget.decide_thresholds(replicas, metrics) == {"a": 0.9, "b": 0.9}  # the one θ nobody has tried
    body = metrics.exposition()[0].decode()
    assert 'tandem_router_acceptance_threshold{replica="a"} 0.9' in body and 'replica="fixed"' not in body
    a.observe(12, 10.0, acceptance_threshold=0.9)  # tried now, and poor
    replicas[0] = _learning_replica("a", a)
    merged = ThresholdController.merged([a.state_dict(), b.state_dict()])
    assert budget.decide_thresholds(replicas, metrics) == {"a": merged.current(), "b": merged.current()}
    assert merged.current() == 0.5  # the cluster's best goodput; the exploration bonus does not outweigh it
    other = _learning_replica("c", _controller([0.2, 0.4], [(0.2, 10, 10.0)]))
    assert budget.decide_thresholds([*replicas, other], metrics)["c"] == 0.4
    replicas[0].healthy = False
    assert "a" not in budget.decide_thresholds(replicas, metrics) and "a" not in budget.thresholds
    assert 'tandem_router_acceptance_threshold{replica="a"}' not in metrics.exposition()[0].decode()
    assert threshold_state(replicas[1].report.threshold)["counts"] == pytest.approx(b.counts)


def test_policy_uses_an_outside_threshold_and_keeps_learning():
    """``DraftPolicy.threshold_override`` (the router's θ) replaces the controller's candidate in
    host-drafted rounds (``begin_round``/``lengths``) and chained ones without a cost model
    (``plan_width``); the controller learns from those rounds under that θ."""
    import numpy as np
    import torch

    ctl = ThresholdController(grid=[0.0, 0.5, 0.9])
    policy = DraftPolicy(lambda f: f[:, 0], controller=ctl)
    assert policy.learns_threshold and not DraftPolicy(lambda f: f[:, 0]).learns_threshold
    policy.threshold_override = 0.9
    keep = policy.begin_round()
    assert keep([0], torch.tensor([[0.95]])) == [True] and keep([0], torch.tensor([[0.6]])) == [False]
    assert policy.lengths([torch.tensor([[0.95], [0.6], [0.99]])]) == [1]  # cut where p < 0.9
    policy.observe(2, 1.0)
    assert ctl.counts == [0.0, 0.0, 1.0]  # the round counted for the θ it ran under
    plan = policy.plan_width(np.array([[0.95, 0.6, 0.99]]), limit=3)
    assert (plan.width, plan.acceptance_threshold) == (1, 0.9)
    policy.threshold_override = None
    assert policy.begin_round() and policy._threshold_used == 0.0  # its own controller again: an untried θ


def test_an_idle_replicas_theta_state_stays_out_of_the_merge():
    """A replica reports its θ controller with ``Load`` only while it runs rounds
    (``threshold_state_report``): none for a policy that does not learn θ or before any round, the
    state after a round, none again once no round came for ``THRESHOLD_STALE_S``, so the
    router merges over the replicas that decode now (its discounted sums would otherwise keep their
    weight however long it idles)."""
    from services.verifier.server import THRESHOLD_STALE_S, threshold_state_report

    ctl = ThresholdController(grid=[0.0, 0.5])
    policy = DraftPolicy(lambda f: f[:, 0], controller=ctl)
    assert threshold_state_report(DraftPolicy(lambda f: f[:, 0]), 0.0) is None  # a fixed θ
    assert threshold_state_report(None) is None and threshold_state_report(policy) is None  # no round yet
    policy.begin_round()
    policy.observe(3, 1.5)
    at = ctl.observed_at
    report = threshold_state_report(policy, at + 1.0)
    assert list(report.grid) == [0.0, 0.5] and list(report.rounds) == [1.0, 0.0]
    assert list(report.tokens) == [3.0, 0.0] and list(report.ms) == [1.5, 0.0]
    assert threshold_state_report(policy, at + THRESHOLD_STALE_S + 0.1) is None
    merged = ThresholdController.merged([threshold_state(report)])  # what a router makes of it
    assert merged.counts == [1.0, 0.0]


def _run(engine, prompts, params) -> list[list[int]]:
    out = []
    for p in prompts:
        rid = engine.add_request(prompt_ids=p, params=params)
        while engine.has_unfinished():
            engine.step()
        out.append(engine.completion(rid).token_ids)
    return out


@pytest.mark.parametrize("drafter", ["oracle-host", "specformer-chained"])
def test_engine_width_cap_caps_rounds_and_keeps_the_output(tiny_engine, drafter):
    """``Engine.width_cap`` limits every round's drafts, for a host drafter that always proposes
    k = 4 (the target's own continuation, every third token wrong) and in chained rounds (a
    SpecFormer head drafting on the device: the round's graph narrows to the cap); greedy output
    is unchanged, and 0 turns drafting off."""
    from test_speculative import OracleDrafter, _specformer_for

    from tandem.engine import Engine
    from tandem.models.runner import RunnerConfig

    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    base = Engine(target=tiny_engine.target, tokenizer=tiny_engine.tokenizer)
    want = _run(base, prompts, params)
    for cap in (4, 2, 0):
        if drafter == "oracle-host":
            engine = Engine(target=tiny_engine.target, tokenizer=tiny_engine.tokenizer, num_draft_tokens=4,
                            drafter=OracleDrafter([p + w for p, w in zip(prompts, want)], mode="noisy",
                                                  vocab=tiny_engine.target.info.vocab_size))
        else:
            engine = Engine(tiny_engine.checkpoint, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128),
                            tokenizer=tiny_engine.tokenizer, drafter=_specformer_for(tiny_engine.checkpoint, 4),
                            num_draft_tokens=4)
            assert engine.chains_rounds
        engine.width_cap = cap
        assert engine.draft_limit == cap and engine.configured_draft_limit == 4
        assert _run(engine, prompts, params) == want
        assert len(engine.stats.drafted_per_pos) == cap  # every round drafted exactly up to the cap
        assert (engine.stats.num_drafted > 0) == (cap > 0)


def test_a_router_width_that_moves_caps_chained_rounds_without_new_graph_widths(tiny_engine):
    """A router's width that comes and changes mid-run (``Engine.width_cap`` none -> 2 -> 4, as
    budget decisions move) caps a chained round's drafts on the device, inside a graph as wide as
    the widest width of the last ``WIDTH_WINDOW`` rounds: a replica's rounds (``cap_rounds``) take
    the capped graph variant from the start, so the first width needs no other graphs; lowering
    the width needs no graph of a new width until a window of rounds was capped lower, raising it
    again none at all; greedy output is unchanged."""
    import tandem.engine as engine_mod
    from test_chained import _widths
    from test_speculative import _specformer_for

    from tandem.engine import Engine
    from tandem.models.runner import RunnerConfig

    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = _run(Engine(target=tiny_engine.target, tokenizer=tiny_engine.tokenizer), prompts, params)
    engine = Engine(tiny_engine.checkpoint, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128),
                    tokenizer=tiny_engine.tokenizer, drafter=_specformer_for(tiny_engine.checkpoint, 4),
                    num_draft_tokens=4)
    assert engine.chains_rounds
    engine._recent_widths = engine_mod.deque(maxlen=6)  # a short window, so this short run narrows its graph
    launched = _widths(engine)
    engine.cap_rounds = True  # what a verifier replica sets
    rids = [engine.submit(engine.make_request(prompt_ids=p, params=params)) for p in prompts]
    while len(launched) < 3:
        engine.step()
    engine.width_cap = 2
    while len(launched) < 12:
        engine.step()
    engine.width_cap = 4
    while engine.has_unfinished():
        engine.step()
    assert [engine.completion(r).token_ids for r in rids] == want
    graphs, caps = [g for g, _ in launched], [c for _, c in launched]
    assert caps[:3] == [4, 4, 4] and set(caps[3:12]) == {2} and set(caps[12:]) == {4}
    # capped to 2 from round 4: the graph stays 4 wide while the window of 6 holds a 4 (rounds 4-8),
    # then narrows to 2; back at 4, the graph widens at once
    assert graphs[:8] == [4] * 8 and graphs[8:12] == [2] * 4 and set(graphs[12:]) == {4}
    assert engine.stats.drafted_per_pos[2] < engine.stats.drafted_per_pos[1]  # the capped rounds drafted 2


def test_router_budget_reaches_a_replica_process(tiny_checkpoint):
    """A verifier replica process with a measured cost model (``--measure-cost``) reports its k
    and applies the width a router sends with its ``Load`` poll; the router's metrics and
    /health show the decision, and requests decode within it."""
    import openai

    import time

    from services.launch import StackConfig, start_stack
    from services.router.core import Router, RouterConfig
    from services.router.replicas import Replica
    from services.verifier.server import BUDGET_LEASE_S

    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    s = start_stack(StackConfig(model=model, drafter="ngram", num_draft_tokens=4, max_batch_size=4, max_seq_len=256,
                                measure_cost=True), timeout_s=180)
    router = None
    try:
        router = Router(RouterConfig(verifiers=list(s.verifier_addresses), model=model))
        replica = router.replicas[0]
        assert replica.cost_model is not None and replica.report.draft_limit == 4
        assert not replica.report.HasField("draft_width")  # nothing decided yet: too little seen
        router.budget.min_drafts = 1
        router.budget.observe(_spec([400] * 4, [20, 1, 0, 0]))  # drafts nearly never accepted
        router.probe()  # the decision goes out with this poll ...
        router.probe()  # ... and the replica's report shows it applied
        low = router.budget.widths[replica.address]
        assert replica.report.draft_width == low < 4
        body, _ = router.metrics.exposition()
        assert f'tandem_router_draft_width{{replica="{replica.address}"}} {float(low)}' in body.decode()
        assert router.health()["verifiers"][0]["draft_width"] == low
        if low == 0:  # the replica decodes without drafts now (a router process of the stack sends no width)
            client = openai.OpenAI(base_url=f"{s.http_url}/v1", api_key="x", max_retries=0, timeout=60)
            r = client.completions.create(model=client.models.list().data[0].id, prompt="1 2 3 1 2 3 1 2 3",
                                          max_tokens=16, temperature=0)
            assert r.usage.model_extra["speculative_decoding"]["num_draft_tokens"] == 0
        router.close()  # the router that set the width goes away: its lease lapses
        router = None
        other = Replica(s.verifier_addresses[0], None, 10.0)  # a router that sends no width
        try:
            other.refresh()
            assert other.report.draft_width == low  # still within the lease
            time.sleep(BUDGET_LEASE_S + 0.3)
            other.refresh()
            other.refresh()
            assert not other.report.HasField("draft_width")  # the replica's own k stands again
        finally:
            other.close()
    finally:
        if router is not None:
            router.close()
        s.stop()


def test_router_sets_one_theta_for_two_replica_processes(tiny_checkpoint):
    """Two verifier replica processes whose policy learns θ (entropy scores, θ auto) under one
    router process: each reports its θ controller with ``Load``; the router merges them and every
    replica runs the merged controller's choice (``acceptance_threshold_set`` in /health); once
    the router is gone, each replica's own controller takes over after the lease."""
    import concurrent.futures
    import json
    import time
    import urllib.request

    import grpc
    import openai

    from conftest import spec_bench_prompts
    from services.launch import StackConfig, start_stack
    from services.router.replicas import Replica
    from services.verifier.server import BUDGET_LEASE_S

    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    s = start_stack(StackConfig(model=model, drafter="ngram", policy="entropy", num_verifiers=2, max_batch_size=4,
                                max_seq_len=256), timeout_s=180)
    passive = []
    try:
        client = openai.OpenAI(base_url=f"{s.http_url}/v1", api_key="x", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 at once over 2 x 4 slots: both replicas decode
            answers = list(pool.map(lambda p: client.completions.create(model=model_id, prompt=p, max_tokens=32,
                                                                        temperature=0), spec_bench_prompts(8)))
        time.sleep(1.5)  # idle: the states stop moving and the router's polls settle on one choice
        passive = [Replica(a, None, 10.0) for a in s.verifier_addresses]  # polls that send nothing
        for r in passive:
            r.refresh()
        # the replicas' acceptance windows hold every request, per draft position (the budget's input)
        usage = SpecDecodeStats()
        for a in answers:
            sd = a.usage.model_extra["speculative_decoding"]
            usage.merge(SpecDecodeStats(drafted_per_pos=sd["draft_tokens_per_position"],
                                        accepted_per_pos=sd["accepted_tokens_per_position"]))
        reported = SpecDecodeStats()
        for r in passive:
            reported.merge(SpecDecodeStats(drafted_per_pos=list(r.report.recent_drafted_per_pos),
                                           accepted_per_pos=list(r.report.recent_accepted_per_pos)))
        assert usage.drafted_per_pos and (reported.drafted_per_pos, reported.accepted_per_pos) == (
            usage.drafted_per_pos, usage.accepted_per_pos)
        states = [threshold_state(r.report.threshold) for r in passive]
        assert all(sum(st["counts"]) > 0 for st in states)  # both ran rounds under the policy
        want = ThresholdController.merged(states).current()
        for r in passive:
            assert r.report.acceptance_threshold_set and r.report.acceptance_threshold == pytest.approx(want)
        with urllib.request.urlopen(f"{s.http_url}/health", timeout=10) as resp:
            health = json.loads(resp.read())
        assert [v["acceptance_threshold"] for v in health["verifiers"]] == [pytest.approx(want)] * 2
        with pytest.raises(grpc.RpcError) as bad:  # a θ outside [0, 1] is refused at the boundary
            passive[0]._stub.Load(verifier_pb2.LoadRequest(acceptance_threshold=2.0), timeout=5)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        router = s.processes["router"]
        router.terminate()
        router.wait(timeout=15)
        time.sleep(BUDGET_LEASE_S + 0.3)
        for r, st in zip(passive, states):
            r.refresh()
            assert not r.report.acceptance_threshold_set  # the replica's own controller again
            own = ThresholdController(grid=st["grid"])
            own.load_state_dict(threshold_state(r.report.threshold))
            assert r.report.acceptance_threshold == pytest.approx(own.acceptance_threshold)
    finally:
        for r in passive:
            r.close()
        s.stop()
