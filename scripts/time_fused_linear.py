"""Time the fused-linear kernels (``tandem.models.fused_linear``) against the cuBLAS path they replace.

A decode or verify step's layer, attention aside, is four kernels with ``kernels="fused-linear"``
(RMSNorm + QKV + RoPE + K/V write, O projection + residual, RMSNorm + gate/up + SiLU-multiply, down
projection + residual) and eight on the plain fused path (add + RMSNorm, QKV GEMM, RoPE + K/V
write, O GEMM, add + RMSNorm, gate/up GEMM, SiLU-multiply, down GEMM). This times both, per kernel
and per layer, at the row counts a round has (batch x tokens a row), over as many layers' weights
as the model has so each layer's weights come from memory as in a step (not from L2), inside one
CUDA graph per measurement as the engine runs them; and for each cut of the launch (``Tiles``)
checks that a row's output is bitwise the same at every row count (batch invariance).

Needs a CUDA GPU with Triton. Shapes default to the bundled SmolLM2-135M's; weights are random.

    python3 scripts/time_fused_linear.py [--rows 1,5,16,64,320,640] [--layers 30] [--tiles default|grid]
                                         [--part cuts|layers|both]

Prints a table per kernel (µs a call) and one per layer, then the cut each row count does best
with; exit code 1 when a cut is not batch-invariant. ``--part layers`` (or ``both``) also times
whole layers in sequence, our attention included, on both paths.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F


def _time_graph(fn, reps: int = 20) -> float:
    """Milliseconds one call of ``fn`` takes replayed from a CUDA graph (median of ``reps``)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def rope_tables(head_dim: int, positions: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE tables ``(cos, sin)``, ``[positions, head_dim]`` each (base 10,000)."""
    half = head_dim // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    return (torch.cat([ang.cos(), ang.cos()], -1).to(device, dtype),
            torch.cat([ang.sin(), ang.sin()], -1).to(device, dtype))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,5,16,64,320,640", help="row counts (batch x tokens a row)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tiles", choices=("default", "grid"), default="grid",
                    help="default: the shipped decode tiles only; grid: a sweep of cuts beside them")
    ap.add_argument("--part", choices=("cuts", "layers", "both"), default="both",
                    help="cuts: the kernels and their cuts; layers: whole layers, attention included, both paths")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from tandem.models import fused_linear, kernels

    dev, dt = torch.device("cuda"), torch.bfloat16
    L, d, inter, H, KVH, hd = args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim
    rows_list = [int(r) for r in args.rows.split(",")]
    max_rows = max(rows_list)
    torch.manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dt)

    nw = [1.0 + rand(d, scale=0.1) for _ in range(L)]
    fw = [1.0 + rand(d, scale=0.1) for _ in range(L)]
    wqkv = [rand((H + 2 * KVH) * hd, d, scale=d ** -0.5) for _ in range(L)]
    wo = [rand(d, H * hd, scale=(H * hd) ** -0.5) for _ in range(L)]
    w13 = [rand(2 * inter, d, scale=d ** -0.5) for _ in range(L)]
    w2 = [rand(d, inter, scale=inter ** -0.5) for _ in range(L)]
    positions = 2048
    cos, sin = rope_tables(hd, positions, dev, dt)
    k_cache = torch.zeros(max_rows, KVH, positions, hd, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    x_all = rand(max_rows, 1, d)
    att_all = rand(max_rows, 1, H * hd)
    act_all = rand(max_rows, 1, inter)
    pos_all = torch.randint(0, positions - 16, (max_rows, 1), device=dev)

    cuts = [fused_linear.DECODE_TILES]
    if args.tiles == "grid":
        for bn, bk, st, w in itertools.product((16, 32), (64, 128), (3, 6), (4, 8)):
            cuts.append(fused_linear.Tiles(fused_linear.BLOCK_M, bn, bk, st, w))
        cuts.append(fused_linear.Tiles(fused_linear.BLOCK_M, 16, 256, 4, 8))
    seen, uniq = set(), []
    for c in cuts:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    cuts = uniq

    def fused_linear_calls(t, rows):
        x, att, act, pos = x_all[:rows], att_all[:rows], act_all[:rows], pos_all[:rows]
        return {
            "qkv": lambda: [fused_linear.norm_qkv_rope(x, nw[i], 1e-5, wqkv[i], None, cos, sin, pos, pos, k_cache[:rows],
                                                       v_cache[:rows], H, KVH, tiles=t) for i in range(L)],
            "o": lambda: [fused_linear.linear_residual(att, wo[i], x, tiles=t) for i in range(L)],
            "gate_up": lambda: [fused_linear.norm_gate_up(x, fw[i], 1e-5, w13[i], tiles=t) for i in range(L)],
            "down": lambda: [fused_linear.linear_residual(act, w2[i], x, tiles=t) for i in range(L)],
        }

    def cublas_calls(rows):
        x, att, act, pos = x_all[:rows], att_all[:rows], act_all[:rows], pos_all[:rows]

        def qkv():
            for i in range(L):
                h, _ = kernels.add_rmsnorm(x, x, nw[i], 1e-5)
                kernels.rope_kv_write(F.linear(h, wqkv[i]), cos, sin, pos, pos, k_cache[:rows], v_cache[:rows], H, KVH)

        def gate_up():
            for i in range(L):
                h, _ = kernels.add_rmsnorm(x, x, fw[i], 1e-5)
                kernels.silu_mul(F.linear(h, w13[i]))

        return {"qkv": qkv, "o": lambda: [F.linear(att, wo[i]) for i in range(L)], "gate_up": gate_up,
                "down": lambda: [F.linear(act, w2[i]) for i in range(L)]}

    if args.part in ("layers", "both"):
        _time_layers(rows_list, L, locals())
        if args.part == "layers":
            return 0

    names = ("qkv", "o", "gate_up", "down")
    table: dict[str, dict[tuple[str, int], float]] = {n: {} for n in names}
    invariant: dict[str, bool] = {}
    for rows in rows_list:
        for n, fn in cublas_calls(rows).items():
            table[n][("cublas path", rows)] = _time_graph(fn) * 1000 / L
    for t in cuts:
        label = f"bn{t.block_n} bk{t.block_k} st{t.stages} w{t.warps}" + (" (shipped)" if t == fused_linear.DECODE_TILES else "")
        ok = True
        ref = None
        for rows in rows_list:
            calls = fused_linear_calls(t, rows)
            for n in names:
                table[n][(label, rows)] = _time_graph(calls[n]) * 1000 / L
            # batch invariance: row 0's outputs at this row count against the smallest's
            x, att, act, pos = x_all[:rows], att_all[:rows], act_all[:rows], pos_all[:rows]
            outs = (fused_linear.norm_qkv_rope(x, nw[0], 1e-5, wqkv[0], None, cos, sin, pos, pos, k_cache[:rows],
                                               v_cache[:rows], H, KVH, tiles=t)[0],
                    fused_linear.linear_residual(att, wo[0], x, tiles=t)[0],
                    fused_linear.norm_gate_up(x, fw[0], 1e-5, w13[0], tiles=t)[0],
                    fused_linear.linear_residual(act, w2[0], x, tiles=t)[0])
            if ref is None:
                ref = [o.clone() for o in outs]
            else:
                ok &= all(torch.equal(a, b) for a, b in zip(outs, ref))
        invariant[label] = ok

    labels = ["cublas path"] + [k for k in invariant]
    head = "| cut | " + " | ".join(f"{r} rows" for r in rows_list) + " |"
    rule = "|---|" + "---:|" * len(rows_list)
    for n in names:
        print(f"\n{n} (µs a call)\n{head}\n{rule}")
        for lab in labels:
            print(f"| {lab} | " + " | ".join(f"{table[n][(lab, r)]:.2f}" for r in rows_list) + " |")
    print(f"\na layer's projections and what stands around them, attention aside (µs; invariant: a row's bits at every row count)\n"
          f"| cut | invariant | " + " | ".join(f"{r} rows" for r in rows_list) + " |\n|---|---|" + "---:|" * len(rows_list))
    layer = {lab: [sum(table[n][(lab, r)] for n in names) for r in rows_list] for lab in labels}
    for lab in labels:
        inv = "-" if lab == "cublas path" else ("yes" if invariant[lab] else "NO")
        print(f"| {lab} | {inv} | " + " | ".join(f"{v:.2f}" for v in layer[lab]) + " |")
    print("\nbest cut a row count:")
    for j, r in enumerate(rows_list):
        best = min(labels[1:], key=lambda lab: layer[lab][j])
        print(f"  {r} rows: {best}: {layer[best][j]:.2f} µs a layer against {layer['cublas path'][j]:.2f} on the cuBLAS path")
    return 0 if all(invariant.values()) else 1


def _time_layers(rows_list: list[int], L: int, env: dict) -> None:
    """Whole layers, our attention included, over ``L`` layers' weights: the cuBLAS path (nine
    kernels a layer) against the fused-linear path (five). Prints µs a layer."""
    from tandem.models import attention, fused_linear, kernels

    nw, fw, wqkv, wo, w13, w2 = (env[k] for k in ("nw", "fw", "wqkv", "wo", "w13", "w2"))
    cos, sin, k_cache, v_cache, H, KVH = (env[k] for k in ("cos", "sin", "k_cache", "v_cache", "H", "KVH"))
    chunk = 256
    attention.prepare_counters(torch.device("cuda"), attention.counters_needed(max(rows_list), KVH, H // KVH, 16, 0))

    def chain(path: str, rows: int):
        x0, pos = env["x_all"][:rows], env["pos_all"][:rows]
        seqlens = (pos[:, 0] + 1).to(torch.int32)
        kc, vc = k_cache[:rows], v_cache[:rows]

        def attend(q):
            return attention.gqa_attention(q, kc, vc, seqlens, chunk=chunk).reshape(rows, 1, H * q.shape[-1])

        def run():
            res, x = x0.contiguous(), x0.contiguous()
            for i in range(L):
                if path == "cublas path":  # the plain fused path's nine kernels
                    h, res = kernels.add_rmsnorm(x, res, nw[i], 1e-5)
                    q = kernels.rope_kv_write(F.linear(h, wqkv[i]), cos, sin, pos, pos, kc, vc, H, KVH)
                    x = F.linear(attend(q), wo[i])
                    h, res = kernels.add_rmsnorm(x, res, fw[i], 1e-5)
                    x = F.linear(kernels.silu_mul(F.linear(h, w13[i])), w2[i])
                else:
                    q = fused_linear.norm_qkv_rope(res, nw[i], 1e-5, wqkv[i], None, cos, sin, pos, pos, kc, vc, H, KVH)
                    res = fused_linear.linear_residual(attend(q), wo[i], res)
                    act = fused_linear.norm_gate_up(res, fw[i], 1e-5, w13[i])
                    res = fused_linear.linear_residual(act, w2[i], res)
            return [res]
        return run

    print(f"\nwhole layers with our attention (split-KV {chunk}), µs a layer")
    print("| path | " + " | ".join(f"{r} rows" for r in rows_list) + " |\n|---|" + "---:|" * len(rows_list))
    for path in ("cublas path", "fused-linear"):
        cells = [_time_graph(chain(path, rows)) * 1000 / L for rows in rows_list]
        print(f"| {path} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
