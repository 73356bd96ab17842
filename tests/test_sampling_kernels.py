"""A sampled round's Triton kernels (``tandem.sampling_kernels``) against the PyTorch ops they
stand for: counter-based uniforms bit for bit.

Each comparison runs on a GPU (marked ``gpu``) and, where Triton is installed, on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, which the tests' conftest turns on without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tandem import residual_kernel, sampling, sampling_kernels
from tandem.verify import stop_weights
from tandem.sampling import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE


def _plain_uniform(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """``sampling.counter_uniform`` in its PyTorch ops, whatever the device."""
    shape = (-1,) + (1,) * (position.dim() - 1)
    lo = (seed & sampling._MASK32).view(shape)
    hi = ((seed >> 32) & sampling._MASK32).view(shape)
    key = sampling._hash32(sampling._hash32(lo ^ sampling_kernels.stream_key(stream)) ^ hi)
    return (sampling._hash32(key ^ (position & sampling._MASK32)) >> 8).to(torch.float32) * (1.0 / (1 << 24))


@pytest.mark.parametrize("stream", [STREAM_ACCEPT, STREAM_SAMPLE, STREAM_DRAFT])
def test_counter_uniform_kernel_is_the_plain_ops(triton_device, stream):
    """Seeds over the whole range (both 32-bit halves, 0 and 2**63 - 1), positions up to 2**32 - 1,
    shapes [B] and [B, K] (a strided view too), and the result lands where the ops' does."""
    g = torch.Generator().manual_seed(stream)
    seed = torch.cat([torch.tensor([0, 1, 2**32 - 1, 2**32, 2**63 - 1]),
                      torch.randint(0, 2**62, (6,), generator=g) * 2 + torch.randint(0, 2, (6,), generator=g)])
    B = seed.shape[0]
    pos_1d = torch.cat([torch.tensor([0, 1, 2**31, 2**32 - 1]), torch.randint(0, 2**32, (B - 4,), generator=g)])
    pos_2d = torch.randint(0, 2**32, (B, 7), generator=g)
    for pos in (pos_1d, pos_2d, pos_2d[:, ::2], pos_2d[:, :1] + torch.arange(5)[None, :]):
        want = _plain_uniform(seed, pos, stream)
        got = sampling_kernels.counter_uniform(seed.to(triton_device), pos.to(triton_device), stream)
        assert got.shape == pos.shape and got.dtype == torch.float32
        assert torch.equal(got.cpu(), want), (stream, pos.shape)
    assert ((want >= 0) & (want < 1)).all()


def test_counter_uniform_takes_the_kernel_on_cuda_only(monkeypatch):
    """``sampling.counter_uniform`` launches the kernel where a round's kernels run (CUDA), for one
    stream at a time; a tensor of streams, and every CPU, keep the ops (whose numbers it equals)."""
    calls = []
    monkeypatch.setattr(sampling_kernels, "counter_uniform", lambda *a: calls.append(a) or torch.zeros(a[1].shape))
    seed, pos = torch.tensor([3, 4]), torch.tensor([[5, 6], [7, 8]])
    want = _plain_uniform(seed, pos, STREAM_SAMPLE)
    assert torch.equal(sampling.counter_uniform(seed, pos, STREAM_SAMPLE), want) and not calls
    monkeypatch.setattr(sampling, "round_kernels_on", lambda device: True)
    sampling.counter_uniform(seed, pos, STREAM_SAMPLE)
    assert len(calls) == 1 and calls[0][2] == STREAM_SAMPLE
    streams = torch.arange(2)[:, None]
    assert sampling.counter_uniform(torch.tensor([3]), torch.tensor([5, 6])[None, :], streams).shape == (2, 2)
    assert len(calls) == 1  # several streams at once: the ops


def test_counter_uniform_kernel_refuses_a_row_count_it_cannot_read():
    with pytest.raises(ValueError, match="needs seed's"):
        sampling_kernels.counter_uniform(torch.tensor([1, 2]), torch.tensor([[1, 2, 3]]), STREAM_SAMPLE)


def _rows(g: torch.Generator, B: int, V: int) -> torch.Tensor:
    """Logits rows of several shapes: peaked, flat, with ties (rounded), and a row with -inf."""
    x = torch.randn(B, V, generator=g) * torch.linspace(0.5, 6.0, B)[:, None]
    x[1] = (x[1] * 2).round() / 2  # many exact ties
    x[2, : V // 3] = float("-inf")  # tokens banned outright
    return x


@pytest.mark.parametrize("chunk", [512, 4096], ids=["chunks", "one-program"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sampling_probs_kernel_keeps_the_ops_cut(triton_device, dtype, chunk, monkeypatch):
    """Temperature, top-k and top-p, alone and together, in rows of every kind: the kernel keeps
    exactly the tokens the PyTorch ops keep (ties with the cut included), with probabilities
    within rounding, rows summing to 1. A vocabulary over three chunks (one program each, a
    launch a pass), and in one chunk (one program a row does it all); a ragged end; a chunk's
    worth of -inf logits (a masked range) in one row."""
    if dtype == torch.bfloat16 and triton_device.type == "cpu":
        pytest.skip("Triton's interpreter has no bfloat16 (NumPy)")
    monkeypatch.setattr(sampling_kernels, "CHUNK", chunk)
    g = torch.Generator().manual_seed(1)
    B, V = 8, 1024 + 333
    logits = _rows(g, B, V).to(dtype)
    logits[5, 512:1024] = float("-inf")
    temp = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0, 1.0, 0.9, 1.0])
    cases = {
        "temperature": (torch.zeros(B, dtype=torch.long), torch.ones(B)),
        "top-k": (torch.tensor([1, 5, 40, 1000, V, V + 5, 0, 2]), torch.ones(B)),
        "top-p": (torch.zeros(B, dtype=torch.long), torch.tensor([0.9, 0.5, 0.95, 1e-9, 0.99, 0.3, 1.0, 0.8])),
        "both": (torch.tensor([50, 0, 7, 1000, 2, 0, 300, 9]), torch.tensor([0.9, 0.6, 0.5, 0.97, 0.8, 1.0, 0.7, 0.999])),
    }
    for name, (top_k, top_p) in cases.items():
        want = sampling_ops_probs(logits, temp, top_k, top_p)
        got = sampling_kernels.sampling_probs(logits.to(triton_device), temp.to(triton_device), top_k.to(triton_device),
                                              top_p.to(triton_device), filtered=name != "temperature").cpu()
        assert torch.equal(got > 0, want > 0), name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(got.sum(-1), torch.ones(B), rtol=1e-5, atol=1e-5, msg=name)
    kept = (sampling_ops_probs(logits, temp, cases["top-k"][0], torch.ones(B)) > 0).sum(-1)
    # (bf16 rounding ties logits: a tie with the k-th stays, so top-k may keep more than k there)
    assert (kept[0] == 1 and kept[2] == 40) if dtype != torch.bfloat16 else (kept[0] >= 1 and kept[2] >= 40)
    assert kept[4] == V  # top_k = V keeps every token


@pytest.mark.parametrize("path,chunk", [("kernel", 1024), ("kernel", 4096), ("ops", 1024)])
def test_sampling_probs_writes_only_the_chosen_rows_in_place(triton_device, path, chunk, monkeypatch):
    """``out`` and ``rows`` (a drafter's q buffer, where only some rows draft): the chosen rows get
    the probabilities ``sampling_probs`` returns alone, the others keep their values, and the
    result is ``out`` itself, also through a strided view (one draft position of a [n, k, V]
    buffer); ``rows`` without ``out`` is refused. Rows over chunks and rows of one chunk."""
    monkeypatch.setattr(sampling_kernels, "CHUNK", chunk)
    g = torch.Generator().manual_seed(3)
    B, V = 6, 2048 + 5
    logits = _rows(g, B, V)
    temp, top_k = torch.full((B,), 0.8), torch.tensor([0, 5, 0, 40, 0, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.7])
    chosen = torch.tensor([True, False, True, True, False, True])
    want = sampling_ops_probs(logits, temp, top_k, top_p)
    buf = torch.full((B, 3, V), 7.0)
    if path == "kernel":
        call = lambda *a, **kw: sampling_kernels.sampling_probs(  # noqa: E731
            *(t.to(triton_device) if isinstance(t, torch.Tensor) else t for t in a), **kw)
        buf = buf.to(triton_device)
    else:
        call = sampling.sampling_probs
    out = buf[:, 1]
    got = call(logits, temp, top_k, top_p, True, out=out, rows=chosen.to(buf.device))
    assert got.data_ptr() == out.data_ptr()
    got = buf[:, 1].cpu()
    torch.testing.assert_close(got[chosen], want[chosen], rtol=1e-4, atol=1e-7)
    assert (got[~chosen] == 7.0).all() and (buf[:, 0] == 7.0).all() and (buf[:, 2] == 7.0).all()
    with pytest.raises(ValueError, match="rows needs out"):
        call(logits, temp, top_k, top_p, True, rows=chosen.to(buf.device))


def test_sampling_kernels_give_a_row_the_same_bits_alone_and_in_a_batch(triton_device, monkeypatch):
    """A row's probabilities and its draw are bitwise the same computed alone, in a batch, or at
    another place in it (fixed chunks, sums in a fixed order): what makes a seeded request's tokens
    independent of the requests beside it. (A row of one chunk is one program: nothing to share.)"""
    monkeypatch.setattr(sampling_kernels, "CHUNK", 512)
    g = torch.Generator().manual_seed(5)
    B, V = 6, 1024 + 333
    logits = _rows(g, B, V).to(triton_device, torch.float16)  # (16-bit keys: four passes a search)
    temp = torch.tensor([0.7, 1.0, 1.3, 0.9, 0.5, 1.1], device=triton_device)
    top_k = torch.tensor([0, 7, 0, 300, 0, 2], device=triton_device)
    top_p = torch.tensor([0.9, 1.0, 0.6, 0.95, 1.0, 0.8], device=triton_device)
    u = torch.rand(B, generator=g).to(triton_device)
    batch = sampling_kernels.sampling_probs(logits, temp, top_k, top_p)
    drawn = sampling_kernels.sample_inverse_cdf(batch, u)
    flipped = sampling_kernels.sampling_probs(logits.flip(0), temp.flip(0), top_k.flip(0), top_p.flip(0)).flip(0)
    assert torch.equal(flipped, batch)
    for r in (3, 5):
        alone = sampling_kernels.sampling_probs(logits[r:r + 1], temp[r:r + 1], top_k[r:r + 1], top_p[r:r + 1])
        assert torch.equal(alone[0], batch[r]), r
        assert torch.equal(sampling_kernels.sample_inverse_cdf(alone, u[r:r + 1])[0], drawn[r]), r


def sampling_ops_probs(logits, temp, top_k, top_p):
    """``sampling.sampling_probs`` in its PyTorch ops (on the CPU, where no kernel runs)."""
    return sampling.sampling_probs(logits.cpu(), temp, top_k, top_p)


def test_sampling_probs_cut_keeps_ties_and_the_most_likely_token(triton_device):
    """The cut, in the ops and the kernel alike: a tie with the k-th logit stays (top-k keeps more
    than k then) and top-p runs over every token top-k kept, ties included; a top_p too small to
    hold any token still keeps the most likely one."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [0.5, 4.0, 0.5, 0.1, 0.2], [2.0, 1.0, 1.0, 1.0, -10.0]])
    args = (torch.ones(3), torch.tensor([2, 0, 2]), torch.tensor([1.0, 1e-12, 0.5]))
    on_device = [a.to(triton_device) for a in args]
    for probs in (sampling.sampling_probs(logits, *args),
                  sampling_kernels.sampling_probs(logits.to(triton_device), *on_device).cpu()):
        assert (probs[0] > 0).tolist() == [True, False, True, True, False]  # the two tied 2.0s both stay
        assert (probs[1] > 0).tolist() == [False, True, False, False, False]
        # top-k = 2 keeps the 2.0 and the three tied 1.0s; 2.0 alone holds 0.475 of their mass < 0.5
        assert (probs[2] > 0).tolist() == [True, True, True, True, False]
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("chunk", [512, 4096], ids=["chunks", "one-program"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sampling_probs_cut_search_near_and_far_from_the_top(triton_device, dtype, chunk, monkeypatch):
    """Where the search's geometric first pass lands (its candidates 0, 1, 3, 7, ... keys below a
    row's greatest key): a cut at the greatest key itself (settled after that pass: the passes
    after it read nothing), a few keys below it, and far below every geometric candidate (a
    near-flat row with top-p 0.999 over logits spanning both signs: the even passes take over);
    top-k whose cut is the greatest key, then top-p over what it keeps; ties at the top. The
    kernel keeps the ops' tokens in every case."""
    monkeypatch.setattr(sampling_kernels, "CHUNK", chunk)
    g = torch.Generator().manual_seed(11)
    B, V = 7, 1024 + 77
    logits = torch.randn(B, V, generator=g)
    logits[0, 17] = 40.0  # one token holds all the mass: the cut is the greatest key
    logits[1] = torch.linspace(-8.0, 8.0, V)[torch.randperm(V, generator=g)]  # the cut far below the top
    logits[2, 100] = logits[2].max() + 0.01  # a cut a few keys below the greatest
    logits[3, 5] = logits[3, 900] = 9.0  # two tokens tied at the top
    logits[6, 300:] = float("-inf")
    logits = logits.to(dtype)
    temp = torch.tensor([1.0, 4.0, 0.7, 1.0, 1.0, 2.0, 1.0])
    top_k = torch.tensor([0, 0, 0, 1, 1, 3, V - 1])
    top_p = torch.tensor([0.9, 0.999, 0.3, 0.9, 0.5, 0.8, 0.999])
    want = sampling_ops_probs(logits, temp, top_k, top_p)
    got = sampling_kernels.sampling_probs(logits.to(triton_device), temp.to(triton_device), top_k.to(triton_device),
                                          top_p.to(triton_device)).cpu()
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    kept = (got > 0).sum(-1)
    assert kept[0] == 1 and kept[3] == 2 and kept[4] == 1 and kept[1] > V // 2  # (row 1: most of a flat row)


def test_inverse_cdf_kernel_draws_the_ops_index(triton_device, monkeypatch):
    """Dense, sparse and one-hot rows, a row of zeros, uniforms near 0 and 1, vocabularies over
    five chunks (a ragged last one), some of them empty: the kernel draws the index the PyTorch
    ops draw, never one of weight 0."""
    monkeypatch.setattr(sampling_kernels, "CHUNK", 1024)
    g = torch.Generator().manual_seed(2)
    B, V = 10, 2 * 2048 + 301
    w = torch.rand(B, V, generator=g) ** 4
    w[1] *= torch.rand(V, generator=g) < 0.01  # sparse
    w[2] = 0.0
    w[2, 4000] = 0.3  # one-hot, in the last column step
    w[3] = 0.0  # nothing: the last index, as the ops give
    w[4, 2048:] = 0.0  # mass only in the first step
    u = torch.rand(B, generator=g)
    u[5], u[6] = 0.0, 1.0 - 2 ** -24
    for rows in (w, w[:, ::1].T.contiguous().T):  # contiguous, and a row stride that is not V
        want = sampling.sample_inverse_cdf(rows, u)
        got = sampling_kernels.sample_inverse_cdf(rows.to(triton_device), u.to(triton_device)).cpu()
        assert torch.equal(got, want)
    assert all(w[r, got[r]] > 0 for r in range(B) if r != 3) and got[3] == V - 1


@pytest.mark.gpu
def test_sampling_kernels_take_more_rows_than_a_grid_dimension_holds():
    """A verify step of many short rows (the powered speculative-sampling tests: millions of rows of
    five tokens): rows lie on the grid's first dimension (2**31 - 1 programs, where the second
    holds 65,535), and a row of one chunk keeps no partial sums."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(4)
    B, V = 70_000, 5
    logits = torch.randn(B, V, generator=g)
    temp, top_k, top_p = torch.full((B,), 0.9), torch.zeros(B, dtype=torch.long), torch.full((B,), 0.8)
    want = sampling_ops_probs(logits, temp, top_k, top_p)
    got = sampling_kernels.sampling_probs(logits.cuda(), temp.cuda(), top_k.cuda(), top_p.cuda()).cpu()
    assert torch.equal(got > 0, want > 0)
    u = torch.rand(B, generator=g)
    assert torch.equal(sampling_kernels.sample_inverse_cdf(want.cuda(), u.cuda()).cpu(),
                       sampling.sample_inverse_cdf(want, u))


def test_sampling_probs_kernel_refuses_a_dtype_it_cannot_read():
    """float64 logits keep the ops (their bit patterns are neither 16 nor 32 bits wide)."""
    x = torch.randn(2, 7, dtype=torch.float64)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        sampling_kernels.sampling_probs(x, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2))


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one-hot-q"])
def test_stop_token_kernel_draws_what_the_materialised_weights_draw(triton_device, with_q, monkeypatch):
    """The emitted token after each row's accepted drafts (``residual_kernel.sample_stop_tokens``):
    the same index as the inverse-CDF draw over ``stop_weights`` (the kernel's, bit for bit, and the
    PyTorch ops'): rejected rows draw from the residual (or p without the rejected token), bonus
    rows from p, a row whose residual is empty (q = p there) from p; q a slice of a larger buffer."""
    monkeypatch.setattr(sampling_kernels, "CHUNK", 512)
    g = torch.Generator().manual_seed(6)
    B, K, V = 7, 3, 1024 + 333
    p = torch.rand(B, K + 1, V, generator=g) ** 6
    p /= p.sum(-1, keepdim=True)
    buf = torch.rand(B, K + 2, V, generator=g) ** 6
    buf /= buf.sum(-1, keepdim=True)
    q = buf[:, 1:K + 1] if with_q else None  # (a row stride that is not K x V)
    tokens = torch.randint(0, V, (B, K), generator=g)
    lens = torch.tensor([3, 3, 2, 0, 3, 1, 3])
    accepted = torch.tensor([0, 3, 1, 0, 2, 1, 1])  # rows 1, 3, 5: every draft accepted (bonus)
    if with_q:
        buf[6, 2] = p[6, 1]  # row 6 rejected at position 1 where q = p: an empty residual, p instead
    u = torch.rand(B, generator=g)
    weights = stop_weights(p, q, tokens, lens, accepted)
    want = sampling.sample_inverse_cdf(weights, u)
    dev = lambda t: None if t is None else t.to(triton_device)  # noqa: E731
    kernel = sampling_kernels.sample_inverse_cdf(weights.to(triton_device), u.to(triton_device)).cpu()
    got = residual_kernel.sample_stop_tokens(dev(p), dev(q), dev(tokens), dev(lens), dev(accepted),
                                             dev(u)).cpu()
    assert torch.equal(got, kernel) and torch.equal(got, want)
    assert all(weights[r, got[r]] > 0 for r in range(B))
    with pytest.raises(ValueError, match="needs float32"):
        residual_kernel.sample_stop_tokens(p[:, :1], None, tokens[:, :0], lens, accepted, u)


def test_draws_never_land_on_a_weight_of_zero_under_a_tree_ordered_scan(triton_device, monkeypatch):
    """On a GPU ``tl.cumsum`` adds across lanes in a tree, so running totals taken over a run of zero
    weights can move by a rounding (a chunk of zeros seen to pass the drawn point, a column of zero
    weight found): the draws must still land on a positive weight. Under the interpreter the scans
    of short vectors are made tree-ordered (Hillis-Steele, as the compiled warp scan adds) to show
    it: weights of 2**-24, 2**-24 and 1 in three chunks, a fourth of zeros, u just below 1."""
    if triton_device.type != "cpu":
        pytest.skip("the tree-ordered scan is emulated under the interpreter")
    np = pytest.importorskip("numpy")
    interp = pytest.importorskip("triton.runtime.interpreter")
    if not hasattr(getattr(interp, "ScanOps", None), "cumsum"):
        pytest.skip("this Triton's interpreter has no ScanOps.cumsum to patch")
    plain = interp.ScanOps.cumsum

    def tree_cumsum(self, input):
        a = input.handle.data
        if a.ndim != 1 or a.shape[0] > 32 or a.dtype != np.float32:
            return plain(self, input)
        a, i = a.copy(), 1
        while i < a.shape[0]:
            b = a.copy()
            b[i:] = (a[i:] + a[:-i]).astype(np.float32)
            a, i = b, i * 2
        return [self.to_tensor(a, dtype=input.dtype)]

    monkeypatch.setattr(interp.ScanOps, "cumsum", tree_cumsum)
    monkeypatch.setattr(sampling_kernels, "CHUNK", 64)
    V = 4 * 64
    w = torch.zeros(1, V)
    w[0, 10], w[0, 64 + 10], w[0, 128 + 10] = 2 ** -24, 2 ** -24, 1.0
    u = torch.tensor([1 - 2 ** -24])
    got = sampling_kernels.sample_inverse_cdf(w, u)
    assert w[0, got[0]] > 0, got
    p, zero = w[:, None].expand(1, 2, V).contiguous(), torch.zeros(1, dtype=torch.long)
    got = residual_kernel.sample_stop_tokens(p, None, zero[:, None], zero, zero, u)
    assert w[0, got[0]] > 0, got
