"""SpecFormer drafter: serves a SpecFormer head (``tandem.models.specformer``) inside the engine.

The head reads the target's tapped residual stream, so it drafts from the verify pass: the engine
hands it the tapped states of the accepted positions (``observe``) and no separate draft pass over
the target runs. This module owns what serving adds to the network: the head's context-attention
KV cache (kept beside the target's, same slots and position ids, rolled back with it), its CUDA
graphs per batch and context bucket, the host-drafted path (``observe`` then ``propose``) and the
chained path that drafts on the device after each verification (``device_after_verify``,
``device_prime``, ``device_drafts``, ``device_draft_probs``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.utils.rnn import pad_sequence

from ..models import attention, kernels
from ..models.attention import FLASH_HEAD_DIMS
from ..models.kernels import FUSED_HEAD_DIMS, MAX_FUSED_TOKENS
from ..models.kv_cache import KV_SLACK
from ..models.prefill import width_bucket
from ..models.runner import CapturedCall, batch_bucket, context_bucket
from ..models.transfer import to_device
# the head as a model; save_specformer and specformer_file are also imported from here by the CLI
from ..models.specformer import (SpecFormerHead, load_specformer, save_specformer, specformer_file,  # noqa: F401
                                 use_fused_kernels)
from .base import NUM_FEATURES, DraftProposal, DraftRequest, Drafter, KeepDrafting, TargetStates, draft_rows, synced_index
from .lookup import LookupIndex
from .specformer_chained import SERVING_SDPA, ChainedHead
from .specformer_prompts import capture_varlen_observes, observe_prompts_varlen

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_SPECFORMER = WEIGHTS_DIR / "specformer-smollm2-135m"  # shipped head for the bundled target

log = logging.getLogger(__name__)


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked grouped-query attention without expanding K/V: the query heads that share a KV head
    are stacked along the query dimension (query head h reads KV head h // group, as in
    ``enable_gqa``), so SDPA sees as many heads as K/V have. (With ``enable_gqa`` and a mask SDPA
    repeated K/V over the context: about 0.5 ms a round at batch 64 on an H200.)

    Args:
        q: ``[n, M, heads, hd]``; keys, values: ``[n, kv_heads, L, hd]``; mask: ``[n, 1, M, L]`` bool.

    Returns:
        ``[n, heads, M, hd]``.
    """
    n, M, nh, hd = q.shape
    kvh = keys.shape[1]
    g = nh // kvh
    qg = q.view(n, M, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(n, kvh, g * M, hd)
    att = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask.repeat(1, 1, g, 1))
    return att.view(n, kvh, g, M, hd).reshape(n, nh, M, hd)


@dataclass
class _Pending:
    length: int  # positions the head has seen for this slot (= the target's cache length)
    state: torch.Tensor = field(repr=False)  # [d] context state at the last accepted position
    # the bonus token (the token after that position; 0-d on the device after a prefill)
    bonus: int | torch.Tensor | None = None


class SpecFormerDrafter(ChainedHead, Drafter):
    """Drafts from the verify pass: the engine taps the target and calls ``observe``.

    Two paths, one head. Host-drafted rounds (a draft policy, verification logs): ``observe``
    after each round, then ``propose``. Chained rounds (``drafts_from_verify``): after each
    verification the round itself runs the head's context layers over the kept positions and its
    draft part, on the device (``device_after_verify``; one CUDA graph per shape), and leaves each
    slot's next drafts — and, for sampled requests, the q they were drawn from — in device buffers
    that the next round reads (``device_drafts``, ``device_draft_probs``). A slot's first chained
    round after its prefill drafts nothing (its drafts are made by that round).

    Args:
        head: a trained ``SpecFormerHead``.
        top_m: candidates kept per position for hard-position branching.

    The drafter is unusable until ``bind`` gives it the target runner (the engine does this).
    """

    name = "specformer"
    drafts_on_device = True
    drafts_from_verify = True

    def __init__(self, head: SpecFormerHead, top_m: int = 4) -> None:
        self.head = head.eval()
        self.max_draft_tokens = head.config.num_draft_tokens  # l_d slots a round
        self.top_m = top_m
        self.target_taps = head.config.taps
        self.pending: dict[int, _Pending] = {}
        self._lookups: dict[int, LookupIndex] = {}
        self._target = None
        self._fused = False  # the head runs the fused kernels (set by bind)
        self._attn_chunk = 0  # ... and the target's split-KV chunk in its context attention (set by bind)
        self._scorer = None  # set_acceptance_scorer: chained rounds score their drafts on the device
        # host-drafted proposals carry the head's draft-slot states (DraftProposal.states), for
        # verification logs (tandem collect-logs --states); their draft pass then runs eagerly
        self.record_states = False
        self._recorded: torch.Tensor | None = None  # [n, l_d, d] states of the last draft_logits call
        self._draft_scores: torch.Tensor | None = None

    @classmethod
    def load(cls, path: str | Path | None = None, top_m: int = 4) -> "SpecFormerDrafter":
        """Load a head (default: the one shipped for the bundled SmolLM2-135M target).

        Raises:
            ModelLoadError: see ``load_specformer``.
        """
        return cls(load_specformer(path or DEFAULT_SPECFORMER), top_m)

    def bind(self, runner) -> None:
        """Attach to the target ``ModelRunner`` (its final norm, LM head, RoPE tables, device, dtype)
        and allocate the context-attention KV cache ``[context_layers, slots, kv_heads, capacity + KV_SLACK, head_dim]``.
        On a runner that uses the fused kernels the head uses them too (``use_fused_kernels``; its
        context attention of chained rounds through ``attention.attention_with_kvcache``).

        Raises:
            ModelLoadError: the head was trained for a target of another shape.
            ValueError: the runner does not tap the head's depths.
        """
        cfg = self.head.config
        cfg.check_target(runner.model_config)
        if tuple(runner.config.taps) != tuple(cfg.taps):
            raise ValueError(f"the target runner taps {runner.config.taps}, the head needs {cfg.taps}")
        self._target = runner.model
        dev, dtype = runner.device, runner.config.dtype
        self.head.to(device=dev, dtype=dtype)
        shape = (cfg.context_layers, runner.cache.num_slots, cfg.ctx_kv_heads, runner.cache.capacity + KV_SLACK,
                 cfg.head_dim)
        # its context attention takes the target's decode/verify attention backend
        head_dims = FUSED_HEAD_DIMS if runner.model.attn_backend == "triton" else FLASH_HEAD_DIMS
        self._fused = bool(runner.model.fused) and cfg.head_dim in head_dims
        use_fused_kernels(self.head, self._fused)
        # and its split-KV chunks (their arrival counters made here, before any capture): a context
        # layer's attention of a round at batch 64 took 30 us unsplit, the target's split one 13 us
        self._attn_chunk = runner.attention_chunk if self._fused and runner.model.attn_backend == "triton" else 0
        if self._attn_chunk:
            attention.prepare_counters(dev, attention.counters_needed(
                runner.cache.num_slots, cfg.ctx_kv_heads, cfg.num_heads // cfg.ctx_kv_heads, MAX_FUSED_TOKENS, 0))
        self.k_cache = torch.zeros(shape, device=dev, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=dev, dtype=dtype)
        self._num_slots = runner.cache.num_slots
        self._capacity = runner.cache.capacity
        # chained rounds' device state per slot: the context state at the last kept position, the
        # next round's drafts and (sampled requests) their q, allocated by the first sampled round
        self._state = torch.zeros((self._num_slots, cfg.hidden_size), device=dev, dtype=dtype)
        self._draft_tokens = torch.zeros((self._num_slots, cfg.num_draft_tokens), dtype=torch.long, device=dev)
        self._draft_lens = torch.zeros(self._num_slots, dtype=torch.long, device=dev)
        self._slot_ids = torch.arange(self._num_slots, device=dev)  # row i is slot i (chained rounds)
        self._full_room = torch.full((self._num_slots,), cfg.num_draft_tokens, dtype=torch.long, device=dev)  # l_d each
        self._draft_q: torch.Tensor | None = None
        self._draft_scores = None
        if self._scorer is not None:
            self._draft_scores = torch.zeros((self._num_slots, cfg.num_draft_tokens), dtype=torch.float32, device=dev)
            with torch.inference_mode():  # once outside any capture: a scorer may place its weights on first use
                self._scorer(torch.zeros((1, NUM_FEATURES), dtype=torch.float32, device=dev))
        # with the runner's CUDA graphs, the head's decode-round observe and draft replay graphs too
        # (static buffers per batch bucket and context bucket): at batch 1 a round is otherwise
        # hundreds of kernel launches around one graph replay (docs/benchmarks.md, history row a0fd552)
        self._static = bool(runner.config.cuda_graphs)
        self._captured: dict[tuple, CapturedCall] = {}
        # observe of many rows at once (a prefill's prompts): replayed in (batch bucket, width
        # bucket) shapes as the target's prefill is, within the same rows x positions bound; the
        # input rows of every such shape are views of one store (observes run one at a time)
        self._wide_rows = runner.prefill_bucket_tokens
        self._prefill_groups = runner.prefill_groups
        self._wide_store: torch.Tensor | None = None
        # with the target's varlen prefill, the prompts observed packed as well (specformer_prompts.py)
        self.prefiller = runner.prefiller
        self._varlen = bool(self.prefiller.varlen)
        self._varlen_store: torch.Tensor | None = None
        self._graph_pool = torch.cuda.graph_pool_handle() if self._static else None
        made = self.capture_prompt_observes()
        if made:
            log.info("SpecFormer head: captured %d prompt observe CUDA graphs", made)

    def _replay(self, key: tuple, fn, make_inputs, fill):
        """``fn``'s output for ``key`` from its ``CapturedCall`` (made on first use from the buffers
        ``make_inputs()`` gives; captured on CUDA only), after ``fill(inputs)`` has written this
        call's values into the static buffers (before the capture too: observe's warm-up runs then
        write real K/V). None when a capture fails: the drafter then stays eager (logged)."""
        call = self._captured.get(key)
        if call is not None:
            fill(call.inputs)
            return call()
        inputs = make_inputs()
        fill(inputs)
        try:
            call = CapturedCall(fn, inputs, capture=self.k_cache.is_cuda, pool=self._graph_pool,
                                label="specformer " + " ".join(map(str, key)))
        except RuntimeError as exc:
            log.warning("SpecFormer head: CUDA graph capture failed (%s); running it eagerly", exc)
            self._static = False
            return None
        self._captured[key] = call
        return call()

    def release(self, slot: int) -> None:
        self.pending.pop(slot, None)
        self._lookups.pop(slot, None)

    @torch.inference_mode()
    @sdpa_kernel(SERVING_SDPA)
    def observe(self, states: list[TargetStates]) -> None:
        """Extend each sequence's context with newly accepted target positions (overwriting any
        rolled-back ones at the same positions; one batched pass) and keep its context state at
        the last of them, from which ``propose`` drafts."""
        states = [s for s in states if s.taps.shape[0] > 0]
        if not states:
            return
        if self._target is None:
            raise RuntimeError("SpecFormerDrafter.observe before bind()")
        cfg = self.head.config
        n = len(states)
        lens = [s.taps.shape[0] for s in states]
        if (cfg.bonus_token or cfg.context_next_token) and any(
                s.next_tokens is None or len(s.next_tokens) != m for s, m in zip(states, lens)):
            raise ValueError("this SpecFormer head needs each row's next token (TargetStates.next_tokens, one per row)")
        rows_m = cfg.num_draft_tokens + 1  # a decode round accepts at most l_d drafts + the bonus token
        if self._varlen and max(lens) > rows_m and not any(s.start for s in states):
            last = observe_prompts_varlen(self, states)  # the prompts packed, as the target's varlen prefill
            if last is not None:
                self._keep_last(states, lens, last, to_device(torch.tensor([s.slot for s in states]), last.device))
                return
        if n > 1 and max(lens) > rows_m:  # a prefill's prompts: in the target prefill's groups of similar
            groups = self._prefill_groups(dict(enumerate(lens)))  # lengths, so short rows are not padded to long ones
            if len(groups) > 1:
                for group in groups:
                    self.observe([states[i] for i in group])
                return
        nb, attn_len, M, static = self._observe_shape(lens, [s.start for s in states])
        # packed rows: first position, rows, slot, then each row's next tokens. Built on the device
        # from one host copy whatever the batch (no per-row copy, no host list of nb x M zeros):
        # the header, each new position's row and index in it, and the next tokens the host holds
        # (on the device after a prefill: its first token is not read back; host lists on the
        # host-drafted path), scattered to their columns. The host side is numpy: torch's CPU
        # repeat_interleave that built the indices was the largest item of an admission's host
        # time in a GPU host's profile (docs/benchmarks.md, "What bounds a round").
        dev, dtype = self.k_cache.device, self.k_cache.dtype
        counts = np.fromiter(lens, dtype=np.int64, count=n)
        total = int(counts.sum())
        on_host = [s.next_tokens is not None and not torch.is_tensor(s.next_tokens) for s in states]
        host_next = [np.asarray(s.next_tokens, dtype=np.int64) for s, h in zip(states, on_host) if h]
        flat_host = np.concatenate([
            np.array([(s.start, m, s.slot) for s, m in zip(states, lens)], dtype=np.int64).reshape(-1),
            np.repeat(np.arange(n, dtype=np.int64), counts),  # each new position's row ...
            np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts),  # ... and index in it
            *host_next])
        moved = to_device(torch.from_numpy(flat_host), dev)  # one copy
        header, row, col, host_tokens = moved.split([3 * n, total, total, len(flat_host) - 3 * n - 2 * total])
        packed = torch.zeros((nb, 3 + M), dtype=torch.long, device=dev)
        packed[:n, :3] = header.view(n, 3)
        if any(s.next_tokens is not None for s in states):
            parts = iter(host_tokens.split([len(t) for t in host_next]))
            packed[row, 3 + col] = torch.cat(
                [next(parts) if h else torch.zeros(m, dtype=torch.long, device=dev) if s.next_tokens is None
                 else s.next_tokens.to(torch.long) for s, m, h in zip(states, lens, on_host)])
        last = None
        if static:
            flat = torch.cat([s.taps for s in states])  # [sum m, taps, d]: one scatter, not one copy per row

            def fill(inputs):
                inputs[0][row, col] = flat.to(inputs[0].dtype)
                inputs[1].copy_(packed)

            def inputs():
                return (self._rows_buffer(nb, M, shared=M != rows_m),
                        torch.zeros((nb, 3 + M), dtype=torch.long, device=dev))

            out = self._replay(("observe", nb, attn_len, M), lambda x, pk: self._observe_rows(x, pk, attn_len),
                               inputs, fill)
            last = None if out is None else out[:n].clone()  # the next replay overwrites the graph's output
        if last is None:  # eager: no graphs, rows past the static bound, or a failed capture
            x = pad_sequence([s.taps.to(dtype) for s in states], batch_first=True)  # [n, M, taps, d]
            last = self._observe_rows(x, packed[:n, :3 + x.shape[1]], attn_len)
        self._keep_last(states, lens, last, header.view(n, 3)[:, 2])

    def _keep_last(self, states: list[TargetStates], lens: list[int], last: torch.Tensor, index: torch.Tensor) -> None:
        """After an observe: each sequence's context state at its last new position (``last``
        ``[n, d]``; ``index`` ``[n]`` their slots on the device), for host-drafted proposals and
        chained rounds alike."""
        for i, (s, m) in enumerate(zip(states, lens)):
            bonus = None if s.next_tokens is None else s.next_tokens[-1]
            self.pending[s.slot] = _Pending(s.start + m, last[i], bonus if torch.is_tensor(bonus) or bonus is None
                                            else int(bonus))
        # chained rounds start from here: these slots' device drafts are stale until their next round
        self._state.index_copy_(0, index, last.to(self._state.dtype))
        # index_fill_ takes the 0 as a scalar: ``t[index] = 0`` would make it a host tensor whose
        # copy to the device waits for the stream, i.e. for the prefill and the round in flight
        self._draft_lens.index_fill_(0, index, 0)

    def _observe_shape(self, lens: list[int], starts: list[int]) -> tuple[int, int, int, bool]:
        """``(rows, attended context, positions, static)`` of one observe pass over rows of
        ``lens`` new positions from ``starts``. Static shapes: l_d + 1 positions (decode rounds) or,
        for more (a prefill's prompts), the target prefill's width bucket within its rows x
        positions bound; otherwise the exact rows and positions, eagerly. The context is rounded up
        to the runner's context bucket (the mask hides the extra positions), so a request brings
        few new attention shapes; a prompt observe (every start 0) attends over its whole width
        bucket: one graph a (rows, width) bucket, all captured when bound."""
        rows_m = self.head.config.num_draft_tokens + 1
        attn_len = context_bucket(max(st + m for st, m in zip(starts, lens)), self._capacity)
        M = rows_m if max(lens) <= rows_m else width_bucket(max(lens), self._capacity)
        nb = batch_bucket(len(lens), self._num_slots)
        if not (self._static and (M == rows_m or nb * M <= self._wide_rows)):
            return len(lens), attn_len, max(lens), False
        if M != rows_m and not any(starts):
            attn_len = context_bucket(M, self._capacity)
        return nb, attn_len, M, True

    def prompt_observe_shapes(self) -> list[tuple[int, int, int]]:
        """``(rows, attended context, positions)`` of every observe graph a prefill's prompts can
        take on the static path (``observe``): prompts of at most l_d + 1 tokens in the decode
        rounds' l_d + 1 positions, longer ones in the target prefill's width buckets within its
        rows x positions bound, each attending over its bucket."""
        rows_m = self.head.config.num_draft_tokens + 1
        slots, cap = self._num_slots, self._capacity
        rows = sorted({min(1 << i, slots) for i in range(slots.bit_length() + 1)})
        widths = {width_bucket(n, cap) for n in range(rows_m + 1, cap + 1)}
        shapes = [(nb, context_bucket(rows_m, cap), rows_m) for nb in rows]
        shapes += [(nb, context_bucket(M, cap), M) for M in sorted(widths) for nb in rows if nb * M <= self._wide_rows]
        return shapes

    @torch.inference_mode()
    @sdpa_kernel(SERVING_SDPA)
    def capture_prompt_observes(self) -> int:
        """Capture now (CUDA graphs only) the observe graph of every shape a prefill's prompts can
        take (``prompt_observe_shapes``), as the target's prefill buckets are captured when its
        runner is built: a capture inside an admission synchronises the device and runs the head
        twice eagerly first, stalling the running batch (at batch 64 SpecFormer admissions took 23
        ms of host time each in a run whose warm-up had not met every prompt shape, 9.5 ms in one
        whose warm-up had; docs/benchmarks.md). The rows are empty (row count 0: every K/V write
        goes to the scratch position). With the target's varlen prefill, its packed buckets instead of
        the padded prompt widths (``specformer_prompts``). Returns the number captured; a failed
        capture is logged and leaves the head eager (``_replay``)."""
        if not (self._static and self.k_cache.is_cuda):
            return 0
        if self._varlen:
            made = capture_varlen_observes(self)
            if not self._static:  # a failed capture: eager from now on
                return made
        else:
            made = 0
        rows_m = self.head.config.num_draft_tokens + 1
        for nb, attn_len, M in self.prompt_observe_shapes():
            key = ("observe", nb, attn_len, M)
            if key in self._captured or (self._varlen and M != rows_m):  # varlen: longer prompts go packed
                continue

            def inputs(nb=nb, M=M):
                return (self._rows_buffer(nb, M, shared=M != rows_m),
                        torch.zeros((nb, 3 + M), dtype=torch.long, device=self.k_cache.device))

            if self._replay(key, lambda x, pk, a=attn_len: self._observe_rows(x, pk, a), inputs,
                            lambda _: None) is None:
                break
            made += 1
        return made

    def _rows_buffer(self, nb: int, M: int, shared: bool) -> torch.Tensor:
        """The static input rows of an observe shape, ``[nb, M, len(taps), d]``: a buffer of its
        own (decode rounds' l_d + 1 rows), or with ``shared`` a view of the store every wider shape
        shares (``nb * M <= _wide_rows``)."""
        cfg = self.head.config
        dev, dtype = self.k_cache.device, self.k_cache.dtype
        shape = (nb, M, len(cfg.taps), cfg.hidden_size)
        if not shared:
            return torch.zeros(shape, device=dev, dtype=dtype)
        if self._wide_store is None:
            self._wide_store = torch.zeros(self._wide_rows * len(cfg.taps) * cfg.hidden_size, device=dev, dtype=dtype)
        return self._wide_store[:nb * M * len(cfg.taps) * cfg.hidden_size].view(shape)

    def _observe_rows(self, x: torch.Tensor, packed: torch.Tensor, attn_len: int,
                      rows_are_slots: bool = False) -> torch.Tensor:
        """The context sub-layers over new target positions, writing their K/V into the head's cache.

        Args:
            x: ``[n, M, len(taps), d]`` tapped states (rows past a sequence's count are ignored).
            packed: ``[n, 3 + M]`` long on the device: first position, row count, KV slot, then
                each row's next token (``context_next_token`` heads).
            attn_len: attended context length (a bucket; the mask hides positions past each row).
            rows_are_slots: row i is KV slot i (chained rounds): the cache is read as a view, not gathered.

        Returns:
            ``[n, d]`` context states at each sequence's last row (garbage for a row count of 0).
        """
        head, target = self.head, self._target
        n, M = x.shape[:2]
        dev = x.device
        start, q_lens, slots = packed[:, 0], packed[:, 1], packed[:, 2]
        next_emb = target.embed(packed[:, 3:]) if head.config.context_next_token else None  # [n, M, d]
        scratch = self.k_cache.shape[3] - 1
        if rows_are_slots and self._fused:  # chained rounds on the fused path: no mask, the fused attention
            # the stream as (h, delta) with h + delta added inside the next norm's kernel
            h, delta = head.context_input_parts(x, next_emb)
            seqlens = (start + M).to(torch.int32)  # the cache keeps KV_SLACK >= M positions past the capacity
            # our attention kernel does the RoPE + K/V write itself, as in the target's chain steps
            inside = target.rope_inside_attention(M)
            for i, layer in enumerate(head.ctx):  # (the RoPE/KV kernel makes the positions from start, q_lens)
                k_rows, v_rows = self.k_cache[i][:n], self.v_cache[i][:n]
                x_in, res = (h, None) if delta is None else (delta, h.contiguous())
                normed, h = kernels.add_rmsnorm(x_in.contiguous(), res, layer.norm.weight, layer.norm.eps)
                if inside:
                    att = attention.gqa_attention_rope(layer.qkv(normed), target.rope_cos, target.rope_sin, q_lens,
                                                       k_rows, v_rows, seqlens, layer.num_heads, self._attn_chunk)
                else:
                    q = kernels.rope_kv_write_spans(layer.qkv(normed), target.rope_cos, target.rope_sin, start,
                                                    q_lens, scratch, k_rows, v_rows, layer.num_heads, layer.kv_heads)
                    att = attention.attention_with_kvcache(q, k_rows, v_rows, seqlens, self._target.attn_backend,
                                                           chunk=self._attn_chunk)
                o = layer.o(att.reshape(n, M, -1))
                h, delta = (h, o) if layer.mlp is None else layer.mlp.residual_parts(h, o)
            h = h if delta is None else h + delta
            # each row's last accepted position (a row of none, not kept, reads its last position: -1)
            return h[self._slot_ids[:n], q_lens - 1]
        h = head.context_input(x, next_emb)
        offs = torch.arange(M, device=dev)
        pos = start[:, None] + offs[None, :]  # [n, M]
        write = torch.where(offs[None, :] < q_lens[:, None], pos, scratch)
        rope_pos = pos.clamp(max=target.rope_cos.shape[0] - 1)
        cos, sin = target.rope_cos[rope_pos].to(x.dtype), target.rope_sin[rope_pos].to(x.dtype)
        mask = (torch.arange(attn_len, device=dev)[None, None, :] <= pos[:, :, None])[:, None]  # [n, 1, M, L]
        for i, layer in enumerate(head.ctx):
            q, k, v = layer.qkv_rotated(h, cos, sin)  # [n, M, heads, hd]
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            k_cache[slots[:, None], :, write] = k
            v_cache[slots[:, None], :, write] = v
            if rows_are_slots:
                keys, values = k_cache[:n, :, :attn_len], v_cache[:n, :, :attn_len]
            else:
                keys, values = k_cache[slots, :, :attn_len], v_cache[slots, :, :attn_len]
            h = layer.finish(h, _grouped_attention(q, keys, values, mask))
        return h[torch.arange(n, device=dev), (q_lens - 1).clamp(min=0)]  # the last accepted position

    def _lookup(self, req: DraftRequest) -> tuple[list[int], int]:
        """The context lookup continuation of ``req.token_ids`` (at most l_d ids, none when nothing
        recurs) and its match length, from the slot's ``LookupIndex`` (``synced_index``)."""
        return synced_index(self._lookups, req, LookupIndex).lookup(self.head.config.num_draft_tokens)

    @torch.inference_mode()
    @sdpa_kernel(SERVING_SDPA)
    def draft_logits(self, requests: list[DraftRequest]) -> torch.Tensor:
        """``[len(requests), l_d, vocab]`` draft logits after each request's bonus token, from the
        context states ``observe`` left for their slots (one batched pass of the head's draft part).
        On the CUDA-graph path this is a view of the graph's output, which the next call
        overwrites: copy what must outlive it (``propose`` does).

        Raises:
            KeyError: a request whose slot ``observe`` has not seen.
            ValueError: a head that needs the bonus token and a state without one.
        """
        cfg = self.head.config
        ld = cfg.num_draft_tokens
        pend = [self.pending[r.slot] for r in requests]
        if cfg.bonus_token and any(p.bonus is None for p in pend):
            raise ValueError("this SpecFormer head conditions on the bonus token; the target states had none")
        n = len(requests)
        nb = batch_bucket(n, self._num_slots) if self._static else n
        rows = []  # lookup continuation (-1: none), match length, bonus token
        for r, p in zip(requests, pend):
            toks, match = self._lookup(r) if cfg.lookup_tokens else ([], 0)
            rows.append(toks + [-1] * (ld - len(toks)) + [match, p.bonus if isinstance(p.bonus, int) else 0])
        dev = self.k_cache.device
        ids = to_device(torch.tensor(rows + [[-1] * ld + [0, 0]] * (nb - n), dtype=torch.long), dev)
        on_device = [i for i, p in enumerate(pend) if torch.is_tensor(p.bonus)]  # after a prefill: written there
        if on_device:
            ids[to_device(torch.tensor(on_device), dev), ld + 1] = torch.stack([pend[i].bonus for i in on_device])
        states = torch.stack([p.state for p in pend])

        def fill(inputs):
            inputs[0][:n].copy_(states)
            inputs[1].copy_(ids)

        if self.record_states:  # eagerly, keeping the normed states the LM head reads
            h = self._draft_states(states, ids[:n])
            self._recorded = h.float()
            return self._target.logits(h, True)
        out = self._replay(("draft", nb), self._draft_rows, lambda: (
            torch.zeros((nb, cfg.hidden_size), device=dev, dtype=self.k_cache.dtype),
            torch.zeros((nb, ld + 2), dtype=torch.long, device=dev)), fill) if self._static else None
        return self._draft_rows(states, ids[:n]) if out is None else out[:n]

    def _draft_rows(self, states: torch.Tensor, ids: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """``[n, l_d, vocab]`` draft logits from context states ``[n, d]`` and ``ids`` ``[n, l_d + 2]``
        (long, on the device: the lookup continuation with -1 for none, its match length, the bonus
        token); float32, or in the weights' dtype with ``float32=False``."""
        return self._target.logits(self._draft_states(states, ids), float32)

    def _draft_states(self, states: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[n, l_d, d]`` the head's draft-slot states after the target's final norm (what the LM
        head reads), from context states and ``ids`` as ``_draft_rows``."""
        head, target = self.head, self._target
        cfg = head.config
        ld = cfg.num_draft_tokens
        bonus = target.embed(ids[:, ld + 1]) if cfg.bonus_token else None
        lookup = (ids[:, :ld], ids[:, ld]) if cfg.lookup_tokens else ()
        return head.draft_from_ids(states, target.embed, target.norm, bonus, *lookup)

    def propose(self, requests: list[DraftRequest], keep_drafting: KeepDrafting | None = None) -> list[DraftProposal]:
        ready: list[tuple[int, DraftRequest]] = []
        for i, r in enumerate(requests):
            p = self.pending.get(r.slot)
            # the head must have seen every token but the last (the bonus token the target has not consumed)
            if r.max_draft > 0 and p is not None and p.length == len(r.token_ids) - 1:
                ready.append((i, r))
        out = [DraftProposal.empty() for _ in requests]
        if not ready:
            return out
        drafts = self.draft_logits([r for _, r in ready])
        logits = torch.cat([row[:r.max_draft] for row, (_, r) in zip(drafts, ready)])
        params, gens, pos, spans = [], [], [], []
        for _, r in ready:
            n = min(r.max_draft, self.head.config.num_draft_tokens)
            spans.append(list(range(len(pos), len(pos) + n)))
            params += [r.params] * n
            gens += [r.generator] * n
            pos += range(1, n + 1)
        rows = draft_rows(logits, params, gens, pos, self.top_m)  # one batched pass for every request
        states = None
        if self.record_states:
            states = torch.cat([row[:r.max_draft] for row, (_, r) in zip(self._recorded, ready)]).cpu()
        for (i, _), span in zip(ready, spans):
            out[i] = rows.proposal(span)
            if states is not None:
                out[i].states = states[span[0]:span[-1] + 1]
        return out
