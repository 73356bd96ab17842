"""Prefill: appending prompts to KV cache slots, eagerly or from CUDA graphs.

``Prefiller.prefill`` groups the prompts by length into batches of at most ``prefill_tokens``
padded tokens, one row per prompt. A group runs one of two ways:

- eager: ``KVCache.batch_rows`` gives the group's rows (views of contiguous slots, else a dense copy
  written back after), and each chunk of ``prefill_chunk`` positions is one ``forward_hidden`` call.
  On a GPU its host cost is launching every kernel of every layer, ~10-20 ms for the bundled
  30-layer model whatever the row count: the rounds queued behind a prefill wait for it.
- static (``RunnerConfig.prefill_graphs``, on by default with CUDA graphs): a group of fresh slots
  is padded to a bucket of rows (a power of two) and positions (a power of two, at least
  ``MIN_WIDTH``, at most the cache capacity: a prompt longer than a chunk is one forward here, the
  bucket's rows x positions bounding its activations as ``prefill_tokens`` bounds the eager path's)
  and runs over dense K/V buffers of exactly that shape, from a CUDA graph captured once per
  bucket: one launch. The buffers are views of one store sized for the
  largest bucket allowed (``rows x positions <= 2 x prefill_tokens``), which every bucket shares
  (prefills run one after another on one stream); the group's rows are then copied into its slots.
  Every bucket is captured when the runner is built (``capture_all``), so no capture lands in an
  admission. Without CUDA graphs (CPU tests) the same path runs eagerly.

A row's results do not depend on its padding (padded tokens write their K/V to the scratch position
and causal attention never reads a later position), so both paths give a prompt the same cache.

- varlen (``RunnerConfig.prefill_varlen``; by default on a GPU with flash-attn's
  variable-length kernel for runners of more than one slot, ``resolve_prefill_varlen``): the
  prompts of fresh slots packed end to end, no padding between them
  (``Transformer.forward_varlen``: the projections and the MLP, most of a prefill's work, run
  over the real tokens only; the padded path ran them over ~1.6-1.8x as many positions and one
  forward per group). Up to ``varlen_limit`` tokens a forward, from a CUDA graph per (packed
  tokens, sequences) bucket (``varlen_token_buckets``, ``varlen_seq_buckets``): the tokens past
  the real ones form dummy sequences of at most ``DUMMY_LEN`` tokens that write nothing to the cache,
  and the graph copies each prompt's K/V into its slot itself. Every fresh-slot prefill takes this
  path when it is on, so a prompt's cache never depends on which path it took; with the
  fused-linear kernels it does not depend on its neighbours either (``Transformer.forward_varlen``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from .kv_cache import padded_rows
from .runner_config import resolve_prefill_varlen
from .transfer import to_device

if TYPE_CHECKING:
    from .runner import ModelRunner

log = logging.getLogger(__name__)

MIN_WIDTH = 32  # the narrowest static prefill bucket (positions)
# a prefill forward's fixed cost in padded positions, against which ``Prefiller.groups`` weighs
# splitting a group: on the H200 a static prefill costs ~1.2 us of GPU per padded position
# (docs/benchmarks.md, 2026-12-04 profile) and a forward ~0.9 ms whatever its size, plus the
# host's launch and row copies; 2,048 positions covers both
GROUP_COST = 2048
# the longest dummy sequence of a varlen bucket's padding (tokens): causal attention costs a
# sequence the square of its length, so the padding (up to a third of a bucket, a sixth on average
# over Spec-Bench's prompts) as one sequence cost ~30% of the real prompts' attention in a prefill of
# ten; in sequences of one flash-attn query block each it costs ~1/(2 x 128) of its length squared
DUMMY_LEN = 128


def dummy_len(max_len: int) -> int:
    """The longest dummy sequence of a varlen graph whose sequences are bounded by ``max_len``
    (flash-attn sizes its grid by that bound and leaves a longer sequence's later rows undone)."""
    return min(DUMMY_LEN, max_len)


def varlen_token_buckets(limit: int) -> list[int]:
    """Packed-token buckets of the varlen path: 64, 96, 128, 192, ... (steps of 1.5x and 4/3x,
    so a prefill pads at most half its tokens, ~20% on average), up to and including ``limit``."""
    out, n = [], 64
    while n < limit:
        out.append(n)
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3  # 2^k -> 1.5 x 2^k -> 2^(k+1)
    return out + [limit]


def varlen_seq_buckets(top: int) -> list[int]:
    """Sequence-count buckets of the varlen path: 2, 8, 32, ... (steps of 4x), and ``top`` itself.

    A bucket's sequences past the real and dummy ones are empty: flash-attn's programs for them
    exit at once and each sequence's attention does not depend on how many there are, so coarse
    steps cost almost nothing at run time and make fewer graphs (60 against 105 for powers of two
    at 64 slots; their capture time, ~9 s on an H100, is the large buckets' and did not move)."""
    out, n = [], 2
    while n < top:
        out.append(n)
        n *= 4
    return out + [top]


def varlen_fields(p: torch.Tensor, T: int, S: int) -> tuple[torch.Tensor, ...]:
    """Views of a varlen layout ``p`` ``[4 T + 2 S + 1]`` (``Prefiller.varlen_inputs``): tokens,
    positions, destination slots and cache positions ``[T]`` each, ``cu_seqlens`` ``[S + 1]`` and
    each prompt's last token index ``[S]``."""
    return p[:T], p[T:2 * T], p[2 * T:3 * T], p[3 * T:4 * T], p[4 * T:4 * T + S + 1], p[4 * T + S + 1:]


def varlen_idle(p: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """Fill the layout ``p`` with no prompt: every token padding (slot -1) in one dummy sequence,
    so a run over it (a capture's warm-up) writes only scratch positions. Returns ``p``."""
    p.zero_()
    _, _, slots, _, cu, _ = varlen_fields(p, T, S)
    slots.fill_(-1)
    cu[1:] = T
    return p


def varlen_kv_targets(slots: torch.Tensor, where: torch.Tensor, scratch: int) -> tuple[torch.Tensor, ...]:
    """Where each packed token's K/V goes in a slot cache: ``(real [T] bool, slot rows [T],
    positions [T])``; padding (slot -1) goes to slot 0's ``scratch`` position, to be written zero."""
    real = slots >= 0
    return real, slots.clamp(min=0), torch.where(real, where, torch.full_like(where, scratch))


def width_bucket(n: int, limit: int) -> int:
    """Positions of the static bucket for a prompt of ``n`` tokens: a power of two, at least
    ``MIN_WIDTH``, at most ``limit`` (``Prefiller.max_width``) but never below ``n``."""
    w = MIN_WIDTH
    while w < n:
        w *= 2
    return max(min(w, limit), n)


class Prefiller:
    """The prefill half of a ``ModelRunner`` (see the module docstring)."""

    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner
        cfg = runner.config
        self.static = cfg.cuda_graphs if cfg.prefill_graphs is None else cfg.prefill_graphs
        self._store: tuple[torch.Tensor, torch.Tensor] | None = None  # flat K and V storage of the buckets
        self.launches = 0  # static prefill groups run (graph replays on CUDA)
        self.varlen = resolve_prefill_varlen(cfg, runner.model_config)

    @functools.cached_property
    def varlen_tokens(self) -> list[int]:
        """``varlen_token_buckets(varlen_limit)``, made once."""
        return varlen_token_buckets(self.varlen_limit)

    @property
    def varlen_limit(self) -> int:
        """Packed tokens of one varlen forward at most (the widest bucket): ``prefill_tokens``,
        or the context when that is longer, so any prompt fits one forward."""
        return max(self.runner.config.prefill_tokens, self.max_width)

    @property
    def max_width(self) -> int:
        """Positions of the widest static bucket: the cache capacity (no prompt is longer)."""
        return self.runner.cache.capacity

    @property
    def max_bucket_tokens(self) -> int:
        """rows x positions of the largest static bucket."""
        cfg = self.runner.config
        return 2 * max(cfg.prefill_tokens, cfg.prefill_chunk)

    def prefill(self, prompts: dict[int, list[int]], taps_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """See ``ModelRunner.prefill``."""
        runner = self.runner
        for slot, ids in prompts.items():
            if not ids:
                raise ValueError(f"slot {slot} has an empty prompt")
            runner.cache.check_room(slot, len(ids))
        slots = sorted(prompts)
        last_hidden: dict[int, torch.Tensor] = {}
        pieces: dict[int, list[torch.Tensor]] | None = {} if taps_out is not None else None
        if self.varlen and not any(runner.cache.lengths[s] for s in slots):
            for group in self.varlen_groups({s: len(prompts[s]) for s in slots}):
                self._varlen_group(group, prompts, last_hidden, pieces)
        else:
            for group in self.groups({s: len(prompts[s]) for s in slots}):
                if not self._static_group(group, prompts, last_hidden, pieces):
                    self._eager_group(group, prompts, last_hidden, pieces)
        hidden = torch.stack([last_hidden[s] for s in slots])
        if taps_out is not None and runner.config.taps:
            taps_out.update({s: p[0] if len(p) == 1 else torch.cat(p) for s, p in pieces.items()})
        return runner.model.logits(hidden)

    def groups(self, lengths: dict[int, int]) -> list[list[int]]:
        """The prompts of one prefill (slot -> prompt tokens) in groups, one forward each, chosen
        to pad little: over the prompts sorted by length, the contiguous runs that minimise the
        padded positions every group computes (static path: its bucket, rows x positions rounded
        up to powers of two; eager: rows x its longest prompt) plus ``GROUP_COST`` positions per
        group for the forward's fixed cost, by dynamic programming (O(n^2), n <= the slots). A
        group keeps within ``prefill_tokens`` (rows x min(chunk, longest)) and, static, within the
        largest bucket. Greedy filling by tokens alone padded 2.7-5x on Spec-Bench's prompt
        lengths (a few long prompts widen every row of their group to a power of two); these
        groups pad ~1.6-1.8x for 1-2 more forwards an admission.

        Returns:
            Groups of slots, each in ascending slot order.
        """
        from .runner import batch_bucket

        cfg = self.runner.config
        chunk, budget = cfg.prefill_chunk, max(cfg.prefill_tokens, cfg.prefill_chunk)
        slots_n, cap = self.runner.cache.num_slots, self.max_width
        order = sorted(lengths, key=lambda s: (lengths[s], s))
        n = len(order)
        best, cut = [0] + [None] * n, [0] * (n + 1)
        for j in range(1, n + 1):
            longest = lengths[order[j - 1]]
            for i in range(j - 1, -1, -1):
                rows = j - i
                if rows > 1 and rows * min(chunk, longest) > budget:
                    break  # more rows only add
                bucket = batch_bucket(rows, slots_n) * width_bucket(longest, cap)
                if self.static and rows > 1 and bucket > self.max_bucket_tokens:
                    break
                cost = best[i] + (bucket if self.static else rows * longest) + GROUP_COST
                if best[j] is None or cost < best[j]:
                    best[j], cut[j] = cost, i
        out: list[list[int]] = []
        j = n
        while j:
            out.append(sorted(order[cut[j]:j]))
            j = cut[j]
        return out[::-1]

    def varlen_groups(self, lengths: dict[int, int]) -> list[list[int]]:
        """The prompts of one varlen prefill (slot -> prompt tokens) in forwards of at most
        ``varlen_limit`` packed tokens: filled in ascending slot order, each group in slot order."""
        out: list[list[int]] = []
        used = self.varlen_limit
        for s in sorted(lengths):
            if used + lengths[s] > self.varlen_limit:
                out.append([])
                used = 0
            out[-1].append(s)
            used += lengths[s]
        return out

    def varlen_shape(self, lengths: list[int]) -> tuple[int, int, int]:
        """``(packed tokens, sequences, max_len)`` of the varlen graph that runs prompts of these
        lengths: the smallest token bucket that holds them, then room for them and the dummy
        sequences that cover the padding (each at most ``DUMMY_LEN`` long, and ``max_len``);
        ``max_len`` = min(tokens, context) bounds every sequence's length (flash-attn's grid).

        Raises:
            ValueError: more tokens than ``varlen_limit``.
        """
        total = sum(lengths)
        if total > self.varlen_limit:
            raise ValueError(f"{total} tokens exceed one varlen prefill's {self.varlen_limit}")
        tokens = next(b for b in self.varlen_tokens if b >= total)
        max_len = min(tokens, self.max_width)
        seqs = len(lengths) + -(-(tokens - total) // dummy_len(max_len))
        return tokens, next(b for b in varlen_seq_buckets(self._varlen_top(tokens)) if b >= seqs), max_len

    def _varlen_top(self, tokens: int) -> int:
        """The most sequences a ``tokens`` bucket can be asked for: every slot's prompt (at most one
        token each within the bucket) and the dummy sequences of the largest padding it can have
        (a total just above the next smaller bucket)."""
        buckets = self.varlen_tokens
        i = buckets.index(tokens)
        pad = tokens - (buckets[i - 1] + 1 if i else 1)
        return min(self.runner.cache.num_slots, tokens) + -(-pad // dummy_len(min(tokens, self.max_width)))

    def _varlen_group(self, group: list[int], prompts: dict[int, list[int]], out: dict[int, torch.Tensor],
                      taps_out: dict[int, list[torch.Tensor]] | None) -> None:
        """Prefill the fresh slots of ``group`` (ascending) in one varlen forward (module docstring)."""
        runner = self.runner
        lengths = [len(prompts[s]) for s in group]
        T, S, max_len = self.varlen_shape(lengths)
        inputs = self.varlen_inputs(T, S, max_len, group, lengths, [prompts[s] for s in group])
        key = ("prefill-varlen", T, S)
        captured = runner._graphs.get(key) or self._capture_varlen(T, S, max_len)
        runner._stage(key, inputs, captured.inputs[0])
        ends, taps = captured()
        self.launches += 1
        ends = ends[:len(group)].clone()  # copies: the next replay of this bucket overwrites the outputs
        total = sum(lengths)
        kept = taps[:total].clone() if taps_out is not None and taps is not None else None
        at = 0
        for r, s in enumerate(group):
            out[s] = ends[r]
            if kept is not None:
                taps_out.setdefault(s, []).append(kept[at:at + lengths[r]])
            at += lengths[r]
            runner.cache.lengths[s] = lengths[r]

    def varlen_inputs(self, T: int, S: int, max_len: int, slots: list[int], lengths: list[int],
                      prompts: list[list[int]] | None = None) -> torch.Tensor:
        """The host inputs of a varlen graph, one int64 tensor ``[4 T + 2 S + 1]``: tokens ``[T]``
        (``prompts``' ids; zeros without them: a drafter that reads the target's states instead),
        positions ``[T]``, destination slots ``[T]`` (-1 for the padding), the cache positions
        ``[T]``, ``cu_seqlens`` ``[S + 1]`` (the prompts, then dummy sequences of at most
        ``dummy_len(max_len)`` tokens covering the padding, then empty ones) and each prompt's last
        token index ``[S]`` (0 past the prompts). ``max_len`` bounds the prompts' lengths (checked).

        Raises:
            ValueError: a prompt longer than ``max_len``, or more tokens or sequences than the bucket.
        """
        if max(lengths, default=0) > max_len or sum(lengths) > T or len(slots) > S:
            raise ValueError(f"prompts of {lengths} tokens do not fit a varlen bucket of {T} tokens, {S} sequences "
                             f"and {max_len} tokens a sequence")
        out = torch.zeros(4 * T + 2 * S + 1, dtype=torch.long)
        tokens, positions, dest, where, cu, last = varlen_fields(out, T, S)
        dest.fill_(-1)
        at = 0
        for i, (slot, n) in enumerate(zip(slots, lengths)):
            if prompts is not None:
                tokens[at:at + n] = torch.tensor(prompts[i], dtype=torch.long)
            positions[at:at + n] = torch.arange(n)
            dest[at:at + n] = slot
            at += n
            cu[i + 1] = at
            last[i] = at - 1
        where.copy_(positions)  # real tokens' cache positions; the graph sends the padding to scratch
        for i in range(len(slots) + 1, S + 1):  # dummy sequences, then empty ones
            at = min(at + dummy_len(max_len), T)
            cu[i] = at
        if at < T:
            raise ValueError(f"{T - at} padding tokens past the {S} sequences of the bucket")
        return out

    def _capture_varlen(self, T: int, S: int, max_len: int):
        """The varlen call of bucket ``T`` tokens x ``S`` sequences (a CUDA graph with CUDA graphs,
        else an eager call), kept in the runner's graphs under ``("prefill-varlen", T, S)``."""
        from .runner import CapturedCall

        runner = self.runner
        cache = runner.cache
        k_buf, v_buf = self._buffers(1, T - 1)  # [layers, 1, kv_heads, T, head_dim]
        scratch = cache.k.shape[3] - 1
        taps = runner.config.taps

        def run(p: torch.Tensor):
            tokens, positions, slots, where, cu, last = varlen_fields(p, T, S)
            hidden, tapped = runner.model.forward_varlen(tokens, positions, cu.to(torch.int32), max_len, k_buf, v_buf,
                                                         taps)
            real, rows, at = varlen_kv_targets(slots, where, scratch)
            for buf, dest in ((k_buf, cache.k), (v_buf, cache.v)):  # each prompt's K/V into its slot
                kv = buf[:, 0, :, :T].permute(2, 0, 1, 3)  # [T, layers, kv_heads, head_dim]
                dest[:, rows, :, at] = torch.where(real[:, None, None, None], kv, torch.zeros_like(kv))
            return hidden[last], tapped

        idle = varlen_idle(torch.empty(4 * T + 2 * S + 1, dtype=torch.long), T, S)  # the warm-up runs write scratch only
        captured = CapturedCall(run, (to_device(idle, runner.device),), capture=runner.config.cuda_graphs and self.static,
                                pool=runner._prefill_pool, stream=runner._admission_stream,  # (without graphs: eager)
                                label=f"prefill-varlen tokens{T} seqs{S}")
        runner._graphs[("prefill-varlen", T, S)] = captured
        return captured

    def varlen_buckets(self) -> list[tuple[int, int]]:
        """Every (packed tokens, sequences) bucket the varlen path can run."""
        return [(t, s) for t in self.varlen_tokens for s in varlen_seq_buckets(self._varlen_top(t))]

    def _eager_group(self, group: list[int], prompts: dict[int, list[int]], out: dict[int, torch.Tensor],
                     taps_out: dict[int, list[torch.Tensor]] | None) -> None:
        """Prefill the slots of ``group`` (ascending) as the rows of one batch (``KVCache.batch_rows``:
        one row per slot, scattered slots included), in chunks of ``prefill_chunk`` positions."""
        runner = self.runner
        cache = runner.cache
        rows = len(group)
        lengths = [cache.lengths[s] for s in group]
        chunk = runner.config.prefill_chunk
        # a chunk's start + width stays within (the longest row at the end) + (the widest chunk)
        k, v, write_back = cache.batch_rows(group, max(n + len(prompts[s]) for n, s in zip(lengths, group))
                                            + min(chunk, max(len(prompts[s]) for s in group)))
        done = [0] * rows
        while any(done[r] < len(prompts[s]) for r, s in enumerate(group)):
            width = min(chunk, max(len(prompts[s]) - done[r] for r, s in enumerate(group)))
            tokens = torch.zeros((rows, width), dtype=torch.long)
            start = torch.tensor(lengths, dtype=torch.long)
            q_lens = torch.zeros(rows, dtype=torch.long)
            for r, s in enumerate(group):
                piece = prompts[s][done[r]:done[r] + width]
                if piece:
                    tokens[r, :len(piece)] = torch.tensor(piece)
                    q_lens[r] = len(piece)
            attn_len = int((start + q_lens).max())
            dev = runner.device
            wide = int(start.max()) + width <= k.shape[3]  # room for the fused kernels' attention span
            hidden, taps = runner.model.forward_hidden(to_device(tokens, dev), to_device(start, dev),
                                                       to_device(q_lens, dev), k, v, attn_len, taps=runner.config.taps,
                                                       wide=wide)
            for r, s in enumerate(group):
                q = int(q_lens[r])
                if q:
                    if taps_out is not None and taps is not None:
                        taps_out.setdefault(s, []).append(taps[r, :q])
                    lengths[r] += q
                    done[r] += q
                    if done[r] == len(prompts[s]):
                        out[s] = hidden[r, q - 1]
        write_back()
        for r, s in enumerate(group):
            cache.lengths[s] = lengths[r]

    def _static_group(self, group: list[int], prompts: dict[int, list[int]], out: dict[int, torch.Tensor],
                      taps_out: dict[int, list[torch.Tensor]] | None) -> bool:
        """Prefill ``group`` on the static path (see the module docstring); False, doing nothing,
        when the group does not qualify (static prefill off, a slot already holding tokens, or a
        bucket past ``max_bucket_tokens``)."""
        from .runner import batch_bucket

        runner = self.runner
        cache = runner.cache
        longest = max(len(prompts[s]) for s in group)
        if not self.static or any(cache.lengths[s] for s in group):
            return False
        rows = len(group)
        R, W = batch_bucket(rows, cache.num_slots), width_bucket(longest, self.max_width)
        if R * W > self.max_bucket_tokens:
            return False
        packed = padded_rows([prompts[s] for s in group] + [[]] * (R - rows), W, extra=1)  # q_len, then the tokens
        packed[:rows, 0] = torch.tensor([len(prompts[s]) for s in group], dtype=torch.long)  # (one copy to the device)
        key = ("prefill", R, W)
        captured = runner._graphs.get(key) or self._capture(R, W)
        runner._stage(key, packed, captured.inputs[0])
        hidden, taps = captured()
        self.launches += 1
        k, v = captured.kv
        index = to_device(torch.tensor(group, dtype=torch.long), runner.device)
        cache.k[:, index, :, :longest] = k[:, :rows, :, :longest]
        cache.v[:, index, :, :longest] = v[:, :rows, :, :longest]
        # copies, not views: the next replay of this bucket overwrites the graph's outputs
        last = to_device(packed[:rows, 0] - 1, runner.device)
        ends = hidden[torch.arange(rows, device=runner.device), last]  # [rows, d]
        kept = taps[:rows, :longest].clone() if taps_out is not None and taps is not None else None  # one copy
        for r, s in enumerate(group):
            q = len(prompts[s])
            out[s] = ends[r]
            if kept is not None:
                taps_out.setdefault(s, []).append(kept[r, :q])
            cache.lengths[s] = q
        return True

    def _capture(self, R: int, W: int):
        """The static call of bucket ``R`` x ``W`` (a CUDA graph with CUDA graphs, else an eager call),
        made and kept in the runner's graphs under ``("prefill", R, W)``."""
        from .runner import CapturedCall

        runner = self.runner
        k, v = self._buffers(R, W)

        def run(p: torch.Tensor):
            q_lens = p[:, 0]
            return runner.model.forward_hidden(p[:, 1:], torch.zeros_like(q_lens), q_lens, k, v, W,
                                               taps=runner.config.taps, wide=True)

        idle = torch.zeros((R, 1 + W), dtype=torch.long)  # every row empty: the warm-up runs write scratch only
        captured = CapturedCall(run, (to_device(idle, runner.device),), capture=runner.config.cuda_graphs,
                                pool=runner._prefill_pool, stream=runner._admission_stream, label=f"prefill rows{R} width{W}")
        captured.kv = (k, v)
        runner._graphs[("prefill", R, W)] = captured
        return captured

    def buckets(self) -> list[tuple[int, int]]:
        """Every (rows, positions) bucket the static path can run: rows a ``batch_bucket`` value,
        positions a ``width_bucket`` value, rows x positions within ``max_bucket_tokens``."""
        slots, limit = self.runner.cache.num_slots, self.max_width
        rows = sorted({min(1 << i, slots) for i in range(slots.bit_length() + 1)})
        widths = sorted({width_bucket(1 << i, limit) for i in range(limit.bit_length() + 1) if 1 << i <= limit}
                        | {limit})
        return [(r, w) for r in rows for w in widths if r * w <= self.max_bucket_tokens]

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every bucket now (at start-up, CUDA graphs only): a capture synchronises the
        device and runs the forward eagerly twice first, which inside a running batch's admission
        would stall every request. Returns the number captured."""
        if not (self.static and self.runner.config.cuda_graphs):
            return 0
        if self.varlen:
            return self._capture_all_varlen()
        made = 0
        for r, w in self.buckets():
            if ("prefill", r, w) not in self.runner._graphs:
                try:
                    self._capture(r, w)
                except Exception as exc:  # e.g. a kernel that cannot be captured here: serve with eager prefills
                    log.warning("prefill CUDA graph capture failed for %d rows x %d positions (%s); prefills run "
                                "eagerly", r, w, exc)
                    self.static = False
                    for key in [k for k in self.runner._graphs if k[0] == "prefill"]:
                        del self.runner._graphs[key]
                    return 0
                made += 1
        return made

    def _capture_all_varlen(self) -> int:
        """``capture_all`` for the varlen path: every (tokens, sequences) bucket; on a failure the
        prefills fall back to the padded path (whose buckets are captured then)."""
        made = 0
        for t, s in self.varlen_buckets():
            if ("prefill-varlen", t, s) in self.runner._graphs:
                continue
            try:
                self._capture_varlen(t, s, min(t, self.max_width))
            except Exception as exc:
                log.warning("varlen prefill CUDA graph capture failed for %d tokens x %d sequences (%s); prefills "
                            "run padded", t, s, exc)
                self.varlen = False
                for key in [k for k in self.runner._graphs if k[0] == "prefill-varlen"]:
                    del self.runner._graphs[key]
                return self.capture_all()
            made += 1
        return made

    def _buffers(self, R: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V of a ``R`` x ``W`` bucket, ``[num_layers, R, num_kv_heads, W + 1, head_dim]``
        each (the last position is the scratch one padded tokens write to): views of the shared store."""
        runner = self.runner
        full = runner.cache.k
        layers, kv_heads, head_dim = full.shape[0], full.shape[2], full.shape[4]
        per_position = layers * kv_heads * head_dim
        if self._store is None:
            positions = max(self.max_bucket_tokens + runner.cache.num_slots,  # R x (W + 1) at most,
                            self.varlen_limit if self.varlen else 0)  # or a varlen forward's tokens
            # zeros, not garbage: masked attention (the reference path) multiplies the values of
            # positions it does not attend by 0, and 0 x NaN is NaN
            self._store = tuple(full.new_zeros(positions * per_position) for _ in range(2))
        shape = (layers, R, kv_heads, W + 1, head_dim)
        n = layers * R * kv_heads * (W + 1) * head_dim
        return self._store[0][:n].view(shape), self._store[1][:n].view(shape)
