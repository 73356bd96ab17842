"""Time the fused path's elementwise kernels (RoPE + K/V write, SiLU-multiply) and our attention at each warp count.

Their programs are small (a RoPE program rotates one head of one token: 32 values a half), so
the warps a program takes decide how many programs the GPU holds at once. Each count is timed at
the row counts a round has (batch x tokens a row), over as many calls as the model has layers,
inside one CUDA graph, and checked to give the same bits as the shipped count (neither kernel
reduces, so it must).

Needs a CUDA GPU with Triton. Shapes default to the bundled SmolLM2-135M's.

    python3 scripts/time_small_kernels.py [--rows 1,5,64,320,640] [--layers 30] [--warps 1,2,4,8]
                                          [--parts elementwise,attention,sampling] [--chunks 1024,2048]

Prints a table per kernel (µs a call); exit code 1 when a count changed an elementwise kernel's
bit. The attention's table follows, at the shapes a round has, with whether its bits moved. The
sampling part times the sampling kernels (``tandem.sampling_kernels``) against the PyTorch ops
they replace (a sort for the top-k / top-p cut, a cumulative sum for the draw), rows of the
model's vocabulary in bf16, temperature 0.7 and top-p 0.9, and says whether the cuts agree, over
two kinds of rows: flat (N(0, 3) logits: a nucleus of thousands of tokens) and peaked (N(0, 2)
with 20 tokens raised by 12, as a language model's next-token logits mostly are: a nucleus of a
few); with ``--chunks``, the transform again at each chunk size (``sampling_kernels.CHUNK``, a
constant of the product: a row's bits depend on it, never on its batch); then the stop-token draw from p and q in place (``tandem.residual_kernel``) against the weights copied
out first.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,5,64,320,640", help="row counts (batch x tokens a row)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--chunks", default="",
                    help="sampling part: also time the transform with these chunk sizes (comma-separated)")
    ap.add_argument("--parts", default="elementwise,attention,sampling",
                    help="which tables: elementwise, attention, sampling (comma-separated)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if parts - {"elementwise", "attention", "sampling"}:
        ap.error(f"--parts: unknown {sorted(parts - {'elementwise', 'attention', 'sampling'})}")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    warps_list = [int(w) for w in args.warps.split(",")]
    same = True
    if "elementwise" in parts:
        same = _time_elementwise(args, warps_list)
    if "attention" in parts:
        _time_attention(args, warps_list)
    if "sampling" in parts:
        _time_sampling(args)
    return 0 if same else 1


def _time_elementwise(args, warps_list: list[int]) -> bool:
    """The elementwise kernels at each warp count; True when every count gave the shipped bits."""
    from tandem.models import kernels
    from time_fused_linear import _time_graph, rope_tables

    dev, dt = torch.device("cuda"), torch.bfloat16
    L, H, KVH, hd, inter = args.layers, args.heads, args.kv_heads, args.head_dim, args.intermediate
    rows_list = [int(r) for r in args.rows.split(",")]
    n = max(rows_list)
    torch.manual_seed(0)
    positions = 2048
    cos, sin = rope_tables(hd, positions, dev, dt)
    qkv = [torch.randn(n, 1, (H + 2 * KVH) * hd, device=dev).to(dt) for _ in range(L)]
    gu = [torch.randn(n, 1, 2 * inter, device=dev).to(dt) for _ in range(L)]
    k_cache = torch.zeros(n, KVH, positions, hd, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.randint(0, positions - 16, (n, 1), device=dev)

    calls = {
        "rope_kv_write": lambda r, w: [kernels.rope_kv_write(qkv[i][:r], cos, sin, pos[:r], pos[:r], k_cache[:r],
                                                             v_cache[:r], H, KVH, warps=w) for i in range(L)],
        "silu_mul": lambda r, w: [kernels.silu_mul(gu[i][:r], warps=w) for i in range(L)],
    }
    shipped = {"rope_kv_write": kernels.ROPE_KV_WARPS, "silu_mul": kernels.SILU_MUL_WARPS}
    same = True
    for name, call in calls.items():
        print(f"\n{name} (µs a call; shipped: {shipped[name]} warps)")
        print("| warps | " + " | ".join(f"{r} rows" for r in rows_list) + " |\n|---:|" + "---:|" * len(rows_list))
        for w in warps_list:
            cells = []
            for r in rows_list:
                cells.append(_time_graph(lambda: call(r, w)) * 1000 / L)
                same &= torch.equal(call(r, w)[0], call(r, shipped[name])[0])
            print(f"| {w} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    print(f"\nevery warp count gave the shipped count's bits: {'yes' if same else 'NO'}")
    return same


def _time_attention(args, warps_list: list[int]) -> None:
    """Our decode/verify attention (``gqa_attention``) at each warp count, for the shapes a round
    has: batch x tokens a row, a context of 100-600 positions of a 2,048-position cache, the
    runner's split-KV chunk (128 up to 4 slots, else 256). Another count may move a row's last bits
    (a cross-warp reduction), the same way for every row: the table says whether it did."""
    from tandem.models import attention
    from time_fused_linear import _time_graph

    dev, dt = torch.device("cuda"), torch.bfloat16
    L, H, KVH, hd = args.layers, args.heads, args.kv_heads, args.head_dim
    shapes = [(1, 1), (1, 5), (16, 5), (64, 1), (64, 5), (128, 5)]
    attention.prepare_counters(dev, attention.counters_needed(128, KVH, H // KVH, 16, 0))
    gen = torch.Generator(device="cpu").manual_seed(1)
    print("\ngqa_attention (µs a call; shipped: %d warps; bits: the same as the shipped count's)" % attention.ATTN_WARPS)
    print("| batch x tokens | chunk | " + " | ".join(f"{w} warps" for w in warps_list) + " | bits |\n|---|---:|"
          + "---:|" * len(warps_list) + "---|")
    for b, qn in shapes:
        chunk = 128 if b <= 4 else 256
        k = torch.randn(b, KVH, 2048, hd, generator=gen).to(dev, dt)
        v = torch.randn(b, KVH, 2048, hd, generator=gen).to(dev, dt)
        q = [torch.randn(b, qn, H, hd, generator=gen).to(dev, dt) for _ in range(L)]
        seqlens = torch.randint(100, 600, (b,), generator=gen).to(dev, torch.int32)
        ref = attention.gqa_attention(q[0], k, v, seqlens, chunk=chunk)
        cells, same = [], True
        for w in warps_list:
            cells.append(_time_graph(lambda: [attention.gqa_attention(q[i], k, v, seqlens, chunk=chunk, warps=w)
                                              for i in range(L)]) * 1000 / L)
            same &= torch.equal(attention.gqa_attention(q[0], k, v, seqlens, chunk=chunk, warps=w), ref)
        print(f"| {b} x {qn} | {chunk} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {'same' if same else 'moved'} |")


def _time_sampling(args) -> None:
    """The sampling kernels against the ops they replace, at the row counts a round samples (batch
    x verified positions), each call replayed from a CUDA graph."""
    from tandem import sampling, sampling_kernels
    from time_fused_linear import _time_graph

    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(2)
    print("\nsampling (µs a call; rows of %d bf16 logits, T = 0.7, top-p 0.9; 'same cut': the kernel keeps the "
          "tokens the ops keep)" % args.vocab)
    print("| rows | probs: kernel | probs: ops (sort) | draw: kernel | draw: ops (cumsum) | uniform: kernel | "
          "uniform: ops | same cut |\n|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = [(r, kind) for r in (int(x) for x in args.rows.split(",")) for kind in ("flat", "peaked")]
    by_chunk = []
    for r, kind in rows:
        if kind == "flat":
            logits = (torch.randn(r, args.vocab, generator=gen) * 3).to(dev, torch.bfloat16)
        else:
            x = torch.randn(r, args.vocab, generator=gen) * 2
            x.scatter_add_(1, torch.randint(0, args.vocab, (r, 20), generator=gen), torch.full((r, 20), 12.0))
            logits = x.to(dev, torch.bfloat16)
        temp = torch.full((r,), 0.7, device=dev)
        top_k = torch.zeros(r, dtype=torch.int64, device=dev)
        top_p = torch.full((r,), 0.9, device=dev)
        seed = torch.arange(r, dtype=torch.int64, device=dev) * 7919 + 1
        pos = torch.arange(r, dtype=torch.int64, device=dev) + 100
        u = torch.rand(r, generator=gen).to(dev)
        kernel_probs = lambda: sampling_kernels.sampling_probs(logits, temp, top_k, top_p)  # noqa: E731
        ops_on = sampling.round_kernels_on
        sampling.round_kernels_on = lambda device: False
        try:
            ops_probs = lambda: sampling.sampling_probs(logits, temp, top_k, top_p)  # noqa: E731
            ops_draw = lambda: sampling.sample_inverse_cdf(probs, u)  # noqa: E731
            ops_uniform = lambda: sampling.counter_uniform(seed, pos, 1)  # noqa: E731
            probs = kernel_probs()
            cells = [_time_graph(kernel_probs), _time_graph(ops_probs),
                     _time_graph(lambda: sampling_kernels.sample_inverse_cdf(probs, u)), _time_graph(ops_draw),
                     _time_graph(lambda: sampling_kernels.counter_uniform(seed, pos, 1)), _time_graph(ops_uniform)]
            same = torch.equal(kernel_probs() > 0, ops_probs() > 0)
        finally:
            sampling.round_kernels_on = ops_on
        print(f"| {r} {kind} | " + " | ".join(f"{c * 1000:.1f}" for c in cells) + f" | {'yes' if same else 'NO'} |")
        if args.chunks:
            shipped, cells = sampling_kernels.CHUNK, []
            try:
                for c in (int(x) for x in args.chunks.split(",")):
                    sampling_kernels.CHUNK = c
                    cells.append(f"{_time_graph(kernel_probs) * 1000:.1f}"
                                 f"{'' if torch.equal(kernel_probs() > 0, probs > 0) else ' (cut moved)'}")
            finally:
                sampling_kernels.CHUNK = shipped
            by_chunk.append(f"| {r} {kind} | " + " | ".join(cells) + " |")
    if by_chunk:
        print(f"\nthe transform by chunk size (µs a call; shipped: {sampling_kernels.CHUNK})")
        print("| rows | " + " | ".join(args.chunks.split(",")) + " |\n|---:|" + "---:|" * len(args.chunks.split(",")))
        print("\n".join(by_chunk))
    _time_stop_token(args)


def _time_stop_token(args) -> None:
    """The token a sampled verify step emits after the accepted drafts: drawn from p and q in place
    (``residual_kernel.sample_stop_tokens``) against the weights copied out first
    (``verify.stop_weights``, then the inverse-CDF kernel), for batches of 5-token chains."""
    from tandem import residual_kernel, sampling_kernels
    from tandem.verify import stop_weights
    from time_fused_linear import _time_graph

    dev, K = torch.device("cuda"), 4
    gen = torch.Generator(device="cpu").manual_seed(3)
    print("\nstop token (µs a call; [B, 5, %d] p, [B, 4, V] q; 'same': the same tokens)" % args.vocab)
    print("| batch | in place | weights copied out | same |\n|---:|---:|---:|---|")
    for b in (1, 16, 64, 128):
        p = torch.rand(b, K + 1, args.vocab, generator=gen).to(dev) ** 8
        p /= p.sum(-1, keepdim=True)
        q = torch.rand(b, K, args.vocab, generator=gen).to(dev) ** 8
        q /= q.sum(-1, keepdim=True)
        tokens = torch.randint(0, args.vocab, (b, K), generator=gen).to(dev)
        lens = torch.full((b,), K, device=dev)
        accepted = torch.randint(0, K + 1, (b,), generator=gen).to(dev)
        u = torch.rand(b, generator=gen).to(dev)
        fused = lambda: residual_kernel.sample_stop_tokens(p, q, tokens, lens, accepted, u)  # noqa: E731
        apart = lambda: sampling_kernels.sample_inverse_cdf(  # noqa: E731
            stop_weights(p, q, tokens, lens, accepted), u)
        same = torch.equal(fused(), apart())
        print(f"| {b} | {_time_graph(fused) * 1000:.1f} | {_time_graph(apart) * 1000:.1f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    sys.exit(main())
