"""Draft-model drafter: a small causal LM sharing the target's tokenizer, run by our own model
runner with its own KV cache (slot numbering mirrors the target's) and rollback.

Host-drafted rounds (a drafter service's, or where chained rounds do not run): each round it
syncs its cache to the sequence (truncating to the longest common prefix: the rejected drafts of
the previous round are dropped in O(1)), then drafts autoregressively. A round is one runner step
whose epilogue chains all k drafts on the device (one CUDA-graph launch and one read a round); a
caller that decides after each position whether to go on (``keep_drafting``) gets one batched
forward and one read per draft position instead. Greedy requests draft by argmax; sampled
requests draw from q = the request's sampling transform of the draft logits, and q is returned
for speculative sampling.

Chained rounds (``Engine.chains_rounds``): the same drafting runs on the device inside the round
that verifies, right after verification (``device_after_verify``), as gpt-fast and SGLang's
speculative worker run their draft model's steps: from the target's device round state it feeds
the token before the new last one and the new last one (a two-token step, which also writes the
last accepted draft's K/V when every draft was accepted, and rewrites an accepted position with
the same token otherwise: the rejected drafts' positions are simply overwritten later), then one
token a step for the remaining drafts; the drafts (and their q) stay in device buffers the next
round reads. No host round trip and no host bookkeeping of the draft cache a round.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..models import kernels
from ..models.config import ModelLoadError
from ..models.kv_cache import KV_SLACK
from ..models.runner import ModelRunner, RunnerConfig
from ..models.weights import Checkpoint, load_checkpoint, make_readable, weights_file
from ..round_state import SlotSampling
from ..sampling import STREAM_DRAFT, SamplingParams, counter_uniform, sample_inverse_cdf, sampling_probs
from ..verify import RowSampling
from .base import (NUM_FEATURES, BufferedDrafts, DraftProposal, DraftRequest, Drafter, KeepDrafting, VerifiedStep,
                   chained_draft_features, device_features, draft_rows, sync_tokens)

PREFILL_THRESHOLD = 16  # sync feeds longer than this go through batched prefill
FORMAT = "tandem-draft-model-v1"  # a distilled draft model (``tandem train draft-model``)
SHARED = ("embed.weight", "lm_head.weight")  # read from the target, never stored
DEFAULT_DRAFT_MODEL = Path(__file__).resolve().parent / "weights" / "draft-model-smollm2-135m"


def truncated_checkpoint(checkpoint: Checkpoint, num_layers: int) -> Checkpoint:
    """The target's first ``num_layers`` blocks + its final norm and LM head: a training-free
    early-exit draft model (LayerSkip-style self-speculation).

    Raises:
        ModelLoadError: ``num_layers`` is not in [1, target layers).
    """
    total = checkpoint.config.num_layers
    if not 1 <= num_layers < total:
        raise ModelLoadError(f"a truncated draft needs 1..{total - 1} layers, got {num_layers}")
    keep = {k: v for k, v in checkpoint.tensors.items()
            if not k.startswith("layers.") or int(k.split(".")[1]) < num_layers}
    return Checkpoint(path=checkpoint.path, config=replace(checkpoint.config, num_layers=num_layers),
                      tensors=keep, chat_template=checkpoint.chat_template)


def load_draft_checkpoint(spec: str, target: Checkpoint) -> Checkpoint:
    """Resolve ``--draft-model``: a path (GGUF / HF directory, or a distilled draft model written by
    ``tandem train draft-model``) or ``truncate:N`` (the target's first N layers).

    Raises:
        ModelLoadError: bad spec, unloadable model, or a vocabulary that does not match the target.
    """
    if spec.startswith("truncate:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ModelLoadError(f"bad draft model spec {spec!r}; use truncate:N with an integer N") from None
        return truncated_checkpoint(target, n)
    if is_draft_model_dir(spec):
        return load_draft_model(spec, target)
    from ..models.specformer import is_specformer_dir

    if is_specformer_dir(spec):
        raise ModelLoadError(f"{spec} is a SpecFormer head, not a draft model: use --drafter specformer")
    draft = load_checkpoint(spec)
    check_compatible(draft, target)
    return draft


def save_draft_model(model, path: str | Path, init_layers: tuple[int, ...], extra: dict | None = None,
                     dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the trained blocks and final norm to ``path/model.safetensors`` (``dtype``).

    Returns the file path.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()
               if k not in SHARED and not k.startswith("rope_")}
    meta = {"format": FORMAT, "num_layers": str(model.config.num_layers), "init_layers": json.dumps(list(init_layers)),
            "extra": json.dumps(extra or {})}
    file = out / "model.safetensors"
    save_file(tensors, str(file), metadata=meta)
    make_readable(file)
    return file


def is_draft_model_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory (or file) written by ``save_draft_model``."""
    from safetensors import safe_open

    file = weights_file(path)
    if not file.is_file() or file.suffix != ".safetensors":
        return False
    try:
        with safe_open(str(file), framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:
        return False


def load_draft_model(path: str | Path, target: Checkpoint) -> Checkpoint:
    """A ``Checkpoint`` of a distilled draft model: its stored blocks + the target's embeddings
    and LM head.

    Raises:
        ModelLoadError: unreadable file, or blocks that do not fit the target's shape.
    """
    from safetensors import safe_open

    file = weights_file(path)
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k).float() for k in f.keys()}
    except Exception as exc:
        raise ModelLoadError(f"cannot read draft model {str(file)!r}: {exc}") from None
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{str(file)!r} is not a Tandem draft model")
    cfg = replace(target.config, num_layers=int(meta["num_layers"]))
    for k in SHARED:
        if k in target.tensors:
            tensors[k] = target.tensors[k]
    for name, t in tensors.items():
        want = target.tensors.get("layers.0." + name.split(".", 2)[2] if name.startswith("layers.") else name)
        if want is not None and tuple(want.shape) != tuple(t.shape):
            raise ModelLoadError(f"draft model tensor {name} has shape {tuple(t.shape)}; the target's is "
                                 f"{tuple(want.shape)}: it was trained for another target")
    return Checkpoint(path=file, config=cfg, tensors=tensors, chat_template=target.chat_template)


def check_compatible(draft: Checkpoint, target: Checkpoint) -> None:
    """Raise ModelLoadError unless the draft shares the target's vocabulary and special ids."""
    d, t = draft.config, target.config
    if d.vocab_size != t.vocab_size:
        raise ModelLoadError(f"draft model vocabulary ({d.vocab_size}) differs from the target's ({t.vocab_size}); "
                             "a draft model must share the target's tokenizer")
    if d.eos_token_ids and t.eos_token_ids and set(d.eos_token_ids) != set(t.eos_token_ids):
        raise ModelLoadError(f"draft model EOS ids {d.eos_token_ids} differ from the target's {t.eos_token_ids}")
    if d.bos_token_id is not None and t.bos_token_id is not None and d.bos_token_id != t.bos_token_id:
        raise ModelLoadError(f"draft model BOS id {d.bos_token_id} differs from the target's {t.bos_token_id}")


class DraftModelDrafter(BufferedDrafts, Drafter):
    """Autoregressive drafting with a small LM.

    Args:
        checkpoint: the draft model (same vocabulary as the target).
        config: runner settings (use the target's device, dtype, slots and context limit).
    """

    name = "draft-model"
    drafts_on_device = True  # chained rounds: it drafts inside the round that verifies (module docstring)
    drafts_from_verify = True

    def __init__(self, checkpoint: Checkpoint, config: RunnerConfig, top_m: int = 4) -> None:
        self.top_m = top_m  # candidates kept per position for hard-position branching
        # Draft numerics never change the output, so the draft runner skips exact-kernel padding.
        self.runner = ModelRunner(checkpoint, replace(config, compile=False, fixed_step_tokens=0))
        # slot -> tokens the host knows the draft cache holds (chained rounds write past them
        # unrecorded: a host-drafted round after them syncs from there, which stays correct)
        self.cached: dict[int, list[int]] = {}
        self._k = 0  # drafts a chained round makes (the engine's limit, ``set_draft_limit``)
        self._draft_tokens: torch.Tensor | None = None  # [slots, k] the next chained round's drafts
        self._draft_lens: torch.Tensor | None = None  # [slots] how many of them
        self._draft_q: torch.Tensor | None = None  # [slots, k, V] float32 q of sampled rows' drafts
        self._scorer = None  # set_acceptance_scorer: chained rounds score their drafts on the device
        self._draft_scores: torch.Tensor | None = None  # [slots, k] float32 their predicted acceptance
        self._chain_slots: SlotSampling | None = None  # host-drafted chained steps' sampling (``_chain_sampling``)
        self._chain_q: torch.Tensor | None = None  # [slots, k, V] float32 their sampled drafts' q

    def release(self, slot: int) -> None:
        if slot in self.cached:
            del self.cached[slot]
            self.runner.cache.free(slot)

    # ------------------------------------------------------------------ chained rounds (device)

    def set_draft_limit(self, k: int) -> None:
        self._k = k

    def set_acceptance_scorer(self, score, width: int = 0) -> None:
        """Score the drafts of chained rounds on the device: ``score`` maps predictor features
        ``[N, NUM_FEATURES]`` (of each draft's distribution, as the host path's ``draft_rows``
        gives them: softmax of the draft logits for greedy requests, the sampling transform for
        sampled ones; position 1..k) to acceptance probabilities ``[N]`` (``DraftPolicy.device_score``);
        each round then leaves ``[slots, k]`` scores beside its drafts (``device_draft_scores``).
        Call before the first round (``width`` is not read: the engine's k is)."""
        self._scorer = score
        self._draft_scores = None

    def admit(self, prompts: dict[int, list[int]]) -> None:
        """Claim the slots and fill the draft cache with each prompt but its last token (the first
        chained step feeds that one with the first generated token: ``device_prime``)."""
        cache = self.runner.cache
        for slot in prompts:
            if slot in self.cached:  # (a slot is released before it is reused; a stale view is dropped)
                self.release(slot)
            cache.claim(slot)
            self.cached[slot] = []
        body = {s: p[:-1] for s, p in prompts.items() if len(p) > 1}
        if body:
            self.runner.prefill(body)
            for s, p in body.items():
                self.cached[s] = list(p)

    def prepare_round(self, sampled: bool) -> None:
        """The draft buffers (and, for sampled requests, the q buffer) before a round is captured."""
        self._buffers(sampled)

    def _buffers(self, sampled: bool) -> None:
        cache = self.runner.cache
        k = max(self._k, 1)
        dev = cache.k.device
        if self._draft_tokens is None or self._draft_tokens.shape[1] < k:
            self._draft_tokens = torch.zeros((cache.num_slots, k), dtype=torch.long, device=dev)
            self._draft_lens = torch.zeros(cache.num_slots, dtype=torch.long, device=dev)
            self._draft_q = None
        if sampled and self._draft_q is None:
            V = self.runner.model_config.vocab_size
            self._draft_q = torch.zeros((cache.num_slots, k, V), dtype=torch.float32, device=dev)
        if self._scorer is not None and (self._draft_scores is None or self._draft_scores.shape[1] < k):
            self._draft_scores = torch.zeros((cache.num_slots, k), dtype=torch.float32, device=dev)
            with torch.inference_mode():  # once outside any capture: a scorer may place its weights on first use
                self._scorer(torch.zeros((1, NUM_FEATURES), dtype=torch.float32, device=dev))

    @torch.inference_mode()
    def device_after_verify(self, step: VerifiedStep) -> None:
        """The next round's drafts of the rows that ran (``step.keep``), from the round state the
        verification left, inside the round's graph (module docstring)."""
        self._draft_chain(step.keep, step.state, step.sampling, step.attn_len + self._k)

    @torch.inference_mode()
    def device_prime(self, keep: torch.Tensor, state, sampling, width: int) -> None:
        """First drafts for slots just prefilled (``keep`` ``[n]`` bool; their prompts ``admit``ted),
        so their first chained round verifies drafts; ``width`` > every kept row's length."""
        self._buffers(sampling.any_sampled)
        self._draft_chain(keep, state, sampling, width + self._k)

    def _draft_chain(self, keep: torch.Tensor, state, sampling, attn_len: int) -> None:
        """``k`` drafts for the kept rows from the round state (``state.length``: each row's
        cached tokens, ``state.last``: its new last token, at position ``length``), written to
        the draft buffers: one two-token forward (the token at ``length - 1`` and the last one),
        then one a draft. Device work only (a chained round captures it)."""
        k = self._k
        if k < 1:
            return
        n = keep.shape[0]
        attn_len = min(attn_len, self.runner.cache.capacity + KV_SLACK)
        length = state.length[:n]
        before = state.history[:n].gather(1, (length - 1).clamp_min(0)[:, None])
        rows = keep.long()
        packed = torch.cat([(length - 1).clamp_min(0)[:, None], (2 * rows)[:, None], before,
                            state.last[:n, None]], dim=1)
        logits = self.runner.forward_packed(packed, attn_len).logits[:, 1]
        drafts = []
        for i in range(k):
            drafts.append(self._pick(logits, length + 1 + i, sampling, keep, i))
            if i + 1 < k:
                packed = torch.stack([length + 1 + i, rows, drafts[-1]], dim=1)
                logits = self.runner.forward_packed(packed, attn_len).logits[:, 0]
        tokens = torch.stack(drafts, dim=1)
        token_rows = self._draft_tokens[:n, :k]
        torch.where(keep[:, None], tokens, token_rows, out=token_rows)  # in place: one launch, no copy
        self._draft_lens[:n].masked_fill_(keep, k)

    def _pick(self, logits: torch.Tensor, position: torch.Tensor, sampling, keep: torch.Tensor,
              i: int) -> torch.Tensor:
        """Draft ``i`` of each row from its logits ``[n, V]``: the argmax for greedy rows; for
        sampled rows a draw from q (the request's sampling transform) with
        ``counter_uniform(seed, position, STREAM_DRAFT)``, q kept for verification."""
        fused = self.runner.model.fused
        n = keep.shape[0]
        # sampled rows' q written into the kept rows of the q buffer, in place
        q_rows = self._draft_q[:n, i] if sampling.any_sampled else None
        drafts, q = _draw(logits, position, sampling, fused, out=q_rows, rows=keep)
        if self._scorer is not None:  # the predictor's features of each draft's distribution, as draft_rows makes them
            pos = torch.full((n,), float(i + 1), device=logits.device)
            feats = chained_draft_features(logits, pos, False, fused)
            if q is not None:
                feats = torch.where(sampling.greedy[:, None], feats, chained_draft_features(q, pos, True, fused))
            scores = self._scorer(feats).float()
            self._draft_scores[:n, i] = torch.where(keep, scores, self._draft_scores[:n, i])
        return drafts

    def _propose_chained(self, reqs: list[DraftRequest]) -> dict[int, DraftProposal] | None:
        """Drafts of ``reqs`` from one runner step: the step feeds each sequence's tokens the cache
        lacks (a long feed is prefilled first, all but its last token) and its epilogue, captured
        in the same CUDA graph, drafts ``k = max(max_draft)`` tokens a row, a one-token forward a
        draft after the first, with each draft's predictor features and top-m tokens
        (``draft_rows``'s); one copy brings them to the host. Greedy rows take the argmax; sampled
        rows draw from q, the request's sampling transform of the draft logits, with
        ``counter_uniform(seed, position, STREAM_DRAFT)`` (the request's seed, else its
        generator's), and q stays on the device for verification. The first ``k - 1`` drafts of a
        row were fed, so the cache keeps them, as the position-at-a-time path does. Returns
        proposals by slot, or None when a row lacks the room for its drafts (that path then runs,
        and stops where the cache does)."""
        cache = self.runner.cache
        k = max(r.max_draft for r in reqs)
        if any(len(r.token_ids) + k - 1 > cache.capacity for r in reqs):
            return None
        sampled = not all(r.params.greedy for r in reqs)
        if sampled:
            self._chain_sampling(reqs)
        feeds = self._feeds(reqs)
        long = {s: f[:-1] for s, f in feeds.items() if len(f) > PREFILL_THRESHOLD}
        if long:
            self.runner.prefill(long)
            feeds.update({s: feeds[s][-1:] for s in long})
        width = self._chain_q.shape[1] if sampled else 0  # (graphs write q into this buffer: a wider one is new)
        out = self.runner.step(feeds, epilogue=self._chain(k, sampled),
                               patch_key=("draft-chain", k, self.top_m, width))
        rows = out.epilogue.cpu()  # [n, k, 1 + NUM_FEATURES + m]: token id, features, top-m ids; the round's one read
        q = self._chain_q[:rows.shape[0], :k].clone() if sampled else None  # [n, k, V] (rewritten next round)
        proposals = {}
        for r in reqs:
            row = rows[r.slot, :r.max_draft]
            tokens = row[:, 0].long().tolist()
            proposals[r.slot] = DraftProposal(tokens, None if r.params.greedy else q[r.slot, :r.max_draft],
                                              row[:, 1:1 + NUM_FEATURES].float(), row[:, 1 + NUM_FEATURES:].long())
            fed = rows[r.slot, :k - 1, 0].long().tolist()
            self.cached[r.slot].extend(fed)
            cache.lengths[r.slot] += len(fed)
        return proposals

    def _chain_sampling(self, reqs: list[DraftRequest]) -> None:
        """Each row's sampling settings for the chained step's epilogue, in the device buffers its
        graph reads (``_chain_slots``, the ``SlotSampling`` a target keeps, over every slot: the
        drafts' own transform, no logit adjustments; rows not in ``reqs`` greedy). Also the
        ``[slots, k, V]`` buffer every sampled graph writes its q into (one for all of them,
        widened when a round drafts more)."""
        cache = self.runner.cache
        dev = cache.k.device
        V = self.runner.model_config.vocab_size
        if self._chain_slots is None:
            self._chain_slots = SlotSampling(cache.num_slots, dev, V)
        k = max(r.max_draft for r in reqs)
        if self._chain_q is None or self._chain_q.shape[1] < k:
            self._chain_q = torch.zeros((cache.num_slots, k, V), dtype=torch.float32, device=dev)
        params = [_GREEDY_DRAFT] * cache.num_slots
        for r in reqs:
            p = r.params
            if not p.greedy:
                seed = p.seed if p.seed is not None else r.generator.initial_seed() if r.generator is not None else 0
                params[r.slot] = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                                seed=seed & (2**63 - 1))
        self._chain_slots.admit(list(range(cache.num_slots)), params)

    def _chain(self, k: int, sampled: bool = False):
        """The epilogue of ``_propose_chained``'s step: ``k`` drafts a row after each row's last
        fed token, ``[n, k, 1 + NUM_FEATURES + top_m]`` (token id, features, top-m ids; ids exact
        in float32 below 2**24); a ``sampled`` step writes each draft's q into ``_chain_q``.
        Device work only."""
        runner, top_m = self.runner, self.top_m
        limit = runner.cache.capacity + KV_SLACK
        fused = runner.model.fused
        slot_sampling, q_out = self._chain_slots, self._chain_q

        def chain(out) -> torch.Tensor:
            packed = out.inputs
            n = packed.shape[0]
            count = packed[:, 1]
            live = (count > 0).long()
            logits = out.logits[torch.arange(n, device=packed.device), (count - 1).clamp_min(0)]
            start = packed[:, 0] + count
            attn_len = min(out.attn_len + k - 1, limit)
            sampling = (slot_sampling.rows(n, flags=(True, True, False)) if sampled
                        else RowSampling(*(None,) * 5, any_sampled=False))
            cols = []
            for i in range(k):
                dist = logits.float().softmax(-1)
                tokens, q = _draw(logits, start + i, sampling, fused, out=q_out[:n, i] if sampled else None)
                if q is not None:
                    dist = torch.where(sampling.greedy[:, None], dist, q)
                feats = device_features(dist, torch.full((n,), float(i + 1), device=dist.device))
                top = dist.topk(min(top_m, dist.shape[-1]), dim=-1).indices
                cols.append(torch.cat([tokens[:, None].float(), feats.float(), top.float()], dim=1))
                if i + 1 < k:
                    step = torch.stack([start + i, live, tokens], dim=1)
                    logits = runner.forward_packed(step, attn_len).logits[:, 0]
            return torch.stack(cols, dim=1)
        return chain

    def _feeds(self, reqs: list[DraftRequest]) -> dict[int, list[int]]:
        """Roll each slot's cache back to its common prefix with ``token_ids`` (the last token
        always fed again); returns the tokens each slot must be fed."""
        cache = self.runner.cache
        feeds: dict[int, list[int]] = {}
        for r in reqs:
            if r.slot not in self.cached:
                cache.claim(r.slot)
                self.cached[r.slot] = []
            common = sync_tokens(self.cached[r.slot], r.token_ids, limit=len(r.token_ids) - 1)  # feed the last token
            cache.truncate(r.slot, common)
            feeds[r.slot] = r.token_ids[common:]
        return feeds

    def _sync(self, reqs: list[DraftRequest]) -> dict[int, torch.Tensor]:
        """Bring each slot's cache to ``token_ids`` and return the logits after its last token."""
        feeds = self._feeds(reqs)
        logits: dict[int, torch.Tensor] = {}
        long = {s: f for s, f in feeds.items() if len(f) > PREFILL_THRESHOLD}
        short = {s: f for s, f in feeds.items() if len(f) <= PREFILL_THRESHOLD}
        if long:
            out = self.runner.prefill(long)
            for i, s in enumerate(sorted(long)):
                logits[s] = out[i]
        if short:
            out = self.runner.step(short)
            for s, f in short.items():
                logits[s] = out.logits[s, len(f) - 1].to(torch.float32, copy=True)
        return logits

    def propose(self, requests: list[DraftRequest], keep_drafting: KeepDrafting | None = None) -> list[DraftProposal]:
        """Host-drafted round (module docstring). Without ``keep_drafting`` every request drafts
        in one step whose graph chains all ``k`` drafts (``_propose_chained``: one launch and one
        read a round, where drafting a position at a time costs a launch and a read each); with
        it (it decides after each position) they draft a position at a time."""
        active = [r for r in requests if r.max_draft > 0]
        chained = self._propose_chained(active) if active and keep_drafting is None else None
        if chained is not None:
            return [chained.get(r.slot, DraftProposal.empty()) for r in requests]
        return self._propose_stepwise(requests, keep_drafting)

    def _propose_stepwise(self, requests: list[DraftRequest],
                          keep_drafting: KeepDrafting | None) -> list[DraftProposal]:
        """Drafts a position at a time: one batched forward and one read a position."""
        active = [r for r in requests if r.max_draft > 0]
        if not active:
            return [DraftProposal.empty() for _ in requests]
        logits = self._sync(active)
        parts: dict[int, list[DraftProposal]] = {r.slot: [] for r in active}
        live = list(active)
        for pos in range(1, max(r.max_draft for r in active) + 1):
            rows = draft_rows(torch.stack([logits[r.slot] for r in live]), [r.params for r in live],
                              [r.generator for r in live], [pos] * len(live), self.top_m)
            for i, r in enumerate(live):
                parts[r.slot].append(rows.proposal([i]))
            keep = keep_drafting([r.slot for r in live], rows.features) if keep_drafting else [True] * len(live)
            live = [r for r, k in zip(live, keep) if k and len(parts[r.slot]) < r.max_draft]
            if not live:
                break
            last = {r.slot: parts[r.slot][-1].tokens[0] for r in live}
            out = self.runner.step({s: [t] for s, t in last.items()})
            for s, t in last.items():
                self.cached[s].append(t)
                logits[s] = out.logits[s, 0].to(torch.float32, copy=True)
        return [DraftProposal.concat(parts[r.slot]) if r.max_draft > 0 else DraftProposal.empty() for r in requests]


_GREEDY_DRAFT = SamplingParams(seed=0)  # a chained step's row without a sampled request (no seed drawn for it)


def _draw(logits: torch.Tensor, position: torch.Tensor, sampling, fused: bool, out: torch.Tensor | None = None,
          rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts ``[n]`` from draft logits ``[n, V]`` and, when ``sampling.any_sampled``, the q
    ``[n, V]`` the sampled rows drew from (the request's sampling transform; greedy rows take the
    argmax) with ``counter_uniform(seed, position, STREAM_DRAFT)``: written into ``out`` when
    given (only its ``rows`` when given; the others keep their values, and their draws are
    meaningless). Device work only."""
    drafts = kernels.row_argmax(logits) if fused else logits.argmax(-1)
    if not sampling.any_sampled:
        return drafts, None
    q = sampling_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.filtered, out=out,
                       rows=rows)
    drawn = sample_inverse_cdf(q, counter_uniform(sampling.seed, position, STREAM_DRAFT))
    return torch.where(sampling.greedy, drafts, drawn), q
