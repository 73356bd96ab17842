"""Exact greedy replay of a drafter's acceptance from the target's own greedy outputs.

Under greedy verification the output is the target-only greedy output ``x``, and a round whose
last verified position is ``p`` (the target has consumed ``x[..p]``; its bonus token is
``x[p+1]``) accepts the longest prefix of its drafts that matches ``x[p+2..]``. The drafts are a
function of the known prefix alone:

- a **SpecFormer** head drafts from the target's tapped states at positions ``<= p`` and (for
  bonus-token heads) ``x[p+1]``: its teacher-forced whole-sequence output at ``p``;
- a **draft model**'s j-th draft equals its teacher-forced argmax at position ``p + j`` as long as
  the drafts before it matched, and after a mismatch nothing more is accepted.

So one teacher-forced forward over every (prompt + target output) yields every round's accepted
length. ``walk_all`` then replays the engine's round loop into ``SpecDecodeStats`` with the
engine's own pieces: the draft-room rule (``tandem.stopping.draft_room``), greedy verification
(``verify_chains``, every trace's round in one batch) and the cut of the counters at the stop
boundary (``SpecDecodeStats.record_run``). The figures equal the engine's own counters exactly in float32 (tested); in
bf16 a near-tie may flip an argmax between the batched whole-sequence forward and incremental
decoding. This makes comparing drafter variants on all 480 Spec-Bench prompts a matter of
seconds on the GPU instead of a decode run per variant.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..data import PromptRecord
from ..errors import check_fields
from ..metrics import SpecDecodeStats
from ..stopping import draft_room
from ..verify import RowSampling, verify_chains


@dataclass
class GreedyTrace:
    """One prompt's target-only greedy decode.

    Attributes:
        category: Spec-Bench category (or "" for other prompt sets).
        prompt_ids: the encoded prompt (chat template applied).
        output_ids: the generated tokens, stop token included (``Completion.token_ids``).
        max_tokens: the request's max new tokens.
        model: sha256 of the target model file that decoded it ("" when unknown).
    """

    category: str
    prompt_ids: list[int]
    output_ids: list[int]
    max_tokens: int
    model: str = ""

    def check(self, vocab_size: int | None = None) -> None:
        """Raise ValueError unless the fields have the right types and ranges (non-empty prompt
        and output of int ids, below ``vocab_size`` when given; 1 <= len(output) <= max_tokens)."""
        if not isinstance(self.category, str) or not isinstance(self.model, str):
            raise ValueError("category and model must be strings")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name, ids in (("prompt_ids", self.prompt_ids), ("output_ids", self.output_ids)):
            if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
                raise ValueError(f"{name} must be a non-empty list of non-negative integer token ids")
            if vocab_size is not None and max(ids) >= vocab_size:
                raise ValueError(f"{name} holds token id {max(ids)}, outside the model's vocabulary ({vocab_size})")
        if len(self.output_ids) > self.max_tokens:
            raise ValueError(f"{len(self.output_ids)} output tokens exceed max_tokens {self.max_tokens}")

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def record_traces(engine, records: list[PromptRecord], max_tokens: int = 256) -> list[GreedyTrace]:
    """Decode ``records`` greedily with ``engine`` (chat template) and keep the token ids.

    Raises:
        ValueError: the engine speculates (traces must come from target-only decoding).
    """
    from ..sampling import SamplingParams

    from ..train.distill import model_fingerprint

    if engine.drafter is not None:
        raise ValueError("greedy traces come from a target-only engine (drafter none)")
    done = engine.generate([r.text for r in records], SamplingParams(max_tokens=max_tokens))
    model = model_fingerprint(engine.checkpoint.path)
    return [GreedyTrace(r.category or "", engine.encode_prompt(r.text), list(c.token_ids), max_tokens, model)
            for r, c in zip(records, done)]


def save_traces(traces: list[GreedyTrace], path: str | Path) -> Path:
    """Write one JSON object per line, gzip-compressed when the name ends in ``.gz`` (as
    ``load_traces`` reads it)."""
    import gzip

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(asdict(t)) + "\n" for t in traces).encode("utf-8")
    p.write_bytes(gzip.compress(data, mtime=0) if p.suffix == ".gz" else data)
    return p


def load_traces(path: str | Path, vocab_size: int | None = None) -> list[GreedyTrace]:
    """Read traces written by ``save_traces`` (gzip-compressed when the name ends in ``.gz``, as
    the committed Spec-Bench traces are) and check each (``GreedyTrace.check``).

    Raises:
        ValueError: an unreadable file or a line that is not a valid trace (file and line named).
    """
    from ..data import read_text

    try:
        text = read_text(path)
    except FileNotFoundError:
        raise ValueError(f"traces file {path} does not exist") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read traces file {path}: {exc}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("a line must be a JSON object")
            check_fields(GreedyTrace, record)
            trace = GreedyTrace(**record)
            trace.check(vocab_size)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: not a greedy trace ({exc})") from None
        out.append(trace)
    return out


def walk(trace: GreedyTrace, drafts, k: int) -> SpecDecodeStats:
    """Replay the engine's rounds over one trace (``walk_all`` for one).

    Args:
        trace: the target's greedy decode.
        drafts: ``[T, >= k]`` int array whose row ``p`` holds the drafts a round at position
            ``p`` proposes for ``x[p+2], x[p+3], ...`` (T = prompt + output length), or a
            function ``(p, room) -> draft token ids`` (at most ``room``) for drafters replayed
            through ``propose``.
        k: draft tokens per round (the engine's ``num_draft_tokens``; an array with fewer
            columns, e.g. a SpecFormer head with l_d < k, drafts that many).

    Returns:
        The request's counters, as the engine would have recorded them.
    """
    return walk_all([trace], [drafts], k)[0]


def walk_all(traces: list[GreedyTrace], drafts: list, k: int) -> list[SpecDecodeStats]:
    """Replay the engine's rounds over every trace, the traces' rounds batched in lockstep: each
    round's room is the engine's draft-room rule (``tandem.stopping.draft_room``), its drafts are
    verified by the engine's own ``verify_chains`` (greedy rows, the trace's next tokens as the
    target's argmax) and its counters are cut at the stop boundary by ``SpecDecodeStats.record_run``.

    Args:
        traces: the target's greedy decodes; drafts: one ``walk`` drafts argument per trace.
        k: draft tokens per round.

    Returns:
        Each trace's counters, in order.
    """
    widths = [d.shape[1] if isinstance(d, np.ndarray) else k for d in drafts]
    W = max([1] + widths)
    stats = [SpecDecodeStats() for _ in traces]
    pos = [[1, len(t.prompt_ids) - 1] for t in traces]  # output tokens so far, last verified position
    while True:
        live = [i for i, t in enumerate(traces) if pos[i][0] < len(t.output_ids)]
        if not live:
            return stats
        B = len(live)
        tokens = torch.zeros((B, W), dtype=torch.int64)
        lens = torch.zeros(B, dtype=torch.int64)
        argmax = torch.zeros((B, W + 1), dtype=torch.int64)
        for b, i in enumerate(live):
            t, d, (out_len, p) = traces[i], drafts[i], pos[i]
            x = t.tokens
            room = max(0, draft_room(min(k, widths[i]), len(x) + W + 2, len(t.prompt_ids), out_len, t.max_tokens))
            row = d[p][:room] if isinstance(d, np.ndarray) else (d(p, room) if room else [])
            lens[b] = len(row)
            tokens[b, :len(row)] = torch.as_tensor([int(v) for v in row], dtype=torch.int64)
            nxt = x[p + 2:p + 3 + W]  # the target's argmax after the last token x[p+1] and each draft
            argmax[b, :len(nxt)] = torch.as_tensor(nxt, dtype=torch.int64)
        greedy = RowSampling(torch.ones(B, dtype=torch.bool), torch.ones(B), torch.zeros(B, dtype=torch.int64),
                             torch.ones(B), torch.zeros(B, dtype=torch.int64), any_sampled=False, filtered=False)
        out = verify_chains(torch.empty((B, W + 1, 0)), argmax, tokens, lens, torch.zeros(B, dtype=torch.int64), greedy)
        for b, n in enumerate(out.num_accepted.tolist()):
            i = live[b]
            kept = min(n + 1, len(traces[i].output_ids) - pos[i][0])  # the stop token may come inside the run
            stats[i].record_run(int(lens[b]), n, n + 1, kept)
            pos[i][0] += kept
            pos[i][1] += kept


def _batches(traces: list[GreedyTrace], max_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length, each group at most ``max_tokens`` padded tokens."""
    order = sorted(range(len(traces)), key=lambda i: len(traces[i].tokens))
    groups, cur, longest = [], [], 0
    for i in order:
        n = len(traces[i].tokens)
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    return groups


def _padded(traces: list[GreedyTrace], idx: list[int], device) -> torch.Tensor:
    """``[len(idx), T]`` right-padded token ids of the chosen traces (``train.loop.pad_batch``)."""
    from ..train.distill import DistilledSequence
    from ..train.loop import pad_batch

    seqs = [DistilledSequence(np.asarray(traces[i].tokens), len(traces[i].prompt_ids)) for i in idx]
    return pad_batch(seqs, device)[0]


CPU_LOGITS_BYTES = 1 << 30  # the logits memory of one `_argmax_tokens` chunk on the CPU


def _argmax_tokens(model, hidden: torch.Tensor) -> torch.Tensor:
    """``model.logits(hidden).argmax(-1)`` for ``hidden`` ``[..., d]`` -> ``[...]`` token ids,
    in row chunks whose logits (bf16 or float32 product plus its float32 copy, 6 bytes per
    entry) fit in half the free CUDA memory, or ``CPU_LOGITS_BYTES`` on the CPU: a batch of
    32,768 positions x 4 draft slots is 25 GB of float32 logits at a 49,152-token vocabulary.
    On a large GPU the whole batch is one chunk."""
    return torch.cat([model.logits(h).argmax(-1) for h in _logit_chunks(model, hidden)]).view(hidden.shape[:-1])


def _top_tokens(model, hidden: torch.Tensor, m: int) -> torch.Tensor:
    """``[..., m]`` ids of the ``m`` largest logits for ``hidden`` ``[..., d]``, best first, in
    ``_argmax_tokens``'s chunks; the first is always ``_argmax_tokens``'s (on a tie topk may order
    the tied tokens otherwise), so column 0 replays the chain exactly."""
    def top(h: torch.Tensor) -> torch.Tensor:
        logits = model.logits(h)
        idx, best = logits.float().topk(m, dim=-1).indices, logits.argmax(-1, keepdim=True)
        idx = torch.where(idx == best, idx[:, :1].expand_as(idx), idx)  # the argmax's place takes topk's first
        idx[:, :1] = best
        return idx

    return torch.cat([top(h) for h in _logit_chunks(model, hidden)]).view(*hidden.shape[:-1], m)


def _logit_chunks(model, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``hidden`` ``[..., d]`` as ``[rows, d]`` chunks whose logits fit the memory budget of
    ``_argmax_tokens``."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    budget = torch.cuda.mem_get_info(flat.device)[0] // 2 if flat.is_cuda else CPU_LOGITS_BYTES
    return flat.split(max(1, budget // (model.config.vocab_size * 6)))


@torch.inference_mode()
def specformer_drafts(head, target, traces: list[GreedyTrace], batch_tokens: int = 32768,
                      top_m: int = 1) -> list[np.ndarray]:
    """Every position's SpecFormer drafts, ``[T, l_d]`` per trace (teacher-forced, the training
    objective's ``teacher_forced_states``); with ``top_m`` > 1, ``[T, l_d, top_m]``: each slot's
    ``top_m`` most likely tokens, best first (``branch_ceiling``).

    Args:
        head: a ``SpecFormerHead`` on the target's device and dtype.
        target: the target ``Transformer``.
    """
    from ..train.specformer import teacher_forced_states

    out: list[np.ndarray | None] = [None] * len(traces)
    for idx in _batches(traces, batch_tokens):
        tokens = _padded(traces, idx, target.embed.weight.device)
        B, T = tokens.shape
        y = target.norm(teacher_forced_states(head, target, tokens))  # [B*T, l_d, d]
        ids = (_argmax_tokens(target, y).view(B, T, -1) if top_m == 1
               else _top_tokens(target, y, top_m).view(B, T, -1, top_m)).cpu().numpy()
        for row, i in enumerate(idx):
            out[i] = ids[row, :len(traces[i].tokens)]
    return out


CEILING_RULES = ("chain", "branch-at-cut", "any-top-m")


def _accepted(rule: str, slots: np.ndarray, nxt: list[int]) -> int:
    """Drafts accepted in one greedy round under ``rule`` (``branch_ceiling``): ``slots`` ``[room,
    m]`` the round's top-m tokens per slot, ``nxt`` the target's tokens the slots stand for."""
    a, room = 0, min(len(slots), len(nxt))
    if rule == "any-top-m":
        while a < room and nxt[a] in slots[a]:
            a += 1
        return a
    while a < room and slots[a][0] == nxt[a]:
        a += 1
    if rule == "branch-at-cut" and a < room and nxt[a] in slots[a][1:]:
        a += 1  # a sibling at the first miss, then the chain's later slots below it
        while a < room and slots[a][0] == nxt[a]:
            a += 1
    return a


def branch_ceiling(traces: list[GreedyTrace], drafts: list[np.ndarray], k: int) -> dict[str, dict]:
    """What token trees could add to a SpecFormer head's chains, by exact greedy replay: the
    mean accepted length (tokens a round, the bonus token included) of each rule in
    ``CEILING_RULES`` over ``traces``, each replayed with the engine's draft-room rule and stop cut
    as ``walk_all`` (a rule changes where later rounds start, so each is its own walk):

    - ``chain``: the head's top-1 tokens, as the engine verifies them at ``k``;
    - ``branch-at-cut``: the best tree that adds the head's other top-m tokens at the chain's
      first miss (the hard-position enhancement of the context-aware design, with a predictor
      that always knew where the miss is), the chain's later slots continuing below the sibling;
    - ``any-top-m``: every path through the slots' top-m tokens verified at once (m^k leaves): no
      tree over this head's top-m candidates accepts more.

    A length policy cannot add accepted tokens to a chain (it only verifies fewer of them), so
    ``branch-at-cut`` / ``chain`` bounds what the context-aware system's trees can add to fixed k.

    Args:
        drafts: ``specformer_drafts(..., top_m=m)`` per trace, ``[T, l_d, m]``.
        k: draft tokens per round (at most l_d).

    Returns:
        rule -> ``SpecDecodeStats.to_dict()`` over every trace.
    """
    out = {}
    for rule in CEILING_RULES:
        total = SpecDecodeStats()
        for t, d in zip(traces, drafts):
            x, prompt = t.tokens, len(t.prompt_ids)
            width = min(k, d.shape[1])
            out_len, p = 1, prompt - 1
            while out_len < len(t.output_ids):
                room = max(0, draft_room(width, len(x) + width + 2, prompt, out_len, t.max_tokens))
                a = _accepted(rule, d[p][:room].tolist(), x[p + 2:p + 2 + room])
                kept = min(a + 1, len(t.output_ids) - out_len)
                total.record_run(room, a, a + 1, kept)
                out_len, p = out_len + kept, p + kept
        out[rule] = total.to_dict()
    return out


@torch.inference_mode()
def draft_model_drafts(draft, traces: list[GreedyTrace], k: int, batch_tokens: int = 32768) -> list[np.ndarray]:
    """Every position's draft-model drafts, ``[T, k]`` per trace: row ``p`` is the teacher-forced
    argmax at positions ``p+1 .. p+k`` (what autoregressive drafting proposes while it matches).

    Args:
        draft: the draft ``Transformer``.
    """
    out: list[np.ndarray | None] = [None] * len(traces)
    for idx in _batches(traces, batch_tokens):
        tokens = _padded(traces, idx, draft.embed.weight.device)
        hidden, _ = draft.forward_causal(tokens)
        arg = _argmax_tokens(draft, hidden).cpu().numpy()  # [B, T]: prediction of the next token
        for row, i in enumerate(idx):
            n = len(traces[i].tokens)
            a = np.concatenate([arg[row, :n], np.full(k + 1, -1)])
            out[i] = np.stack([a[1 + j:1 + j + n] for j in range(k)], axis=1)
    return out


def token_drafter_drafts(drafter, traces: list[GreedyTrace]) -> list:
    """``walk`` callables that ask a drafter reading only token ids (n-gram) for each round's
    drafts through ``Drafter.propose``, greedy, trace i on slot i."""
    from ..drafters.base import DraftRequest
    from ..sampling import SamplingParams

    params = SamplingParams()

    def for_trace(slot: int, t: GreedyTrace):
        x = t.tokens
        return lambda p, room: drafter.propose([DraftRequest(slot, x[:p + 2], room, params, None)])[0].tokens

    return [for_trace(i, t) for i, t in enumerate(traces)]


def replay(traces: list[GreedyTrace], drafts: list, k: int) -> tuple[dict, dict[str, dict]]:
    """Overall and per-category ``SpecDecodeStats.to_dict()`` of a drafter over ``traces``."""
    overall, per_cat = SpecDecodeStats(), {}
    for t, s in zip(traces, walk_all(traces, drafts, k)):
        overall.merge(s)
        per_cat.setdefault(t.category, SpecDecodeStats()).merge(s)
    return overall.to_dict(), {c: v.to_dict() for c, v in sorted(per_cat.items())}


def load_drafter(kind: str, path: str | None, checkpoint, option: str = "the weights path after ':'"):
    """A drafter's weights for replay, loaded and checked against the target: a ``SpecFormerHead``
    (``specformer``), a draft ``Checkpoint`` (``draft-model``; ``path`` None = the weights shipped
    for the bundled target) or None (``ngram``, nothing to load). ``option`` names ``path`` in errors.

    Raises:
        InvalidRequestError: an empty path, or no path and no shipped weights for this target.
        ModelLoadError: unloadable weights or weights made for another target.
        ValueError: an unknown ``kind``.
    """
    from ..drafters.factory import drafter_weights

    if kind == "ngram":
        return None
    if kind == "specformer":
        from ..models.specformer import load_specformer

        head = load_specformer(drafter_weights(kind, path, checkpoint, option))
        head.config.check_target(checkpoint.config)
        return head
    if kind == "draft-model":
        from ..drafters.draft_model import load_draft_checkpoint

        return load_draft_checkpoint(str(drafter_weights(kind, path, checkpoint, option)), checkpoint)
    raise ValueError(f"replay supports specformer, draft-model and ngram, not {kind!r}")


class Replayer:
    """Drafts of several drafters over one set of traces; the target ``Transformer`` that
    SpecFormer heads read is built once, on first use.

    Args:
        checkpoint: the target; traces: its greedy traces; device, dtype: where the models run.
    """

    def __init__(self, checkpoint, traces: list[GreedyTrace], device: str, dtype: torch.dtype) -> None:
        self.checkpoint, self.traces, self.device, self.dtype = checkpoint, traces, device, dtype
        self.max_positions = max(len(t.tokens) for t in traces) + 1
        self._target = None

    def _model(self, checkpoint):
        from ..models.transformer import Transformer

        model = Transformer(checkpoint.config, self.max_positions)
        model.load_weights(checkpoint.tensors)
        return model.to(self.device, self.dtype).eval()

    def drafts(self, kind: str, drafter, k: int, top_m: int = 1) -> list:
        """``walk``'s drafts for ``drafter`` (what ``load_drafter`` returned for ``kind``); for a
        SpecFormer head with ``top_m`` > 1, each slot's top-m tokens (``branch_ceiling``)."""
        if kind == "ngram":
            from ..drafters import NgramDrafter

            return token_drafter_drafts(NgramDrafter(), self.traces)
        if kind == "specformer":
            if self._target is None:
                self._target = self._model(self.checkpoint)
            return specformer_drafts(drafter.to(self.device, self.dtype).eval(), self._target, self.traces,
                                     top_m=top_m)
        return draft_model_drafts(self._model(drafter), self.traces, k)
