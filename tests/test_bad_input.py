"""Bad requests are rejected at the boundary with InvalidRequestError and a message that says
what is wrong; a rejected request leaves nothing behind and the engine keeps serving."""

from __future__ import annotations

import math

import pytest

from tandem.errors import InvalidRequestError
from tandem.sampling import SamplingParams

pytestmark = pytest.mark.slow  # every test here uses the real engine

GOOD = "Name three primary colors."
GOOD_PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def good_tokens(real_engine):
    return real_engine.generate([GOOD], GOOD_PARAMS)[0].token_ids


def _assert_clean(engine) -> None:
    assert not engine.waiting and not engine.running and not engine.requests
    assert engine.cache.num_free() == engine.cache.num_slots


def _still_serves(engine, good_tokens) -> None:
    _assert_clean(engine)
    assert engine.generate([GOOD], GOOD_PARAMS)[0].token_ids == good_tokens
    _assert_clean(engine)


@pytest.mark.parametrize("prompt", ["", "   ", " \n\t  "], ids=["empty", "spaces", "whitespace"])
def test_empty_prompt(real_engine, good_tokens, prompt):
    with pytest.raises(InvalidRequestError, match="empty"):
        real_engine.add_request(prompt, GOOD_PARAMS)
    with pytest.raises(InvalidRequestError, match="empty"):
        real_engine.generate([prompt])
    _still_serves(real_engine, good_tokens)


@pytest.mark.parametrize("prompt", [[], None], ids=["no-messages", "none"])
def test_missing_prompt(real_engine, good_tokens, prompt):
    with pytest.raises(InvalidRequestError):
        real_engine.add_request(prompt, GOOD_PARAMS)
    _still_serves(real_engine, good_tokens)


def test_empty_prompt_ids(real_engine, good_tokens):
    with pytest.raises(InvalidRequestError, match="empty"):
        real_engine.add_request(prompt_ids=[], params=GOOD_PARAMS)
    _still_serves(real_engine, good_tokens)


@pytest.mark.parametrize("messages", [[{"role": "user"}], [{"role": "user", "content": 5}], ["hello"]],
                         ids=["no-content", "non-string-content", "not-a-dict"])
def test_malformed_chat_messages(real_engine, good_tokens, messages):
    with pytest.raises(InvalidRequestError, match="role.*content"):
        real_engine.add_request(messages, GOOD_PARAMS)
    _still_serves(real_engine, good_tokens)


def test_prompt_over_context_limit(real_engine, good_tokens):
    limit = real_engine.max_seq_len
    long_text = "The quick brown fox jumps over the lazy dog. " * 200  # ~2000 tokens
    with pytest.raises(InvalidRequestError, match=rf"context limit is {limit} tokens") as exc:
        real_engine.add_request(long_text, GOOD_PARAMS)
    assert "prompt has" in str(exc.value)
    # exactly at the limit there is no room for a generated token either
    with pytest.raises(InvalidRequestError, match="context limit"):
        real_engine.add_request(prompt_ids=[100] * limit, params=GOOD_PARAMS)
    _still_serves(real_engine, good_tokens)


def test_prompt_one_under_context_limit(real_engine):
    """The context limit counts prompt plus output (RunnerConfig.max_seq_len: "tokens per slot
    (prompt + output), the context limit"; the rejection message says the same): a prompt one
    token under it gets exactly one token."""
    limit = real_engine.max_seq_len
    rid = real_engine.add_request(prompt_ids=[100] * (limit - 1),
                                  params=SamplingParams(max_tokens=50, ignore_eos=True))
    while real_engine.has_unfinished():
        real_engine.step()
    res = real_engine.completion(rid)
    assert res.finish_reason == "length"
    assert res.prompt_tokens + len(res.token_ids) <= limit, (
        f"{res.prompt_tokens} prompt + {len(res.token_ids)} generated tokens exceed the {limit}-token context")
    assert len(res.token_ids) == 1
    _assert_clean(real_engine)


def test_generate_with_one_bad_prompt_queues_nothing(real_engine, good_tokens):
    """``Engine.generate`` documents "a prompt is invalid (nothing is queued then)"."""
    too_long = "The quick brown fox jumps over the lazy dog. " * 200
    with pytest.raises(InvalidRequestError, match="^prompt 2 of 2: prompt has .* context limit"):
        real_engine.generate([GOOD, too_long], GOOD_PARAMS)
    _assert_clean(real_engine)


def test_generate_with_one_empty_prompt_queues_nothing(real_engine, good_tokens):
    with pytest.raises(InvalidRequestError, match="^prompt 2 of 2: .*empty"):
        real_engine.generate([GOOD, ""], GOOD_PARAMS)
    _still_serves(real_engine, good_tokens)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(top_k=-1), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", None]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="abc"), "seed"),
    (dict(seed=10**23), "seed"),
    (dict(seed=-1), "seed"),
    (dict(top_k=2**40), "top_k"),
    (dict(stop_token_ids=[2**40]), "stop_token_ids"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=7), "stop_token_ids"),
    (dict(stop_token_ids="7"), "stop_token_ids"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_bad_sampling_params(real_engine, good_tokens, kwargs, field):
    with pytest.raises(InvalidRequestError, match=field) as exc:
        SamplingParams(**kwargs)
    value = next(iter(kwargs.values()))
    if not isinstance(value, list):
        assert repr(value) in str(exc.value) or str(value) in str(exc.value)  # says what it got
    _still_serves(real_engine, good_tokens)


@pytest.mark.parametrize("ids", [[49152], [1, 2, -1], [10**9]], ids=["vocab", "negative", "huge"])
def test_token_ids_out_of_vocab(real_engine, good_tokens, ids):
    with pytest.raises(InvalidRequestError, match=r"\[0, 49152\)"):
        real_engine.add_request(prompt_ids=ids, params=GOOD_PARAMS)
    _still_serves(real_engine, good_tokens)


@pytest.mark.parametrize("ids", [["abc"], [None], [1.5]], ids=["str", "none", "float"])
def test_token_ids_not_integers(real_engine, good_tokens, ids):
    with pytest.raises(InvalidRequestError, match="token ids"):
        real_engine.add_request(prompt_ids=ids, params=GOOD_PARAMS)
    _still_serves(real_engine, good_tokens)


@pytest.mark.parametrize("raw", [b"\xff\xfe bad", b"ok \xc3\x28", b"\xe2\x82"], ids=["ff", "bad-cont", "truncated"])
def test_invalid_utf8_prompt(real_engine, good_tokens, raw):
    with pytest.raises(InvalidRequestError, match="UTF-8"):
        real_engine.add_request(raw, GOOD_PARAMS)
    with pytest.raises(InvalidRequestError, match="UTF-8"):
        real_engine.generate([raw], GOOD_PARAMS)
    _still_serves(real_engine, good_tokens)


def test_valid_utf8_bytes_prompt_is_accepted(real_engine, good_tokens):
    res = real_engine.generate([GOOD.encode("utf-8")], GOOD_PARAMS)[0]
    assert res.token_ids == good_tokens


@pytest.mark.parametrize("kwargs,field", [
    (dict(params={"max_tokens": 2}), "params"),
    (dict(params="greedy"), "params"),
    (dict(logprobs="yes"), "logprobs"),
    (dict(chat="no"), "chat"),
    (dict(final_only=1), "final_only"),
    (dict(request_id=5), "request_id"),
    (dict(request_id=["a"]), "request_id"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_bad_request_arguments(real_engine, good_tokens, kwargs, field):
    """An argument of the wrong type is refused at the boundary with the field's name, not an
    internal error (params read before their type is checked, an unhashable id)."""
    args = dict(params=GOOD_PARAMS) | kwargs
    with pytest.raises(InvalidRequestError, match=field):
        real_engine.add_request(GOOD, **args)
    _still_serves(real_engine, good_tokens)


def test_duplicate_request_id(real_engine, good_tokens):
    rid = real_engine.add_request(GOOD, GOOD_PARAMS, request_id="dup")
    with pytest.raises(InvalidRequestError, match="duplicate"):
        real_engine.add_request(GOOD, GOOD_PARAMS, request_id="dup")
    while real_engine.has_unfinished():
        real_engine.step()
    assert real_engine.completion(rid).token_ids == good_tokens
    _still_serves(real_engine, good_tokens)


def test_rejection_does_not_disturb_running_requests(real_engine, good_tokens):
    rid = real_engine.add_request(GOOD, GOOD_PARAMS)
    real_engine.step()  # running now
    for bad in ("", b"\xff", "x " * 3000):
        with pytest.raises(InvalidRequestError):
            real_engine.add_request(bad, GOOD_PARAMS)
    while real_engine.has_unfinished():
        real_engine.step()
    assert real_engine.completion(rid).token_ids == good_tokens
    _assert_clean(real_engine)
