"""``tandem generate``: one prompt streamed, or a prompts file as a table of results; with
``--compare`` also target-only decoding of the same prompts on the same target."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import click
from rich.table import Table

from ..cache import current_umask
from ..data import PromptRecord, load_prompts
from ..errors import InvalidRequestError
from ..speculation import TARGET_ONLY, build_engine
from .common import (_engine, _run_file, _unescape, console, device_option, dtype_option, err_console, fail, fmt,
                     kernels_option, model_option, policy_option, speculative_config, with_drafter_options,
                     with_sampling_options)

MIN_DECODE_TOKENS = 8  # a per-prompt decode rate needs this many tokens after the first


@click.command()
@click.option("--prompt", default=None, help="One prompt.")
@click.option("--prompts-file", type=click.Path(dir_okay=False), default=None,
              help="JSONL of prompts: 'prompt' rows, or Spec-Bench 'turns' rows (their first turn).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="First N prompts of the file.")
@model_option
@device_option
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@with_sampling_options
@click.option("--stop", multiple=True, help="Stop string (repeatable); \\n, \\t, \\r and \\\\ are unescaped.")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True, help="[-2, 2] (OpenAI's).")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True, help="[-2, 2] (OpenAI's).")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True, help="(0, 10]; 1 = off (vLLM's).")
@click.option("--min-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="Output tokens before EOS or a stop may end the output.")
@click.option("--logit-bias", multiple=True, metavar="ID=BIAS",
              help="Add BIAS in [-100, 100] to token ID's logit (repeatable).")
@click.option("--json", "json_object", is_flag=True, help="Structured output: any JSON object.")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Structured output: a JSON schema file the output must match.")
@click.option("--regex", default=None, help="Structured output: a regular expression the output must match.")
@click.option("--grammar", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Structured output: a Lark grammar file (llguidance's dialect).")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Running requests at most.")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True, help="Context limit per request.")
@click.option("--no-chat", is_flag=True, help="Send the prompt raw, without the chat template.")
@with_drafter_options
@policy_option
@click.option("--specformer", "specformer_path", default=None, metavar="PATH",
              help="SpecFormer head directory (tandem train specformer); implies --drafter specformer. Same as "
                   "--drafter specformer --draft-model PATH, and as tandem bench --specformer.")
@click.option("--output", default=None, metavar="FILE",
              help="With --prompts-file: also write each completion as a JSONL row (prompt id, category, "
                   "text, token ids, finish reason, token counts); with --compare, the drafter's run. Written "
                   "when the run has finished (a failed run leaves an existing file as it was).")
@click.option("--compare", is_flag=True,
              help="With a drafter: also run target-only on the same prompt(s) and report the speedup and how "
                   "many outputs are identical (with --prompt, a table of one instead of streamed text).")
@dtype_option
@kernels_option
def generate(prompt, prompts_file, limit, model, device, max_tokens, temperature, top_p, top_k, seed, stop,
             presence_penalty, frequency_penalty, repetition_penalty, min_tokens, logit_bias, json_object, json_schema,
             regex, grammar, batch_size, max_seq_len, no_chat, drafter, draft_model, num_draft_tokens, predictor, acceptance_threshold, branch_top_m,
             policy, specformer_path, output, compare, dtype, kernels) -> None:
    """Generate for one prompt (streamed) or a prompts file (table of results)."""
    from ..sampling import SamplingParams  # torch

    if specformer_path is not None:
        if drafter not in ("none", "specformer"):
            fail(f"--specformer needs --drafter specformer, got --drafter {drafter}")
        if draft_model:
            fail("give the SpecFormer head once: --specformer PATH or --draft-model PATH")
        if not specformer_path.strip():
            fail("--specformer is empty")
        from ..drafters.specformer import specformer_file  # torch

        specformer_file(specformer_path)  # a missing head is refused before the target loads
        drafter, draft_model = "specformer", specformer_path
    if (prompt is None) == (prompts_file is None):
        fail("give exactly one of --prompt or --prompts-file")
    if compare and drafter == "none":
        fail("--compare needs a --drafter (it compares the drafter's run with target-only decoding)")
    if limit is not None and prompts_file is None:
        fail("--limit takes the first N prompts of --prompts-file; with --prompt there is one")
    if _given("batch_size") and prompts_file is None:
        fail("--batch-size runs a prompts file's prompts that many at a time; with --prompt there is one")
    if output is not None and prompts_file is None:
        fail("--output writes a prompts file's completions; with --prompt the text goes to stdout")
    if output is not None:
        _check_output(output, prompts_file)
    if drafter == "none" and _given("num_draft_tokens"):
        fail("--num-draft-tokens needs a --drafter (target-only decoding drafts nothing)")
    if drafter == "none" and policy is not None:
        fail("--policy needs a --drafter (target-only decoding drafts nothing)")
    if prompt is not None and not prompt.strip():
        fail("prompt is empty (or only whitespace)")
    spec = speculative_config(drafter, draft_model, num_draft_tokens, predictor, acceptance_threshold, branch_top_m, policy)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=tuple(_unescape(x) for x in stop), presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                                min_tokens=min_tokens, logit_bias=_logit_bias(logit_bias),
                                structure=_structure(json_object, json_schema, regex, grammar))
        if temperature == 0 and (seed is not None or top_p < 1 or top_k > 0):  # (valid, but without effect)
            given = [f for f, on in (("--seed", seed is not None), ("--top-p", top_p < 1), ("--top-k", top_k > 0)) if on]
            err_console.print(f"note: {', '.join(given)} do{'es' if len(given) == 1 else ''} nothing under greedy "
                              "decoding (--temperature 0)", highlight=False, soft_wrap=True)
        records = load_prompts(prompts_file, limit) if prompts_file else None
        if compare and prompt is not None:  # one prompt compared: run as a file of one (no streaming)
            records, prompt = [PromptRecord("prompt", "-", prompt)], None
        if records is not None and not records:
            fail(f"the prompts file {prompts_file} has no prompts")
        # running requests at most: one prompt runs alone, a file no wider than its prompts (the KV
        # cache's slots, and the batch sizes an adaptive policy's cost model is measured for)
        running = 1 if records is None else min(batch_size, len(records))
        engine = _engine(model, device, running, max_seq_len, spec, dtype=dtype, kernels=kernels)
    except InvalidRequestError as exc:
        fail(str(exc))
        return
    if params.max_tokens >= engine.max_seq_len:  # said before it binds (the HTTP API refuses such a request)
        err_console.print(f"note: --max-tokens {params.max_tokens} is past the context (--max-seq-len "
                          f"{engine.max_seq_len}, the prompt included): generation stops at the context limit",
                          highlight=False, soft_wrap=True)
    if prompt is not None:
        emitted, out = 0, None
        try:
            for out in engine.stream(prompt, params, chat=not no_chat):
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
                emitted += len(out.new_token_ids)
        except InvalidRequestError as exc:
            fail(str(exc))
        sys.stdout.write("\n")
        if out is not None and out.finish_reason == "length" and emitted < params.max_tokens:
            err_console.print(f"[dim]stopped at the context limit (--max-seq-len {engine.max_seq_len}) after "
                              f"{emitted} of --max-tokens {params.max_tokens} tokens[/dim]", highlight=False,
                              soft_wrap=True)
        if engine.drafter is not None:  # on stderr: stdout holds only the generated text
            st = engine.stats
            err_console.print(f"[dim]{engine.drafter.name}: acceptance rate {fmt(st.acceptance_rate, '.3f')}, "
                              f"mean accepted length {st.mean_accepted_length:.2f}[/dim]", highlight=False)
        return
    baseline = None
    if compare:
        # the baseline is an engine of its own over the same target (weights, KV cache, graphs),
        # built from the target-only configuration: no drafter, and no draft policy whose θ
        # controller would learn from target-only rounds; the speculative engine is left as it was.
        # Each engine first runs one short prompt untimed: a first run pays one-time costs (first
        # calls of each kernel and op, allocations) that a second run over the shared target would
        # skip, which made a short comparison favour whichever engine ran second.
        baseline = build_engine(TARGET_ONLY, share=engine)
        warm = dataclasses.replace(params, max_tokens=min(params.max_tokens, max(16, params.min_tokens)))
        for e in (engine, baseline):
            _run_file(e, records[:1], warm, not no_chat, desc="warm-up")
    sink = _output_sink(output) if output is not None else None
    try:
        results, wall = _run_file(engine, records, params, not no_chat)
    except BaseException:
        if sink is not None:  # the file the user named is left as it was
            sink.close()
            os.unlink(sink.name)
        raise
    cut = sum(c.finish_reason == "length" and c.completion_tokens < params.max_tokens for c in results)
    if cut:  # as a single prompt says it: the context limit, not --max-tokens, ended these
        err_console.print(f"[dim]{cut} of {len(results)} prompts stopped at the context limit (--max-seq-len "
                          f"{engine.max_seq_len}) before --max-tokens {params.max_tokens}[/dim]", highlight=False,
                          soft_wrap=True)
    if sink is not None:
        with sink:
            for r, c in zip(records, results):
                sink.write(json.dumps({"prompt_id": r.prompt_id, "category": r.category, "text": c.text,
                                       "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                       "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens},
                                      ensure_ascii=False) + "\n")
        os.chmod(sink.name, 0o666 & ~current_umask())  # a temporary file is private: the output gets the usual mode
        os.replace(sink.name, output)
        err_console.print(f"[dim]wrote {len(results)} completions to {output}[/dim]", highlight=False)
    _print_results(engine, records, results, wall, spec.policy)
    if baseline is not None:
        base, base_wall = _run_file(baseline, records, params, not no_chat, desc="target-only")
        _print_comparison(engine, results, wall, base, base_wall, spec.policy, sampled=not params.greedy)


def _check_output(output: str, prompts_file: str) -> None:
    """``--output``'s path, checked before the model loads: not a directory, not the prompts file,
    in a directory that exists and can be written."""
    path = Path(output)
    if path.is_dir():
        fail(f"--output {output} is a directory")
    if path.exists() and path.resolve() == Path(prompts_file).resolve():
        fail("--output would overwrite --prompts-file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        fail(f"cannot write --output {output}: {parent} is not a directory" if parent.exists() else f"cannot write --output {output}: no directory {parent}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"cannot write --output {output}: permission denied")


def _output_sink(output: str):
    """A temporary file beside ``--output``, renamed onto it once the run has finished."""
    path = Path(output)
    try:
        return tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                           suffix=".tmp", delete=False)
    except OSError as exc:
        fail(f"cannot write --output {output}: {exc.strerror or exc}")


def _logit_bias(pairs: tuple[str, ...]) -> dict[int, float]:
    """``--logit-bias ID=BIAS`` options as a dict (range checks: ``SamplingParams``)."""
    out = {}
    for pair in pairs:
        tok, sep, bias = pair.partition("=")
        try:
            out[int(tok)] = float(bias)
        except ValueError:
            fail(f"--logit-bias takes ID=BIAS (an integer token id and a number), got {pair!r}")
        if not sep:
            fail(f"--logit-bias takes ID=BIAS, got {pair!r}")
    return out


def _structure(json_object: bool, json_schema: str | None, regex: str | None, grammar: str | None):
    """The structured-output options as a ``Structure`` (None without one; at most one)."""
    from ..structured import Structure

    given = [x for x in (json_object or None, json_schema, regex, grammar) if x is not None]
    if len(given) > 1:
        fail("give at most one of --json, --json-schema, --regex and --grammar")
    if json_object:
        return Structure("json_object", param="--json")
    if json_schema is not None:
        return Structure("json_schema", _structure_file(json_schema, "--json-schema", "JSON schema"),
                         param="--json-schema")
    if regex is not None:
        return Structure("regex", regex, param="--regex")
    if grammar is not None:
        return Structure("lark", _structure_file(grammar, "--grammar", "Lark grammar"), param="--grammar")
    return None


def _structure_file(path: str, flag: str, what: str) -> str:
    """A structure's file as text: a one-line error when it cannot be read, is not UTF-8 or is
    empty."""
    from pathlib import Path

    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        fail(f"{flag} {path} is not valid UTF-8 ({exc.reason} at byte {exc.start})")
    except OSError as exc:
        fail(f"{flag} {path}: {exc.strerror or exc}")
    if not text.strip():
        fail(f"{flag} {path} is empty: it should hold a {what}")
    return text


def _given(name: str) -> bool:
    """Whether the option ``name`` came from the command line (not its default)."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) == ParameterSource.COMMANDLINE


def _speculation_label(engine, policy: str) -> str:
    """The drafter, k and, under a draft policy (``policy``, its ``--policy`` name), how it chooses:
    ``ngram, k=4 (predictor lengths, learned θ)``."""
    label = f"{engine.drafter.name}, k={engine.num_draft_tokens}"
    chosen = engine.draft_policy
    if chosen is None:
        return label
    trees = f", top-{chosen.branch_top_m} trees where θ cuts" if chosen.branch_top_m > 1 else ""
    return f"{label} ({policy} lengths{', learned θ' if chosen.learns_threshold else ''}{trees})"


def _print_results(engine, records, results, wall: float, policy: str) -> None:
    spec_on = engine.drafter is not None
    title = (f"{engine.checkpoint.path.name} on {engine.runner.device} ({engine.runner_config.dtype}, "
             f"batch <= {engine.max_running}"
             + (f", drafter {_speculation_label(engine, policy)})" if spec_on else ", target-only)"))
    table = Table(title=title)
    cols = ["prompt id", "category", "prompt tok", "output tok", "finish", "TTFT ms (from submit)", "decode tok/s"]
    if spec_on:
        cols += ["drafted", "accepted", "accept rate", "mean acc len"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("category", "finish") else "right")
    for rec, res in zip(records, results):
        # tokens after the first over the time after it; undefined over fewer than MIN_DECODE_TOKENS,
        # where one speculative round can bring them all at once
        decode_s = res.latency_s - res.ttft_s
        tps = (res.completion_tokens - 1) / decode_s if decode_s > 0 and res.completion_tokens > MIN_DECODE_TOKENS \
            else float("nan")
        row = [rec.prompt_id, rec.category, str(res.prompt_tokens), str(res.completion_tokens), res.finish_reason,
               f"{res.ttft_s * 1e3:.0f}", fmt(tps, ".1f")]
        if spec_on:
            row += [str(res.spec.num_drafted), str(res.spec.num_accepted), fmt(res.spec.acceptance_rate, ".2f"),
                    f"{res.spec.mean_accepted_length:.2f}"]
        table.add_row(*row)
    total = sum(r.completion_tokens for r in results)
    table.add_section()
    row = ["total", f"{len(results)} prompts", str(sum(r.prompt_tokens for r in results)), str(total), "",
           f"p50 {statistics.median(r.ttft_s for r in results) * 1e3:.0f}", f"{total / wall:.1f}"]
    if spec_on:
        st = engine.stats
        row += [str(st.num_drafted), str(st.num_accepted), fmt(st.acceptance_rate, ".2f"),
                f"{st.mean_accepted_length:.2f}"]
    table.add_row(*row)
    console.print(table)
    console.print(f"{total} output tokens in {wall:.2f} s: {total / wall:.1f} tok/s for the whole batch; "
                  f"TPOT p50 {statistics.median(r.tpot_s for r in results) * 1e3:.1f} ms", highlight=False)
    if spec_on:
        from ..metrics import draft_length_lines

        lines = draft_length_lines(engine.stats, policy, engine.num_draft_tokens)
        for line in lines or ["nothing drafted"]:
            console.print(line, highlight=False)


def _print_comparison(engine, results, wall, base, base_wall, policy: str, sampled: bool = False) -> None:
    spec_tokens = sum(r.completion_tokens for r in results)
    base_tokens = sum(r.completion_tokens for r in base)
    same = sum(a.token_ids == b.token_ids for a, b in zip(results, base))
    table = Table(title="Speculative vs target-only decoding, same prompts, same engine")
    for col in ("configuration", "output tok", "wall s", "tok/s", "speedup", "identical outputs"):
        table.add_column(col, justify="right")
    table.add_row("target-only", str(base_tokens), f"{base_wall:.2f}", f"{base_tokens / base_wall:.1f}", "1.00x", "-")
    table.add_row(_speculation_label(engine, policy), str(spec_tokens), f"{wall:.2f}",
                  f"{spec_tokens / wall:.1f}", f"{(spec_tokens / wall) / (base_tokens / base_wall):.2f}x",
                  f"{same}/{len(results)}")
    console.print(table)
    if sampled:
        console.print("sampling: speculative output follows the same distribution as target-only, not the same "
                      "tokens, so 'identical outputs' is not expected to be full", highlight=False)


