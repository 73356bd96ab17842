"""State store contract: the in-memory store and Redis (127.0.0.1:6379) pass the same tests."""

import uuid

import pytest

from tandem.threshold import ThresholdController
from tandem.state import InMemoryStore, RedisStore, StateStoreUnavailable, open_store

REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_up() -> bool:
    try:
        return RedisStore(REDIS_URL).ping()
    except Exception:
        return False


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        yield InMemoryStore()
        return
    if not redis_up():
        pytest.skip("no Redis on 127.0.0.1:6379")
    s = RedisStore(REDIS_URL, prefix=f"tandem-test-{uuid.uuid4().hex}:")
    yield s
    keys = s._r.keys(s.prefix + "*")
    if keys:
        s._r.delete(*keys)
    s.close()


def test_json_documents(store):
    assert store.get_json("missing") is None
    store.set_json("doc", {"a": 1, "b": [1.5, "x"]})
    assert store.get_json("doc") == {"a": 1, "b": [1.5, "x"]}
    store.set_json("doc", {"a": 2})
    assert store.get_json("doc") == {"a": 2}


def test_counters(store):
    assert store.counters("acc:ngram:qa") == {}
    store.incr("acc:ngram:qa", {"drafted": 5, "accepted": 3})
    store.incr("acc:ngram:qa", {"drafted": 2, "accepted": 0.5})
    assert store.counters("acc:ngram:qa") == {"drafted": 7.0, "accepted": 3.5}


def test_capped_log(store):
    assert store.read_log("vlog") == []
    for i in range(30):
        store.append_log("vlog", {"i": i, "features": [0.1, i]}, maxlen=10)
    tail = store.read_log("vlog", 3)
    assert [r["i"] for r in tail] == [27, 28, 29]
    everything = store.read_log("vlog")
    assert everything[-1]["i"] == 29 and len(everything) >= 10  # Redis trims approximately
    assert len(everything) < 30 or isinstance(store, RedisStore)
    assert store.read_log("vlog", 0) == []


def test_threshold_controller_state_is_shared_through_the_store(store):
    a = ThresholdController()
    for i in range(40):
        a.current()
        a.observe(1 + i % 4, 1.0)
    store.set_json("acceptance_threshold:ngram", a.state_dict())
    b = ThresholdController()
    b.load_state_dict(store.get_json("acceptance_threshold:ngram"))
    assert b.acceptance_threshold == a.acceptance_threshold and b.goodput() == a.goodput()


def test_redis_down_raises_unavailable_fast():
    dead = RedisStore("redis://127.0.0.1:1/0", timeout_s=0.2)
    assert dead.ping() is False
    with pytest.raises(StateStoreUnavailable, match="unavailable"):
        dead.set_json("k", {"a": 1})


def test_open_store_picks_backend(monkeypatch):
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    assert isinstance(open_store(), InMemoryStore)
    assert isinstance(open_store(fallback=True), InMemoryStore)
    monkeypatch.setenv("TANDEM_REDIS_URL", REDIS_URL)
    assert isinstance(open_store(), RedisStore)
    from tandem.state import FallbackStore

    served = open_store(fallback=True)  # a verifier replica's: Redis that degrades to local state
    assert isinstance(served, FallbackStore) and served.up
    served.close()


def test_draft_policy_shares_tau_state_through_the_store(store):
    import torch

    from tandem.control import DraftPolicy

    a = DraftPolicy(lambda f: torch.full((f.shape[0],), 0.5), controller=ThresholdController(), store=store,
                    store_key="acceptance_threshold:test", sync_every=4)
    feats = [torch.zeros(3, 4)]
    for i in range(8):
        a.lengths(feats)
        a.observe(1 + i % 3, 1.0)
    saved = store.get_json("acceptance_threshold:test")
    assert saved is not None and sum(saved["counts"]) > 0
    b = DraftPolicy(lambda f: f[:, 0], controller=ThresholdController(), store=store, store_key="acceptance_threshold:test")
    assert b.controller.state_dict() == saved  # a second replica starts from the shared state


def test_draft_policy_keeps_working_when_the_store_is_down():
    import torch

    from tandem.control import DraftPolicy

    dead = RedisStore("redis://127.0.0.1:1/0", timeout_s=0.1)
    pol = DraftPolicy(lambda f: torch.full((f.shape[0],), 0.9), controller=ThresholdController(), store=dead, sync_every=1)
    assert pol.lengths([torch.zeros(2, 4)]) in ([2], [0], [1])
    pol.observe(2, 1.0)  # logs a warning, does not raise
    assert sum(pol.controller.counts) == 1
