"""A greedy verify round's device epilogue in one Triton kernel: accept, bonus token, round-state
update and the host's packed row, one program per row.

After the forward of a round whose rows are all greedy (no sampled request, no logit adjustment,
no grammar mask), what is left is integer work on ``[B, k + 1]``: compare each draft with the
target's argmax, count the accepted prefix, take the argmax after it as the bonus (or
correction) token, write the emitted tokens into the slot's device history and its new length
and last token (``RoundState.advance``), and pack ``[start, q_len, accepted, tokens]`` for the
host's one copy. In plain ops (``verify_chains``, ``RoundState.advance``, the pack) that is about
thirty small kernels a round, in every configuration, target-only included; here it is one. The
results equal the plain ops' bit for bit (``tests/test_verify_kernel.py``, on the GPU and under
Triton's interpreter). Sampled rows, adjusted logits and grammar masks keep the plain path, whose
speculative sampling (Leviathan et al. 2023) needs the distributions.
"""

from __future__ import annotations

import functools

import torch

from .models import kernels
from .verify import ChainVerification


available = kernels.triton_runs_on  # where the kernel runs: CUDA with Triton, or the CPU under the interpreter


@functools.lru_cache(maxsize=1)
def _kernel():
    triton, tl = kernels._modules()

    @triton.jit
    def greedy_round_kernel(argmax_ptr, inputs_ptr, chain_ptr, length_ptr, last_ptr, hist_ptr, packed_ptr,
                            accepted_ptr, tokens_ptr, argmax_stride, in_stride, hist_stride,
                            Q: tl.constexpr, QP: tl.constexpr):
        # row r: inputs[r] = [start, q_len, last token, d_1 .. d_K, ...], argmax[r] = [Q] target
        # argmax after each input; K = Q - 1 drafts, the first q_len - 1 of them real
        row = tl.program_id(0).to(tl.int64)
        src = inputs_ptr + row * in_stride
        start = tl.load(src)
        q_len = tl.load(src + 1)
        chain = tl.load(chain_ptr + row).to(tl.int64)
        j = tl.arange(0, QP).to(tl.int64)
        draft_len = tl.where(chain != 0, tl.maximum(q_len - 1, 0), 0)
        drafts = tl.load(src + 3 + j, mask=j < Q - 1, other=0)  # [QP], 0 from K on (the bonus slot's padding)
        target = tl.load(argmax_ptr + row * argmax_stride + j, mask=j < Q, other=-1)
        match = (drafts == target) & (j < draft_len)
        accepted = tl.min(tl.where(match, QP, j), axis=0)  # the first mismatch ends the accepted prefix
        bonus = tl.sum(tl.where(j == accepted, target, 0), axis=0)
        tokens = tl.where(j == accepted, bonus, drafts)
        tl.store(tokens_ptr + row * Q + j, tokens, mask=j < Q)
        tl.store(accepted_ptr + row, accepted)
        out = packed_ptr + row * (Q + 3)
        tl.store(out, start)
        tl.store(out + 1, q_len)
        tl.store(out + 2, accepted)
        tl.store(out + 3 + j, tokens, mask=j < Q)
        # the round state of a row that ran (q_len > 0) on the chain path: kept length, last token,
        # the emitted tokens appended to the history (a vector mask with the condition folded in:
        # Triton's interpreter cannot take a vector AND a 0-d bool as a mask)
        keep = (chain != 0) & (q_len > 0)
        tl.store(length_ptr + row, tl.where(keep, start + 1 + accepted, tl.load(length_ptr + row)))
        tl.store(last_ptr + row, tl.where(keep, bonus, tl.load(last_ptr + row)))
        tl.store(hist_ptr + row * hist_stride + start + 1 + j, tokens, mask=j <= tl.where(keep, accepted, -1))

    return greedy_round_kernel


def greedy_round(argmax: torch.Tensor, inputs: torch.Tensor, chain: torch.Tensor, state
                 ) -> tuple[ChainVerification, torch.Tensor]:
    """``verify_chains`` for greedy rows, ``RoundState.advance`` and the host's packed rows in one
    launch.

    Args:
        argmax: ``[n, Q]`` int64 target argmax after each input of the step.
        inputs: ``[n, >= 2 + Q]`` int64 packed step inputs (start, q_len, the last token, the
            K = Q - 1 draft slots); rows with q_len 0 ran nothing.
        chain: ``[n]`` bool, rows verified as chains (others verify no drafts and keep their state).
        state: the target's ``RoundState`` (rows ``0 .. n-1`` are slots ``0 .. n-1``); its
            ``length``, ``last`` and ``history`` are updated in place.

    Returns:
        ``(ChainVerification, packed)``: accepted counts ``[n]`` and tokens ``[n, Q]`` as
        ``verify_chains`` gives them, and ``[n, 3 + Q]`` int64 rows of start, q_len, accepted,
        tokens.

    Raises:
        RuntimeError: not ``available`` on ``argmax``'s device.
        ValueError: ``state.history`` rows that are not contiguous.
    """
    if not available(argmax.device):
        raise RuntimeError(f"the greedy round kernel does not run on {argmax.device} here (CUDA with Triton, "
                           "or TRITON_INTERPRET=1 on a CPU)")
    n, Q = argmax.shape
    dev = argmax.device
    packed = torch.empty((n, 3 + Q), dtype=torch.int64, device=dev)
    accepted = torch.empty(n, dtype=torch.int64, device=dev)
    tokens = torch.empty((n, Q), dtype=torch.int64, device=dev)
    history = state.history
    if n:
        if history.stride(1) != 1:  # written in place: no copy can stand in for it
            raise ValueError("greedy_round: the round state's history rows must be contiguous")
        argmax = argmax if argmax.stride(1) == 1 else argmax.contiguous()
        inputs = inputs if inputs.stride(1) == 1 else inputs.contiguous()
        _kernel()[(n,)](argmax, inputs, chain, state.length, state.last, history, packed, accepted, tokens,
                        argmax.stride(0), inputs.stride(0), history.stride(0), Q=Q, QP=kernels._pow2(Q), num_warps=1)
    return ChainVerification(accepted, tokens), packed
