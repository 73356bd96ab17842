"""SpecFormer head: a non-autoregressive draft network on the target's own hidden states.

Implements *SpecFormer: Non-Autoregressive Forecasting in Large-Batch Scenarios* (AAAI 2026,
arXiv 2511.20340). The head reads the target's residual stream at a few depths (by default the
embedding output, layer L/2, layer L-1 and the final layer), normalises each tap with its own
RMSNorm, concatenates them (``len(taps) * d``) and projects back to ``d``; a **context causal
attention** sub-layer with its own KV cache (kept beside the target's, same position ids, rolled
back with it) mixes in the history; a **positional FFN** ``d -> l_d * d`` (the only
position-dependent parameters) fans each position out into ``l_d`` draft slots; **draft
attention** across those slots (bidirectional by default, causal as an option) and a SwiGLU
MLP refine them; the target's frozen final norm and LM head turn them into logits.

Two extensions beyond the paper, each off by default (off = the paper's head): ``bonus_token``
adds the embedding of the round's bonus token to the draft slots, and ``context_next_token``
adds, at every position ``t`` of the context stream, the embedding of the token that follows it
(EAGLE's feature + shifted-token input, Li et al. 2024), so the context attention can match the
next token against the history (copying, as n-gram lookup does). ``context_layers`` stacks more
context attention sub-layers (``context_mlp`` adds a SwiGLU after each). ``context_init`` makes
the context sub-layers whole decoder blocks of the target's shape (grouped-query attention and the
target's MLP width), initialised from chosen target blocks
(``train.specformer.init_context_from_target``), the way the context-aware paper's draft model
starts from target blocks: a pretrained start that a few million distilled tokens can refine
without memorising them. ``lookup_tokens`` gives every draft
slot one more input, the context lookup continuation (``tandem.drafters.lookup``, the n-gram
drafter's rule: what followed an earlier occurrence of the sequence's last 1-4 tokens, as prompt
lookup decoding drafts it) and its match length, so the head learns where copying from the context beats its
own forecast (repetition loops, extraction, summaries, translations of a quoted text).

At target position ``t`` (whose target logits give the bonus token ``x[t+1]``) draft slot ``j``
(0-based) predicts ``x[t+2+j]``. The target forward that verifies round r therefore also yields
round r+1's drafts: the engine hands the tapped states of the accepted positions to
``SpecFormerDrafter.observe`` and no separate draft pass over the target runs.

This module is the head as a model: its config, network, initialisation from target blocks and
file format. The serving side (the head's own KV cache, CUDA graphs, drafting on the device) is
``tandem.drafters.specformer.SpecFormerDrafter``; training is ``tandem.train.specformer``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..drafters.lookup import MAX_N
from . import head_kernels, kernels
from .config import ModelConfig, ModelLoadError
from .rope import apply_rope
from .transformer import RMSNorm
from .weights import make_readable, weights_file

FORMAT = "tandem-specformer-v1"


def default_taps(num_layers: int) -> tuple[int, ...]:
    """Embedding output, layer L/2, layer L-1 and the final layer (the paper's four hooks)."""
    return tuple(sorted({0, num_layers // 2, num_layers - 1, num_layers}))


@dataclass(frozen=True)
class SpecFormerConfig:
    """Shape of a SpecFormer head.

    Attributes:
        hidden_size: the target's width d; vocab_size: the target's vocabulary.
        num_heads / head_dim: attention heads of the context and draft attention sub-layers.
        intermediate_size: SwiGLU hidden width.
        num_draft_tokens: l_d, draft slots per position.
        taps: target residual-stream depths read (0 = embedding output, L = final layer).
        causal_draft: causal mask across the draft slots (the paper's ablation) instead of none.
        bonus_token: also condition the draft slots on the embedding of the bonus token x[t+1]
            (known once the round is verified) through the target's frozen embedding: an
            EAGLE-style extension beyond the paper, off by default (off = the paper's head).
        context_next_token: add the embedding of x[t+1] to the context stream at every position t
            (the last position's x[t+1] is the bonus token): EAGLE-style shifted tokens, off by
            default.
        context_layers: context causal attention sub-layers (the paper has one).
        context_mlp: a SwiGLU MLP after each context attention.
        context_kv_heads: key/value heads of the context attention (grouped-query attention;
            0: ``num_heads``).
        context_intermediate_size: SwiGLU width of the context MLPs (0: ``intermediate_size``).
        context_init: target blocks the context sub-layers were initialised from (one per
            context layer; empty: random initialisation). Recorded for the model card.
        rms_norm_eps: epsilon of the head's RMSNorms.
        target_layers: the target's layer count (checked when the head is bound).
    """

    hidden_size: int
    vocab_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    num_draft_tokens: int = 4
    taps: tuple[int, ...] = ()
    causal_draft: bool = False
    rms_norm_eps: float = 1e-5
    target_layers: int = 0
    bonus_token: bool = False
    context_next_token: bool = False
    context_layers: int = 1
    context_mlp: bool = False
    context_kv_heads: int = 0
    context_intermediate_size: int = 0
    context_init: tuple[int, ...] = ()
    lookup_tokens: bool = False

    @property
    def ctx_kv_heads(self) -> int:
        """Key/value heads of the context attention."""
        return self.context_kv_heads or self.num_heads

    @property
    def ctx_intermediate_size(self) -> int:
        """SwiGLU width of the context MLPs."""
        return self.context_intermediate_size or self.intermediate_size

    @classmethod
    def for_target(cls, target: ModelConfig, num_draft_tokens: int = 4, taps: tuple[int, ...] | None = None,
                   causal_draft: bool = False, intermediate_size: int | None = None,
                   bonus_token: bool = False, context_next_token: bool = False, context_layers: int | None = None,
                   context_mlp: bool = False, context_init: Sequence[int] | None = None,
                   lookup_tokens: bool = False) -> "SpecFormerConfig":
        """A head sized for ``target`` (same width and head shape, SwiGLU width 2d by default).

        ``context_init``: target block indices; the head gets one context decoder block per index,
        shaped like the target's blocks (its key/value heads and MLP width, ``context_mlp`` on),
        ready for ``train.specformer.init_context_from_target``; ``context_layers`` (default 1, the
        paper's) is then ``len(context_init)`` and may be given only as that.

        Raises:
            ValueError: ``num_draft_tokens`` or ``context_layers`` < 1, ``intermediate_size`` < 1,
                a tap outside [0, num_layers] or named twice, a ``context_init`` block outside [0, num_layers),
                ``context_layers`` other than ``len(context_init)``, or a target whose blocks the
                context sub-layer cannot copy (query/key norms or attention biases).
        """
        if taps is not None and len(set(taps)) != len(taps):
            raise ValueError(f"taps {tuple(taps)} name a depth twice")
        taps = tuple(sorted(taps)) if taps else default_taps(target.num_layers)
        init = tuple(context_init or ())
        if init and context_layers not in (None, len(init)):
            raise ValueError(f"{context_layers} context layers but {len(init)} context init blocks; "
                             "the init blocks set the layer count")
        context_layers = len(init) if init else (1 if context_layers is None else context_layers)
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if context_layers < 1:
            raise ValueError(f"context_layers must be >= 1, got {context_layers}")
        if intermediate_size is not None and intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {intermediate_size}")
        if not all(0 <= t <= target.num_layers for t in taps):
            raise ValueError(f"taps {taps} must lie in [0, {target.num_layers}]")
        kv_heads = ctx_width = 0
        if init:
            if not all(0 <= i < target.num_layers for i in init):
                raise ValueError(f"context init blocks {init} must be target block indices in [0, {target.num_layers})")
            if target.qk_norm or target.attention_bias:
                raise ValueError("context init from target blocks needs blocks without query/key norms and "
                                 f"attention biases; {target.architecture} has them")
            context_mlp = True
            kv_heads, ctx_width = target.num_kv_heads, target.intermediate_size
        return cls(target.hidden_size, target.vocab_size, target.num_heads, target.head_dim,
                   intermediate_size or 2 * target.hidden_size, num_draft_tokens, taps, causal_draft,
                   target.rms_norm_eps, target.num_layers, bonus_token, context_next_token, context_layers,
                   context_mlp, kv_heads, ctx_width, init, lookup_tokens)

    @classmethod
    def from_json(cls, text: str | None) -> "SpecFormerConfig":
        """The config ``save_specformer`` wrote into a head's metadata (older heads lack the later
        fields; they take their defaults).

        Raises:
            ValueError: not a JSON object, an unknown or missing field, a field of the wrong type
                (integers, booleans, lists of integers), or a size below 1.
        """
        import typing

        from ..errors import check_fields

        if text is None:
            raise ValueError("the metadata has no config")
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config is not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError("config must be a JSON object")
        check_fields(cls, raw)
        hints = typing.get_type_hints(cls)
        for name, value in raw.items():
            hint = hints[name]
            if hint is bool:
                ok = isinstance(value, bool)
            elif hint is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif hint is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            else:  # tuple[int, ...]
                ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                value = raw[name] = tuple(value) if ok else value
            if not ok:
                raise ValueError(f"field {name} has a value of the wrong type: {value!r}")
        sizes = ("hidden_size", "vocab_size", "num_heads", "head_dim", "intermediate_size", "num_draft_tokens",
                 "context_layers")
        small = [f"{n}={raw[n]}" for n in sizes if raw.get(n, 1) < 1]
        if small:
            raise ValueError(f"sizes must be >= 1: {', '.join(small)}")
        return cls(**raw)

    def check_target(self, target: ModelConfig) -> None:
        """Raise ModelLoadError unless this head was made for a target of ``target``'s shape."""
        if (self.hidden_size, self.vocab_size, self.target_layers) != (target.hidden_size, target.vocab_size,
                                                                        target.num_layers):
            raise ModelLoadError(
                f"SpecFormer head was trained for a target with d={self.hidden_size}, vocab={self.vocab_size}, "
                f"{self.target_layers} layers; this target has d={target.hidden_size}, vocab={target.vocab_size}, "
                f"{target.num_layers} layers")


class ContextLayer(nn.Module):
    """One context causal attention sub-layer (pre-norm, RoPE at the target's positions, residual,
    grouped-query attention when ``context_kv_heads`` < ``num_heads``), optionally followed by a
    SwiGLU MLP. Its output projections start at zero (identity layer) unless copied from a target
    block (``train.specformer.init_context_from_target``)."""

    def __init__(self, config: "SpecFormerConfig") -> None:
        super().__init__()
        d, nh, hd, kvh = config.hidden_size, config.num_heads, config.head_dim, config.ctx_kv_heads
        self.num_heads, self.kv_heads, self.head_dim = nh, kvh, hd
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv = nn.Linear(d, (nh + 2 * kvh) * hd, bias=False)
        self.o = nn.Linear(nh * hd, d, bias=False)
        self.mlp = _SwiGLU(d, config.ctx_intermediate_size, config.rms_norm_eps) if config.context_mlp else None
        with torch.no_grad():
            self.o.weight.zero_()

    def qkv_rotated(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q ``[B, Q, heads, hd]`` and k, v ``[B, Q, kv_heads, hd]`` for ``h`` ``[B, Q, d]``."""
        B, Q, _ = h.shape
        nh, kvh, hd = self.num_heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(self.norm(h)).split([nh * hd, kvh * hd, kvh * hd], dim=-1)
        q, k, v = q.view(B, Q, nh, hd), k.view(B, Q, kvh, hd), v.view(B, Q, kvh, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, h: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Residual update of ``h`` ``[B, Q, d]`` with the attention output ``att`` ``[B, heads, Q, hd]``."""
        B, Q, _ = h.shape
        o = self.o(att.transpose(1, 2).reshape(B, Q, -1))
        return h + o if self.mlp is None else self.mlp.residual_forward(h, o)


class _SwiGLU(nn.Module):
    """Pre-norm SwiGLU MLP with a residual; the down projection starts at zero."""

    def __init__(self, d: int, width: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(d, eps)
        self.w13 = nn.Linear(d, 2 * width, bias=False)
        self.w2 = nn.Linear(width, d, bias=False)
        with torch.no_grad():
            self.w2.weight.zero_()

    fused = False  # SiLU-multiply as one kernel (``use_fused_kernels``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return x + self.w2(kernels.silu_mul(self.w13(self.norm(x))))
        gate, up = self.w13(self.norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)

    def residual_forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``self(x + delta)``, the same bits; fused, the add runs inside the norm's kernel
        (``kernels.add_rmsnorm`` with a residual), one kernel fewer."""
        if not self.fused:
            return self(x + delta)
        r, out = self.residual_parts(x, delta)
        return r + out

    def residual_parts(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual_forward`` as ``(r, out)`` with the result ``r + out``, left to the next
        norm's kernel to add (fused only)."""
        normed, r = kernels.add_rmsnorm(delta.contiguous(), x.contiguous(), self.norm.weight, self.norm.eps)
        return r, self.w2(kernels.silu_mul(self.w13(normed)))


# parameter names of heads saved before context layers were stacked (one layer, no MLP)
_LEGACY_KEYS = {"ctx_norm.weight": "ctx.0.norm.weight", "ctx_qkv.weight": "ctx.0.qkv.weight",
                "ctx_o.weight": "ctx.0.o.weight", "mlp_norm.weight": "mlp.norm.weight",
                "w13.weight": "mlp.w13.weight", "w2.weight": "mlp.w2.weight"}


class SpecFormerHead(nn.Module):
    """The trainable part of SpecFormer (the target's final norm and LM head stay outside, frozen).

    Args:
        config: head shape.
    """

    def __init__(self, config: SpecFormerConfig) -> None:
        super().__init__()
        self.config = config
        d, nh, hd = config.hidden_size, config.num_heads, config.head_dim
        eps = config.rms_norm_eps
        self.tap_norms = nn.ModuleList(RMSNorm(d, eps) for _ in config.taps)
        # [taps, d] the tap norms' weights stacked for the fused path (``use_fused_kernels``; a
        # buffer, so it follows the head's device and dtype; not saved)
        self.register_buffer("_tap_weight", None, persistent=False)
        self.down = nn.Linear(len(config.taps) * d, d, bias=False)
        if config.context_next_token:
            self.next_norm = RMSNorm(d, eps)
            self.next_proj = nn.Linear(d, d, bias=False)
        self.ctx = nn.ModuleList(ContextLayer(config) for _ in range(config.context_layers))
        self.pos_norm = RMSNorm(d, eps)
        self.pos_ffn = nn.Linear(d, config.num_draft_tokens * d, bias=False)
        self.draft_norm = RMSNorm(d, eps)
        self.draft_qkv = nn.Linear(d, 3 * nh * hd, bias=False)
        self.draft_o = nn.Linear(nh * hd, d, bias=False)
        self.mlp = _SwiGLU(d, config.intermediate_size, eps)
        if config.bonus_token:
            self.bonus_norm = RMSNorm(d, eps)
            self.bonus_proj = nn.Linear(d, d, bias=False)
        if config.lookup_tokens:  # a per-channel gain on the normalised embedding (no d x d projection: size)
            self.lookup_norm = RMSNorm(d, eps)
            self.lookup_match = nn.Embedding(MAX_N + 1, d)
        with torch.no_grad():  # start as "copy the final tap into every slot": residual branches at zero
            if config.lookup_tokens:
                self.lookup_norm.weight.zero_()
                self.lookup_match.weight.zero_()
            for name in ("pos_ffn", "draft_o", "bonus_proj", "next_proj"):
                if hasattr(self, name):
                    getattr(self, name).weight.zero_()
            self.down.weight.zero_()
            self.down.weight[:, -d:] = torch.eye(d)

    fused = False  # the glue kernels and the draft slots' attention as one kernel (``use_fused_kernels``)

    def context_input(self, taps: torch.Tensor, next_emb: torch.Tensor | None = None) -> torch.Tensor:
        """The context stream's input ``[..., d]``: per-tap RMSNorm, concat, downsample of ``taps``
        ``[..., len(taps), d]``, plus (``context_next_token`` heads) the projected embedding of
        each position's next token ``next_emb`` ``[..., d]``.

        Raises:
            ValueError: a ``context_next_token`` head without ``next_emb``.
        """
        h, delta = self.context_input_parts(taps, next_emb)
        return h if delta is None else h + delta

    def context_input_parts(self, taps: torch.Tensor, next_emb: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``context_input`` as ``(h, delta)`` with the input ``h + delta`` (``delta`` the next
        token's projection, None for a head without): the fused path adds it inside the first
        context layer's norm (``kernels.add_rmsnorm``). Raises as ``context_input``."""
        if self.fused:  # one kernel writes the concatenated norms (``head_kernels.tap_rmsnorm``)
            h = self.down(head_kernels.tap_rmsnorm(taps, self._tap_weight, self.tap_norms[0].eps))
        else:
            h = self.down(torch.cat([norm(taps[..., i, :]) for i, norm in enumerate(self.tap_norms)], dim=-1))
        if not self.config.context_next_token:
            return h, None
        if next_emb is None:
            raise ValueError("this SpecFormer head reads each position's next token: pass next_emb")
        return h, self.next_proj(self.next_norm(next_emb))

    def draft(self, h: torch.Tensor, bonus_emb: torch.Tensor | None = None,
              lookup: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``[N, d]`` context states -> ``[N, l_d, d]`` draft states (before the target's final norm).

        Args:
            bonus_emb: ``[N, d]`` target embeddings of the bonus tokens (``bonus_token`` heads only).
            lookup: (``lookup_tokens`` heads only) ``[N, l_d, d]`` target embeddings of the lookup
                continuation tokens (zeros where nothing recurs) and ``[N]`` match lengths in
                [0, 4] (``lookup_inputs``).

        Raises:
            ValueError: a ``bonus_token`` head without ``bonus_emb`` or a ``lookup_tokens`` head
                without ``lookup``.
        """
        h, pos = self._slot_inputs(h, bonus_emb)
        x = h[:, None, :] + pos
        if self.config.lookup_tokens:
            if lookup is None:
                raise ValueError("this SpecFormer head reads the context lookup continuation: pass lookup")
            emb, match = lookup
            x = x + self.lookup_norm(emb) + self.lookup_match(match)[:, None, :]
        return self._draft_slots(x, self.draft_norm(x))

    def draft_from_ids(self, h: torch.Tensor, embed: nn.Embedding, final_norm: RMSNorm,
                       bonus_emb: torch.Tensor | None = None, cont: torch.Tensor | None = None,
                       match: torch.Tensor | None = None) -> torch.Tensor:
        """``final_norm(draft(...))`` with the lookup continuation as token ids, as serving holds
        it: ``[N, d]`` context states -> ``[N, l_d, d]`` draft states after the target's final
        norm (what its LM head reads). With ``fused`` the slots' input stream and its norm are one
        kernel (``head_kernels.draft_input``, which reads the continuation's embeddings itself) and
        the MLP's residual add runs inside the final norm's kernel.

        Args:
            embed: the target's token embedding (frozen); final_norm: the target's final norm.
            bonus_emb: as in ``draft``.
            cont: (``lookup_tokens`` heads) ``[N, l_d]`` long continuation ids, -1 where none;
                match: ``[N]`` long match lengths (``lookup_inputs``).

        Raises:
            ValueError: as ``draft``.
        """
        lookup_ids = cont is not None and match is not None
        if not self.fused:
            return final_norm(self.draft(h, bonus_emb, lookup_inputs(embed, cont, match) if lookup_ids else None))
        lookup = None
        if self.config.lookup_tokens:
            if not lookup_ids:
                raise ValueError("this SpecFormer head reads the context lookup continuation: pass cont and match")
            lookup = (cont, match, embed.weight, self.lookup_norm.weight, self.lookup_match.weight)
        h, pos = self._slot_inputs(h, bonus_emb)
        x, normed = head_kernels.draft_input(h, pos, self.draft_norm.weight, self.draft_norm.eps, lookup)
        r, delta = self._draft_slots(x, normed, parts=True)
        return kernels.add_rmsnorm(delta.contiguous(), r.contiguous(), final_norm.weight, final_norm.eps)[0]

    def _slot_inputs(self, h: torch.Tensor, bonus_emb: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The context states with the bonus token's projection added (``bonus_token`` heads) and
        the position rows ``[N, l_d, d]`` made from them: the two terms every draft slot's input
        starts from. Raises ValueError for a ``bonus_token`` head without ``bonus_emb``."""
        if self.config.bonus_token:
            if bonus_emb is None:
                raise ValueError("this SpecFormer head conditions on the bonus token: pass bonus_emb")
            h = h + self.bonus_proj(self.bonus_norm(bonus_emb))
        return h, self.pos_ffn(self.pos_norm(h)).view(h.shape[0], self.config.num_draft_tokens, h.shape[1])

    def _draft_slots(self, x: torch.Tensor, normed: torch.Tensor, parts: bool = False):
        """The draft slots' attention and MLP over their input stream ``x`` ``[N, l_d, d]`` and its
        draft norm ``normed``: ``[N, l_d, d]`` draft states; with ``parts`` (fused only) as
        ``(r, delta)`` whose sum they are (``_SwiGLU.residual_parts``)."""
        N, ld, _ = x.shape
        nh, hd = self.config.num_heads, self.config.head_dim
        qkv = self.draft_qkv(normed)
        if self.fused:  # one kernel from the projection's rows to the output projection's
            att = kernels.slot_attention(qkv, nh, hd, self.config.causal_draft)
        else:
            q, k, v = qkv.view(N, ld, 3, nh, hd).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=self.config.causal_draft)
            att = att.transpose(1, 2).reshape(N, ld, nh * hd)
        if parts:
            return self.mlp.residual_parts(x, self.draft_o(att))
        return self.mlp.residual_forward(x, self.draft_o(att))

    def forward_train(self, taps: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      select: torch.Tensor | None = None, bonus_emb: torch.Tensor | None = None,
                      next_emb: torch.Tensor | None = None,
                      lookup: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Whole-sequence forward for training.

        Args:
            taps: ``[B, T, len(taps), d]`` target states of sequences starting at position 0.
            cos, sin: ``[B, T, head_dim]`` rotary tables of positions 0..T-1.
            select: optional ``[B, T]`` bool, positions whose drafts are needed (saves memory).
            bonus_emb: ``[N, d]`` embeddings of each needed position's next token (``bonus_token``).
            next_emb: ``[B, T, d]`` embeddings of every position's next token (``context_next_token``).
            lookup: ``[N, l_d, d]`` lookup embeddings and ``[N]`` match lengths of the needed
                positions (``lookup_tokens``; see ``draft``).

        Returns:
            ``[N, l_d, d]`` draft states, N = B*T or the selected count (row-major order).
        """
        B, T = taps.shape[:2]
        h = self.context_input(taps, next_emb)
        for layer in self.ctx:
            q, k, v = layer.qkv_rotated(h, cos, sin)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=layer.kv_heads != layer.num_heads)
            h = layer.finish(h, att)
        h = h[select] if select is not None else h.reshape(B * T, -1)
        return self.draft(h, bonus_emb, lookup)


def use_fused_kernels(head: SpecFormerHead, on: bool = True) -> None:
    """Run the head's RMSNorms, SwiGLU activations and draft-slot attention through the fused GPU
    kernels (``tandem.models.kernels``; ``slot_attention`` for the slots), and its glue between
    matmuls through ``tandem.models.head_kernels`` (the tap norms, the draft slots' input): serving
    only (the kernels have no backward), on a target runner that uses them. Call after the head
    has its weights (the tap norms' weights are stacked here; they share the config's epsilon)."""
    for m in head.modules():
        if isinstance(m, (RMSNorm, _SwiGLU)):
            m.fused = on
    head.fused = on
    head._tap_weight = torch.stack([norm.weight.detach() for norm in head.tap_norms]) if on else None


def lookup_inputs(embed: nn.Embedding, cont, match) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``lookup_tokens`` head's ``draft`` input from lookup continuations.

    Args:
        embed: the target's token embedding (frozen).
        cont: ``[N, l_d]`` continuation ids, -1 where there is none (``lookup_continuations``).
        match: ``[N]`` match lengths.

    Returns:
        ``[N, l_d, d]`` embeddings (zero rows for -1) and ``[N]`` long match lengths, on the
        embedding's device.
    """
    dev = embed.weight.device
    cont = torch.as_tensor(cont, dtype=torch.long, device=dev)
    emb = embed(cont.clamp(min=0)) * (cont >= 0)[..., None].to(embed.weight.dtype)
    return emb, torch.as_tensor(match, dtype=torch.long, device=dev).clamp(0, MAX_N)


def save_specformer(head: SpecFormerHead, path: str | Path, extra: dict | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``path/model.safetensors`` (weights in ``dtype``, config in the metadata).

    Returns the safetensors file path.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "config": json.dumps(asdict(head.config)), "extra": json.dumps(extra or {})}
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    file = out / "model.safetensors"
    save_file(tensors, str(file), metadata=meta)
    make_readable(file)
    return file


def is_specformer_dir(path: str | Path) -> bool:
    """True when ``path`` (a directory or its safetensors file) holds a head written by ``save_specformer``."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights_file(path)), framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # missing, or not safetensors
        return False


def specformer_file(path: str | Path) -> Path:
    """The safetensors file of a head given as its directory or as the file (cheap: no read).

    Raises:
        ModelLoadError: no such file.
    """
    file = weights_file(path)
    if not file.is_file():
        raise ModelLoadError(f"no SpecFormer head at {str(Path(path))!r} (expected a directory with model.safetensors)")
    return file


def load_specformer(path: str | Path) -> SpecFormerHead:
    """Read a head written by ``save_specformer`` (a directory or its safetensors file), float32 on CPU.

    Raises:
        ModelLoadError: missing file, not a SpecFormer head, or tensors that do not fit its config.
    """
    from safetensors import safe_open

    file = specformer_file(path)
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # not safetensors
        raise ModelLoadError(f"cannot read SpecFormer head {str(file)!r}: not a complete safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{str(file)!r} is not a SpecFormer head (format {meta.get('format')!r})")
    try:
        head = SpecFormerHead(SpecFormerConfig.from_json(meta.get("config")))
    except (ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"SpecFormer head {str(file)!r} has a damaged config: {exc}") from None
    try:
        head.load_state_dict({_LEGACY_KEYS.get(k, k): v.float() for k, v in tensors.items()})
    except RuntimeError as exc:
        raise ModelLoadError(f"SpecFormer head {str(file)!r} does not match its config: {exc}") from None
    return head
