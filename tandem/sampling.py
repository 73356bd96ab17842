"""Sampling parameters and the logits -> probabilities transform (one source of truth).

The same ``sampling_probs`` transform is applied to the target's and the drafter's logits in
speculative sampling, so the verified distribution is exactly target-only sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError


SAMPLING_EPS = 1e-5  # temperatures below this decode greedily


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
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
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
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}", param="stop")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31:
                raise InvalidRequestError(f"stop_token_ids must be integers in [0, 2**31), got {t!r}",
                                          param="stop_token_ids")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or below ``SAMPLING_EPS``."""
        return self.temperature < SAMPLING_EPS


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits and return probabilities.

    Args:
        logits: ``[B, V]`` float32.
        temperature: ``[B]`` float, > 0 for every row (greedy rows are handled by argmax).
        top_k: ``[B]`` int64, 0 = off.
        top_p: ``[B]`` float in (0, 1].
        filtered: False when the caller knows no row uses top-k or top-p (every ``top_k`` 0 and
            every ``top_p`` 1): skips the sort, with the same result.

    Returns:
        ``[B, V]`` float32 probabilities; filtered tokens have probability exactly 0.
    """
    logits = logits.float() / temperature[:, None]
    if not filtered:
        return logits.softmax(dim=-1)
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= k[:, None]
    probs_sorted = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # nucleus: drop a token when the mass strictly before it already reaches top_p; the most likely
    # token always stays (a top_p that rounds to 0 in float32 must not empty the row)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    remove = remove | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (ranks > 0))  # top_p = 1 is off
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits.softmax(dim=-1))
    return probs


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
    """
    shape = (-1,) + (1,) * (position.dim() - 1)
    lo = (seed & _MASK32).view(shape)
    hi = ((seed >> 32) & _MASK32).view(shape)
    key = _hash32(_hash32(lo ^ ((stream * 0x9E3779B9 + 0x7F4A7C15) & _MASK32)) ^ hi)  # [B, 1, ...]
    h = _hash32(key ^ (position & _MASK32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sample_inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Draw one index per row from non-negative ``weights`` (not necessarily normalised) with the
    given uniforms, by inversion of the cumulative sum: index i has probability
    ``weights[i] / weights.sum()``. An index of weight 0 is never returned (rows of all zeros
    return index 0).

    Args:
        weights: ``[B, V]`` float32, >= 0.
        uniform: ``[B]`` float32 in [0, 1).

    Returns:
        ``[B]`` int64.
    """
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
