"""The Ray Serve application (``services.router.deployment:build_app``) on a local 2-CPU Ray,
deployed from ``infra/serve_config.yaml`` the way ``serve deploy`` / ``serve run`` apply a config
(GPU placement removed, a tiny model): it starts, answers the OpenAI API through Serve's HTTP proxy
with the in-process engine's greedy output (router replica -> verifier replicas, each running the
engine loop behind its own gRPC server; with ``drafter: draft-model`` -> a drafter service replica
that the verifier replica calls), and shuts down. Skipped without ray[serve] and openai."""

from __future__ import annotations

import copy
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import spec_bench_prompts
from test_infra import SERVE_CONFIG, load, with_drafter_service

from tandem.drafters import NgramDrafter
from tandem.engine import Engine
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
APP = "tandem"


@pytest.fixture(scope="module")
def ray_local():
    import shutil
    import tempfile

    from services.launch import free_port

    # Ray workers import services/ and tandem/ from this checkout.
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    # Ray's session files (logs, sockets) in a directory of this run, removed after: nothing left in /tmp/ray
    # (short: its socket paths must stay under the 107-byte limit)
    temp_dir = tempfile.mkdtemp(prefix="ray-")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False, _temp_dir=temp_dir)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def local_config(config: dict, port: int, **args) -> dict:
    """``config`` for this machine: Serve's HTTP on ``port``, every replica on a quarter of a CPU
    and no GPU (the config's CPU-only fallback), the application's ``args`` updated with ``args``
    and bound to loopback."""
    config = copy.deepcopy(config)
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    [app] = config["applications"]
    app["args"].update(host="127.0.0.1", **args)
    for d in app["deployments"]:
        d["ray_actor_options"] = {"num_cpus": 0.25, "num_gpus": 0}
    return config


def deploy(config: dict, timeout_s: float = 240.0):
    """Apply ``config`` as ``serve deploy`` does and wait until the application is RUNNING or has
    failed; returns its status."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(APP)
        if status is not None and status.status in ("RUNNING", "DEPLOY_FAILED"):
            return status
        assert time.monotonic() < deadline, f"{APP} not running after {timeout_s:.0f} s: {status}"
        time.sleep(0.5)


def delete() -> None:
    serve.delete(APP)
    assert APP not in serve.status().applications


def health(port: int, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/health", headers=headers),
                                timeout=10) as r:
        return json.loads(r.read())


def check_greedy_answers(port: int, engine: Engine, prompts: list[str], key: str = "none",
                         same_steps: bool = True) -> list:
    """Chat completions (whole and streamed) through Serve equal ``engine``'s greedy output; with
    ``same_steps`` also its verify steps. Returns the usage of each whole answer."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
    model_id = client.models.list().data[0].id
    usages = []
    for prompt in prompts:
        ref = engine.generate([prompt], SamplingParams(max_tokens=16))[0]
        messages = [{"role": "user", "content": prompt}]
        r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=16, temperature=0)
        assert r.choices[0].message.content == ref.text
        spec = r.usage.model_extra["speculative_decoding"]
        if same_steps:
            assert spec["num_verify_steps"] == ref.spec.num_steps
        usages.append(spec)
        chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=16, temperature=0, stream=True) if c.choices]
        assert "".join(chunks) == ref.text
    return usages


def test_build_app_binds_a_drafter_service_only_for_a_model_drafter():
    from test_infra import bound_deployments

    from services.router.deployment import build_app
    from tandem.errors import ConfigError

    engine_only = {"RouterDeployment", "VerifierDeployment"}
    for args, expected in [({}, engine_only), ({"drafter": "specformer"}, engine_only),
                           ({"drafter": "none"}, engine_only),
                           ({"drafter": "draft-model"}, engine_only | {"DrafterDeployment"}),
                           ({"drafter": "draft-model", "drafter_service": False}, engine_only),
                           ({"drafter": "ngram", "drafter_service": True}, engine_only | {"DrafterDeployment"})]:
        assert bound_deployments(build_app(args)) == expected, args
    with pytest.raises(ConfigError, match="no drafter service"):  # SpecFormer drafts inside the verify pass
        build_app({"drafter": "specformer", "drafter_service": True})
    with pytest.raises(ConfigError, match="needs a --drafter"):
        build_app({"drafter": "none", "policy": "entropy"})
    import pydantic

    for bad in ({"num_draft_tokens": "many"}, {"drafter": "eagle"}, {"speculation": "ngram"}):
        with pytest.raises(pydantic.ValidationError):
            build_app(bad)


def test_serve_config_with_an_in_replica_drafter(ray_local, tiny_checkpoint):
    """The config as written: two verifier replicas drafting in-replica (n-gram here: the tiny
    model has no SpecFormer head), a CPU router, no drafter deployment."""
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    config = local_config(load(SERVE_CONFIG), ray_local, model=model, drafter="ngram", max_batch_size=4,
                          max_seq_len=256)
    [app] = config["applications"]
    assert app["args"]["verifier_replicas"] == 2
    status = deploy(config)
    assert status.status == "RUNNING", status.message
    assert set(status.deployments) == {"RouterDeployment", "VerifierDeployment"}
    engine = Engine(model, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=256), drafter=NgramDrafter(),
                    num_draft_tokens=4)
    check_greedy_answers(ray_local, engine, spec_bench_prompts(2))
    h = health(ray_local)
    verifiers = h["verifiers"]  # one engine per verifier replica
    assert len(verifiers) == 2 and len({v["address"] for v in verifiers}) == 2 and all(v["healthy"] for v in verifiers)
    assert all("drafter=ngram" in v["speculation"] for v in verifiers) and h["drafter"] is None
    delete()


def test_serve_config_entry_for_an_unbound_deployment_is_refused(ray_local, tiny_checkpoint):
    """Why the config keeps the drafter service's entry commented: with an in-replica drafter the
    application creates no DrafterDeployment, and Serve refuses options for it."""
    config = with_drafter_service(SERVE_CONFIG.read_text())
    config = local_config(config, ray_local, model=str(tiny_checkpoint("llama", with_tokenizer=True)),
                          drafter="ngram")
    status = deploy(config)
    assert status.status == "DEPLOY_FAILED" and "'DrafterDeployment' does not exist" in status.message
    delete()


def test_serve_config_with_a_draft_model_drafter_service(ray_local, tiny_checkpoint):
    """The config with its drafter service enabled (``drafter: draft-model``): the verifier replica
    drafts through a DrafterDeployment replica, with the services' bearer token between them."""
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    key = "serve-secret"
    config = local_config(with_drafter_service(SERVE_CONFIG.read_text()), ray_local, model=model,
                          draft_model="truncate:1", max_batch_size=4, max_seq_len=256, verifier_replicas=1,
                          api_key=key)
    for d in config["applications"][0]["deployments"]:
        if "num_replicas" in d:
            d["num_replicas"] = 1
    status = deploy(config)
    assert status.status == "RUNNING", status.message
    assert set(status.deployments) == {"RouterDeployment", "VerifierDeployment", "DrafterDeployment"}
    target_only = Engine(model, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=256))
    usages = check_greedy_answers(ray_local, target_only, spec_bench_prompts(2), key=key, same_steps=False)
    assert sum(u["num_draft_tokens"] for u in usages) > 0  # the drafter service drafted
    h = health(ray_local, key)
    [verifier] = h["verifiers"]
    assert verifier["healthy"] and "drafter=remote" in verifier["speculation"]
    assert h["drafter"] is not None and h["drafter"]["available"]
    delete()
