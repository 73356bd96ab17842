"""Lossless verification of draft tokens against one batched target forward.

Greedy: accept the longest draft prefix equal to the target's argmax, then emit the target's
argmax at the first mismatch (or after the last draft) as the bonus token.

Sampling: speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Alg. 1; Chen et al. 2023). Draft x_i ~ q_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); on the first rejection a token is drawn from the residual
norm(max(0, p_i - q_i)); if all drafts are accepted, a bonus token is drawn from p_{n+1}. p and q
are both passed through ``tandem.sampling.sampling_probs`` with the request's temperature /
top-k / top-p, so every emitted token is distributed exactly as target-only sampling.

Chains (every drafter's plain drafts) are verified by ``verify_chains``: the whole batch at once,
on the device, with no host synchronisation and no per-token host work; its random numbers come
from ``tandem.sampling.counter_uniform`` keyed by (request seed, sequence position), so a seeded
request gives the same tokens in any batch. Token trees (hard-position branching): greedy
ones are verified with the batch, on the device (``verify_trees_greedy``); sampled ones walk the
per-sequence ``verify_tree_sampling`` on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import residual_kernel
from .models.kernels import round_kernels_on
from .sampling import (STREAM_ACCEPT, STREAM_SAMPLE, LogitAdjustments, adjust_logits, chain_prefix, counter_uniform,
                       sample_inverse_cdf, sampling_probs)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome for one sequence.

    Attributes:
        tokens: emitted tokens: the accepted drafts then one target token (bonus or correction).
        num_accepted: drafts accepted (``len(tokens) - 1``).
        path: token trees: indices of the accepted drafts, root to leaf (None for chains).
    """

    tokens: list[int]
    num_accepted: int
    path: list[int] | None = None


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings of a verify batch, as device tensors (one row per sequence).

    Attributes:
        greedy: ``[B]`` bool, temperature 0 (argmax verification).
        temperature: ``[B]`` float32 (any positive value on greedy rows; not used there).
        top_k: ``[B]`` int64, 0 = off.
        top_p: ``[B]`` float32 in (0, 1].
        seed: ``[B]`` int64 request seeds in [0, 2**63).
        any_sampled: some row is not greedy (host-side flag: all-greedy batches skip sampling).
        filtered: some sampled row uses top-k or top-p (host-side flag: else no sort is needed).
        adjust: the rows' logit adjustments (logit_bias, min_tokens, penalties), or None when no
            row has any (``tandem.sampling.adjust_logits``).
        allowed: ``[B, Q, V]`` bool, the tokens a grammar allows at each verified position
            (structured output, ``tandem.structured``; rows without a grammar allow all), or None.
            Applied after the adjustments: the rest are -inf.
    """

    greedy: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    any_sampled: bool = True
    filtered: bool = True
    adjust: LogitAdjustments | None = None
    allowed: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> "RowSampling":
        """The settings of rows ``index`` (``[R]`` int64)."""
        return RowSampling(self.greedy[index], self.temperature[index], self.top_k[index], self.top_p[index],
                           self.seed[index], self.any_sampled, self.filtered,
                           None if self.adjust is None else self.adjust.rows(index),
                           None if self.allowed is None else self.allowed[index])

    def constrain(self, logits: torch.Tensor, positions: torch.Tensor, prefix: torch.Tensor | None = None,
                  prefix_valid: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` ``[B, Q, V]`` after the rows' adjustments (``adjust_logits``, same arguments)
        and grammar masks (``allowed``): what argmax and the sampling transform read. Unchanged
        when the rows have neither."""
        if self.adjust is not None:
            logits = adjust_logits(logits, self.adjust, positions, prefix, prefix_valid)
        if self.allowed is not None:
            Q = logits.shape[1]
            logits = logits.float().masked_fill(~self.allowed[:, :Q], float("-inf"))
        return logits


def target_probs(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """p: the sampling transform of target logits, row settings broadcast over positions.

    Args:
        logits: ``[B, Q, V]``.

    Returns:
        ``[B, Q, V]`` float32 probabilities.
    """
    B, Q, V = logits.shape
    rep = lambda t: t[:, None].expand(B, Q).reshape(-1)  # noqa: E731
    return sampling_probs(logits.reshape(B * Q, V), rep(sampling.temperature), rep(sampling.top_k),
                          rep(sampling.top_p), sampling.filtered).view(B, Q, V)


def accept_drafts(p_draft: torch.Tensor, q_draft: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The accept test of speculative sampling: ``u < min(1, p(x) / q(x))``, written ``u q < p``
    (no division; since u < 1, p >= q always accepts).

    Args:
        p_draft / q_draft: ``[B, K]`` target and draft probability of each draft token.
        uniform: ``[B, K]`` in [0, 1).

    Returns:
        ``[B, K]`` bool.
    """
    return uniform * q_draft < p_draft


def rejection_weights(p_row: torch.Tensor, q_row: torch.Tensor | None, rejected_token: torch.Tensor,
                      rejected: torch.Tensor) -> torch.Tensor:
    """Weights of the token emitted at each row's stop position: the residual max(0, p - q) where
    a draft was rejected (q one-hot at ``rejected_token`` when ``q_row`` is None: p with that
    token removed), p itself where every draft was accepted (the bonus token). A residual that is
    empty (p == q up to rounding) falls back to p.

    Args:
        p_row: ``[B, V]`` p at the stop position.
        q_row: ``[B, V]`` q of the rejected draft there, or None (deterministic drafter).
        rejected_token: ``[B]`` the rejected draft token (any value on bonus rows).
        rejected: ``[B]`` bool, the row stopped at a rejection (else: a bonus row).

    Returns:
        ``[B, V]`` non-negative weights (not normalised).
    """
    if q_row is None:
        residual = p_row.scatter(-1, rejected_token[:, None], 0.0)
    else:
        residual = (p_row - q_row).clamp_min(0.0)
    empty = residual.sum(-1) <= 0.0
    return torch.where((rejected & ~empty)[:, None], residual, p_row)


def stop_weights(p: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                 draft_lens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Weights of the token each row emits after its accepted drafts: at row position
    ``num_accepted``, the residual of the rejected draft, or p there (the bonus token) when every
    draft was accepted (``rejection_weights``).

    Args:
        p: ``[B, K + 1, V]``; draft_probs: ``[B, K, V]`` or None (q one-hot);
        draft_tokens: ``[B, K]``; draft_lens / num_accepted: ``[B]``.

    Returns:
        ``[B, V]``.
    """
    B, Q, _ = p.shape
    rows = torch.arange(B, device=p.device)
    at = num_accepted.clamp(max=max(Q - 2, 0))
    rejected_token = draft_tokens[rows, at] if Q > 1 else torch.zeros_like(num_accepted)
    q_row = None if draft_probs is None or Q == 1 else draft_probs[rows, at]
    return rejection_weights(p[rows, num_accepted], q_row, rejected_token, num_accepted < draft_lens)


def sample_stop_tokens(p: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                       draft_lens: torch.Tensor, num_accepted: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token each row emits after its accepted drafts: the inverse-CDF draw
    (``sample_inverse_cdf``) with ``uniform`` from ``stop_weights``. On CUDA two launches read p
    and q in place instead of materialising the weights (``tandem.residual_kernel``: the same
    draws); elsewhere these ops.

    Args:
        p: ``[B, K + 1, V]`` float32; draft_probs: ``[B, K, V]`` or None (q one-hot);
        draft_tokens: ``[B, K]``; draft_lens / num_accepted: ``[B]``; uniform: ``[B]`` in [0, 1).

    Returns:
        ``[B]`` int64.
    """
    if round_kernels_on(p.device) and residual_kernel.readable(p, draft_probs, draft_tokens):
        return residual_kernel.sample_stop_tokens(p, draft_probs, draft_tokens, draft_lens, num_accepted, uniform)
    return sample_inverse_cdf(stop_weights(p, draft_probs, draft_tokens, draft_lens, num_accepted), uniform)


@dataclass(frozen=True)
class ChainVerification:
    """``verify_chains``' result, on the device.

    Attributes:
        num_accepted: ``[B]`` int64 drafts accepted per row.
        tokens: ``[B, K + 1]`` int64; row b emits ``tokens[b, :num_accepted[b] + 1]`` (the accepted
            drafts then the bonus or correction token); later entries are meaningless.
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor


def verify_chains(logits: torch.Tensor, argmax: torch.Tensor, draft_tokens: torch.Tensor, draft_lens: torch.Tensor,
                  positions: torch.Tensor, sampling: RowSampling, draft_probs: torch.Tensor | None = None
                  ) -> ChainVerification:
    """Verify every row's chain of drafts at once, on the device, with no host synchronisation.

    With ``sampling.adjust`` or ``sampling.allowed``, the logits are first adjusted and masked
    (``RowSampling.constrain``: each position sees the drafts before it as output) and the
    argmax is taken over them.
    Greedy rows accept the longest prefix equal to the target argmax and emit the argmax after it.
    Sampled rows run speculative sampling (module docstring), with uniforms
    ``counter_uniform(seed, position, STREAM_ACCEPT)`` for the accept test of the draft at a
    position and ``STREAM_SAMPLE`` for the token drawn there.

    Args:
        logits: ``[B, K + 1, V]`` target logits over [last token, d_1 .. d_K] (row j predicts the
            token after input j; rows past a row's draft length are ignored).
        argmax: ``[B, K + 1]`` their argmax.
        draft_tokens: ``[B, K]`` int64 (padding past ``draft_lens`` is ignored).
        draft_lens: ``[B]`` int64 in [0, K].
        positions: ``[B]`` int64 sequence position of each row's first draft token (tokens the
            sequence holds, the last one included).
        sampling: per-row settings.
        draft_probs: ``[B, K, V]`` q each sampled row's drafts were drawn from (after the same
            sampling transform), or None when every draft is deterministic (q one-hot: n-gram,
            greedy drafters).

    Returns:
        ``ChainVerification``.

    Raises:
        ValueError: shapes disagree.
    """
    B, Q = argmax.shape
    K = Q - 1
    if draft_tokens.shape != (B, K) or tuple(logits.shape[:2]) != (B, Q):
        raise ValueError(f"verify_chains: logits {tuple(logits.shape)} / argmax {tuple(argmax.shape)} need "
                         f"draft_tokens [B, Q - 1], got {tuple(draft_tokens.shape)}")
    if sampling.adjust is not None or sampling.allowed is not None:
        logits = sampling.constrain(logits, positions, *chain_prefix(draft_tokens, draft_lens))
        argmax = logits.argmax(-1)
    cols = torch.arange(K, device=argmax.device)
    valid = cols[None, :] < draft_lens[:, None]  # [B, K]
    match = (draft_tokens == argmax[:, :K]) & valid
    if sampling.any_sampled:
        p = target_probs(logits, sampling)  # [B, K + 1, V]
        p_draft = p[:, :K].gather(-1, draft_tokens[..., None])[..., 0]
        q_draft = (torch.ones_like(p_draft) if draft_probs is None
                   else draft_probs.gather(-1, draft_tokens[..., None])[..., 0])
        u = counter_uniform(sampling.seed, positions[:, None] + cols[None, :], STREAM_ACCEPT)
        accepted = accept_drafts(p_draft, q_draft, u) & valid
        accepted = torch.where(sampling.greedy[:, None], match, accepted)
    else:
        accepted = match
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    stop = num_accepted[:, None]
    next_token = argmax.gather(-1, stop)[:, 0]
    if sampling.any_sampled:
        u = counter_uniform(sampling.seed, positions + num_accepted, STREAM_SAMPLE)
        drawn = sample_stop_tokens(p, draft_probs, draft_tokens, draft_lens, num_accepted, u)
        next_token = torch.where(sampling.greedy, next_token, drawn)
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)
    tokens = padded.scatter(1, stop, next_token[:, None])
    return ChainVerification(num_accepted, tokens)


def sample_tokens(logits: torch.Tensor, positions: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """One token per row (after prefill, or target-only decoding): the argmax on greedy rows, a
    draw from the row's sampling transform with ``counter_uniform(seed, position, STREAM_SAMPLE)``
    elsewhere. The same numbers ``verify_chains`` uses for a row without drafts.

    Args:
        logits: ``[B, V]``; positions: ``[B]`` int64 position of the token drawn.

    Returns:
        ``[B]`` int64.
    """
    if sampling.adjust is not None or sampling.allowed is not None:
        logits = sampling.constrain(logits[:, None], positions)[:, 0]
    out = logits.argmax(-1)
    if not sampling.any_sampled:
        return out
    p = target_probs(logits[:, None], sampling)[:, 0]
    u = counter_uniform(sampling.seed, positions, STREAM_SAMPLE)
    return torch.where(sampling.greedy, out, sample_inverse_cdf(p, u))


def verify_trees_greedy(argmax: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor,
                        q_len: torch.Tensor) -> tuple[ChainVerification, torch.Tensor]:
    """Greedy verification of token trees (SpecInfer, Miao et al. 2024: from the root, follow the
    child equal to the target's argmax; emit the argmax where no child matches) for every row at
    once, on the device, with no host synchronisation: each node's test is vectorised over the batch and the tree (a node is accepted when it and
    every ancestor equal the target's argmax after their parent, the first such child of a node
    winning), so a round of token trees costs a few small kernels, not a host walk per tree.
    A chain is a tree too (each token's parent the one before): its rows give ``verify_chains``'
    greedy result.

    Args:
        argmax: ``[B, Q]`` target argmax after each step position (position 0: the last token;
            position i + 1: tree token i).
        tokens: ``[B, Q]`` int64 the step's tokens (position 0 the last token).
        depth: ``[B, Q]`` int64 each position's depth (the last token 0, its children 1, ...).
        visible: ``[B, Q, Q]`` bool, position i sees j: j is i or an ancestor of i (the tree
            mask ``ModelRunner.step`` attends with; padding sees only itself).
        q_len: ``[B]`` int64 positions in use (1 + tree tokens; 0 for idle rows).

    Returns:
        ``(ChainVerification, path)``: accepted counts ``[B]`` and emitted tokens ``[B, Q]`` (row b
        emits ``tokens[b, :num_accepted[b] + 1]``, the accepted branch root to leaf, then the
        argmax after it), and ``[B, Q - 1]`` int64 the step position of the accepted token at each
        depth (``path[b, d - 1]``; entries past ``num_accepted`` are 0).
    """
    B, Q = argmax.shape
    if Q == 1:  # no tree tokens: the argmax after the last token
        return ChainVerification(argmax.new_zeros(B), argmax.clone()), argmax.new_zeros(B, 0)
    j = torch.arange(1, Q, device=argmax.device)  # the tree tokens' positions
    # a token's parent is its latest proper ancestor (parents precede children); the last token is
    # every token's ancestor and always kept, so only the tree tokens' own columns are tested
    parent = (visible[:, 1:, :-1].tril() * (j - 1)).amax(-1)  # [B, Q - 1]
    match = (j[None, :] < q_len[:, None]) & (tokens[:, 1:] == argmax.gather(1, parent))
    # several children may equal the argmax only when they repeat a token: the first one wins
    earlier = ((parent[:, :, None] == parent[:, None, :]) & match[:, None, :]).tril(-1).any(-1)
    good = match & ~earlier
    accepted = ~(visible[:, 1:, 1:] & ~good[:, None, :]).any(-1)  # it and every ancestor good: one branch
    num_accepted = accepted.sum(-1)
    leaf = (accepted * j).amax(-1, keepdim=True)  # the branch's deepest token (0: none accepted)
    col = torch.where(accepted, depth[:, 1:] - 1, Q)  # the token at depth d goes to column d - 1; the rest to a spare
    emitted = torch.zeros(B, Q + 1, dtype=tokens.dtype, device=tokens.device).scatter_(1, col, tokens[:, 1:])
    emitted = emitted[:, :Q].scatter(1, num_accepted[:, None], argmax.gather(1, leaf))
    path = torch.zeros(B, Q + 1, dtype=torch.int64, device=tokens.device).scatter_(1, col, j.expand(B, Q - 1))
    return ChainVerification(num_accepted, emitted), path[:, :Q - 1]


def tree_path(draft_tokens: list[int], parents: list[int], accepted: list[int]) -> list[int]:
    """The indices of a tree's accepted drafts, root to leaf, from the accepted tokens: at each
    node the first child holding the next token (``verify_trees_greedy``'s rule, so its path).

    Raises:
        ValueError: ``accepted`` is no branch of the tree.
    """
    node, path = -1, []
    for tok in accepted:
        node = next((c for c in _children(parents, node) if draft_tokens[c] == tok), None)
        if node is None:
            raise ValueError(f"tokens {accepted} are no branch of the tree {draft_tokens} / {parents}")
        path.append(node)
    return path


def _children(parents: list[int], node: int) -> list[int]:
    return [i for i, p in enumerate(parents) if p == node]


def verify_tree_sampling(draft_tokens: list[int], parents: list[int], draft_probs: torch.Tensor | None,
                         target_probs: torch.Tensor, seed: int, position: int) -> VerifyResult:
    """Speculative sampling over a token tree. A node with one child drawn from q uses the
    min(1, p/q) rule; a node with several children tries them in order as one-hot proposals —
    accept child c with probability r(c) / Σ r, else zero r(c) and go on — and samples from the
    remaining r if all are rejected (r starts at p). Either way the emitted token is distributed
    as p, whatever produced the candidates (SpecInfer, Miao et al. 2024).

    Random numbers: ``counter_uniform(seed, position + depth, stream)`` with ``STREAM_ACCEPT``
    for a single child's test, streams 2, 3, ... for the tries among several children and
    ``STREAM_SAMPLE`` for the emitted token, as ``verify_chains`` does for chains.

    Args:
        draft_probs: ``[n, vocab]`` q per tree token (used only for single-child nodes), or None.
        target_probs: ``[n + 1, vocab]``; row ``i + 1`` is the target after token i.
        seed: the request's seed; position: sequence position of the first tree level.
    """
    n = len(draft_tokens)
    p_all = target_probs.float().cpu()  # one copy: the walk below reads single entries
    q_all = None if draft_probs is None else draft_probs.float().cpu()
    streams = 2 + max((parents.count(x) for x in set(parents)), default=0)
    pos = torch.arange(position, position + n + 1)[None, :]
    seed_t = torch.tensor([seed], dtype=torch.int64)
    u = counter_uniform(seed_t, pos, torch.arange(streams)[:, None]).tolist()  # [stream][depth], one call
    node, path = -1, []
    while True:
        depth = len(path)
        p = p_all[node + 1]
        kids = _children(parents, node)
        if len(kids) == 1 and q_all is not None:
            c = kids[0]
            tok = draft_tokens[c]
            if u[STREAM_ACCEPT][depth] * float(q_all[c, tok]) < float(p[tok]):
                path.append(c)
                node = c
                continue
            residual = (p - q_all[c]).clamp_min(0.0)
        else:
            residual = p.clone()
            accepted = None
            for j, c in enumerate(kids):
                total = float(residual.sum())
                tok = draft_tokens[c]
                if total > 0 and u[2 + j][depth] * total < float(residual[tok]):
                    accepted = c
                    break
                residual[tok] = 0.0
            if accepted is not None:
                path.append(accepted)
                node = accepted
                continue
            if not kids:  # a leaf: the bonus token comes from p itself
                residual = p
        if float(residual.sum()) <= 0.0:
            residual = p
        out = int(sample_inverse_cdf(residual[None], torch.tensor([u[STREAM_SAMPLE][depth]]))[0])
        return VerifyResult([draft_tokens[i] for i in path] + [out], len(path), path)
