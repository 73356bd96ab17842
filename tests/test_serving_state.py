"""The router's shared state (``tandem.state``) across a Redis outage: requests keep being served
on local state, /health says so, and every write made during the outage reaches Redis when it
returns (acceptance counters per drafter and category, the verification-log stream).

Each test runs its own ``redis-server`` on a free loopback port (skipped without the binary)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

import pytest
from conftest import spec_bench_prompts

from services.launch import StackConfig, free_port, start_stack
from tandem.state import FallbackStore, RedisStore

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


class RedisProcess:
    """A throwaway redis-server (no persistence) that can be stopped and started on one port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        store = RedisStore(self.url)
        deadline = time.monotonic() + 10
        while not store.ping():
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        store.close()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def redis_proc():
    r = RedisProcess()
    yield r
    if r.proc.poll() is None:
        r.stop()


def test_fallback_store_queues_and_replays(redis_proc):
    store = FallbackStore(RedisStore(redis_proc.url), retry_s=0.0)
    store.incr("acc", {"drafted": 3, "accepted": 1})
    store.append_log("vlog:x", {"i": 0})
    assert store.up and store.counters("acc") == {"drafted": 3.0, "accepted": 1.0}
    redis_proc.stop()
    store.incr("acc", {"drafted": 2, "accepted": 2})  # during the outage
    store.append_log("vlog:x", {"i": 1})
    store.set_json("acceptance_threshold", {"grid": [0.5]})
    assert not store.up and store.pending == 3
    assert store.counters("acc") == {"drafted": 5.0, "accepted": 3.0}  # local state keeps serving reads
    assert store.get_json("acceptance_threshold") == {"grid": [0.5]}
    redis_proc.start()  # an empty Redis came back: the replay restores what was written during the outage
    assert store.ping() and store.up and store.pending == 0
    direct = RedisStore(redis_proc.url)
    assert direct.counters("acc") == {"drafted": 2.0, "accepted": 2.0}
    assert direct.read_log("vlog:x") == [{"i": 1}] and direct.get_json("acceptance_threshold") == {"grid": [0.5]}
    direct.close()


def _health(url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def test_stack_serves_through_a_redis_outage(redis_proc, tiny_checkpoint):
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    # adaptive draft lengths: threshold controller over exp(-entropy) scores. No cost model here: T(b, q)
    # timed on a loaded 2-core CI machine can be noisy enough for the allocator to draft nothing,
    # and this test is about what reaches the state store (the allocator has its own tests). A draft
    # model behind a drafter service: the replica's rounds are host-drafted, which is where
    # verification logs are kept (device-chained rounds keep no per-draft features: the in-replica
    # draft model and SpecFormer, n-gram under a policy)
    stack = start_stack(StackConfig(model=model, drafter="draft-model", draft_model="truncate:1", drafter_service=True,
                                    max_batch_size=4, max_seq_len=256, redis_url=redis_proc.url, policy="entropy"),
                        timeout_s=180)
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        prompts = spec_bench_prompts(3)

        def ask(prompt: str, category: str):
            return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=16, temperature=0, extra_body={"category": category})

        first = ask(prompts[0], "coding")
        h = _health(stack.http_url)["state_store"]
        assert h["backend"] == "redis" and h["up"]
        for p in prompts:  # enough rounds for the replica to publish its threshold controller state (every 32)
            client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": p}], max_tokens=48,
                                           temperature=0)
        # writes that met a slow Redis (0.5 s timeout; a loaded CI machine) are queued and replayed:
        # delivery is eventual, so wait for the queue to drain before reading the streams
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = _health(stack.http_url)["state_store"]
            if st["up"] and not st.get("pending_writes"):
                break
            time.sleep(0.3)
        state = RedisStore(redis_proc.url).get_json("acceptance_threshold")
        assert state is not None and sum(state["counts"]) > 0 and len(state["grid"]) == len(state["counts"])
        vlog = RedisStore(redis_proc.url).read_log("vlog:draft-model", 10)  # labelled drafts that retrain the predictor
        assert vlog and all(len(r["features"]) == len(r["labels"]) for r in vlog)
        before = ask(prompts[1], "writing")  # the answer with Redis up (another category: its counters are lost below)
        redis_proc.stop()
        during = ask(prompts[1], "coding")  # still served, and served the same
        assert during.choices[0].message.content == before.choices[0].message.content
        assert during.usage.completion_tokens == before.usage.completion_tokens >= 1
        h = _health(stack.http_url)
        assert h["status"] == "ok" and not h["state_store"]["up"] and "local" in h["state_store"]["mode"]
        assert h["state_store"]["pending_writes"] >= 1
        with open(stack.logs["verifier"]) as f:  # the replica holds the state and says so
            assert "state store down, serving on local state" in f.read()
        redis_proc.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not _health(stack.http_url)["state_store"]["up"]:
            time.sleep(0.3)
        assert _health(stack.http_url)["state_store"]["up"]
        # the request served during the outage reached Redis (the first went to the Redis that was lost)
        counters = RedisStore(redis_proc.url).counters("acceptance:draft-model:coding")
        sd = during.usage.model_extra["speculative_decoding"]
        assert counters["requests"] == 1.0
        assert counters["num_drafted"] == sd["num_draft_tokens"] and counters["num_accepted"] == sd["num_accepted_tokens"]
        assert first.choices[0].message.content and (first.usage.completion_tokens == 16
                                                     or first.choices[0].finish_reason == "stop")
    finally:
        stack.stop()
