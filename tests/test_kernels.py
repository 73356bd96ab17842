"""The fused decode/verify kernels (``tandem.models.kernels``): they match the reference forward
(within bf16 tolerance on a GPU), and a row's logits are bitwise identical whatever batch it runs
in, wherever it sits in the batch and however many tokens it verifies (batch- and
width-invariance: what makes greedy speculative output equal target-only output in the fast mode).

Each kernel test runs on a GPU (marked ``gpu``, bf16) and, where Triton is installed, on the CPU
under Triton's interpreter (``TRITON_INTERPRET=1``, float32): the same kernels, run through NumPy,
so their indexing, masking, causal alignment and GQA packing are checked on machines without a
GPU. The interpreter's floating point is not the GPU's, so invariance found there says that no
kernel mixes rows; the GPU run says that the compiled code keeps it."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.errors import ConfigError
from tandem.models import attention, kernels, load_checkpoint
from tandem.models.attention import flash_available, gqa_attention
from tandem.models.kernels import MAX_FUSED_TOKENS, fused_unavailable_reason
from tandem.models.runner import DEFAULT_ATTENTION_CHUNK, ModelRunner, RunnerConfig, resolve_attention_chunk
from tandem.models.runner_config import SMALL_BATCH, SMALL_BATCH_ATTENTION_CHUNK, default_attention_chunk

# head_dim 64 with 3 query heads per KV head, as the bundled SmolLM2 (the flash-attn build's shape)
FUSED_SHAPE = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, intermediate_size=512)


def _fused_ready() -> bool:
    return torch.cuda.is_available() and fused_unavailable_reason(torch.device("cuda"), 64, torch.bfloat16) is None


needs_fused = pytest.mark.skipif(not _fused_ready(), reason="needs CUDA with triton")
# the fused kernels with our attention, and with flash-attn's (where it is importable)
FUSED_PATHS = ["fused", "fused-linear", pytest.param("fused-flash", marks=pytest.mark.skipif(
    not (_fused_ready() and flash_available(64)), reason="needs flash-attn"))]


@pytest.fixture(params=[
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_fused]),
    pytest.param("cpu", marks=pytest.mark.skipif(
        torch.cuda.is_available() or not kernels.interpreted(),
        reason="needs triton, and no GPU (the tests' conftest turns the interpreter on then)")),
], ids=["gpu", "interpreter"])
def where(request):
    """``(device, dtype)`` of a kernel test: CUDA in bf16, or the CPU under Triton's interpreter in
    float32."""
    return (torch.device("cuda"), torch.bfloat16) if request.param == "cuda" else (torch.device("cpu"), torch.float32)


def test_kernel_choice_on_cpu(tiny_checkpoint, monkeypatch):
    """A CPU runner (no interpreter) takes the reference path under "auto", refuses "fused" with
    the reason, and refuses an unknown choice."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    runner = ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32))
    assert runner.kernels == "reference" and runner.attention_backend == "sdpa-masked"
    with pytest.raises(ConfigError, match="not a CUDA device"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, kernels="fused"))
    with pytest.raises(ConfigError, match="not a CUDA device"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, kernels="fused-flash"))
    with pytest.raises(ConfigError, match="kernels must be one of"):
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, kernels="fast"))
    with pytest.raises(ConfigError, match="applies to our attention kernel.*sdpa-masked"):  # not ignored in silence
        ModelRunner(ckpt, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=32, attention_chunk=64))
    # unset, the split-KV chunk follows the attention: ours splits by default, the others never do
    assert runner.config.attention_chunk is None and runner.attention_chunk == 0
    assert resolve_attention_chunk(RunnerConfig(), "fused") == DEFAULT_ATTENTION_CHUNK
    assert resolve_attention_chunk(RunnerConfig(), "fused-linear") == DEFAULT_ATTENTION_CHUNK
    assert resolve_attention_chunk(RunnerConfig(), "fused-flash") == 0
    assert resolve_attention_chunk(RunnerConfig(), "reference") == 0
    assert resolve_attention_chunk(RunnerConfig(attention_chunk=0), "fused") == 0  # asked for: kept
    assert resolve_attention_chunk(RunnerConfig(attention_chunk=128), "fused") == 128
    # a runner of few slots splits finer by default (more, shorter programs for one row); asked-for chunks stay
    assert resolve_attention_chunk(RunnerConfig(max_batch_size=SMALL_BATCH), "fused") == SMALL_BATCH_ATTENTION_CHUNK
    assert resolve_attention_chunk(RunnerConfig(max_batch_size=SMALL_BATCH + 1), "fused") == DEFAULT_ATTENTION_CHUNK
    assert resolve_attention_chunk(RunnerConfig(max_batch_size=1, attention_chunk=256), "fused") == 256
    assert resolve_attention_chunk(RunnerConfig(max_batch_size=1), "reference") == 0


def _runner(ckpt, kernels: str, slots: int, graphs: bool = False, taps: tuple[int, ...] = (),
            dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
            max_seq_len: int = 512) -> ModelRunner:
    return ModelRunner(ckpt, RunnerConfig(device=str(device), dtype=dtype, max_batch_size=slots, max_seq_len=max_seq_len,
                                          cuda_graphs=graphs, kernels=kernels, taps=taps))


def _rel_err(x: torch.Tensor, exact: torch.Tensor) -> float:
    return ((x.float() - exact.float()).norm() / exact.float().norm()).item()


def test_kernel_choice_under_the_interpreter(tiny_checkpoint):
    """With ``TRITON_INTERPRET=1`` a CPU runner takes "fused" when asked, in float32, and refuses
    bf16 (NumPy has none); "auto" stays on the reference path (the interpreter is for checking)."""
    if torch.cuda.is_available() or not kernels.interpreted():
        pytest.skip("needs triton, and no GPU (the interpreter on)")
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    assert _runner(ckpt, "auto", 1, dtype=torch.float32, device="cpu", max_seq_len=32).kernels == "reference"
    runner = _runner(ckpt, "fused", 1, dtype=torch.float32, device="cpu", max_seq_len=32)
    assert runner.kernels == "fused" and runner.attention_backend == f"triton-gqa-split{default_attention_chunk(1)}"
    with pytest.raises(ConfigError, match="NumPy has no bfloat16"):
        _runner(ckpt, "fused", 1, dtype=torch.bfloat16, device="cpu", max_seq_len=32)


@pytest.mark.parametrize("q_len", [1, 2, 5, 16, 70])
def test_gqa_attention_matches_float32_attention(where, q_len):
    """The GQA-packed attention kernel against float32 attention over expanded K/V with a causal
    mask aligned at each row's end: ragged lengths (one row as short as its new tokens), 3 query
    heads per KV head, decode (1 token), verify (2 ... 16) and a prefill-sized step (70). Stale
    positions past a row's length hold large values, which must not leak into the result."""
    device, dtype = where
    gen = torch.Generator(device=device).manual_seed(q_len)
    B, heads, kv_heads, hd, positions = 5, 6, 2, 64, 600

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    seqlens = torch.tensor([q_len, q_len + 1, 64 + q_len, 333, 600], device=device, dtype=torch.int32)
    q = randn(B, q_len, heads, hd).to(dtype)
    k, v = randn(B, kv_heads, positions, hd).to(dtype), randn(B, kv_heads, positions, hd).to(dtype)
    for b, n in enumerate(seqlens.tolist()):
        k[b, :, n:], v[b, :, n:] = 1e4, -1e4
    got = gqa_attention(q, k, v, seqlens).float()
    g = heads // kv_heads
    keys = torch.arange(positions, device=device)
    pos = seqlens[:, None].long() - q_len + torch.arange(q_len, device=device)[None, :]  # [B, Q]
    mask = keys[None, None, :] <= pos[:, :, None]  # [B, Q, L]
    qf = q.float().transpose(1, 2)  # [B, heads, Q, hd]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask[:, None]).transpose(1, 2)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-4, err
        return
    assert err < 2e-2, err  # bf16 inputs and P, fp32 accumulation
    bf16_ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
        attn_mask=mask[:, None]).transpose(1, 2).float()
    assert err <= max(1.5 * (bf16_ref - want).abs().max().item(), 1e-3)


def test_rope_kv_write_spans_equals_explicit_positions(where):
    """``rope_kv_write_spans`` (positions made in the kernel from each row's start and real token
    count, read as two columns of one packed tensor) rotates and writes exactly as
    ``rope_kv_write`` with the positions made by plain ops: a row past the tables' last row rotates
    there, padding tokens write to the scratch position."""
    device, dtype = where
    torch.manual_seed(0)
    B, Q, heads, kv_heads, hd, positions = 3, 5, 6, 2, 64, 40
    cos = torch.randn(positions, hd, device=device).to(dtype)
    sin = torch.randn(positions, hd, device=device).to(dtype)
    qkv = torch.randn(B, Q, (heads + 2 * kv_heads) * hd, device=device).to(dtype)
    packed = torch.tensor([[3, 5, 0], [0, 2, 1], [37, 4, 2]], device=device)  # start, q_len, slot
    start, q_lens, scratch = packed[:, 0], packed[:, 1], positions + 4
    offs = torch.arange(Q, device=device)
    slot_pos = start[:, None] + offs[None, :]
    write = torch.where(offs[None, :] < q_lens[:, None], slot_pos, scratch)
    caches = [torch.zeros(B, kv_heads, positions + 5, hd, device=device, dtype=dtype) for _ in range(4)]
    want = kernels.rope_kv_write(qkv, cos, sin, slot_pos.clamp(max=positions - 1), write, caches[0], caches[1],
                                 heads, kv_heads)
    got = kernels.rope_kv_write_spans(qkv, cos, sin, start, q_lens, scratch, caches[2], caches[3], heads, kv_heads)
    assert torch.equal(got, want)
    real = slice(0, scratch)  # row 1's three padding tokens race for the scratch position
    assert torch.equal(caches[2][:, :, real], caches[0][:, :, real])
    assert torch.equal(caches[3][:, :, real], caches[1][:, :, real])


def test_rope_and_kv_write_match_the_reference_layer(where):
    """``rope_kv_write`` rotates q and k as the reference attention layer does (rotate-half RoPE at
    each token's position) and writes k and v at each token's cache position, padding tokens to
    the scratch position, touching nothing else."""
    device, dtype = where
    torch.manual_seed(0)
    B, Q, heads, kv_heads, hd, positions = 3, 4, 6, 2, 64, 40
    half = hd // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(device, dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(device, dtype)
    qkv = torch.randn(B, Q, (heads + 2 * kv_heads) * hd, device=device).to(dtype)
    pos = torch.tensor([[3, 4, 5, 6], [0, 1, 2, 3], [20, 21, 22, 23]], device=device)
    write = pos.clone()
    write[1, 2:] = positions - 1  # row 1 has two real tokens: its padding goes to the scratch position
    k_cache = torch.zeros(B, kv_heads, positions, hd, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = kernels.rope_kv_write(qkv, cos, sin, pos, write, k_cache, v_cache, heads, kv_heads)

    def rotate(x, p):  # x [..., hd] at positions p
        c, s_ = cos[p].float(), sin[p].float()
        x = x.float()
        return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s_

    qs, ks, vs = qkv.float().split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
    want_q = rotate(qs.view(B, Q, heads, hd), pos[:, :, None])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.float(), want_q, **tol)
    want_k = rotate(ks.view(B, Q, kv_heads, hd), pos[:, :, None])
    for b in range(B):
        for j in range(Q):
            w = int(write[b, j])
            if w == positions - 1 and b == 1:
                continue  # scratch: whatever the last padding token wrote
            torch.testing.assert_close(k_cache[b, :, w].float(), want_k[b, j], **tol)
            torch.testing.assert_close(v_cache[b, :, w].float(), vs.view(B, Q, kv_heads, hd)[b, j], **tol)
    written = {(b, int(write[b, j])) for b in range(B) for j in range(Q)}
    for b in range(B):
        for p in range(positions):
            if (b, p) not in written:
                assert not k_cache[b, :, p].any() and not v_cache[b, :, p].any(), (b, p)


def test_add_rmsnorm_and_silu_mul_match_plain_ops(where):
    """``add_rmsnorm`` gives the residual sum and RMSNorm of it (rounded where the plain ops round);
    ``silu_mul`` gives silu(gate) * up over rows wider than one block."""
    device, dtype = where
    torch.manual_seed(0)
    x, r = torch.randn(7, 576, device=device).to(dtype), torch.randn(7, 576, device=device).to(dtype)
    w = torch.randn(576, device=device).to(dtype)
    normed, res = kernels.add_rmsnorm(x, r, w, 1e-5)
    s = (x + r).float()
    want = w.float() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(res.float(), s, **tol)
    torch.testing.assert_close(normed.float(), want, **tol)
    first, alone = kernels.add_rmsnorm(x, None, w, 1e-5)
    assert alone is x  # the first layer: no residual to add
    xf = x.float()
    torch.testing.assert_close(first.float(), w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)),
                               **tol)
    gu = torch.randn(2, 3, 2 * 1536, device=device).to(dtype)
    got = kernels.silu_mul(gu)
    assert got.shape == (2, 3, 1536)
    torch.testing.assert_close(got.float(), torch.nn.functional.silu(gu[..., :1536].float()) * gu[..., 1536:].float(),
                               **tol)


@pytest.mark.parametrize("kernels_path", FUSED_PATHS)
def test_fused_forward_is_as_accurate_as_the_reference(tiny_checkpoint, where, kernels_path):
    """Against a float32 forward, the fused kernels' logits, tapped states and cache contents are
    as accurate as the reference forward's in the same dtype (relative error at most 1.5x the
    reference's, or 1e-3; the random tiny model's bf16 logits are ~7% off float32 on either
    path): a wide prefill (padded rows), then ragged verify steps (idle rows, a rollback between
    steps). bf16 rounds differently in the two bf16 paths, so they are compared through the exact
    result rather than with each other."""
    device, dtype = where
    if kernels_path == "fused-flash" and device.type != "cuda":
        pytest.skip("flash-attn runs on a GPU only")
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    taps = (0, 1, 2)
    exact, ref, fused = (_runner(ckpt, "reference", 4, taps=taps, dtype=torch.float32, device=device),
                         _runner(ckpt, "reference", 4, taps=taps, dtype=dtype, device=device),
                         _runner(ckpt, kernels_path, 4, taps=taps, dtype=dtype, device=device))
    split = f"triton-gqa-split{default_attention_chunk(4)}"  # our kernel splits the KV by default
    attention = {"fused": split, "fused-flash": "flash-attn", "fused-linear": split}[kernels_path]
    assert fused.kernels == kernels_path and fused.attention_backend == attention and ref.kernels == "reference"
    rng = random.Random(0)
    vocab = ckpt.config.vocab_size
    lengths = (37, 5, 300) if device.type == "cuda" else (37, 5, 90)  # (the interpreter is slow)
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate(lengths)}
    runners = (exact, ref, fused)
    for r in runners:
        for s in prompts:
            r.cache.allocate()
        r.prefill(prompts)

    def check(want, ref_out, got, what):
        e_ref, e_fused = _rel_err(ref_out, want), _rel_err(got, want)
        assert e_fused <= max(1.5 * e_ref, 1e-3), (what, e_ref, e_fused)

    for step in range(4):
        app = {s: [rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for s in prompts if rng.random() < 0.8}
        app = app or {0: [1]}
        outs = [r.step(app) for r in runners]
        for s, toks in app.items():
            n = len(toks)
            check(*(o.logits[s, :n] for o in outs), ("logits", step, s))
            check(*(o.taps[s, :n] for o in outs), ("taps", step, s))
        s = next(iter(app))
        for r in runners:  # roll one slot back: its next step overwrites the dropped positions
            r.cache.truncate(s, r.cache.lengths[s] - len(app[s]) + 1)
    for s in prompts:
        n = exact.cache.lengths[s]
        assert ref.cache.lengths[s] == fused.cache.lengths[s] == n
        for name in ("k", "v"):
            check(*(getattr(r.cache, name)[:, s, :, :n] for r in runners), (name, s))


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kernels_path", FUSED_PATHS)
def test_fused_rows_are_batch_and_width_invariant(tiny_checkpoint, graphs, kernels_path):
    """One row (the same context, the same tokens) verified alone or among 2 ... 128 rows, at any
    slot of the batch, with 1 ... 8 tokens: the logits of its common positions are bitwise equal.
    Every slot holds the same prompt, so any slot can carry the row; other rows get random tokens
    and widths; each step is rolled back. (GPU only: on a CPU the GEMMs between the kernels are
    the CPU BLAS's, whose reduction order changes with the number of rows.)"""
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    runner = _runner(ckpt, kernels_path, 128, graphs=graphs)
    rng = random.Random(1)
    vocab = ckpt.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(150)]
    for _ in range(128):
        runner.cache.allocate()
    runner.prefill({s: prompt for s in range(128)})
    row = [rng.randrange(vocab) for _ in range(8)]
    reference = None
    for batch in (1, 2, 7, 16, 64, 128):
        for width in (1, 3, 5, 8):
            slot = rng.randrange(batch)
            app = {s: [rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for s in range(batch)
                   if rng.random() < 0.9}
            app[slot] = row[:width]
            logits = runner.step(app).logits[slot, :width].float().cpu()
            for s, toks in app.items():
                runner.cache.truncate(s, len(prompt))
            if reference is None or width > reference.shape[0]:
                if reference is not None:
                    assert torch.equal(logits[:reference.shape[0]], reference), (batch, width, slot)
                reference = logits
            else:
                assert torch.equal(logits, reference[:width]), (batch, width, slot)
    assert reference.shape[0] == 8 <= MAX_FUSED_TOKENS


def test_kernel_rows_are_batch_and_width_invariant(where):
    """Each kernel on its own: one row's result is bitwise the same alone or among other rows, at
    any place in the batch, and (attention, RoPE) for its first tokens whatever the number of
    tokens after them: add+RMSNorm, SiLU-multiply, RoPE with the K/V write, the GQA-packed attention
    over a cache whose row is the same in every batch, and the fused-linear kernels."""
    device, dtype = where
    torch.manual_seed(0)
    heads, kv_heads, hd, positions, start = 6, 2, 64, 160, 90
    rows, Qmax = 7, 8

    def rand(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    x, r, w = rand(rows, 384), rand(rows, 384), rand(384)
    gu = rand(rows, 1024)
    alone = [(kernels.add_rmsnorm(x[i:i + 1], r[i:i + 1], w, 1e-5), kernels.silu_mul(gu[i:i + 1])) for i in range(rows)]
    (normed, res), act = kernels.add_rmsnorm(x, r, w, 1e-5), kernels.silu_mul(gu)
    for i, ((n1, r1), a1) in enumerate(alone):
        assert torch.equal(normed[i:i + 1], n1) and torch.equal(res[i:i + 1], r1) and torch.equal(act[i:i + 1], a1), i
    cos, sin = rand(positions, hd), rand(positions, hd)
    qkv = rand(rows, Qmax, (heads + 2 * kv_heads) * hd)
    cache_k, cache_v = rand(1, kv_heads, positions, hd), rand(1, kv_heads, positions, hd)

    def attend(row_ids: list[int], width: int) -> torch.Tensor:
        """The rows' first ``width`` tokens after ``start`` cached positions: [len, width, heads, hd]."""
        n = len(row_ids)
        k, v = cache_k.expand(n, -1, -1, -1).clone(), cache_v.expand(n, -1, -1, -1).clone()
        pos = (start + torch.arange(width, device=device))[None, :].expand(n, -1).contiguous()
        q = kernels.rope_kv_write(qkv[row_ids, :width], cos, sin, pos, pos, k, v, heads, kv_heads)
        seqlens = torch.full((n,), start + width, dtype=torch.int32, device=device)
        return torch.cat([q.flatten(2), attention.gqa_attention(q, k, v, seqlens).flatten(2)], -1)

    want = attend([3], Qmax)[0]
    for width in (1, 2, 5, Qmax):
        for batch in ([3], [0, 3, 5], list(range(rows)), [6, 5, 4, 3]):
            got = attend(batch, width)[batch.index(3)]
            assert torch.equal(got, want[:width]), (width, batch)
    # the fused-linear kernels, over 40 rows (three 16-row tiles): row 3 alone, or at row 37
    from tandem.models import fused_linear

    many, w_o, w13 = rand(40, 384), rand(384, 384) * 0.05, rand(1024, 384) * 0.05
    moved = many.clone()
    moved[37] = many[3]
    for bm in (fused_linear.BLOCK_M, fused_linear.PREFILL_BLOCK_M):
        for fn in (lambda t: fused_linear.linear_residual(t, w_o, t, block_m=bm),
                   lambda t: fused_linear.norm_gate_up(t, w, 1e-5, w13, block_m=bm)):
            assert torch.equal(fn(many[3:4])[0], fn(moved)[37]) and torch.equal(fn(many)[3], fn(many[3:4])[0]), bm
    k, v = cache_k[:, :, :64].expand(40, -1, -1, -1).clone(), cache_v[:, :, :64].expand(40, -1, -1, -1).clone()
    wqkv = rand((heads + 2 * kv_heads) * hd, 384) * 0.05
    at = torch.full((40, 1), 9, device=device)
    q_all = fused_linear.norm_qkv_rope(moved[:, None], w, 1e-5, wqkv, None, cos, sin, at, at, k, v, heads, kv_heads)
    q_one = fused_linear.norm_qkv_rope(many[3:4, None], w, 1e-5, wqkv, None, cos, sin, at[:1], at[:1], k[:1], v[:1],
                                       heads, kv_heads)
    assert torch.equal(q_all[37], q_one[0]) and torch.equal(k[37, :, 9], k[0, :, 9]) and torch.equal(v[37], v[0])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0 * -inf, masked
@pytest.mark.parametrize("probs", [False, True])
def test_draft_features_kernel_matches_the_plain_definition(where, probs):
    """``draft_features`` (one pass over the vocabulary per row: entropy, top-1, top-1 - top-2,
    position) gives ``device_features`` of the same distribution: peaked, flat, tied and masked
    rows, low-precision logits or float32 probabilities, a vocabulary that is not a multiple of the
    block."""
    from tandem.drafters.base import device_features
    from tandem.models.kernels import draft_features

    device, dtype = where
    torch.manual_seed(0)
    R, V = (67, 49152 + 13) if device.type == "cuda" else (13, 4096 + 13)
    logits = torch.randn(R, V, device=device) * torch.linspace(0.1, 12.0, R, device=device)[:, None]
    logits[3] = 0.0  # flat
    logits[4, :2] = 30.0  # a tie at the top
    logits[5, 100:] = float("-inf")  # a filtered row
    pos = torch.arange(R, device=device, dtype=torch.float32) % 6 + 1
    if probs:
        x = logits.float().softmax(-1)
        want = device_features(x, pos)
    else:
        x = logits.to(dtype)
        want = device_features(x.float().softmax(-1), pos)
    got = draft_features(x, pos, probs=probs)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert got[4, 2].abs() < 1e-6  # tied top candidates: margin 0


def test_fused_linear_kernels_match_plain_ops(where):
    """Each fused-linear kernel against the ops it replaces: RMSNorm + QKV projection (with a bias)
    + RoPE + K/V write, the O/down projection with its residual add, RMSNorm + gate/up + SiLU-multiply;
    ragged rows (a tile part full), padding tokens written to the scratch position."""
    from tandem.models import fused_linear

    device, dtype = where
    torch.manual_seed(0)
    B, Q, d, heads, kv_heads, hd, inter, positions = 3, 7, 384, 6, 2, 64, 512, 64
    half = hd // 2
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    x, nw = rand(B, Q, d), rand(d)
    wqkv, bias = rand((heads + 2 * kv_heads) * hd, d, scale=d ** -0.5), rand((heads + 2 * kv_heads) * hd)
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(device, dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(device, dtype)
    pos = (torch.tensor([5, 0, 40], device=device)[:, None] + torch.arange(Q, device=device)[None, :])
    write = pos.clone()
    write[1, 4:] = positions - 1  # row 1: four real tokens, its padding to the scratch position
    k_cache = torch.zeros(B, kv_heads, positions, hd, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)

    def rms(t, w):
        tf = t.float()
        return (w.float() * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()).to(dtype)

    def rotate(t, p):
        c, s_ = cos[p].float(), sin[p].float()
        t = t.float()
        return t * c + torch.cat([-t[..., half:], t[..., :half]], -1) * s_

    for b_ in (None, bias):
        k_cache.zero_(), v_cache.zero_()
        q = fused_linear.norm_qkv_rope(x, nw, 1e-5, wqkv, b_, cos, sin, pos, write, k_cache, v_cache, heads, kv_heads)
        qkv = torch.nn.functional.linear(rms(x, nw), wqkv, b_).float()
        qs, ks, vs = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
        torch.testing.assert_close(q.float(), rotate(qs.view(B, Q, heads, hd), pos[:, :, None]), **tol)
        want_k = rotate(ks.view(B, Q, kv_heads, hd), pos[:, :, None])
        for b in range(B):
            for j in range(Q):
                if b == 1 and j >= 4:
                    continue
                w = int(write[b, j])
                torch.testing.assert_close(k_cache[b, :, w].float(), want_k[b, j], **tol)
                torch.testing.assert_close(v_cache[b, :, w].float(), vs.view(B, Q, kv_heads, hd)[b, j], **tol)
        assert not k_cache[1, :, 4:40].any() and not k_cache[0, :, :5].any()  # nothing else written
    att, wo, res = rand(B, Q, heads * hd), rand(d, heads * hd, scale=(heads * hd) ** -0.5), rand(B, Q, d)
    torch.testing.assert_close(fused_linear.linear_residual(att, wo, res).float(),
                               (res.float() + torch.nn.functional.linear(att, wo).float()), **tol)
    w13 = rand(2 * inter, d, scale=d ** -0.5)
    gate, up = torch.nn.functional.linear(rms(res, nw), w13).float().chunk(2, -1)
    torch.testing.assert_close(fused_linear.norm_gate_up(res, nw, 1e-5, w13).float(),
                               torch.nn.functional.silu(gate) * up, **tol)


def test_fused_linear_prefill_does_not_depend_on_the_prompts_beside_it(tiny_checkpoint, where):
    """With fused-linear a prompt's K/V cache after its prefill is bitwise the same whether it was
    prefilled alone or in one forward with longer and shorter prompts (fixed 64-row tiles; the plain
    fused path's prefill GEMMs are cuBLAS's, whose kernel depends on the number of rows)."""
    device, dtype = where
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    rng = random.Random(3)
    vocab = ckpt.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(40)]
    others = [[rng.randrange(vocab) for _ in range(n)] for n in (70, 9)]
    caches = []
    for batch in ([prompt], [others[0], prompt, others[1]]):
        runner = _runner(ckpt, "fused-linear", 3, dtype=dtype, device=device, max_seq_len=128)
        for _ in batch:
            runner.cache.allocate()
        runner.prefill(dict(enumerate(batch)))
        s = batch.index(prompt)
        n = runner.cache.lengths[s]
        caches.append((runner.cache.k[:, s, :, :n].clone(), runner.cache.v[:, s, :, :n].clone()))
    for alone, beside in zip(caches[0], caches[1]):
        torch.testing.assert_close(beside, alone, rtol=1e-4, atol=1e-4)
    if device.type == "cpu" and not _host_matmul_is_row_invariant():
        pytest.skip("the interpreter's tl.dot is numpy's matmul, and this host's BLAS gives a row a result that "
                    "depends on its place in the tile (checked above to 1e-4; bitwise on the GPU)")
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def _host_matmul_is_row_invariant() -> bool:
    """Whether numpy's float32 matmul (what Triton's interpreter runs for ``tl.dot``) gives rows the
    same bits wherever they sit in a 64-row tile: true of some BLAS kernels, not of others (OpenBLAS
    on an AMD EPYC differs by 1e-5)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 64), dtype=np.float32), rng.standard_normal((64, 96), dtype=np.float32)
    moved = np.zeros_like(a)
    moved[6:46] = a[:40]
    return bool(np.array_equal((a @ b)[:40], (moved @ b)[6:46]))


def _skip_bitwise_where_host_matmul_varies(device: torch.device) -> None:
    """Skip what is left of a test (its bitwise checks) under Triton's interpreter on a host whose
    BLAS gives a row a result that depends on its place in the tile: a tree step gives each token an
    attention tile of its own, a chain packs them, so a tree node and its chain row meet numpy's
    matmul at different places (the test checked them to a tolerance first; bitwise on the GPU)."""
    if device.type == "cpu" and not _host_matmul_is_row_invariant():
        pytest.skip("the interpreter's tl.dot is numpy's matmul, and this host's BLAS gives a row a result that "
                    "depends on its place in the tile (checked to a tolerance; bitwise on the GPU)")


def _random_qkv(where, seed: int, B: int, Q: int, heads: int, kv_heads: int, hd: int, positions: int):
    """Seeded random q ``[B, Q, heads, hd]`` and a K/V cache ``[B, kv_heads, positions, hd]`` each."""
    device, dtype = where
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(B, Q, heads, hd, device=device, generator=gen).to(dtype),
            *(torch.randn(B, kv_heads, positions, hd, device=device, generator=gen).to(dtype) for _ in range(2)))


def test_tree_attention_matches_masked_attention(where):
    """``gqa_attention`` with per-token tree bits against float32 attention with the explicit mask
    (the cache before the new tokens, then the token's ancestors and itself); a chain's bits give
    bitwise the causal kernel's result."""
    device, dtype = where
    B, Q, heads, kv_heads, hd, positions = 3, 6, 6, 2, 64, 200
    q, k, v = _random_qkv(where, 5, B, Q, heads, kv_heads, hd, positions)
    seqlens = torch.tensor([Q + 10, Q + 130, Q], device=device, dtype=torch.int32)
    parents = [[-1, 0, 0, 1, 2, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 1, 4]]  # row 1: a chain
    mask = torch.zeros(B, Q, Q, dtype=torch.bool, device=device)
    for b, ps in enumerate(parents):
        for i, p in enumerate(ps):
            mask[b, i, i] = True
            if p >= 0:
                mask[b, i] |= mask[b, p]
    bits = (mask.to(torch.int32) << torch.arange(Q, device=device, dtype=torch.int32)).sum(-1, dtype=torch.int32)
    got = gqa_attention(q, k, v, seqlens, bits).float()
    g = heads // kv_heads
    keys = torch.arange(positions, device=device)
    prefix = (seqlens.long() - Q)[:, None]  # [B, 1]
    rel = keys[None, :] - prefix  # [B, L]
    new_seen = mask.gather(2, rel.clamp(0, Q - 1)[:, None, :].expand(B, Q, positions))
    visible = (rel < 0)[:, None, :] | ((rel >= 0) & (rel < Q))[:, None, :] & new_seen  # [B, Q, L]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1),
        attn_mask=visible[:, None]).transpose(1, 2)
    err = (got - want).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), err
    chain = gqa_attention(q, k, v, seqlens)
    tree_chain = gqa_attention(q, k, v, seqlens, bits)[1]
    torch.testing.assert_close(tree_chain, chain[1], rtol=1e-5, atol=1e-5)
    _skip_bitwise_where_host_matmul_varies(device)
    assert torch.equal(tree_chain, chain[1])  # the chain row: bitwise causal


def test_fused_tree_steps_match_the_reference_and_keep_chain_rows_exact(tiny_checkpoint, where):
    """A verify step with token trees on the fused path: tree rows' logits as accurate as the
    reference path's (which masks the whole cache), and a chain row's logits bitwise those it gets
    in a step without trees of the same shape, so trees in a round leave the other rows lossless."""
    device, dtype = where
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    rng = random.Random(7)
    vocab = ckpt.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((30, 12, 50))}
    runners = [_runner(ckpt, "reference", 3, dtype=torch.float32, device=device, max_seq_len=128),
               _runner(ckpt, "reference", 3, dtype=dtype, device=device, max_seq_len=128),
               _runner(ckpt, "fused", 3, dtype=dtype, device=device, max_seq_len=128)]
    for r in runners:
        for _ in prompts:
            r.cache.allocate()
        r.prefill(prompts)
    step = {s: [rng.randrange(vocab) for _ in range(5)] for s in prompts}
    trees = {0: [-1, 0, 0, 1, 2], 2: [-1, 0, 1, 1, 3]}  # slot 1 is a chain
    outs = [r.step(step, trees=trees) for r in runners]
    for s in prompts:
        e_ref, e_fused = (_rel_err(o.logits[s, :5], outs[0].logits[s, :5]) for o in outs[1:])
        assert e_fused <= max(1.5 * e_ref, 1e-3), (s, e_ref, e_fused)
    fused = runners[2]
    for s in prompts:
        fused.cache.truncate(s, len(prompts[s]))
    chain_only = fused.step(step)
    torch.testing.assert_close(chain_only.logits[1, :5], outs[2].logits[1, :5], rtol=1e-4, atol=1e-4)
    _skip_bitwise_where_host_matmul_varies(device)
    assert torch.equal(chain_only.logits[1, :5], outs[2].logits[1, :5])


@pytest.mark.parametrize("chunk", [0, 64], ids=["unsplit", "split64"])
def test_fused_tree_rows_are_bitwise_the_chain_rows_they_stand_for(tiny_checkpoint, where, chunk):
    """A token tree's node, verified in one fused step with its siblings and cousins, gets bitwise
    the logits its path gets as a chain (the node at depth d: the chain's token d), in every layer
    of the model, unsplit and with split-KV chunks that the new tokens straddle (positions 60-66
    over 64-position chunks): the attention reads the node's ancestors at the chain's positions, so
    greedy trees are lossless in bf16 as chains are, not only close."""
    device, dtype = where
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    rng = random.Random(11)
    vocab = ckpt.config.vocab_size
    prompt = {0: [rng.randrange(vocab) for _ in range(60)]}
    parents = [-1, 0, 0, 1, 2, 2, 4]
    tokens = [rng.randrange(vocab) for _ in parents]
    runner = ModelRunner(ckpt, RunnerConfig(device=str(device), dtype=dtype, max_batch_size=1, max_seq_len=128,
                                            kernels="fused", attention_chunk=chunk))
    runner.cache.allocate()
    runner.prefill(prompt)
    tree = runner.step({0: tokens}, trees={0: parents}).logits[0]
    bitwise = device.type != "cpu" or _host_matmul_is_row_invariant()
    for node in range(len(parents)):
        path, i = [], node
        while i >= 0:
            path.insert(0, i)
            i = parents[i]
        runner.cache.truncate(0, len(prompt[0]))
        # as wide as the tree step (the tokens after the path change nothing before them), so the
        # comparison is the attention's alone wherever the projections' bits depend on the width
        padded = [tokens[i] for i in path] + tokens[:len(parents) - len(path)]
        chain = runner.step({0: padded}).logits[0]
        torch.testing.assert_close(chain[len(path) - 1], tree[node], rtol=1e-4, atol=1e-4)
        assert not bitwise or torch.equal(chain[len(path) - 1], tree[node]), (node, path)
    _skip_bitwise_where_host_matmul_varies(device)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_slot_attention_is_sdpa_over_the_projection_rows(where, causal):
    """SpecFormer's draft-slot attention as one kernel: the scaled dot-product attention of q, k
    and v split from the QKV projection's rows (``[L, 3, heads, head_dim]`` per sequence), written
    as the output projection reads it; l_d 4, 6 (a padded tile) and 8, and no sequences at all."""
    device, dtype = where
    gen = torch.Generator(device=device).manual_seed(3)
    heads, hd = 9, 64
    for N, L in ((5, 4), (3, 6), (2, 8), (0, 4)):
        qkv = torch.randn(N, L, 3 * heads * hd, device=device, generator=gen).to(dtype)
        q, k, v = qkv.float().view(N, L, 3, heads, hd).permute(2, 0, 3, 1, 4)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        got = kernels.slot_attention(qkv, heads, hd, causal)
        assert got.shape == (N, L, heads * hd) and got.dtype == dtype
        err = (got.float() - want.transpose(1, 2).reshape(N, L, heads * hd)).abs().max().item() if N else 0.0
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (N, L, err)
    with pytest.raises(ValueError, match="9 heads of 64"):
        kernels.slot_attention(torch.zeros(1, 4, 100, device=device, dtype=dtype), heads, hd)


def test_head_glue_kernels_equal_the_fused_ops_they_replace(where):
    """The SpecFormer head's glue kernels (``head_kernels``) give what the launches they replace
    give: ``tap_rmsnorm`` each tap's ``add_rmsnorm`` concatenated, bitwise; ``draft_input`` the
    slots' input (context state + position rows + the lookup continuation's normalised embedding,
    zero where there is none, + the match row of the clamped match length), each add rounded, and
    the draft norm of it; without a lookup, context state + position rows and its norm. Bitwise
    under the interpreter; on a GPU within a bf16 rounding (there the compiler may sum a norm's
    squares in another order than in ``add_rmsnorm``: a few elements one unit apart)."""
    from tandem.models import head_kernels

    device, dtype = where
    gen = torch.Generator(device=device).manual_seed(11)
    d, T, eps = 576, 4, 1e-5
    taps = torch.randn(3, 5, T, d, device=device, generator=gen).to(dtype)
    w = torch.randn(T, d, device=device, generator=gen).to(dtype)
    got = head_kernels.tap_rmsnorm(taps, w, eps)
    want = torch.cat([kernels.add_rmsnorm(taps[..., t, :].contiguous(), None, w[t], eps)[0] for t in range(T)], -1)
    assert got.shape == (3, 5, T * d) and torch.equal(got, want)
    with pytest.raises(ValueError, match="weight"):
        head_kernels.tap_rmsnorm(taps, w[:2], eps)

    N, L, V = 4, 4, 50
    h = torch.randn(N, d, device=device, generator=gen).to(dtype)
    pos = torch.randn(N, L, d, device=device, generator=gen).to(dtype)
    embed = torch.randn(V, d, device=device, generator=gen).to(dtype)
    lw, dw = (torch.randn(d, device=device, generator=gen).to(dtype) for _ in range(2))
    table = torch.randn(5, d, device=device, generator=gen).to(dtype)
    cont = torch.tensor([[3, 7, -1, -1], [-1] * 4, [1, 2, 3, 4], [49, 0, 5, -1]], device=device)
    match = torch.tensor([2, 0, 4, 9], device=device)  # 9: past the table, clamped to its last row
    x, normed = head_kernels.draft_input(h, pos, dw, eps, (cont, match, embed, lw, table))
    emb = embed[cont.clamp(min=0)] * (cont >= 0)[..., None].to(dtype)
    ref = h[:, None] + pos
    ref = ref + kernels.add_rmsnorm(emb.contiguous(), None, lw, eps)[0]
    ref = ref + table[match.clamp(0, 4)][:, None]
    if dtype == torch.float32:
        assert torch.equal(x, ref) and torch.equal(normed, kernels.add_rmsnorm(ref, None, dw, eps)[0])
    else:
        torch.testing.assert_close(x, ref, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(normed, kernels.add_rmsnorm(x, None, dw, eps)[0], atol=2e-2, rtol=1e-2)
    x, normed = head_kernels.draft_input(h, pos, dw, eps)
    ref = h[:, None] + pos
    assert torch.equal(x, ref) and torch.equal(normed, kernels.add_rmsnorm(ref, None, dw, eps)[0])
    x, normed = head_kernels.draft_input(h[:0], pos[:0], dw, eps)
    assert x.shape == normed.shape == (0, L, d)


def test_row_argmax_is_torch_argmax_with_its_ties(where):
    """``row_argmax`` gives ``torch.argmax``'s index for every row of ``[..., V]`` logits, ties
    included (the first maximum, also when equal maxima sit in different parts of the first pass),
    for a vocabulary that is not a multiple of a part, rows whose maximum is in the last, partial
    part, rows of -inf, and rows of a strided view."""
    device, dtype = where
    gen = torch.Generator(device=device).manual_seed(5)
    V = 3 * 4096 + 123
    x = torch.randn(7, V, device=device, generator=gen).to(dtype)
    x[1, 5000] = x[1, 9000] = 50.0  # equal maxima in blocks 1 and 2: the first
    x[2, 17] = x[2, 18] = 50.0  # equal maxima in one block
    x[3, V - 1] = 50.0  # the last column
    x[4] = 1.0  # all equal: index 0
    x[5] = float("-inf")  # all -inf: index 0, as torch.argmax
    x[6, V - 100] = x[6, V - 50] = 60.0  # equal maxima in the last, partial part
    assert torch.equal(kernels.row_argmax(x), x.argmax(-1))
    assert kernels.row_argmax(x)[1].item() == 5000
    three = x[:6].view(2, 3, V)
    assert torch.equal(kernels.row_argmax(three), three.argmax(-1))
    wide = torch.randn(4, 2 * V, device=device, generator=gen).to(dtype)[:, :V]  # rows strided, columns not
    assert torch.equal(kernels.row_argmax(wide), wide.argmax(-1))
    assert kernels.row_argmax(x[:0]).shape == (0,)


def test_split_kv_counters_cover_a_runners_steps_and_grow_without_freeing():
    """The split attention's arrival counters: sized for a runner's widest decode or tree step and
    largest prefill bucket (SmolLM2-135M: 3 KV heads of 3 query heads), and a larger need replaces
    the buffer while the old one stays alive (graphs captured over it keep counting there)."""
    # 256 rows x 16 tokens (a tree step: a tile per token) x 3 KV heads; a 16,384-position prefill
    assert attention.counters_needed(256, 3, 3, 16, 16384) == 3 * max(256 * 16, 16384 * 3 // 16 + 256)
    assert attention.counters_needed(8, 8, 32, 16, 64) == 8 * 8 * 16 * 2  # 32 query heads a KV head: 2 tiles
    device = torch.device("cpu")
    first = attention.prepare_counters(device)
    assert first.numel() >= attention.COUNTERS and not first.any()
    bigger = attention.prepare_counters(device, first.numel() + 1)
    assert bigger.numel() > first.numel() and any(t is first for t in attention._RETIRED)
    assert attention.prepare_counters(device, 10) is bigger  # a smaller need keeps it


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_split_kv_attention_matches_and_is_batch_invariant(where, tree):
    """Split-KV over fixed 64-position chunks (``chunk``): the same attention as the unsplit kernel
    within rounding, rows short and long (one chunk, several, a chunk past a row's end); a row's
    result bitwise the same alone or in a batch, and for its first tokens whatever its width. The
    launch merges its chunks itself (the last program of a tile): its arrival counters are back at
    zero after it, so a launch repeated (a CUDA graph replayed) gives the same bits."""
    device, dtype = where
    B, Q, heads, kv_heads, hd, positions = 4, 5, 6, 2, 64, 330
    q, k, v = _random_qkv(where, 11, B, Q, heads, kv_heads, hd, positions)
    seqlens = torch.tensor([Q, 70, 300, 129], device=device, dtype=torch.int32)
    bits = None
    if tree:  # token 2 branches off token 0; the rest a chain
        parents = [-1, 0, 0, 1, 3]
        rows = []
        for i, p in enumerate(parents):
            rows.append((1 << i) | (rows[p] if p >= 0 else 0))
        bits = torch.tensor([rows] * B, device=device, dtype=torch.int32)
    whole = gqa_attention(q, k, v, seqlens, bits)
    split = gqa_attention(q, k, v, seqlens, bits, chunk=64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (split.float() - whole.float()).abs().max().item() < tol
    assert not attention.prepare_counters(device).any()
    assert torch.equal(gqa_attention(q, k, v, seqlens, bits, chunk=64), split)
    for b in range(B):  # alone: the same bits
        alone = gqa_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], seqlens[b:b + 1],
                              None if bits is None else bits[b:b + 1], chunk=64)
        assert torch.equal(alone[0], split[b]), b
    if not tree:  # fewer tokens: the first ones unchanged
        short = gqa_attention(q[:, :2].contiguous(), k, v, seqlens - (Q - 2), chunk=64)
        assert torch.equal(short, split[:, :2])
    with pytest.raises(ValueError, match="multiple of 64"):
        gqa_attention(q, k, v, seqlens, chunk=100)


def test_kernels_compile_for_the_gpu_without_spills():
    """Every Triton kernel, in each specialisation the engine launches, compiles for sm_90 (H100/H200)
    with Triton's bundled ptxas and keeps its tiles in registers (no local-memory loads or stores
    in the disassembly): ``tests/kernel_compile.py``, in a process without the interpreter."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if kernels._modules() is None:
        pytest.skip("needs triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said aloud (it warns otherwise)
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_compile.py"))], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.count("OK  ") >= 25, res.stdout


def test_runner_with_split_kv_attention(tiny_checkpoint, where):
    """``RunnerConfig.attention_chunk`` reaches the attention kernel: prefill and a verify step
    are as accurate against a float32 forward as the unsplit runner's (relative error at most 1.5x
    its, or 1e-3, as ``test_fused_forward_is_as_accurate_as_the_reference``: in bf16 the two
    round differently, and the random tiny model's logits amplify a rounding step to ~0.15), and
    the runner names the split; a chunk that is not a multiple of 64 is a ConfigError."""
    device, dtype = where
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    rng = random.Random(9)
    vocab = ckpt.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((20, 5, 70))}  # 70: two chunks
    step = {s: [rng.randrange(vocab) for _ in range(4)] for s in prompts}
    outs = []
    for kernels, run_dtype, chunk in (("reference", torch.float32, 0), ("fused", dtype, 0), ("fused", dtype, 64)):
        runner = ModelRunner(ckpt, RunnerConfig(device=str(device), dtype=run_dtype, max_batch_size=3, max_seq_len=256,
                                                kernels=kernels, attention_chunk=chunk))
        if kernels == "fused":
            assert runner.attention_backend == ("triton-gqa-split64" if chunk else "triton-gqa")
        for _ in prompts:
            runner.cache.allocate()
        runner.prefill(prompts)
        outs.append(runner.step(step).logits[:, :4].float())
    exact, unsplit, split = outs
    for s in prompts:
        e_unsplit, e_split = _rel_err(unsplit[s], exact[s]), _rel_err(split[s], exact[s])
        assert e_split <= max(1.5 * e_unsplit, 1e-3), (s, e_unsplit, e_split)
    with pytest.raises(ConfigError, match="multiple of 64"):
        ModelRunner(ckpt, RunnerConfig(device=str(device), dtype=dtype, max_batch_size=1, max_seq_len=32,
                                       kernels="fused", attention_chunk=96))
    # unset, the chunk is the runner's default (by its slots) where our kernel runs, none on the reference path
    for kernels, backend in (("fused", f"triton-gqa-split{SMALL_BATCH_ATTENTION_CHUNK}"), ("reference", "sdpa-masked")):
        runner = ModelRunner(ckpt, RunnerConfig(device=str(device), dtype=dtype, max_batch_size=1, max_seq_len=32,
                                                kernels=kernels))
        assert runner.attention_backend == backend


@pytest.mark.parametrize("chunk", [0, 64], ids=["unsplit", "split64"])
def test_attention_with_rope_inside_equals_the_two_kernels(where, chunk):
    """``gqa_attention_rope`` (RoPE + the K/V write inside the attention) gives exactly what the
    RoPE + K/V-write kernel followed by ``gqa_attention`` gives: the real tokens' outputs and every
    cache position but the padding's, bitwise, for rows of every shape (one token, a full width, a
    row with padding, a row rotated past the tables' end, new tokens across a chunk boundary),
    alone or in the batch, its real token counts read in place from a strided column; a step wider
    than ``MAX_NEW`` is refused."""
    device, dtype = where
    torch.manual_seed(3)
    heads, kv_heads, hd, positions = 6, 2, 64, 200
    cos = torch.randn(positions, hd, device=device).to(dtype)
    sin = torch.randn(positions, hd, device=device).to(dtype)
    for Q, starts, lens in ((1, [0, 50, 199, 63], [1, 1, 1, 1]), (5, [0, 61, 197, 30], [5, 3, 5, 1]),
                            (16, [10, 120, 0, 56], [16, 9, 16, 2])):
        B = len(starts)
        qkv = torch.randn(B, Q, (heads + 2 * kv_heads) * hd, device=device).to(dtype)
        start = torch.tensor(starts, device=device)
        q_lens = torch.tensor(lens, device=device)
        seqlens = (start + Q).to(torch.int32)
        scratch = positions + Q
        base_k = torch.randn(B, kv_heads, scratch + 1, hd, device=device).to(dtype)
        base_v = torch.randn(B, kv_heads, scratch + 1, hd, device=device).to(dtype)
        k0, v0, k1, v1 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
        q = kernels.rope_kv_write_spans(qkv, cos, sin, start, q_lens, scratch, k0, v0, heads, kv_heads)
        want = gqa_attention(q, k0, v0, seqlens, chunk=chunk)
        column = torch.stack([start, q_lens], dim=1)[:, 1]  # read in place, as a step's packed inputs give it
        got = attention.gqa_attention_rope(qkv, cos, sin, column, k1, v1, seqlens, heads, chunk=chunk)
        for b in range(B):
            n = lens[b]
            assert torch.equal(got[b, :n], want[b, :n]), (Q, b)
            end = starts[b] + n  # the real tokens' positions written; padding goes nowhere (was: scratch)
            assert torch.equal(k1[b, :, :end], k0[b, :, :end]) and torch.equal(v1[b, :, :end], v0[b, :, :end]), (Q, b)
            alone = attention.gqa_attention_rope(qkv[b:b + 1], cos, sin, q_lens[b:b + 1], base_k[b:b + 1].clone(),
                                                 base_v[b:b + 1].clone(), seqlens[b:b + 1], heads, chunk=chunk)
            assert torch.equal(alone[0, :n], got[b, :n]), (Q, b)
    with pytest.raises(ValueError, match=f"at most {attention.MAX_NEW} tokens"):
        attention.gqa_attention_rope(torch.zeros(1, attention.MAX_NEW + 1, (heads + 2 * kv_heads) * hd, device=device,
                                                 dtype=dtype), cos, sin, torch.ones(1, device=device, dtype=torch.long),
                                     base_k[:1], base_v[:1], torch.full((1,), 40, device=device, dtype=torch.int32),
                                     heads)


def test_runner_steps_with_rope_inside_the_attention_keep_every_bit(tiny_checkpoint, where):
    """A fused runner whose chain steps take ``gqa_attention_rope`` (``Transformer.rope_in_attention``)
    gives the same logits and cache, bit for bit, as one that runs the RoPE + K/V-write kernel and
    the attention apart: ragged verify steps with idle rows, rollbacks between them, unsplit and
    split attention."""
    device, dtype = where
    ckpt = load_checkpoint(tiny_checkpoint("llama", **FUSED_SHAPE))
    rng = random.Random(4)
    vocab = ckpt.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((20, 5, 70))}  # 70: two chunks
    for chunk in (0, 64):
        runners = []
        for inside in (False, True):
            r = ModelRunner(ckpt, RunnerConfig(device=str(device), dtype=dtype, max_batch_size=3, max_seq_len=256,
                                               kernels="fused", attention_chunk=chunk))
            r.model.rope_in_attention = inside
            for _ in prompts:
                r.cache.allocate()
            r.prefill(prompts)
            runners.append(r)
        for step in range(3):
            app = {s: [rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for s in prompts if rng.random() < 0.8}
            app = app or {0: [1]}
            apart, inside = (r.step(app).logits.float().cpu() for r in runners)
            for s, toks in app.items():
                assert torch.equal(inside[s, :len(toks)], apart[s, :len(toks)]), (chunk, step, s)
            s = next(iter(app))
            for r in runners:
                r.cache.truncate(s, r.cache.lengths[s] - len(app[s]) + 1)
        for s in prompts:
            n = runners[0].cache.lengths[s]
            for name in ("k", "v"):
                assert torch.equal(getattr(runners[1].cache, name)[:, s, :, :n], getattr(runners[0].cache, name)[:, s, :, :n])
