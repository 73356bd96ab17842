"""Per-slot state a ``LocalTarget`` keeps on its device: each sequence's sampling settings
(written once at admission) and its round state (last token, KV length, token history, prompt
length and token limit), so a chained round needs nothing from the host."""

from __future__ import annotations

import torch

from .models.kv_cache import padded_rows
from .models.transfer import to_device
from .sampling import LogitAdjustments, SamplingParams, new_seed
from .stopping import draft_room_end
from .verify import RowSampling


class SlotSampling:
    """Per-slot sampling settings on the target's device, written once when a sequence is
    admitted, so a verify round sends no sampling parameters to the device.

    The logit adjustments (``SamplingParams.logit_bias``, ``min_tokens`` and the penalties) keep
    ``[num_slots, vocab]`` state (the bias, the output's token counts, the prompt's tokens, the ids
    masked before ``min_tokens``): allocated when the first request that adjusts is admitted, then
    kept; the counts grow on the device with every emitted token (``record``).

    Args:
        num_slots: KV cache slots; device: the target's device; vocab_size: the target's vocabulary.
    """

    def __init__(self, num_slots: int, device: torch.device, vocab_size: int) -> None:
        self.device = device
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.adjust: LogitAdjustments | None = None  # every slot's, once a request has adjusted
        self.greedy = torch.ones(num_slots, dtype=torch.bool, device=device)
        self.temperature = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.params: list[SamplingParams | None] = [None] * num_slots  # host mirror
        self._flags_memo: tuple[tuple[int, ...], tuple[bool, bool, bool]] | None = None  # flags' last (slots, value)
        self.seeds: list[int] = [0] * num_slots

    def admit(self, slots: list[int], params: list[SamplingParams], prompts: list[list[int]] | None = None,
              stop_ids: list[tuple[int, ...]] | None = None, resumed: list[int] | None = None) -> None:
        """Record the settings of newly admitted sequences (a request without a seed gets one):
        their ``prompts`` and ``stop_ids`` (the ids masked before ``min_tokens``) are read when a
        request adjusts its logits (``logit_bias`` ids are in the vocabulary: ``new_request``
        checks them); ``resumed``: how many of each prompt's last tokens are output emitted
        elsewhere (a resumed request): the output's token counts start with them."""
        seeds = [p.seed if p.seed is not None else new_seed() for p in params]
        for s, p, seed in zip(slots, params, seeds):
            self.params[s], self.seeds[s] = p, seed
        self._flags_memo = None  # a slot's parameters changed
        idx = to_device(torch.tensor(slots, dtype=torch.int64), self.device)
        ints = to_device(torch.tensor([[int(p.greedy), p.top_k, seed] for p, seed in zip(params, seeds)],
                                      dtype=torch.int64), self.device)
        floats = to_device(torch.tensor([[p.temperature if not p.greedy else 1.0, p.top_p] for p in params],
                                        dtype=torch.float32), self.device)
        self.greedy.index_copy_(0, idx, ints[:, 0] > 0)
        self.top_k.index_copy_(0, idx, ints[:, 1])
        self.seed.index_copy_(0, idx, ints[:, 2])
        self.temperature.index_copy_(0, idx, floats[:, 0])
        self.top_p.index_copy_(0, idx, floats[:, 1])
        if self.adjust is None and any(p.adjusts_logits for p in params):
            self.adjust = self._allocate_adjustments()
        if self.adjust is not None:
            self._admit_adjustments(idx, slots, params, prompts or [[] for _ in slots],
                                    stop_ids or [() for _ in slots], resumed or [0 for _ in slots])

    def _allocate_adjustments(self) -> LogitAdjustments:
        S, V, dev = self.num_slots, self.vocab_size, self.device
        return LogitAdjustments(
            bias=torch.zeros(S, V, dtype=torch.float32, device=dev),
            counts=torch.zeros(S, V, dtype=torch.float32, device=dev),
            prompt_seen=torch.zeros(S, V, dtype=torch.bool, device=dev),
            suppress=torch.zeros(S, V, dtype=torch.bool, device=dev),
            prompt_len=torch.zeros(S, dtype=torch.int64, device=dev),
            min_tokens=torch.zeros(S, dtype=torch.int64, device=dev),
            presence=torch.zeros(S, dtype=torch.float32, device=dev),
            frequency=torch.zeros(S, dtype=torch.float32, device=dev),
            repetition=torch.ones(S, dtype=torch.float32, device=dev))

    def _admit_adjustments(self, idx: torch.Tensor, slot_of: list[int], params: list[SamplingParams],
                           prompts: list[list[int]], stop_ids: list[tuple[int, ...]], resumed: list[int]) -> None:
        """Write the adjustment rows of admitted slots ``idx`` (neutral for requests without any)."""
        adj, dev = self.adjust, self.device
        for name in ("bias", "counts", "prompt_seen", "suppress"):
            getattr(adj, name).index_fill_(0, idx, 0)

        def scatter(target: torch.Tensor, pairs: list[tuple[int, int]], values: list | None = None) -> None:
            if pairs:
                rows, cols = zip(*pairs)
                at = (to_device(torch.tensor(rows, dtype=torch.int64), dev),
                      to_device(torch.tensor(cols, dtype=torch.int64), dev))
                # a device tensor of values: ``target[at] = True`` would copy a host scalar and wait for the stream
                target.index_put_(at, torch.ones(len(pairs), dtype=target.dtype, device=dev) if values is None
                                  else to_device(torch.tensor(values, dtype=target.dtype), dev))

        bias = [((s, t), b) for s, p in zip(slot_of, params) for t, b in p.logit_bias]
        scatter(adj.bias, [k for k, _ in bias], [b for _, b in bias])
        scatter(adj.prompt_seen, sorted({(s, t) for s, p, pr in zip(slot_of, params, prompts)
                                         if p.repetition_penalty != 1.0 for t in pr}))
        counted = [(s, t) for s, pr, n in zip(slot_of, prompts, resumed) if n for t in pr[len(pr) - n:]]
        if counted:  # a resumed request's output so far
            rows, cols = zip(*counted)
            adj.counts.index_put_((to_device(torch.tensor(rows, dtype=torch.int64), dev),
                                   to_device(torch.tensor(cols, dtype=torch.int64), dev)),
                                  torch.ones(len(counted), dtype=torch.float32, device=dev), accumulate=True)
        scatter(adj.suppress, sorted({(s, t) for s, p, ids in zip(slot_of, params, stop_ids) if p.min_tokens
                                      for t in ids if 0 <= t < self.vocab_size}))
        ints = to_device(torch.tensor([[len(pr), p.min_tokens] for p, pr in zip(params, prompts)], dtype=torch.int64),
                         dev)
        floats = to_device(torch.tensor([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
                                         for p in params], dtype=torch.float32), dev)
        adj.prompt_len.index_copy_(0, idx, ints[:, 0])
        adj.min_tokens.index_copy_(0, idx, ints[:, 1])
        adj.presence.index_copy_(0, idx, floats[:, 0])
        adj.frequency.index_copy_(0, idx, floats[:, 1])
        adj.repetition.index_copy_(0, idx, floats[:, 2])

    def record(self, tokens: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Count emitted tokens in the output token counts (when adjustments exist), on the device.

        Args:
            tokens: ``[n, Q]`` int64 tokens of rows ``0 .. n-1`` (or of ``rows``).
            keep: ``[n, Q]`` bool, which of them were emitted.
            rows: ``[n]`` int64 slots of the rows (default: row i is slot i).
        """
        if self.adjust is None:
            return
        counts = self.adjust.counts
        if rows is None:
            counts[:tokens.shape[0]].scatter_add_(1, tokens, keep.to(torch.float32))
        else:
            counts.index_put_((rows[:, None].expand_as(tokens), tokens), keep.to(torch.float32), accumulate=True)

    def flags(self, slots: list[int]) -> tuple[bool, bool, bool]:
        """``(any_sampled, filtered, adjusted)`` of a step over ``slots`` (``RowSampling``'s host
        flags; ``adjusted``: some request adjusts its logits)."""
        key = tuple(slots)
        if self._flags_memo is not None and self._flags_memo[0] == key:  # (a running batch asks every round)
            return self._flags_memo[1]
        ps = [p for p in (self.params[s] for s in slots) if p is not None]
        sampled = [p for p in ps if not p.greedy]
        flags = (bool(sampled), any(p.top_k > 0 or p.top_p < 1.0 for p in sampled), any(p.adjusts_logits for p in ps))
        self._flags_memo = (key, flags)
        return flags

    def rows(self, n: int, slots: list[int] | None = None, flags: tuple[bool, bool, bool] | None = None
             ) -> RowSampling:
        """Settings of rows ``0 .. n-1`` (row = slot) for a step over ``slots``, whose parameters
        give the host flags (or pass ``flags`` from ``flags(slots)``)."""
        any_sampled, filtered, adjusted = flags if flags is not None else self.flags(slots or [])
        return RowSampling(self.greedy[:n], self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seed[:n],
                           any_sampled=any_sampled, filtered=filtered,
                           adjust=self.adjust.rows(slice(0, n)) if adjusted and self.adjust is not None else None)


class RoundState:
    """Per-slot round state on the target's device: what the next round of a sequence feeds and
    where, without the host knowing it yet.

    Attributes:
        last: ``[num_slots]`` int64, the token each slot emitted last and the cache does not hold
            yet (written by prefill and by every verify round on the device).
        length: ``[num_slots]`` int64, tokens each slot's KV cache holds after its last round
            (the device mirror of ``KVCache.lengths``; a rollback is a write of this tensor).
        history: ``[num_slots, capacity + 2]`` int64, each slot's tokens (prompt and output; index
            ``length`` is ``last``), what device drafters draft from; the last column is scratch.
        room_end: ``[num_slots]`` int64, the KV length each sequence's drafts may bring its cache
            to (``tandem.stopping.draft_room_end`` of its prompt length and token limit: the
            draft-room rule on the device).
    """

    def __init__(self, num_slots: int, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.last = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.length = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.history = torch.zeros(num_slots, capacity + 2, dtype=torch.int64, device=device)
        self.room_end = torch.zeros(num_slots, dtype=torch.int64, device=device)

    def admit(self, index: torch.Tensor, first_tokens: torch.Tensor, prompts: list[list[int]],
              max_new: list[int]) -> None:
        """Prefilled slots ``index`` ``[R]`` hold their ``prompts`` and feed ``first_tokens`` ``[R]`` next."""
        width = max(len(p) for p in prompts)
        host = padded_rows(prompts, width, extra=2)  # length, draft-room end, then the prompt: one copy
        host[:, 0] = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        host[:, 1] = draft_room_end(self.capacity, host[:, 0], torch.tensor(max_new, dtype=torch.int64))
        rows = to_device(host, index.device)
        lengths = rows[:, 0]
        self.history[index, :width] = rows[:, 2:]  # entries past a prompt are overwritten before they are read
        self.history[index, lengths] = first_tokens
        self.last.index_copy_(0, index, first_tokens)
        self.length.index_copy_(0, index, lengths)
        self.room_end.index_copy_(0, index, rows[:, 1])

    def feed(self, inputs: torch.Tensor, attn_len: int, drafter=None, k: int = 0,
             cap: torch.Tensor | None = None) -> None:
        """Overwrite a chained step's packed inputs ``[n, 2 + 1 + k]`` (``ModelRunner.step``'s
        ``patch``; ``attn_len`` bounds every row's length + 1, so the drafter reads only that much
        of the history): every row with tokens starts at its slot's device length with its last
        token; with a device ``drafter``, its drafts follow, as many as the row's placeholder count
        allows and the draft-room rule (``tandem.stopping.draft_room``, in the form of
        ``draft_room_end``) gives on the device: no draft past the context (``capacity``) or the
        token limit, and none past ``cap`` (a 0-d int64 device tensor: a draft policy's width for
        this round, written without recapturing the graph)."""
        n = inputs.shape[0]
        active = inputs[:, 1] > 0
        length = self.length[:n]
        inputs[:, 0] = torch.where(active, length, inputs[:, 0])
        inputs[:, 2] = torch.where(active, self.last[:n], inputs[:, 2])
        if drafter is None or k == 0:
            return
        # the draft-room rule: min(limit, end - held) (``draft_room_end``); idle rows draft nothing
        left = self.room_end[:n] - length
        room = torch.minimum(inputs[:, 1] - 1, left).clamp(min=0) * active
        if cap is not None:
            room = torch.minimum(room, cap)
        # rows outside this round (idle slots of the bucket) may hold more than attn_len: they draft nothing
        last = (length * active).clamp(max=attn_len - 1)
        score_room = None
        if drafter.scores_on_device and not drafter.drafts_from_verify:
            # drafts scored where they are made (n-gram): over the policy's full width, whatever this
            # round's graph width and cap, so a later plan can widen again
            score_room = left.clamp(min=0, max=max(k, drafter.score_width)) * active
        tokens, lens = drafter.device_drafts(self.history[:n, :attn_len], last, room, k, score_room=score_room)
        inputs[:, 3:3 + k] = tokens
        inputs[:, 1] = torch.where(active, 1 + lens, inputs[:, 1])

    def advance(self, inputs: torch.Tensor, chain: torch.Tensor, num_accepted: torch.Tensor,
                tokens: torch.Tensor) -> None:
        """After verification of rows ``0 .. n-1`` (``inputs`` ``[n, >= 2]``: start, q_len): each
        chain row with tokens (``chain`` ``[n]`` bool) keeps its last token and accepted drafts
        (length ``start + 1 + num_accepted``), appends what it emitted (``tokens`` ``[n, K + 1]``,
        the first ``num_accepted + 1``) to its history and feeds the last of them next."""
        n, Q = tokens.shape
        keep = chain & (inputs[:, 1] > 0)
        start = inputs[:, 0]
        emitted = tokens.gather(1, num_accepted[:, None])[:, 0]
        self.length[:n] = torch.where(keep, start + 1 + num_accepted, self.length[:n])
        self.last[:n] = torch.where(keep, emitted, self.last[:n])
        j = torch.arange(Q, device=tokens.device)
        write = keep[:, None] & (j[None, :] <= num_accepted[:, None])
        pos = torch.where(write, start[:, None] + 1 + j[None, :], torch.full_like(tokens, self.capacity + 1))
        self.history[:n].scatter_(1, pos, tokens)

    def set(self, slot: int, start: int, tokens: list[int]) -> None:
        """Write one slot's state from the host: it held ``start`` tokens and emitted ``tokens``
        (a token tree verified there)."""
        self.length[slot] = start + len(tokens)
        self.last[slot] = tokens[-1]
        self.history[slot, start + 1:start + 1 + len(tokens)] = to_device(torch.tensor(tokens, dtype=torch.int64),
                                                                          self.history.device)
