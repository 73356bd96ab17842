"""Sampling parameters and the logits -> probabilities transform (one source of truth).

The same ``sampling_probs`` transform is applied to the target's and the drafter's logits in
speculative sampling, so the verified distribution is exactly target-only sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError, check_utf8
from . import sampling_kernels
from .models.kernels import round_kernels_on
from .structured import Structure


SAMPLING_EPS = 1e-5  # temperatures below this decode greedily
MAX_LOGIT_BIAS = 100  # OpenAI's logit_bias range: [-100, 100]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI / vLLM semantics).

    Attributes:
        max_tokens: output tokens at most (>= 1).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. Values below
            ``SAMPLING_EPS`` (1e-5, as vLLM) are greedy too: the limit of sampling as the
            temperature goes to 0, and a float32 division by less would overflow.
        top_k: keep the k most likely tokens (0 = off).
        top_p: nucleus sampling mass in (0, 1] (1 = off).
        seed: per-request seed: every random number the request uses is a function of (seed,
            position), so its draws do not depend on the batch. Its output does as far as the
            forward's rounding does: a logit computed over a batch of 3 rows may differ in the
            last bit from one over 1 row and move an inverse-CDF draw to the neighbouring token
            (batch-invariant kernels are what would remove that).
        stop: strings that end generation; the matched string is not returned.
        stop_token_ids: extra ids that end generation (besides the model's EOS).
        ignore_eos: keep generating past EOS (benchmarks).
        logit_bias: ``(token id, bias)`` pairs added to the target's logits before anything else
            (OpenAI's ``logit_bias``; bias in [-100, 100]). A dict is accepted and stored sorted.
        min_tokens: output tokens before EOS or a stop token id may be generated (vLLM's
            ``min_tokens``): they are masked out of the distribution until then, and stop
            strings are not matched before then either.
        presence_penalty / frequency_penalty: subtracted from the logit of every token the output
            holds, once / once per occurrence (OpenAI's, in [-2, 2]).
        repetition_penalty: a token the prompt or the output holds has its logit divided by it
            when positive, multiplied by it otherwise (CTRL, Keskar et al. 2019; vLLM's); 1 = off.
        structure: a grammar the output must match (``tandem.structured.Structure``: a JSON
            object, a JSON schema, a Lark grammar or a regex), or None.

    The five adjustments apply to the target's distribution at every position, including every
    verified draft position (each position sees the drafts before it as output); drafters draft
    from their own distribution, and speculative sampling makes the output the adjusted target's
    (``tandem.verify``). Order, as vLLM's: min_tokens and logit_bias, then the repetition,
    frequency and presence penalties, then temperature, top-k, top-p.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structure: "Structure | None" = None

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if name == "stop" and isinstance(value, str):
                value = (value,)
            elif isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
                raise InvalidRequestError(f"{name} must be a list, got {value!r}", param=name)
            object.__setattr__(self, name, tuple(value))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}",
                                      param="logit_bias") from None
        object.__setattr__(self, "logit_bias", bias)
        self.validate()

    def validate(self) -> None:
        """Raises InvalidRequestError naming the first bad field."""
        if (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                or not 1 <= self.max_tokens < 2**31):
            raise InvalidRequestError(f"max_tokens must be an integer in [1, 2**31), got {self.max_tokens!r}",
                                      param="max_tokens")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                      param="temperature")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise InvalidRequestError(f"top_k must be an integer in [0, 2**31) (0 = off), got {self.top_k!r}",
                                      param="top_k")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}", param="seed")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}", param="stop")
            check_utf8(s, f"stop string {i}" if len(self.stop) > 1 else "the stop string", "stop")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31:
                raise InvalidRequestError(f"stop_token_ids must be integers in [0, 2**31), got {t!r}",
                                          param="stop_token_ids")
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31:
                raise InvalidRequestError(f"logit_bias keys must be token ids in [0, 2**31), got {t!r}",
                                          param="logit_bias")
            if (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                    or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                                          f"got {b!r} for token {t}", param="logit_bias")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequestError("logit_bias names a token twice", param="logit_bias")
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                                      f"got {self.min_tokens!r}", param="min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {v!r}", param=name)
        if self.structure is not None and not isinstance(self.structure, Structure):
            raise InvalidRequestError(f"structure must be a tandem.structured.Structure, got {self.structure!r}",
                                      param="response_format")
        if self.structure is not None:
            check_utf8(self.structure.spec, "the structure's specification", self.structure.param)
        if self.structure is not None and (self.min_tokens or self.ignore_eos):
            # a complete grammar allows only EOS: holding EOS off would leave no token to emit
            name = "min_tokens" if self.min_tokens else "ignore_eos"
            raise InvalidRequestError(f"{name} cannot be combined with structured output ({self.structure.param}): "
                                      "the output ends where the grammar is complete", param=name)
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0.0 < r <= 10.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10] (1 = off), got {r!r}",
                                      param="repetition_penalty")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or below ``SAMPLING_EPS``."""
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Some logit adjustment is on (logit_bias, min_tokens or a penalty)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class LogitAdjustments:
    """Per-row logit adjustments of a batch (``SamplingParams``' logit_bias, min_tokens and
    penalties), as device tensors; rows without adjustments hold neutral values.

    Attributes:
        bias: ``[B, V]`` float32 logit_bias.
        counts: ``[B, V]`` float32, occurrences of each token in the row's output so far.
        prompt_seen: ``[B, V]`` bool, the token occurs in the row's prompt.
        suppress: ``[B, V]`` bool, the tokens masked before ``min_tokens`` (EOS and stop token ids).
        prompt_len: ``[B]`` int64 (a position minus it is the output index of the token there).
        min_tokens: ``[B]`` int64.
        presence / frequency / repetition: ``[B]`` float32 penalties (0, 0, 1 = off).
    """

    bias: torch.Tensor
    counts: torch.Tensor
    prompt_seen: torch.Tensor
    suppress: torch.Tensor
    prompt_len: torch.Tensor
    min_tokens: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor

    def rows(self, index: torch.Tensor | slice) -> "LogitAdjustments":
        """The adjustments of rows ``index``."""
        return LogitAdjustments(*(getattr(self, f)[index] for f in self.__dataclass_fields__))


def adjust_logits(logits: torch.Tensor, adj: LogitAdjustments, positions: torch.Tensor,
                  prefix: torch.Tensor | None = None, prefix_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The target's logits after ``SamplingParams``' adjustments, in vLLM's order: min_tokens (EOS
    and stop ids at -inf while the output is shorter), logit_bias, the repetition penalty (tokens
    of the prompt or output: a positive logit divided by it, a negative one multiplied), then the
    frequency and presence penalties over the output's token counts.

    Position j of a row predicts the token at sequence position ``positions + j``; the output
    before it is the row's output so far (``adj.counts``) followed by its ``prefix`` tokens at j
    (the drafts before j in a chain, the ancestors in a token tree).

    Args:
        logits: ``[B, Q, V]``.
        adj: the rows' adjustments.
        positions: ``[B]`` int64 sequence position of the token position 0 predicts (position j
            predicts ``positions + j``), or ``[B, Q]`` each position's own (token trees).
        prefix: ``[B, Q, P]`` int64 output tokens before each position beyond ``adj.counts``, or None.
        prefix_valid: ``[B, Q, P]`` bool, which of ``prefix`` count.

    Returns:
        ``[B, Q, V]`` float32.
    """
    B, Q, V = logits.shape
    x = logits.float() + adj.bias[:, None]
    if positions.dim() == 1:
        positions = positions[:, None] + torch.arange(Q, device=logits.device)[None, :]
    index = positions - adj.prompt_len[:, None]  # [B, Q] output index of the token each position predicts
    early = (index < adj.min_tokens[:, None])[..., None] & adj.suppress[:, None]
    counts = adj.counts[:, None].expand(B, Q, V)
    if prefix is not None and prefix.shape[-1]:
        counts = counts.clone().scatter_add_(-1, prefix, prefix_valid.to(torch.float32))
    present = counts > 0
    r = adj.repetition[:, None, None]
    x = torch.where(present | adj.prompt_seen[:, None], torch.where(x > 0, x / r, x * r), x)
    x = x - adj.frequency[:, None, None] * counts - adj.presence[:, None, None] * present.to(torch.float32)
    return x.masked_fill(early, float("-inf"))


def chain_prefix(draft_tokens: torch.Tensor, draft_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``adjust_logits``' prefix of chains: position j of a row sees its drafts before j.

    Args:
        draft_tokens: ``[B, K]`` int64; draft_lens: ``[B]`` int64.

    Returns:
        ``([B, K + 1, K]`` int64 tokens, ``[B, K + 1, K]`` bool valid).
    """
    B, K = draft_tokens.shape
    i = torch.arange(K, device=draft_tokens.device)
    j = torch.arange(K + 1, device=draft_tokens.device)
    valid = (i[None, None, :] < j[None, :, None]) & (i[None, None, :] < draft_lens[:, None, None])
    return draft_tokens[:, None, :].expand(B, K + 1, K), valid


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, filtered: bool = True, out: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits and return probabilities.

    A row keeps the tokens whose logit is at least its cut: the k-th largest logit (top-k; tokens
    tied with it stay), then, over that top-k distribution, the logit of the token at which the
    mass of the most likely tokens, taken in order, first reaches ``top_p`` (nucleus, Holtzman et
    al. 2020); tokens tied with the cut stay too. The most likely token always stays (a ``top_p``
    that rounds to 0 must not empty the row). On CUDA (with Triton) Triton kernels do it without
    sorting the vocabulary (``tandem.sampling_kernels.sampling_probs``: the same cut, found by
    searching the logits' bit patterns, each row in fixed chunks); elsewhere these ops (a sort).

    Args:
        logits: ``[B, V]`` (any float dtype; upcast to float32).
        temperature: ``[B]`` float, > 0 for every row (greedy rows are handled by argmax).
        top_k: ``[B]`` int64, 0 = off.
        top_p: ``[B]`` float in (0, 1] (1 = off).
        filtered: False when the caller knows no row uses top-k or top-p (every ``top_k`` 0 and
            every ``top_p`` 1): skips the cut, with the same result.
        out: ``[B, V]`` float32 to write the probabilities into, or None (a new tensor).
        rows: ``[B]`` bool, with ``out``: only these rows are written, the others keep their
            values (a drafter's q buffer, where only some rows draft), without a copy.

    Returns:
        ``[B, V]`` float32 probabilities (``out`` when given); filtered tokens have probability
        exactly 0.

    Raises:
        ValueError: ``rows`` without ``out``.
    """
    if rows is not None and out is None:
        raise ValueError("sampling_probs: rows needs out (the rows left out keep out's values)")
    if (logits.dim() == 2 and logits.shape[0] and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and round_kernels_on(logits.device) and (out is None or out.stride(-1) == 1)):
        return sampling_kernels.sampling_probs(logits, temperature, top_k, top_p, filtered, out, rows)
    probs = _sampling_probs_ops(logits, temperature, top_k, top_p, filtered)
    if out is None:
        return probs
    return torch.where(rows[:, None], probs, out, out=out) if rows is not None else out.copy_(probs)


def _sampling_probs_ops(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, filtered: bool) -> torch.Tensor:
    """``sampling_probs`` in PyTorch ops (a sort), into a new tensor."""
    logits = logits.float() / temperature[:, None]
    if not filtered:
        return logits.softmax(dim=-1)
    vocab = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    # top-k keeps the tokens tied with the k-th logit too, and top-p then runs over all of them
    remove = sorted_logits < sorted_logits.gather(-1, k[:, None] - 1)
    probs_sorted = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # nucleus: drop a token when the mass strictly before it already reaches top_p (top_p = 1 is
    # off); the removed ranks are a suffix, so the kept ones end at the cut
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    remove = remove | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (ranks > 0))
    cut = sorted_logits.gather(-1, (~remove).sum(-1, keepdim=True) - 1)  # [B, 1]: the smallest kept logit
    return logits.masked_fill(logits < cut, float("-inf")).softmax(dim=-1)


DRAFTER_SEED_OFFSET = 0x9E3779B97F4A7C15  # golden-ratio constant: the drafter's stream differs from the verifier's


def request_generator(params: SamplingParams, device: torch.device | str, drafter: bool = False
                      ) -> torch.Generator | None:
    """The one random generator of a request on ``device``: None for a greedy request; else a
    ``torch.Generator`` seeded with ``params.seed`` (from the OS when it is None). Every place that
    holds a request's generator (the engine, the drafter service) builds it here.

    A drafter (``drafter=True``) seeds with ``(seed + DRAFTER_SEED_OFFSET) mod 2**63`` instead:
    had it used the verifier's seed, its draft draws would reuse the verifier's acceptance draws
    and bias the output; the fixed offset keeps seeded requests reproducible with independent
    streams.
    """
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed((params.seed + DRAFTER_SEED_OFFSET) % 2**63 if drafter else params.seed)
    return g


# ----------------------------------------------------------------------------- counter-based random numbers

_MASK32 = 0xFFFFFFFF
SEED_BITS = 63  # seeds are integers in [0, 2**63)

# Streams of uniforms at one sequence position (each used at most once per position).
STREAM_ACCEPT = 0  # the accept test of the draft token at the position
STREAM_SAMPLE = 1  # drawing the token at the position (target-only, correction or bonus)
# drawing a device drafter's draft token for the position (SpecFormer in chained rounds). A
# position may be drafted again in a later round with another q, reusing the number: that is safe
# because a draft is only ever examined once (a rejection decides the position for good) and a
# draft that was never examined influenced nothing.
STREAM_DRAFT = 2


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), in 16-bit halves of ``c`` (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' "triple32" integer hash of int64 values in [0, 2**32) (a bijection with
    near-ideal avalanche)."""
    x = x ^ (x >> 17)
    x = _mul32(x, 0xED5AD4BB)
    x = x ^ (x >> 11)
    x = _mul32(x, 0xAC4C1B51)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x31848BAB)
    return x ^ (x >> 14)


def counter_uniform(seed: torch.Tensor, position: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) float32 numbers that depend only on (seed, position, stream).

    A counter-based generator (the idea of Philox, Salmon et al. 2011, with an integer hash as the
    mixer): the
    number a request uses at a sequence position is a pure function of its seed, so a seeded
    request draws the same numbers whatever batch it runs in, on CPU and GPU alike, and a CUDA
    graph can draw them (no generator state on the host). The numbers have 24 random bits.

    Args:
        seed: ``[B]`` int64 in ``[0, 2**63)``.
        position: ``[B, ...]`` int64 sequence positions (``>= 0``, ``< 2**32``).
        stream: which draw at that position (``STREAM_ACCEPT``, ``STREAM_SAMPLE`` or ``STREAM_DRAFT``),
            or an int64 tensor of them that broadcasts against ``position`` (several streams in one
            call: ``[S, 1]`` streams and ``[1, n]`` positions give ``[S, n]``).

    Returns:
        float32 tensor shaped like ``position`` (broadcast with ``stream``).

    On CUDA (with Triton) one stream's numbers come from one kernel launch
    (``tandem.sampling_kernels``), bit for bit these ops' (about 115 element-wise launches).
    """
    if (isinstance(stream, int) and position.dim() > 0 and position.shape[0] == seed.shape[0]
            and round_kernels_on(position.device)):
        return sampling_kernels.counter_uniform(seed, position, stream)
    shape = (-1,) + (1,) * (position.dim() - 1)
    lo = (seed & _MASK32).view(shape)
    hi = ((seed >> 32) & _MASK32).view(shape)
    key = _hash32(_hash32(lo ^ sampling_kernels.stream_key(stream)) ^ hi)  # [B, 1, ...]
    h = _hash32(key ^ (position & _MASK32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sample_inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Draw one index per row from non-negative ``weights`` (not necessarily normalised) with the
    given uniforms, by inversion of the cumulative sum: index i has probability
    ``weights[i] / weights.sum()``. An index of weight 0 is never returned (a row of all zeros
    returns its last index).

    Args:
        weights: ``[B, V]`` float32, >= 0.
        uniform: ``[B]`` float32 in [0, 1).

    Returns:
        ``[B]`` int64.

    On CUDA (with Triton) two kernel launches do it (``tandem.sampling_kernels``: the same rule
    over sums taken in another order, so a draw within rounding of a boundary may land on the
    neighbouring index).
    """
    if weights.dim() == 2 and weights.shape[0] and round_kernels_on(weights.device):
        return sampling_kernels.sample_inverse_cdf(weights, uniform)
    cdf = weights.cumsum(-1)
    x = (uniform * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, x, right=True).clamp_(max=weights.shape[-1] - 1)
    # float rounding can land past the last positive weight: take the last positive index then
    last_positive = weights.shape[-1] - 1 - (weights > 0).flip(-1).to(torch.int8).argmax(-1, keepdim=True)
    ok = weights.gather(-1, idx) > 0
    return torch.where(ok, idx, last_positive)[:, 0]


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request for several choices (OpenAI's ``n``) with ``seed``:
    choice 0 keeps it (so ``n = 1`` and the first of ``n`` agree), choice i > 0 takes
    splitmix64(seed + i) mod 2**63, a stream independent of its neighbours' (``seed + i`` alone
    would give choice i of one request the output of choice 0 of a request seeded ``seed + i``).

    Raises:
        ValueError: ``index`` < 0.
    """
    if index < 0:
        raise ValueError(f"choice index must be >= 0, got {index}")
    if index == 0:
        return seed
    mask = (1 << 64) - 1
    z = (seed + index + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) % 2**SEED_BITS


def new_seed() -> int:
    """A fresh seed in ``[0, 2**63)`` from the OS (for requests that give none)."""
    import secrets

    return secrets.randbits(SEED_BITS)
