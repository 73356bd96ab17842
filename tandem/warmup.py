"""Capture a server's decode-round CUDA graphs before traffic comes.

A round's graph is keyed by its shape: the batch bucket (rows up to the highest slot in use,
rounded up to a power of two), the tokens per row and the context bucket (the longest row's
attended length, rounded up to ``CONTEXT_BUCKET`` positions). The engine captures a shape the
second time it meets it (``ModelRunner.step``: the first run is eager), which takes a step tens of
milliseconds; a server whose load moves through batch sizes and context lengths would pay that
in the middle of live requests, for as long as new shapes keep coming. ``capture_round_shapes``
meets every (batch bucket, context bucket) of the engine once at start-up instead, as vLLM
captures its decode graphs for every batch size before serving, with synthetic greedy requests
that leave nothing behind: no request, no slot, no statistic, nothing learned by the draft policy.

Prefill graphs (``tandem.models.prefill``) and a SpecFormer head's prompt-observe graphs are
already captured when the runner and the head are built; sampled requests, log-probabilities and
token trees bring shapes of their own, met at their first use as before.
"""

from __future__ import annotations

import copy
import logging
import time

from .engine import Engine
from .models.graphs import CONTEXT_BUCKET, CapturedCall, batch_bucket
from .sampling import SamplingParams

log = logging.getLogger(__name__)

ROUNDS_PER_SHAPE = 3  # the eager run, the capture, one replay (a capture that fails shows there)


def round_shapes(num_slots: int, capacity: int) -> list[tuple[int, int]]:
    """Every (batch bucket, context bucket) a round of an engine with ``num_slots`` KV slots of
    ``capacity`` positions can have: batch buckets 1, 2, 4 ... ``num_slots``; context buckets
    ``CONTEXT_BUCKET``, 2 x ... up to ``capacity``."""
    batches = sorted({batch_bucket(n, num_slots) for n in range(1, num_slots + 1)})
    contexts = sorted({min(capacity, c) for c in range(CONTEXT_BUCKET, capacity + CONTEXT_BUCKET, CONTEXT_BUCKET)})
    return [(b, c) for b in batches for c in contexts]


def capture_round_shapes(engine: Engine, vocab_token: int | None = None) -> int:
    """Run one batch of synthetic requests per round shape (``round_shapes``) through ``engine``
    so that each shape's graph is captured now: ``b`` requests for batch bucket ``b`` (they take
    slots 0 .. b - 1), each with a prompt that puts its rounds in context bucket ``c`` and
    ``ROUNDS_PER_SHAPE`` output tokens (greedy, EOS ignored). Afterwards the engine holds nothing
    of them: its counters, statistics and admission state are restored, and its draft policy and
    round callback did not see their rounds.

    Args:
        engine: an idle engine (no request queued or running).
        vocab_token: the token the synthetic prompts repeat (default: a cycle of 97 ordinary token
            ids, past the special ones at the start of a vocabulary: a pattern an n-gram drafter
            finds drafts in).

    Returns:
        The CUDA graphs captured (0 without CUDA graphs: the rounds then ran eagerly).

    Raises:
        RuntimeError: the engine is not idle. A step that fails raises its error after the
            synthetic requests left are aborted and the engine's state restored.
    """
    if engine.has_unfinished():
        raise RuntimeError("capture_round_shapes needs an idle engine (requests are queued or running)")
    target = engine.target
    capacity, num_slots = target.info.max_seq_len, target.info.num_slots
    k = engine.configured_draft_limit
    span = ROUNDS_PER_SHAPE * (k + 1) + 1  # positions a request's rounds may add: it stays inside its bucket
    first = 1000 if target.info.vocab_size > 2000 else 1  # ordinary tokens, past a vocabulary's special ones
    saved = (engine.num_rounds, engine.round_wall_s, engine.round_rows, copy.deepcopy(engine.stats),
             copy.deepcopy(engine.admission), engine.draft_policy, engine.on_round, engine.verification_sink,
             engine.max_running)
    engine.draft_policy, engine.on_round, engine.verification_sink = None, None, None
    engine.admission.intake_s = 0.0  # (its synthetic requests are all queued at once: nothing to wait for)
    shapes = round_shapes(num_slots, capacity)
    made0, t0 = CapturedCall.made, time.perf_counter()
    params = SamplingParams(max_tokens=ROUNDS_PER_SHAPE, ignore_eos=True)
    ids: list[str] = []
    try:
        engine.max_running = num_slots
        for b, c in shapes:
            below = (c - 1) // CONTEXT_BUCKET * CONTEXT_BUCKET  # the bucket below's end
            length = max(1, min(below + 1, capacity - span))  # just past it, with room for the rounds
            if length + span > capacity:  # a context too small for any round of this width
                continue
            prompt = [vocab_token if vocab_token is not None else first + i % 97 for i in range(length)]
            ids = [engine.add_request(prompt_ids=prompt, params=params, final_only=True) for _ in range(b)]
            while engine.has_unfinished():
                engine.step()
            for rid in ids:
                engine.completion(rid)
    finally:
        for rid in ids:  # (a failed step: the synthetic requests left are dropped with their slots)
            engine.abort(rid)
        (engine.num_rounds, engine.round_wall_s, engine.round_rows, engine.stats, engine.admission,
         engine.draft_policy, engine.on_round, engine.verification_sink, engine.max_running) = saved
    made = CapturedCall.made - made0
    log.info("captured %d decode-round CUDA graphs for %d round shapes in %.1f s", made, len(shapes),
             time.perf_counter() - t0)
    return made
