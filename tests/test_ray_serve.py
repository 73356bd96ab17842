"""The Ray Serve application (``services.router.deployment:build_app``) on a local 2-CPU Ray,
deployed from ``infra/serve_config.yaml`` the way ``serve deploy`` / ``serve run`` apply a config
(a tiny model on the CPU): it starts, answers the OpenAI API through Serve's HTTP proxy with the
in-process engine's greedy output (router replica -> verifier replicas, each running the engine
loop behind its own gRPC server; with ``drafter: draft-model`` -> a drafter service replica that
the verifier replica calls), and shuts down.

The config's GPU placement is kept: the local node declares stand-in GPUs and the custom resources
Ray derives from ``accelerator_type`` (``accelerator_type:A100``, ``accelerator_type:L4``), and each
replica's actor is checked to hold what its deployment's ``ray_actor_options`` name. The verifier
deployment's autoscaling is checked end to end: load put on its replica through the router (more
requests than KV slots) raises the replica count, and the router takes the new replica in.
Skipped without ray[serve] and openai."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

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
# The local node's stand-ins for GPU nodes: GPUs (Ray counts what it is told) and the resources that
# ``accelerator_type: A100`` / ``L4`` in ``ray_actor_options`` require (0.001 of
# ``accelerator_type:<name>`` per actor, besides ``num_gpus``).
NUM_GPUS = 3
GPU_CLASSES = {"accelerator_type:A100": 3.0, "accelerator_type:L4": 1.0}


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
    ray.init(num_cpus=2, num_gpus=NUM_GPUS, resources=dict(GPU_CLASSES), include_dashboard=False, log_to_driver=False,
             configure_logging=False, _temp_dir=temp_dir)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def local_config(config: dict, port: int, **args) -> dict:
    """``config`` for this machine: Serve's HTTP on ``port``, every replica on a quarter of a CPU
    (its GPU options kept: ``ray_local``'s node has stand-ins for them; the engines run on the
    CPU), the application's ``args`` updated with ``args`` and bound to loopback."""
    config = copy.deepcopy(config)
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    [app] = config["applications"]
    app["args"].update(host="127.0.0.1", device="cpu", **args)
    for d in app["deployments"]:
        d["ray_actor_options"] = {**d.get("ray_actor_options", {}), "num_cpus": 0.25}
    return config


def replica_resources() -> dict[str, list[dict[str, float]]]:
    """What Ray reserved for each live replica actor of the application (its actor's required
    resources, from the GCS actor table), by deployment name."""
    from ray._private import state
    from ray.core.generated import gcs_pb2

    found = defaultdict(list)
    prefix = f"ServeReplica:{APP}:"
    for actor_id, actor in state.actors(actor_state_name="ALIVE").items():
        if actor["ActorClassName"].startswith(prefix):
            info = gcs_pb2.ActorTableData.FromString(state.state.get_actor_info(ray.ActorID(bytes.fromhex(actor_id))))
            found[actor["ActorClassName"][len(prefix):]].append(dict(info.required_resources))
    return dict(found)


def check_placement(config: dict, replicas: dict[str, int]) -> None:
    """Each deployment of ``config`` has ``replicas[name]`` live replicas, each on an actor that
    holds what the deployment's ``ray_actor_options`` name: its GPUs, and the resource of its
    ``accelerator_type`` (a resource this node offers) and no other GPU class; none for a CPU
    deployment."""
    held = replica_resources()
    assert {name: len(r) for name, r in held.items()} == replicas
    node = ray.cluster_resources()
    for d in config["applications"][0]["deployments"]:
        opts = d["ray_actor_options"]
        for r in held.get(d["name"], []):
            assert r.get("GPU", 0) == opts.get("num_gpus", 0), (d["name"], r)
            classes = {k for k in r if k.startswith("accelerator_type:")}
            if opts.get("accelerator_type"):
                assert classes == {f"accelerator_type:{opts['accelerator_type']}"}, (d["name"], r)
                assert all(node.get(k, 0) > 0 for k in classes)
            else:
                assert not classes and "GPU" not in r, (d["name"], r)


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


@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")  # still its knob in Ray 2.x
def test_serve_config_with_an_in_replica_drafter(ray_local, tiny_checkpoint):
    """The config as written: two verifier replicas drafting in-replica (n-gram here: the tiny
    model has no SpecFormer head), a CPU router, no drafter deployment; each replica on what its
    ``ray_actor_options`` name. Then the verifier's autoscaling on the load its replicas report:
    light traffic keeps the minimum; more long requests than KV slots (through the router, which
    spreads them over both replicas) raise the count (the config's policy and target, bounded
    here by the node's three stand-in GPUs), the new replica lands on a GPU of the verifier's class
    and the router takes it in."""
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    config = local_config(load(SERVE_CONFIG), ray_local, model=model, drafter="ngram", max_batch_size=4,
                          max_seq_len=2048)
    [app] = config["applications"]
    assert app["args"]["verifier_replicas"] == 2
    scaling = next(d for d in app["deployments"] if d["name"] == "VerifierDeployment")["autoscaling_config"]
    assert scaling["min_replicas"] == 2
    # the config's policy, target and minimum; the node's GPUs as maximum, and a fast control loop:
    # a load report every 0.2 s, pushed every 0.25 s, averaged over 1 s, acted on at once
    scaling.update(max_replicas=NUM_GPUS, upscale_delay_s=0, look_back_period_s=1, metrics_interval_s=0.25)
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
    check_placement(config, {"RouterDeployment": 1, "VerifierDeployment": 2})

    # one request at a time (above) is a quarter of a replica's slots: still the minimum
    assert verifier_replicas() == {"RUNNING": 2}
    states = load_until_scaled_up(ray_local, 16)  # 8 per replica: 2 requests per slot
    assert set(states) <= {"STARTING", "RUNNING"} and sum(states.values()) == 3, states
    deadline = time.monotonic() + 120
    while True:  # the new replica runs, the router sends to it, and the cancelled requests freed their slots
        verifiers = health(ray_local)["verifiers"]
        if verifier_replicas() == {"RUNNING": 3} and len(verifiers) == 3 and all(v["healthy"] for v in verifiers) \
                and not any(v["running"] or v["waiting"] for v in verifiers):
            break
        assert time.monotonic() < deadline, (verifier_replicas(), verifiers)
        time.sleep(0.5)
    assert len({v["address"] for v in verifiers}) == 3
    check_placement(config, {"RouterDeployment": 1, "VerifierDeployment": 3})
    delete()


def verifier_replicas() -> dict[str, int]:
    """Serve's count of the verifier deployment's replicas, by state."""
    return dict(serve.status().applications[APP].deployments["VerifierDeployment"].replica_states)


def load_until_scaled_up(port: int, n: int, timeout_s: float = 60.0) -> dict[str, int]:
    """Send ``n`` long completions (greedy, past EOS, up to 2000 tokens) through Serve's HTTP at
    once and wait until Serve shows more verifier replicas (starting or running) than before;
    then cancel them. Asserts the scale-up came within ``timeout_s`` while every request was still
    running. Returns the replica states then."""
    before = sum(verifier_replicas().values())

    async def run() -> dict[str, int]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        model_id = (await client.models.list()).data[0].id
        tasks = [asyncio.create_task(client.completions.create(
            model=model_id, prompt="Count:", max_tokens=2000, temperature=0, extra_body={"ignore_eos": True}))
            for _ in range(n)]
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                await asyncio.sleep(0.2)
                states = await asyncio.to_thread(verifier_replicas)
                if sum(states.values()) > before:
                    assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]  # under load
                    return states
                assert time.monotonic() < deadline, f"no scale-up in {timeout_s:.0f} s: {states}, {health(port)}"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()

    return asyncio.run(run())


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
        if d["name"] == "VerifierDeployment":
            d["autoscaling_config"].update(min_replicas=1)
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
    # the draft model on its cheaper GPU class, the target on its own
    check_placement(config, {"RouterDeployment": 1, "VerifierDeployment": 1, "DrafterDeployment": 1})
    delete()


def test_requests_per_slot_policy():
    """The verifier's autoscaling policy: the replicas' summed requests per KV slot over the target
    (Serve bounds, delays and rounds what it returns)."""
    from services.verifier.deployment import LOAD_METRIC, RequestsPerSlotPolicy

    def ctx(loads: dict, running=("a", "b"), target=2):
        return SimpleNamespace(aggregated_metrics={LOAD_METRIC: loads} if loads is not None else {},
                               running_replicas=list(running), current_num_replicas=len(running),
                               target_num_replicas=target)

    policy = RequestsPerSlotPolicy(target_requests_per_slot=0.5)
    assert policy(ctx({"a": 1.0, "b": 0.5}))[0] == 3.0  # waiting requests: more replicas
    assert policy(ctx({"a": 0.25, "b": 0.0}))[0] == 0.5  # idle slots: fewer
    assert policy(ctx({"a": 1.0, "gone": 4.0}))[0] == 2.0  # a stopped replica's last report is not load
    assert policy(ctx(None))[0] == 2 and policy(ctx({}, running=(), target=1))[0] == 1  # no report: keep
    with pytest.raises(ValueError):
        RequestsPerSlotPolicy(target_requests_per_slot=0)

