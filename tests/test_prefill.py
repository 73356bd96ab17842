"""Prefill paths (``tandem.models.prefill``): the static, bucketed path (from CUDA graphs on a GPU,
eager here) leaves each prompt the same KV cache, logits and tapped states as the eager path, and
so does the varlen path (prompts packed end to end), whose results do not depend on a prompt's
neighbours."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import Engine
from tandem.models import load_checkpoint
from tandem.models.prefill import (DUMMY_LEN, GROUP_COST, MIN_WIDTH, dummy_len, varlen_fields, varlen_seq_buckets,
                                   varlen_token_buckets, width_bucket)
from tandem.models.runner import ModelRunner, RunnerConfig
from tandem.sampling import SamplingParams

LENGTHS = {1: 3, 3: 40, 4: 7, 6: 70}  # scattered slots, lengths across several width buckets


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint("llama"))


def _prompts(vocab: int, lengths: dict[int, int], seed: int = 0) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {s: torch.randint(1, vocab, (n,), generator=gen).tolist() for s, n in lengths.items()}


def _runner(checkpoint, static: bool, device: str = "cpu", **kw) -> ModelRunner:
    kw = {"max_batch_size": 8, "dtype": torch.float32, **kw}
    cfg = RunnerConfig(device=device, max_seq_len=128, prefill_graphs=static, taps=(0, 2), **kw)
    runner = ModelRunner(checkpoint, cfg)
    for _ in range(cfg.max_batch_size):
        runner.cache.allocate()
    return runner


def _check_same(got: ModelRunner, want: ModelRunner, prompts, got_out, want_out, atol: float) -> None:
    (got_logits, got_taps), (want_logits, want_taps) = got_out, want_out
    torch.testing.assert_close(got_logits.cpu(), want_logits.cpu(), atol=atol, rtol=0)
    for s, ids in prompts.items():
        n = len(ids)
        assert got.cache.lengths[s] == want.cache.lengths[s] == n
        for name in ("k", "v"):
            torch.testing.assert_close(getattr(got.cache, name)[:, s, :, :n].float().cpu(),
                                       getattr(want.cache, name)[:, s, :, :n].float().cpu(), atol=atol, rtol=0)
        torch.testing.assert_close(got_taps[s].float().cpu(), want_taps[s].float().cpu(), atol=atol, rtol=0)


def _prefill(runner: ModelRunner, prompts) -> tuple[torch.Tensor, dict]:
    taps: dict = {}
    return runner.prefill(prompts, taps), taps


def test_width_buckets():
    assert [width_bucket(n, 1024) for n in (1, MIN_WIDTH, MIN_WIDTH + 1, 200, 1000)] == [
        MIN_WIDTH, MIN_WIDTH, 2 * MIN_WIDTH, 256, 1024]
    assert width_bucket(900, 1000) == 1000 and width_bucket(100, 64) == 100  # the chunk caps, never below n


@pytest.mark.parametrize("slots,chunk,tokens", [(8, 1024, 8192), (128, 1024, 8192), (6, 100, 64)])
def test_buckets_cover_every_static_group(checkpoint, slots, chunk, tokens):
    """``Prefiller.buckets`` (what ``capture_all`` captures at start-up) holds the bucket of every
    group the static path can meet: any row count up to the slots, any longest prompt up to the
    cache capacity (past a chunk too)."""
    from tandem.models.runner import batch_bucket

    runner = ModelRunner(checkpoint, RunnerConfig(device="cpu", max_batch_size=slots, max_seq_len=2048,
                                                  prefill_chunk=chunk, prefill_tokens=tokens))
    pre = runner._prefiller
    cap = runner.cache.capacity
    buckets = set(pre.buckets())
    assert len(buckets) == len(pre.buckets())
    met = {(batch_bucket(n, slots), width_bucket(w, cap)) for n in range(1, slots + 1) for w in range(1, cap + 1)}
    assert {b for b in met if b[0] * b[1] <= pre.max_bucket_tokens} == buckets
    if (slots, chunk) == (8, 1024):
        assert cap == 2048 and len(buckets) == 4 * 7  # rows 1..8, positions 32..2048


@pytest.mark.parametrize("static", [True, False])
def test_groups_are_the_least_padded_contiguous_runs(checkpoint, static):
    """``Prefiller.groups`` splits a prefill's prompts (sorted by length) into the contiguous runs
    of least padded positions + ``GROUP_COST`` per group, within the row and bucket limits: equal
    to a brute force over every split, on random lengths; a long prompt no longer widens the short
    ones' rows (greedy filling by tokens put them all in one 8 x 2048 bucket)."""
    import itertools
    import random

    from tandem.models.runner import batch_bucket

    runner = ModelRunner(checkpoint, RunnerConfig(device="cpu", max_batch_size=8, max_seq_len=2048,
                                                  prefill_chunk=1024, prefill_tokens=8192))
    pre = runner._prefiller
    pre.static = static
    cap, chunk, budget = pre.max_width, 1024, 8192

    def cost(group_lengths: list[int]) -> int | None:
        rows, longest = len(group_lengths), max(group_lengths)
        bucket = batch_bucket(rows, 8) * width_bucket(longest, cap)
        if rows > 1 and (rows * min(chunk, longest) > budget or (static and bucket > pre.max_bucket_tokens)):
            return None
        return (bucket if static else rows * longest) + GROUP_COST

    rng = random.Random(0)
    for _ in range(40):
        lengths = {s: rng.choice([rng.randint(1, 120), rng.randint(100, 1900)]) for s in rng.sample(range(8), 6)}
        groups = pre.groups(lengths)
        assert sorted(s for g in groups for s in g) == sorted(lengths) and all(g == sorted(g) for g in groups)
        got = sum(cost([lengths[s] for s in g]) for g in groups)
        ordered = sorted(lengths.values())
        best = None
        for cuts in itertools.product([False, True], repeat=len(ordered) - 1):
            runs, run = [], [ordered[0]]
            for n, c in zip(ordered[1:], cuts):
                if c:
                    runs.append(run)
                    run = []
                run.append(n)
            costs = [cost(r) for r in runs + [run]]
            if None not in costs and (best is None or sum(costs) < best):
                best = sum(costs)
        assert got == best, (lengths, groups)
    groups = pre.groups({0: 1500, 1: 40, 2: 45, 3: 50, 4: 60, 5: 70})
    assert groups == [[1, 2, 3, 4, 5], [0]]


def test_failed_capture_falls_back_to_eager_prefills(checkpoint, monkeypatch):
    """A bucket whose capture fails at start-up turns the static path off (with a warning) instead
    of failing the runner: prefills then run eagerly and give the same results."""
    import tandem.models.runner as runner_mod

    runner = _runner(checkpoint, True)
    pre = runner._prefiller
    object.__setattr__(runner.config, "cuda_graphs", True)  # RunnerConfig refuses it on a CPU
    calls = []

    def failing(fn, inputs, capture=True, pool=None, warmup=2):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("operation not permitted when stream is capturing")
        return runner_mod.CapturedCall(fn, inputs, capture=False)

    monkeypatch.setattr(runner_mod, "CapturedCall", failing)
    assert pre.capture_all() == 0 and not pre.static and not any(k[0] == "prefill" for k in runner._graphs)
    object.__setattr__(runner.config, "cuda_graphs", False)
    prompts = _prompts(checkpoint.config.vocab_size, LENGTHS)
    eager = _runner(checkpoint, False)
    _check_same(runner, eager, prompts, _prefill(runner, prompts), _prefill(eager, prompts), atol=1e-6)
    assert pre.launches == 0


def test_static_prefill_equals_eager(checkpoint):
    """Scattered slots, four lengths, taps: the padded static path's logits, K/V rows, lengths and
    tapped states equal the eager path's, prompts past one chunk included (one static forward each,
    where the eager path runs them by chunks); a slot already holding tokens takes the eager path."""
    prompts = _prompts(checkpoint.config.vocab_size, LENGTHS)
    static, eager = _runner(checkpoint, True), _runner(checkpoint, False)
    _check_same(static, eager, prompts, _prefill(static, prompts), _prefill(eager, prompts), atol=1e-5)
    assert static._prefiller.launches >= 1 and eager._prefiller.launches == 0
    launches = static._prefiller.launches
    more = {s: p[:5] for s, p in _prompts(checkpoint.config.vocab_size, {3: 5, 6: 5}, seed=1).items()}
    _check_same(static, eager, {3: prompts[3] + more[3], 6: prompts[6] + more[6]},
                _prefill(static, more), _prefill(eager, more), atol=1e-5)
    assert static._prefiller.launches == launches  # slots holding tokens: eager
    long_static = _runner(checkpoint, True, prefill_chunk=16)
    long_eager = _runner(checkpoint, False, prefill_chunk=16)
    _check_same(long_static, long_eager, prompts, _prefill(long_static, prompts), _prefill(long_eager, prompts),
                atol=1e-5)
    assert long_static._prefiller.launches >= 1 and long_eager._prefiller.launches == 0


def test_static_prefill_reuses_its_bucket_and_keeps_outputs(checkpoint):
    """Groups in one prefill that share a bucket (same rows and width): each group's
    results survive the later replays (they are copies, not views of the graph's outputs)."""
    prompts = _prompts(checkpoint.config.vocab_size, {0: 20, 1: 21, 2: 22, 3: 23})
    cfg = dict(prefill_chunk=32, prefill_tokens=32)  # one prompt of 20+ tokens per group: four groups, one bucket
    static, eager = _runner(checkpoint, True, **cfg), _runner(checkpoint, False, **cfg)
    _check_same(static, eager, prompts, _prefill(static, prompts), _prefill(eager, prompts), atol=1e-5)
    assert static._prefiller.launches == 4 and len([k for k in static._graphs if k[0] == "prefill"]) == 1


def test_engine_output_same_with_every_prefill_path(tiny_checkpoint):
    """Greedy generation over the tiny model is the same token for token with eager, padded static
    and varlen prefills."""
    d = str(tiny_checkpoint("llama", with_tokenizer=True))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = ["a b c d e f", "hello there, how are you today?", "x" * 50]
    outs = []
    for static, varlen in ((False, False), (True, False), (True, True)):
        engine = Engine(d, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128, prefill_graphs=static,
                                        prefill_varlen=varlen))
        assert engine.runner._prefiller.varlen is varlen
        outs.append([c.token_ids for c in engine.generate(prompts, params)])
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_graphs_equal_eager_on_the_gpu(checkpoint):
    """From CUDA graphs (float32, the fused kernels): every bucket captured when the runner is
    built (none during a prefill), and the same results as eager prefills, twice."""
    prompts = _prompts(checkpoint.config.vocab_size, LENGTHS)
    graphs = _runner(checkpoint, True, device="cuda", cuda_graphs=True, prefill_varlen=False)
    eager = _runner(checkpoint, False, device="cuda", cuda_graphs=True, prefill_varlen=False)
    made = {k for k in graphs._graphs if k[0] == "prefill"}  # every bucket, at construction
    assert made == {("prefill", r, w) for r, w in graphs._prefiller.buckets()}
    for _ in range(2):
        for s in prompts:
            graphs.cache.truncate(s, 0)
            eager.cache.truncate(s, 0)
        _check_same(graphs, eager, prompts, _prefill(graphs, prompts), _prefill(eager, prompts), atol=1e-4)
    assert graphs._prefiller.launches >= 2 and {k for k in graphs._graphs if k[0] == "prefill"} == made
    assert not any(k[0] == "prefill" for k in eager._graphs)


def test_an_eager_call_is_not_counted_as_a_capture(checkpoint):
    """``CapturedCall.made`` counts CUDA graphs captured (what a bench checks its timed pass for):
    a runner built on a CPU, whose prefill and step calls run eagerly, captures none."""
    from tandem.models.graphs import CapturedCall

    made = CapturedCall.made
    runner = _runner(checkpoint, True, prefill_varlen=True)
    _prefill(runner, _prompts(checkpoint.config.vocab_size, LENGTHS))
    assert runner._graphs and CapturedCall.made == made


def test_varlen_buckets():
    tokens = varlen_token_buckets(8192)
    assert tokens[:6] == [64, 96, 128, 192, 256, 384] and tokens[-1] == 8192
    assert all(b / a <= 1.5 for a, b in zip(tokens, tokens[1:]))  # padding at most half the tokens
    assert varlen_token_buckets(100) == [64, 96, 100] and varlen_token_buckets(64) == [64]
    assert varlen_seq_buckets(65) == [2, 8, 32, 65] and varlen_seq_buckets(2) == [2]


def test_inputs_cover_the_padding_with_dummy_sequences(checkpoint):
    """Each prompt's tokens, positions, slot and last index; the padding in dummy sequences of at
    most DUMMY_LEN tokens that write nothing (slot -1); empty sequences after them; prompts that
    do not fit the bucket refused."""
    pre = _runner(checkpoint, True, prefill_varlen=True, max_batch_size=4)._prefiller  # context 128
    T, S, max_len = pre.varlen_shape([3, 5])
    assert (T, S, max_len) == (64, 5, 64)  # 2 prompts + 1 dummy of 56 tokens -> the top bucket (2, 5)
    p = pre.varlen_inputs(T, S, max_len, [2, 0], [3, 5], [[7, 8, 9], [1, 2, 3, 4, 5]])
    tokens, positions, slots, where = p[:T], p[T:2 * T], p[2 * T:3 * T], p[3 * T:4 * T]
    cu, last = p[4 * T:4 * T + S + 1], p[4 * T + S + 1:]
    assert tokens[:8].tolist() == [7, 8, 9, 1, 2, 3, 4, 5] and not tokens[8:].any()
    assert positions[:8].tolist() == [0, 1, 2, 0, 1, 2, 3, 4] and torch.equal(where, positions)
    assert slots[:8].tolist() == [2, 2, 2, 0, 0, 0, 0, 0] and (slots[8:] == -1).all()
    assert cu.tolist() == [0, 3, 8, 64, 64, 64] and last.tolist() == [2, 7, 0, 0, 0]
    bare = pre.varlen_inputs(T, S, max_len, [2, 0], [3, 5])  # no ids (a drafter's layout): the same, tokens 0
    assert not bare[:T].any() and torch.equal(bare[T:], p[T:])
    wide = _runner(checkpoint, True, prefill_varlen=True, max_batch_size=4, prefill_tokens=512)._prefiller
    T, S, max_len = wide.varlen_shape([130, 60])  # 190 tokens -> the 192 bucket; max_len = the context
    assert (T, S, max_len) == (192, 5, 128)
    T, S, max_len = wide.varlen_shape([100, 100, 100])  # 300 -> 384: 84 padded tokens, one dummy
    assert (T, S) == (384, 5)
    worst = wide.varlen_shape([97, 96, 96, 96])  # every slot, just past the 384 bucket: 127 padded, one dummy
    assert worst == (512, 5, 128) and worst[:2] in wide.varlen_buckets()
    with pytest.raises(ValueError, match="exceed"):
        wide.varlen_shape([128] * 5)
    with pytest.raises(ValueError, match="do not fit"):
        wide.varlen_inputs(*wide.varlen_shape([100, 100]), [0, 1, 2], [100, 100, 100])  # more tokens than the bucket
    # 800 tokens -> the 1,024 bucket: 224 padded tokens in two dummy sequences (128 + 96), not one
    many = _runner(checkpoint, True, prefill_varlen=True, max_batch_size=8, prefill_tokens=2048)._prefiller
    T, S, max_len = many.varlen_shape([100] * 8)
    assert (T, S, max_len) == (1024, 10, 128) and (T, S) in many.varlen_buckets()
    cu = varlen_fields(many.varlen_inputs(T, S, max_len, list(range(8)), [100] * 8), T, S)[4]
    assert cu.tolist() == [100 * i for i in range(9)] + [800 + DUMMY_LEN, 1024]
    # never longer than the graph's bound on a sequence (flash-attn's grid), as in a short context
    assert dummy_len(max_len) == DUMMY_LEN and dummy_len(64) == 64
    with pytest.raises(ValueError, match="do not fit"):
        many.varlen_inputs(T, S, 64, [0], [100])  # a prompt longer than the bound


def test_varlen_prefill_equals_padded(checkpoint):
    """Scattered slots, four lengths, taps: logits, K/V rows, lengths and tapped states as the
    padded path's, in one forward; a slot already holding tokens takes the padded path; more
    tokens than the limit run in more forwards, each prompt whole."""
    prompts = _prompts(checkpoint.config.vocab_size, LENGTHS)
    varlen, padded = _runner(checkpoint, True, prefill_varlen=True), _runner(checkpoint, True, prefill_varlen=False)
    assert varlen._prefiller.varlen and not padded._prefiller.varlen
    _check_same(varlen, padded, prompts, _prefill(varlen, prompts), _prefill(padded, prompts), atol=1e-5)
    assert varlen._prefiller.launches == 1 and [k[0] for k in varlen._graphs] == ["prefill-varlen"]
    more = {s: p[:5] for s, p in _prompts(checkpoint.config.vocab_size, {3: 5, 6: 5}, seed=1).items()}
    _check_same(varlen, padded, {3: prompts[3] + more[3], 6: prompts[6] + more[6]},
                _prefill(varlen, more), _prefill(padded, more), atol=1e-5)
    assert varlen._prefiller.launches == 1  # slots holding tokens: not varlen
    lengths = {0: 60, 2: 50, 5: 45, 7: 30}  # 185 tokens, limit 128 (the context): two forwards
    prompts = _prompts(checkpoint.config.vocab_size, lengths, seed=2)
    varlen, padded = (_runner(checkpoint, True, prefill_varlen=True, prefill_tokens=64),
                      _runner(checkpoint, True, prefill_varlen=False, prefill_tokens=64))
    assert varlen._prefiller.varlen_groups(lengths) == [[0, 2], [5, 7]]
    _check_same(varlen, padded, prompts, _prefill(varlen, prompts), _prefill(padded, prompts), atol=1e-5)
    assert varlen._prefiller.launches == 2


def test_varlen_is_refused_where_it_cannot_run(checkpoint):
    """On a GPU the varlen prefill needs flash-attn, the fused kernels and bf16/fp16: asked for
    without them, the runner's config check says which is missing (no CUDA device needed)."""
    from tandem.errors import ConfigError
    from tandem.models.runner_config import check_runner_config

    cfg = RunnerConfig(device="cuda", dtype=torch.float32, kernels="reference", prefill_varlen=True)
    with pytest.raises(ConfigError, match="--prefill-varlen cannot run here: flash-attn runs in bf16 or fp16"):
        check_runner_config(cfg, checkpoint.config)
    with pytest.raises(ConfigError, match="the reference kernels"):
        check_runner_config(RunnerConfig(device="cuda", dtype=torch.bfloat16, kernels="reference",
                                         prefill_varlen=True), checkpoint.config)
    assert check_runner_config(RunnerConfig(prefill_varlen=True), checkpoint.config) == "reference"  # a CPU: runs



def test_varlen_by_default_only_where_it_can_run(checkpoint):
    """Unset, the varlen prefill is on where it can run on a GPU with more than one slot and off
    elsewhere: never on a CPU or for one slot, and on a GPU without what it needs the padded path
    serves instead of a refusal (no CUDA device needed: the reasons come from the config)."""
    from tandem.models.runner_config import check_runner_config, resolve_prefill_varlen, varlen_batch_sizes

    mc = checkpoint.config
    assert resolve_prefill_varlen(RunnerConfig(), mc) is False  # a CPU
    assert resolve_prefill_varlen(RunnerConfig(prefill_varlen=True), mc) is True  # asked for: the reference attention
    for cfg in (RunnerConfig(device="cuda", dtype=torch.float32, kernels="reference"),
                RunnerConfig(device="cuda", dtype=torch.bfloat16, kernels="reference")):
        assert resolve_prefill_varlen(cfg, mc) is False
        assert check_runner_config(cfg, mc) == "reference"  # unset: no refusal
    assert resolve_prefill_varlen(RunnerConfig(device="cuda", prefill_varlen=False), mc) is False
    one_slot = RunnerConfig(device="cuda", dtype=torch.bfloat16, kernels="fused", max_batch_size=1)
    assert resolve_prefill_varlen(one_slot, mc) is False  # one prompt an admission: the padded buckets
    assert varlen_batch_sizes(RunnerConfig(prefill_varlen=True), mc, [1, 4]) == [1, 4]  # asked for: every size
    assert varlen_batch_sizes(RunnerConfig(), mc, [1, 4]) == []

def test_a_prompt_does_not_depend_on_its_neighbours(checkpoint):
    """The same prompt prefilled alone and packed after others of other lengths: the same logits
    and cache (float32 on a CPU: to rounding; the GPU test checks bit for bit)."""
    vocab = checkpoint.config.vocab_size
    target = _prompts(vocab, {1: 37}, seed=3)[1]
    alone = _runner(checkpoint, True, prefill_varlen=True)
    packed = _runner(checkpoint, True, prefill_varlen=True)
    logits_alone = alone.prefill({1: target})
    others = _prompts(vocab, {0: 50, 4: 9}, seed=4)
    logits_packed = packed.prefill({**others, 1: target})  # slot order 0, 1, 4: packed between the two
    torch.testing.assert_close(logits_packed[1], logits_alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.cache.k[:, 1, :, :37], alone.cache.k[:, 1, :, :37], atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [{}, {"context_next_token": True, "context_layers": 2, "context_mlp": True}])
def test_specformer_rounds_same_with_varlen_prefill(tiny_checkpoint, shape):
    """With the varlen prefill a SpecFormer head observes the prompts packed end to end as well
    (``specformer_prompts``; a head reading each position's next token with two context layers
    too): its context cache (every prompt position of every slot), its drafts' accepted counts and
    the greedy output are those of the padded prefill and padded observe."""
    from tandem.drafters.specformer import SpecFormerDrafter
    from tandem.train.specformer import new_head

    ck = load_checkpoint(tiny_checkpoint("llama", with_tokenizer=True))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["a b c d e f a b c d e f", "hello there, how are you today?", "x" * 40, "one two three"]
    runs = []
    for varlen in (False, True):
        head = new_head(ck.config, 4, None, False, 0, True, **shape)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (1.0 if p.ndim == 1 else 0.0))
        engine = Engine(ck, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128, prefill_graphs=True,
                                         prefill_varlen=varlen), drafter=SpecFormerDrafter(head.eval()),
                        num_draft_tokens=4)
        outs = [c.token_ids for c in engine.generate(prompts, params)]
        lens = [len(engine.make_request(p, params).prompt_ids) for p in prompts]
        drafter = engine.drafter
        assert any(k[0] == "observe-varlen" for k in drafter._captured) is varlen
        runs.append((outs, engine.stats.num_drafted, engine.stats.accepted_per_pos,
                     [drafter.k_cache[:, s, :, :n].clone() for s, n in enumerate(lens)]))
    (outs, drafted, accepted, cache), (outs_v, drafted_v, accepted_v, cache_v) = runs
    assert (outs, drafted, accepted) == (outs_v, drafted_v, accepted_v) and drafted > 0
    for a, b in zip(cache, cache_v):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_varlen_prefill_on_the_gpu(real_checkpoint):
    """The bundled model in bf16 with CUDA graphs and flash-attn: every varlen bucket captured when
    the runner is built (none in a prefill), logits, K/V and tapped states as the
    padded path's to bf16 rounding (cosine > 0.999), and with the fused-linear kernels a prompt's
    logits and cache bit for bit the same alone as packed with others."""
    from tandem.models.attention import varlen_available

    if not varlen_available(real_checkpoint.config.head_dim):
        pytest.skip("flash-attn's variable-length kernel is not importable here")

    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        assert torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0) > 0.999

    kw = dict(device="cuda", cuda_graphs=True, dtype=torch.bfloat16, prefill_varlen=True)
    varlen = _runner(real_checkpoint, True, **kw)
    padded = _runner(real_checkpoint, True, **{**kw, "prefill_varlen": False})
    made = {k for k in varlen._graphs if k[0] == "prefill-varlen"}
    assert varlen._prefiller.varlen and made == {("prefill-varlen", t, s) for t, s in varlen._prefiller.varlen_buckets()}
    prompts = _prompts(real_checkpoint.config.vocab_size, LENGTHS)
    (got, got_taps), (want, want_taps) = _prefill(varlen, prompts), _prefill(padded, prompts)
    close(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for s, ids in prompts.items():
        close(varlen.cache.k[:, s, :, :len(ids)], padded.cache.k[:, s, :, :len(ids)])
        close(varlen.cache.v[:, s, :, :len(ids)], padded.cache.v[:, s, :, :len(ids)])
        close(got_taps[s], want_taps[s])
    assert {k for k in varlen._graphs if k[0] == "prefill-varlen"} == made
    kw["kernels"] = "fused-linear"  # every projection row by row (cuBLAS picks its GEMM by the row count)
    packed, alone = _runner(real_checkpoint, True, **kw), _runner(real_checkpoint, True, **kw)
    logits = packed.prefill(prompts)
    logits_alone = alone.prefill({6: prompts[6]})
    assert torch.equal(logits[sorted(prompts).index(6)], logits_alone[0])
    assert torch.equal(packed.cache.k[:, 6, :, :70], alone.cache.k[:, 6, :, :70])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_specformer_over_varlen_prefills_is_lossless_on_the_gpu(real_checkpoint):
    """The bundled model and shipped head in bf16 with CUDA graphs and varlen prefills: the head's
    packed prompt observes captured at start-up (none in a prefill), its drafts accepted, and the
    greedy output of every prompt that of target-only decoding with the same prefills."""
    from conftest import spec_bench_prompts
    from tandem.drafters.specformer import SpecFormerDrafter
    from tandem.models.attention import varlen_available

    if not varlen_available(real_checkpoint.config.head_dim):
        pytest.skip("flash-attn's variable-length kernel is not importable here")
    cfg = RunnerConfig(device="cuda", dtype=torch.bfloat16, cuda_graphs=True, max_batch_size=16, max_seq_len=2048,
                       prefill_varlen=True)
    prompts = spec_bench_prompts(24)
    params = SamplingParams(max_tokens=48)
    target = Engine(real_checkpoint, cfg)
    want = [c.token_ids for c in target.generate(prompts, params)]
    engine = Engine(real_checkpoint, cfg, drafter=SpecFormerDrafter.load(), num_draft_tokens=4)
    made = {k for k in engine.drafter._captured if k[0] == "observe-varlen"}
    assert made == {("observe-varlen", t, s) for t, s in engine.runner.prefiller.varlen_buckets()}
    rows_m = engine.drafter.head.config.num_draft_tokens + 1  # no padded prompt-width observe graphs beside them
    assert not any(k[0] == "observe" and k[3] != rows_m for k in engine.drafter._captured)
    assert [c.token_ids for c in engine.generate(prompts, params)] == want
    assert engine.stats.num_accepted > 0
    assert {k for k in engine.drafter._captured if k[0] == "observe-varlen"} == made
