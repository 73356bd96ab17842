"""SpecFormer head, self-distillation data, drafter training, and lossless decoding with the
trained drafters (SpecFormer, AAAI 2026; the distilled draft model of the context-aware paper)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tandem.cli import main
from tandem.data import PromptRecord
from tandem.drafters.draft_model import DraftModelDrafter, load_draft_checkpoint
from tandem.drafters.specformer import SpecFormerDrafter
from tandem.engine import Engine
from tandem.errors import InvalidRequestError
from tandem.models.config import ModelLoadError
from tandem.models.runner import RunnerConfig
from tandem.models.specformer import SpecFormerConfig, SpecFormerHead, load_specformer, save_specformer
from tandem.models.transformer import Transformer
from tandem.models.weights import load_checkpoint
from tandem.sampling import SamplingParams
from tandem.train.distill import distill, iter_batches, read_distilled
from tandem.train.draft_model import DraftModelObjective, init_draft_model
from tandem.train.loop import TrainConfig, train
from tandem.train.specformer import SpecFormerObjective, init_context_from_target, new_head, specformer_labels

from conftest import spec_bench_prompts
from helpers import assert_in_target_top_k, make_runner

PROMPTS = ["Write a short poem about rain.", "What is the capital of France?", "Explain recursion simply.",
           "List three fruits.", "How do magnets work?", "Say hello in Spanish.", "Count to five.",
           "Describe a cat.", "What is two plus two?", "Name a famous painter."]


@pytest.fixture(scope="module")
def tiny_ck(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint("llama", with_tokenizer=True))


@pytest.fixture(scope="module")
def tiny_target(tiny_ck):
    t = Transformer(tiny_ck.config, 256)
    t.load_weights(tiny_ck.tensors)
    return t.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def distilled(tiny_ck, tmp_path_factory):
    """Greedy answers of the tiny target to ten prompts (32 tokens each)."""
    out = tmp_path_factory.mktemp("distill")
    engine = Engine(tiny_ck, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128))
    records = [PromptRecord(str(i), "-", p) for i, p in enumerate(PROMPTS)]
    distill(engine, records, out, max_tokens=32, max_prompt_tokens=64, shard_tokens=200)
    return out


# head variants: the paper's head, the bonus-token extension, the EAGLE-style shifted-token
# context with two context layers (each followed by an MLP) on top of it, and context decoder
# blocks of the target's shape (grouped-query attention: the tiny target has 4 heads, 2 KV heads)
VARIANTS = {"paper": {}, "bonus": {"bonus_token": True},
            "next-token": {"bonus_token": True, "context_next_token": True, "context_layers": 2, "context_mlp": True},
            "target-blocks": {"context_next_token": True, "context_init": (1, 0)},
            "lookup": {"bonus_token": True, "context_next_token": True, "lookup_tokens": True}}


def _random_head(cfg, num_draft=4, causal=False, seed=0, bonus_token=False, **shape) -> SpecFormerHead:
    """A head with every weight random (the trained-from-zero residual branches made non-zero)."""
    head = new_head(cfg, num_draft, None, causal, seed, bonus_token, **shape)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (1.0 if p.ndim == 1 else 0.0))
    return head.eval()


# ----------------------------------------------------------------------------- head shapes and masks


def test_context_lookup_whole_sequence_equals_incremental():
    """``lookup_continuations`` (training, analysis) and ``LookupIndex`` (serving) agree at every
    index of random low-entropy sequences, for several widths and n-gram ranges; the rule's cases
    by hand: the longest match wins, the most recent occurrence with k tokens after it wins, else
    the earliest, and a continuation never runs past the end."""
    from tandem.drafters.lookup import LookupIndex, lookup_continuations

    rng = np.random.default_rng(0)
    for trial in range(300):
        x = rng.integers(0, 2 + trial % 6, size=int(rng.integers(1, 60)))
        k = 1 + trial % 6
        max_n = 1 + trial % 4
        min_n = 1 + (trial // 4) % max_n
        cont, match = lookup_continuations(x, k, max_n, min_n)
        index = LookupIndex(max_n, min_n)
        for i, tok in enumerate(x):
            index.extend([tok])
            toks, n = index.lookup(k)
            assert n == match[i] and toks == [int(t) for t in cont[i] if t >= 0]
            assert (cont[i, :len(toks)] >= 0).all() and (cont[i, len(toks):] == -1).all()
    cont, match = lookup_continuations([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], 3)
    assert match[9] == 2 and cont[9].tolist() == [8, 1, 2]  # "1 2" last occurred at 5..6, 3 tokens before the end
    cont, match = lookup_continuations([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], 4)
    assert match[9] == 2 and cont[9].tolist() == [9, 7, 1, 2]  # at width 4 only the one at 1..2 has room
    cont, match = lookup_continuations([3, 4, 3, 4, 3], 4)  # a loop of period 2: the earliest occurrence
    assert match[4] == 3 and cont[4].tolist() == [4, 3, -1, -1]
    cont, match = lookup_continuations([1, 2, 3], 2)
    assert (match == 0).all() and (cont == -1).all()
    with pytest.raises(ValueError):
        lookup_continuations([1, 2], 0)
    with pytest.raises(ValueError):
        lookup_continuations([1, 2], 2, max_n=2, min_n=3)
    # a batch of rows in one pass equals each row alone (rows never match each other)
    for trial in range(50):
        x = rng.integers(0, 2 + trial % 5, size=(int(rng.integers(1, 6)), int(rng.integers(1, 50))))
        cont, match = lookup_continuations(x, 3)
        for b in range(len(x)):
            c, m = lookup_continuations(x[b], 3)
            assert (cont[b] == c).all() and (match[b] == m).all()


def test_lookup_head_reads_the_continuation(tiny_ck, tiny_target):
    """A ``lookup_tokens`` head's drafts change with the lookup input (the continuation and the
    match length both enter every draft slot), and a head without the input is refused."""
    from tandem.models.specformer import lookup_inputs
    from tandem.train.specformer import lookup_rows

    head = _random_head(tiny_ck.config, **VARIANTS["lookup"])
    h, bonus = torch.randn(2, tiny_ck.config.hidden_size), tiny_target.embed(torch.tensor([3, 3]))
    a = head.draft(h, bonus, lookup_inputs(tiny_target.embed, [[1, 2, 3, 4], [-1] * 4], [2, 0]))
    b = head.draft(h, bonus, lookup_inputs(tiny_target.embed, [[1, 2, 3, 5], [-1] * 4], [3, 0]))
    assert torch.equal(a[1], b[1]) and not torch.allclose(a[0], b[0])
    with pytest.raises(ValueError, match="lookup"):
        head.draft(h, bonus)
    tokens = torch.tensor([[7, 1, 2, 7, 1, 0, 0]])  # row t reads x[..t+1]
    cont, match = lookup_rows(tokens, 2)
    assert match.tolist()[:4] == [0, 0, 1, 2] and cont[3].tolist() == [2, 7]


def test_head_shapes_and_default_taps(tiny_ck, tiny_target):
    cfg = SpecFormerConfig.for_target(tiny_ck.config, num_draft_tokens=3)
    L = tiny_ck.config.num_layers
    assert cfg.taps == tuple(sorted({0, L // 2, L - 1, L}))
    head = _random_head(tiny_ck.config, 3)
    tokens = torch.randint(0, 100, (2, 7))
    _, taps = tiny_target.forward_causal(tokens, taps=cfg.taps)
    assert taps.shape == (2, 7, len(cfg.taps), cfg.hidden_size)
    cos, sin = tiny_target.rope_cos[:7].expand(2, 7, -1), tiny_target.rope_sin[:7].expand(2, 7, -1)
    y = head.forward_train(taps, cos, sin)
    assert y.shape == (14, 3, cfg.hidden_size)
    select = torch.zeros(2, 7, dtype=torch.bool)
    select[1, 2] = select[0, 6] = True
    ys = head.forward_train(taps, cos, sin, select)
    assert torch.allclose(ys, y.view(2, 7, 3, -1)[select], atol=1e-5)
    with pytest.raises(ValueError):
        SpecFormerConfig.for_target(tiny_ck.config, taps=(0, L + 1))


@pytest.mark.parametrize("causal", [False, True])
def test_draft_attention_mask(tiny_ck, causal):
    """Causal: slot 0 never sees later slots; bidirectional: it does."""
    head = _random_head(tiny_ck.config, 4, causal)
    h = torch.randn(3, tiny_ck.config.hidden_size)
    base = head.draft(h)
    with torch.no_grad():  # change only what the positional FFN gives slots 1..3
        d = tiny_ck.config.hidden_size
        head.pos_ffn.weight[d:] += 0.5
    moved = head.draft(h)
    assert torch.allclose(moved[:, 0], base[:, 0], atol=1e-6) == causal
    assert not torch.allclose(moved[:, 1:], base[:, 1:])


def test_context_attention_is_causal(tiny_ck, tiny_target):
    """The head's drafts at position t depend on tokens <= t only."""
    cfg = SpecFormerConfig.for_target(tiny_ck.config)
    head = _random_head(tiny_ck.config)
    a = torch.randint(0, 100, (1, 9))
    b = a.clone()
    b[0, 6:] = (b[0, 6:] + 1) % 100
    cos, sin = tiny_target.rope_cos[:9][None], tiny_target.rope_sin[:9][None]
    ya = head.forward_train(tiny_target.forward_causal(a, taps=cfg.taps)[1], cos, sin).view(9, 4, -1)
    yb = head.forward_train(tiny_target.forward_causal(b, taps=cfg.taps)[1], cos, sin).view(9, 4, -1)
    assert torch.allclose(ya[:6], yb[:6], atol=1e-5)
    assert not torch.allclose(ya[6:], yb[6:])


def test_labels_only_answer_tokens():
    tokens = torch.arange(10)[None]
    labels, valid = specformer_labels(tokens, torch.tensor([8]), torch.tensor([4]), 2)
    assert labels[0, 1].tolist() == [3, 4]  # position 1 predicts tokens 3 and 4
    assert valid[0, 1].tolist() == [False, True]  # token 3 is in the prompt
    assert valid[0, 5].tolist() == [True, False]  # token 7 exists, token 8 is past the end
    assert not valid[0, 6:].any()


# ----------------------------------------------------------------------------- drafts from the verify pass


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafts_from_verify_pass_match_full_recompute(tiny_ck, tiny_target, variant):
    """After rounds of speculative decoding with rollbacks, the head's incremental state (its own
    KV caches fed by the verify passes) gives the same drafts as a from-scratch forward over the
    accepted sequence; no separate target pass ran. Bonus-token heads also see the round's bonus
    token; shifted-token heads see every position's next token in their context."""
    from tandem.train.specformer import teacher_forced_states

    from tandem.drafters.base import NUM_FEATURES, DraftProposal

    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    greedy = Engine(tiny_ck, cfg).generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]

    class Oracle(SpecFormerDrafter):
        """Observes like SpecFormer but proposes two right tokens and a wrong one, so rounds keep
        several drafts and roll one back (the head's random drafts would never be accepted)."""

        def propose(self, requests, keep_drafting=None):
            out = []
            for r in requests:
                done = len(r.token_ids) - len(prompt_ids)
                toks = greedy.token_ids[done:done + 2] + [(greedy.token_ids[min(done + 2, 19)] + 1) % 256]
                out.append(DraftProposal(toks, None, torch.zeros(len(toks), NUM_FEATURES)))
            return out

    head = _random_head(tiny_ck.config, **VARIANTS[variant])
    drafter = Oracle(head)
    engine = Engine(tiny_ck, cfg, drafter=drafter)
    engine.target.chains_rounds = False  # the host-drafted path (observe, then propose) is what this checks
    prompt_ids = engine.make_request(PROMPTS[0], SamplingParams(max_tokens=20)).prompt_ids
    calls = []
    step = engine.runner.step
    engine.runner.step = lambda *a, **k: calls.append(1) or step(*a, **k)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(6):
        engine.step()
    req = engine.requests[rid]
    seq = req.prompt_ids + req.token_ids  # the collected round's tokens included
    pending = drafter.pending[req.slot]
    assert pending.length == len(seq) - 1 and len(calls) == 5  # one target forward per decode round
    from tandem.drafters.base import DraftRequest

    got = drafter.draft_logits([DraftRequest(req.slot, seq, 4, SamplingParams(), None)])[0]
    # 3 tokens a round; the fifth round is collected, its stop rules and metrics run at the next step
    assert req.spec.num_accepted == 8 and req.pending is not None and len(req.pending) == 3
    assert seq[len(prompt_ids):] == greedy.token_ids[:16]
    tokens = torch.tensor([seq])  # the last token is the bonus token the target has not consumed
    select = torch.zeros(1, len(seq), dtype=torch.bool)
    select[0, -2] = True
    y = teacher_forced_states(head, tiny_target, tokens, select)
    want = tiny_target.logits(tiny_target.norm(y[0]))
    assert torch.allclose(got, want, atol=1e-4)
    engine.abort(rid)


@pytest.mark.parametrize("variant", ["target-blocks", "lookup"])
def test_static_buffer_rounds_match_full_recompute(tiny_ck, tiny_target, variant):
    """The static-buffer path that CUDA graphs replay (padded to the batch bucket and to l_d + 1
    rows a round; run eagerly on the CPU) leaves the same context states and drafts as a
    from-scratch forward, for several requests at once (3 requests: one padded batch row), and
    the greedy output stays the target's."""
    from tandem.drafters.base import DraftRequest
    from tandem.train.specformer import teacher_forced_states

    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    want_text = [c.token_ids for c in Engine(tiny_ck, cfg).generate(PROMPTS[:3], params)]
    head = _random_head(tiny_ck.config, **VARIANTS[variant])
    drafter = SpecFormerDrafter(head)
    engine = Engine(tiny_ck, cfg, drafter=drafter)
    engine.target.chains_rounds = False  # the host-drafted path (observe, then propose) is what this checks
    drafter._static = True  # the graph path's buffers and padding, without capture (CPU)
    rids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    for _ in range(4):
        engine.step()
    assert {k[0] for k in drafter._captured} == {"observe", "draft"}
    assert all(k[1] == 4 for k in drafter._captured)  # 3 requests -> batch bucket 4
    reqs = [engine.requests[r] for r in rids]
    seqs = [r.prompt_ids + r.token_ids for r in reqs]
    got = drafter.draft_logits([DraftRequest(r.slot, q, 4, SamplingParams(), None) for r, q in zip(reqs, seqs)])
    for i, seq in enumerate(seqs):
        assert drafter.pending[reqs[i].slot].length == len(seq) - 1
        select = torch.zeros(1, len(seq), dtype=torch.bool)
        select[0, -2] = True
        y = teacher_forced_states(head, tiny_target, torch.tensor([seq]), select)
        assert torch.allclose(got[i], tiny_target.logits(tiny_target.norm(y[0])), atol=1e-4)
    while engine.has_unfinished():
        engine.step()
    assert [engine.completion(r).token_ids for r in rids] == want_text


_DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if _DEV == "cuda" else [torch.float32])
@pytest.mark.parametrize("variant", ["paper", "target-blocks", "lookup"])
def test_static_path_matches_an_eager_twin_under_churn(tiny_ck, monkeypatch, dtype, variant):
    """The static-buffer path (CUDA graphs on a GPU; forced, uncaptured, on the CPU) against an
    eager twin head fed the same observe calls, every round and every admission (the prompts in
    width buckets sharing one input store): 10 requests admitted 1-3 at a time
    with different lengths (slots finish and are reused mid-batch), 0-4 drafts accepted per round
    (rollbacks; 1-5 new rows per request), small context buckets (several per request). float32
    also against a from-scratch recompute; bf16 (GPU) within bf16 rounding."""
    import random

    import tandem.models.graphs as graphs_mod
    from tandem.drafters.base import NUM_FEATURES, DraftProposal, DraftRequest
    from tandem.train.specformer import teacher_forced_states

    monkeypatch.setattr(graphs_mod, "CONTEXT_BUCKET", 16)
    cfg = RunnerConfig(device=_DEV, dtype=dtype, max_batch_size=8, max_seq_len=128, cuda_graphs=_DEV == "cuda")
    maxes = [7, 30, 12, 25, 3, 18, 9, 22, 15, 28]
    base = Engine(tiny_ck, cfg)
    greedy, keys = {}, []
    for prompt in PROMPTS:
        keys.append(tuple(base.make_request(prompt, SamplingParams(max_tokens=40)).prompt_ids))
        greedy[keys[-1]] = base.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    rng = random.Random(0)

    class Oracle(SpecFormerDrafter):
        """Observes like SpecFormer; proposes 0-4 right tokens then a wrong one."""

        def propose(self, requests, keep_drafting=None):
            out = []
            for r in requests:
                pre = max((p for p in greedy if tuple(r.token_ids[:len(p)]) == p), key=len)
                done, k = len(r.token_ids) - len(pre), rng.randint(0, 4)
                toks = (list(greedy[pre][done:done + k]) + [(greedy[pre][min(done + k, 39)] + 1) % 256])[:r.max_draft]
                out.append(DraftProposal(toks, None, torch.zeros(len(toks), NUM_FEATURES)))
            return out

    drafter = Oracle(_random_head(tiny_ck.config, **VARIANTS[variant]))
    engine = Engine(tiny_ck, cfg, drafter=drafter, num_draft_tokens=4)
    engine.target.chains_rounds = False  # the host-drafted path (observe, then propose) is what this checks
    drafter._static = True
    twin = SpecFormerDrafter(_random_head(tiny_ck.config, **VARIANTS[variant]))
    twin.bind(engine.runner)
    twin._static = False
    observe = drafter.observe
    monkeypatch.setattr(drafter, "observe", lambda states: (observe(states), twin.observe(states))[0])
    target = None
    if dtype == torch.float32:
        target = Transformer(tiny_ck.config, 256)
        target.load_weights(tiny_ck.tensors)
        target = target.to(_DEV).eval().requires_grad_(False)
    rids, adds, steps = {}, [(i, PROMPTS[i]) for i in rng.sample(range(10), 10)], 0
    while adds or engine.has_unfinished():
        if adds and steps % 2 == 0:
            for _ in range(rng.randint(1, 3)):
                if adds:
                    i, prompt = adds.pop(0)
                    rids[engine.add_request(prompt, SamplingParams(max_tokens=maxes[i], ignore_eos=True))] = i
        engine.step()
        steps += 1
        running = [engine.requests[r] for r in rids if r in engine.requests
                   and engine.requests[r].slot is not None and not engine.requests[r].finished]
        if not running:
            continue
        seqs = [r.prompt_ids + r.token_ids for r in running]
        asks = [DraftRequest(r.slot, q, 4, SamplingParams(), None) for r, q in zip(running, seqs)]
        got, want = drafter.draft_logits(asks).clone(), twin.draft_logits(asks)
        err = ((got - want).abs().max() / want.abs().max()).item()
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        assert torch.isfinite(got).all() and err < (1e-4 if target is not None else 5e-2), (steps, err)
        assert agree > (0.999 if target is not None else 0.9), (steps, agree)
        if target is not None:
            for i, seq in enumerate(seqs):
                select = torch.zeros(1, len(seq), dtype=torch.bool, device=_DEV)
                select[0, -2] = True
                with torch.inference_mode():
                    y = teacher_forced_states(drafter.head, target, torch.tensor([seq], device=_DEV), select)
                    ref = target.logits(target.norm(y[0]))
                assert torch.allclose(got[i], ref, atol=1e-3, rtol=1e-3), (steps, i)
    assert {k[0] for k in drafter._captured} == {"observe", "draft"}
    assert len({k[1] for k in drafter._captured}) > 1 and len({k[2] for k in drafter._captured if k[0] == "observe"}) > 1
    # the admitted prompts were observed on the static path too, in width buckets past l_d + 1 rows
    assert {k[3] for k in drafter._captured if k[0] == "observe"} - {drafter.head.config.num_draft_tokens + 1}
    assert [engine.completion(r).token_ids for r in rids] == [greedy[keys[i]][:maxes[i]] for i in rids.values()]


def test_chained_static_path_matches_the_eager_head(tiny_ck):
    """Chained rounds with the head's static path (forced, uncaptured, on the CPU): the prompts'
    observe (in the prefill's groups, padded to buckets) and the in-round work run through their
    static-shape calls, greedy and sampled, prompts admitted alone and together; the outputs and
    the drafted / accepted counts equal those of the same head run eagerly."""
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_k=20, seed=5),
              SamplingParams(max_tokens=12, ignore_eos=True)]
    runs = []
    for static in (True, False):
        drafter = SpecFormerDrafter(_random_head(tiny_ck.config, **VARIANTS["lookup"]))
        engine = Engine(tiny_ck, cfg, drafter=drafter)
        drafter._static = static
        assert engine.chains_rounds
        out = [engine.generate([p], sp)[0] for p, sp in zip(PROMPTS[:3], params)]
        out += engine.generate(PROMPTS[3:6], params[0])  # admitted together
        runs.append(([c.token_ids for c in out], engine.stats.num_drafted, engine.stats.num_accepted))
        assert ("observe" in {k[0] for k in drafter._captured}) is static
    assert runs[0] == runs[1] and runs[0][1] > 0


def test_a_failed_graph_capture_falls_back_to_eager(tiny_ck, monkeypatch):
    """When capturing the head's graphs fails, the drafter logs it, runs eagerly from then on,
    and every request still gets the target's own output."""
    import tandem.drafters.specformer as sf

    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [c.token_ids for c in Engine(tiny_ck, cfg).generate(PROMPTS[:2], params)]
    drafter = SpecFormerDrafter(_random_head(tiny_ck.config, **VARIANTS["lookup"]))
    engine = Engine(tiny_ck, cfg, drafter=drafter)
    drafter._static = True
    monkeypatch.setattr(sf, "CapturedCall", broken)
    got = [c.token_ids for c in engine.generate(PROMPTS[:2], params)]
    assert got == want and drafter._static is False and not drafter._captured


def test_prompt_observe_shapes_cover_every_static_prompt_observe(tiny_ck):
    """Every shape the head's observe of a prefill's prompts takes on the static (CUDA graph) path
    is one ``prompt_observe_shapes`` lists, which ``capture_prompt_observes`` captures when the
    head is bound: whatever the prompts' lengths and however the prefill groups them, no observe
    graph is captured inside an admission. Decode rounds' observes (positions past 0) keep their
    l_d + 1 shape."""
    import random

    engine = Engine(tiny_ck, RunnerConfig(device="cpu", max_batch_size=16, max_seq_len=600),
                    drafter=SpecFormerDrafter(_random_head(tiny_ck.config)), num_draft_tokens=4)
    head = engine.drafter
    head._static = True  # the shapes the CUDA path takes (a CPU runner has no graphs)
    shapes = set(head.prompt_observe_shapes())
    rows_m = head.head.config.num_draft_tokens + 1
    assert len(shapes) == len(head.prompt_observe_shapes()) < 60
    rng = random.Random(0)
    static = 0
    for _ in range(300):
        lens = [rng.choice([rng.randint(1, 8), rng.randint(9, 120), rng.randint(121, 600)])
                for _ in range(rng.randint(1, 16))]
        groups = engine.runner.prefill_groups(dict(enumerate(lens))) if len(lens) > 1 and max(lens) > rows_m \
            else [list(range(len(lens)))]
        for group in groups:
            nb, attn_len, M, on_graph = head._observe_shape([lens[i] for i in group], [0] * len(group))
            assert (nb, attn_len, M) in shapes or not on_graph
            static += on_graph
    assert static > 300  # most groups fit the static bound
    nb, attn_len, M, on_graph = head._observe_shape([3, 5, 1], [40, 300, 7])  # a decode round's accepted rows
    assert (nb, M, on_graph) == (4, rows_m, True) and attn_len == 512
    assert head.capture_prompt_observes() == 0  # nothing to capture without CUDA


def test_engine_traces_the_drafters_observe_phase(tiny_ck, tmp_path, monkeypatch):
    """SpecFormer's per-round work on the verify pass's states has its own span, inside the
    round, so `tandem trace-report` splits a round into draft, verify and observe."""
    from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    import tandem.telemetry
    from tandem.trace_report import build_report, read_spans

    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(tmp_path / "t.jsonl")))
    monkeypatch.setattr(tandem.telemetry, "_tracer", provider.get_tracer("test"))
    engine = Engine(tiny_ck, RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=128),
                    drafter=SpecFormerDrafter(_random_head(tiny_ck.config)), num_draft_tokens=2)
    engine.target.chains_rounds = False  # host-drafted rounds have an observe phase (chained ones draft in the round)
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    provider.shutdown()
    report = build_report(read_spans(tmp_path / "t.jsonl"))
    rounds, observe = report.phase("round"), report.phase("observe")
    assert 0 < observe.count <= rounds.count and 0 < observe.share_of_round < 1  # none after the last round


def test_shifted_token_head_reads_the_next_token(tiny_ck, tiny_target):
    """A ``context_next_token`` head's drafts at position t change with x[t+1] and with earlier
    positions' next tokens, and never with tokens after x[t+1]."""
    from tandem.train.specformer import teacher_forced_states

    head = _random_head(tiny_ck.config, context_next_token=True)
    base = torch.randint(3, tiny_ck.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    select = torch.zeros(1, 12, dtype=torch.bool)
    select[0, 6] = True
    ref = teacher_forced_states(head, tiny_target, base, select)
    later = base.clone()
    later[0, 8:] = (later[0, 8:] + 1) % tiny_ck.config.vocab_size
    assert torch.allclose(teacher_forced_states(head, tiny_target, later, select), ref, atol=1e-5)
    nxt = base.clone()
    nxt[0, 7] = (nxt[0, 7] + 1) % tiny_ck.config.vocab_size
    assert not torch.allclose(teacher_forced_states(head, tiny_target, nxt, select), ref, atol=1e-3)
    with pytest.raises(ValueError, match="next token"):
        head.context_input(torch.zeros(1, 2, len(head.config.taps), tiny_ck.config.hidden_size))


# ----------------------------------------------------------------------------- distillation data


def test_distill_writes_shards_and_resumes(tiny_ck, distilled, tmp_path):
    manifest, seqs = read_distilled(distilled)
    assert len(seqs) == len(PROMPTS) and len(manifest.shards) > 1
    assert manifest.target["sha256"] and manifest.settings["max_tokens"] == 32
    engine = Engine(tiny_ck, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128))
    for rec, s in zip(manifest.records, seqs):
        assert len(s.tokens) == rec.prompt_len + rec.answer_len and 1 <= rec.answer_len <= 32
    # the answers are the target's greedy output
    rec = manifest.records[0]
    c = engine.generate([PROMPTS[int(rec.prompt_id)]], SamplingParams(max_tokens=32))[0]
    assert seqs[0].tokens[rec.prompt_len:].tolist() == c.token_ids
    # a rerun skips what is done; benchmark prompts are never training data
    bench = [PromptRecord("b", "-", spec_bench_prompts(1)[0])]
    again = distill(engine, [PromptRecord("0", "-", PROMPTS[0])] + bench, distilled, max_tokens=32)
    assert len(again.records) == len(PROMPTS) and again.skipped["benchmark"] == 1
    with pytest.raises(Exception, match="benchmark"):
        distill(engine, bench, tmp_path / "b", max_tokens=4)
    # answers of another length limit are not mixed into the same data
    with pytest.raises(InvalidRequestError, match="max_tokens 32 -> 16"):
        distill(engine, [PromptRecord("new", "-", "Name a colour.")], distilled, max_tokens=16)
    # answers to a second prompt set join the data, and the manifest names both prompt files
    two = tmp_path / "two"
    distill(engine, [PromptRecord("a", "-", PROMPTS[0])], two, max_tokens=8, settings={"prompts_file": "first.jsonl"})
    m = distill(engine, [PromptRecord("b", "-", PROMPTS[1])], two, max_tokens=8, settings={"prompts_file": "second.jsonl"})
    assert [r.prompt_id for r in m.records] == ["a", "b"]
    assert m.settings["prompts_file"] == "first.jsonl" and m.settings["prompts_files"] == ["first.jsonl", "second.jsonl"]
    again = distill(engine, [PromptRecord("b", "-", PROMPTS[1])], two, max_tokens=8, settings={"prompts_file": "second.jsonl"})
    assert again.settings["prompts_files"] == ["first.jsonl", "second.jsonl"]
    # each resumed run that answered something is noted (a rerun with nothing left to do is not)
    assert again.settings["resumed"] == [{"prompts_file": "second.jsonl", "answers_before": 1}]


def test_shards_are_compressed_and_old_raw_shards_convert(distilled, tmp_path):
    """Shards are written gzip-compressed; a directory of uncompressed ``.bin`` shards (older runs,
    the first committed data) reads the same and converts in place; a damaged shard is a clear error."""
    import gzip
    import shutil

    from tandem.errors import InvalidRequestError
    from tandem.train.distill import DistillManifest, compress_shards, file_sha256

    manifest, seqs = read_distilled(distilled)
    assert all(s["file"].endswith(".bin.gz") for s in manifest.shards)
    raw = tmp_path / "raw"
    shutil.copytree(distilled, raw)
    m = DistillManifest.load(raw)
    for entry in m.shards:  # rewrite as an older run would have left it
        path = raw / entry["file"]
        plain = raw / entry["file"][:-3]
        plain.write_bytes(gzip.decompress(path.read_bytes()))
        path.unlink()
        entry.update(file=plain.name, sha256=file_sha256(plain))
    m.save(raw)
    for got in (read_distilled(raw)[1], None):
        if got is None:
            assert compress_shards(raw) == len(m.shards) and compress_shards(raw) == 0
            assert not list(raw.glob("*.bin")) and len(list(raw.glob("*.bin.gz"))) == len(m.shards)
            got = read_distilled(raw)[1]
        assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in seqs]
    manifest_text = (raw / "manifest.json").read_text()
    for damage, said in ((manifest_text[:500], "not JSON"), ("[]", "not a tandem-distill-v1"),
                         (manifest_text.replace('"offset":0,', '"offset":99999999,', 1), "points outside its shard"),
                         (manifest_text.replace('"offset":0,', '', 1), "is damaged"),
                         (manifest_text.replace('"shard":0,', '"shard":"a",', 1), "points outside its shard")):
        (raw / "manifest.json").write_text(damage)
        with pytest.raises(InvalidRequestError, match=said):
            read_distilled(raw)
    (raw / "manifest.json").write_text(manifest_text)
    first = raw / DistillManifest.load(raw).shards[0]["file"]
    first.write_bytes(first.read_bytes()[:10])
    with pytest.raises(InvalidRequestError, match="corrupt"):
        read_distilled(raw)
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        read_distilled(raw, verify=False)


def test_batches_respect_token_budget(distilled):
    _, seqs = read_distilled(distilled)
    batches = list(iter_batches(seqs, 256, np.random.default_rng(0), max_len=60))
    assert sum(len(b) for b in batches) == len(seqs)
    assert all(len(b) * max(len(s.tokens) for s in b) <= 256 or len(b) == 1 for b in batches)
    # an answer cap keeps each prompt whole and the first N answer tokens
    capped = [s for b in iter_batches(seqs, 256, np.random.default_rng(0), max_answer_tokens=5) for s in b]
    by_prompt = {tuple(s.tokens[:s.prompt_len]): s for s in seqs}
    assert len(capped) == len(seqs)
    for s in capped:
        full = by_prompt[tuple(s.tokens[:s.prompt_len])]
        assert len(s.tokens) == min(len(full.tokens), full.prompt_len + 5)
        assert np.array_equal(s.tokens, full.tokens[:len(s.tokens)])


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("variant,soft", [("paper", 0.0), ("bonus", 0.0), ("next-token", 0.5), ("target-blocks", 0.0),
                                          ("lookup", 0.0)])
def test_specformer_training_lowers_loss_and_round_trips(tiny_ck, tiny_target, distilled, tmp_path, variant, soft):
    _, seqs = read_distilled(distilled)
    head = new_head(tiny_ck.config, 4, seed=0, **VARIANTS[variant])
    objective = SpecFormerObjective(head, tiny_target, amp=False, soft_weight=soft)
    before = float(objective(seqs[:4])[0].detach())
    # 10 steps lower the loss by 1.1 or more in every variant (20 steps were no more telling)
    cfg = TrainConfig(max_steps=10, lr=6e-3, max_batch_tokens=512, checkpoint_every=5)
    result = train(head, objective, seqs, cfg, tmp_path, progress=False)
    after = float(objective(seqs[:4])[0].detach())
    assert result.steps == 10 and after < before - 0.5 and result.final_loss < result.first_loss
    assert {"acc_slot1", "expected_accepted"} <= set(result.metrics)
    save_specformer(head, tmp_path / "head")
    loaded = load_specformer(tmp_path / "head")
    assert loaded.config == head.config
    for (k, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-2 * (a.abs().max() + 1)), k  # stored in bf16
    # resuming at the last checkpoint does no further steps
    again = train(head, objective, seqs, cfg, tmp_path, progress=False)
    assert again.steps == 10


def test_soft_label_loss_is_cross_entropy_against_the_target(tiny_ck, tiny_target, distilled):
    """soft_weight 1: the loss is the mean over valid (position, slot) pairs of
    -sum_v p_target(v | x[..t+1+j]) log q_j(v | t), computed here from a plain target forward;
    soft_weight 0 is the hard-label cross-entropy; and weights outside [0, 1] are refused."""
    from tandem.train.loop import pad_batch
    from tandem.train.specformer import teacher_forced_states

    _, seqs = read_distilled(distilled)
    batch = seqs[:3]
    head = _random_head(tiny_ck.config, bonus_token=True)
    tokens, lengths, prompt_lens = pad_batch(batch, "cpu")
    labels, valid = specformer_labels(tokens, lengths, prompt_lens, 4)
    select = valid.any(-1)
    logp = tiny_target.logits(tiny_target.norm(teacher_forced_states(head, tiny_target, tokens, select))).log_softmax(-1)
    teacher = tiny_target.logits(tiny_target.forward_causal(tokens)[0]).softmax(-1)  # [B, T, vocab]
    b, t = select.nonzero(as_tuple=True)
    ok = valid[select]
    soft = torch.stack([-(teacher[b, (t + 1 + j).clamp(max=tokens.shape[1] - 1)] * logp[:, j]).sum(-1)
                        for j in range(4)], dim=1)
    hard = -logp.gather(-1, labels[select][..., None])[..., 0]
    for w, want in ((1.0, soft), (0.0, hard), (0.25, 0.75 * hard + 0.25 * soft)):
        got = float(SpecFormerObjective(head, tiny_target, amp=False, soft_weight=w)(batch)[0].detach())
        assert got == pytest.approx(float((want * ok).sum().detach() / ok.sum()), rel=1e-5)
    with pytest.raises(ValueError, match="soft_weight"):
        SpecFormerObjective(head, tiny_target, amp=False, soft_weight=1.5)


def test_head_saved_before_context_layers_loads(tiny_ck, tmp_path):
    """Heads written before the context sub-layers were a list (one layer, flat parameter names,
    as the first shipped heads) load into the same weights."""
    from safetensors.torch import load_file, save_file

    head = _random_head(tiny_ck.config, bonus_token=True)
    file = save_specformer(head, tmp_path / "new")
    new_names = {"ctx.0.norm.weight": "ctx_norm.weight", "ctx.0.qkv.weight": "ctx_qkv.weight",
                 "ctx.0.o.weight": "ctx_o.weight", "mlp.norm.weight": "mlp_norm.weight",
                 "mlp.w13.weight": "w13.weight", "mlp.w2.weight": "w2.weight"}
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    legacy = {new_names.get(k, k): v for k, v in load_file(str(file)).items()}
    (tmp_path / "old").mkdir()
    save_file(legacy, str(tmp_path / "old" / "model.safetensors"), metadata=meta)
    a, b = load_specformer(tmp_path / "new").state_dict(), load_specformer(tmp_path / "old").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("edit,message", [
    (lambda c: "{", "config is not JSON"),
    (lambda c: None, "the metadata has no config"),
    (lambda c: "[1]", "config must be a JSON object"),
    (lambda c: dict(c, lookup_tokens="maybe"), "lookup_tokens has a value of the wrong type"),
    (lambda c: dict(c, num_draft_tokens=True), "num_draft_tokens has a value of the wrong type"),
    (lambda c: dict(c, taps=[0, "1"]), "taps has a value of the wrong type"),
    (lambda c: dict(c, foo=1), "unknown foo"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "missing hidden_size"),
    (lambda c: dict(c, num_draft_tokens=0), "sizes must be >= 1: num_draft_tokens=0"),
])
def test_damaged_head_config_is_a_clear_error(tiny_ck, tmp_path, edit, message):
    """A head whose metadata config is not what ``save_specformer`` writes is refused with a
    ``ModelLoadError`` naming the problem (no traceback, no silent coercion of a bogus flag)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    file = save_specformer(_random_head(tiny_ck.config, **VARIANTS["lookup"]), tmp_path / "good")
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    changed = edit(json.loads(meta["config"]))
    meta = dict(meta)
    if changed is None:
        del meta["config"]
    else:
        meta["config"] = changed if isinstance(changed, str) else json.dumps(changed)
    (tmp_path / "bad").mkdir()
    save_file(load_file(str(file)), str(tmp_path / "bad" / "model.safetensors"), metadata=meta)
    with pytest.raises(ModelLoadError, match="damaged config") as err:
        load_specformer(tmp_path / "bad")
    assert message in str(err.value)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "model.safetensors").write_text("not weights")
    with pytest.raises(ModelLoadError, match="not a complete safetensors file"):
        load_specformer(tmp_path / "text")


def test_context_blocks_start_as_copies_of_target_blocks(tiny_ck, tiny_target, tmp_path):
    """``context_init`` heads: each context block computes exactly what its target block computes
    (grouped-query attention, SwiGLU), the taps enter through a zero downsampler, so at step 0
    every draft slot holds the pruned target's state after the next-token embedding."""
    cfg = tiny_ck.config
    head = new_head(cfg, 3, context_next_token=True, context_init=(1, 0))
    assert head.config.context_layers == 2 and head.config.context_mlp
    assert head.config.ctx_kv_heads == cfg.num_kv_heads < cfg.num_heads
    init_context_from_target(head, tiny_target)
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    cos, sin = tiny_target.rope_cos[:7].expand(2, 7, -1), tiny_target.rope_sin[:7].expand(2, 7, -1)
    with torch.no_grad():
        for layer, idx in zip(head.ctx, (1, 0)):
            q, k, v = layer.qkv_rotated(x, cos, sin)
            att = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
            assert torch.allclose(layer.finish(x, att), tiny_target.layers[idx].forward_causal(x, cos, sin), atol=1e-5)
        from tandem.train.specformer import teacher_forced_states

        tokens = torch.randint(3, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
        slots = teacher_forced_states(head, tiny_target, tokens)  # [9, 3, d]
        e = tiny_target.embed(tokens[0, torch.arange(1, 10).clamp(max=8)])
        h = head.next_norm(e)[None]
        for layer, idx in zip(head.ctx, (1, 0)):
            h = tiny_target.layers[idx].forward_causal(h, tiny_target.rope_cos[:9][None], tiny_target.rope_sin[:9][None])
        assert torch.count_nonzero(head.down.weight) == 0
        assert torch.allclose(slots, h[0][:, None].expand_as(slots), atol=1e-5)
    save_specformer(head, tmp_path)
    assert load_specformer(tmp_path).config.context_init == (1, 0)
    with pytest.raises(ValueError, match="block indices"):
        SpecFormerConfig.for_target(cfg, context_init=(0, cfg.num_layers))
    with pytest.raises(ValueError, match="init blocks set the layer count"):
        SpecFormerConfig.for_target(cfg, context_layers=3, context_init=(0, 1))
    with pytest.raises(ValueError, match="no context init blocks"):
        init_context_from_target(new_head(cfg, 3), tiny_target)


def test_context_init_refuses_targets_with_query_key_norms(tiny_checkpoint):
    qwen3 = load_checkpoint(tiny_checkpoint("qwen3")).config
    with pytest.raises(ValueError, match="query/key norms"):
        SpecFormerConfig.for_target(qwen3, context_init=(0,))


def test_draft_model_training_lowers_loss(tiny_ck, tiny_target, distilled, tmp_path):
    _, seqs = read_distilled(distilled)
    draft = init_draft_model(tiny_ck, (0,), 256)
    assert not draft.embed.weight.requires_grad
    objective = DraftModelObjective(draft, tiny_target, amp=False)
    before = float(objective(seqs[:4])[0].detach())
    train(draft, objective, seqs, TrainConfig(max_steps=30, lr=3e-3, max_batch_tokens=512), tmp_path, progress=False)
    assert float(objective(seqs[:4])[0].detach()) < before - 0.1
    with pytest.raises(ModelLoadError):
        init_draft_model(tiny_ck, (5,), 256)


# ----------------------------------------------------------------------------- CLI and lossless decoding


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, distilled, tmp_path_factory):
    """Head and draft model trained through the CLI on the tiny target's distilled answers."""
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    out = tmp_path_factory.mktemp("trained")
    runner = CliRunner()
    head_flags = ["--bonus-token", "--context-next-token", "--context-init-layers", "1,0", "--soft-labels", "0.5",
                  "--max-answer-tokens", "24"]
    for kind, extra in (("specformer", head_flags), ("draft-model", ["--init-layers", "0"])):
        res = runner.invoke(main, ["train", kind, "--data", str(distilled), "--out", str(out / kind), "--model", model,
                                   "--device", "cpu", "--max-steps", "15", "--lr", "5e-3", "--batch-tokens", "512",
                                   "--eval-limit", "3", "--eval-max-tokens", "16"] + extra)
        assert res.exit_code == 0, res.output
    return model, out


def test_cli_training_writes_weights_and_model_card(trained):
    _, out = trained
    for kind in ("specformer", "draft-model"):
        card = json.loads((out / kind / "card.json").read_text())
        assert card["training"]["steps"] == 15 and card["data"]["answers"] == len(PROMPTS)
        sb = card["spec_bench"]
        assert sb["prompts"] == 3 and 0.0 <= sb["overall"]["acceptance_rate"] <= 1.0
        readme = (out / kind / "README.md").read_text()
        assert "Measured acceptance" in readme and "self-distillation" in readme
    card = json.loads((out / "specformer" / "card.json").read_text())
    assert card["extra"]["context_next_token"] and card["extra"]["context_layers"] == 2
    assert card["extra"]["context_init"] == [1, 0] and card["extra"]["context_mlp"]
    assert card["training"]["soft_label_weight"] == 0.5 and card["training"]["max_answer_tokens"] == 24
    assert "0.5 of it against the target's soft labels" in (out / "specformer" / "README.md").read_text()
    from tandem.train.card import model_card

    assert "- **Where**: here" in model_card(dict(card, notes=["**Where**: here"]))  # hand-added provenance notes


@pytest.mark.parametrize("flags,message", [
    (["--context-init-layers", ""], "comma-separated target block indices"),
    (["--context-init-layers", "0,x"], "comma-separated target block indices"),
    (["--context-init-layers", "0,9"], "must be target block indices"),
    (["--context-init-layers", "0,1", "--context-layers", "3"], "3 context layers but 2 context init blocks"),
    (["--context-init-layers", "0,1,0,1,0,1,0,1,0"], "at most 8"),
    (["--taps", ""], "comma-separated integers"),
    (["--taps", "0,0"], "name a depth twice"),
])
def test_cli_rejects_bad_context_init_layers(tiny_checkpoint, distilled, tmp_path, flags, message):
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    res = CliRunner().invoke(main, ["train", "specformer", "--data", str(distilled), "--out", str(tmp_path),
                                    "--model", model, "--device", "cpu", "--max-steps", "1"] + flags)
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_resume_into_a_run_of_other_settings_is_a_clear_error(trained, distilled):
    """Training into an --out whose checkpoint another head (same tensor shapes or not) or another
    loss wrote stops before any step, with a one-line error; a SpecFormer head given as a draft
    model says which drafter it is for."""
    model, out = trained
    for flags, said in ((["--context-init-layers", "0,1"], "head.context_init (1, 0) -> (0, 1)"),
                        (["--context-init-layers", "1,0", "--soft-labels", "0.2"], "soft_label_weight 0.5 -> 0.2"),
                        (["--context-layers", "2"], "head.context_init")):
        res = CliRunner().invoke(main, ["train", "specformer", "--data", str(distilled), "--out", str(out / "specformer"),
                                        "--model", model, "--device", "cpu", "--max-steps", "15", "--lr", "5e-3",
                                        "--batch-tokens", "512", "--bonus-token", "--context-next-token",
                                        "--max-answer-tokens", "24"] + flags)
        assert res.exit_code == 2 and said in res.output and "Traceback" not in res.output, res.output
    res = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--drafter", "draft-model", "--draft-model",
                                    str(out / "specformer"), "--model", model, "--device", "cpu", "--max-tokens", "2"])
    assert res.exit_code == 2 and "is a SpecFormer head" in res.output


def test_init_from_fine_tunes_a_trained_head(trained, distilled, tmp_path):
    """``--init-from`` starts from the trained head's weights (its step-0 held-out loss is the
    trained head's, far below a fresh head's), records where it started in the card, refuses a
    head of another shape in one line, and a resume from other start weights is refused."""
    model, out = trained
    head_flags = ["--bonus-token", "--context-next-token", "--context-init-layers", "1,0", "--soft-labels", "0.5",
                  "--max-answer-tokens", "24"]
    base = ["train", "specformer", "--data", str(distilled), "--model", model, "--device", "cpu",
            "--batch-tokens", "512", "--lr", "1e-3"]
    res = CliRunner().invoke(main, base + ["--out", str(tmp_path / "ft"), "--max-steps", "2", "--init-from",
                                           str(out / "specformer")] + head_flags)
    assert res.exit_code == 0, res.output
    card = json.loads((tmp_path / "ft" / "card.json").read_text())
    assert card["training"]["init_from"] == str(out / "specformer")
    assert f"fine-tuned from `{out / 'specformer'}`" in (tmp_path / "ft" / "README.md").read_text()
    start_sha = card["training"]["init_from_sha256"]
    trained_card = json.loads((out / "specformer" / "card.json").read_text())
    fresh = CliRunner().invoke(main, base + ["--out", str(tmp_path / "fresh"), "--max-steps", "2"] + head_flags)
    assert fresh.exit_code == 0, fresh.output
    fresh_card = json.loads((tmp_path / "fresh" / "card.json").read_text())
    ft_loss, fresh_loss = card["training"]["first_loss"], fresh_card["training"]["first_loss"]
    assert ft_loss < fresh_loss - 0.5 and abs(ft_loss - trained_card["training"]["final_loss"]) < 1.0
    # another head shape: one line, before any step
    res = CliRunner().invoke(main, base + ["--out", str(tmp_path / "bad"), "--max-steps", "2", "--init-from",
                                           str(out / "specformer"), "--context-next-token"])
    assert res.exit_code == 2 and "is another head" in res.output and "context_init" in res.output
    assert "Traceback" not in res.output
    for bad, said in ((str(tmp_path / "missing"), "no SpecFormer head"), (str(out / "draft-model"), "not a SpecFormer head"),
                      ("", "--init-from is empty")):
        res = CliRunner().invoke(main, base + ["--out", str(tmp_path / "bad2"), "--init-from", bad] + head_flags)
        assert res.exit_code == 2 and said in res.output and "Traceback" not in res.output, res.output
    # a resume into the fine-tuned run from other start weights is refused
    res = CliRunner().invoke(main, base + ["--out", str(tmp_path / "ft"), "--max-steps", "2", "--init-from",
                                           str(tmp_path / "fresh")] + head_flags)
    assert res.exit_code == 2 and f"init_from_sha256 {start_sha!r}" in res.output, res.output
    # more draft slots (l_d 4 -> 6) start from the trained head too; fewer are refused
    res = CliRunner().invoke(main, base + ["--out", str(tmp_path / "grown"), "--max-steps", "2", "--num-draft-tokens",
                                           "6", "--init-from", str(out / "specformer")] + head_flags)
    assert res.exit_code == 0, res.output
    grown = json.loads((tmp_path / "grown" / "card.json").read_text())
    assert grown["extra"]["num_draft_tokens"] == 6 and grown["training"]["first_loss"] < fresh_loss - 0.5
    res = CliRunner().invoke(main, base + ["--out", str(tmp_path / "shrunk"), "--max-steps", "2", "--num-draft-tokens",
                                           "2", "--init-from", str(out / "specformer")] + head_flags)
    assert res.exit_code == 2 and "can grow draft slots, not lose them" in res.output


def test_a_grown_head_starts_as_the_trained_one_with_copies_of_its_last_slot(tiny_ck):
    """``load_start`` into a head with two more draft slots: every weight as trained, the new slots'
    ``pos_ffn`` rows copies of the last slot's, so the old slots draft exactly as before and the new
    ones as the last one does."""
    from tandem.train.specformer import load_start, new_head

    start = new_head(tiny_ck.config, 4, seed=1)
    with torch.no_grad():
        for p in start.parameters():
            p.normal_(0, 0.02)
    grown = new_head(tiny_ck.config, 6, seed=2)
    load_start(grown, start)
    d = tiny_ck.config.hidden_size
    w0, w1 = start.pos_ffn.weight, grown.pos_ffn.weight
    assert torch.equal(w1[:4 * d], w0) and torch.equal(w1[4 * d:5 * d], w0[3 * d:]) and torch.equal(w1[5 * d:], w0[3 * d:])
    for name, p in start.state_dict().items():
        if name != "pos_ffn.weight":
            assert torch.equal(grown.state_dict()[name], p), name
    with pytest.raises(ValueError, match="not lose them"):
        load_start(new_head(tiny_ck.config, 2), start)


def test_generate_says_when_k_exceeds_the_heads_draft_slots(trained):
    model, out = trained
    res = CliRunner().invoke(main, ["generate", "--prompt", "Say hello.", "--drafter", "specformer", "--draft-model",
                                    str(out / "specformer"), "--num-draft-tokens", "8", "--model", model,
                                    "--device", "cpu", "--max-tokens", "4"])
    assert res.exit_code == 0, res.output
    assert "drafts 4 tokens a round (l_d); --num-draft-tokens 8 is capped to 4" in res.output
    # --specformer PATH is the same head (and implies --drafter specformer): same note, same text
    same = CliRunner().invoke(main, ["generate", "--prompt", "Say hello.", "--specformer", str(out / "specformer"),
                                     "--num-draft-tokens", "8", "--model", model, "--device", "cpu", "--max-tokens", "4"])
    assert same.exit_code == 0 and same.output == res.output, same.output


def test_generate_writes_a_trace_file_that_splits_rounds(trained, tmp_path):
    """`TANDEM_TRACE_FILE` works for in-process commands too: a SpecFormer run's rounds and their
    verify phase (chained rounds: the head drafts inside it, so there is no separate observe
    phase) in `tandem trace-report`."""
    import os
    import subprocess
    import sys

    model, out = trained
    trace = tmp_path / "spans.jsonl"
    env = dict(os.environ, TANDEM_TRACE_FILE=str(trace))
    run = subprocess.run([sys.executable, "-m", "tandem", "generate", "--prompt", "Count to five.", "--drafter",
                          "specformer", "--draft-model", str(out / "specformer"), "--model", model, "--device", "cpu",
                          "--max-tokens", "8"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    res = CliRunner().invoke(main, ["trace-report", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    phases = json.loads(res.stdout)["phases"]
    assert phases["round"]["count"] > 0 and phases["verify"]["count"] == phases["round"]["count"]
    assert phases.get("observe", {}).get("count", 0) == 0
    bad = subprocess.run([sys.executable, "-m", "tandem", "generate", "--prompt", "hi", "--model", model,
                          "--device", "cpu", "--max-tokens", "2"], env=dict(env, TANDEM_TRACE_FILE=str(tmp_path)),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "tracing settings" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("kind", ["specformer", "draft-model"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_trained_drafters_are_lossless_tiny(trained, tiny_ck, kind, temperature):
    """Greedy: identical to target-only. Sampled (seeded, top_k = 4): every token is one of the
    target's 4 most likely at its position, drafts included (a necessary condition; the
    distribution-level check of speculative sampling, SpecFormer included, is in
    tests/test_speculative.py)."""
    _, out = trained
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    drafter = (SpecFormerDrafter.load(out / kind) if kind == "specformer"
               else DraftModelDrafter(load_draft_checkpoint(str(out / kind), tiny_ck), cfg))
    engine = Engine(tiny_ck, cfg, drafter=drafter, num_draft_tokens=4)
    ref = Engine(tiny_ck, cfg)
    params = SamplingParams(max_tokens=24, temperature=temperature, top_k=4 if temperature else 0, seed=3)
    got = engine.generate(PROMPTS[:6], params)
    if temperature == 0.0:
        assert [c.token_ids for c in got] == [c.token_ids for c in ref.generate(PROMPTS[:6], params)]
    else:
        runner = make_runner(tiny_ck, 1, cfg.max_seq_len)
        for prompt, c in zip(PROMPTS[:6], got):
            assert_in_target_top_k(runner, engine.encode_prompt(prompt), c.token_ids, params.top_k)
    assert all(1 <= len(c.token_ids) <= 24 for c in got)
    assert engine.stats.num_drafted > 0


def test_cli_generate_with_trained_drafters(trained):
    model, out = trained
    for kind in ("specformer", "draft-model"):
        res = CliRunner().invoke(main, ["generate", "--prompt", "Hi", "--model", model, "--device", "cpu",
                                        "--max-tokens", "8", "--drafter", kind, "--draft-model", str(out / kind)])
        assert res.exit_code == 0, res.output
        assert "mean accepted length" in res.output
    res = CliRunner().invoke(main, ["generate", "--prompt", "Hi", "--model", model, "--device", "cpu",
                                    "--drafter", "specformer"])
    assert res.exit_code == 2 and "needs --draft-model" in res.output
    res = CliRunner().invoke(main, ["generate", "--prompt", "Hi", "--model", model, "--device", "cpu",
                                    "--drafter", "specformer", "--draft-model", str(out / "draft-model")])
    assert res.exit_code == 2 and "not a SpecFormer head" in res.output
    res = CliRunner().invoke(main, ["generate", "--prompt", "Hi", "--model", model, "--device", "cpu",
                                    "--drafter", "specformer", "--draft-model", ""])
    assert res.exit_code == 2 and "--draft-model is empty" in res.output
    import os

    mask = os.umask(0)
    os.umask(mask)  # weights get the usual 0666 less the umask (safetensors alone leaves 0600)
    assert all((out / kind / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
               for kind in ("specformer", "draft-model"))


def test_head_for_another_target_is_refused(trained, small_vocab_checkpoint):
    _, out = trained
    engine_ck = load_checkpoint(small_vocab_checkpoint())
    with pytest.raises(ModelLoadError, match="trained for a target"):
        Engine(engine_ck, RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=64),
               drafter=SpecFormerDrafter.load(out / "specformer"))


@pytest.mark.gpu
@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("variant", ["bonus", "next-token", "lookup"])
def test_specformer_cuda_graphs_lossless(tiny_ck, variant, chained):
    """On the GPU the taps come out of captured CUDA graphs and the head's work replays graphs of
    its own (observe and draft on the host-drafted path; its in-round work on the chained path);
    greedy output stays identical, and the drafts (hence the accepted counts) equal those of the
    same head run eagerly."""
    cfg = RunnerConfig(device="cuda", dtype=torch.float32, max_batch_size=4, max_seq_len=128, cuda_graphs=True)
    head = _random_head(tiny_ck.config, **VARIANTS[variant])
    drafter = SpecFormerDrafter(head)
    engine = Engine(tiny_ck, cfg, drafter=drafter, num_draft_tokens=4)
    eager = SpecFormerDrafter(_random_head(tiny_ck.config, **VARIANTS[variant]))
    eager_engine = Engine(tiny_ck, cfg, drafter=eager, num_draft_tokens=4)
    eager._static = False
    if not chained:
        engine.target.chains_rounds = eager_engine.target.chains_rounds = False
    assert engine.chains_rounds is chained and eager_engine.chains_rounds is chained
    ref = Engine(tiny_ck, cfg)
    params = SamplingParams(max_tokens=24)
    got, want = engine.generate(PROMPTS[:6], params), ref.generate(PROMPTS[:6], params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert engine.stats.num_drafted > 0
    # chained: the rounds' graphs plus the prompts' observe graphs and the first drafts' (admission);
    # host-drafted: observe and draft
    assert {k[0] for k in drafter._captured} == ({"chained", "observe", "prime"} if chained else {"observe", "draft"})
    eager_engine.generate(PROMPTS[:6], params)
    assert (eager_engine.stats.num_drafted, eager_engine.stats.num_accepted) == \
        (engine.stats.num_drafted, engine.stats.num_accepted)


SMOLLM2_PARAMS = SamplingParams(max_tokens=32)


@pytest.fixture(scope="module")
def smollm2_target_only(real_engine) -> list[list[int]]:
    """Target-only greedy tokens of the first three Spec-Bench prompts on the bundled model (the
    session engine, no drafter)."""
    assert real_engine.drafter is None
    return [c.token_ids for c in real_engine.generate(spec_bench_prompts(3), SMOLLM2_PARAMS)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["specformer", "draft-model"])
def test_shipped_drafters_lossless_on_smollm2(real_checkpoint, real_engine, on_real_target, smollm2_target_only,
                                             kind):
    """The shipped drafters load by default with the bundled target, draft, and leave greedy output
    identical to target-only decoding."""
    from tandem.drafters.factory import build_drafter

    cfg = real_engine.runner_config
    drafter = build_drafter(kind, None, real_checkpoint, cfg)
    if drafter.target_taps:  # SpecFormer reads the target's hidden states: a target that taps them
        engine = Engine(real_checkpoint, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=512),
                        drafter=drafter, num_draft_tokens=4)
    else:  # a draft model drafts from tokens alone: the session engine's target
        engine = on_real_target(drafter, num_draft_tokens=4)
    got = engine.generate(spec_bench_prompts(3), SMOLLM2_PARAMS)
    assert [c.token_ids for c in got] == smollm2_target_only
    assert engine.stats.num_drafted > 0 and engine.stats.num_accepted > 0


def test_predictor_next_to_its_drafter(trained, tmp_path):
    """Logs from the trained draft model train a predictor saved beside its weights, which
    `--predictor auto` then finds; a drafter without one gets a clear error."""
    model, out = trained
    draft = str(out / "draft-model")
    prompts = tmp_path / "p.jsonl"
    long_prompt = "tell me more " * 200  # longer than the context: skipped, the rest still collected
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in [long_prompt] + PROMPTS))
    runner = CliRunner()
    res = runner.invoke(main, ["collect-logs", "--prompts", str(prompts), "--limit", "7", "--out", str(tmp_path / "l.npz"),
                               "--model", model, "--device", "cpu", "--drafter", "draft-model", "--draft-model", draft,
                               "--max-tokens", "24", "--max-seq-len", "256"])
    assert res.exit_code == 0, res.output
    assert "from 6 prompts" in res.output
    res = runner.invoke(main, ["generate", "--prompt", "Hi", "--model", model, "--device", "cpu", "--max-tokens", "8",
                               "--drafter", "draft-model", "--draft-model", draft, "--predictor", "auto"])
    assert res.exit_code == 2 and "no predictor.safetensors" in res.output
    res = runner.invoke(main, ["train", "predictor", "--logs", str(tmp_path / "l.npz"), "--out",
                               f"{draft}/predictor.safetensors", "--epochs", "5"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["generate", "--prompt", "Hi", "--model", model, "--device", "cpu", "--max-tokens", "8",
                               "--drafter", "draft-model", "--draft-model", draft, "--predictor", "auto"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("kind", ["specformer", "draft-model", "ngram"])
@pytest.mark.parametrize("k", [4, 3])
def test_replay_equals_engine_counters(trained, tiny_ck, kind, k, monkeypatch):
    """The teacher-forced replay (tandem.bench.replay) gives every request exactly the engine's
    speculative decoding counters (float32): drafted, accepted and emitted per round position.
    The drafts' LM head runs in chunks of 7 rows here (the CPU memory cap on the logits)."""
    from tandem.bench import replay as replay_mod
    from tandem.bench.replay import draft_model_drafts, record_traces, specformer_drafts, token_drafter_drafts, walk
    from tandem.drafters import NgramDrafter

    monkeypatch.setattr(replay_mod, "CPU_LOGITS_BYTES", tiny_ck.config.vocab_size * 6 * 7)

    _, out = trained
    cfg = RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    records = [PromptRecord(str(i), "c", p) for i, p in enumerate(PROMPTS)]
    traces = record_traces(Engine(tiny_ck, cfg), records, max_tokens=24)
    if kind == "specformer":
        drafter = SpecFormerDrafter.load(out / kind)
        target = Transformer(tiny_ck.config, 256)
        target.load_weights(tiny_ck.tensors)
        drafts = specformer_drafts(load_specformer(out / kind), target.eval(), traces)
        top = specformer_drafts(load_specformer(out / kind), target.eval(), traces, top_m=3)  # --branch-ceiling's
        assert all(d.shape == t.shape[:2] and (t[..., 0] == d).all() and (t[..., 1] != d).all()
                   for d, t in zip(drafts, top))  # its first column is the chain's argmax, the others differ
    elif kind == "ngram":
        drafter = NgramDrafter()
        drafts = token_drafter_drafts(NgramDrafter(), traces)
    else:
        draft_ck = load_draft_checkpoint(str(out / kind), tiny_ck)
        drafter = DraftModelDrafter(draft_ck, cfg)
        draft = Transformer(draft_ck.config, 256)
        draft.load_weights(draft_ck.tensors)
        drafts = draft_model_drafts(draft.eval(), traces, k)
    engine = Engine(tiny_ck, cfg, drafter=drafter, num_draft_tokens=k)
    done = engine.generate([r.text for r in records], SamplingParams(max_tokens=24))
    assert [c.token_ids for c in done] == [t.output_ids for t in traces]
    accepted = 0
    for c, t, d in zip(done, traces, drafts):
        got = walk(t, d, k)
        assert json.dumps(got.to_dict(), sort_keys=True) == json.dumps(c.spec.to_dict(), sort_keys=True)  # NaN-safe
        accepted += got.num_accepted
    assert accepted > 0


def test_training_stops_cleanly_on_sigterm(distilled, tmp_path):
    """SIGTERM (a scheduler's time limit) ends training after the current step with a checkpoint;
    the same call resumes from it, runs to the planned step count and reports the whole run."""
    import os
    import signal

    _, seqs = read_distilled(distilled)
    module = torch.nn.Linear(4, 1)
    calls = []

    def loss_fn(batch):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return module(torch.ones(len(batch), 4)).pow(2).mean(), {}

    cfg = TrainConfig(max_steps=8, max_batch_tokens=64, checkpoint_every=100)
    first = train(module, loss_fn, seqs, cfg, tmp_path, progress=False)
    assert (first.steps, first.planned_steps) == (3, 8)
    assert (tmp_path / "checkpoint.pt").is_file()
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back
    second = train(module, loss_fn, seqs, cfg, tmp_path, progress=False)
    assert (second.steps, second.planned_steps) == (8, 8)
    # the resumed run reports the whole run: its first step's loss and both runs' training time
    assert second.first_loss == first.first_loss and second.wall_s >= first.wall_s


def test_resume_refuses_other_settings_and_reports_a_finished_run_again(distilled, tmp_path):
    """A checkpoint resumes only under the settings that wrote it (data cut, batches, schedule,
    loss options); resuming a finished run does no step and reports the same metrics."""
    _, seqs = read_distilled(distilled)
    module = torch.nn.Linear(4, 1)

    def loss_fn(batch):
        return module(torch.ones(len(batch), 4)).pow(2).mean(), {"m": 1.0}

    cfg = TrainConfig(max_steps=6, max_batch_tokens=64, checkpoint_every=100, val_fraction=0.0)
    done = train(module, loss_fn, seqs, cfg, tmp_path, progress=False, settings={"soft_label_weight": 0.5})
    again = train(module, loss_fn, seqs, cfg, tmp_path, progress=False, settings={"soft_label_weight": 0.5})
    assert again.steps == 6 and again.metrics == done.metrics == {"m": 1.0}
    assert again.wall_s == done.wall_s  # it trained nothing, so it adds no training time
    from dataclasses import replace

    for other, settings, said in ((replace(cfg, max_answer_tokens=8), {"soft_label_weight": 0.5}, "max_answer_tokens"),
                                  (replace(cfg, max_steps=9), {"soft_label_weight": 0.5}, "planned steps 6 -> 9"),
                                  (cfg, {"soft_label_weight": 0.0}, "soft_label_weight 0.5 -> 0.0")):
        with pytest.raises(ValueError, match=said):
            train(module, loss_fn, seqs, other, tmp_path, progress=False, settings=settings)
    assert train(module, loss_fn, seqs, replace(cfg, max_steps=9), tmp_path, resume=False, progress=False).steps == 9
    (tmp_path / "checkpoint.pt").write_bytes(b"hi")
    with pytest.raises(ValueError, match="cannot be read"):
        train(module, loss_fn, seqs, cfg, tmp_path, progress=False)


def test_training_keeps_the_best_held_out_step(distilled, tmp_path):
    """A seeded share of the answers is held out; the module ends with the parameters of the step
    whose held-out loss was lowest, even when later steps are worse (here: lr pushes past the optimum)."""
    from tandem.train.loop import evaluate, split_validation

    _, seqs = read_distilled(distilled)
    cfg = TrainConfig(max_steps=12, max_batch_tokens=64, checkpoint_every=2, val_fraction=0.3, lr=0.5, warmup_frac=0.0)
    train_part, val_part = split_validation(seqs, cfg)
    assert len(val_part) == 3 and len(train_part) == 7
    assert not {id(s) for s in val_part} & {id(s) for s in train_part}
    module = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(3.0)

    def loss_fn(batch):  # minimum at w = 1; lr 0.5 with AdamW overshoots and oscillates
        return (module(torch.ones(1, 1)) - 1.0).pow(2).mean(), {"w": float(module.weight.detach())}

    result = train(module, loss_fn, seqs, cfg, tmp_path, progress=False)
    val = result.validation
    assert val["sequences"] == 3 and val["best_step"] % 2 == 0
    assert evaluate(module, loss_fn, val_part, cfg)["loss"] == pytest.approx(val["loss"])


def test_collect_logs_records_the_heads_states(trained, tmp_path):
    """`collect-logs --states` with a SpecFormer head records, beside each labelled position's
    features, the head's normed draft-slot state (the target's hidden size), the predictor trains
    on them with --state-projection and reports the features-only AUC beside its own; a drafter
    with no states, or logs without them, is a clear error."""
    model, out = trained
    head = str(out / "specformer")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    runner = CliRunner()
    logs = tmp_path / "l.npz"
    base = ["collect-logs", "--prompts", str(prompts), "--limit", "10", "--model", model, "--device", "cpu",
            "--max-tokens", "24", "--max-seq-len", "256"]
    res = runner.invoke(main, base + ["--out", str(logs), "--drafter", "specformer", "--draft-model", head, "--states"])
    assert res.exit_code == 0, res.output
    data = np.load(logs)
    hidden = load_checkpoint(model).config.hidden_size
    assert data["states"].shape == (len(data["labels"]), hidden) and data["states"].dtype == np.float16
    assert np.isfinite(data["states"]).all() and data["states"].std() > 0
    res = runner.invoke(main, ["train", "predictor", "--logs", str(logs), "--out", str(tmp_path / "p.safetensors"),
                               "--epochs", "3", "--state-projection", "4"])
    assert res.exit_code == 0, res.output
    assert "features only" in res.output
    report = json.loads((tmp_path / "p.safetensors.json").read_text())
    assert 0.0 <= report["features_only_auc"] <= 1.0
    res = runner.invoke(main, base + ["--out", str(tmp_path / "n.npz"), "--drafter", "ngram", "--states"])
    assert res.exit_code == 2 and "the ngram drafter has none to record" in res.output
    res = runner.invoke(main, base + ["--out", str(tmp_path / "plain.npz"), "--drafter", "specformer",
                                      "--draft-model", head])
    assert res.exit_code == 0, res.output
    assert "states" not in np.load(tmp_path / "plain.npz").files
    res = runner.invoke(main, ["train", "predictor", "--logs", str(tmp_path / "plain.npz"), "--out",
                               str(tmp_path / "q.safetensors"), "--state-projection", "4"])
    assert res.exit_code == 2 and "collect-logs --states" in res.output


@pytest.mark.slow
@pytest.mark.parametrize("slots", [6, 8])
def test_the_shipped_longer_heads_draft_all_slots_and_are_lossless(real_engine, slots):
    """The shipped l_d = 6 and l_d = 8 heads (``specformer-smollm2-135m-ld6``, fine-tuned from the
    l_d = 4 one; ``-ld8``, from the l_d = 6 one) load with their draft slots; over the bundled
    target at k = l_d their greedy output equals target-only's, and they draft, and have drafts
    accepted, at their last two positions."""
    from tandem.drafters.specformer import WEIGHTS_DIR
    from tandem.speculation import SpeculativeConfig, build_engine

    path = WEIGHTS_DIR / f"specformer-smollm2-135m-ld{slots}"
    assert SpecFormerDrafter.load(path).head.config.num_draft_tokens == slots
    engine = build_engine(SpeculativeConfig(drafter="specformer", draft_model=str(path), num_draft_tokens=slots),
                          share=real_engine)
    prompts = ["Count from 1 to 40, separated by commas.", "Write the English alphabet in capital letters, separated "
               "by spaces, twice."]
    params = SamplingParams(max_tokens=48)
    want = [c.token_ids for c in real_engine.generate(prompts, params)]
    got = engine.generate(prompts, params)
    assert [c.token_ids for c in got] == want
    drafted = [sum(c.spec.drafted_per_pos[i] for c in got) for i in range(slots)]
    accepted = [sum(c.spec.accepted_per_pos[i] for c in got) for i in range(slots)]
    assert drafted[-1] > 0 and accepted[-2] > 0 and accepted[-1] > 0, (drafted, accepted)


def test_branch_ceiling_rules():
    """``branch_ceiling`` over a hand-made trace whose drafts miss at slot 2 with the right token
    second: the chain accepts one draft a round, a sibling at the first miss (and any top-2 path)
    accepts all four; its chain rule is ``walk``'s count over the top-1 drafts, round for round."""
    import numpy as np

    from tandem.bench.replay import GreedyTrace, branch_ceiling, walk

    trace = GreedyTrace("c", [1, 2, 3], list(range(10, 40)), 30)
    x = trace.tokens
    T, k = len(x), 4
    drafts = np.zeros((T, k, 2), dtype=np.int64)
    for p in range(T):
        for j in range(k):
            want = x[p + 2 + j] if p + 2 + j < T else 0
            drafts[p, j] = [99, want] if j == 1 else [want, 98]
    got = branch_ceiling([trace], [drafts], k)
    assert json.dumps(got["chain"], sort_keys=True) == json.dumps(walk(trace, drafts[..., 0], k).to_dict(), sort_keys=True)
    assert got["chain"]["acceptance_per_pos"][:2] == [1.0, 0.0]
    for rule in ("branch-at-cut", "any-top-m"):
        assert got[rule]["num_emitted"] == len(trace.output_ids) - 1  # the first comes from the prefill
        assert got[rule]["mean_accepted_length"] > 4 > 2 >= got["chain"]["mean_accepted_length"]
    drafts[:, 2, :] = 97  # slot 3 wrong in both candidates: a sibling at the miss now adds one token
    got = branch_ceiling([trace], [drafts], k)
    assert got["chain"]["num_accepted"] < got["branch-at-cut"]["num_accepted"] == got["any-top-m"]["num_accepted"]
    assert got["branch-at-cut"]["acceptance_per_pos"][:3] == [1.0, 1.0, 0.0]
