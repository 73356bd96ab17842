"""Compile every Triton kernel of the fused path for sm_90 (an H100/H200) without a GPU.

Run as a script in a process without ``TRITON_INTERPRET`` (the tests' conftest turns it on):
Triton's bundled ptxas takes each kernel, in each specialisation the engine launches, to a cubin.
This catches what the interpreter cannot: typing and lowering errors, and register spills (local
memory loads and stores, ``LDL``/``STL``, in the disassembly by the bundled nvdisasm). Prints a
line per kernel; exits 1 when any fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile



def main() -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("run without TRITON_INTERPRET")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tandem.drafters import lookup_kernel
    from tandem import residual_kernel, sampling_kernels, verify_kernel
    from tandem.models import attention, fused_linear, head_kernels, kernels

    target = GPUTarget("cuda", 90, 32)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    failed = 0

    def build(fn, signature: dict, constexprs: dict, name: str, warps: int = 4, stages: int = 3) -> None:
        nonlocal failed
        sig = {**signature, **{k: "constexpr" for k in constexprs}}
        try:
            k = triton.compile(ASTSource(fn, sig, constexprs), target=target, options={"num_warps": warps, "num_stages": stages})
        except Exception as exc:  # a kernel that does not compile: the report names it
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:2000]}")
            return
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([nvdisasm, f.name], capture_output=True, text=True, check=True).stdout
        spills = sass.count("LDL") + sass.count("STL")
        failed += spills > 0
        print(f"{'FAIL' if spills else 'OK  '} {name} ({warps} warps, {stages} stages): {len(k.asm['cubin'])} B cubin, "
              f"{spills} local-memory accesses (register spills)")

    bf, i32, i64, f32 = "*bf16", "i32", "i64", "fp32"
    add_rmsnorm, rope_kv, silu_mul = kernels._kernels()
    build(add_rmsnorm, dict(x_ptr=bf, res_ptr=bf, w_ptr=bf, out_ptr=bf, res_out_ptr=bf, n_cols=i32, eps=f32),
          dict(HAS_RES=True, BLOCK=1024), "add_rmsnorm")
    for spans in (False, True):  # explicit positions; positions from each row's start and count
        build(rope_kv, dict(qkv_ptr=bf, cos_ptr=bf, sin_ptr=bf, pos_ptr="*i64", write_ptr="*i64", q_out_ptr=bf,
                            k_ptr=bf, v_ptr=bf, tokens_per_row=i32, k_sb=i64, k_sh=i64, k_sp=i64, qkv_stride=i32,
                            span_stride=i32, max_pos=i32, scratch=i32),
              dict(HEADS=9, KV_HEADS=3, HEAD_DIM=64, SPANS=spans), f"rope_kv spans={spans}",
              warps=kernels.ROPE_KV_WARPS)
    build(silu_mul, dict(gu_ptr=bf, out_ptr=bf, n_inter=i32), dict(BLOCK=1024), "silu_mul", warps=kernels.SILU_MUL_WARPS)
    attn = attention._attention_kernel()
    for tree, rope in ((False, False), (True, False), (False, True)):  # RoPE inside: chain steps only
        for chunk in (0, 256):
            part = "*fp32" if chunk else bf
            build(attn, dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, seqlen_ptr="*i32", tree_ptr="*i32", out_ptr=bf,
                             part_ptr=part, ml_ptr=part, count_ptr="*i32", cos_ptr=bf, sin_ptr=bf,
                             qlen_ptr="*i64" if rope else "*i32", qlen_stride=i32, n_tokens=i32, n_chunks=i32, scale_log2=f32,
                             k_sb=i64, k_sh=i64, k_sp=i64, qkv_stride=i32, max_pos=i32),
                  dict(GROUP=3, HEADS=9, HEAD_DIM=64, HAS_TREE=tree, CHUNK=chunk, BLOCK_M=attention.ATTN_BLOCK_M,
                       BLOCK_N=attention.ATTN_BLOCK_N, ROPE=rope, NEW=attention.MAX_NEW),
                  f"gqa_attention tree={tree} rope={rope} chunk={chunk}", warps=attention.ATTN_WARPS,
                  stages=attention.ATTN_STAGES)
    build(kernels._draft_features_kernel(), dict(x_ptr=bf, pos_ptr="*fp32", out_ptr="*fp32", n_cols=i32, x_stride=i32),
          dict(IS_PROBS=False, BLOCK=4096), "draft_features")
    for causal in (False, True):  # SpecFormer's draft slots: the shipped heads' l_d of 4, 6 and 8
        for L in (4, 8):
            build(kernels._slot_attention_kernel(), dict(qkv_ptr=bf, out_ptr=bf, L=i32, scale=f32),
                  dict(HEADS=9, HEAD_DIM=64, BLOCK_L=L, CAUSAL=causal), f"slot_attention L<={L} causal={causal}")
    argmax_part, argmax_merge = kernels._row_argmax_kernels()
    build(argmax_part, dict(x_ptr=bf, val_ptr="*fp32", idx_ptr="*i64", n_cols=i32, x_stride=i32, parts=i32),
          dict(BLOCK=kernels.ARGMAX_BLOCK), "row_argmax part")
    build(argmax_merge, dict(val_ptr="*fp32", idx_ptr="*i64", out_ptr="*i64", parts=i32), dict(PARTS=32),
          "row_argmax merge", warps=1)
    i64p = "*i64"
    tap_rmsnorm, draft_input = head_kernels._kernels()
    build(tap_rmsnorm, dict(x_ptr=bf, w_ptr=bf, out_ptr=bf, n_cols=i32, n_taps=i32, eps=f32), dict(BLOCK=1024),
          "tap_rmsnorm")
    for lookup in (False, True):
        build(draft_input, dict(h_ptr=bf, pos_ptr=bf, cont_ptr=i64p, match_ptr=i64p, emb_ptr=bf, lw_ptr=bf, mt_ptr=bf,
                                dw_ptr=bf, x_ptr=bf, out_ptr=bf, n_cols=i32, slots=i32, max_match=i32, eps=f32),
              dict(LOOKUP=lookup, BLOCK=1024), f"draft_input lookup={lookup}")
    for k, support in ((4, False), (8, True)):  # n-gram and the head's lookup; the context-aware n-gram's evidence
        build(lookup_kernel._kernel(), dict(hist_ptr=i64p, last_ptr=i64p, room_ptr=i64p, cont_ptr=i64p, lens_ptr=i64p,
                                            match_ptr=i64p, support_ptr=i64p, survivors_ptr=i64p, C=i32,
                                            hist_stride=i32),
              dict(K=k, KP=k, MAX_N=4, MIN_N=1, LP=8, WITH_SUPPORT=support, BLOCK=lookup_kernel.BLOCK),
              f"ngram_lookup k={k} support={support}")
    for q in (1, 5, 9):  # target-only, k = 4, k = 8
        build(verify_kernel._kernel(), dict(argmax_ptr=i64p, inputs_ptr=i64p, chain_ptr="*i1", length_ptr=i64p,
                                            last_ptr=i64p, hist_ptr=i64p, packed_ptr=i64p, accepted_ptr=i64p,
                                            tokens_ptr=i64p, argmax_stride=i32, in_stride=i32, hist_stride=i32),
              dict(Q=q, QP=kernels._pow2(q)), f"greedy_round q={q}", warps=1)
    for stream in (0, 1, 2):
        build(sampling_kernels._uniform_kernel(), dict(seed_ptr=i64p, pos_ptr=i64p, out_ptr="*fp32", n=i32, per_row=i32),
              dict(STREAM_KEY=sampling_kernels.stream_key(stream), BLOCK=sampling_kernels.UNIFORM_BLOCK),
              f"counter_uniform stream {stream}")
    stats, search, write, row_kernel = sampling_kernels._sampling_kernels()
    chunk = dict(CHUNK_=sampling_kernels.CHUNK, BLOCK=sampling_kernels.SEARCH_BLOCK)
    search_args = dict(t_ptr="*fp32", k_ptr=i64p, p_ptr="*fp32", pm_ptr="*fp32", pz_ptr="*fp32", pk_ptr=i64p,
                       part_ptr="*fp32",
                       V=i32, x_stride=i32, B=i32, C=i32)
    cp = dict(CP=16, WAYS_=sampling_kernels.WAYS)
    for dt, bits in ((bf, 16), ("*fp32", 32)):
        n_pass = sampling_kernels.search_passes(bits)
        build(stats, dict(x_ptr=dt, t_ptr="*fp32", pm_ptr="*fp32", pz_ptr="*fp32", pk_ptr=i64p, V=i32, x_stride=i32,
                          C=i32), dict(BITS=bits, **chunk), f"sampling_probs stats {bits}-bit",
              warps=sampling_kernels.CHUNK_WARPS)
        build(search, dict(x_ptr=dt, **search_args, g=i32), dict(NP=n_pass, BITS=bits, **chunk, **cp),
              f"sampling_probs search {bits}-bit", warps=sampling_kernels.CHUNK_WARPS)
        for filtered in (False, True):
            for sel in (False, True):
                build(write, dict(x_ptr=dt, **search_args, out_ptr="*fp32", sel_ptr="*i1", out_stride=i32),
                      dict(FILTER=filtered, HAS_SEL=sel, NP=n_pass, BITS=bits, **chunk, **cp),
                      f"sampling_probs write {bits}-bit{' filtered' if filtered else ''}{' chosen rows' if sel else ''}",
                      warps=sampling_kernels.CHUNK_WARPS)
                build(row_kernel, dict(x_ptr=dt, t_ptr="*fp32", k_ptr=i64p, p_ptr="*fp32", out_ptr="*fp32",
                                       sel_ptr="*i1", V=i32, x_stride=i32, out_stride=i32),
                      dict(FILTER=filtered, HAS_SEL=sel, NP=n_pass, BITS=bits, BLOCK=sampling_kernels.SEARCH_BLOCK,
                           WAYS_=sampling_kernels.WAYS),
                      f"sampling_probs one-program row {bits}-bit{' filtered' if filtered else ''}"
                      f"{' chosen rows' if sel else ''}", warps=sampling_kernels.CHUNK_WARPS)
    sums, walk = sampling_kernels._inverse_cdf_kernels()
    draw = dict(CHUNK_=sampling_kernels.CHUNK, BLOCK=sampling_kernels.INVERSE_CDF_BLOCK)
    build(sums, dict(w_ptr="*fp32", ps_ptr="*fp32", pl_ptr="*i32", V=i32, w_stride=i32, C=i32), draw,
          "inverse_cdf sums", warps=sampling_kernels.CHUNK_WARPS)
    build(walk, dict(w_ptr="*fp32", u_ptr="*fp32", ps_ptr="*fp32", pl_ptr="*i32", out_ptr=i64p, V=i32, w_stride=i32,
                     C=i32), dict(**draw, CP=16), "inverse_cdf walk", warps=sampling_kernels.CHUNK_WARPS)
    stop_sums, stop_walk = residual_kernel._stop_token_kernels()
    stop_args = dict(p_ptr="*fp32", q_ptr="*fp32", tok_ptr=i64p, acc_ptr=i64p, lens_ptr=i64p, ps_ptr="*fp32",
                     pl_ptr="*i32", V=i32, p_sb=i32, p_sq=i32, q_sb=i32, q_sk=i32, tok_sb=i32, tok_sk=i32, Q=i32,
                     C=i32)
    for has_q in (False, True):
        build(stop_sums, stop_args, dict(HAS_Q=has_q, **draw), f"stop token sums{' with q' if has_q else ''}",
              warps=sampling_kernels.CHUNK_WARPS)
        build(stop_walk, dict(**stop_args, u_ptr="*fp32", out_ptr=i64p), dict(HAS_Q=has_q, **draw, CP=16),
              f"stop token walk{' with q' if has_q else ''}", warps=sampling_kernels.CHUNK_WARPS)
    qkv, linear, gate_up = fused_linear._kernels()
    for t in (fused_linear.DECODE_TILES, fused_linear.PREFILL_TILES):
        tile = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, STAGES=t.stages)
        for bias in (False, True):
            build(qkv, dict(x_ptr=bf, nw_ptr=bf, w_ptr=bf, b_ptr=bf, cos_ptr=bf, sin_ptr=bf, pos_ptr="*i64",
                            write_ptr="*i64", q_out_ptr=bf, k_ptr=bf, v_ptr=bf, n_rows=i32, K=i32, eps=f32,
                            tokens_per_row=i32, k_sb=i64, k_sh=i64, k_sp=i64),
                  dict(HEADS=9, KV_HEADS=3, HEAD_DIM=64, HAS_BIAS=bias, **{**tile, "BLOCK_N": min(t.block_n, 32)}),
                  f"norm_qkv_rope block_m={t.block_m} bias={bias}", warps=t.warps, stages=t.stages)
        build(linear, dict(a_ptr=bf, w_ptr=bf, res_ptr=bf, out_ptr=bf, n_rows=i32, K=i32, N=i32), tile,
              f"linear_residual block_m={t.block_m}", warps=t.warps, stages=t.stages)
        build(gate_up, dict(x_ptr=bf, nw_ptr=bf, w_ptr=bf, out_ptr=bf, n_rows=i32, K=i32, n_inter=i32, eps=f32), tile,
              f"norm_gate_up block_m={t.block_m}", warps=t.warps, stages=t.stages)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
