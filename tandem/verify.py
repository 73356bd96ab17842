"""Lossless verification of draft tokens against one batched target forward.

Greedy: accept the longest draft prefix equal to the target's argmax, then emit the target's
argmax at the first mismatch (or after the last draft) as the bonus token.

Sampling: speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Alg. 1; Chen et al. 2023). Draft x_i ~ q_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); on the first rejection a token is drawn from the residual
norm(max(0, p_i - q_i)); if all drafts are accepted, a bonus token is drawn from p_{n+1}. p and q
are both passed through ``tandem.sampling.sampling_probs`` with the request's temperature /
top-k / top-p, so every emitted token is distributed exactly as target-only sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, sampling_probs


@dataclass(frozen=True)
class VerifyResult:
    """Outcome for one sequence.

    Attributes:
        tokens: emitted tokens: the accepted drafts then one target token (bonus or correction).
        num_accepted: drafts accepted (``len(tokens) - 1``).
    """

    tokens: list[int]
    num_accepted: int
    path: list[int] | None = None  # token trees: indices of the accepted drafts, root to leaf


def verify_greedy(draft_tokens: list[int], target_argmax: list[int]) -> VerifyResult:
    """Greedy verification.

    Args:
        draft_tokens: n draft ids.
        target_argmax: n + 1 target argmax ids at [last token, d_1, ..., d_n].

    Raises:
        ValueError: ``len(target_argmax) != len(draft_tokens) + 1``.
    """
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError(f"need {len(draft_tokens) + 1} target predictions, got {len(target_argmax)}")
    m = 0
    while m < len(draft_tokens) and draft_tokens[m] == target_argmax[m]:
        m += 1
    return VerifyResult(list(draft_tokens[:m]) + [target_argmax[m]], m)


def verify_sampling(draft_tokens: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                    generator: torch.Generator | None) -> VerifyResult:
    """Speculative sampling for one sequence.

    Args:
        draft_tokens: n draft ids.
        draft_probs: ``[n, vocab]`` q each draft was drawn from, or None for a deterministic
            drafter (q one-hot at each draft).
        target_probs: ``[n + 1, vocab]`` transformed target probabilities p.
        generator: the request's generator (on ``target_probs``' device).

    Raises:
        ValueError: shapes disagree.
    """
    n = len(draft_tokens)
    if target_probs.shape[0] != n + 1 or (draft_probs is not None and draft_probs.shape[0] != n):
        raise ValueError("draft / target probability rows do not match the number of drafts")
    dev = target_probs.device
    uniforms = torch.rand(n, generator=generator, device=dev).tolist() if n else []
    for i, tok in enumerate(draft_tokens):
        p = target_probs[i]
        p_x = float(p[tok])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, tok])
        if q_x > 0 and uniforms[i] < min(1.0, p_x / q_x):
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[tok] = 0.0
        else:
            residual = (p - draft_probs[i].to(p.dtype)).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: the residual is empty, fall back to p
            residual, total = p, float(p.sum())
        correction = int(torch.multinomial(residual / total, 1, generator=generator))
        return VerifyResult(list(draft_tokens[:i]) + [correction], i)
    bonus = int(torch.multinomial(target_probs[n], 1, generator=generator))
    return VerifyResult(list(draft_tokens) + [bonus], n)


def _children(parents: list[int], node: int) -> list[int]:
    return [i for i, p in enumerate(parents) if p == node]


def verify_tree_greedy(draft_tokens: list[int], parents: list[int], target_argmax: list[int]) -> VerifyResult:
    """Greedy verification of a token tree (SpecInfer, Miao et al. 2024): from the root, follow
    the child equal to the target's argmax; emit the argmax where no child matches.

    Args:
        draft_tokens: n tree tokens; ``parents[i]`` is the index of token i's parent (-1: the
            last accepted token, row 0). Row ``i + 1`` of ``target_argmax`` is token i's.
        target_argmax: n + 1 target argmax ids.
    """
    node, path = -1, []
    while True:
        a = target_argmax[node + 1]
        nxt = next((c for c in _children(parents, node) if draft_tokens[c] == a), None)
        if nxt is None:
            return VerifyResult([draft_tokens[i] for i in path] + [a], len(path), path)
        path.append(nxt)
        node = nxt


def verify_tree_sampling(draft_tokens: list[int], parents: list[int], draft_probs: torch.Tensor | None,
                         target_probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """Speculative sampling over a token tree. A node with one child drawn from q uses the
    min(1, p/q) rule; a node with several children tries them in order as one-hot proposals —
    accept child c with probability r(c) / Σ r, else zero r(c) and go on — and samples from the
    remaining r if all are rejected (r starts at p). Either way the emitted token is distributed
    as p, whatever produced the candidates.

    Args:
        draft_probs: ``[n, vocab]`` q per tree token (used only for single-child nodes), or None.
        target_probs: ``[n + 1, vocab]``; row ``i + 1`` is the target after token i.
    """
    node, path = -1, []
    while True:
        p = target_probs[node + 1]
        kids = _children(parents, node)
        if len(kids) == 1 and draft_probs is not None:
            c = kids[0]
            tok = draft_tokens[c]
            q_x = float(draft_probs[c, tok])
            if q_x > 0 and float(torch.rand((), generator=generator, device=p.device)) < min(1.0, float(p[tok]) / q_x):
                path.append(c)
                node = c
                continue
            residual = (p - draft_probs[c].to(p.dtype)).clamp_min(0.0)
        else:
            residual = p.clone()
            accepted = None
            for c in kids:
                total = float(residual.sum())
                tok = draft_tokens[c]
                if total > 0 and float(torch.rand((), generator=generator, device=p.device)) < float(residual[tok]) / total:
                    accepted = c
                    break
                residual[tok] = 0.0
            if accepted is not None:
                path.append(accepted)
                node = accepted
                continue
            if not kids:  # a leaf: the bonus token comes from p itself
                residual = p
        total = float(residual.sum())
        if total <= 0.0:
            residual, total = p, float(p.sum())
        out = int(torch.multinomial(residual / total, 1, generator=generator))
        return VerifyResult([draft_tokens[i] for i in path] + [out], len(path), path)


def verify_batch(drafts: list[list[int]], draft_probs: list[torch.Tensor | None], params: list[SamplingParams],
                 generators: list[torch.Generator | None], logits: torch.Tensor, argmax: torch.Tensor,
                 rows: list[int], parents: list[list[int] | None] | None = None) -> list[VerifyResult]:
    """Verify every sequence of one batched target forward.

    Args:
        drafts / draft_probs / params / generators: per sequence.
        parents: per sequence, the token-tree parent indices (None: a chain).
        logits: ``[B, Q, vocab]`` float32 target logits of the forward over [last token + drafts].
        argmax: ``[B, Q]`` target argmax of the same forward.
        rows: each sequence's row in ``logits``.

    Returns:
        One VerifyResult per sequence.
    """
    results: list[VerifyResult | None] = [None] * len(drafts)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        am = argmax.tolist()
        for i in greedy:
            tree = parents[i] if parents else None
            row = am[rows[i]][:len(drafts[i]) + 1]
            results[i] = verify_greedy(drafts[i], row) if tree is None else verify_tree_greedy(drafts[i], tree, row)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        dev = logits.device
        width = max(len(drafts[i]) + 1 for i in sampled)
        sel = logits[[rows[i] for i in sampled], :width]  # [S, width, vocab]
        ps = [params[i] for i in sampled]
        rep = torch.tensor([width] * len(sampled))
        probs = sampling_probs(
            sel.reshape(-1, sel.shape[-1]),
            torch.tensor([p.temperature for p in ps], device=dev).repeat_interleave(rep.to(dev)),
            torch.tensor([p.top_k for p in ps], device=dev).repeat_interleave(rep.to(dev)),
            torch.tensor([p.top_p for p in ps], device=dev).repeat_interleave(rep.to(dev)),
        ).view(len(sampled), width, -1)
        for j, i in enumerate(sampled):
            n = len(drafts[i])
            tree = parents[i] if parents else None
            if tree is None:
                results[i] = verify_sampling(drafts[i], draft_probs[i], probs[j, :n + 1], generators[i])
            else:
                results[i] = verify_tree_sampling(drafts[i], tree, draft_probs[i], probs[j, :n + 1], generators[i])
    return results  # type: ignore[return-value]
