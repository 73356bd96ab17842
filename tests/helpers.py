"""Small helpers shared by the test modules (imported as ``helpers``; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tandem.models import Checkpoint
from tandem.models.runner import ModelRunner, RunnerConfig


def record_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` (for the test) so that each call appends to the returned list."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def make_runner(checkpoint: Checkpoint, slots: int = 1, max_seq_len: int = 64) -> ModelRunner:
    """A CPU float32 eager runner."""
    return ModelRunner(checkpoint, RunnerConfig(device="cpu", max_batch_size=slots, max_seq_len=max_seq_len))


def our_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of a fresh run of ``ids`` in a fresh slot (one forward)."""
    slot = runner.cache.allocate()
    try:
        return runner.step({slot: list(ids)}).logits[slot, :len(ids)].clone()
    finally:
        runner.cache.free(slot)


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` float32 logits of a Hugging Face causal LM."""
    return model(torch.tensor([ids])).logits[0].float()


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """Copy a checkpoint directory (to corrupt it without touching the shared one)."""
    shutil.copytree(src, dst)
    return dst


def edit_config(d: Path, **changes) -> None:
    """Rewrite keys of ``d/config.json`` (a value of ``None`` deletes the key)."""
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson goodness-of-fit p-value of observed ``counts`` against ``probs``.

    Cells with expected count below ``min_expected`` are pooled into one cell; an observation in
    a cell of probability 0 gives p-value 0.
    """
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    probs = probs / probs.sum()
    n = counts.sum()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.numel() < 2:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def total_variation(counts, probs) -> float:
    """Total-variation distance between the empirical distribution of ``counts`` and ``probs``."""
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    return 0.5 * float((counts / counts.sum() - probs / probs.sum()).abs().sum())


def assert_in_target_top_k(runner: ModelRunner, prompt_ids: list[int], token_ids: list[int], top_k: int) -> None:
    """Each of ``token_ids``, sampled after ``prompt_ids`` with ``top_k``, is among the target's
    ``top_k`` most likely tokens at its position (one fresh forward of ``runner``, a runner of the
    target, over the whole sequence).

    Any lossless sampler must emit only those; a draft token taken without the target's say mostly
    is not (from a vocabulary of thousands). A necessary condition only: the distribution-level
    checks are in test_speculative.py and test_lossless.py.
    """
    assert token_ids, "nothing to check"
    logits = our_logits(runner, list(prompt_ids) + list(token_ids[:-1]))[len(prompt_ids) - 1:]
    kth = logits.topk(top_k, dim=-1).values[:, -1]
    got = logits.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    outside = [i for i in range(len(token_ids)) if got[i] < kth[i] - 1e-4]  # 1e-4: batched vs fresh forward
    assert not outside, f"tokens at output positions {outside} are outside the target's top-{top_k}"


def check_acceptance_figures(drafted: int, accepted: int, acceptance_rate: float, mean_accepted_length: float,
                             output_tokens: int, prompts: int, k: int) -> None:
    """A benchmark row's acceptance figures agree with its own token counts (rather than merely
    lying in their ranges, which any numbers of the right kind do).

    α = accepted / drafted. Every request's first token comes from its prefill, so the decode
    steps emitted ``output_tokens - prompts`` tokens, and τ (tokens per step) makes the step count
    ``steps = emitted / τ`` a whole number. A step emits its accepted drafts plus one token, save a
    request's last step, which the stop rules may cut (at most one per request): so
    ``emitted - steps <= accepted <= emitted - steps + prompts``, and τ <= k + 1.
    """
    import math

    assert 0 <= accepted <= drafted
    if drafted:
        assert acceptance_rate == accepted / drafted or abs(acceptance_rate - accepted / drafted) < 1e-9
    else:
        assert acceptance_rate is None or math.isnan(acceptance_rate)
    emitted = output_tokens - prompts
    steps = emitted / mean_accepted_length
    assert abs(steps - round(steps)) < 1e-6, (emitted, mean_accepted_length)
    steps = round(steps)
    assert emitted - steps <= accepted <= emitted - steps + prompts, (emitted, steps, accepted)
    assert mean_accepted_length <= k + 1


def verify_tree_greedy(draft_tokens: list[int], parents: list[int], target_argmax: list[int]):
    """The greedy tree rule walked on the host, one tree at a time: the reference
    ``tandem.verify.verify_trees_greedy`` is checked against. From the root, follow the child
    equal to the target's argmax (row ``i + 1`` of ``target_argmax`` is tree token i's, row 0 the
    last accepted token's); emit the argmax where no child matches."""
    from tandem.verify import VerifyResult

    node, path = -1, []
    while True:
        a = target_argmax[node + 1]
        nxt = next((c for c, p in enumerate(parents) if p == node and draft_tokens[c] == a), None)
        if nxt is None:
            return VerifyResult([draft_tokens[i] for i in path] + [a], len(path), path)
        path.append(nxt)
        node = nxt
