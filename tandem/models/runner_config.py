"""How a ``ModelRunner`` is built (``RunnerConfig``) and what its settings resolve to on this
machine: the decode/verify kernels (``resolve_kernels``), the split-KV chunk of our attention
(``resolve_attention_chunk``), both checked before any weight is placed (``check_runner_config``),
and the defaults for a device (``default_runner_config``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError
from .attention import ATTN_BLOCK_N, attention_backend_for, attention_name, flash_available, varlen_available
from .config import ModelConfig
from .fused_linear import unsupported_reason as linear_unsupported_reason
from .kernels import fused_unavailable_reason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    """How the runner is built.

    Attributes:
        device: "cpu", "cuda", "cuda:1", ...
        dtype: float32 on CPU, bfloat16 on GPU by default.
        max_batch_size: KV cache slots.
        max_seq_len: tokens per slot (prompt + output), the context limit.
        cuda_graphs: capture decode steps into CUDA graphs (CUDA only).
        fixed_step_tokens: exact kernels (``tandem bench --exact-kernels``); 0 = off. When > 0,
            every ``step`` runs all ``max_batch_size`` cache slots as rows with exactly this many
            tokens per row (real tokens first, padding ignored; a longer row widens that step)
            and attends over context + this many positions whatever the real token count, and
            the engine prefills one prompt per forward. Why: in bf16 on a GPU the GEMM kernel
            (tiling, split-K) is chosen by the shape, and different kernels round differently, so
            target-only decoding ([b, 1] per step) and verification ([b, k + 1]) can flip a
            near-tied argmax and disagree although both are exact greedy decoding. With one
            decode shape and per-prompt prefill, every token's logits come out of the same
            kernels in both modes, so greedy speculative output is identical token for token.
            Costs speed (every step verifies k + 1 positions of every slot); on CPU float32 it
            changes nothing but the time.
        compile: ``torch.compile`` the batch-1 decode graph (CUDA only; falls back to the
            uncompiled forward if compilation fails).
        prefill_chunk: prompt positions per eager prefill forward (the static path takes a whole
            prompt in one forward, bounded by its bucket's rows x positions).
        prefill_tokens: padded tokens (rows x positions) per prefill forward; bounds activation
            and attention-mask memory while letting many short prompts share one forward.
        prefill_graphs: run prefills of fresh slots from CUDA graphs, one per (rows, positions)
            bucket, positions up to the context (``tandem.models.prefill``; dense K/V buffers of
            the largest bucket, 2 x ``prefill_tokens`` positions, are kept for them); None = the
            same as ``cuda_graphs``. Without ``cuda_graphs`` the same padded path runs eagerly.
        prefill_varlen: prefills of fresh slots packed end to end, no padding between prompts,
            through flash-attn's variable-length attention (``tandem.models.prefill``, varlen).
            None (default): on for a runner of more than one slot wherever it can run on a GPU
            (flash-attn's varlen kernel, the fused kernels, bf16 or fp16), off on a CPU and for one
            slot (``resolve_prefill_varlen``); True where it cannot run is a ConfigError
            (``check_runner_config``); on a CPU, True runs the same path with a reference
            attention (tests).
        taps: residual-stream depths whose hidden states every forward also returns (for a
            SpecFormer drafter; see ``Transformer.forward_hidden``); empty = none.
        kernels: "auto" (the fused decode/verify kernels of ``tandem.models.kernels`` wherever
            they can run: CUDA with Triton, a head size of 64 or 128, no QK-norm), "fused" (the same,
            or a ConfigError saying why not), "fused-flash" (the fused kernels with flash-attn's
            attention for decode and verify instead of our GQA-packed one; needs flash-attn),
            "fused-heuristic" ("fused-flash" with flash-attn's own split-KV heuristic, which depends
            on the batch size: not batch-invariant, so greedy speculative output may differ from
            target-only; it exists to measure what invariance costs), "fused-linear" ("fused" with
            the four projections of a decode or verify step fused with their neighbours, five
            kernels a layer: ``tandem.models.fused_linear``), "reference" (plain PyTorch
            ops with a masked SDPA, the path a CPU always takes). Token trees take the fused path
            too (tree bits in our attention kernel, whatever the attention backend); a prefill
            takes the fused one (flash-attn's attention where it is importable) when every row has
            room for its attention span. The fused path replaces ``compile`` (which is then
            ignored).
        attention_chunk: 0, or split-KV for our decode/verify attention over fixed chunks of this
            many cache positions (a multiple of 64; ``attention.gqa_attention``): more programs for
            few rows or long contexts, still batch- and width-invariant. Fused paths only. None
            (default): ``default_attention_chunk(max_batch_size)`` where our attention kernel
            runs (128 positions up to 4 slots, else 256), else 0 (``resolve_attention_chunk``).
    """

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_batch_size: int = 8
    max_seq_len: int = 2048
    cuda_graphs: bool = False
    fixed_step_tokens: int = 0
    compile: bool = False
    prefill_chunk: int = 1024
    prefill_tokens: int = 8192
    prefill_graphs: bool | None = None
    prefill_varlen: bool | None = None
    taps: tuple[int, ...] = ()
    kernels: str = "auto"
    attention_chunk: int | None = None


KERNEL_CHOICES = ("auto", "fused", "fused-flash", "fused-heuristic", "fused-linear", "reference")


def resolve_kernels(config: RunnerConfig, model: ModelConfig) -> str:
    """The decode/verify path ``config.kernels`` gives for ``model`` here: "fused", "fused-flash",
    "fused-heuristic", "fused-linear" or "reference".

    Raises:
        ConfigError: an unknown choice, or a fused choice where the fused path cannot run (the
            message says why: no CUDA, no triton, dtype, head size, QK-norm; no flash-attn for
            the flash choices).
    """
    choice = config.kernels
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice == "reference":
        return "reference"
    device = torch.device(config.device)
    if choice == "auto" and device.type != "cuda":  # a CPU runs the kernels only when asked (the interpreter)
        return "reference"
    reason = "QK-norm models" if model.qk_norm else fused_unavailable_reason(device, model.head_dim, config.dtype)
    if reason is not None and choice.startswith("fused"):
        raise ConfigError(f"the fused kernels cannot run here: {reason}")
    if reason is not None and device.type == "cuda":
        log.warning("decode kernels: reference PyTorch path (%s)", reason)
    if reason is not None:
        return "reference"
    if choice == "fused-linear":
        why = linear_unsupported_reason(model.hidden_size, model.intermediate_size, model.head_dim)
        if why is not None:
            raise ConfigError(f"kernels=fused-linear cannot run this model: {why}")
    if choice in ("fused-flash", "fused-heuristic") and not flash_available(model.head_dim):
        raise ConfigError(f"kernels={choice} needs flash-attn built for head dim {model.head_dim} "
                          "(pip install 'tandem[flash-attn]' on a GPU machine)")
    return "fused" if choice == "auto" else choice


# Split-KV chunk of our attention kernel by default. Measured on an H200 (2026-12-06,
# docs/benchmarks.md), against the unsplit kernel in one lease: target-only +18% at batch 64 and
# +14% at 128, n-gram and SpecFormer +7-9% there, and -2% / -3% / 0% at batch 1. A runner of at
# most SMALL_BATCH slots takes SMALL_BATCH_ATTENTION_CHUNK instead: measured on an H100 (2026-12-07),
# chunks of 128 against 256 at batch 1 gave target-only +4% (a layer's attention 6.3 -> 5.1 µs: more,
# shorter programs for one row) and cost target-only 3-5% at batch 64. The chunk is the runner's,
# fixed by its slot count, never by a step's batch or width, so a row's reduction order is the same
# in every step a runner takes (target-only and speculative engines of one size alike).
DEFAULT_ATTENTION_CHUNK = 256
SMALL_BATCH = 4
SMALL_BATCH_ATTENTION_CHUNK = 128


def default_attention_chunk(max_batch_size: int) -> int:
    """The split-KV chunk of our attention kernel for a runner of ``max_batch_size`` slots when
    none is configured: ``SMALL_BATCH_ATTENTION_CHUNK`` up to ``SMALL_BATCH`` slots, else
    ``DEFAULT_ATTENTION_CHUNK``."""
    return SMALL_BATCH_ATTENTION_CHUNK if max_batch_size <= SMALL_BATCH else DEFAULT_ATTENTION_CHUNK


def resolve_attention_chunk(config: RunnerConfig, kernels: str) -> int:
    """The split-KV chunk a runner of ``config`` uses on the resolved ``kernels`` path: the
    configured one, or for None ``default_attention_chunk(config.max_batch_size)`` where our
    attention kernel runs (fused, fused-linear) and 0 elsewhere."""
    if config.attention_chunk is not None:
        return config.attention_chunk
    if kernels == "reference" or attention_backend_for(kernels) != "triton":
        return 0
    return default_attention_chunk(config.max_batch_size)


def check_runner_config(config: RunnerConfig, model: ModelConfig) -> str:
    """The kernel settings of ``config`` checked for ``model`` here, before any weight is placed:
    ``resolve_kernels``'s path, and an ``attention_chunk`` that the path uses.

    Raises:
        ConfigError: as ``resolve_kernels``; ``prefill_varlen`` where it cannot run
            (``varlen_unavailable_reason``); an ``attention_chunk`` that is not a multiple of
            ``ATTN_BLOCK_N``, or one set where our attention kernel does not run (the reference
            path, flash-attn's attention).
    """
    kernels = resolve_kernels(config, model)
    why = varlen_unavailable_reason(config, model) if config.prefill_varlen is True else None
    if why is not None:
        raise ConfigError(f"--prefill-varlen cannot run here: {why}")
    if config.attention_chunk is None:
        return kernels
    chunk = config.attention_chunk
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0 or chunk % ATTN_BLOCK_N:
        raise ConfigError(f"--attention-chunk must be 0 or a positive multiple of {ATTN_BLOCK_N}, got {chunk!r}")
    if chunk and (kernels == "reference" or attention_backend_for(kernels) != "triton"):
        raise ConfigError(f"--attention-chunk applies to our attention kernel (kernels fused or fused-linear, on a "
                          f"CUDA GPU); this runner's decode attention is {attention_name(kernels)}")
    return kernels


def default_runner_config(device: str | None = None, **overrides) -> RunnerConfig:
    """CUDA with bf16, graphs and compile when a GPU is present; else CPU float32 eager.

    Raises:
        ConfigError: an unknown device, CUDA on a machine without it, or CUDA graphs, compile or
            prefill graphs asked for on a CPU.
    """
    from ..errors import ConfigError

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {device!r}; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"device {device!r} is not available here (torch {torch.__version__}, "
                          f"{torch.cuda.device_count()} CUDA devices)")
    on_gpu = dev.type == "cuda"
    asked = [flag for flag, key in (("--cuda-graphs", "cuda_graphs"), ("--compile", "compile"),
                                    ("--prefill-graphs", "prefill_graphs")) if overrides.get(key)]
    if asked and not on_gpu:
        named = " and ".join([", ".join(asked[:-1]), asked[-1]] if len(asked) > 1 else asked)
        raise ConfigError(f"{named} need{'s' if len(asked) == 1 else ''} a CUDA device; the device is {device}")
    base = dict(device=device, dtype=torch.bfloat16 if on_gpu else torch.float32,
                max_batch_size=64 if on_gpu else 8, cuda_graphs=on_gpu, compile=on_gpu)
    base.update({k: v for k, v in overrides.items() if v is not None})
    return RunnerConfig(**base)


def resolve_prefill_varlen(config: RunnerConfig, model: ModelConfig) -> bool:
    """Whether a runner of ``config`` packs its prefills end to end: ``config.prefill_varlen``
    when set; for None, on a CUDA device where ``varlen_unavailable_reason`` finds nothing against
    it and the runner has more than one slot, else off.

    Measured on an H100 (docs/benchmarks.md, "Varlen prefill by default"), side by side at batch 64
    over 256 prompts: an admission's GPU window 5.9 ms against 8.9 (target-only) and 8.5 against
    10.9 (SpecFormer), 3% and 5% more tok/s, every output identical. With one slot every
    admission is one prompt, which the padded buckets hold with little waste: there packing gained
    nothing (2.4 against 2.5 ms of GPU a target prefill, 5.9 against 5.4 with a SpecFormer head,
    in two calls of one day), so a one-slot runner keeps the padded path. The choice is per runner,
    never per admission: a prompt's cache never depends on what it was admitted with."""
    if config.prefill_varlen is not None:
        return config.prefill_varlen
    return (torch.device(config.device).type == "cuda" and config.max_batch_size > 1
            and varlen_unavailable_reason(config, model) is None)


def varlen_batch_sizes(config: RunnerConfig, model: ModelConfig, sizes: list[int]) -> list[int]:
    """The batch sizes among ``sizes`` whose runners (``config`` with that ``max_batch_size``)
    pack their prefills (``resolve_prefill_varlen``)."""
    return [b for b in sizes if resolve_prefill_varlen(replace(config, max_batch_size=b), model)]


def varlen_unavailable_reason(config: RunnerConfig, model: ModelConfig) -> str | None:
    """Why the varlen prefill cannot run on ``config``'s GPU for ``model`` (None: it can, or the
    device is a CPU, where it runs with the reference attention)."""
    if torch.device(config.device).type != "cuda":
        return None
    if config.dtype not in (torch.bfloat16, torch.float16):
        return f"flash-attn runs in bf16 or fp16, not {str(config.dtype).removeprefix('torch.')}"
    if resolve_kernels(config, model) == "reference":
        return "the reference kernels (the varlen forward is the fused kernels')"
    if not varlen_available(model.head_dim):
        return f"no flash-attn variable-length kernel for head size {model.head_dim} here (pip install tandem[flash-attn])"
    return None
