"""The Ray Serve application (``services.router.deployment:build_app``) on a local 2-CPU Ray:
it starts, answers the OpenAI API through Serve's HTTP proxy with the in-process engine's
greedy output (router replica -> two verifier replicas and a drafter replica over their own
gRPC servers), and shuts down."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import spec_bench_prompts

from tandem.drafters import NgramDrafter
from tandem.engine import Engine
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent


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
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_serve_app_starts_serves_and_shuts_down(ray_local, tiny_checkpoint):
    from services.router.deployment import build_app

    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    app = build_app({"model": model, "drafter": "ngram", "max_batch_size": 4, "max_seq_len": 256,
                     "verifier_replicas": 2, "host": "127.0.0.1"})  # loopback only in tests
    serve.run(app, name="tandem", route_prefix="/", blocking=False)
    client = openai.OpenAI(base_url=f"{ray_local}/v1", api_key="none", max_retries=0, timeout=120)
    prompts = spec_bench_prompts(2)
    engine = Engine(model, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=256), drafter=NgramDrafter(),
                    num_draft_tokens=4)
    model_id = client.models.list().data[0].id
    for prompt in prompts:
        ref = engine.generate([prompt], SamplingParams(max_tokens=16))[0]
        r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=16, temperature=0)
        assert r.choices[0].message.content == ref.text
        assert r.usage.model_extra["speculative_decoding"]["num_verify_steps"] == ref.spec.num_steps
        chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0,
            stream=True) if c.choices]
        assert "".join(chunks) == ref.text
    import json
    import urllib.request

    with urllib.request.urlopen(f"{ray_local}/health", timeout=10) as r:  # one engine per verifier replica
        verifiers = json.loads(r.read())["verifiers"]
    assert len(verifiers) == 2 and len({v["address"] for v in verifiers}) == 2 and all(v["healthy"] for v in verifiers)
    status = serve.status().applications["tandem"]
    assert status.status == "RUNNING"
    assert set(status.deployments) == {"RouterDeployment", "VerifierDeployment", "DrafterDeployment"}
    serve.delete("tandem")
    assert "tandem" not in serve.status().applications
