"""Deployment files: they parse, agree with each other, name the right keys, and every import path
and CLI flag they use exists (once the serving code, services/, is in the tree)."""

from __future__ import annotations

import http.server
import importlib
import re
import shutil
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "infra" / "serve_config.yaml"
RAYSERVICE = ROOT / "infra" / "k8s" / "rayservice.yaml"
COLLECTOR = ROOT / "infra" / "otel-collector.yaml"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

ROLES = ("drafter", "verifier", "router")
TANDEM_ENV = {"TANDEM_REDIS_URL", "OTEL_EXPORTER_OTLP_ENDPOINT"}
needs_services = pytest.mark.skipif(not (ROOT / "services").is_dir(),
                                    reason="services/ (the serving code of branch `serve`) is not in this tree yet")


def load(path: Path):
    return yaml.safe_load(path.read_text())


def serve_app(config: dict | None = None) -> dict:
    [app] = (config or load(SERVE_CONFIG))["applications"]
    return app


def deployments(config: dict | None = None) -> dict[str, dict]:
    return {d["name"]: d for d in serve_app(config)["deployments"]}


def role_of(deployment_name: str) -> str:
    """``DrafterDeployment`` -> ``drafter``."""
    return deployment_name.removesuffix("Deployment").lower()


DRAFTER_ENTRY = "# - name: DrafterDeployment"


def with_drafter_service(text: str) -> dict:
    """The Serve config ``text`` as its notes say to run a draft-model drafter service: its
    commented ``DrafterDeployment`` entry uncommented and ``drafter: draft-model``."""
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(DRAFTER_ENTRY))
    indent = " " * (len(lines[start]) - len(lines[start].lstrip()))
    end = start
    while end < len(lines) and lines[end].startswith(indent + "#"):
        lines[end] = indent + lines[end][len(indent) + 2:]  # drop "# "
        end += 1
    config = yaml.safe_load("".join(lines))
    serve_app(config)["args"]["drafter"] = "draft-model"
    return config


# ----------------------------------------------------------------------------- Ray Serve


def test_serve_config_application_and_deployments():
    app = serve_app()
    assert app["import_path"] == "services.router.deployment:build_app"
    assert {"model", "drafter", "num_draft_tokens"} <= set(app["args"])
    # The default drafter runs inside the verifier replicas: no drafter deployment, no GPU for one.
    assert app["args"]["drafter"] in ("none", "ngram", "specformer") and not app["args"].get("drafter_service")
    deps = deployments()
    assert set(deps) == {"VerifierDeployment", "RouterDeployment"}
    for d in deps.values():
        assert "num_replicas" in d or "autoscaling_config" in d
    verifier = deps["VerifierDeployment"]
    router = deps["RouterDeployment"]["ray_actor_options"]
    assert verifier["ray_actor_options"]["num_gpus"] == 1 and verifier["ray_actor_options"]["accelerator_type"] == "A100"
    # The verifier scales on the load its replicas report (Serve's request counts never see it):
    # a policy that reads the replicas' requests per KV slot; the routers wait for the minimum.
    scaling = verifier["autoscaling_config"]
    assert 1 <= scaling["min_replicas"] < scaling["max_replicas"] and "num_replicas" not in verifier
    assert scaling["policy"]["policy_function"] == "services.verifier.deployment:RequestsPerSlotPolicy"
    assert scaling["policy"]["policy_kwargs"]["target_requests_per_slot"] > 0
    assert app["args"]["verifier_replicas"] == scaling["min_replicas"]  # the routers wait for these
    assert router.get("num_gpus", 0) == 0 and "accelerator_type" not in router
    text = SERVE_CONFIG.read_text()
    assert "CPU-only" in text  # the fallback is documented in the file
    # The drafter service's entry, commented, is what `drafter: draft-model` needs: a fraction of a
    # cheaper GPU than the verifier's.
    assert "Deployment 'DrafterDeployment' does not exist" in text  # why the entry stays commented
    with_service = with_drafter_service(text)
    drafter = deployments(with_service)["DrafterDeployment"]
    assert "num_replicas" in drafter or "autoscaling_config" in drafter
    opts = drafter["ray_actor_options"]
    assert 0 < opts["num_gpus"] < 1 and opts["accelerator_type"] not in ("A100", None)
    assert {n: d for n, d in deployments(with_service).items() if n != "DrafterDeployment"} == deps


def test_serve_config_passes_rays_own_schema():
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed")
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    for config in (load(SERVE_CONFIG), with_drafter_service(SERVE_CONFIG.read_text())):
        schema = ServeDeploySchema.model_validate(config)
        assert [a.import_path for a in schema.applications] == [serve_app()["import_path"]]
        for d in deployments(config).values():
            if "autoscaling_config" in d:
                cfg = AutoscalingConfig(**d["autoscaling_config"])  # a custom policy is imported here
                assert cfg.min_replicas <= cfg.max_replicas
                if not cfg.policy.is_default_policy_function():
                    assert cfg.policy.get_serialized_policy_def()


# ----------------------------------------------------------------------------- KubeRay


def test_rayservice_embeds_the_serve_config_and_has_gpu_groups_for_it():
    doc = load(RAYSERVICE)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    assert yaml.safe_load(doc["spec"]["serveConfigV2"]) == load(SERVE_CONFIG)  # no drift between the two
    cluster = doc["spec"]["rayClusterConfig"]
    groups = cluster["workerGroupSpecs"]
    containers = [c for spec in [cluster["headGroupSpec"], *groups] for c in spec["template"]["spec"]["containers"]]
    for c in containers:
        assert TANDEM_ENV <= {e["name"] for e in c["env"]}, c["name"]
    # Every GPU deployment (the drafter service's too, when enabled) finds a worker group with its
    # accelerator, and enough GPUs at max scale; a group that only the drafter service uses starts empty.
    service_only = set()
    for name, d in deployments(with_drafter_service(SERVE_CONFIG.read_text())).items():
        opts = d["ray_actor_options"]
        if not opts.get("num_gpus"):
            continue
        acc = opts["accelerator_type"]
        matching = [g for g in groups if f"accelerator_type:{acc}" in g["rayStartParams"].get("resources", "")]
        assert matching, f"no worker group offers accelerator_type:{acc} for {name}"
        for g in matching:
            assert any(acc in v for v in g["template"]["spec"]["nodeSelector"].values())
        gpus = sum(g["maxReplicas"] * c["resources"]["limits"]["nvidia.com/gpu"]
                   for g in matching for c in g["template"]["spec"]["containers"])
        replicas = d.get("num_replicas") or d["autoscaling_config"]["max_replicas"]
        assert replicas * opts["num_gpus"] <= gpus, f"{name}: {replicas} x {opts['num_gpus']} GPU > {gpus}"
        if name not in deployments():
            service_only |= {g["groupName"] for g in matching}
    assert service_only, "the drafter service's GPU group"
    for g in groups:
        if g["groupName"] in service_only:
            assert g["replicas"] == g["minReplicas"] == 0, f"{g['groupName']} holds GPUs nothing uses by default"


# ----------------------------------------------------------------------------- OpenTelemetry collector


def test_collector_pipeline_sends_traces_to_jaeger_file_and_debug():
    cfg = load(COLLECTOR)
    assert {"grpc", "http"} <= set(cfg["receivers"]["otlp"]["protocols"])
    pipeline = cfg["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert set(pipeline[kind]) <= set(cfg[kind]), f"undefined {kind} in the traces pipeline"
    assert "batch" in pipeline["processors"]
    exporters = {name.split("/")[0]: cfg["exporters"][name] for name in pipeline["exporters"]}
    assert exporters["otlp_grpc"]["endpoint"] == "jaeger:4317"
    assert {"file", "debug"} <= set(exporters)
    assert exporters["file"]["path"].startswith("/traces/")  # the directory docker-compose mounts


# ----------------------------------------------------------------------------- docker compose


def compose() -> dict:
    return load(COMPOSE)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_compose_services_env_healthchecks_and_wiring():
    services = compose()["services"]
    assert {"redis", "otel-collector", "jaeger", *ROLES} <= set(services)
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
    ports = {}
    for role in ROLES:
        svc = services[role]
        assert svc["build"] == "." and "healthcheck" in svc
        env = svc["environment"]
        assert env["TANDEM_REDIS_URL"] == "redis://redis:6379/0"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert svc["command"][:2] == ["serve", role]
        ports[role] = flag(svc["command"], "--port")
        assert ports[role] in " ".join(svc["healthcheck"]["test"])  # the check probes the served port
    router = services["router"]["command"]
    assert flag(router, "--verifier") == f"verifier:{ports['verifier']}"
    assert "--drafter" not in router  # the replicas draft: the router routes whole requests
    assert flag(services["verifier"]["command"], "--drafter-address") == f"drafter:{ports['drafter']}"
    assert flag(services["drafter"]["command"], "--drafter") == "draft-model"
    model = flag(router, "--model-name")  # the name the usage examples send
    assert f'"model": "{model}"' in COMPOSE.read_text() and f'"model": "{model}"' in (ROOT / "README.md").read_text()
    assert "16686:16686" in services["jaeger"]["ports"]
    collector = services["otel-collector"]
    assert "contrib" in collector["image"]
    mounts = dict(v.split(":")[:2] for v in collector["volumes"])  # host path -> container path
    config_in_container = mounts["./infra/otel-collector.yaml"]
    assert (ROOT / "infra" / "otel-collector.yaml").is_file()
    assert f"--config={config_in_container}" in collector["command"]
    trace_dir = str(Path(load(COLLECTOR)["exporters"]["file"]["path"]).parent)
    assert trace_dir in mounts.values()  # the trace file lands on the host, for tandem trace-report


def healthcheck(role: str, port: int) -> subprocess.CompletedProcess:
    """Run ``role``'s compose healthcheck command here, aimed at ``port`` on this machine."""
    svc = compose()["services"][role]
    kind, program, *args = svc["healthcheck"]["test"]
    assert kind == "CMD" and program == "python"
    args = [a.replace(f":{flag(svc['command'], '--port')}", f":{port}") for a in args]
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_grpc_healthchecks_follow_the_standard_health_service(role):
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("grpc_health.v1", reason="grpcio-health-checking is not installed")
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck(role, port).returncode == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck(role, port).returncode != 0
    finally:
        server.stop(None)
    assert healthcheck(role, port).returncode != 0  # nothing listening


def test_router_healthcheck_probes_http_health():
    paths = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            paths.append(self.path)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        assert healthcheck("router", port).returncode == 0 and paths == ["/health"]
    finally:
        server.shutdown()
        server.server_close()
    assert healthcheck("router", port).returncode != 0


def test_dockerfile_builds_the_services_image():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=\S*/cpu$", text, re.M)  # CPU torch unless told otherwise
    assert 'ENTRYPOINT ["tandem"]' in text
    assert compose()["services"]["router"]["build"] == "."
    # KubeRay's default probes are `bash -c "wget ... | grep success"` in the Ray containers (the image
    # of infra/k8s/rayservice.yaml): the slim base has bash but not wget
    assert re.search(r"apt-get install -y --no-install-recommends wget", text)
    assert "tandem:0.1.0" in (ROOT / "infra" / "k8s" / "rayservice.yaml").read_text()


def compose_cli() -> list[str] | None:
    """``docker compose`` (v2 plugin) or ``docker-compose``, whichever is installed; None if neither."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def test_docker_compose_config_validates():
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    res = subprocess.run([*cli, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)  # schema validation only: no daemon needed
    assert res.returncode == 0, res.stderr


# ----------------------------------------------------------------------------- import paths and CLI flags


def import_path_target(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@needs_services
def test_every_import_path_names_a_real_attribute():
    assert callable(import_path_target(serve_app()["import_path"]))
    for name in deployments(with_drafter_service(SERVE_CONFIG.read_text())):
        target = import_path_target(f"services.{role_of(name)}.deployment:{name}")
        if hasattr(target, "name"):  # a Ray Serve Deployment: its name is what the config refers to
            assert target.name == name


def bound_deployments(app) -> set[str]:
    """Names of the deployments a Serve ``Application`` binds (its ingress and those it is given)."""
    from ray.serve.deployment import Application

    d = app._bound_deployment
    names = {d.name}
    for arg in [*d.init_args, *d.init_kwargs.values()]:
        if isinstance(arg, Application):
            names |= bound_deployments(arg)
    return names


@needs_services
def test_config_entries_are_the_deployments_the_app_binds():
    """Ray Serve refuses options for a deployment the application does not create, so the entries of
    the config, as written and with the drafter service enabled, are exactly what ``build_app``
    binds for its args."""
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed")
    for config in (load(SERVE_CONFIG), with_drafter_service(SERVE_CONFIG.read_text())):
        build_app = import_path_target(serve_app(config)["import_path"])
        assert bound_deployments(build_app(serve_app(config)["args"])) == set(deployments(config))


@needs_services
def test_compose_commands_use_real_cli_flags():
    from tandem.cli import main

    assert "serve" in main.commands, "tandem serve is missing"
    serve = main.commands["serve"]
    for role in ROLES:
        command = compose()["services"][role]["command"]
        sub = serve.commands[role]
        options = {o for p in sub.params for o in p.opts}
        used = {a for a in command[2:] if a.startswith("--")}
        assert used <= options, f"tandem serve {role}: unknown {sorted(used - options)}"
