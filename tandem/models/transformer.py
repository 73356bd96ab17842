"""Our own decoder-only transformer forward (Llama / Mistral / Qwen2 / Qwen3).

RMSNorm, RoPE (checkpoint theta and scaling), grouped-query attention over a static per-slot KV
cache, SwiGLU. The projections are fused (q|k|v in one matrix, gate|up in one) so a step issues
few kernels. One ``forward`` appends ``q >= 1`` tokens per row with ragged ``q`` (rows with fewer
tokens are padded; their padded tokens write to the cache's scratch position and are ignored).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import attention, fused_linear, kernels
from .config import ModelConfig, ModelLoadError
from .kernels import MAX_FUSED_TOKENS
from .rope import apply_rope, rope_tables


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 as Hugging Face Llama does. With
    ``fused`` set (inference on a GPU whose runner uses the fused kernels) it is one Triton kernel
    (``kernels.add_rmsnorm``) instead of seven."""

    fused = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels.add_rmsnorm(x.contiguous(), None, self.weight, self.eps)[0]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Block(nn.Module):
    """One pre-norm transformer block: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_size = cfg.num_heads * hd
        self.kv_size = cfg.num_kv_heads * hd
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.wqkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.wo = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, rows: torch.Tensor, write_pos: torch.Tensor, attn_mask: torch.Tensor,
                attn_len: int) -> torch.Tensor:
        """Args:
            x: ``[B, Q, d]`` hidden states.
            cos, sin: ``[B, Q, head_dim]`` rotary tables at each token's position.
            k_cache, v_cache: this layer's cache rows ``[B, kv_heads, capacity + KV_SLACK, head_dim]``.
            rows, write_pos: ``[B, Q]`` where each token's K/V is written.
            attn_mask: ``[B, 1, group * Q, attn_len]`` bool, True = may attend.
            attn_len: cache positions attended (>= every row's new length).
        """
        B, Q, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        k_cache[rows, :, write_pos] = k.to(k_cache.dtype)
        v_cache[rows, :, write_pos] = v.to(v_cache.dtype)
        # GQA without expanding K/V: fold the query heads of one group into the query axis,
        # [B, Q, kvh * g, hd] -> [B, kvh, g * Q, hd]; every folded row shares its group's K/V.
        kvh, g, hd = self.cfg.num_kv_heads, self.cfg.group_size, self.cfg.head_dim
        qg = q.view(B, Q, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * Q, hd)
        keys = k_cache[:, :, :attn_len]
        values = v_cache[:, :, :attn_len]
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=attn_mask)
        out = out.view(B, kvh, g, Q, hd).permute(0, 3, 1, 2, 4).reshape(B, Q, self.q_size)
        return self._finish(x, out)

    def forward_causal(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward over whole sequences (training and distillation).

        Args:
            x: ``[B, T, d]``; cos, sin: ``[B, T, head_dim]``.
        """
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        return self._finish(x, out.transpose(1, 2).reshape(B, T, self.q_size))

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q ``[B, Q, heads, hd]`` and k, v ``[B, Q, kv_heads, hd]``."""
        cfg = self.cfg
        B, Q, _ = x.shape
        hd, kvh = cfg.head_dim, cfg.num_kv_heads
        qkv = self.wqkv(self.attn_norm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, Q, cfg.num_heads, hd)
        k = k.view(B, Q, kvh, hd)
        v = v.view(B, Q, kvh, hd)
        if cfg.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, then the SwiGLU MLP with its residual."""
        x = x + self.wo(attn_out)
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    """Decoder-only LM over a static KV cache.

    Args:
        config: model shape.
        max_positions: rows of the RoPE tables (the context limit the runner will use).
    """

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.max_positions = max_positions
        self.fused = False  # decode/verify through tandem.models.kernels (set by the runner on a GPU)
        self.fused_linear = False  # ... with the projections fused too (fused_linear.py), prefills included
        self.attn_backend = "triton"  # decode/verify attention of the fused path (attention.ATTN_BACKENDS)
        self.attn_chunk = 0  # its fixed split-KV chunk in positions (0: none; attention.gqa_attention)
        # chain steps on our attention kernel rotate and write K/V inside it (gqa_attention_rope)
        self.rope_in_attention = ROPE_IN_ATTENTION
        cos, sin = rope_tables(config, max_positions, "cpu", torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (our names, see ``tandem.models.weights``) into the parameters.

        Raises:
            ModelLoadError: a tensor is missing, unexpected, or of the wrong shape.
        """
        params = dict(self.named_parameters(remove_duplicate=True))
        missing = [n for n in params if n not in tensors]
        if missing:
            raise ModelLoadError(f"checkpoint lacks tensors: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
        unexpected = [n for n in tensors if n not in params]
        if unexpected:
            raise ModelLoadError(f"checkpoint has unexpected tensors: {', '.join(unexpected[:5])}")
        with torch.no_grad():
            for name, p in params.items():
                t = tensors[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ModelLoadError(
                        f"shape mismatch for {name}: checkpoint {tuple(t.shape)}, config expects {tuple(p.shape)}"
                    )
                p.copy_(t.to(p.dtype))

    def forward_hidden(self, tokens: torch.Tensor, start: torch.Tensor, q_lens: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, attn_len: int,
                       depth: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                       taps: tuple[int, ...] = (), wide: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``tokens`` to the cache rows and return final-norm hidden states.

        Args:
            tokens: ``[B, Q]`` token ids; row b's first ``q_lens[b]`` are real, the rest padding.
            start: ``[B]`` int64, tokens each row holds before this call (its write offset).
            q_lens: ``[B]`` int64, real tokens per row (0 allowed: the row only does dummy work).
            k_cache, v_cache: ``[num_layers, B, kv_heads, capacity + KV_SLACK, head_dim]`` views of the
                cache rows this batch runs on (the last position is the scratch row).
            attn_len: cache positions to attend over; must be >= max(start + q_lens).
            depth: ``[B, Q]`` int64 position offset of each new token (token tree verification:
                siblings share a depth); default ``0..Q-1`` (a chain).
            tree_mask: ``[B, Q, Q]`` bool, ``tree_mask[b, i, j]`` = new token i may attend new
                token j (itself and its ancestors); default causal. K/V of new token j are always
                written at cache position ``start + j``, rotated for position ``start + depth``.
            taps: residual-stream depths to return besides the output (0 = embedding output,
                i = after block i, ``num_layers`` = the last block's output before the final
                norm): the hidden states a SpecFormer head reads.
            wide: the caller checked that every row has room for ``start + Q`` cache positions,
                so a step wider than ``MAX_FUSED_TOKENS`` (a prefill) may take the fused kernels.

        Returns:
            ``([B, Q, d]`` hidden states after the final RMSNorm, ``[B, Q, len(taps), d]`` tapped
            states or None when ``taps`` is empty).
        """
        B, Q = tokens.shape
        if self.fused and (Q <= MAX_FUSED_TOKENS or (wide and depth is None and tree_mask is None)):
            return self.forward_fused(tokens, start, q_lens, k_cache, v_cache, taps, prefill=wide,
                                      depth=depth, tree_mask=tree_mask)
        g = self.config.group_size
        scratch = k_cache.shape[3] - 1
        offs = torch.arange(Q, device=tokens.device)
        slot_pos = start[:, None] + offs[None, :]  # [B, Q]: where each new token's K/V lives
        real = offs[None, :] < q_lens[:, None]
        write_pos = torch.where(real, slot_pos, torch.full_like(slot_pos, scratch))
        rows = torch.arange(B, device=tokens.device)[:, None].expand(B, Q)
        pos = slot_pos if depth is None else start[:, None] + depth
        rope_pos = pos.clamp(max=self.max_positions - 1)
        cos = self.rope_cos[rope_pos].to(self.embed.weight.dtype)
        sin = self.rope_sin[rope_pos].to(self.embed.weight.dtype)
        keys = torch.arange(attn_len, device=tokens.device)
        if tree_mask is None:
            mask = keys[None, None, :] <= slot_pos[:, :, None]  # [B, Q, L]: causal over each row's cache
        else:
            rel = keys[None, :] - start[:, None]  # [B, L]: key index among the new tokens
            is_new = (rel >= 0) & (rel < Q)
            new_vis = tree_mask.gather(2, rel.clamp(0, Q - 1)[:, None, :].expand(B, Q, attn_len))
            mask = (rel < 0)[:, None, :] | (is_new[:, None, :] & new_vis)
        mask = mask.repeat(1, g, 1).unsqueeze(1)  # [B, 1, g*Q, L], matches the folded query rows
        x = self.embed(tokens)
        tapped = [x] if _is_tap(0, taps) else []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, k_cache[i], v_cache[i], rows, write_pos, mask, attn_len)
            if _is_tap(i + 1, taps):
                tapped.append(x)
        return self.norm(x), _stack_taps(tapped, taps)

    def forward_fused(self, tokens: torch.Tensor, start: torch.Tensor, q_lens: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      taps: tuple[int, ...] = (), prefill: bool = False, depth: torch.Tensor | None = None,
                      tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_hidden`` for chains of at most ``MAX_FUSED_TOKENS`` tokens per row, through the
        fused GPU kernels (``tandem.models.kernels``): nine kernels per layer (eight in a chain step on
        our attention kernel with ``rope_in_attention``; five with
        ``fused_linear``, whose kernels fuse the projections with their neighbours, prefills
        included), no attention mask, and every row's result independent of the other rows of the
        batch and of the row's width.

        Same arguments and result as ``forward_hidden``; a token tree (``depth``, ``tree_mask``;
        not in a prefill) rotates each token for its depth and passes the mask to the attention
        kernel as per-token bits over the new tokens (``attention.gqa_attention``'s ``tree_bits``),
        so a chain row of a step with trees gets exactly the logits of a chain step. The cache rows need
        ``max(start) + Q`` positions (``KVCache`` keeps ``KV_SLACK`` positions past its capacity,
        enough for any decode or verify step; a prefill checks it: ``forward_hidden``'s ``wide``):
        attention runs over ``start + Q`` positions of each row, causally aligned at the end, so a
        row's real tokens never see its padding.

        Attention: ``self.attn_backend`` for decode and verify steps; a prefill (``prefill``, whatever
        its width, so that a prompt's cache does not depend on what it was batched with) takes
        flash-attn where it is importable, else the same Triton kernel.
        """
        cfg = self.config
        backend = self.attn_backend
        if prefill:
            backend = "flash" if attention.flash_available(cfg.head_dim) else "triton"
        B, Q = tokens.shape
        scratch = k_cache.shape[3] - 1
        seqlens = (start + Q).to(torch.int32)
        spans = depth is None and not self.fused_linear  # the RoPE/KV kernel makes the positions itself
        if not spans:
            offs = torch.arange(Q, device=tokens.device)
            slot_pos = start[:, None] + offs[None, :]
            write_pos = torch.where(offs[None, :] < q_lens[:, None], slot_pos, torch.full_like(slot_pos, scratch))
            rope_pos = (slot_pos if depth is None else start[:, None] + depth).clamp(max=self.max_positions - 1)
        tree_bits = None
        if tree_mask is not None:  # bit j of token i: i may see new token j (Q <= MAX_FUSED_TOKENS < 31)
            offs = torch.arange(Q, device=tokens.device, dtype=torch.int32)
            tree_bits = (tree_mask.to(torch.int32) << offs[None, None, :]).sum(-1, dtype=torch.int32)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            return attention.attention_with_kvcache(q, k_cache[i], v_cache[i], seqlens, backend, tree_bits,
                                                    self.attn_chunk)

        attend_qkv = None
        if spans and not prefill and self.rope_inside_attention(Q):
            def attend_qkv(i: int, qkv: torch.Tensor) -> torch.Tensor:  # RoPE + K/V write inside the attention
                return attention.gqa_attention_rope(qkv, self.rope_cos, self.rope_sin, q_lens, k_cache[i], v_cache[i],
                                                    seqlens, cfg.num_heads, self.attn_chunk)

        write = (start, q_lens, scratch) if spans else (rope_pos, write_pos)
        return self._fused_layers(self.embed(tokens), k_cache, v_cache, write, attend, taps, prefill, attend_qkv)

    def forward_varlen(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                       k_buf: torch.Tensor, v_buf: torch.Tensor,
                       taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A varlen prefill: prompts packed end to end, no padding between them.

        Every projection, norm and MLP runs over the packed tokens only (a padded prefill runs them
        over rows x its widest prompt); attention is ``attention.varlen_causal_attention`` (each
        prompt attends only to itself). Each token's K/V is written at its own index of
        ``k_buf``/``v_buf``, from which the caller copies them into cache slots. The attention of
        one sequence never reads another's, and with ``fused_linear`` every projection computes
        each token's row alone, so a prompt's result does not depend on what it is packed with
        (the plain fused path's cuBLAS GEMMs pick their kernel by the number of rows, as they do
        in a padded prefill).

        Args:
            tokens: ``[T]`` token ids.
            positions: ``[T]`` int64 rotary position of each token (its index in its prompt).
            cu_seqlens: ``[S + 1]`` int32 prompt boundaries (``varlen_causal_attention``).
            max_len: a bound on every prompt's length.
            k_buf, v_buf: ``[num_layers, 1, kv_heads, >= T, head_dim]`` (last dim contiguous).
            taps: as in ``forward_hidden``.

        Returns:
            ``[T, d]`` hidden states after the final RMSNorm and ``[T, len(taps), d]`` tapped
            states (None when ``taps`` is empty).
        """
        T = tokens.shape[0]
        pos = positions.clamp(max=self.max_positions - 1)[None]
        where = torch.arange(T, device=tokens.device)[None]

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:  # [1, T, heads, hd] -> [1, T, heads, hd]
            return attention.varlen_causal_attention(q[0], k_buf[i, 0, :, :T].transpose(0, 1),
                                                     v_buf[i, 0, :, :T].transpose(0, 1), cu_seqlens, max_len)[None]

        x = self.embed(tokens)[None]
        if self.fused:
            hidden, tapped = self._fused_layers(x, k_buf, v_buf, (pos, where), attend, taps, True)
        else:
            cos = self.rope_cos[pos].to(x.dtype)
            sin = self.rope_sin[pos].to(x.dtype)
            kept = [x] if _is_tap(0, taps) else []
            for i, layer in enumerate(self.layers):
                q, k, v = layer._qkv(x, cos, sin)
                k_buf[i, 0, :, :T] = k[0].transpose(0, 1).to(k_buf.dtype)
                v_buf[i, 0, :, :T] = v[0].transpose(0, 1).to(v_buf.dtype)
                x = layer._finish(x, attend(i, q).reshape(1, T, layer.q_size))
                if _is_tap(i + 1, taps):
                    kept.append(x)
            hidden, tapped = self.norm(x), _stack_taps(kept, taps)
        return hidden[0], None if tapped is None else tapped[0]

    def rope_inside_attention(self, width: int) -> bool:
        """Whether a decode or verify chain step of ``width`` tokens a row (this model's, or a
        SpecFormer head's context layers beside it) takes the attention that does the RoPE + K/V
        write itself (``attention.gqa_attention_rope``): ``rope_in_attention`` on, our attention
        kernel, and at most ``attention.MAX_NEW`` tokens."""
        return self.rope_in_attention and self.attn_backend == "triton" and width <= attention.MAX_NEW

    def _fused_layers(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write: tuple,
                      attend, taps: tuple[int, ...], prefill: bool,
                      attend_qkv=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers of ``forward_fused`` / ``forward_varlen`` over the embedded ``x`` ``[B, Q, d]``.

        Args:
            write: ``(rope_pos, write_pos)``, ``[B, Q]`` each, or ``(start, q_lens, scratch)`` for
                rows of consecutive positions (``kernels.rope_kv_write_spans``; not with
                ``fused_linear``).
            attend: ``(layer index, rotated q [B, Q, heads, hd]) -> [B, Q, heads, hd]``, over the
                K/V this layer just wrote.
            prefill: take the prefill tiles of the fused projections.
            attend_qkv: ``(layer index, qkv [B, Q, width]) -> [B, Q, heads, hd]``, attention that
                rotates and writes the K/V itself (``attention.gqa_attention_rope``), in place of
                the RoPE + K/V-write kernel and ``attend`` (the nine-kernel path; None: not used).
        """
        cfg = self.config
        eps = cfg.rms_norm_eps
        B, Q = x.shape[:2]
        tapped = [x] if _is_tap(0, taps) else []
        if self.fused_linear:  # five kernels a layer: the projections fused with their neighbours
            rope_pos, write_pos = write
            bm = fused_linear.PREFILL_BLOCK_M if prefill else fused_linear.BLOCK_M
            res = x.contiguous()  # the residual stream
            for i, layer in enumerate(self.layers):
                q = fused_linear.norm_qkv_rope(res, layer.attn_norm.weight, eps, layer.wqkv.weight, layer.wqkv.bias,
                                               self.rope_cos, self.rope_sin, rope_pos, write_pos, k_cache[i],
                                               v_cache[i], cfg.num_heads, cfg.num_kv_heads, block_m=bm)
                res = fused_linear.linear_residual(attend(i, q).reshape(B, Q, layer.q_size), layer.wo.weight, res,
                                                   block_m=bm)
                act = fused_linear.norm_gate_up(res, layer.ffn_norm.weight, eps, layer.w13.weight, block_m=bm)
                res = fused_linear.linear_residual(act, layer.w2.weight, res, block_m=bm)
                if _is_tap(i + 1, taps):
                    tapped.append(res)
            hidden, _ = kernels.add_rmsnorm(res, None, self.norm.weight, eps)
            return hidden, _stack_taps(tapped, taps)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = kernels.add_rmsnorm(x, residual, layer.attn_norm.weight, eps)
            if attend_qkv is not None:  # eight kernels a layer: RoPE and the K/V write inside the attention
                o = attend_qkv(i, layer.wqkv(h))
            elif len(write) == 3:
                o = attend(i, kernels.rope_kv_write_spans(layer.wqkv(h), self.rope_cos, self.rope_sin, *write,
                                                          k_cache[i], v_cache[i], cfg.num_heads, cfg.num_kv_heads))
            else:
                o = attend(i, kernels.rope_kv_write(layer.wqkv(h), self.rope_cos, self.rope_sin, *write, k_cache[i],
                                                    v_cache[i], cfg.num_heads, cfg.num_kv_heads))
            x = layer.wo(o.reshape(B, Q, layer.q_size))
            h, residual = kernels.add_rmsnorm(x, residual, layer.ffn_norm.weight, eps)
            x = layer.w2(kernels.silu_mul(layer.w13(h)))
            if _is_tap(i + 1, taps):
                tapped.append(residual + x)
        hidden, _ = kernels.add_rmsnorm(x, residual, self.norm.weight, eps)
        return hidden, _stack_taps(tapped, taps)

    def forward_causal(self, tokens: torch.Tensor, taps: tuple[int, ...] = (),
                       num_layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cache-free causal forward over whole sequences from position 0 (training, distillation).

        Args:
            tokens: ``[B, T]`` token ids (right padding is harmless: causal attention never lets a
                real token see a later pad).
            taps: as in ``forward_hidden``.
            num_layers: run only the first blocks (default all).

        Returns:
            ``[B, T, d]`` final-norm hidden states and ``[B, T, len(taps), d]`` taps (or None).
        """
        B, T = tokens.shape
        cos = self.rope_cos[:T].to(self.embed.weight.dtype).expand(B, T, -1)
        sin = self.rope_sin[:T].to(self.embed.weight.dtype).expand(B, T, -1)
        x = self.embed(tokens)
        tapped = [x] if _is_tap(0, taps) else []
        for i, layer in enumerate(self.layers[:num_layers]):
            x = layer.forward_causal(x, cos, sin)
            if _is_tap(i + 1, taps):
                tapped.append(x)
        return self.norm(x), _stack_taps(tapped, taps)

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """LM head: ``[..., d]`` hidden -> ``[..., vocab]`` logits, float32 (``float32=False``: in the
        weights' dtype, which a batch's argmax reads without writing a float32 copy of every row:
        the upcast is exact, so the argmax is the same)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits


# Decode and verify chain steps on our attention kernel do the RoPE + K/V write inside it: eight
# kernels a layer instead of nine. Bitwise the two kernels' result (CPU under Triton's interpreter
# and an H100); on an H100 +5-6% tok/s at batch 1, 3-6% less GPU a round at 64 (docs/benchmarks.md, "RoPE + K/V
# write inside the attention"). Off (False) restores the separate RoPE/KV kernel.
ROPE_IN_ATTENTION = True


def _is_tap(depth: int, taps: tuple[int, ...]) -> bool:
    """``depth in taps``, spelled as comparisons: under ``torch.compile(dynamic=True)`` the tap
    depths become symbolic ints and Dynamo evaluates ``int in tuple`` as False (torch 2.11-2.13),
    which silently dropped every tap from the compiled batch-1 graph."""
    return any(depth == t for t in taps)


def _stack_taps(tapped: list[torch.Tensor], taps: tuple[int, ...]) -> torch.Tensor | None:
    if not taps:
        return None
    if len(tapped) != len(taps) or list(taps) != sorted(set(taps)):
        raise ValueError(f"taps {taps} must be distinct, ascending depths in [0, num_layers]")
    return torch.stack(tapped, dim=2)
