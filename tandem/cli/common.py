"""What every ``tandem`` command shares: the consoles, one-line errors, the common options, the
mapping of the drafter options to a ``SpeculativeConfig``, and the engine a command runs on."""

from __future__ import annotations

import logging
import math
import sys
import time

import click
from rich.console import Console
from rich.markup import escape
from tqdm import tqdm

from ..admission import ADMISSION_DEFAULTS
from ..control import parse_acceptance_threshold
from ..errors import ConfigError, InvalidRequestError
from ..metrics import SpecDecodeStats
from ..models.runner import KERNEL_CHOICES
from ..speculation import TARGET_ONLY, SpeculativeConfig

log = logging.getLogger("tandem")
# not a terminal (a log, a pipe): wide enough for the bench's tables, whose cells are never cut
console = Console(width=None if sys.stdout.isatty() else 400)
err_console = Console(stderr=True)

DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def init_tracing() -> None:
    """Tracing for in-process commands: spans go where ``OTEL_*`` / ``TANDEM_TRACE_FILE`` say (read
    with ``tandem trace-report``); with neither set no provider is installed and nothing is
    recorded. A bad setting is an InvalidRequestError (one line), not a traceback."""
    from ..telemetry import init_tracing as init, tracing_configured

    try:
        if tracing_configured():
            init("tandem")
    except (RuntimeError, OSError) as exc:
        raise InvalidRequestError(f"tracing settings: {exc}") from None


def command_line() -> str:
    """This invocation as a user would type it (``tandem ...``, not the interpreter's script path)."""
    return " ".join(["tandem", *sys.argv[1:]])


def fail(msg: str) -> None:
    """Print a one-line error to stderr and exit 2."""
    err_console.print(f"[red]error:[/red] {escape(msg)}", highlight=False, soft_wrap=True)
    sys.exit(2)


def finite(ctx: click.Context, param, value: float | None) -> float | None:
    """Option callback: NaN and infinities pass ``click.FloatRange``'s bounds; refuse them here."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}", ctx=ctx, param=param)
    return value


def host_port(ctx: click.Context, param, value):
    """Option callback: each address (one, or a tuple of a repeatable option) is ``HOST:PORT`` with
    a port in 1..65535, so a typo fails at once instead of after a connection deadline."""
    for v in value if isinstance(value, tuple) else (value,):
        if v is None:
            continue
        host, sep, port = v.rpartition(":")
        if not sep or not host or "/" in host or not port.isdigit() or not 1 <= int(port) <= 65535:  # no scheme
            raise click.BadParameter(f"expected HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:50051), got {v!r}",
                                     ctx=ctx, param=param)
    return value


def out_dir(path: str, flag: str = "--out") -> None:
    """Make the output directory ``path`` (and its parents) before any work starts, so a path that
    cannot be written fails in a line instead of after a long run."""
    import os
    from pathlib import Path

    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot write {flag} {path}: {exc.strerror or exc}")
    if not os.access(p, os.W_OK | os.X_OK):
        fail(f"cannot write {flag} {path}: permission denied")


def fmt(x: float, spec: str) -> str:
    """``format(x, spec)``, or "-" for NaN (an undefined rate)."""
    return "-" if x != x else format(x, spec)


def _unescape(s: str) -> str:
    """Turn the escapes a shell passes literally (\\n, \\t, \\r, \\\\) into characters."""
    out, i = [], 0
    table = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s) and s[i + 1] in table:
            out.append(table[s[i + 1]])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def torch_dtype(dtype: str):
    """``--dtype`` as a torch dtype (None for auto: bfloat16 on GPU, float32 on CPU)."""
    import torch

    return getattr(torch, DTYPES[dtype]) if DTYPES[dtype] else None


# ----------------------------------------------------------------------------- options

model_option = click.option("--model", "model", default=None, metavar="PATH",
                            help="GGUF file or Hugging Face checkpoint directory (default: bundled SmolLM2-135M-Instruct).")
device_option = click.option("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available).")
dtype_option = click.option("--dtype", type=click.Choice(list(DTYPES)), default="auto", show_default=True,
                            help="auto = bfloat16 on GPU, float32 on CPU.")
kernels_option = click.option(
    "--kernels", type=click.Choice(list(KERNEL_CHOICES)), default="auto", show_default=True,
    help="Decode/verify kernels: fused (Triton, our GQA-packed attention, batch-invariant; GPU) or reference "
         "(PyTorch ops, masked SDPA); auto = fused where it can run; fused-flash = fused with flash-attn's "
         "attention; fused-heuristic = fused-flash with flash-attn's batch-dependent split-KV choice (measures "
         "what invariance costs); fused-linear = fused with the projections fused with their neighbours (five "
         "kernels a layer; prefills in fixed tiles too).")



def graph_options(fn):
    """``--cuda-graphs``, ``--compile``, ``--prefill-graphs`` and ``--prefill-varlen`` (runner settings;
    None = the device's default)."""
    fn = click.option("--prefill-varlen/--no-prefill-varlen", default=None,
                      help="Prefills of new requests packed end to end (flash-attn's variable-length attention), "
                           "no padding between prompts; off: padded to (rows, positions) buckets. Default: on "
                           "where it can run on a GPU (flash-attn, the fused kernels, bf16/fp16) with a batch "
                           "size above 1, off elsewhere; asked for where it cannot run, an error says why. A "
                           "CPU runs it with a reference attention.")(fn)
    fn = click.option("--prefill-graphs/--no-prefill-graphs", default=None,
                      help="Prefills from CUDA graphs, one per (rows, positions) bucket; off: eager prefills. "
                           "Default: as --cuda-graphs.")(fn)
    fn = click.option("--compile/--no-compile", "compile_", default=None, help="Default: on for CUDA.")(fn)
    return click.option("--cuda-graphs/--no-cuda-graphs", default=None, help="Default: on for CUDA.")(fn)


TAU_DEPRECATED = "--tau is deprecated (τ is the mean accepted length); use --acceptance-threshold"


def _deprecated_tau(ctx: click.Context, param, value: str | None) -> None:
    """``--tau`` (hidden, deprecated): warns on stderr and hands its value to
    ``--acceptance-threshold``, which reads it from ``ctx.meta`` (this option is eager, so it is
    parsed first)."""
    if value is not None:
        click.echo(f"warning: {TAU_DEPRECATED}", err=True)
        ctx.meta["deprecated_tau"] = value


def _check_acceptance_threshold(ctx: click.Context, param, value: str) -> str:
    """--acceptance-threshold (or the deprecated --tau) checked when the command line is parsed,
    before any model loads.

    Raises:
        click.BadParameter: not a number in [0, 1] nor auto, or both options given.
    """
    tau = ctx.meta.get("deprecated_tau")
    if tau is not None:
        if ctx.get_parameter_source(param.name) is not click.core.ParameterSource.DEFAULT:
            raise click.BadParameter("give --acceptance-threshold only (--tau is its deprecated name)",
                                     param_hint="'--acceptance-threshold'")
        value = tau
    try:
        parse_acceptance_threshold(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix("--acceptance-threshold "),
                                 param_hint="'--acceptance-threshold'") from None
    return value


drafter_options = [
    click.option("--drafter", type=click.Choice(["none", "ngram", "draft-model", "specformer"]), default="none",
                 show_default=True, help="Speculative decoding drafter (none = target-only decoding)."),
    click.option("--draft-model", default=None, metavar="PATH|truncate:N",
                 help="Draft model for --drafter draft-model: a distilled draft (tandem train draft-model), a GGUF / "
                      "HF directory sharing the target's tokenizer, or truncate:N (the target's first N layers). "
                      "Default with the bundled target: the shipped distilled draft model. For --drafter "
                      "specformer: a head directory (default: the shipped head; generate also takes --specformer)."),
    click.option("--num-draft-tokens", type=click.IntRange(min=1, max=16), default=4, show_default=True,
                 help="Draft tokens per sequence per round (k)."),
    click.option("--predictor", default=None, metavar="PATH|auto",
                 help="Context-aware drafting: acceptance predictor (.safetensors from tandem train predictor), or "
                      "auto = the predictor saved next to the drafter's weights; draft lengths follow it under --acceptance-threshold."),
    click.option("--acceptance-threshold", default="auto", show_default=True, callback=_check_acceptance_threshold,
                 help="Threshold on predicted acceptance probability: a number in [0, 1], or auto (learned "
                      "online)."),
    click.option("--tau", default=None, hidden=True, is_eager=True, expose_value=False, callback=_deprecated_tau,
                 help="Deprecated name of --acceptance-threshold."),
    click.option("--branch-top-m", type=click.IntRange(min=0, max=8), default=0, show_default=True,
                 help="Hard-position enhancement: verify the top-m candidates where the acceptance threshold cuts a draft "
                 "(draft-model, specformer: the most likely tokens; ngram: the other continuations of the context)."),
]


policy_option = click.option(
    "--policy", type=click.Choice(["fixed", "entropy", "predictor", "batch-width"]), default=None,
    help="Draft lengths: fixed k; entropy or predictor (a threshold on exp(-entropy) or on the learned "
         "acceptance predictor, allocated across the batch under the verifier cost model); batch-width (one "
         "width a round from the batch size, the cost model and the acceptance per position so far; nothing "
         "scored). Default: predictor with --predictor, else fixed.")


admission_options = [
    click.option("--admission-share", type=click.FloatRange(0.0, 1.0), default=ADMISSION_DEFAULTS[0], show_default=True,
                 callback=finite,
                 help="Continuous batching: waiting requests join a running batch once this share of its slots "
                      "is free or all of them fit (0: at every free slot), or sooner when the slot-rounds left "
                      "idle outweigh a prefill's cost; a larger share means fewer, larger prefills."),
    click.option("--admission-wait-rounds", type=click.IntRange(min=0), default=ADMISSION_DEFAULTS[1], show_default=True,
                 help="Admit anyway once a free slot has waited this many decode rounds for a waiting request "
                      "(a bound on the time to first token beyond queueing)."),
    click.option("--admission-overlap/--no-admission-overlap", default=ADMISSION_DEFAULTS[2], show_default=True,
                 help="Run an admission's prefill on a second CUDA stream beside the running requests' rounds "
                      "(only with CUDA graphs and the varlen prefill; elsewhere it has no effect); the admitted "
                      "requests join the first round after it. Off by default: measured on an H100 at batch 64, "
                      "overlapping gained 1-2% in one run and lost 6-13% in another (docs/benchmarks.md); off, a "
                      "prefill stops the rounds until done."),
    click.option("--admission-intake-ms", type=click.FloatRange(0.0, 1000.0), default=1e3 * ADMISSION_DEFAULTS[3],
                 show_default=True, callback=finite,
                 help="Hold admission back while requests keep arriving (the newest came less than this many "
                      "ms ago) and slots stay free, at most 4 windows after the oldest waiting one's arrival: a "
                      "burst forwarded one request at a time (a router in front of a replica) fills the batch in "
                      "a few prefills, not one small prefill a round; a lone request waits this much longer for "
                      "its first token. 0: off."),
]


sampling_options = [
    click.option("--temperature", type=click.FloatRange(min=0, max=2), default=0.0, show_default=True,
                 callback=finite, help="[0, 2] (OpenAI's); 0 = greedy."),
    click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True,
                 callback=finite, help="Nucleus sampling: the most likely tokens holding this much probability "
                                       "mass; 1 = off. Sampled decoding only."),
    click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
                 help="The k most likely tokens; 0 = off. Sampled decoding only."),
    click.option("--seed", type=int, default=None,
                 help="Per-request seed: every random number a request uses is a function of (seed, position). "
                      "Sampled decoding only."),
]


def with_sampling_options(fn):
    """Add ``sampling_options`` (``SamplingParams``' temperature, top_p, top_k, seed)."""
    for opt in reversed(sampling_options):
        fn = opt(fn)
    return fn


def with_admission_options(fn):
    """Add ``admission_options`` (``tandem.admission.AdmissionPolicy``'s share, wait_rounds, overlap,
    intake window)."""
    for opt in reversed(admission_options):
        fn = opt(fn)
    return fn


def with_drafter_options(fn):
    """Add ``drafter_options`` to a command (read them with ``speculative_config``)."""
    for opt in reversed(drafter_options):
        fn = opt(fn)
    return fn


def speculative_config(drafter: str = "none", draft_model: str | None = None, num_draft_tokens: int = 4,
                       predictor: str | None = None, acceptance_threshold: str = "auto", branch_top_m: int = 0,
                       policy: str | None = None) -> SpeculativeConfig:
    """The drafter options (``with_drafter_options``, ``policy_option``) as a ``SpeculativeConfig``:
    ``policy`` as given, else "predictor" with a predictor (θ online unless
    ``--acceptance-threshold``) and "fixed" without.

    Raises:
        ConfigError: options that do not go together (``SpeculativeConfig``).
    """
    if policy is None:
        policy = "predictor" if predictor is not None else "fixed"
    return SpeculativeConfig(drafter, draft_model=draft_model, num_draft_tokens=num_draft_tokens, policy=policy,
                             predictor=predictor, acceptance_threshold=acceptance_threshold, branch_top_m=branch_top_m)


# ----------------------------------------------------------------------------- engines


def _engine(model, device, max_batch_size, max_seq_len, spec: SpeculativeConfig = TARGET_ONLY, cuda_graphs=None,
            compile_=None, dtype="auto", num_requests=None, verification_sink=None, kernels="auto"):
    """The engine a command runs on: the runner settings from the options, then
    ``tandem.speculation.build_engine``. Without ``max_batch_size`` the KV cache gets the
    device's default slots, or ``num_requests`` when fewer requests will ever run. A k above the
    drafter's own limit is noted on stderr (the engine caps it).

    Raises:
        ModelLoadError / InvalidRequestError / ConfigError.
    """
    from dataclasses import replace

    from ..models.runner import default_runner_config
    from ..models.weights import load_checkpoint
    from ..speculation import build_engine

    init_tracing()
    cfg = default_runner_config(device, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                cuda_graphs=cuda_graphs, compile=compile_, dtype=torch_dtype(dtype), kernels=kernels)
    if max_batch_size is None and num_requests:
        cfg = replace(cfg, max_batch_size=max(1, min(cfg.max_batch_size, num_requests)))
    checkpoint = load_checkpoint(model)
    engine = build_engine(spec, checkpoint, cfg, verification_sink=verification_sink, on_measure=lambda: err_console.print(
        "note: measuring the verifier's step cost T(b, q) for the draft policy's allocation (once at start-up; "
        "up to a minute or more on a CPU)", highlight=False, soft_wrap=True))
    if engine.drafter is not None and engine.draft_limit < spec.num_draft_tokens:
        err_console.print(f"note: this {engine.drafter.name} drafter drafts {engine.draft_limit} tokens a round "
                          f"(l_d); --num-draft-tokens {spec.num_draft_tokens} is capped to {engine.draft_limit}",
                          highlight=False, soft_wrap=True)
    return engine


def _run_file(engine, records, params, chat: bool, desc: str = "generating"):
    """Run every record through the engine with a progress bar; returns (completions, wall s)."""
    engine.stats = SpecDecodeStats()
    # (disable=None: a bar only on a terminal; on a redirected stderr its \r-rewrites stay as text)
    with tqdm(total=len(records), desc=desc, unit="prompt", file=sys.stderr, disable=None) as bar:
        t0 = time.perf_counter()
        try:
            results = engine.generate([r.text for r in records], params, chat=chat, on_finish=lambda c: bar.update())
        except InvalidRequestError as exc:
            bar.leave = False  # erase the bar: the error is the line left
            bar.close()
            fail(str(exc))
        wall = time.perf_counter() - t0
    return results, wall
