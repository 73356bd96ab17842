"""``tandem demo`` (``make run``): the disaggregated stack end to end on loopback.

Starts a verifier replica (the engine loop and its drafter), the router and, for a draft model, a
drafter service as separate processes, sends Spec-Bench prompts through ``/v1/chat/completions``
with the official ``openai`` client (several in flight, so the replica batches them), prints per-prompt tokens, acceptance and latency and the totals, one prompt with
its answer, and the temperature used, then shuts the stack down (its temporary logs go with it).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from tandem.data import PromptRecord
from tandem.metrics import SpecDecodeStats, draft_length_lines
from tandem.speculation import SpeculativeConfig

from .launch import Stack, StackConfig, start_stack


@dataclass
class DemoResult:
    record: PromptRecord
    completion_tokens: int
    prompt_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    latency_s: float
    ttft_s: float
    finish_reason: str
    text: str
    spec: SpecDecodeStats  # the request's speculative-decoding counters, per draft position too


def ask(client, model: str, record: PromptRecord, max_tokens: int, temperature: float) -> DemoResult:
    """One chat completion through the router (streamed, with usage in the last chunk)."""
    t0 = time.perf_counter()
    first = None
    parts, usage, finish = [], None, ""
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": record.text}],
                                            max_tokens=max_tokens, temperature=temperature, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"category": record.category})
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.content or ""
            if delta and first is None:
                first = time.perf_counter()
            parts.append(delta)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    sd = (usage.model_extra or {}).get("speculative_decoding", {})
    spec = SpecDecodeStats(num_steps=sd.get("num_verify_steps", 0), num_drafted=sd.get("num_draft_tokens", 0),
                           num_accepted=sd.get("num_accepted_tokens", 0),
                           drafted_per_pos=list(sd.get("draft_tokens_per_position", [])),
                           accepted_per_pos=list(sd.get("accepted_tokens_per_position", [])))
    return DemoResult(record, usage.completion_tokens, usage.prompt_tokens, sd.get("num_draft_tokens", 0),
                      sd.get("num_accepted_tokens", 0), sd.get("num_verify_steps", 0), end - t0,
                      (first or end) - t0, finish, "".join(parts), spec)


def run_demo(records: list[PromptRecord], config: StackConfig, max_tokens: int, concurrency: int,
             temperature: float = 0.0, console: Console | None = None) -> list[DemoResult]:
    """Start the stack, run every record through it, print the table, stop the stack."""
    import openai

    console = console or Console()
    t_start = time.perf_counter()
    console.print(f"speculation: {describe_speculation(config.speculation)}", highlight=False)
    console.print(f"starting verifier replica{', drafter service' if config.uses_drafter_service else ''} and router "
                  f"on loopback "
                  f"(context limit {config.max_seq_len} tokens: --max-seq-len) ...", highlight=False)
    stack: Stack = start_stack(config)
    try:
        verifiers = ", ".join(stack.verifier_addresses)
        logs = (f"logs in {stack.logs['router'].parent}" if stack.temp_log_dir is None
                else "logs removed on exit (--log-dir DIR keeps them)")
        console.print(f"stack up in {time.perf_counter() - t_start:.1f} s: router {stack.http_url}, verifier "
                      f"{verifiers}, drafter {stack.drafter_address or ('in the replica' if config.drafter != 'none' else 'none')}; "
                      f"{logs}", highlight=False)
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=config.api_key or "none", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id
        t0 = time.perf_counter()

        def ask_or_refused(record: PromptRecord) -> DemoResult | str:
            try:
                return ask(client, model, record, max_tokens, temperature)
            except openai.BadRequestError as exc:  # this prompt only (e.g. too long for the context)
                return f"{record.prompt_id}: {_refusal(exc)}"

        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(ask_or_refused, records))
        wall = time.perf_counter() - t0
    finally:
        stack.stop()
    results = [a for a in answers if isinstance(a, DemoResult)]
    refused = [a for a in answers if isinstance(a, str)]
    for line in refused:
        console.print(f"refused by the router: {line}", highlight=False, markup=False)
    if not results:
        raise RuntimeError(f"the router refused all {len(records)} prompts (first: {refused[0]})")
    _print(console, results, wall, model, config, min(concurrency, len(records)))  # at most one per prompt
    _print_sample(console, results[0])
    console.print(temperature_note(temperature), highlight=False)
    return results


def _refusal(exc) -> str:
    """The router's error message of a 4xx answer (OpenAI's error body), else the client's text."""
    body = exc.body if isinstance(getattr(exc, "body", None), dict) else {}
    return str(body.get("message") or exc.message)


DRAFTER_NAMES = {"none": "none (target-only decoding)", "ngram": "n-gram (prompt lookup)",
                 "draft-model": "draft model", "specformer": "SpecFormer head"}
POLICY_NAMES = {"fixed": "fixed (k drafts per sequence per round)",
                "entropy": "context-aware (entropy score, acceptance threshold learned online, cost-model allocation)",
                "predictor": "context-aware (learned predictor, acceptance threshold learned online, cost-model allocation)",
                "random": "random length (ablation)"}


def describe_speculation(spec: SpeculativeConfig) -> str:
    """One line: the drafter (and its weights), k and the draft policy."""
    if not spec.speculates:
        return DRAFTER_NAMES["none"]
    weights = f" ({spec.draft_model})" if spec.draft_model else ""
    predictor = f" ({spec.predictor})" if spec.predictor else ""
    return (f"drafter {DRAFTER_NAMES.get(spec.drafter, spec.drafter)}{weights}, k = {spec.num_draft_tokens}, "
            f"draft policy {POLICY_NAMES[spec.policy]}{predictor}")


def temperature_note(temperature: float) -> str:
    """The temperature the demo's requests used, and the defaults elsewhere."""
    mode = "greedy: the output is exactly the target's" if temperature == 0 else "sampled"
    return (f"temperature {temperature:g} ({mode}; tandem demo --temperature T). A request to the HTTP API that "
            f"leaves temperature out samples at 1, the OpenAI default; tandem generate defaults to 0.")


def _trim(text: str, limit: int) -> str:
    """``text`` on one line, cut to ``limit`` characters with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1].rstrip() + "…"


def _print_sample(console: Console, r: DemoResult) -> None:
    console.print(f"sample ({r.record.prompt_id}, {r.record.category}; {r.completion_tokens} tokens, "
                  f"{r.finish_reason}):", highlight=False)
    console.print(f"  prompt: {_trim(r.record.text, 200)}", highlight=False, markup=False)
    console.print(f"  answer: {_trim(r.text, 400)}", highlight=False, markup=False)


def _print(console: Console, results: list[DemoResult], wall: float, model: str, config: StackConfig,
           concurrency: int) -> None:
    table = Table(title=f"{model} via router -> verifier replica + {config.drafter} drafter (k={config.num_draft_tokens}, "
                        f"policy {config.policy}, {concurrency} requests in flight)")
    for col in ("prompt id", "category", "prompt tok", "output tok", "finish", "drafted", "accepted", "accept rate",
                "mean acc len", "TTFT ms", "latency s"):
        table.add_column(col, justify="left" if col in ("category", "finish") else "right")

    def rate(a: int, d: int) -> str:
        return f"{a / d:.2f}" if d else "-"

    for r in results:
        table.add_row(r.record.prompt_id, r.record.category, str(r.prompt_tokens), str(r.completion_tokens),
                      r.finish_reason, str(r.num_draft_tokens), str(r.num_accepted_tokens),
                      rate(r.num_accepted_tokens, r.num_draft_tokens),
                      f"{(r.completion_tokens - 1) / r.num_verify_steps:.2f}" if r.num_verify_steps else "-",
                      f"{r.ttft_s * 1e3:.0f}", f"{r.latency_s:.2f}")
    tokens = sum(r.completion_tokens for r in results)
    drafted = sum(r.num_draft_tokens for r in results)
    accepted = sum(r.num_accepted_tokens for r in results)
    steps = sum(r.num_verify_steps for r in results)
    emitted_after_first = sum(r.completion_tokens - 1 for r in results if r.completion_tokens)
    table.add_section()
    table.add_row("total", f"{len(results)} prompts", str(sum(r.prompt_tokens for r in results)), str(tokens), "",
                  str(drafted), str(accepted), rate(accepted, drafted),
                  f"{emitted_after_first / steps:.2f}" if steps else "-",
                  f"p50 {statistics.median(r.ttft_s for r in results) * 1e3:.0f}",
                  f"p50 {statistics.median(r.latency_s for r in results):.2f}")
    console.print(table)
    console.print(f"{tokens} output tokens in {wall:.1f} s: {tokens / wall:.1f} tok/s over the batch; acceptance "
                  f"{rate(accepted, drafted)}, mean accepted length "
                  f"{emitted_after_first / steps if steps else 1.0:.2f} tokens per verification step",
                  highlight=False)
    total = SpecDecodeStats()
    for r in results:
        total.merge(r.spec)
    for line in draft_length_lines(total, config.policy, config.num_draft_tokens):
        console.print(line, highlight=False)
