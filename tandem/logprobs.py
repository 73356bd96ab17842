"""The log-probabilities a round returns (OpenAI's ``logprobs`` / ``top_logprobs``): packed on the
device into the round's one device-to-host copy, read back on the host. They are the target's raw
log-probabilities (before the sampling transform, logit adjustments and grammar masks), as vLLM's
default."""

from __future__ import annotations

import torch

MAX_TOP_LOGPROBS = 20  # most likely alternatives returned per token at most (OpenAI's top_logprobs limit)


def logprob_columns(logits: torch.Tensor, tokens: torch.Tensor, top: bool) -> torch.Tensor:
    """The log-probability columns of a round's packed results, on the device: the target's
    log-probability (raw logits) of each emitted token, then, with ``top``, the
    ``MAX_TOP_LOGPROBS`` most likely tokens at each position (ids, then their log-probabilities).

    Args:
        logits: ``[n, Q, V]``; row j predicts the token after the j-th input.
        tokens: ``[n, Q]`` int64 tokens emitted at those positions.

    Returns:
        ``[n, Q]`` float64, or ``[n, Q * (1 + 2 * MAX_TOP_LOGPROBS)]`` with ``top``.
    """
    logp = logits.float().log_softmax(-1)
    cols = [logp.gather(-1, tokens[..., None])[..., 0].double()]
    if top:
        values, ids = logp.topk(MAX_TOP_LOGPROBS, dim=-1)  # [n, Q, N], most likely first
        cols += [ids.flatten(1).double(), values.flatten(1).double()]
    return torch.cat(cols, dim=1)


def read_logprob_columns(row: list[float], start: int, width: int, count: int, top: int
                          ) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """The host side of ``logprob_columns``: the first ``count`` positions' log-probabilities and
    (``top`` > 0) their ``top`` most likely tokens, from one packed row whose log-probability
    columns start at ``start`` for a round of ``width`` positions."""
    lp = row[start:start + count]
    if not top:
        return lp, None
    n = MAX_TOP_LOGPROBS
    ids, values = start + width, start + width + width * n
    return lp, [[(int(row[ids + j * n + i]), row[values + j * n + i]) for i in range(top)] for j in range(count)]


def wants_logprobs(it) -> bool:
    """The item asked for log-probabilities (``top_logprobs`` implies them)."""
    return it.return_logprobs or it.top_logprobs > 0


def logprob_mode(items: list) -> int:
    """Which log-probability columns a round packs: 0 none, 1 the emitted tokens', 2 those and the
    top alternatives (``logprob_columns``); one value per round, part of a chained graph's key."""
    if any(it.top_logprobs for it in items):
        return 2
    return 1 if any(it.return_logprobs for it in items) else 0
