"""Serving commands: ``tandem serve verifier | drafter | router`` (one service per process) and
``tandem demo`` (the three on loopback, prompts through the OpenAI API: ``make run``)."""

from __future__ import annotations

import logging
import os

import click

from services.demo import run_demo
from services.launch import StackConfig

from ..data import bundled_spec_bench, load_prompts
from ..speculation import SpeculativeConfig
from .common import console, device_option, fail, model_option


@click.group()
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
    from services.processes import run_verifier  # torch

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
    from services.processes import run_drafter  # torch

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
              help="Draft lengths: fixed k, or adaptive (threshold controller + verifier cost model) over exp(-entropy) "
                   "or the learned predictor.")
@click.option("--predictor", default=None, metavar="PATH", help="Predictor for --policy predictor.")
@click.option("--redis-url", default=None, envvar="TANDEM_REDIS_URL",
              help="Shared state store (env TANDEM_REDIS_URL); in-memory when unset.")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--drafter-timeout", type=click.FloatRange(min=0.01), default=10.0, show_default=True,
              help="Seconds to wait for one round of drafts before decoding target-only.")
@click.option("--verifier-timeout", type=click.FloatRange(min=0.1), default=120.0, show_default=True,
              help="Seconds to wait for one verify batch before failing its requests (a hung verifier replica): "
                   "allow a cold replica's first batches, which capture CUDA graphs.")
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="Draft the next round while the verifier checks this one (used where the guess holds).")
@key_option
def serve_router(verifiers, drafter, model, model_name, http_port, grpc_port, host, num_draft_tokens, policy,
                 predictor, redis_url, default_max_tokens, drafter_timeout, verifier_timeout, overlap, api_key) -> None:
    """The router: OpenAI-compatible HTTP and tandem.v1.Router gRPC over remote drafter and verifiers."""
    from services.processes import run_router  # torch
    from services.router.core import RouterConfig, remote_speculation

    config = RouterConfig(list(verifiers), drafter, model, model_name,
                          speculation=remote_speculation(drafter, num_draft_tokens, policy, predictor),
                          redis_url=redis_url, drafter_timeout_s=drafter_timeout, verifier_timeout_s=verifier_timeout,
                          overlap=overlap)
    run_router(config, http_port, grpc_port, host, api_key, default_max_tokens)


@click.command()
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
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep each process's log here (default: a temporary directory, removed on exit).")
def demo(prompts_file, limit, model, drafter, draft_model, num_draft_tokens, max_tokens, temperature, concurrency,
         max_batch_size, max_seq_len, overlap, log_dir) -> None:
    """Start verifier, drafter and router as separate processes on loopback, send prompts through
    /v1/chat/completions with the openai client, print tokens, acceptance, latency and one
    answer, stop."""
    records = load_prompts(prompts_file or bundled_spec_bench(), limit)
    spec = SpeculativeConfig(drafter, draft_model=draft_model, num_draft_tokens=num_draft_tokens)
    config = StackConfig.serving(spec, model=model, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                 redis_url=os.environ.get("TANDEM_REDIS_URL"), overlap=overlap, log_dir=log_dir)
    try:
        run_demo(records, config, max_tokens, concurrency, temperature, console)
    except (RuntimeError, TimeoutError) as exc:
        fail(str(exc))

