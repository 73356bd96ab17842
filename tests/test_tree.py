"""Token-tree verification (hard-position enhancement): the tree attention pass, greedy and
sampling verification over trees, KV moves of the accepted branch, and lossless engine output."""

import random

import pytest
import torch
from helpers import assert_in_target_top_k, chi_square_pvalue, make_runner, our_logits, verify_tree_greedy

from tandem.control import DraftPolicy
from tandem.drafters import DraftModelDrafter, DraftProposal
from tandem.engine import Engine
from tandem.models import load_checkpoint
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams
from tandem.models.runner import _tree_columns
from tandem.verify import tree_path, verify_tree_sampling, verify_trees_greedy


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint("llama"))


def test_tree_forward_matches_each_root_to_leaf_path(tiny):
    """One pass over the tree [r, a, b | c under a | d under r] gives every node the logits of a
    plain causal run of its root-to-node path."""
    prefix, (r, a, b, c, d) = [11, 12, 13], [21, 22, 23, 24, 25]
    runner = make_runner(tiny, slots=2, max_seq_len=64)
    slot = runner.cache.allocate()
    runner.prefill({slot: prefix})
    tokens, parents = [r, a, b, c, d], [-1, 0, 1, 1, 0]
    got = runner.step({slot: tokens}, {slot: parents}).logits[slot, :5]
    paths = {0: [r], 1: [r, a], 2: [r, a, b], 3: [r, a, c], 4: [r, d]}
    for node, path in paths.items():
        want = our_logits(runner, prefix + path)[-1]
        torch.testing.assert_close(got[node], want, atol=1e-4, rtol=0)


def test_kv_move_then_continue_equals_a_fresh_run(tiny):
    """Accept the branch r -> d (tree index 4), move its K/V next to r, roll back, keep decoding:
    the logits equal a fresh run of prefix + [r, d, e]."""
    prefix, r, a, b, d, e = [5, 6, 7], 31, 32, 33, 34, 35
    runner = make_runner(tiny, slots=2, max_seq_len=64)
    slot = runner.cache.allocate()
    runner.prefill({slot: prefix})
    start = runner.cache.lengths[slot]
    runner.step({slot: [r, a, b, d]}, {slot: [-1, 0, 1, 0]})
    runner.cache.move(slot, [start + 3], [start + 1])  # d sat at start + 3, belongs at start + 1
    runner.cache.truncate(slot, start + 2)
    got = runner.step({slot: [e]}).logits[slot, 0]
    want = our_logits(runner, prefix + [r, d, e])[-1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_tree_greedy_follows_the_matching_child():
    # tree: 0 (root child) -> 1 -> {2, 3}; target argmax rows: root, 0, 1, 2, 3
    drafts, parents = [7, 8, 9, 10], [-1, 0, 1, 1]
    res = verify_tree_greedy(drafts, parents, [7, 8, 10, 99, 55])
    assert res.tokens == [7, 8, 10, 55] and res.num_accepted == 3 and res.path == [0, 1, 3]
    res = verify_tree_greedy(drafts, parents, [4, 8, 10, 99, 55])
    assert res.tokens == [4] and res.num_accepted == 0 and res.path == []


@pytest.mark.parametrize("with_q", [False, True])
def test_tree_sampling_emits_tokens_distributed_as_p(with_q):
    """Root with three one-hot candidates (and q rows that must be ignored at a branching node):
    the first emitted token follows p exactly."""
    V = 6
    p = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05])
    target = torch.stack([p] + [torch.full((V,), 1 / V)] * 3)
    drafts, parents = [1, 2, 4], [-1, -1, -1]
    q = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(3)), -1) if with_q else None
    n = 10000  # the joint, multi-round tests of trees are in test_speculative.py (draft-model-tree)
    first = torch.tensor([verify_tree_sampling(drafts, parents, q, target, seed, 0).tokens[0] for seed in range(n)])
    counts = torch.bincount(first, minlength=V)
    assert chi_square_pvalue(counts, p.double()) > 1e-4, counts


def test_branched_proposal_shape():
    feats = torch.arange(12, dtype=torch.float32).view(3, 4)
    top = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    prop = DraftProposal([5, 8, 11], torch.softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(0)), -1),
                         feats, top)
    tree = prop.branched(1, 3)
    assert tree.tokens == [5, 8, 9, 10] and tree.parents == [-1, 0, 0, 0]
    assert tree.chain_length == 1 and tree.probs.shape == (4, 20)
    assert tree.probs[1:].argmax(-1).tolist() == [8, 9, 10] and tree.probs[1:].sum(-1).tolist() == [1.0, 1.0, 1.0]
    root = prop.branched(0, 2)
    assert root.tokens == [5, 6] and root.parents == [-1, -1] and root.chain_length == 0
    with pytest.raises(ValueError):
        DraftProposal([1], None, feats[:1]).branched(0, 2)


def test_batched_device_tree_verification_equals_the_host_walk():
    """``verify_trees_greedy`` over a batch of random trees (chains, idle rows and repeated sibling
    tokens among them, on a 4-token vocabulary so that siblings often match together) gives
    ``verify_tree_greedy``'s tokens and path for every row, on the step's own tree columns; and
    ``tree_path`` recovers the path from the accepted tokens."""
    rng = random.Random(0)
    for _ in range(400):
        B, Q = rng.randint(1, 6), rng.randint(1, 8)
        cols, tokens, argmax, q_len, want = [], [], [], [], []
        for _ in range(B):
            am = [rng.randrange(4) for _ in range(Q)]
            if rng.random() < 0.1:  # an idle row
                cols.append(_tree_columns(Q, 0, None))
                tokens.append([0] * Q), argmax.append(am), q_len.append(0), want.append(None)
                continue
            n = rng.randint(0, Q - 1)
            parents = [rng.randint(-1, i - 1) for i in range(n)] if rng.random() < 0.7 else list(range(-1, n - 1))
            drafts = [rng.randrange(4) for _ in range(n)]
            cols.append(_tree_columns(Q, n + 1, [-1] + [p + 1 for p in parents]))  # as LocalTarget asks the runner
            tokens.append([rng.randrange(4)] + drafts + [0] * (Q - 1 - n))
            argmax.append(am), q_len.append(n + 1)
            want.append((drafts, parents, verify_tree_greedy(drafts, parents, am[:n + 1])))
        cols = torch.tensor(cols)
        res, path = verify_trees_greedy(torch.tensor(argmax), torch.tensor(tokens), cols[:, :Q],
                                        cols[:, Q:].view(B, Q, Q) > 0, torch.tensor(q_len))
        for b, w in enumerate(want):
            if w is None:
                continue
            drafts, parents, r = w
            m = int(res.num_accepted[b])
            assert m == r.num_accepted and res.tokens[b, :m + 1].tolist() == r.tokens
            assert [p - 1 for p in path[b, :m].tolist()] == r.path  # step positions: tree index + 1
            assert tree_path(drafts, parents, r.tokens[:m]) == r.path


def test_tree_columns_are_memoised_and_still_checked():
    """The runner's tree columns come from a memo: equal to a fresh build, and a malformed tree
    is still refused."""
    first = _tree_columns(6, 4, [-1, 0, 0, 1])
    assert _tree_columns(6, 4, [-1, 0, 0, 1]) == first
    assert first[:6] == (0, 1, 1, 2, 0, 0)  # depths; then row 3 sees 0, 1 and itself
    assert first[6 + 3 * 6:6 + 4 * 6] == (1, 1, 0, 1, 0, 0)
    with pytest.raises(ValueError):
        _tree_columns(6, 3, [-1, 2, 0])


def _branching_ngram_engine(model_dir: str, cfg: RunnerConfig, tokenizer) -> Engine:
    """An n-gram engine whose policy keeps one draft and branches position 2 into up to three
    continuations (a score of 0.95 for a match length <= 1, 0.05 after)."""
    from tandem.drafters import NgramDrafter

    score = lambda f: torch.where(f[:, 3] <= 1, 0.95, 0.05)  # noqa: E731
    return Engine(model_dir, cfg, tokenizer=tokenizer, drafter=NgramDrafter(top_m=3), num_draft_tokens=4,
                  draft_policy=DraftPolicy(score, acceptance_threshold=0.5, branch_top_m=3))


def test_greedy_trees_with_logit_adjustments_and_sampled_rows_lossless(small_vocab_checkpoint):
    """Greedy trees verified on the device under penalties and a logit bias (each node sees its
    ancestors as output), in batches that also hold sampled trees (walked on the host): every
    greedy request's output is target-only's."""
    model_dir = str(small_vocab_checkpoint(seed=0, logit_scale=2.0))
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=96)
    base = Engine(model_dir, cfg)
    prompts = ["w1 w2 w3 w9 w1 w2 w4 w9 w1 w2 w5 w9 w1 w2 w3 w9 w1", "w7 w8 w7 w6 w7 w8 w7 w5 w7",
               "w11 w12 w13 w11 w12 w14 w11 w12", "w2 w2 w3 w2 w2 w4 w2"]
    w3 = base.tokenizer.encode("w3")[-1]
    greedy = [SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=3.0, presence_penalty=1.5),
              SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=2.0, logit_bias={w3: 2.0}),
              SamplingParams(max_tokens=20, ignore_eos=True)]
    sampled = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=5)
    params = [greedy[0], greedy[1], sampled, greedy[2]]
    want = [c.token_ids for c in base.generate(prompts, params)]
    eng = _branching_ngram_engine(model_dir, cfg, base.tokenizer)
    trees = []
    verify = eng.target.launch_verify

    def spy(items, masks=None):
        trees.extend(it.params.greedy for it in items if it.proposal.parents is not None)
        return verify(items, masks)

    eng.target.launch_verify = spy
    got = [c.token_ids for c in eng.generate(prompts, params)]
    assert any(trees) and not all(trees)  # greedy trees and sampled ones were verified
    assert [g for g, q in zip(got, params) if q.greedy] == [w for w, q in zip(want, params) if q.greedy]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafter", ["draft-model", "specformer"])
def test_engine_with_branching_greedy_lossless_sampled_in_target_top_k(tiny_checkpoint, temperature, drafter):
    """Token trees in the engine, from a draft model's candidates or from a SpecFormer head's slot
    distributions. Greedy: exactly target-only output. Sampled (top_k = 3): every token is one of
    the target's 3 most likely at its position, though most tree nodes are the drafter's
    candidates (the distribution-level test of trees is test_speculative.py's draft-model-tree and
    specformer-tree)."""
    target_dir = str(tiny_checkpoint("llama", with_tokenizer=True))
    draft = load_checkpoint(tiny_checkpoint("llama", with_tokenizer=True, seed=1))
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=96)
    base = Engine(target_dir, cfg)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [3, 4], [7] * 10]
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=temperature, top_k=3 if temperature else 0,
                            seed=3)
    # position 1 looks easy, later ones hard: keep one draft, branch position 2 into 3 leaves
    score = lambda f: torch.where(f[:, 3] <= 1, 0.95, 0.05)
    if drafter == "specformer":
        from test_speculative import _specformer_for

        d = _specformer_for(base.checkpoint, 4)
    else:
        d = DraftModelDrafter(draft, cfg)
    eng = Engine(target_dir, cfg, tokenizer=base.tokenizer, drafter=d,
                 num_draft_tokens=4, draft_policy=DraftPolicy(score, acceptance_threshold=0.5, branch_top_m=3))
    ids = [eng.add_request(prompt_ids=p, params=params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    got = [eng.completion(i) for i in ids]
    assert all(len(c.token_ids) == 20 for c in got)
    assert eng.stats.num_drafted >= 3 * eng.stats.num_steps  # the trees really were verified
    if temperature == 0.0:
        ref = [base.add_request(prompt_ids=p, params=params) for p in prompts]
        while base.has_unfinished():
            base.step()
        assert [c.token_ids for c in got] == [base.completion(i).token_ids for i in ref]
    else:
        runner = make_runner(base.checkpoint, 1, cfg.max_seq_len)
        for p, c in zip(prompts, got):
            assert_in_target_top_k(runner, p, c.token_ids, params.top_k)


def test_ngram_branches_at_hard_positions_greedy_lossless(small_vocab_checkpoint):
    """Hard-position enhancement over n-gram drafts: where θ cuts, the leaves are the other
    continuations of the earlier occurrences that agree with the kept drafts
    (``LookupIndex.lookup_with_support``'s candidates). Greedy output is target-only's, and trees
    with several leaves were verified."""

    model_dir = str(small_vocab_checkpoint(seed=0, logit_scale=2.0))
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=96)
    base = Engine(model_dir, cfg)
    # "w1 w2" recurs followed by w3, w4 and w5: position 2 has three continuations to branch into
    prompts = ["w1 w2 w3 w9 w1 w2 w4 w9 w1 w2 w5 w9 w1 w2 w3 w9 w1", "w7 w8 w7 w6 w7 w8 w7 w5 w7",
               "w11 w12 w13 w11 w12 w14 w11 w12", "w2 w2 w3 w2 w2 w4 w2"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [c.token_ids for c in base.generate(prompts, params)]
    eng = _branching_ngram_engine(model_dir, cfg, base.tokenizer)
    leaves = []
    verify = eng.target.launch_verify

    def spy(items, masks=None):
        leaves.extend(len(it.proposal.tokens) - it.proposal.chain_length for it in items
                      if it.proposal.parents is not None)
        return verify(items, masks)

    eng.target.launch_verify = spy
    assert [c.token_ids for c in eng.generate(prompts, params)] == want
    assert max(leaves, default=0) >= 2, leaves  # some trees branched into several continuations


def test_greedy_tree_rounds_verify_inside_the_step(small_vocab_checkpoint):
    """A round with token trees whose rows are all greedy, without logit adjustments, verifies as
    the step's epilogue (in its CUDA graph on a GPU: one launch), with output equal to
    target-only's; a round that also holds a sampled tree verifies after the step."""
    model_dir = str(small_vocab_checkpoint(seed=0, logit_scale=2.0))
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=96)
    base = Engine(model_dir, cfg)
    prompts = ["w1 w2 w3 w9 w1 w2 w4 w9 w1 w2 w5 w9 w1 w2 w3 w9 w1", "w2 w2 w3 w2 w2 w4 w2"]
    for params in ([SamplingParams(max_tokens=16, ignore_eos=True)] * 2,
                   [SamplingParams(max_tokens=16, ignore_eos=True),
                    SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=2)]):
        eng = _branching_ngram_engine(model_dir, cfg, base.tokenizer)
        rounds, step, verify = [], eng.target.runner.step, eng.target.launch_verify

        def spy_verify(items, masks=None):  # (any tree, any sampled row)
            rounds.append((any(it.proposal.parents is not None for it in items),
                           any(not it.params.greedy for it in items)))
            return verify(items, masks)

        def spy_step(tokens, trees=None, **kw):
            rounds[-1] += (kw.get("epilogue") is not None,)
            return step(tokens, trees, **kw)

        eng.target.launch_verify, eng.target.runner.step = spy_verify, spy_step
        got = [c.token_ids for c in eng.generate(prompts, params)]
        assert any(tree for tree, _, _ in rounds)
        assert all(inside == (tree and not sampled) for tree, sampled, inside in rounds)
        if all(p.greedy for p in params):
            assert got == [c.token_ids for c in base.generate(prompts, params)]
        else:
            assert any(tree and sampled for tree, sampled, _ in rounds)


@pytest.mark.gpu
def test_greedy_trees_are_lossless_in_bf16_on_the_gpu(real_checkpoint):
    """The bundled model in bf16 on the fused path with CUDA graphs, batch 16, greedy: a policy
    that keeps two drafts and branches position 3 into the draft model's top-3 verifies token
    trees every round, and every prompt's output is target-only's (a tree node's attention reads
    its ancestors at its chain's positions, so its logits are bitwise the chain row's; before,
    4-8 of 128 prompts differed at batch 64)."""
    import json

    from conftest import SPEC_BENCH

    from tandem.drafters import load_draft_checkpoint

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] for r in rows[::30][:16]]
    cfg = RunnerConfig(device="cuda", dtype=torch.bfloat16, max_batch_size=16, max_seq_len=1024, cuda_graphs=True,
                       compile=False)
    params = SamplingParams(max_tokens=64)
    base = Engine(real_checkpoint, cfg)
    want = [c.token_ids for c in base.generate(prompts, params)]
    drafter = DraftModelDrafter(load_draft_checkpoint("truncate:4", real_checkpoint), cfg)
    policy = DraftPolicy(lambda f: torch.where(f[:, 3] <= 2, 0.95, 0.05), acceptance_threshold=0.5, branch_top_m=3)
    eng = Engine(real_checkpoint, cfg, tokenizer=base.tokenizer, drafter=drafter, num_draft_tokens=4,
                 draft_policy=policy)
    trees = []
    verify = eng.target.launch_verify

    def spy(items, masks=None):
        trees.extend(it.proposal.parents is not None for it in items)
        return verify(items, masks)

    eng.target.launch_verify = spy
    got = [c.token_ids for c in eng.generate(prompts, params)]
    assert sum(trees) > 16  # trees in most rounds
    assert got == want, [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
