"""Command line: ``tandem generate``, ``tandem info``, ``tandem bench``."""

from __future__ import annotations

import logging
import statistics
import sys
import time

import click
from rich.console import Console
from rich.table import Table

log = logging.getLogger("tandem")
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _init_tracing() -> None:
    """Tracing for in-process commands: spans go where ``OTEL_*`` / ``TANDEM_TRACE_FILE`` say (read
    with ``tandem trace-report``); with neither set no provider is installed and nothing is
    recorded. A bad setting is an InvalidRequestError (one line), not a traceback."""
    from .errors import InvalidRequestError
    from .telemetry import init_tracing, tracing_configured

    try:
        if tracing_configured():
            init_tracing("tandem")
    except (RuntimeError, OSError) as exc:
        raise InvalidRequestError(f"tracing settings: {exc}") from None


def _command_line() -> str:
    """This invocation as a user would type it (``tandem ...``, not the interpreter's script path)."""
    return " ".join(["tandem", *sys.argv[1:]])


def _fail(msg: str) -> None:
    """Print a one-line error to stderr and exit 2."""
    from rich.markup import escape

    err_console.print(f"[red]error:[/red] {escape(msg)}", highlight=False, soft_wrap=True)
    sys.exit(2)


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


class _Group(click.Group):
    """Turns the errors a user can cause into one-line messages (exit 2) instead of tracebacks."""

    def invoke(self, ctx):
        from .errors import ConfigError, InvalidRequestError
        from .models.config import ModelLoadError
        from .target import TargetUnavailable

        try:
            return super().invoke(ctx)
        except (InvalidRequestError, ModelLoadError, ConfigError, TargetUnavailable) as exc:
            _fail(str(exc))
        except OSError as exc:  # e.g. a port already in use, an unreadable file
            _fail(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError (CUDA) or the CPU allocator
            text = str(exc)
            if not isinstance(exc, MemoryError) and "out of memory" not in text and "allocate memory" not in text:
                raise
            first = next((line for line in text.splitlines() if line.strip()), type(exc).__name__)
            _fail(f"out of memory: {first.strip()[:300]} (lower the batch size or the work of one call)")


def _engine(model, device, max_batch_size, max_seq_len, cuda_graphs=None, compile_=None, dtype="auto",
            drafter="none", draft_model=None, num_draft_tokens=4, predictor=None, tau="auto", branch_top_m=0,
            num_requests=None):
    """Build an Engine (and its drafter) from CLI options; without ``max_batch_size`` the KV cache
    gets the device's default slots, or ``num_requests`` when fewer requests will ever run.
    Raises ModelLoadError / InvalidRequestError / ConfigError."""
    from dataclasses import replace

    import torch

    from .control import make_draft_policy
    from .drafters.factory import build_drafter
    from .engine import Engine
    from .errors import InvalidRequestError
    from .models.runner import default_runner_config
    from .models.weights import load_checkpoint

    _init_tracing()
    cfg = default_runner_config(device, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                cuda_graphs=cuda_graphs, compile=compile_,
                                dtype=getattr(torch, DTYPES[dtype]) if DTYPES[dtype] else None)
    if max_batch_size is None and num_requests:
        cfg = replace(cfg, max_batch_size=max(1, min(cfg.max_batch_size, num_requests)))
    checkpoint = load_checkpoint(model)
    if draft_model and drafter not in ("draft-model", "specformer"):
        raise InvalidRequestError("--draft-model needs --drafter draft-model or specformer")
    draft = build_drafter(drafter, draft_model, checkpoint, cfg)
    slots = draft.max_draft_tokens if draft is not None else None
    if slots is not None and num_draft_tokens > slots:
        err_console.print(f"note: this {draft.name} drafter drafts {slots} tokens a round (l_d); "
                          f"--num-draft-tokens {num_draft_tokens} is capped to {slots}", highlight=False,
                          soft_wrap=True)
        num_draft_tokens = slots
    if predictor == "auto":  # the predictor trained for this drafter, saved next to its weights
        from .drafters.factory import PREDICTOR_FILE, drafter_predictor

        if drafter not in ("draft-model", "specformer"):
            raise InvalidRequestError("--predictor auto needs a trained drafter (--drafter draft-model or specformer)")
        predictor = drafter_predictor(drafter, draft_model, checkpoint)
        if predictor is None:
            raise InvalidRequestError(f"--predictor auto: no {PREDICTOR_FILE} next to the {drafter} drafter's weights")
    policy = make_draft_policy(predictor, tau, branch_top_m)
    if policy is not None and draft is None:
        raise InvalidRequestError("--predictor needs a --drafter")
    engine = Engine(checkpoint, cfg, drafter=draft, num_draft_tokens=num_draft_tokens, draft_policy=policy)
    if policy is not None:  # the verifier cost model T(b, q), measured at start-up, drives the batch allocation
        from .control import CostModel

        sizes = sorted({1, cfg.max_batch_size})
        policy.cost = CostModel.measure(engine.runner, sizes, num_draft_tokens + max(branch_top_m, 1) + 1, iters=3)
    return engine


model_option = click.option("--model", "model", default=None, metavar="PATH",
                            help="GGUF file or Hugging Face checkpoint directory (default: bundled SmolLM2-135M-Instruct).")
device_option = click.option("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available).")


def _check_tau(value: str) -> str:
    """--tau checked when the command line is parsed, before any model loads."""
    from .control import parse_tau
    from .errors import ConfigError

    try:
        parse_tau(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix("--tau "), param_hint="'--tau'") from None
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
                      "auto = the predictor saved next to the drafter's weights; draft lengths follow it under tau."),
    click.option("--tau", default="auto", show_default=True, callback=lambda ctx, param, value: _check_tau(value),
                 help="Threshold on predicted acceptance: a number in [0, 1], or auto (learned online)."),
    click.option("--branch-top-m", type=click.IntRange(min=0, max=8), default=0, show_default=True,
                 help="Hard-position enhancement: verify the top-m candidates where tau cuts a draft (draft-model)."),
]


def with_drafter_options(fn):
    for opt in reversed(drafter_options):
        fn = opt(fn)
    return fn


dtype_option = click.option("--dtype", type=click.Choice(list(DTYPES)), default="auto", show_default=True,
                            help="auto = bfloat16 on GPU, float32 on CPU.")


@click.group(cls=_Group)
@click.option("-v", "--verbose", is_flag=True, help="Log engine events.")
def main(verbose: bool) -> None:
    """Tandem: lossless speculative decoding for LLM serving."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--prompt", default=None, help="One prompt.")
@click.option("--prompts-file", type=click.Path(dir_okay=False), default=None,
              help="JSONL of prompts (Spec-Bench 'turns' rows or 'prompt' rows).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="First N prompts of the file.")
@model_option
@device_option
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable); \\n, \\t, \\r and \\\\ are unescaped.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Running requests at most.")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True, help="Context limit per request.")
@click.option("--no-chat", is_flag=True, help="Send the prompt raw, without the chat template.")
@with_drafter_options
@click.option("--specformer", "specformer_path", default=None, metavar="PATH",
              help="SpecFormer head directory (tandem train specformer); implies --drafter specformer. Same as "
                   "--drafter specformer --draft-model PATH, and as tandem bench --specformer.")
@click.option("--compare", is_flag=True,
              help="With a prompts file and a drafter: also run target-only on the same prompts and report "
                   "the speedup and how many outputs are identical.")
@dtype_option
def generate(prompt, prompts_file, limit, model, device, max_tokens, temperature, top_p, top_k, seed, stop,
             batch_size, max_seq_len, no_chat, drafter, draft_model, num_draft_tokens, predictor, tau, branch_top_m,
             specformer_path, compare, dtype) -> None:
    """Generate for one prompt (streamed) or a prompts file (table of results)."""
    from .data import load_prompts
    from .errors import InvalidRequestError
    from .models.config import ModelLoadError
    from .sampling import SamplingParams

    if specformer_path is not None:
        if drafter not in ("none", "specformer"):
            _fail(f"--specformer needs --drafter specformer, got --drafter {drafter}")
        if draft_model:
            _fail("give the SpecFormer head once: --specformer PATH or --draft-model PATH")
        if not specformer_path.strip():
            _fail("--specformer is empty")
        from .drafters.specformer import specformer_file

        specformer_file(specformer_path)  # a missing head is refused before the target loads
        drafter, draft_model = "specformer", specformer_path
    if (prompt is None) == (prompts_file is None):
        _fail("give exactly one of --prompt or --prompts-file")
    if compare and (prompts_file is None or drafter == "none"):
        _fail("--compare needs --prompts-file and a --drafter")
    if prompt is not None and not prompt.strip():
        _fail("prompt is empty")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=tuple(_unescape(x) for x in stop))
        records = load_prompts(prompts_file, limit) if prompts_file else None
        if records is not None and not records:
            _fail("the prompts file has no prompts")
        engine = _engine(model, device, batch_size, max_seq_len, dtype=dtype, drafter=drafter,
                         draft_model=draft_model, num_draft_tokens=num_draft_tokens, predictor=predictor, tau=tau,
                         branch_top_m=branch_top_m, num_requests=1 if records is None else len(records))
    except (InvalidRequestError, ModelLoadError) as exc:
        _fail(str(exc))
        return
    if prompt is not None:
        try:
            for out in engine.stream(prompt, params, chat=not no_chat):
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
        except InvalidRequestError as exc:
            _fail(str(exc))
        sys.stdout.write("\n")
        if engine.drafter is not None:  # on stderr: stdout holds only the generated text
            st = engine.stats
            err_console.print(f"[dim]{engine.drafter.name}: acceptance rate {_fmt(st.acceptance_rate, '.3f')}, "
                              f"mean accepted length {st.mean_accepted_length:.2f}[/dim]", highlight=False)
        return
    if not records:
        _fail("the prompts file has no prompts")
    results, wall = _run_file(engine, records, params, not no_chat)
    _print_results(engine, records, results, wall)
    if compare:
        # the baseline runs with no drafter and no draft policy (whose tau controller must not learn
        # from target-only rounds); both are put back afterwards
        saved = engine.drafter, engine.draft_policy
        engine.drafter = engine.draft_policy = None
        try:
            base, base_wall = _run_file(engine, records, params, not no_chat, desc="target-only")
        finally:
            engine.drafter, engine.draft_policy = saved
        _print_comparison(engine, results, wall, base, base_wall, sampled=not params.greedy)


def _run_file(engine, records, params, chat: bool, desc: str = "generating"):
    """Run every record through the engine with a progress bar; returns (completions, wall s)."""
    from tqdm import tqdm

    from .errors import InvalidRequestError
    from .metrics import SpecDecodeStats

    engine.stats = SpecDecodeStats()
    with tqdm(total=len(records), desc=desc, unit="prompt", file=sys.stderr) as bar:
        t0 = time.perf_counter()
        try:
            results = engine.generate([r.text for r in records], params, chat=chat, on_finish=lambda c: bar.update())
        except InvalidRequestError as exc:
            bar.leave = False  # erase the bar: the error is the line left
            bar.close()
            _fail(str(exc))
        wall = time.perf_counter() - t0
    return results, wall


def _fmt(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)  # NaN -> "-"


def _print_results(engine, records, results, wall: float) -> None:
    spec_on = engine.drafter is not None
    title = (f"{engine.checkpoint.path.name} on {engine.runner.device} ({engine.runner_config.dtype}, "
             f"batch <= {engine.max_running}"
             + (f", drafter {engine.drafter.name}, k={engine.num_draft_tokens})" if spec_on else ", target-only)"))
    table = Table(title=title)
    cols = ["prompt id", "category", "prompt tok", "output tok", "finish", "TTFT ms (from submit)", "tok/s"]
    if spec_on:
        cols += ["drafted", "accepted", "accept rate", "mean acc len"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("category", "finish") else "right")
    for rec, res in zip(records, results):
        decode_s = res.latency_s - res.ttft_s
        tps = (res.completion_tokens - 1) / decode_s if decode_s > 0 else float("nan")
        row = [rec.prompt_id, rec.category, str(res.prompt_tokens), str(res.completion_tokens), res.finish_reason,
               f"{res.ttft_s * 1e3:.0f}", _fmt(tps, ".1f")]
        if spec_on:
            row += [str(res.spec.num_drafted), str(res.spec.num_accepted), _fmt(res.spec.acceptance_rate, ".2f"),
                    f"{res.spec.mean_accepted_length:.2f}"]
        table.add_row(*row)
    total = sum(r.completion_tokens for r in results)
    table.add_section()
    row = ["total", f"{len(results)} prompts", str(sum(r.prompt_tokens for r in results)), str(total), "",
           f"p50 {statistics.median(r.ttft_s for r in results) * 1e3:.0f}", f"{total / wall:.1f}"]
    if spec_on:
        st = engine.stats
        row += [str(st.num_drafted), str(st.num_accepted), _fmt(st.acceptance_rate, ".2f"),
                f"{st.mean_accepted_length:.2f}"]
    table.add_row(*row)
    console.print(table)
    console.print(f"{total} output tokens in {wall:.2f} s: {total / wall:.1f} tok/s for the whole batch; "
                  f"TPOT p50 {statistics.median(r.tpot_s for r in results) * 1e3:.1f} ms", highlight=False)
    if spec_on:
        per_pos = ", ".join(_fmt(a, ".2f") for a in engine.stats.acceptance_per_pos)
        console.print(f"acceptance per draft position: {per_pos}", highlight=False)


def _print_comparison(engine, results, wall, base, base_wall, sampled: bool = False) -> None:
    spec_tokens = sum(r.completion_tokens for r in results)
    base_tokens = sum(r.completion_tokens for r in base)
    same = sum(a.token_ids == b.token_ids for a, b in zip(results, base))
    table = Table(title="Speculative vs target-only decoding, same prompts, same engine")
    for col in ("configuration", "output tok", "wall s", "tok/s", "speedup", "identical outputs"):
        table.add_column(col, justify="right")
    table.add_row("target-only", str(base_tokens), f"{base_wall:.2f}", f"{base_tokens / base_wall:.1f}", "1.00x", "-")
    table.add_row(f"{engine.drafter.name}, k={engine.num_draft_tokens}", str(spec_tokens), f"{wall:.2f}",
                  f"{spec_tokens / wall:.1f}", f"{(spec_tokens / wall) / (base_tokens / base_wall):.2f}x",
                  f"{same}/{len(results)}")
    console.print(table)
    if sampled:
        console.print("sampling: speculative output follows the same distribution as target-only, not the same "
                      "tokens, so 'identical outputs' is not expected to be full", highlight=False)


@main.command()
@model_option
@device_option
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="KV cache slots (default per device).")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
def info(model, device, batch_size, max_seq_len) -> None:
    """Show the model, architecture, device, dtype and KV cache size."""
    from .models.config import ModelLoadError

    try:
        engine = _engine(model, device, batch_size, max_seq_len)
    except ModelLoadError as exc:
        _fail(str(exc))
        return
    cfg = engine.checkpoint.config
    rc = engine.runner_config
    n_params = sum(p.numel() for p in engine.runner.model.parameters())
    table = Table(show_header=False)
    rows = [
        ("model", str(engine.checkpoint.path)),
        ("architecture", cfg.architecture),
        ("parameters", f"{n_params / 1e6:.1f} M"),
        ("layers / hidden / intermediate", f"{cfg.num_layers} / {cfg.hidden_size} / {cfg.intermediate_size}"),
        ("heads / kv heads / head dim", f"{cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"),
        ("vocab", str(cfg.vocab_size)),
        ("rope theta / scaling", f"{cfg.rope_theta:g} / {cfg.rope_scaling.kind if cfg.rope_scaling else 'none'}"),
        ("tied embeddings", str(cfg.tie_word_embeddings)),
        ("trained context", str(cfg.max_position_embeddings)),
        ("chat template", "yes" if engine.tokenizer.has_chat_template else "no"),
        ("eos ids", ", ".join(map(str, engine.tokenizer.eos_token_ids))),
        ("device / dtype", f"{rc.device} / {str(rc.dtype).removeprefix('torch.')}"),
        ("CUDA graphs / compile", f"{rc.cuda_graphs} / {rc.compile}"),
        ("KV cache", f"{engine.cache.num_slots} slots x {engine.cache.capacity} tokens = "
                     f"{engine.runner.kv_cache_bytes() / 2**20:.1f} MiB"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


@main.command()
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="Spec-Bench style JSONL (default: the bundled Spec-Bench copy).")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="Prompts at batch 1 (batch b runs max(limit, 2b)), round-robin across the Spec-Bench tasks.")
@click.option("--batch-sizes", default="1,16,64", show_default=True, help="Comma-separated batch sizes.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--configs", "configs_spec", default=None, metavar="NAME,...",
              help="Configurations to compare: target, ngram, draft-model, specformer, context-aware, hf-generate, "
                   "hf-prompt-lookup; target-host, ngram-host, specformer-host run host-drafted rounds instead of "
                   "chained device rounds (target always runs: it is the baseline). Default: target (+ hf-generate).")
@click.option("--hf-baseline/--no-hf-baseline", default=None,
              help="Add (or drop) hf-generate in --configs; on by default when --configs is not given.")
@click.option("--hf-limit", type=click.IntRange(min=1), default=5, show_default=True,
              help="Prompts for the HF references (batch 1 only: they are slow).")
@click.option("--specformer", "specformer_path", default=None, metavar="PATH",
              help="SpecFormer head for the specformer configuration (default: the one shipped for the bundled model).")
@click.option("--ca-drafter", default="draft-model", show_default=True, metavar="NAME",
              help="Drafter the context-aware configuration controls: draft-model, ngram or specformer.")
@click.option("--exact-kernels", is_flag=True,
              help="Run every decode step of every configuration (target-only too) with one shape, [b, k+1], and "
                   "prefill prompts one by one, so bf16 GPU outputs are identical token for token (slower).")
@click.option("--cost-table", is_flag=True, help="Also measure the verifier step time T(b, q) for q = 1..k+1.")
@click.option("--warmup", type=click.Choice(["full", "short"]), default="full", show_default=True,
              help="Warm-up pass before each timed pass: full = the same prompts (every CUDA graph and compile "
                   "is made before timing); short = max(2b, 4) of them (faster; later context lengths are "
                   "captured inside the timing).")
@click.option("--mode", type=click.Choice(["inproc", "distributed"]), default="inproc", show_default=True,
              help="inproc: one process; distributed: through the gRPC services (tandem serve).")
@model_option
@device_option
@click.option("--cuda-graphs/--no-cuda-graphs", default=None, help="Default: on for CUDA.")
@click.option("--compile/--no-compile", "compile_", default=None, help="Default: on for CUDA.")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
@dtype_option
@click.option("--kernels", type=click.Choice(["auto", "fused", "reference", "fused-heuristic"]), default="auto",
              show_default=True,
              help="Decode/verify kernels: fused (Triton + flash-attn, batch-invariant; GPU) or reference "
                   "(PyTorch ops, masked SDPA); auto = fused where it can run; fused-heuristic = fused with "
                   "flash-attn's batch-dependent split-KV choice (measures what invariance costs).")
@click.option("--ablation", is_flag=True,
              help="The context-aware ablation as the configuration set: target, fixed-k, random-length, "
                   "entropy-threshold, predictor, full-system over --drafter (or --ca-drafter) at k = "
                   "--num-draft-tokens; the predictor rows use --predictor PATH|auto.")
@with_drafter_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Write results.json, results.md and the PNG plots here.")
@click.option("--from-results", "from_results", default=None, metavar="FILE,...",
              help="Run nothing: merge these results.json files (e.g. batch sizes run in separate calls) and write "
                   "the tables and plots to --out.")
def bench(prompts_file, limit, batch_sizes, max_tokens, configs_spec, hf_baseline, hf_limit, specformer_path, ca_drafter,
          exact_kernels, cost_table, warmup, mode, model, device, cuda_graphs, compile_, max_seq_len, dtype, kernels, ablation,
          drafter, draft_model, num_draft_tokens, predictor, tau, branch_top_m, out, from_results) -> None:
    """Compare decoding configurations on Spec-Bench prompts: TPS, speedup over target-only,
    acceptance, latency, memory and the lossless check, per batch size."""
    from .data import bundled_spec_bench, load_prompts
    from .errors import InvalidRequestError

    if from_results:
        _bench_from_results(from_results, out)
        return
    _init_tracing()

    try:
        sizes = sorted({int(b) for b in batch_sizes.split(",")})  # an empty item is an error, not skipped
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        _fail(f"--batch-sizes must be positive integers separated by commas, got {batch_sizes!r}")
        return
    try:
        records = load_prompts(prompts_file or bundled_spec_bench())
    except InvalidRequestError as exc:
        _fail(str(exc))
        return
    if not records:
        _fail("the prompts file has no prompts")
    if ablation:  # the paper's ablation rows are configurations on the same engines (tandem.bench.configs)
        from .bench.configs import ABLATION_CONFIGS

        if configs_spec:
            _fail("--ablation runs its own configuration set; drop --configs")
        if tau != "auto":
            _fail("--ablation rows set τ themselves (the online controller, or none); drop --tau")
        configs_spec, hf_baseline = ",".join(ABLATION_CONFIGS), False
        if drafter != "none":
            ca_drafter, drafter = drafter, "none"
        if predictor == "auto":  # the predictor saved next to the drafter's weights
            predictor = None
    _bench_configs(records, str(prompts_file or bundled_spec_bench()), limit, sizes, max_tokens, configs_spec,
                   hf_baseline, hf_limit, specformer_path, ca_drafter, exact_kernels, cost_table, mode, model, device, cuda_graphs,
                   compile_, max_seq_len, dtype, drafter, draft_model, num_draft_tokens, predictor, tau, branch_top_m,
                   out, warmup, kernels)


def _bench_configs(records, prompts_file, limit, sizes, max_tokens, configs_spec, hf_baseline, hf_limit,
                   specformer_path, ca_drafter, exact_kernels, cost_table, mode, model, device, cuda_graphs, compile_,
                   max_seq_len, dtype, drafter, draft_model, num_draft_tokens, predictor, tau, branch_top_m, out,
                   warmup, kernels="auto") -> None:
    """``tandem bench`` without --ablation: every configuration at every batch size (tandem.bench)."""
    import torch
    from tqdm import tqdm

    from dataclasses import replace

    from .bench.configs import BenchOptions, parse_configs, predictor_path
    from .bench.report import tables, write_json, write_report
    from .bench.spec_bench import check_mode, run_benchmark
    from .models.runner import default_runner_config
    from .models.weights import load_checkpoint
    from .tokenizer import load_tokenizer

    if drafter != "none":
        _fail("--drafter is for --ablation; choose configurations with --configs")
    if configs_spec is not None:
        parse_configs(configs_spec)  # an empty list or item is an error before anything else
    names = [n.strip() for n in (configs_spec or "target").split(",")]
    if hf_baseline or (hf_baseline is None and configs_spec is None):
        names.append("hf-generate")
    elif hf_baseline is False:
        names = [n for n in names if n != "hf-generate"]
    configs = parse_configs(",".join(names))
    check_mode(mode)
    predictor = None if predictor == "auto" else predictor  # None: the one saved next to the drafter, if any
    options = BenchOptions(num_draft_tokens=num_draft_tokens, draft_model=draft_model, specformer=specformer_path,
                           ca_drafter=ca_drafter,
                           predictor=predictor, tau=tau, branch_top_m=branch_top_m)
    cfg = default_runner_config(device, max_batch_size=max(sizes), max_seq_len=max_seq_len, cuda_graphs=cuda_graphs,
                                compile=compile_, dtype=getattr(torch, DTYPES[dtype]) if DTYPES[dtype] else None,
                                kernels=kernels)
    checkpoint = load_checkpoint(model)
    uses_predictor = any(c.name in ("context-aware", "predictor", "full-system") for c in configs)
    options = replace(options,  # the results record which predictor ran (none when no configuration uses one)
                      predictor=predictor_path(options, checkpoint) if uses_predictor else None)
    err_console.print(f"device {cfg.device}, dtype {cfg.dtype}, CUDA graphs {cfg.cuda_graphs}, compile {cfg.compile}; "
                      f"configurations {', '.join(c.name for c in configs)}; batch sizes {sizes}", highlight=False,
                      soft_wrap=True)
    report = run_benchmark(checkpoint, load_tokenizer(checkpoint), cfg, records, configs, sizes, options,
                           max_tokens=max_tokens, limit=limit, hf_limit=hf_limit, exact_kernels=exact_kernels,
                           cost_table=cost_table, mode=mode, prompts_file=prompts_file, warmup=warmup,
                           say=lambda msg: tqdm.write(msg, file=sys.stderr),
                           on_result=(lambda partial: write_json(partial, out)) if out else None)
    for t in tables(report):
        console.print(t.to_rich())
    if out:
        written = write_report(report, out)
        console.print("wrote " + ", ".join(str(p) for p in written), highlight=False)


def _bench_from_results(files: str, out) -> None:
    """``tandem bench --from-results``: merge results.json files into one set of tables and plots."""
    import json
    from pathlib import Path

    from .bench.report import tables, write_report
    from .bench.spec_bench import BenchReport, merge_reports

    if not out:
        _fail("--from-results needs --out")
    try:
        report = merge_reports([BenchReport.from_dict(json.loads(Path(f).read_text()))
                                for f in files.split(",") if f.strip()])
    except (OSError, ValueError) as exc:
        _fail(f"--from-results: {exc}")
        return
    for t in tables(report):
        console.print(t.to_rich())
    console.print("wrote " + ", ".join(str(p) for p in write_report(report, out)), highlight=False)


@main.command("replay")
@click.option("--drafter", "drafters", multiple=True, required=True, metavar="KIND[:PATH]",
              help="specformer or draft-model, optionally with its weights (default: the shipped ones), or ngram; "
                   "repeatable.")
@click.option("--traces", "traces_file", type=click.Path(dir_okay=False), default=None,
              help="Greedy traces (JSONL) from an earlier --save-traces, made with the same --model; the prompt "
                   "options below then do not apply. Default: decode the prompts target-only now.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="Prompt JSONL (default: the bundled Spec-Bench questions).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Round-robin N prompts over the categories.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="New tokens per prompt [default: 256].")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Target-only decode batch (default per device).")
@click.option("--save-traces", type=click.Path(dir_okay=False), default=None, help="Write the traces here (JSONL).")
@click.option("-k", "--num-draft-tokens", type=click.IntRange(min=1, max=16), default=None,
              help="Draft tokens per round (default: a head's l_d, 4 for the others; a head drafts at most l_d).")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON.")
@model_option
@device_option
def replay_cmd(drafters, traces_file, prompts_file, limit, max_tokens, batch_size, save_traces, num_draft_tokens,
               out, model, device) -> None:
    """Acceptance of drafters on a prompt set by exact greedy replay: one teacher-forced pass over
    the target's own greedy outputs gives every round's accepted length (the engine's counters,
    see tandem.bench.replay), so drafter variants compare in seconds, not decode runs."""
    import json
    from pathlib import Path

    import torch

    from .bench.replay import Replayer, load_drafter, load_traces, record_traces, replay, save_traces as write_traces
    from .data import bundled_spec_bench, load_prompts, round_robin_by_category
    from .errors import InvalidRequestError
    from .models.config import ModelLoadError
    from .models.runner import default_runner_config
    from .models.weights import load_checkpoint
    from .train.distill import model_fingerprint

    if traces_file and (prompts_file or limit or max_tokens or batch_size):
        _fail("--traces replays saved traces: --prompts, --limit, --max-tokens and --batch-size do not apply")
    for path in (out, save_traces):
        if path and not Path(path).resolve().parent.is_dir():
            _fail(f"cannot write {path}: its directory does not exist")
    specs = []
    for spec in dict.fromkeys(drafters):  # a repeated drafter is replayed once
        kind, colon, path = spec.partition(":")
        if kind not in ("specformer", "draft-model", "ngram"):
            _fail(f"--drafter {spec!r}: replay supports specformer, draft-model and ngram")
        if kind == "ngram" and path:
            _fail("--drafter ngram takes no weights path")
        specs.append((spec, kind, path if colon else None))  # "KIND:" (empty path) is refused by drafter_weights
    try:
        checkpoint = load_checkpoint(model)
        loaded = {}
        for spec, kind, path in specs:  # every drafter's weights load before anything is decoded
            try:
                loaded[spec] = load_drafter(kind, path, checkpoint)
            except (InvalidRequestError, ModelLoadError) as exc:
                raise InvalidRequestError(f"--drafter {spec}: {exc}") from None
        if traces_file:
            traces = load_traces(traces_file, checkpoint.config.vocab_size)
            made_by = {t.model for t in traces if t.model}
            if made_by and made_by != {model_fingerprint(checkpoint.path)}:
                raise InvalidRequestError(f"{traces_file} was decoded by another target model than --model; "
                                          "replay needs the target's own greedy outputs")
        else:
            records = load_prompts(prompts_file or bundled_spec_bench())
            if limit:
                records = round_robin_by_category(records, limit)
            if not records:
                raise InvalidRequestError("the prompts file has no prompts")
            engine = _engine(model, device, batch_size or (128 if torch.cuda.is_available() else 8), 2048, compile_=False)
            traces = record_traces(engine, records, max_tokens or 256)
            del engine
        if not traces:
            raise InvalidRequestError(f"{traces_file} holds no traces")
        if save_traces:
            write_traces(traces, save_traces)
        cfg = default_runner_config(device)
        replayer = Replayer(checkpoint, traces, cfg.device, cfg.dtype)
        results = {}
        for spec, kind, path in specs:
            k = num_draft_tokens or 4
            if kind == "specformer":  # a head drafts l_d tokens at most
                k = min(num_draft_tokens or 99, loaded[spec].config.num_draft_tokens)
            overall, per_cat = replay(traces, replayer.drafts(kind, loaded[spec], k), k)
            results[spec] = {"kind": kind, "path": path, "k": k, "overall": overall, "per_category": per_cat}
    except (InvalidRequestError, ModelLoadError, ValueError, OSError) as exc:
        _fail(str(exc))
        return
    table = Table(title=f"greedy replay over {len(traces)} prompts (max {traces[0].max_tokens} new tokens)")
    table.add_column("category")
    for spec in results:
        table.add_column(f"{spec}\nacceptance / mean accepted length", justify="right")
    cats = sorted({c for r in results.values() for c in r["per_category"]})
    for cat in cats + ["overall"]:
        cells = []
        for r in results.values():
            st = r["overall"] if cat == "overall" else r["per_category"][cat]
            cells.append(f"{_fmt(st['acceptance_rate'], '.3f')} / {st['mean_accepted_length']:.2f}")
        table.add_row(cat or "(none)", *cells)
    console.print(table)
    if out:  # strict JSON: an undefined rate (nothing drafted) is null
        from .bench.spec_bench import json_safe

        Path(out).write_text(json.dumps(json_safe({"prompts": len(traces), "drafters": results}), indent=1,
                                        allow_nan=False))


@main.command("collect-logs")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), required=True,
              help="JSONL prompts (e.g. ../shared/data/train_prompts.jsonl; never a benchmark set).")
@click.option("--limit", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Output .npz (features, labels).")
@model_option
@device_option
@with_drafter_options
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
def collect_logs(prompts_file, limit, out, model, device, drafter, draft_model, num_draft_tokens, predictor, tau,
                 branch_top_m, max_tokens, batch_size, max_seq_len) -> None:
    """Run speculative decoding and record, per drafted position, the predictor features and the
    label (accepted 1, first rejected 0; later positions unlabelled)."""
    import numpy as np

    from .data import load_prompts
    from .errors import InvalidRequestError
    from .models.config import ModelLoadError
    from .predictor import FEATURE_NAMES
    from .sampling import SamplingParams

    if drafter == "none":
        _fail("collect-logs needs a --drafter")
    records = []
    try:
        prompts = load_prompts(prompts_file, limit)
        engine = _engine(model, device, batch_size, max_seq_len, drafter=drafter, draft_model=draft_model,
                         num_draft_tokens=num_draft_tokens, predictor=predictor, tau=tau, branch_top_m=branch_top_m)
    except (InvalidRequestError, ModelLoadError) as exc:
        _fail(str(exc))
        return
    from .state import StateStoreUnavailable, open_store

    store = open_store()  # TANDEM_REDIS_URL set: the logs also go to the capped Redis stream

    def sink(record) -> None:
        records.append(record)
        x, y = record.labelled()
        try:
            store.append_log(f"vlog:{record.drafter}", {"features": x.tolist(), "labels": y.tolist()})
        except StateStoreUnavailable as exc:
            log.warning("verification log not streamed: %s", exc)

    engine.verification_sink = sink
    fits = [r for r in prompts if len(engine.encode_prompt(r.text)) < engine.max_seq_len]
    if len(fits) < len(prompts):  # a data job over a training set: skip what cannot fit, say so, go on
        log.warning("skipped %d of %d prompts longer than the context limit (%d tokens; raise --max-seq-len)",
                    len(prompts) - len(fits), len(prompts), engine.max_seq_len)
    if not fits:
        _fail("no prompt fits the context limit; raise --max-seq-len")
    results, wall = _run_file(engine, fits, SamplingParams(max_tokens=max_tokens), True, desc="collecting")
    if not records:
        _fail("no drafts were verified; nothing to log")
    feats, labels = zip(*(r.labelled() for r in records))
    x, y = np.concatenate(feats), np.concatenate(labels)
    np.savez_compressed(out, features=x, labels=y, feature_names=np.array(FEATURE_NAMES), drafter=engine.drafter.name)
    console.print(f"{len(y)} labelled positions ({y.mean():.3f} accepted) from {len(results)} prompts in "
                  f"{wall:.1f} s -> {out}", highlight=False)


@main.command("trace-report")
@click.argument("trace_files", metavar="FILE...", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
def trace_report_cmd(trace_files, as_json) -> None:
    """Per-phase latency of decode rounds (request, prefill, round, draft, allocate, verify, network:
    count, p50, p99, mean ms) and the share of round time on the network, from OTLP JSON trace files
    (the OpenTelemetry collector's file exporter output, or TANDEM_TRACE_FILE). Give every service's
    file of one run together: RPC client and server spans are paired across them."""
    import json

    from .trace_report import TraceFileError, build_report, read_spans, render_table

    try:
        report = build_report([s for path in trace_files for s in read_spans(path)])
    except TraceFileError as exc:
        _fail(str(exc))
        return
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    console.print(render_table(report, f"{', '.join(trace_files)}: {report.num_spans} spans, "
                                       f"{report.num_traces} traces"))
    share = report.network_share
    console.print("network: " + ("no RPC or network spans inside rounds" if share is None
                                 else f"{100 * share:.1f}% of round time"), highlight=False)


@main.group()
def train() -> None:
    """Train drafters and the difficulty predictor."""


@train.command("predictor")
@click.option("--logs", "logs_file", type=click.Path(dir_okay=False, exists=True), required=True,
              help=".npz written by tandem collect-logs.")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Predictor .safetensors path.")
@click.option("--hidden", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=40, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def train_predictor_cmd(logs_file, out, hidden, epochs, seed) -> None:
    """Fit the acceptance predictor; writes the model, a JSON report and a reliability diagram."""
    from pathlib import Path

    import numpy as np

    from .predictor import reliability_diagram, train_predictor

    try:
        data = np.load(logs_file)
        x, y = data["features"], data["labels"]
    except (OSError, KeyError, ValueError) as exc:
        _fail(f"{logs_file} is not a collect-logs file: {exc}")
        return
    try:
        model, report = train_predictor(x, y, hidden=hidden, epochs=epochs, seed=seed)
    except ValueError as exc:
        _fail(str(exc))
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    model.save(out, report)
    png = str(Path(out).with_suffix(".reliability.png"))
    import torch

    from .predictor import validation_split

    val, _ = validation_split(len(y), seed=seed)  # the held-out rows the report was computed on

    reliability_diagram(model.predict(torch.from_numpy(x[val])).numpy(), y[val], png)
    console.print(f"AUC {report.auc:.3f} (entropy-only {report.entropy_auc:.3f}), ECE {report.ece:.3f}, "
                  f"{report.cost_us_per_token:.2f} µs/token; wrote {out}, {out}.json, {png}", highlight=False)


@main.command("distill-data")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), required=True,
              help="JSONL training prompts (../shared/data/train_prompts.jsonl); benchmark prompts are dropped.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/distill", show_default=True,
              help="Output directory (shards + manifest.json); an existing one is resumed.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="First N prompts of the file.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True, help="Answer length limit.")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Longer prompts (after the chat template) are skipped.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Running requests at most (default: 256 on GPU, 8 on CPU).")
@model_option
@device_option
@dtype_option
def distill_data(prompts_file, out, limit, max_tokens, max_prompt_tokens, batch_size, model, device, dtype) -> None:
    """Self-distillation data: the target answers every prompt greedily (chat template) and the
    token ids are written with a manifest (prompt ids, lengths, target model hash)."""
    import torch
    from tqdm import tqdm

    from .data import load_prompts
    from .engine import Engine
    from .models.runner import default_runner_config
    from .models.weights import load_checkpoint
    from .train.distill import distill

    import signal

    def _stop(signum, frame):  # SIGTERM (e.g. `timeout`): flush what is finished, then exit
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    records = load_prompts(prompts_file, limit)
    on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    cfg = default_runner_config(device, max_batch_size=batch_size or (256 if on_gpu else 8),
                                max_seq_len=max_prompt_tokens + max_tokens + 1,
                                dtype=getattr(torch, DTYPES[dtype]) if DTYPES[dtype] else None)
    engine = Engine(load_checkpoint(model), cfg)
    t0 = time.perf_counter()
    with tqdm(total=len(records), desc="distilling", unit="prompt", file=sys.stderr) as bar:
        manifest = distill(engine, records, out, max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens,
                           settings={"command": _command_line(), "dtype": str(cfg.dtype), "device": cfg.device,
                                     "prompts_file": str(prompts_file)},
                           on_record=lambda n: bar.update())
    wall = time.perf_counter() - t0
    answers = sum(r.answer_len for r in manifest.records)
    console.print(f"{len(manifest.records)} answers, {answers} answer tokens ({manifest.num_tokens} with prompts) "
                  f"in {len(manifest.shards)} shards; skipped {manifest.skipped}; {wall:.0f} s this run -> {out}",
                  highlight=False)


train_options = [
    click.option("--data", "data_dir", type=click.Path(file_okay=False), default="runs/distill", show_default=True,
                 help="Directory written by tandem distill-data."),
    click.option("--out", type=click.Path(file_okay=False), required=True, help="Output directory (weights + model card)."),
    click.option("--epochs", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True),
    click.option("--max-steps", type=click.IntRange(min=1), default=None,
                 help="Stop after N optimiser steps (default: the steps of --epochs). N sets the learning-rate "
                      "schedule; a run in --out resumes only with the same N and the same other options "
                      "(--no-resume starts over)."),
    click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Peak learning rate (default: 1e-3 for specformer, 3e-4 for draft-model)."),
    click.option("--batch-tokens", type=click.IntRange(min=64), default=8192, show_default=True,
                 help="Padded tokens per batch."),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--max-answer-tokens", type=click.IntRange(min=1), default=None,
                 help="Train on the first N tokens of each answer only (default: all); long answers of a small "
                      "target often end in repetition loops."),
    click.option("--no-resume", is_flag=True, help="Ignore a checkpoint.pt in --out and start over."),
    click.option("--val-fraction", type=click.FloatRange(min=0, max=0.5), default=0.02, show_default=True,
                 help="Share of the distilled answers held out (at most 256 answers); the weights of the step with the "
                      "lowest held-out loss are kept."),
    click.option("--eval-limit", type=click.IntRange(min=0), default=0, show_default=True,
                 help="After training, measure acceptance on the first N Spec-Bench prompts (round robin over "
                      "categories, greedy, --eval-max-tokens) and put it in the model card."),
    click.option("--eval-max-tokens", type=click.IntRange(min=1), default=256, show_default=True),
    click.option("--eval-batch-size", type=click.IntRange(min=1), default=None,
                 help="Running requests during the evaluation (default 64 on GPU, 8 on CPU)."),
    model_option,
    device_option,
]


def with_train_options(fn):
    for opt in reversed(train_options):
        fn = opt(fn)
    return fn


def _train_setup(model, device, data_dir):
    """(target checkpoint, frozen target Transformer on the device, sequences, manifest, amp)."""
    import torch

    from .errors import InvalidRequestError
    from .models.runner import default_runner_config
    from .models.transformer import Transformer
    from .models.weights import load_checkpoint
    from .train.distill import model_fingerprint, read_distilled

    manifest, seqs = read_distilled(data_dir)
    ck = load_checkpoint(model)
    if manifest.target.get("sha256") != model_fingerprint(ck.path):
        raise InvalidRequestError(f"{data_dir} was distilled from another target model ({manifest.target.get('path')})")
    cfg = default_runner_config(device)
    amp = cfg.device.startswith("cuda")
    longest = max(len(s.tokens) for s in seqs) if seqs else 1
    target = Transformer(ck.config, max_positions=longest + 1)
    target.load_weights(ck.tensors)
    target = target.to(cfg.device, torch.bfloat16 if amp else torch.float32).eval().requires_grad_(False)
    return ck, target, seqs, manifest, amp, cfg


def _finish_training(kind, out, result, manifest, train_cfg, extra, model, device, eval_limit, eval_max_tokens,
                     eval_batch_size, num_draft_tokens) -> None:
    """Evaluate (optional) and write the model card (card.json + README.md) beside the weights."""
    import json
    from pathlib import Path

    from .train.card import model_card

    report = None
    if eval_limit:
        from .bench.acceptance import measure_acceptance
        from .data import bundled_spec_bench, load_prompts, round_robin_by_category

        import torch

        on_gpu = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
        engine = _engine(model, device, eval_batch_size or (64 if on_gpu else 8), 2048, drafter=kind,
                         draft_model=out, num_draft_tokens=num_draft_tokens)
        records = round_robin_by_category(load_prompts(bundled_spec_bench()), eval_limit)
        report = measure_acceptance(engine, records, eval_max_tokens)[0].to_dict()
    card = {"kind": kind, "command": _command_line(), "data": {
                "answers": len(manifest.records), "answer_tokens": sum(r.answer_len for r in manifest.records),
                "target": manifest.target, "settings": manifest.settings},
            "training": dict(train_cfg, **result.to_dict()), "extra": extra, "spec_bench": report}
    Path(out, "card.json").write_text(json.dumps(card, indent=2))
    Path(out, "README.md").write_text(model_card(card))
    line = f"{kind}: {result.steps} steps in {result.wall_s:.0f} s, loss {result.first_loss:.3f} -> {result.final_loss:.3f}"
    if report:
        o = report["overall"]
        line += (f"; Spec-Bench ({report['prompts']} prompts): acceptance rate {o['acceptance_rate']:.3f}, "
                 f"mean accepted length {o['mean_accepted_length']:.2f}")
    console.print(line + f" -> {out}", highlight=False)


@train.command("specformer")
@with_train_options
@click.option("--num-draft-tokens", "num_draft", type=click.IntRange(min=1, max=16), default=4, show_default=True,
              help="Draft slots per position (l_d).")
@click.option("--causal", is_flag=True, help="Causal mask across the draft slots (ablation of the bidirectional default).")
@click.option("--taps", default=None, help="Target depths read, comma separated (default 0,L/2,L-1,L).")
@click.option("--bonus-token/--no-bonus-token", default=False,
              help="Also condition the draft slots on the bonus token's embedding (an extension beyond the paper; "
                   "default off).")
@click.option("--context-next-token", is_flag=True,
              help="Add each position's next token embedding to the context stream (EAGLE-style; beyond the paper).")
@click.option("--context-layers", type=click.IntRange(min=1, max=8), default=None,
              help="Context causal attention sub-layers (default 1, as in the paper).")
@click.option("--context-init-layers", default=None,
              help="Make the context sub-layers whole decoder blocks copied from these target blocks, comma "
                   "separated, at most 8 (e.g. 0,29; sets the context layer count and --context-mlp); meant "
                   "with --context-next-token, whose stream then starts as the draft model's; beyond the paper.")
@click.option("--context-mlp", is_flag=True, help="A SwiGLU MLP after each context attention sub-layer.")
@click.option("--lookup-tokens", is_flag=True,
              help="Also feed draft slot j the j-th token of the context lookup continuation (what followed the "
                   "latest earlier occurrence of the last 1-4 tokens, as prompt lookup would draft it; nothing where "
                   "no suffix recurs) and every slot the match length, so the head learns when to copy from the "
                   "context; beyond the paper.")
@click.option("--intermediate-size", type=click.IntRange(min=1), default=None,
              help="SwiGLU width of the head (default 2 x the target's hidden size).")
@click.option("--soft-labels", "soft_weight", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="Weight W of the soft-label term: loss = (1 - W) x cross-entropy against the distilled token "
                   "+ W x cross-entropy against the target's own distribution (0 = hard labels only, the paper's "
                   "loss).")
@click.option("--init-from", type=click.Path(), default=None,
              help="Start from this trained head (a directory with model.safetensors) instead of a fresh one: "
                   "fine-tuning, e.g. on more distilled data with a lower --lr. The other head options must "
                   "describe the same head; the copy of --context-init-layers from the target is skipped.")
def train_specformer_cmd(data_dir, out, epochs, max_steps, lr, batch_tokens, seed, max_answer_tokens, no_resume,
                         val_fraction, eval_limit, eval_max_tokens, eval_batch_size, model, device, num_draft, causal,
                         taps, bonus_token, context_next_token, context_layers, context_init_layers, context_mlp,
                         lookup_tokens, intermediate_size, soft_weight, init_from) -> None:
    """Train a SpecFormer head on self-distilled data (the target frozen)."""
    from dataclasses import asdict

    from .drafters.base import weights_file
    from .drafters.specformer import init_context_from_target, load_specformer, save_specformer
    from .train.loop import TrainConfig, train as run_training
    from .train.distill import model_fingerprint
    from .train.specformer import SpecFormerObjective, new_head

    try:
        tap_list = tuple(int(t) for t in taps.split(",")) if taps is not None else None
    except ValueError:
        _fail(f"--taps must be comma-separated integers, got {taps!r}")
        return
    try:
        init_list = tuple(int(t) for t in context_init_layers.split(",")) if context_init_layers is not None else ()
    except ValueError:
        init_list = None
    if init_list is None or (context_init_layers is not None and not init_list):
        _fail(f"--context-init-layers must be comma-separated target block indices, got {context_init_layers!r}")
        return
    if len(init_list) > 8:
        _fail(f"--context-init-layers names {len(init_list)} blocks; at most 8 (as --context-layers)")
        return
    if init_from is not None and not init_from.strip():
        _fail("--init-from is empty; give a trained head's directory (with model.safetensors)")
        return
    start = load_specformer(init_from) if init_from is not None else None  # before the target: fail early
    ck, target, seqs, manifest, amp, rcfg = _train_setup(model, device, data_dir)
    try:
        head = new_head(ck.config, num_draft, tap_list, causal, seed, bonus_token,
                        context_next_token=context_next_token, context_layers=context_layers,
                        context_mlp=context_mlp, intermediate_size=intermediate_size, context_init=init_list,
                        lookup_tokens=lookup_tokens)
        if start is not None:
            differ = [f"{k} {v!r} (there) vs {getattr(head.config, k)!r} (these options)"
                      for k, v in asdict(start.config).items() if getattr(head.config, k) != v]
            if differ:
                raise ValueError(f"--init-from {init_from} is another head: {'; '.join(differ)}")
            head.load_state_dict(start.state_dict())
        elif init_list:
            init_context_from_target(head, target)
        head = head.to(rcfg.device)
    except ValueError as exc:
        _fail(str(exc))
        return
    tcfg = TrainConfig(epochs=epochs, max_steps=max_steps, lr=lr or 1e-3, max_batch_tokens=batch_tokens, seed=seed,
                       val_fraction=val_fraction, max_answer_tokens=max_answer_tokens)
    try:
        run = dict({f"head.{k}": v for k, v in asdict(head.config).items()}, soft_label_weight=soft_weight)
        started = {}
        if init_from is not None:  # a resume must start from the same weights
            started = {"init_from": str(init_from), "init_from_sha256": model_fingerprint(weights_file(init_from))}
            run["init_from_sha256"] = started["init_from_sha256"]
        result = run_training(head, SpecFormerObjective(head, target, amp, soft_weight), seqs, tcfg, out,
                              resume=not no_resume, settings=run)
    except ValueError as exc:
        _fail(str(exc))
        return
    save_specformer(head, out, extra={"train": result.to_dict(), "soft_label_weight": soft_weight})
    _finish_training("specformer", out, result, manifest, dict(asdict(tcfg), soft_label_weight=soft_weight, **started),
                     asdict(head.config), model, device,
                     eval_limit, eval_max_tokens, eval_batch_size, num_draft)


@train.command("draft-model")
@with_train_options
@click.option("--init-layers", default="0,1", show_default=True,
              help="Target blocks the draft model's blocks start from (comma separated; the count sets its depth).")
@click.option("--num-draft-tokens", type=click.IntRange(min=1, max=16), default=4, show_default=True,
              help="k used by the optional evaluation.")
def train_draft_model_cmd(data_dir, out, epochs, max_steps, lr, batch_tokens, seed, max_answer_tokens, no_resume,
                          val_fraction, eval_limit, eval_max_tokens, eval_batch_size, model, device, init_layers,
                          num_draft_tokens) -> None:
    """Distil a small draft LM (target tokenizer, embeddings and LM head shared) from the target."""
    from dataclasses import asdict

    from .drafters.draft_model import save_draft_model
    from .train.draft_model import DraftModelObjective, init_draft_model
    from .train.loop import TrainConfig, train as run_training

    try:
        layers = tuple(int(t) for t in init_layers.split(","))
    except ValueError:
        _fail(f"--init-layers must be comma-separated integers, got {init_layers!r}")
        return
    ck, target, seqs, manifest, amp, rcfg = _train_setup(model, device, data_dir)
    import torch

    torch.manual_seed(seed)
    draft = init_draft_model(ck, layers, target.max_positions).to(rcfg.device)
    tcfg = TrainConfig(epochs=epochs, max_steps=max_steps, lr=lr or 3e-4, max_batch_tokens=batch_tokens, seed=seed,
                       val_fraction=val_fraction, max_answer_tokens=max_answer_tokens)
    try:
        result = run_training(draft, DraftModelObjective(draft, target, amp), seqs, tcfg, out, resume=not no_resume,
                              settings={"init_layers": layers})
    except ValueError as exc:
        _fail(str(exc))
        return
    save_draft_model(draft, out, layers, extra={"train": result.to_dict()})
    _finish_training("draft-model", out, result, manifest, asdict(tcfg), {"init_layers": list(layers)}, model,
                     device, eval_limit, eval_max_tokens, eval_batch_size, num_draft_tokens)


# ----------------------------------------------------------------------------- serving


@main.group()
def serve() -> None:
    """Run one Tandem service (drafter, verifier, router) as a standalone process.

    Start order: verifier(s), then drafter, then the router (it asks the verifiers for their model
    at start-up). Services log at INFO (a "serving on" line when ready); -v adds engine events.
    """
    for name in ("services", "tandem"):
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)


host_option = click.option("--host", default="127.0.0.1", show_default=True, help="Bind address.")
key_option = click.option("--api-key", default=None, envvar="TANDEM_API_KEY",
                          help="Require this bearer token on HTTP and gRPC (env TANDEM_API_KEY).")


@serve.command("verifier")
@model_option
@device_option
@click.option("--port", type=click.IntRange(min=1, max=65535), required=True, help="gRPC port.")
@host_option
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None, help="KV cache slots (default per device).")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--measure-cost", "measure_cost_k", type=click.IntRange(min=0, max=16), default=0, show_default=True,
              help="Measure the verifier cost model T(b, q) for q up to K+1 at start-up and publish it (0: off).")
@key_option
def serve_verifier(model, device, port, host, max_batch_size, max_seq_len, measure_cost_k, api_key) -> None:
    """The target model: tandem.v1.Verifier (prefill, verify, KV rollback) over gRPC."""
    from services.processes import run_verifier

    run_verifier(model, device, port, host, max_batch_size, max_seq_len, measure_cost_k, api_key)


@serve.command("drafter")
@click.option("--drafter", type=click.Choice(["ngram", "draft-model"]), default="ngram", show_default=True)
@click.option("--draft-model", default=None, metavar="PATH|truncate:N",
              help="Draft model for --drafter draft-model (default with the bundled target: the shipped one).")
@model_option
@device_option
@click.option("--port", type=click.IntRange(min=1, max=65535), required=True, help="gRPC port.")
@host_option
@click.option("--max-sequences", type=click.IntRange(min=1), default=64, show_default=True,
              help="Sequences held at once over all router streams (draft-model KV cache slots).")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
@key_option
@click.option("--predictor", default=None, metavar="PATH|auto",
              help="Send each draft's predicted acceptance with it (acceptance predictor; auto = the one saved "
                   "beside the drafter's weights). Without it the router scores the drafts' features.")
def serve_drafter(drafter, draft_model, model, device, port, host, max_sequences, max_seq_len, api_key,
                  predictor) -> None:
    """A drafter: tandem.v1.Drafter over gRPC."""
    from services.processes import run_drafter

    run_drafter(drafter, draft_model, model, device, port, host, max_sequences, max_seq_len, api_key, predictor)


@serve.command("router")
@click.option("--verifier", "verifiers", multiple=True, required=True, metavar="HOST:PORT",
              help="A verifier replica (repeatable: one engine per replica).")
@click.option("--drafter", default=None, metavar="HOST:PORT", help="Drafter service (none: target-only decoding).")
@model_option
@click.option("--model-name", default=None, help="Model id in /v1/models (default: the verifier's model file name).")
@click.option("--port", "http_port", type=click.IntRange(min=1, max=65535), required=True, help="HTTP port.")
@click.option("--grpc-port", type=click.IntRange(min=1, max=65535), default=None, help="gRPC Router.Generate port.")
@host_option
@click.option("--num-draft-tokens", type=click.IntRange(min=1, max=16), default=4, show_default=True)
@click.option("--policy", type=click.Choice(["fixed", "entropy", "predictor"]), default="fixed", show_default=True,
              help="Draft lengths: fixed k, or adaptive (tau controller + verifier cost model) over exp(-entropy) "
                   "or the learned predictor.")
@click.option("--predictor", default=None, metavar="PATH", help="Predictor for --policy predictor.")
@click.option("--redis-url", default=None, envvar="TANDEM_REDIS_URL",
              help="Shared state store (env TANDEM_REDIS_URL); in-memory when unset.")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--drafter-timeout", type=click.FloatRange(min=0.01), default=10.0, show_default=True,
              help="Seconds to wait for one round of drafts before decoding target-only.")
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="Draft the next round while the verifier checks this one (used where the guess holds).")
@key_option
def serve_router(verifiers, drafter, model, model_name, http_port, grpc_port, host, num_draft_tokens, policy,
                 predictor, redis_url, default_max_tokens, drafter_timeout, overlap, api_key) -> None:
    """The router: OpenAI-compatible HTTP and tandem.v1.Router gRPC over remote drafter and verifiers."""
    from services.processes import run_router
    from services.router.core import RouterConfig

    config = RouterConfig(list(verifiers), drafter, model, model_name, num_draft_tokens, policy, predictor, redis_url,
                          drafter_timeout_s=drafter_timeout, overlap=overlap)
    run_router(config, http_port, grpc_port, host, api_key, default_max_tokens)


@main.command()
@click.option("--prompts-file", type=click.Path(dir_okay=False), default=None,
              help="JSONL of prompts (default: the bundled Spec-Bench questions).")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True)
@model_option
@click.option("--drafter", type=click.Choice(["none", "ngram", "draft-model"]), default="ngram", show_default=True)
@click.option("--draft-model", default=None, metavar="PATH|truncate:N")
@click.option("--num-draft-tokens", type=click.IntRange(min=1, max=16), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests in flight at once (the router batches them).")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Verifier KV slots.")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="Router drafts the next round while the verifier checks this one.")
def demo(prompts_file, limit, model, drafter, draft_model, num_draft_tokens, max_tokens, temperature, concurrency,
         max_batch_size, max_seq_len, overlap) -> None:
    """Start verifier, drafter and router as separate processes on loopback, send prompts through
    /v1/chat/completions with the openai client, print tokens, acceptance and latency, stop."""
    import os

    from services.demo import run_demo
    from services.launch import StackConfig

    from .data import bundled_spec_bench, load_prompts

    records = load_prompts(prompts_file or bundled_spec_bench(), limit)
    config = StackConfig(model=model, drafter=drafter, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
                         max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         redis_url=os.environ.get("TANDEM_REDIS_URL"), overlap=overlap)
    try:
        run_demo(records, config, max_tokens, concurrency, temperature, console)
    except (RuntimeError, TimeoutError) as exc:
        _fail(str(exc))
