"""Static per-slot KV cache: ragged appends, O(1) truncation (rollback), slot reuse, errors."""

from __future__ import annotations

import pytest
import torch
from helpers import make_runner, our_logits

from tandem.models import CacheFullError, KVCache, load_checkpoint
from tandem.models.runner import ModelRunner, RunnerConfig
from tandem.models.kernels import MAX_FUSED_TOKENS
from tandem.models.kv_cache import KV_SLACK

ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint(request.param))


class Tokens:
    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()


def _check_rows(logits: torch.Tensor, appended: dict[int, list[int]], seqs: dict[int, list[int]], ref_runner) -> None:
    """Each slot's logits for the tokens it just appended == a fresh run of its whole sequence."""
    for slot, toks in appended.items():
        ref = our_logits(ref_runner, seqs[slot])[-len(toks):]
        torch.testing.assert_close(logits[slot, :len(toks)], ref, atol=ATOL, rtol=0,
                                   msg=lambda m, s=slot: f"slot {s}: {m}")


def test_ragged_append_truncate_append(tiny):
    rand = Tokens(tiny.config.vocab_size)
    runner = make_runner(tiny, slots=4, max_seq_len=48)
    ref = make_runner(tiny, slots=1, max_seq_len=48)
    seqs = {0: rand(5), 1: rand(9), 2: rand(3), 3: rand(12)}
    for s in range(4):
        assert runner.cache.allocate() == s
        runner.prefill({s: seqs[s]})

    # one step, a different number of tokens per slot; slot 2 sits idle inside the batch
    appended = {0: rand(4), 1: rand(1), 3: rand(6)}
    logits = runner.step(appended).logits.clone()
    assert logits.shape == (4, 6, tiny.config.vocab_size)
    for s, toks in appended.items():
        seqs[s] += toks
    _check_rows(logits, appended, seqs, ref)
    assert runner.cache.lengths == [len(seqs[s]) for s in range(4)]

    # roll back (rejected drafts) by different amounts, then append different tokens
    for slot, keep in {0: len(seqs[0]) - 3, 1: 2, 3: 12}.items():
        runner.cache.truncate(slot, keep)
        seqs[slot] = seqs[slot][:keep]
    appended = {0: rand(2), 1: rand(5), 2: rand(4), 3: rand(1)}
    logits = runner.step(appended).logits.clone()
    for s, toks in appended.items():
        seqs[s] += toks
    _check_rows(logits, appended, seqs, ref)

    # plain decoding afterwards still sees exactly the final sequences
    for _ in range(3):
        appended = {s: rand(1) for s in range(4)}
        logits = runner.step(appended).logits.clone()
        for s, toks in appended.items():
            seqs[s] += toks
        _check_rows(logits, appended, seqs, ref)
    assert runner.cache.lengths == [len(seqs[s]) for s in range(4)]


def test_truncate_to_zero_and_refill(tiny):
    rand = Tokens(tiny.config.vocab_size, seed=1)
    runner = make_runner(tiny, slots=2, max_seq_len=32)
    ref = make_runner(tiny, slots=1, max_seq_len=32)
    a, b = runner.cache.allocate(), runner.cache.allocate()
    runner.prefill({a: rand(20)})
    runner.prefill({b: rand(7)})
    runner.cache.truncate(a, 0)
    new = rand(4)
    logits = runner.step({a: new, b: rand(2)}).logits.clone()
    torch.testing.assert_close(logits[a, :4], our_logits(ref, new), atol=ATOL, rtol=0)


def test_freed_slot_reused_without_stale_state(tiny):
    rand = Tokens(tiny.config.vocab_size, seed=2)
    runner = make_runner(tiny, slots=3, max_seq_len=40)
    ref = make_runner(tiny, slots=1, max_seq_len=40)
    for s in range(3):
        runner.prefill({runner.cache.allocate(): rand(30)})
    runner.cache.free(1)
    assert runner.cache.allocate() == 1 and runner.cache.lengths[1] == 0
    prompt = rand(6)
    last = runner.prefill({1: prompt})[0]
    torch.testing.assert_close(last, our_logits(ref, prompt)[-1], atol=ATOL, rtol=0)
    nxt = rand(3)
    logits = runner.step({0: rand(1), 1: nxt, 2: rand(1)}).logits.clone()
    torch.testing.assert_close(logits[1, :3], our_logits(ref, prompt + nxt)[-3:], atol=ATOL, rtol=0)


def test_prefill_appends_to_partly_filled_slot(tiny):
    rand = Tokens(tiny.config.vocab_size, seed=3)
    runner = ModelRunner(tiny, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, prefill_chunk=4))
    ref = make_runner(tiny, slots=1, max_seq_len=32)
    slot = runner.cache.allocate()
    first, second = rand(9), rand(6)
    runner.prefill({slot: first})
    last = runner.prefill({slot: second})[0]
    assert runner.cache.lengths[slot] == 15
    torch.testing.assert_close(last, our_logits(ref, first + second)[-1], atol=ATOL, rtol=0)


def test_prefill_appends_to_scattered_partly_filled_slots(tiny):
    """Scattered slots that already hold tokens (a drafter catching up) get their next pieces in
    one batch: each row continues from its own length, the slot between them is untouched."""
    rand = Tokens(tiny.config.vocab_size, seed=4)
    runner = ModelRunner(tiny, RunnerConfig(device="cpu", max_batch_size=3, max_seq_len=40, prefill_chunk=4))
    ref = make_runner(tiny, slots=1, max_seq_len=40)
    for _ in range(3):
        runner.cache.allocate()
    seqs = {0: rand(7), 1: rand(5), 2: rand(12)}
    runner.prefill(seqs)
    more = {0: rand(9), 2: rand(3)}
    last = runner.prefill(more)
    assert runner.cache.lengths == [16, 5, 15]
    for row, slot in enumerate(sorted(more)):
        seqs[slot] = seqs[slot] + more[slot]
        torch.testing.assert_close(last[row], our_logits(ref, seqs[slot])[-1], atol=ATOL, rtol=0)
    appended = {s: rand(2) for s in range(3)}
    out = runner.step(appended)
    for s, toks in appended.items():
        seqs[s] += toks
    _check_rows(out.logits, appended, seqs, ref)


@pytest.mark.parametrize("chunk,budget", [(1024, 8192), (4, 12), (5, 1)], ids=["one-forward", "grouped-chunked", "row-by-row"])
def test_batched_prefill_ragged_prompts(tiny, chunk, budget):
    """Several prompts of different lengths prefilled together (grouped, chunked; the scattered
    slots 0, 1, 3, 4 run on a dense copy of their rows), with a running slot between them that
    must stay untouched."""
    rand = Tokens(tiny.config.vocab_size, seed=6)
    runner = ModelRunner(tiny, RunnerConfig(device="cpu", max_batch_size=5, max_seq_len=40, prefill_chunk=chunk,
                                            prefill_tokens=budget))
    ref = make_runner(tiny, slots=1, max_seq_len=40)
    for _ in range(5):
        runner.cache.allocate()
    seqs = {2: rand(11)}
    runner.prefill({2: seqs[2]})  # a running request in the middle of the range
    prompts = {4: rand(1), 0: rand(9), 3: rand(14), 1: rand(3)}
    last = runner.prefill(prompts)
    assert last.shape == (4, tiny.config.vocab_size)
    for row, slot in enumerate(sorted(prompts)):  # ascending slot order
        torch.testing.assert_close(last[row], our_logits(ref, prompts[slot])[-1], atol=ATOL, rtol=0)
        seqs[slot] = list(prompts[slot])
    assert runner.cache.lengths == [9, 3, 11, 14, 1]
    appended = {s: rand(1 + s % 2) for s in range(5)}
    out = runner.step(appended)
    for s, toks in appended.items():
        seqs[s] += toks
    _check_rows(out.logits, appended, seqs, ref)
    assert torch.equal(out.argmax, out.logits.argmax(-1))


def test_prefill_errors_leave_cache_untouched(tiny):
    rand = Tokens(tiny.config.vocab_size, seed=7)
    runner = make_runner(tiny, slots=3, max_seq_len=16)
    for _ in range(3):
        runner.cache.allocate()
    with pytest.raises(ValueError, match="empty prompt"):
        runner.prefill({0: rand(3), 1: []})
    with pytest.raises(CacheFullError, match="slot 2"):
        runner.prefill({0: rand(3), 1: rand(16), 2: rand(17)})
    assert runner.cache.lengths == [0, 0, 0]


# ----------------------------------------------------------------------------- capacity


def test_cache_full_on_step_and_prefill(tiny):
    rand = Tokens(tiny.config.vocab_size, seed=4)
    runner = make_runner(tiny, slots=2, max_seq_len=16)
    a, b = runner.cache.allocate(), runner.cache.allocate()
    with pytest.raises(CacheFullError, match="capacity 16"):
        runner.prefill({a: rand(17)})
    assert runner.cache.lengths[a] == 0
    runner.prefill({a: rand(14)})
    runner.prefill({b: rand(3)})
    with pytest.raises(CacheFullError, match="slot 0"):
        runner.step({b: rand(1), a: rand(3)})
    assert runner.cache.lengths == [14, 3]  # nothing was appended anywhere
    runner.step({a: rand(2), b: rand(1)})  # exactly to capacity is fine
    assert runner.cache.lengths == [16, 4]
    with pytest.raises(CacheFullError):
        runner.step({a: rand(1)})


def test_step_argument_errors(tiny):
    runner = make_runner(tiny, slots=2, max_seq_len=16)
    runner.cache.allocate()
    with pytest.raises(ValueError, match="at least one slot"):
        runner.step({})
    with pytest.raises(ValueError, match="no tokens"):
        runner.step({0: []})


# ----------------------------------------------------------------------------- KVCache unit


def test_kv_cache_layout(tiny):
    c = tiny.config
    cache = KVCache(c, num_slots=3, capacity=10)
    assert cache.k.shape == (c.num_layers, 3, c.num_kv_heads, 10 + KV_SLACK, c.head_dim)
    assert cache.v.shape == cache.k.shape
    assert cache.scratch_index == 10 + KV_SLACK - 1 and KV_SLACK >= MAX_FUSED_TOKENS
    assert cache.nbytes() == 2 * cache.k.numel() * 4
    assert cache.lengths == [0, 0, 0] and cache.num_free() == 3


def test_kv_cache_allocate_free_truncate(tiny):
    cache = KVCache(tiny.config, num_slots=3, capacity=10)
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    assert cache.num_free() == 0
    with pytest.raises(CacheFullError, match="no free"):
        cache.allocate()
    cache.lengths[2] = 7
    cache.free(2)
    cache.free(0)
    assert cache.allocate() == 0  # lowest free slot first
    assert cache.allocate() == 2 and cache.lengths[2] == 0  # a reused slot starts empty
    cache.free(1)
    with pytest.raises(ValueError, match="already free"):
        cache.free(1)

    cache.lengths[0] = 5
    cache.truncate(0, 5)
    cache.truncate(0, 2)
    assert cache.lengths[0] == 2
    with pytest.raises(ValueError, match="holding 2"):
        cache.truncate(0, 3)  # cannot grow by truncating
    with pytest.raises(ValueError):
        cache.truncate(0, -1)
    cache.truncate(0, 0)
    assert cache.lengths[0] == 0


def test_kv_cache_check_room(tiny):
    cache = KVCache(tiny.config, num_slots=1, capacity=10)
    slot = cache.allocate()
    cache.lengths[slot] = 8
    cache.check_room(slot, 2)
    with pytest.raises(CacheFullError, match="holds 8 tokens; 3 more exceed the capacity 10"):
        cache.check_room(slot, 3)


@pytest.mark.parametrize("slots,capacity", [(0, 10), (2, 1)])
def test_kv_cache_bad_sizes(tiny, slots, capacity):
    with pytest.raises(ValueError):
        KVCache(tiny.config, num_slots=slots, capacity=capacity)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "graphs+compile"])
def test_cuda_graph_ragged_steps_match_cpu(tiny, compile):
    """The CUDA-graph decode path (bucketed batch and context) == CPU eager, ragged steps and
    rollback included."""
    rand = Tokens(tiny.config.vocab_size, seed=5)
    gpu = ModelRunner(tiny, RunnerConfig(device="cuda", dtype=torch.float32, max_batch_size=4, max_seq_len=64,
                                         cuda_graphs=True, compile=compile))
    cpu = make_runner(tiny, slots=4, max_seq_len=64)
    seqs = {s: rand(n) for s, n in zip(range(3), (5, 11, 2))}
    for r in (gpu, cpu):
        for s in range(3):
            r.cache.allocate()
            r.prefill({s: seqs[s]})
    for step, app in enumerate([{0: rand(3), 1: rand(1), 2: rand(2)}, {1: rand(4)}, {0: rand(1), 2: rand(1)}]):
        if step == 1:
            for r in (gpu, cpu):
                r.cache.truncate(1, 8)
        got = gpu.step(app).logits.float().cpu()
        want = cpu.step(app).logits
        for s, toks in app.items():
            torch.testing.assert_close(got[s, :len(toks)], want[s, :len(toks)], atol=1e-3, rtol=0)


# ----------------------------------------------------------------------------- torch.compile (Dynamo on CPU)


@pytest.mark.parametrize("taps", [(), (0, 1, 2)], ids=["no-taps", "taps"])
def test_compiled_forward_one_graph_for_every_draft_length(tiny, taps):
    """The batch-1 forward that ``RunnerConfig.compile`` compiles (``dynamic=True, fullgraph=True``)
    traces once for q = 1 and once for every q > 1 and every context (no recompile per draft
    length: on the H200 each one cost ~30 s), and returns the same logits and tapped hidden
    states as the uncompiled forward. Dynamo runs here with a graph-counting backend, so the test
    needs no C++ / Triton toolchain. A tap set once vanished from the compiled graph (``int in
    tuple`` of symbolic ints is False under Dynamo), which broke SpecFormer under compile."""
    import torch._dynamo

    torch._dynamo.reset()
    runner = ModelRunner(tiny, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=128, taps=taps))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(runner._forward_logits, backend=backend, dynamic=True, fullgraph=True)
    k, v = runner.cache.k[:, :1], runner.cache.v[:, :1]
    rand = Tokens(tiny.config.vocab_size, seed=9)
    with torch.inference_mode():
        for attn_len in (64, 128):
            for q in range(1, 6):
                packed = torch.tensor([[3, q] + rand(q)])
                got, want = compiled(packed, k, v, attn_len, q), runner._forward_logits(packed, k, v, attn_len, q)
                torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
                if taps:
                    assert got.taps is not None and got.taps.shape == (1, q, len(taps), tiny.config.hidden_size)
                    torch.testing.assert_close(got.taps, want.taps, atol=ATOL, rtol=0)
                else:
                    assert got.taps is None
    assert len(graphs) == 2, f"{len(graphs)} traces for q = 1..5 at two contexts"


def test_padded_rows_pads_after_the_extra_columns():
    """``padded_rows``: zero columns first, then each row left-aligned and zero-padded; a row
    wider than the width is an error, not a silent cut."""
    from tandem.models.kv_cache import padded_rows

    t = padded_rows([[5, 6], [], [7, 8, 9]], 3, extra=1)
    assert t.dtype == torch.int64 and t.tolist() == [[0, 5, 6, 0], [0, 0, 0, 0], [0, 7, 8, 9]]
    assert padded_rows([], 4).shape == (0, 4)
    with pytest.raises(ValueError, match="4 ints in 3 columns"):
        padded_rows([[1, 2, 3, 4]], 3)
