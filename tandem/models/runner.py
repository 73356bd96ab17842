"""Model runner: owns the target weights and KV cache and runs batched forwards.

Two paths with the same numerics:
- eager (CPU): one ``Transformer.forward_hidden`` call per batch (prefill: ``tandem.models.prefill``,
  eager or from CUDA graphs of its own);
- decode on CUDA: the forward (optionally ``torch.compile``-d with dynamic shapes, which fuses
  the small element-wise kernels) is captured once per (batch bucket, tokens per row, context
  bucket) into a CUDA graph and replayed, removing per-kernel launch overhead.

Rows of a decode batch are cache slots ``0 .. n-1`` (the engine keeps running sequences at low
slot indices); idle slots inside that range run with 0 tokens.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..errors import ConfigError
from ..profiling import step_timeline
from .config import ModelConfig
from .attention import attention_backend_for, attention_name, counters_needed, prepare_counters
from . import kernels
from .kernels import MAX_FUSED_TOKENS
from .graphs import CONTEXT_BUCKET, CapturedCall, batch_bucket, context_bucket  # noqa: F401 (re-exported)
from .kv_cache import KVCache
from .prefill import Prefiller
from .transformer import Transformer
from .runner_config import (DEFAULT_ATTENTION_CHUNK, KERNEL_CHOICES, RunnerConfig,  # noqa: F401 (re-exported)
                            check_runner_config, default_runner_config, resolve_attention_chunk,
                            resolve_kernels)
from .weights import Checkpoint

log = logging.getLogger(__name__)

class ModelRunner:
    """Runs the target over a static KV cache.

    Args:
        checkpoint: loaded weights and config.
        config: runner settings.

    Raises:
        ConfigError: CUDA graphs or compile asked for on a CPU device; ``max_seq_len`` past the
            model's trained context, or a KV cache that does not fit the device's free memory
            (``kv_cache.check_fits``).
    """

    def __init__(self, checkpoint: Checkpoint, config: RunnerConfig) -> None:
        self.config = config
        self.model_config: ModelConfig = checkpoint.config
        self.device = torch.device(config.device)
        if (config.cuda_graphs or config.compile) and self.device.type != "cuda":
            raise ConfigError("cuda_graphs and compile need a CUDA device")
        self._kernels = check_runner_config(config, checkpoint.config)
        trained = checkpoint.config.max_position_embeddings
        if config.max_seq_len > trained:
            raise ConfigError(f"--max-seq-len {config.max_seq_len} is past the model's trained context of "
                              f"{trained} tokens")
        model = Transformer(checkpoint.config, max_positions=config.max_seq_len + 1)
        model.load_weights(checkpoint.tensors)
        self.model = model.to(device=self.device, dtype=config.dtype).eval()
        self.model.fused = self._kernels != "reference"
        self.model.fused_linear = self._kernels == "fused-linear"
        self.model.attn_backend = attention_backend_for(self._kernels)
        self.attention_chunk = self.model.attn_chunk = resolve_attention_chunk(config, self._kernels)
        if self.attention_chunk:  # the split attention's arrival counters, before any step is captured
            mc = checkpoint.config
            prepare_counters(self.device, counters_needed(
                config.max_batch_size, mc.num_kv_heads, mc.num_heads // mc.num_kv_heads, MAX_FUSED_TOKENS,
                2 * max(config.prefill_tokens, config.prefill_chunk)))
        self.cache = KVCache(checkpoint.config, config.max_batch_size, config.max_seq_len, self.device, config.dtype)
        self._forward = self._forward_logits
        # Compiled forward, used for batch-1 graphs only: measured on an H200 (docs/benchmarks.md),
        # dynamic-shape inductor kernels made batch 16 2.6x slower than plain graphs, while at
        # batch 1 fusion lifts graphs from 325 to 504 tok/s. The fused kernels make it unnecessary.
        self._forward_compiled = (torch.compile(self._forward_logits, dynamic=True, fullgraph=True)
                                  if config.compile and not self.model.fused else None)
        self._graphs: dict[tuple, CapturedCall] = {}  # (batch, tokens/row, context, tree, patch key)
        self._graph_pool = torch.cuda.graph_pool_handle() if config.cuda_graphs else None
        # prefill graphs: a pool and a capture stream of their own, so a prefill can replay on that
        # stream while a round's graph replays on the main one (``admission_stream``)
        self._prefill_pool = torch.cuda.graph_pool_handle() if config.cuda_graphs else None
        self._admission_stream = (torch.cuda.Stream(self.device) if config.cuda_graphs and not config.fixed_step_tokens
                                  else None)
        # pinned host inputs per graph, two per shape: with a round in flight (chained rounds) the next
        # round's inputs are staged while the previous copy may not have run yet
        self._staging: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}
        self._staging_turn: dict[tuple, int] = {}
        self._warmed: set[tuple] = set()  # keys of steps with an epilogue that ran eagerly once
        self._prefiller = Prefiller(self)
        t0 = time.perf_counter()
        made = self._prefiller.capture_all()
        if made:
            log.info("captured %d prefill CUDA graphs (%s buckets) in %.1f s", made,
                     "packed tokens x sequences" if self._prefiller.varlen else "rows x positions",
                     time.perf_counter() - t0)

    @property
    def kernels(self) -> str:
        """The decode/verify path in use: "fused" (Triton kernels, our attention), "fused-flash",
        "fused-heuristic" or "reference" (``RunnerConfig.kernels``, resolved)."""
        return self._kernels

    @property
    def attention_backend(self) -> str:
        """Attention of decode/verify steps: "triton-gqa" (with "-split<chunk>" under
        ``attention_chunk``), "flash-attn", "flash-attn-heuristic" (fused paths) or "sdpa-masked"
        (reference)."""
        return attention_name(self.kernels, self.attention_chunk)

    # ------------------------------------------------------------------ forwards

    def _forward_logits(self, packed: torch.Tensor, k_cache, v_cache, attn_len: int, q: int) -> StepOutput:
        """``packed`` int64 rows (one H2D copy): start, q_len, then ``q`` tokens; for token trees
        also ``q`` depths and the ``q x q`` visibility mask, flattened. (start and q_len come first
        so that every index into a row is a constant or a slice: an integer index that depends on
        ``q`` would make ``torch.compile`` specialise on q and recompile for every draft length.)"""
        depth = tree_mask = None
        if packed.shape[1] > q + 2:
            depth = packed[:, q + 2:2 * q + 2]
            tree_mask = packed[:, 2 * q + 2:].reshape(packed.shape[0], q, q) > 0
        hidden, taps = self.model.forward_hidden(packed[:, 2:q + 2], packed[:, 0], packed[:, 1], k_cache, v_cache,
                                                 attn_len, depth, tree_mask, self.config.taps)
        logits = self.model.logits(hidden, float32=False)  # consumers upcast the rows they sample from
        # the fused path's argmax streams the rows in one launch (the same first index of the maximum)
        return StepOutput(logits, kernels.row_argmax(logits) if self.model.fused else logits.argmax(dim=-1), taps)

    @torch.inference_mode()
    def prefill(self, prompts: dict[int, list[int]],
                taps_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Append prompts to their slots in as few forwards as the token budget allows
        (``tandem.models.prefill``: packed end to end with ``prefill_varlen``, else grouped by
        length, one row per prompt; from a CUDA graph per bucket with ``prefill_graphs``). Other
        slots are untouched.

        Args:
            prompts: slot -> prompt tokens (>= 1 each).
            taps_out: when given and the runner taps hidden states (``RunnerConfig.taps``),
                filled with slot -> ``[len(prompt), len(taps), d]`` tapped states.

        Returns:
            ``[len(prompts), vocab]`` float32 logits at each prompt's last token, in ascending
            slot order.

        Raises:
            CacheFullError: a prompt does not fit in its slot.
            ValueError: an empty prompt.
        """
        return self._prefiller.prefill(prompts, taps_out)

    @property
    def admission_stream(self) -> "torch.cuda.Stream | None":
        """The stream a prefill may run on beside the rounds (``LocalTarget.launch_prefill`` with
        ``overlap``), or None where it may not: without CUDA graphs, with exact kernels, or when
        prefills are not the varlen path from CUDA graphs. That path shares nothing mutable with a
        round: its graphs have their own memory pool and were captured on this stream (a graph's
        cuBLAS calls keep the workspace of the stream it was captured on), its attention is
        flash-attn's varlen kernel (no split-KV arrival counters, which our decode attention
        shares between launches), and it writes only its own slots' K/V rows (a round's idle rows
        write their scratch position)."""
        p = self._prefiller
        return self._admission_stream if p.varlen and p.static and self.device.type == "cuda" else None

    @property
    def prefiller(self) -> Prefiller:
        """The prefill half of the runner, for a drafter that mirrors the prefill's shapes (a
        SpecFormer head observing the prompts: ``Prefiller.varlen`` and its buckets)."""
        return self._prefiller

    @property
    def prefill_bucket_tokens(self) -> int:
        """rows x positions of the largest static prefill bucket: the bound a drafter that mirrors
        the prefill's static shapes (a SpecFormer head observing the prompts) keeps to as well."""
        return self._prefiller.max_bucket_tokens

    def prefill_groups(self, lengths: dict[int, int]) -> list[list[int]]:
        """How ``prefill`` groups prompts of these lengths (key -> tokens) into forwards
        (``Prefiller.groups``): a drafter that mirrors the prefill's shapes groups the same way."""
        return self._prefiller.groups(lengths)

    @torch.inference_mode()
    def step(self, tokens_per_slot: dict[int, list[int]], trees: dict[int, list[int]] | None = None,
             patch: Callable[[torch.Tensor, int], None] | None = None, patch_key: object = None,
             epilogue: Callable[["StepOutput"], torch.Tensor] | None = None) -> StepOutput:
        """Append tokens to several slots in one batched forward (decode or verification).

        Args:
            tokens_per_slot: slot -> tokens to append (ragged lengths; 1 for plain decoding,
                1 + drafts for verification). Slots not named run as idle rows.
            trees: slot -> parent index of each appended token (-1 for the first; a parent
                precedes its children) for token-tree verification: a token sees only its
                ancestors among the appended ones and is rotated for position ``length + depth``.
                Slots without an entry are chains. Token j's K/V is stored at ``length + j``.
            patch: called with the step's packed inputs on the device (``[n, 2 + Q (+ tree
                columns)]`` int64: start, q_len, tokens; see ``_forward_logits``) and the step's
                attended context length (>= every row's start + q_len) before the forward
                runs, to overwrite columns from device state (``tandem.target.RoundState``:
                chained rounds, whose start positions and tokens the host does not know yet): it
                must write the start and tokens of every row with tokens, since the host fills
                only each row's q_len (the values of ``tokens_per_slot`` are placeholders). It
                must only queue device work, and keep every row's writes inside the cache (the
                host then does not check the room: its lengths are upper bounds). The host-side
                lengths still grow by ``len(tokens_per_slot[s])``: the caller corrects them once
                the round is back. With CUDA graphs the patch is captured in the step's graph
                (one launch for both), once per ``patch_key``: patches with the same key must do
                the same device work (they may be different closures over the same tensors).
            epilogue: device work after the forward, given its ``StepOutput`` (inputs and
                attn_len set): verification, the device round state's update, a drafter's work
                on the verify pass; its result is the output's ``epilogue``. Captured in the same
                graph (the round is one launch), keyed by ``patch_key`` as the patch is. An
                epilogue may update device state, so it must run exactly once per step: the
                first step of a key runs eagerly (it warms every kernel up), the second captures
                the graph without warm-up runs and replays it.

        Returns:
            ``StepOutput`` with ``logits`` ``[n, Q, vocab]`` (the model's dtype) and ``argmax`` ``[n, Q]``;
            row = slot, ``Q`` = the longest token list, and row ``s``'s first
            ``len(tokens_per_slot[s])`` positions are valid. With CUDA graphs these are static
            buffers that the next call overwrites: read them first.

        Raises:
            CacheFullError: a slot would grow past the context limit.
        """
        if not tokens_per_slot:
            raise ValueError("step needs at least one slot")
        for slot, toks in tokens_per_slot.items():
            if not toks:
                raise ValueError(f"slot {slot} has no tokens to append")
            if patch is None:  # a patched step's host lengths are upper bounds: the patch keeps to the room
                self.cache.check_room(slot, len(toks))
        n = max(tokens_per_slot) + 1
        q = max(len(t) for t in tokens_per_slot.values())
        attn_len = min(self.cache.capacity, max(self.cache.lengths[s] + len(t) for s, t in tokens_per_slot.items()))
        if self.config.fixed_step_tokens:  # exact kernels: one shape for every step (RunnerConfig)
            n, q = self.cache.num_slots, max(q, self.config.fixed_step_tokens)
            attn_len = min(self.cache.capacity, max(self.cache.lengths[s] + q for s in tokens_per_slot))
        if self.config.cuda_graphs:
            n = batch_bucket(n, self.cache.num_slots)
            attn_len = context_bucket(attn_len, self.cache.capacity)
        tree = bool(trees)
        if patch is not None and not tree:  # the patch writes every row's start and tokens: only q_len is the host's
            packed = torch.zeros(n, 2 + q, dtype=torch.long)
            packed[torch.tensor(list(tokens_per_slot), dtype=torch.long), 1] = torch.tensor(
                [len(t) for t in tokens_per_slot.values()], dtype=torch.long)
        else:
            rows = []
            for slot in range(n):
                toks = tokens_per_slot.get(slot) or []
                row = [self.cache.lengths[slot] if toks else 0, len(toks)] + toks + [0] * (q - len(toks))
                if tree:
                    row += _tree_columns(q, len(toks), (trees or {}).get(slot))
                rows.append(row)
            packed = torch.tensor(rows, dtype=torch.long)
        if self.config.cuda_graphs:
            out = self._replay(n, q, attn_len, packed, tree, patch, patch_key, epilogue)
        else:
            out = self._step_fn(n, q, attn_len, patch, epilogue)(packed.to(self.device))
        for slot, toks in tokens_per_slot.items():
            self.cache.lengths[slot] += len(toks)
        return out

    def forward_packed(self, packed: torch.Tensor, attn_len: int) -> "StepOutput":
        """One forward over device-resident packed rows, without the host's bookkeeping (its
        slots' lengths are not advanced, nothing is checked on the host): for device work inside
        another runner's captured round (a draft model drafting a chained round's next drafts).

        Args:
            packed: ``[n, 2 + q]`` int64 on this runner's device: each row's start position and
                token count (0: an idle row, whose tokens write to the scratch position), then
                ``q`` tokens; row = KV slot.
            attn_len: attended context length (>= every row's start + count).

        Returns:
            ``StepOutput`` as ``step``'s (``logits`` ``[n, q, vocab]``).
        """
        n, q = packed.shape[0], packed.shape[1] - 2
        return self._forward(packed, self.cache.k[:, :n], self.cache.v[:, :n], attn_len, q)

    # ------------------------------------------------------------------ CUDA graphs

    def _step_fn(self, n: int, q: int, attn_len: int, patch=None, epilogue=None,
                 forward=None) -> Callable[[torch.Tensor], "StepOutput"]:
        """The device work of one step over packed inputs ``p``: patch, forward, epilogue."""
        k, v = self.cache.k[:, :n], self.cache.v[:, :n]
        forward = forward or self._forward

        def run(p: torch.Tensor) -> StepOutput:
            if patch is not None:
                patch(p, attn_len)
            out = forward(p, k, v, attn_len, q)._replace(inputs=p, attn_len=attn_len)
            return out if epilogue is None else out._replace(epilogue=epilogue(out))
        return run

    def _replay(self, n: int, q: int, attn_len: int, packed: torch.Tensor, tree: bool = False,
                patch: Callable[[torch.Tensor, int], None] | None = None, patch_key: object = None,
                epilogue: Callable[["StepOutput"], torch.Tensor] | None = None) -> StepOutput:
        key = (n, q, attn_len, tree, patch_key if patch is not None or epilogue is not None else None)
        captured = self._graphs.get(key)
        if captured is None:
            if epilogue is not None and key not in self._warmed:  # see ``step``: run once eagerly first
                self._warmed.add(key)
                return self._step_fn(n, q, attn_len, patch, epilogue)(packed.to(self.device))
            captured = self._capture(n, q, attn_len, packed, patch, epilogue)
            self._graphs[key] = captured
        self._stage(key, packed, captured.inputs[0])
        timeline = step_timeline()  # a bench measuring each step graph's GPU span and idle time
        return captured() if timeline is None else timeline.launch(captured)

    def _stage(self, key: tuple, packed: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy host inputs ``packed`` into a graph's static input ``dest`` without waiting for the
        device: through a pinned staging buffer (a copy from pageable memory may wait for the GPU),
        two per graph ``key``, used in turn (the one used two steps ago has long been copied)."""
        if self.device.type != "cuda":  # the graph bookkeeping run on a CPU (tests)
            dest.copy_(packed)
            return
        ring = self._staging.get(key)
        if ring is None:
            ring = self._staging[key] = [(torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True),
                                          torch.cuda.Event()) for _ in range(2)]
        turn = self._staging_turn[key] = 1 - self._staging_turn.get(key, 1)
        staging, copied = ring[turn]
        copied.synchronize()  # a step whose results were never read (timing loops) may still be copying
        staging.copy_(packed)
        dest.copy_(staging, non_blocking=True)
        copied.record()

    def _capture(self, n: int, q: int, attn_len: int, packed: torch.Tensor,
                 patch: Callable[[torch.Tensor, int], None] | None = None,
                 epilogue: Callable[["StepOutput"], torch.Tensor] | None = None) -> "CapturedCall":
        # Capturing during a real step is safe: a forward writes only its own tokens' K/V, so the
        # warm-up runs and the replay write identical values to identical positions (a patch that
        # drafts may draft fewer tokens in the second warm-up, which sees its own output; the
        # replay, from the staged inputs, then writes every position the step owns again). An
        # epilogue updates state: its step ran eagerly once already, and is captured without warm-up.
        log.info("capturing CUDA graph for batch %d, %d tokens/row, context %d", n, q, attn_len)
        packed = packed.to(self.device)
        warmup = 0 if epilogue is not None else 2
        if self._forward_compiled is not None and n == 1:
            compiled = self._step_fn(n, q, attn_len, patch, epilogue, forward=self._forward_compiled)
            try:
                return CapturedCall(compiled, (packed,), pool=self._graph_pool, warmup=warmup,
                                    label=f"round b{n} q{q} ctx{attn_len} (compiled)")
            except Exception as exc:  # compiler failure: keep serving on the uncompiled forward
                log.warning("torch.compile failed (%s); using the uncompiled forward", exc)
                self._forward_compiled = None
        return CapturedCall(self._step_fn(n, q, attn_len, patch, epilogue), (packed,), pool=self._graph_pool,
                            warmup=warmup, label=f"round b{n} q{q} ctx{attn_len}")

    def warmup(self, batch_sizes: list[int], tokens_per_row: int = 1, contexts: tuple[int, ...] = (CONTEXT_BUCKET,)) -> None:
        """Compile and capture the decode graphs for these shapes ahead of serving (CUDA only)."""
        if not self.config.cuda_graphs:
            return
        for b in batch_sizes:
            nb = batch_bucket(b, self.cache.num_slots)
            for ctx in contexts:
                if (nb, tokens_per_row, ctx, False, None) not in self._graphs:
                    packed = torch.zeros((nb, tokens_per_row + 2), dtype=torch.long)  # all rows idle
                    self._graphs[(nb, tokens_per_row, ctx, False, None)] = self._capture(nb, tokens_per_row, ctx, packed)

    @torch.inference_mode()
    def measure_step_ms(self, batch_size: int, tokens_per_row: int, context: int, iters: int = 30) -> float:
        """Time of one batched forward T(b, q) in ms: ``batch_size`` rows each appending
        ``tokens_per_row`` tokens after ``context`` cached tokens (cache contents are arbitrary).

        Uses the same path as ``step`` (graph replay when enabled), timed with CUDA events on
        GPU or wall clock on CPU; slot lengths are restored afterwards. Under
        ``fixed_step_tokens`` every shape is padded as ``step`` pads it, so the table is flat:
        measure the cost model on a runner without it.

        Raises:
            ValueError: the shape does not fit the cache.
        """
        if batch_size > self.cache.num_slots or context + tokens_per_row > self.cache.capacity:
            raise ValueError(f"batch {batch_size} x context {context} + {tokens_per_row} does not fit the cache")
        saved = list(self.cache.lengths)
        batch = {s: [0] * tokens_per_row for s in range(batch_size)}

        def once() -> None:
            for s in range(batch_size):
                self.cache.lengths[s] = context
            self.step(batch)

        try:
            for _ in range(3):
                once()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(iters):
                    once()
                end.record()
                end.synchronize()
                return begin.elapsed_time(end) / iters
            import time

            t0 = time.perf_counter()
            for _ in range(iters):
                once()
            return (time.perf_counter() - t0) * 1e3 / iters
        finally:
            self.cache.lengths[:] = saved

    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes()


class StepOutput(NamedTuple):
    """One batched forward's result: ``logits`` ``[n, Q, vocab]`` in the model's dtype (bfloat16 on
    a GPU: the argmax of a bf16 row equals that of its exact float32 upcast, and the rows that are
    sampled are upcast by ``sampling_probs``), ``argmax`` ``[n, Q]``,
    ``taps`` ``[n, Q, len(taps), d]`` when the runner taps hidden states (else None), and
    ``inputs``, the step's packed int64 rows on the device (start, q_len, the Q tokens, then tree
    columns; see ``ModelRunner._forward_logits``), so that verification reads the drafts there
    instead of copying them to the device again, and ``attn_len``, the attended context length
    (>= every row's start + q_len; 0 after a prefill), and ``epilogue``, the result of the step's
    epilogue (``ModelRunner.step``), if any."""

    logits: torch.Tensor
    argmax: torch.Tensor
    taps: torch.Tensor | None = None
    inputs: torch.Tensor | None = None
    attn_len: int = 0
    epilogue: torch.Tensor | None = None


def _tree_columns(q: int, n: int, parents: list[int] | None) -> tuple[int, ...]:
    """Depth (``q``) and flattened visibility mask (``q * q``) columns of one row; padding and
    idle positions see only themselves (finite, ignored). A step asks for them for every row of
    a round with trees, and a round's shapes recur (chains of each length, the policy's trees of
    each chain length and width): memoised, so the columns cost a look-up a row."""
    return _tree_columns_of(q, n, None if parents is None else tuple(parents))


@functools.lru_cache(maxsize=4096)
def _tree_columns_of(q: int, n: int, parents: tuple[int, ...] | None) -> tuple[int, ...]:
    if parents is None:
        parents = list(range(-1, n - 1))  # a chain
    if len(parents) != n or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"tree parents {parents} must name an earlier token (or -1) for each of {n} tokens")
    depth = [0] * q
    mask = [[0] * q for _ in range(q)]
    for i in range(q):
        mask[i][i] = 1
    for i in range(n):
        p = parents[i]
        if p >= 0:
            depth[i] = depth[p] + 1
            mask[i][:i] = mask[p][:i]
    return tuple(depth + [x for row in mask for x in row])
