"""Serving commands: ``tandem serve verifier | drafter | router`` (one service per process) and
``tandem demo`` (the three on loopback, prompts through the OpenAI API: ``make run``)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import click

from services.demo import run_demo
from services.launch import StackConfig

from ..data import bundled_spec_bench, load_prompts, round_robin_by_category, spec_bench_task
from ..speculation import SpeculativeConfig
from .common import (console, device_option, dtype_option, fail, finite, graph_options, host_port, kernels_option,
                     model_option, policy_option, speculative_config, torch_dtype, with_admission_options)


@click.group()
def serve() -> None:
    """Run one Tandem service (drafter, verifier, router) as a standalone process.

    Start order: a drafter service if any, then the verifier replica(s), then the router (it asks
    the replicas for their model at start-up). Services log their own INFO lines (a "gRPC serving
    <services> on HOST:PORT" line when ready, a replica's drafter and policy); -v adds the
    libraries' INFO lines (the router's HTTP server: a line per request)."""
    for name in ("services", "tandem"):
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)


host_option = click.option("--host", default="127.0.0.1", show_default=True, help="Bind address.")
def _api_key(ctx: click.Context, param, value: str | None) -> str | None:
    """Option callback: a bearer token is non-empty and has no surrounding whitespace (an empty one
    would serve without auth while looking like it asks for it)."""
    if value is not None and (not value.strip() or value != value.strip()):
        raise click.BadParameter("must be a non-empty token without surrounding whitespace; omit --api-key "
                                 "(and TANDEM_API_KEY) to serve without auth", ctx=ctx, param=param)
    return value


key_option = click.option("--api-key", default=None, envvar="TANDEM_API_KEY", callback=_api_key,
                          help="Require this bearer token on HTTP and gRPC (env TANDEM_API_KEY; without one, "
                               "no auth).")


@serve.command("verifier")
@model_option
@device_option
@click.option("--port", type=click.IntRange(min=1, max=65535), required=True, help="gRPC port.")
@host_option
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None, help="KV cache slots (default per device).")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--drafter", type=click.Choice(["none", "ngram", "specformer", "draft-model"]), default=None,
              help="The drafter, run in this replica (SpecFormer inside the verify pass) [default: ngram]; "
                   "--drafter-address drafts through a drafter service instead.")
@click.option("--draft-model", default=None, metavar="PATH|truncate:N",
              help="Weights for --drafter specformer / draft-model (default with the bundled target: the shipped ones).")
@click.option("--drafter-address", default=None, metavar="HOST:PORT", callback=host_port,
              help="A drafter service (tandem serve drafter) to draft with, e.g. a draft model on a cheaper GPU.")
@click.option("--num-draft-tokens", type=click.IntRange(min=1, max=16), default=4, show_default=True)
@policy_option
@click.option("--predictor", default=None, metavar="PATH|auto", help="Predictor for --policy predictor.")
@click.option("--measure-cost/--no-measure-cost", default=False, show_default=True,
              help="Time the verifier cost model T(b, q) at start-up (--policy batch-width needs it): adaptive "
                   "policies allocate draft tokens "
                   "across the batch under it, and routers budget this replica's draft width with it (a fixed-k "
                   "replica needs it for that).")
@click.option("--redis-url", default=None, envvar="TANDEM_REDIS_URL",
              help="State store for the threshold, acceptance counters and verification logs (env "
                   "TANDEM_REDIS_URL); in-memory when unset.")
@click.option("--drafter-timeout", type=click.FloatRange(min=0.01), default=10.0, show_default=True, callback=finite,
              help="Seconds to wait for one round from the drafter service before decoding target-only.")
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="Ask the drafter service for the next round while the target verifies this one.")
# default: services.processes.GIL_SWITCH_INTERVAL_S (a test keeps them equal; the CLI imports the stack lazily)
@click.option("--gil-switch-interval", type=click.FloatRange(min=1e-6, max=1.0), default=5e-4, show_default=True,
              envvar="TANDEM_GIL_SWITCH_INTERVAL", callback=finite, metavar="SECONDS",
              help="The replica process's GIL switch interval (sys.setswitchinterval; Python's default is 0.005): "
                   "how long its engine thread can wait for the interpreter while the gRPC thread holds it.")
@click.option("--metrics-port", type=click.IntRange(min=1, max=65535), default=None,
              help="Serve this replica's Prometheus metrics on http://HOST:PORT/metrics.")
@click.option("--capture-rounds/--no-capture-rounds", default=True, show_default=True,
              help="With CUDA graphs: capture every decode-round shape's graph (batch bucket x context bucket) "
                   "at start-up, a few seconds, so no request waits on a capture once serving.")
@with_admission_options
@dtype_option
@kernels_option
@graph_options
@key_option
def serve_verifier(model, device, port, host, max_batch_size, max_seq_len, drafter, draft_model, drafter_address,
                   num_draft_tokens, policy, predictor, measure_cost, redis_url, drafter_timeout, overlap,
                   gil_switch_interval, metrics_port, capture_rounds, admission_share, admission_wait_rounds, admission_overlap,
                   admission_intake_ms, dtype,
                   kernels, cuda_graphs, compile_, prefill_graphs, prefill_varlen, api_key) -> None:
    """A verifier replica: the target model and the engine loop over it (scheduler, KV slots,
    drafts, verification), serving whole requests over tandem.v1.Verifier."""
    from services.processes import run_verifier  # torch

    if drafter_address and (drafter or draft_model):
        raise click.UsageError("--drafter-address drafts through the drafter service there: give it without "
                               "--drafter / --draft-model (the service's own options choose its drafter)")
    spec = speculative_config("remote" if drafter_address else drafter or "ngram", draft_model, num_draft_tokens,
                              predictor, policy=policy)
    replace(spec, cost_model=measure_cost)  # what the replica runs (run_verifier): checked before anything loads
    runner = dict(dtype=torch_dtype(dtype), kernels=kernels, cuda_graphs=cuda_graphs, compile=compile_,
                  prefill_graphs=prefill_graphs, prefill_varlen=prefill_varlen)
    run_verifier(spec, model, device, port, host, max_batch_size, max_seq_len, drafter_address=drafter_address,
                 drafter_timeout_s=drafter_timeout, redis_url=redis_url, overlap=overlap, measure_cost=measure_cost,
                 metrics_port=metrics_port, key=api_key, runner=runner, gil_switch_interval_s=gil_switch_interval,
                 capture_rounds=capture_rounds,
                 admission=(admission_share, admission_wait_rounds, admission_overlap, admission_intake_ms / 1e3))


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
    from services.processes import run_drafter  # torch

    run_drafter(drafter, draft_model, model, device, port, host, max_sequences, max_seq_len, api_key, predictor)


@serve.command("router")
@click.option("--verifier", "verifiers", multiple=True, required=True, metavar="HOST:PORT", callback=host_port,
              help="A verifier replica (repeatable); each request goes to the least loaded healthy one.")
@click.option("--model", "model", default=None, metavar="PATH",
              help="The replicas' model (GGUF file or HF directory), for its tokenizer (default: the replicas' model "
                   "path when it is readable here, else the bundled SmolLM2 if that is what they serve).")
@click.option("--model-name", default=None, help="Model id in /v1/models (default: the verifier's model file name).")
@click.option("--port", "http_port", type=click.IntRange(min=1, max=65535), required=True, help="HTTP port.")
@click.option("--grpc-port", type=click.IntRange(min=1, max=65535), default=None, help="gRPC Router.Generate port.")
@host_option
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--verifier-timeout", type=click.FloatRange(min=0.2), default=10.0, show_default=True, callback=finite,
              help="Seconds a verifier replica may leave keepalive pings unanswered before it counts as hung: its "
                   "requests resume on another replica.")
@click.option("--failover-wait", type=click.FloatRange(min=0), default=30.0, show_default=True, callback=finite,
              help="Seconds a request whose replicas all failed waits for one to come back before it fails.")
@key_option
def serve_router(verifiers, model, model_name, http_port, grpc_port, host, default_max_tokens, verifier_timeout,
                 failover_wait, api_key) -> None:
    """The router: OpenAI-compatible HTTP and tandem.v1.Router gRPC, sending each request to a
    verifier replica chosen by load (no per-request state survives it)."""
    from services.processes import run_router  # torch
    from services.router.core import RouterConfig

    config = RouterConfig(list(verifiers), model, model_name, verifier_timeout_s=verifier_timeout,
                          failover_wait_s=failover_wait)
    run_router(config, http_port, grpc_port, host, api_key, default_max_tokens)


@click.command()
@click.option("--prompts-file", type=click.Path(dir_okay=False), default=None,
              help="JSONL of prompts (default: the bundled Spec-Bench questions).")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="Prompts to send, taken round-robin over the file's Spec-Bench tasks (file order within one).")
@model_option
@click.option("--drafter", type=click.Choice(["none", "ngram", "specformer", "draft-model"]), default="ngram",
              show_default=True, help="Runs in the verifier replica; draft-model runs as a drafter service of its own.")
@click.option("--draft-model", default=None, metavar="PATH|truncate:N")
@click.option("--num-draft-tokens", type=click.IntRange(min=1, max=16), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0, max=2), default=0.0, show_default=True,
              callback=finite, help="Sampling temperature, as the API takes it.")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests in flight at once (the verifier replica batches them).")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Verifier KV slots.")
@click.option("--max-seq-len", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="The replica asks the drafter service for the next round while the target verifies this one.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep each process's log here (default: a temporary directory, removed on exit).")
def demo(prompts_file, limit, model, drafter, draft_model, num_draft_tokens, max_tokens, temperature, concurrency,
         max_batch_size, max_seq_len, overlap, log_dir) -> None:
    """Start a verifier replica, the router and (for draft-model) a drafter service as separate
    processes on loopback, send prompts through
    /v1/chat/completions with the openai client, print tokens, acceptance, latency and one
    answer, stop."""
    if max_tokens >= max_seq_len:
        fail(f"--max-tokens {max_tokens} leaves no room for a prompt in the context limit (--max-seq-len "
             f"{max_seq_len}): each request needs prompt + max tokens <= {max_seq_len}")
    for flag, path in (("--model", model), ("--draft-model", draft_model)):
        if path is not None and not path.startswith("truncate:") and not Path(path).expanduser().exists():
            fail(f"{flag} {path!r} does not exist")
    # round-robin over the Spec-Bench tasks, as the bench takes them: the first 20 rows of the
    # bundled file are all writing and roleplay, where prompt lookup finds little to draft
    records = round_robin_by_category(load_prompts(prompts_file or bundled_spec_bench()), limit,
                                      key=lambda r: spec_bench_task(r.category))
    if not records:
        fail(f"the prompts file {prompts_file} has no prompts")
    spec = SpeculativeConfig(drafter, draft_model=draft_model, num_draft_tokens=num_draft_tokens)
    config = StackConfig.serving(spec, model=model, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                 redis_url=os.environ.get("TANDEM_REDIS_URL"), overlap=overlap, log_dir=log_dir)
    try:
        run_demo(records, config, max_tokens, concurrency, temperature, console)
    except (RuntimeError, TimeoutError) as exc:
        fail(str(exc))

