"""A SpecFormer head's observe of admitted prompts packed end to end, beside the target's varlen
prefill (``RunnerConfig.prefill_varlen``, ``tandem.models.prefill``).

The padded prompt observe runs the head's context layers over (batch bucket x width bucket) rows,
one graph per group of the target's padded prefill: with the varlen prefill the prompts' tapped
states arrive per prompt, and this path runs them as the target did, packed end to end in the
target's (packed tokens, sequences) buckets: the context input and every context layer over the
real positions only, each prompt attending only to itself (``attention.varlen_causal_attention``),
each position's K/V written straight into its slot of the head's cache, one graph per bucket
captured when the head is bound. A prompt's context states are what the padded path gives it, to
rounding (the attention's kernel differs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..models import attention
from ..models.prefill import varlen_fields, varlen_idle, varlen_kv_targets
from ..models.transfer import to_device

if TYPE_CHECKING:
    from .base import TargetStates
    from .specformer import SpecFormerDrafter


def varlen_observe_key(T: int, S: int) -> tuple:
    return ("observe-varlen", T, S)


def observe_prompts_varlen(drafter: "SpecFormerDrafter", states: list["TargetStates"]) -> torch.Tensor | None:
    """The context states at each prompt's last position, ``[len(states), d]``, after the head's
    context layers ran over the prompts (every ``start`` 0) packed end to end, in the target's
    varlen groups; their K/V are in the head's cache. None when a graph capture failed (the
    drafter is then eager and the caller takes the padded path).

    Args:
        states: the admitted prompts' tapped states ``[len(prompt), len(taps), d]`` and, for
            ``context_next_token`` heads, each position's next token ``[len(prompt)]``.
    """
    pre = drafter.prefiller
    lens = {i: s.taps.shape[0] for i, s in enumerate(states)}
    out: list[torch.Tensor] = []
    for group in pre.varlen_groups(lens):  # ascending indices: the states' own order
        part = [states[i] for i in group]
        sizes = [lens[i] for i in group]
        T, S, max_len = pre.varlen_shape(sizes)
        host = pre.varlen_inputs(T, S, max_len, [s.slot for s in part], sizes)
        total = sum(sizes)
        flat = torch.cat([s.taps for s in part])  # [total, taps, d]
        nexts = (torch.cat([s.next_tokens.to(torch.long) if torch.is_tensor(s.next_tokens)
                            else to_device(torch.tensor(s.next_tokens, dtype=torch.long), flat.device) for s in part])
                 if drafter.head.config.context_next_token else None)

        def fill(inputs, flat=flat, nexts=nexts, host=host, total=total):
            x, nxt, packed = inputs
            x[:total] = flat.to(x.dtype)
            if nexts is not None:
                nxt[:total] = nexts
            packed.copy_(to_device(host, packed.device))

        last = drafter._replay(varlen_observe_key(T, S), _observe_fn(drafter, T, S, max_len),
                               lambda T=T, S=S: _inputs(drafter, T, S), fill)
        if last is None:
            return None
        out.append(last[:len(group)].clone())  # the next replay of this bucket overwrites the output
    return torch.cat(out)


def capture_varlen_observes(drafter: "SpecFormerDrafter") -> int:
    """Capture the observe graph of every (packed tokens, sequences) bucket of the target's varlen
    prefill (CUDA graphs only), over all-padding inputs (every K/V write to the scratch position).
    Returns the number captured; a failed capture leaves the head eager (``_replay``)."""
    pre = drafter.prefiller
    made = 0
    for T, S in pre.varlen_buckets():
        if varlen_observe_key(T, S) in drafter._captured:
            continue

        if drafter._replay(varlen_observe_key(T, S), _observe_fn(drafter, T, S, min(T, pre.max_width)),
                           lambda T=T, S=S: _inputs(drafter, T, S),
                           lambda inputs, T=T, S=S: varlen_idle(inputs[2], T, S)) is None:
            break
        made += 1
    return made


def _inputs(drafter: "SpecFormerDrafter", T: int, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The static inputs of a varlen observe bucket: tapped states ``[T, taps, d]`` (a view of one
    store every bucket shares), next tokens ``[T]`` and the packed layout of
    ``Prefiller.varlen_inputs`` ``[4 T + 2 S + 1]``."""
    cfg = drafter.head.config
    dev, dtype = drafter.k_cache.device, drafter.k_cache.dtype
    per = len(cfg.taps) * cfg.hidden_size
    if drafter._varlen_store is None:
        drafter._varlen_store = torch.zeros(drafter.prefiller.varlen_limit * per, device=dev, dtype=dtype)
    x = drafter._varlen_store[:T * per].view(T, len(cfg.taps), cfg.hidden_size)
    return (x, torch.zeros(T, dtype=torch.long, device=dev),
            torch.zeros(4 * T + 2 * S + 1, dtype=torch.long, device=dev))


def _observe_fn(drafter: "SpecFormerDrafter", T: int, S: int, max_len: int):
    """The head's context layers over one packed bucket: ``(x, next tokens, packed) -> [S, d]``
    context states at each sequence's last position (garbage past the prompts)."""
    head, target = drafter.head, drafter._target
    scratch = drafter.k_cache.shape[3] - 1

    def run(x: torch.Tensor, nxt: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        _, positions, slots, where, cu, last = varlen_fields(p, T, S)
        cu = cu.to(torch.int32)
        next_emb = target.embed(nxt)[None] if head.config.context_next_token else None
        h = head.context_input(x[None], next_emb)  # [1, T, d]
        pos = positions.clamp(max=target.rope_cos.shape[0] - 1)
        cos, sin = target.rope_cos[pos][None].to(h.dtype), target.rope_sin[pos][None].to(h.dtype)
        real, rows, at = varlen_kv_targets(slots, where, scratch)
        keep = real[:, None, None]
        for i, layer in enumerate(head.ctx):
            q, k, v = layer.qkv_rotated(h, cos, sin)  # [1, T, heads, hd], [1, T, kv_heads, hd]
            k_cache, v_cache = drafter.k_cache[i], drafter.v_cache[i]
            k_cache[rows, :, at] = torch.where(keep, k[0], torch.zeros_like(k[0])).to(k_cache.dtype)
            v_cache[rows, :, at] = torch.where(keep, v[0], torch.zeros_like(v[0])).to(v_cache.dtype)
            att = attention.varlen_causal_attention(q[0], k[0], v[0], cu, max_len)  # [T, heads, hd]
            h = layer.finish(h, att[None].transpose(1, 2))
        return h[0, last]

    return run
