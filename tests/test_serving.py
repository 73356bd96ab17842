"""Disaggregated serving end to end: verifier, drafter and router as real processes talking real
gRPC on loopback, driven through the official ``openai`` client and ``tandem.v1.Router``.

Outputs through the router equal the in-process engine's (greedy), streaming and not; a killed
drafter loses no request and changes no output; 50 concurrent streams complete; malformed input
gets 4xx / INVALID_ARGUMENT without disturbing other requests; a client that goes away frees
its slots; auth is enforced; a dead verifier fails its requests with a clear error. The gRPC
path of speculative *sampling* (sparse top-K q) is checked for losslessness in-process.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import pytest
import torch
from conftest import SMALL_VOCAB, spec_bench_prompts
from test_speculative import sampling_setup  # noqa: F401  (fixture: small-vocabulary target, draft, exact logits)

from services.common import BackgroundServer, Delta, Done, auth_metadata, params_to_pb
from services.launch import StackConfig, start_stack
from services.proto.tandem.v1 import common_pb2, router_pb2, router_pb2_grpc
from tandem.drafters import DraftModelDrafter, NgramDrafter
from tandem.engine import Engine
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams, choice_seed
from tandem.tokenizer import IncrementalDetokenizer

openai = pytest.importorskip("openai")

KEY = "test-key"
SLOTS = 4
CONTEXT = 256
MAX_TOKENS = 24


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint):
    return str(tiny_checkpoint("llama", with_tokenizer=True))


@pytest.fixture(scope="module")
def stack(tiny_dir):
    """Verifier (tiny random llama, real tokenizer), n-gram drafter and router, with a bearer key."""
    s = start_stack(StackConfig(model=tiny_dir, drafter="ngram", max_batch_size=SLOTS, max_seq_len=CONTEXT,
                                api_key=KEY, drafter_timeout_s=5.0), timeout_s=180)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local_engine(tiny_dir):
    """The in-process engine with the same model, drafter and k: the reference."""
    return Engine(tiny_dir, RunnerConfig(device="cpu", max_batch_size=SLOTS, max_seq_len=CONTEXT),
                  drafter=NgramDrafter(), num_draft_tokens=4)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def prompts():
    return spec_bench_prompts(6)


def reference(engine: Engine, prompts: list[str], max_tokens: int = MAX_TOKENS, ignore_eos: bool = False) -> list:
    """In-process greedy completions, one prompt at a time."""
    return [engine.generate([p], SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))[0] for p in prompts]


def grpc_generate(stack, prompt: str, params: SamplingParams, key: str | None = KEY) -> tuple[list[int], str, object]:
    with grpc.insecure_channel(stack.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        ids, text, last = [], "", None
        for m in stub.Generate(router_pb2.GenerateRequest(prompt=prompt, params=params_to_pb(params)),
                               metadata=auth_metadata(key), timeout=120):
            ids += list(m.token_ids)
            text += m.text
            last = m
    return ids, text, last


def _samples(stack) -> list:
    """Every sample of the router's /metrics (Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=5) as r:
        body = r.read().decode()
    return [s for fam in text_string_to_metric_families(body) for s in fam.samples]


def metric(stack, name: str, **labels) -> float:
    """One sample of the router's /metrics, e.g. a counter's ``_total``: the unlabelled one, or the
    one with exactly ``labels``."""
    found = [s.value for s in _samples(stack) if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def metric_sum(stack, name: str) -> float:
    """The sum of a metric's samples over all their labels (e.g. every finish reason)."""
    return sum(s.value for s in _samples(stack) if s.name == name)


def health(stack) -> dict:
    try:
        with urllib.request.urlopen(f"{stack.http_url}/health", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def stream_text(client, model_id: str, prompt: str, max_tokens: int = MAX_TOKENS,
                ignore_eos: bool = False) -> tuple[str, object, str]:
    parts, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True} if ignore_eos else None):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(parts), usage, finish


# ----------------------------------------------------------------------------- equality with the engine


def test_router_equals_engine_greedy(stack, client, model_id, local_engine, prompts):
    """Non-streaming HTTP, streaming HTTP (SSE) and gRPC Router.Generate all return exactly the
    in-process engine's greedy output, with speculative-decoding usage."""
    expected = reference(local_engine, prompts[:3])
    for prompt, ref in zip(prompts[:3], expected):
        r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == ref.completion_tokens
        assert r.usage.prompt_tokens == ref.prompt_tokens
        sd = r.usage.model_extra["speculative_decoding"]
        assert sd["num_verify_steps"] == ref.spec.num_steps and sd["num_draft_tokens"] == ref.spec.num_drafted
        text, usage, finish = stream_text(client, model_id, prompt)
        assert text == ref.text and finish == ref.finish_reason and usage.completion_tokens == ref.completion_tokens
        ids, gtext, last = grpc_generate(stack, prompt, SamplingParams(max_tokens=MAX_TOKENS))
        assert ids == ref.token_ids and gtext == ref.text
        assert last.finished and last.finish_reason == ref.finish_reason
        assert last.usage.num_accepted_tokens == ref.spec.num_accepted


def test_completions_endpoint_and_stop_strings(stack, client, model_id, local_engine, prompts):
    ref = local_engine.generate([prompts[3]], SamplingParams(max_tokens=MAX_TOKENS), chat=False)[0]
    r = client.completions.create(model=model_id, prompt=prompts[3], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref.text
    stop = ref.text[len(ref.text) // 2:][:3]  # a string from the middle of the output
    assert stop
    ref_stop = local_engine.generate([prompts[3]], SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,)), chat=False)[0]
    r = client.completions.create(model=model_id, prompt=prompts[3], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].text == ref_stop.text and r.choices[0].finish_reason == "stop"
    status, payload = _post(stack, "/v1/completions", {"prompt": [], "max_tokens": 4})  # no token ids at all
    assert status == 400 and "prompt is empty" in payload["error"]["message"] and payload["error"]["param"] == "prompt"
    # the chat endpoint's body sent here: the stray field is named, not only the missing one
    status, payload = _post(stack, "/v1/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "unknown field(s): messages" in payload["error"]["message"], payload
    assert payload["error"]["param"] == "messages"


def test_stop_string_cuts_usage_and_logprobs_with_the_text(client, model_id, local_engine, prompts):
    """A stop string that ends the output inside a token: the returned text stops before it, and
    ``usage.completion_tokens`` and the logprobs stop with the text: they count the tokens that
    made the returned text (the last may run into the stop string), and the logprobs' tokens join
    to the returned text, non-streamed and streamed, chat and completions."""
    msgs = [{"role": "user", "content": prompts[2]}]
    full = local_engine.generate([prompts[2]], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    detok = IncrementalDetokenizer(local_engine.tokenizer)  # each token's text, as the engine cuts them
    texts = [detok.add(t) for t in full.token_ids]
    starts = [len("".join(texts[:i])) for i in range(len(texts))]
    # a stop string starting inside a token (one character after its start), past the first tokens
    picks = [(i, full.text[starts[i] + 1:starts[i] + 4]) for i in range(3, len(texts) - 1) if len(texts[i]) >= 2]
    i, stop = next((i, st) for i, st in picks if len(st) == 3 and full.text.index(st) == starts[i] + 1)
    cut = starts[i] + 1
    want_text, want_tokens = full.text[:cut], i + 1  # tokens 0..i made the text; token i runs into the stop
    r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                       stop=[stop], logprobs=True, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.message.content == want_text and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == stop  # vLLM's field: the stop string that ended it
    assert r.system_fingerprint.startswith("fp_") and len(r.system_fingerprint) == 15
    assert r.usage.completion_tokens == want_tokens == len(c.logprobs.content)
    assert "".join(t.token for t in c.logprobs.content) == want_text
    rid = local_engine.add_request(prompts[2], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=(stop,)),
                                   logprobs=True)
    while local_engine.has_unfinished():
        local_engine.step()
    local = local_engine.completion(rid)
    assert local.token_ids == full.token_ids[:want_tokens] and local.text == want_text
    assert [t.logprob for t in c.logprobs.content] == pytest.approx(local.logprobs, abs=1e-5)
    parts, tokens, usage, reasons = [], [], None, []
    for chunk in client.chat.completions.create(model=model_id, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                                stop=[stop], logprobs=True, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        assert chunk.system_fingerprint == r.system_fingerprint
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].model_extra.get("stop_reason"))
            if chunk.choices[0].logprobs is not None:
                tokens += [t.token for t in chunk.choices[0].logprobs.content]
        usage = chunk.usage or usage
    assert "".join(parts) == "".join(tokens) == want_text and usage.completion_tokens == want_tokens
    assert reasons[-1] == stop and not any(reasons[:-1])  # on the last chunk only
    ref = local_engine.generate([prompts[2]], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=(stop,)),
                                chat=False)[0]
    r = client.completions.create(model=model_id, prompt=prompts[2], max_tokens=MAX_TOKENS, temperature=0,
                                  stop=[stop], logprobs=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == ref.text and r.usage.completion_tokens == ref.completion_tokens == len(c.logprobs.tokens)
    assert "".join(c.logprobs.tokens) == c.text
    assert c.model_extra["stop_reason"] == (stop if ref.finish_reason == "stop" else None) == ref.stop_reason
    r = client.completions.create(model=model_id, prompt=prompts[2], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["stop_reason"] is None


def test_seeded_sampling_through_router(client, model_id, local_engine, prompts):
    """The seed decides a sampled request's output: through the router it is exactly the sample the
    in-process engine draws with that seed (the verifier seeds its generator from it), and other
    seeds draw other samples."""
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95)

    def ask(seed: int) -> str:
        return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompts[0]}],
                                              max_tokens=params.max_tokens, temperature=params.temperature,
                                              top_p=params.top_p, seed=seed).choices[0].message.content

    seeds = (7, 8, 9)
    want = {s: local_engine.generate([prompts[0]], replace(params, seed=s))[0].text for s in seeds}
    assert {s: ask(s) for s in seeds} == want
    # the samples differ between seeds (a random 12-token sample of this model repeats with
    # negligible probability), so the equality above is about the seed, not a fixed output
    assert len(set(want.values())) == len(seeds), want
    # nor is a sampled request greedy in disguise
    assert reference(local_engine, prompts[:1], params.max_tokens)[0].text not in want.values()


def test_n_choices_through_router(client, model_id, local_engine, prompts):
    """``n`` choices: each decodes as a request of its own, choice i seeded with
    ``choice_seed(seed, i)``: distinct samples; streamed, its choices' deltas interleave, each
    naming its index; ``usage`` counts the prompt once and
    sums the choices' tokens; greedy choices are the target's text n times (chat and
    completions). (A sampled choice is compared with itself, not with an in-process run of its
    seed alone, nor across repeats: the choices are separate requests to
    the replica, they share verify batches as their arrival happens to group them, and a forward
    over 3 rows may round a logit differently from one over 1 row, which can move an inverse-CDF
    draw to the next token; the tiny random model's near-flat distributions make that frequent.)"""
    ask = dict(model=model_id, messages=[{"role": "user", "content": prompts[2]}], max_tokens=MAX_TOKENS,
               temperature=0.9, top_p=0.95, seed=11, n=3, logprobs=True)
    r = client.chat.completions.create(**ask)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3, texts  # independent samples
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    solo = local_engine.generate([prompts[2]], SamplingParams(max_tokens=1))[0]
    assert r.usage.prompt_tokens == solo.prompt_tokens
    streamed, usage_seen = {}, None
    for chunk in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
        usage_seen = chunk.usage or usage_seen
    assert sorted(streamed) == [0, 1, 2] and len(set(streamed.values())) == 3, streamed
    assert usage_seen.prompt_tokens == r.usage.prompt_tokens and 3 <= usage_seen.completion_tokens <= 3 * MAX_TOKENS
    greedy = client.completions.create(model=model_id, prompt=prompts[3], max_tokens=8, temperature=0, n=2)
    want = local_engine.generate([prompts[3]], SamplingParams(max_tokens=8), chat=False)[0].text
    assert [c.text for c in greedy.choices] == [want, want] and [c.index for c in greedy.choices] == [0, 1]
    assert choice_seed(11, 0) == 11 and len({choice_seed(11, i) for i in range(16)}) == 16


def run_with_logprobs(engine: Engine, prompt: str, max_tokens: int = MAX_TOKENS, top: int = 0, chat: bool = True):
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), logprobs=True, top_logprobs=top, chat=chat)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return engine.completion(rid)
    raise AssertionError("request did not finish")


def test_logprobs_same_with_and_without_speculation(tiny_dir, prompts):
    """Log-probabilities read off the verification pass (accepted drafts + bonus) equal
    target-only decoding's (drafts from an oracle that is right two times in three)."""
    from test_speculative import OracleDrafter

    cfg = RunnerConfig(device="cpu", max_batch_size=SLOTS, max_seq_len=CONTEXT)
    plain = Engine(tiny_dir, cfg)
    for prompt in prompts[:2]:
        ref = run_with_logprobs(plain, prompt)
        full = plain.encode_prompt(prompt) + ref.token_ids
        spec_engine = Engine(plain.checkpoint, cfg, tokenizer=plain.tokenizer,
                             drafter=OracleDrafter([full], mode="noisy", vocab=plain.target.info.vocab_size))
        spec = run_with_logprobs(spec_engine, prompt)
        assert spec.token_ids == ref.token_ids and spec.spec.num_accepted > 0
        assert len(spec.logprobs) == len(spec.token_ids)
        assert spec.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert all(lp <= 0 for lp in spec.logprobs)


def test_logprobs_through_router(stack, client, model_id, local_engine, prompts):
    ref = run_with_logprobs(local_engine, prompts[0])
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompts[0]}],
                                       max_tokens=MAX_TOKENS, temperature=0, logprobs=True)
    got = [c.logprob for c in r.choices[0].logprobs.content]
    assert got == pytest.approx(ref.logprobs, abs=1e-5)
    streamed = []
    for chunk in client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompts[0]}],
                                                max_tokens=MAX_TOKENS, temperature=0, logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += [c.logprob for c in chunk.choices[0].logprobs.content]
    assert streamed == pytest.approx(ref.logprobs, abs=1e-5)
    with grpc.insecure_channel(stack.grpc_address) as ch:
        msgs = list(router_pb2_grpc.RouterStub(ch).Generate(
            router_pb2.GenerateRequest(prompt=prompts[0], params=params_to_pb(SamplingParams(max_tokens=MAX_TOKENS)),
                                       logprobs=True), metadata=auth_metadata(KEY), timeout=60))
    assert [x for m in msgs for x in m.logprobs] == pytest.approx(ref.logprobs, abs=1e-5)


def test_an_answer_taken_whole_comes_in_one_message(stack, local_engine, prompts):
    """``GenerateRequest.final_only`` (a client that does not stream): one message, finished, with
    every token, the text, the log-probabilities and usage, equal to the in-process answer; the
    replica sent nothing for it before then, and its time to first token still reaches usage. The
    prompt goes as token ids (``prompt_ids``: tokenized by the client, chat template included)."""
    ref = run_with_logprobs(local_engine, prompts[1])
    with grpc.insecure_channel(stack.grpc_address) as ch:
        msgs = list(router_pb2_grpc.RouterStub(ch).Generate(
            router_pb2.GenerateRequest(prompt_ids=local_engine.encode_prompt(prompts[1]),
                                       params=params_to_pb(SamplingParams(max_tokens=MAX_TOKENS)),
                                       logprobs=True, top_logprobs=2, final_only=True),
            metadata=auth_metadata(KEY), timeout=60))
    assert len(msgs) == 1 and msgs[0].finished
    m = msgs[0]
    assert list(m.token_ids) == ref.token_ids and m.text == ref.text and m.finish_reason == ref.finish_reason
    assert list(m.logprobs) == pytest.approx(ref.logprobs, abs=1e-5) and len(m.top_logprobs) == len(ref.token_ids)
    assert m.usage.completion_tokens == len(ref.token_ids) and 0 < m.usage.ttft_s <= m.usage.e2e_s
    if len(ref.token_ids) > 2:  # decoding took more than one step: the first token came well before the end
        assert m.usage.ttft_s < m.usage.e2e_s


def test_logit_adjustments_through_router(stack, client, model_id, local_engine, prompts):
    """logit_bias, presence / frequency / repetition penalties and min_tokens reach the replica
    (HTTP and gRPC) and give the in-process engine's output; each changes the output."""
    plain = local_engine.generate([prompts[2]], SamplingParams(max_tokens=MAX_TOKENS))[0]
    banned = plain.token_ids[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, logit_bias={5: 3.0, banned: -100}, presence_penalty=0.5,
                            frequency_penalty=1.0, repetition_penalty=1.2, min_tokens=MAX_TOKENS - 2)
    want = local_engine.generate([prompts[2]], params)[0]
    assert banned not in want.token_ids
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompts[2]}],
                                       max_tokens=MAX_TOKENS, temperature=0, logit_bias={"5": 3.0, str(banned): -100},
                                       presence_penalty=0.5, frequency_penalty=1.0,
                                       extra_body={"repetition_penalty": 1.2, "min_tokens": MAX_TOKENS - 2})
    assert r.choices[0].message.content == want.text and r.usage.completion_tokens == want.completion_tokens
    with grpc.insecure_channel(stack.grpc_address) as ch:
        msgs = list(router_pb2_grpc.RouterStub(ch).Generate(
            router_pb2.GenerateRequest(messages=[router_pb2.ChatMessage(role="user", content=prompts[2])],
                                       params=params_to_pb(params)), metadata=auth_metadata(KEY), timeout=60))
    assert [t for m in msgs for t in m.token_ids] == want.token_ids


COMPACT = {"whitespace_flexible": False}  # (llguidance's option: a random model could emit whitespace for ever)
SMALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["colour", "n"], "x-guidance": COMPACT,
                "properties": {"colour": {"enum": ["red", "green", "blue"]},
                               "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_structured_output_through_router(stack, client, model_id, local_engine, prompts):
    """response_format json_schema (greedy: the in-process engine's output; sampled at 0.8:
    valid) and json_object, through the router, non-streamed and streamed."""
    import jsonschema

    from tandem.structured import Structure

    msgs = [{"role": "user", "content": prompts[0]}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SMALL_SCHEMA, "strict": True}}
    want = local_engine.generate([msgs], SamplingParams(max_tokens=40, structure=Structure(
        "json_schema", json.dumps(SMALL_SCHEMA))))[0]
    r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=40, temperature=0, response_format=fmt)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), SMALL_SCHEMA)
    for seed in range(3):
        r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=40, temperature=0.8, seed=seed,
                                           response_format=fmt)
        jsonschema.validate(json.loads(r.choices[0].message.content), SMALL_SCHEMA)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model_id, messages=msgs, max_tokens=40, temperature=0, response_format=fmt, stream=True) if c.choices)
    assert text == want.text
    r = client.completions.create(model=model_id, prompt=prompts[1], max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"], "x-guidance": COMPACT,
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False, "x-guidance": COMPACT}}}


def test_tool_call_round_trip_through_router(stack, client, model_id):
    """tool_choice required / a named function give a tool call in OpenAI's shape (streamed as a
    tool_calls delta too); the call and its result go back as messages, and the model answers."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=40, temperature=0,
                                       tools=[WEATHER, CLOCK], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Oslo", "Lima")
    named = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=40, temperature=0.7, seed=1,
                                           tools=[WEATHER, CLOCK],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model=model_id, messages=msgs, max_tokens=40, temperature=0, tools=[WEATHER], tool_choice="required",
        stream=True) if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].function.name == "get_weather"
    assert json.loads(streamed[0].function.arguments)["city"] in ("Paris", "Oslo", "Lima")
    assert " " not in streamed[0].function.arguments  # compact, as the grammar wrote it
    for seed in range(4):  # auto: a call in OpenAI's shape, or plain text (not a malformed call)
        m = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=24, temperature=1.0, seed=seed,
                                           tools=[WEATHER]).choices[0]
        if m.message.tool_calls:
            assert m.finish_reason == "tool_calls" and m.message.tool_calls[0].function.name == "get_weather"
        else:
            assert isinstance(m.message.content, str) and not m.message.content.lstrip().startswith("{")
    cut = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=8, temperature=0,
                                         tools=[WEATHER], tool_choice="required").choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None  # a cut call is still a call
    assert cut.message.tool_calls[0].function.name == "get_weather"  # (the name fits in 8 tokens)
    assert '{"city":"Paris"}'.startswith(cut.message.tool_calls[0].function.arguments[:3]) or \
        cut.message.tool_calls[0].function.arguments == ""
    none = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=24, temperature=0,
                                          tools=[{"type": "function", "function": {"name": "now"}}],
                                          tool_choice="required").choices[0]
    assert none.finish_reason == "tool_calls" and none.message.tool_calls[0].function.arguments == "{}"
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18}'}]
    answer = client.chat.completions.create(model=model_id, messages=follow, max_tokens=12, temperature=0,
                                            tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)
    alone = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=1, tools=[WEATHER],
                                           tool_choice="none")
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 10  # the call and its result are in the prompt


@pytest.mark.parametrize("body, needle, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "bad", "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format type", "response_format.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools",
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "function name", "tools.0.function.name"),
    ({"tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, "bad json schema",
     "tools.0.function.parameters"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "unknown response_format field", "response_format.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "needs", "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "must be a boolean", "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "foo": 1}}},
     "unknown json_schema field", "response_format.json_schema.foo"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "cannot be combined with structured", "min_tokens"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "needs the tool_call_id", "messages.0.tool_call_id"),
    ({"logit_bias": {" 5": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "both constrain", "response_format"),
])
def test_bad_structured_requests_get_400(stack, body, needle, param):
    status, payload = _post(stack, "/v1/chat/completions", {"messages": HI, "max_tokens": 4} | body)
    assert status == 400 and needle in payload["error"]["message"], payload
    assert payload["error"]["param"] == param


def test_top_logprobs_through_router(stack, client, model_id, local_engine, prompts):
    """``top_logprobs`` (chat, streamed and not), completions' ``logprobs`` = N and the gRPC
    ``top_logprobs`` return the in-process engine's alternatives in OpenAI's shapes."""
    top = 3
    ref = run_with_logprobs(local_engine, prompts[0], top=top)
    assert len(ref.top_logprobs) == len(ref.token_ids) and all(len(a) == top for a in ref.top_logprobs)
    text = local_engine.tokenizer.decode
    want = [[(text([t]), v) for t, v in alts] for alts in ref.top_logprobs]
    msgs = [{"role": "user", "content": prompts[0]}]
    r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=top)
    content = r.choices[0].logprobs.content
    assert [[a.token for a in c.top_logprobs] for c in content] == [[t for t, _ in w] for w in want]
    assert [a.logprob for c in content for a in c.top_logprobs] == pytest.approx(
        [v for w in want for _, v in w], abs=1e-5)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the token is the best
    assert all(a.bytes == list(a.token.encode()) for c in content for a in c.top_logprobs)
    streamed = []
    for chunk in client.chat.completions.create(model=model_id, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                                logprobs=True, top_logprobs=top, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += [[a.token for a in c.top_logprobs] for c in chunk.choices[0].logprobs.content]
    assert streamed == [[t for t, _ in w] for w in want]
    plain = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=4, temperature=0, logprobs=True)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)  # logprobs alone: no alternatives
    ref_raw = run_with_logprobs(local_engine, prompts[1], top=top, chat=False)
    c = client.completions.create(model=model_id, prompt=prompts[1], max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=top).choices[0]
    assert len(c.logprobs.top_logprobs) == len(ref_raw.token_ids)
    for got, alts in zip(c.logprobs.top_logprobs, ref_raw.top_logprobs):
        assert got == pytest.approx({text([t]): v for t, v in reversed(alts)}, abs=1e-5)  # (a repeated text keeps the best)
    with grpc.insecure_channel(stack.grpc_address) as ch:
        out = list(router_pb2_grpc.RouterStub(ch).Generate(
            router_pb2.GenerateRequest(prompt=prompts[0], params=params_to_pb(SamplingParams(max_tokens=MAX_TOKENS)),
                                       top_logprobs=top), metadata=auth_metadata(KEY), timeout=60))
    assert [list(a.token_ids) for m in out for a in m.top_logprobs] == [[t for t, _ in a] for a in ref.top_logprobs]


def test_overlapped_drafting_is_lossless_and_used(tiny_dir, prompts):
    """A replica's drafter-service client drafts the next round while the target verifies (assuming every
    draft is accepted and guessing the bonus token); where the guess holds, those drafts are used
    without another drafter round trip. Where guesses rarely hold for whole rounds, a drafter whose
    prefetches are answered before verification ends keeps being asked (they cost nothing), while
    one whose prefetches hold rounds up is asked only now and then. Outputs stay the target's own."""
    import time

    from test_speculative import OracleDrafter

    from services.drafter.server import serve as serve_drafter
    from services.drafter.client import RemoteDrafter
    from tandem.target import LocalTarget

    class SlowOracle(OracleDrafter):  # every draft batch takes 30 ms: a prefetch is not back when verification ends
        def propose(self, requests, keep_drafting=None):
            time.sleep(0.03)
            return super().propose(requests, keep_drafting)

    cfg = RunnerConfig(device="cpu", max_batch_size=SLOTS, max_seq_len=CONTEXT)
    plain = Engine(tiny_dir, cfg)
    refs = [plain.generate([p], SamplingParams(max_tokens=MAX_TOKENS))[0] for p in prompts[:SLOTS]]
    full = [plain.encode_prompt(p) + r.token_ids for p, r in zip(prompts, refs)]
    for mode, kind in (("right", OracleDrafter), ("noisy", OracleDrafter), ("noisy", SlowOracle)):
        oracle = kind(full, mode=mode, vocab=plain.target.info.vocab_size)
        server = BackgroundServer(lambda ready, stop: serve_drafter(oracle, SLOTS, 0, ready=ready, stop=stop))
        try:
            drafter = RemoteDrafter(server.address, plain.target.info.vocab_size)
            eng = Engine(tokenizer=plain.tokenizer, drafter=drafter, num_draft_tokens=4,
                         target=LocalTarget(plain.checkpoint, cfg))
            got = eng.generate(prompts[:SLOTS], SamplingParams(max_tokens=MAX_TOKENS))
            assert [g.token_ids for g in got] == [r.token_ids for r in refs]
            if mode == "right":  # every guess holds: the drafter is never waited for after the first round
                assert drafter.prefetch_hits > 0 and drafter.prefetch_misses <= SLOTS
                assert eng.stats.acceptance_rate == 1.0 and drafter.prefetch_skipped == 0
            else:  # a wrong draft in every run: no guess holds, each round drafts again after verification
                assert drafter.prefetch_misses > 0 and 0 < eng.stats.acceptance_rate < 1.0
                if kind is SlowOracle:  # prefetches hold rounds up: most rounds no longer prefetch
                    assert drafter.prefetch_skipped > 0
            drafter.close()
        finally:
            server.stop()


def test_draft_batches_encode_and_decode_whole():
    """A drafter service's answer is encoded and decoded a batch at a time (features, top tokens,
    scores and sampled proposals' sparse q in one conversion each) exactly as one proposal at a
    time: greedy proposals with and without scores, sampled ones (a row with more non-zero entries
    than the service's K among them), empty ones; a batch of mixed shapes takes the
    proposal-at-a-time path; features of the wrong size are refused."""
    from services.common import probs_to_sparse, probs_to_sparse_batch
    from services.drafter.client import RemoteDrafter
    from services.drafter.server import _proposal_pb, _proposals_pb
    from services.proto.tandem.v1 import drafter_pb2
    from tandem.drafters.base import NUM_FEATURES, DraftProposal

    torch.manual_seed(0)
    vocab = 50

    def greedy(n, scored=False, m=3):
        return DraftProposal(torch.randint(0, vocab, (n,)).tolist(), None, torch.rand(n, NUM_FEATURES),
                             torch.randint(0, vocab, (n, m)) if m else None, scores=torch.rand(n) if scored else None)

    def sampled(n, nonzero=8):  # q truncated to its top `nonzero` tokens, as a drafter service samples
        q = torch.softmax(torch.randn(n, vocab), -1)
        q[q < q.topk(nonzero, -1).values[:, -1:]] = 0
        return DraftProposal(torch.randint(0, vocab, (n,)).tolist(), q / q.sum(-1, keepdim=True),
                             torch.rand(n, NUM_FEATURES), torch.randint(0, vocab, (n, 3)))

    client = RemoteDrafter.__new__(RemoteDrafter)  # the decoding half only: no channel
    client.vocab_size, client.device = vocab, torch.device("cpu")
    batches = {"plain": [greedy(4), DraftProposal.empty(), greedy(2), greedy(1)],
               "scored": [greedy(3, True), greedy(4, True), DraftProposal.empty()],
               "sampled": [sampled(3), greedy(2), DraftProposal.empty(), sampled(1, nonzero=12), sampled(4)],
               "mixed": [greedy(2, m=3), greedy(2, m=0), sampled(2)], "empty": [DraftProposal.empty()] * 2}
    for name, props in batches.items():
        ids = list(range(len(props)))
        wire = _proposals_pb(ids, props, 8)  # (a row of 12 non-zero entries goes through probs_to_sparse)
        one_at_a_time = [_proposal_pb(i, p).SerializeToString() for i, p in zip(ids, props)]
        assert [m.SerializeToString() for m in wire] == one_at_a_time, name
        rows = [p.probs for p in props if p.probs is not None]  # the GPU's way, one top-K for the batch, on the CPU
        assert probs_to_sparse_batch(rows, 8, topk=True) == [r for q in rows for r in probs_to_sparse(q)], name
        back = drafter_pb2.DraftBatch.FromString(drafter_pb2.DraftBatch(round=1, proposals=wire).SerializeToString())
        got, want = client._proposals(back.proposals), [client._proposal(p) for p in back.proposals]
        for g, w in zip(got, want):
            assert g.tokens == w.tokens and torch.equal(g.features, w.features), name
            for a, b in ((g.top_tokens, w.top_tokens), (g.scores, w.scores), (g.probs, w.probs)):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    bad = drafter_pb2.DraftBatch(round=1, proposals=_proposals_pb([0, 1], [greedy(2), greedy(2)], 8)).proposals
    del bad[1].features[-1]
    with pytest.raises(ValueError, match="wrong size"):
        client._proposals(bad)
    from tandem.errors import InvalidRequestError

    for damage, message in (("index", "outside"), ("values", "mismatched")):
        bad = drafter_pb2.DraftBatch(round=1, proposals=_proposals_pb([0, 1], [sampled(2), sampled(1)], 8)).proposals
        if damage == "index":
            bad[1].probs[0].indices[0] = vocab
        else:
            del bad[0].probs[1].values[-1]
        with pytest.raises(InvalidRequestError, match=message):
            client._proposals(bad)


# ----------------------------------------------------------------------------- load, bad input, disconnects


def test_fifty_concurrent_streams(stack, model_id, local_engine, prompts):
    """50 streaming requests at once over 4 KV slots: all complete (continuous batching, queueing),
    each with exactly the in-process engine's greedy output for its prompt."""

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key=KEY, max_retries=0, timeout=300)

        async def one(i: int):
            chunks, usage = [], None
            stream = await aclient.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": prompts[i % len(prompts)]}], max_tokens=6,
                temperature=0, stream=True, stream_options={"include_usage": True})
            async for c in stream:
                if c.choices:
                    chunks.append(c.choices[0].delta.content or "")
                if c.usage is not None:
                    usage = c.usage
            return "".join(chunks), usage

        try:
            return await asyncio.gather(*(one(i) for i in range(50)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 50
    want = reference(local_engine, prompts, 6)
    for i, (text, usage) in enumerate(results):  # greedy: the engine's text whatever the batch and the queue
        ref = want[i % len(prompts)]
        assert text == ref.text and usage is not None and usage.completion_tokens == ref.completion_tokens, i


def room(engine, prompt: str) -> int:
    """The most output tokens a chat request with ``prompt`` may ask for (prompt + output <= CONTEXT)."""
    return CONTEXT - len(engine.encode_prompt([{"role": "user", "content": prompt}]))


def _post(stack, path: str, body, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"{stack.http_url}{path}", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, needle, param", [
    (b"{not json", "not valid JSON", None),
    (b"", "body is empty", None),
    ({"messages": []}, "messages", "messages"),
    ({"messages": HI, "temperature": -1}, "temperature", "temperature"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"messages": HI, "top_p": 1.5}, "top_p", "top_p"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role", "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi " * 400}]}, "context limit", "messages"),
    ({"messages": HI, "max_tokens": 10**9}, "past the context limit of 256 tokens", "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 250}, "at most", "max_completion_tokens"),
    ({"messages": HI, "max_tokens": 4, "max_completion_tokens": 6}, "disagree", "max_completion_tokens"),
    ({"messages": HI, "max_tokens": "4"}, "max_tokens", "max_tokens"),
    ({"messages": HI, "max_tokens": True}, "max_tokens", "max_tokens"),
    ({"messages": HI, "stream": "yes"}, "stream", "stream"),
    ({"messages": HI, "stop": 5}, "stop must be a string or a list of strings", "stop"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content: Input should be", "messages.0.content"),
    ({"messages": HI, "n": 17}, "less than or equal to 16", "n"),
    ({"messages": HI, "n": 0}, "greater than or equal to 1", "n"),
    ({"messages": HI, "model": "gpt-9"}, "not served", "model"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "could not be decoded: invalid UTF-8 at byte 43",
     None),
    (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper than the parser allows", None),
    ({"messages": HI, "logit_bias": {"x": 5}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"messages": HI, "logit_bias": {"42": 500}}, "[-100, 100]", "logit_bias"),
    ({"messages": HI, "logit_bias": {"99999999": 1}}, "outside the vocabulary", "logit_bias"),
    ({"messages": HI, "stop_token_ids": [1000000000]}, "stop_token_ids token id 1000000000 is outside", "stop_token_ids"),
    ({"messages": HI, "frequency_penalty": 2.5}, "less than or equal to 2", "frequency_penalty"),
    ({"messages": HI, "repetition_penalty": 0}, "greater than 0", "repetition_penalty"),
    ({"messages": HI, "max_tokens": 4, "min_tokens": 5}, "min_tokens must be", "min_tokens"),
    ({"messages": HI, "functions": [{"name": "f"}]}, "unsupported field(s): functions", "functions"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "less than or equal to 20", "top_logprobs"),
    ({"messages": HI, "top_logprobs": 2}, "needs logprobs: true", "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}], "best_of": 2},
     "unsupported field(s): best_of, messages.0.name", "best_of"),
    ({"messages": HI, "stream_options": {"include_usage": True}}, "only allowed with stream: true", "stream_options"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "finite number", "temperature"),
    ({"messages": HI, "temperature": 2.5}, "less than or equal to 2", "temperature"),
    ({"messages": HI, "prompt": "x"}, "unknown field(s): prompt", "prompt"),  # not renamed to messages
    ({"prompt": "x"}, "unknown field(s): prompt", "prompt"),  # the completions body: its stray field named
    (b"[1, 2]", "the request body must be a JSON object", None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_tokens": 400}',
     "the key 'max_tokens' appears twice", "max_tokens"),
    ({"messages": HI, "stop": [1]}, "stop: stop must be a string or a list of strings", "stop"),  # no "Value error"
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}",
     "more digits than the parser reads", None),
    ({"messages": HI, "category": "c" * 5000}, "is not 1-64 characters", "category"),
    ({"messages": HI, "stop": [1, 2]}, "stop must be a string or a list of strings", "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text content parts", "messages.0.content"),
    ({"messages": HI, "stream": True, "stream_options": {"foo": 1}}, "unknown stream_options field(s): foo",
     "stream_options.foo"),
    (b'{"messages": [{"role": "user", "content": "' + b"x" * (5 * 2**20) + b'"}]}', "over 4 MiB", None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": "\\ud800"}', "the stop string is not valid UTF-8",
     "stop"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["x", "\\udfff"], "stream": true}',
     "stop string 1 is not valid UTF-8", "stop"),
])
def test_malformed_requests_get_4xx_and_others_continue(stack, client, model_id, local_engine, prompts, body, needle,
                                                        param):
    """Each bad request gets a 4xx whose message says what is wrong and whose ``param`` names the
    field at fault (None where no single field is), while a good streaming request runs alongside."""
    result = {}
    good = threading.Thread(target=lambda: result.setdefault("r", stream_text(client, model_id, prompts[1], 12)))
    good.start()
    status, payload = _post(stack, "/v1/chat/completions", body)
    good.join(timeout=120)
    assert 400 <= status < 500, payload
    assert needle in payload["error"]["message"]
    assert payload["error"]["param"] == param, payload
    text, usage, finish = result["r"]  # the good request is unharmed: exactly the in-process engine's output
    want = reference(local_engine, [prompts[1]], 12)[0]
    assert text == want.text and usage.completion_tokens == want.completion_tokens
    assert finish == want.finish_reason


def test_http_protocol_errors_use_the_openai_shape(stack):
    """Unknown path 404, wrong method 405, a body without a JSON content type 400, a compressed
    body 400 naming its encoding, an unknown model's card 404, each as {"error": {"message",
    "type", "param", "code"}} like every other error; the served model's card as OpenAI's; the
    bearer scheme in any case; the API's documentation pages behind the key."""
    def call(path, method="POST", data=b"{}", ctype="application/json", auth=f"Bearer {KEY}", **extra):
        headers = {**({"authorization": auth} if auth else {}), **({"content-type": ctype} if ctype else {}), **extra}
        req = urllib.request.Request(f"{stack.http_url}{path}", data=data if method == "POST" else None,
                                     headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    for (status, payload), want, needle in [
        (call("/v1/nothing"), 404, "no such endpoint"),
        (call("/v1/chat/completions", method="GET"), 405, "GET is not allowed"),
        (call("/v1/chat/completions", data=body, ctype="application/x-www-form-urlencoded"), 400,
         "Content-Type: application/json"),
        (call("/v1/chat/completions", data=gzip.compress(body), **{"content-encoding": "gzip"}), 400,
         "Content-Encoding 'gzip' is not supported"),
        (call("/v1/chat/completions", data=body, **{"content-encoding": "br"}), 400,  # JSON that parses all the same
         "Content-Encoding 'br' is not supported"),
        # UTF-8 that is neither gzip nor JSON
        (call("/v1/chat/completions", data=b"notgz", **{"content-encoding": "gzip"}), 400,
         "Content-Encoding 'gzip' is not supported"),
        (call("/v1/models/gpt-9", method="GET"), 404, "is not served here"),
        (call("/openapi.json", method="GET", auth=None), 401, "bearer token"),
    ]:
        assert status == want and set(payload["error"]) == {"message", "type", "param", "code"}, payload
        assert needle in payload["error"]["message"] and payload["error"]["code"] == want
    models = call("/v1/models", method="GET")[1]["data"]
    status, card = call(f"/v1/models/{models[0]['id']}", method="GET", auth=f"bEaReR {KEY}")
    assert status == 200 and card == models[0] and card["object"] == "model"
    assert call("/openapi.json", method="GET")[0] == 200


def test_a_fault_inside_a_stream_ends_it_with_an_error_event():
    """An exception raised while a choice streams (a fault of ours, not a replica's) ends the stream
    with an OpenAI-shaped error event, not as if the request had finished."""
    from services.router.http import _stream
    from tandem.requests import RequestOutput

    class Broken:
        model_name, fingerprint = "m", "fp"

        async def generate(self, req, category, api):
            yield Delta(RequestOutput("r", [1], "a", False, None))
            raise RuntimeError("boom")

    async def collect():
        return [e async for e in _stream(Broken(), [object()], "default", "r", 0, True, False)]

    events = asyncio.run(collect())
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert len(errors) == 1 and errors[0]["code"] == 500 and "RuntimeError" in errors[0]["message"], events
    assert any('"content": "a"' in e for e in events)  # what came before the fault was sent


def test_grpc_invalid_argument(stack, local_engine, prompts):
    """Bad input over gRPC: INVALID_ARGUMENT with a message (a max_tokens past the context as over
    HTTP); a request without max_tokens gets the router's default and stops at the context."""
    for req in (router_pb2.GenerateRequest(prompt="", params=common_pb2.SamplingParams(max_tokens=4)),
                router_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=CONTEXT)),
                router_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=4, top_p=2.0)),
                router_pb2.GenerateRequest(messages=[router_pb2.ChatMessage(role="wizard", content="hi")],
                                           params=common_pb2.SamplingParams(max_tokens=4)),
                router_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=4),
                                           category="c" * 65),
                router_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=4, temperature=2.5)),
                router_pb2.GenerateRequest(messages=[router_pb2.ChatMessage(role="user", content=" ")],
                                           params=common_pb2.SamplingParams(max_tokens=4)),
                router_pb2.GenerateRequest(prompt="hi", prompt_ids=[1, 2], params=common_pb2.SamplingParams(max_tokens=4)),
                router_pb2.GenerateRequest(prompt_ids=[1, 2], raw_prompt=True, params=common_pb2.SamplingParams(max_tokens=4)),
                router_pb2.GenerateRequest(prompt_ids=[1, 10 ** 9], params=common_pb2.SamplingParams(max_tokens=4)),
                router_pb2.GenerateRequest(prompt_ids=[1, -3], params=common_pb2.SamplingParams(max_tokens=4))):
        with grpc.insecure_channel(stack.grpc_address) as ch, pytest.raises(grpc.RpcError) as err:
            list(router_pb2_grpc.RouterStub(ch).Generate(req, metadata=auth_metadata(KEY), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details()
    for raw in (b"\xff\xff\xff\xff", b"\x0a\x02\xff\xfe"):  # not protobuf; invalid UTF-8 in a string field
        with grpc.insecure_channel(stack.grpc_address) as ch, pytest.raises(grpc.RpcError) as err:
            call = ch.unary_stream("/tandem.v1.Router/Generate", request_serializer=lambda b: b,
                                   response_deserializer=router_pb2.GenerateResponse.FromString)
            list(call(raw, metadata=auth_metadata(KEY), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed request message" in \
            err.value.details()
    req = router_pb2.GenerateRequest(prompt=prompts[0], params=common_pb2.SamplingParams(ignore_eos=True))
    with grpc.insecure_channel(stack.grpc_address) as ch:  # no max_tokens: the default, cut at the context
        last = list(router_pb2_grpc.RouterStub(ch).Generate(req, metadata=auth_metadata(KEY), timeout=120))[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == CONTEXT - last.usage.prompt_tokens


def test_a_client_request_id_used_twice_at_once(stack, local_engine, prompts):
    """gRPC clients choose their request ids: two requests with the same id at the same time both
    run, each with its own output (the router keys its stream to the replica by ids of its own)."""
    want = [local_engine.generate([p], SamplingParams(max_tokens=8), chat=False)[0].token_ids for p in prompts[:2]]
    got = {}

    def run(i: int) -> None:
        req = router_pb2.GenerateRequest(request_id="mine", prompt=prompts[i], raw_prompt=True,
                                         params=params_to_pb(SamplingParams(max_tokens=8)))
        with grpc.insecure_channel(stack.grpc_address) as ch:
            msgs = list(router_pb2_grpc.RouterStub(ch).Generate(req, metadata=auth_metadata(KEY), timeout=60))
        got[i] = [t for m in msgs for t in m.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [got.get(0), got.get(1)] == want


def test_bearer_token_required(stack, model_id):
    status, payload = _post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, key=None)
    assert status == 401 and "bearer" in payload["error"]["message"]
    status, _ = _post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, key="wrong")
    assert status == 401
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(stack, "hi", SamplingParams(max_tokens=2), key=None)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def held(stack, replica: int = 0) -> int:
    """Requests a verifier replica holds (running + waiting), as the router last polled it."""
    v = health(stack)["verifiers"][replica]
    return (v["running"] or 0) + (v["waiting"] or 0)


def wait_held(stack, want: int, timeout_s: float = 10.0, replica: int = 0) -> int:
    """Poll ``held`` until it is ``want`` (the router polls replicas every 0.5 s); returns the last value."""
    deadline = time.monotonic() + timeout_s
    while (n := held(stack, replica)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def first_content(stream) -> None:
    """Read a chat stream up to its first generated text: the request is decoding (the first chunk,
    the assistant role, is sent before the request is even admitted)."""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return
    raise AssertionError("the stream ended without text")


def test_client_disconnect_frees_slots(stack, client, model_id, local_engine, prompts):
    """Closing a stream mid-generation aborts the request on the replica: the requests it holds drop
    from SLOTS to zero and every KV slot can be used again."""
    streams = []
    for i in range(SLOTS):
        s = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompts[i]}],
                                           max_tokens=room(local_engine, prompts[i]), temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        first_content(s)  # the request is running (it runs to the context limit unless aborted)
        streams.append(s)
    assert wait_held(stack, SLOTS) == SLOTS  # all of them hold a slot now
    for s in streams:
        s.close()
    assert wait_held(stack, 0, 30) == 0
    results = {}  # all slots free again: SLOTS new requests run at once
    threads = [threading.Thread(target=lambda i=i: results.setdefault(i, stream_text(client, model_id, prompts[i], 4)))
               for i in range(SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    want = reference(local_engine, prompts[:SLOTS], 4)
    assert len(results) == SLOTS
    for i, (text, usage, _) in results.items():  # every request ran to its own end, output intact
        assert text == want[i].text and usage.completion_tokens == want[i].completion_tokens, i


def test_n_choices_stop_when_the_client_goes_away(stack, model_id, local_engine, prompts):
    """A non-streamed request for n choices whose client goes away once every choice holds a KV
    slot: every choice is aborted (none counts as a finished request) and its slot freed."""
    import http.client
    from urllib.parse import urlparse

    url = urlparse(stack.http_url)
    finished = metric_sum(stack, "tandem_request_success_total")
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": prompts[0]}], "n": SLOTS,
                       "max_tokens": room(local_engine, prompts[0]), "temperature": 0.8, "seed": 3,
                       "ignore_eos": True})
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert wait_held(stack, SLOTS) == SLOTS  # every choice is running
    conn.close()  # the client goes away without reading the response
    assert wait_held(stack, 0) == 0
    assert metric_sum(stack, "tandem_request_success_total") == finished  # aborted, not run to their end


def test_two_routers_over_one_verifier_queue_for_its_slots(stack, model_id, local_engine, prompts):
    """Two routers over the same verifier replica (what router autoscaling makes), 8 concurrent
    requests each, 16 in all over its 4 KV slots: the replica queues what does not fit, every
    request completes with the in-process engine's greedy output, and nothing is left held."""
    url2 = stack.add_router("router2")
    try:
        want = reference(local_engine, prompts, 8)

        async def main():
            clients = [openai.AsyncOpenAI(base_url=f"{u}/v1", api_key=KEY, max_retries=0, timeout=120)
                       for u in (stack.http_url, url2)]

            async def one(c, i: int):
                r = await c.chat.completions.create(model=model_id, max_tokens=8, temperature=0,
                                                    messages=[{"role": "user", "content": prompts[i % len(prompts)]}])
                return i, r

            return await asyncio.gather(*[one(c, i) for c in clients for i in range(8)])

        results = asyncio.run(main())
        assert len(results) == 16
        for i, r in results:
            assert r.choices[0].message.content == want[i % len(prompts)].text, i
        assert wait_held(stack, 0) == 0
    finally:
        proc = stack.processes.pop("router2")
        proc.terminate()
        proc.wait(timeout=30)


def test_metrics_and_health(stack, client, model_id, local_engine, prompts):
    """/metrics counts the speculative-decoding work of the requests served: one request that
    drafts moves the counters by exactly its own usage, under our names and under vLLM's (with
    the served model's ``model_name`` label; drafts = rounds in which it verified drafts)."""
    refs = reference(local_engine, prompts, MAX_TOKENS)
    i = next((i for i, r in enumerate(refs) if r.spec.num_drafted > 0), None)
    assert i is not None, "no prompt drafts: the test would prove nothing"
    names = {"drafted": "tandem_spec_decode_num_draft_tokens_total",
             "accepted": "tandem_spec_decode_num_accepted_tokens_total",
             "generated": "tandem_generation_tokens_total", "prompt": "tandem_prompt_tokens_total"}
    vllm = {"drafts": "vllm:spec_decode_num_drafts_total", "drafted": "vllm:spec_decode_num_draft_tokens_total",
            "accepted": "vllm:spec_decode_num_accepted_tokens_total"}
    before = {k: metric(stack, n) for k, n in names.items()}
    before_vllm = {k: metric(stack, n, model_name=model_id) for k, n in vllm.items()}
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompts[i]}],
                                       max_tokens=MAX_TOKENS, temperature=0)
    after = {k: metric(stack, n) for k, n in names.items()}
    after_vllm = {k: metric(stack, n, model_name=model_id) for k, n in vllm.items()}
    sd = r.usage.model_extra["speculative_decoding"]
    assert sd["num_draft_tokens"] == refs[i].spec.num_drafted > 0
    assert after["drafted"] - before["drafted"] == sd["num_draft_tokens"]
    assert after["accepted"] - before["accepted"] == sd["num_accepted_tokens"]
    assert after_vllm["drafted"] - before_vllm["drafted"] == sd["num_draft_tokens"]
    assert after_vllm["accepted"] - before_vllm["accepted"] == sd["num_accepted_tokens"]
    # a round in which the request drafted counts one draft: the rounds with a draft at position 0
    assert after_vllm["drafts"] - before_vllm["drafts"] == refs[i].spec.drafted_per_pos[0] >= 1
    assert after["generated"] - before["generated"] == r.usage.completion_tokens
    assert after["prompt"] - before["prompt"] == r.usage.prompt_tokens
    h = health(stack)
    assert h["status"] == "ok" and h["drafter"] is None and h["state_store"]["backend"] == "memory"  # n-gram: in the replica
    assert h["verifiers"][0]["speculation"] == "drafter=ngram k=4 policy=fixed" and h["verifiers"][0]["num_slots"] == SLOTS
    # a router plans no rounds: the replicas' plan gauges are not on its page (no 0s that look like data)
    assert not {s.name for s in _samples(stack)} & {"tandem_draft_width", "tandem_acceptance_threshold"}


# ----------------------------------------------------------------------------- faults (each on a stack of its own)


def test_killed_drafter_loses_nothing_and_recovers(tiny_dir, local_engine, prompts):
    """SIGKILL the drafter service while requests are speculating (they have streamed several
    rounds, each with drafts): every request completes with the engine's exact greedy output
    (target-only once the drafter is gone), /health shows it down, and a restarted drafter is
    used again.

    The drafter is a draft model with the target's own weights: it drafts k tokens in every round
    and greedy verification accepts them all, so the requests are surely speculating when it dies,
    with accepted drafts in their KV caches (an n-gram drafter drafts only where the history
    repeats itself, on this random model rarely)."""
    k, max_tokens = 4, 96
    s = start_stack(StackConfig(model=tiny_dir, drafter="draft-model", draft_model=tiny_dir, num_draft_tokens=k,
                                max_batch_size=SLOTS, max_seq_len=CONTEXT, drafter_timeout_s=5.0,
                                grpc_front_door=False), timeout_s=180)
    try:
        client = openai.OpenAI(base_url=f"{s.http_url}/v1", api_key="none", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        expected = reference(local_engine, prompts[:SLOTS], max_tokens, ignore_eos=True)
        results: dict[int, tuple] = {}
        chunks = [0] * SLOTS  # text chunks received so far: at most one per round (the first: the prefill token)

        def run(i: int) -> None:
            parts, usage = [], None
            for chunk in client.chat.completions.create(
                    model=model_id, messages=[{"role": "user", "content": prompts[i]}], max_tokens=max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                    chunks[i] += 1
                if chunk.usage is not None:
                    usage = chunk.usage
            results[i] = ("".join(parts), usage)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(SLOTS)]
        for t in threads:
            t.start()
        # speculation under way: every stream past its prefill token and two more rounds (the draft
        # model is the target: every round drafts k and has them all accepted)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and min(chunks) < 3:
            time.sleep(0.02)
        at_kill = list(chunks)
        assert min(at_kill) >= 3 and not results, at_kill  # all still running
        s.processes["drafter"].send_signal(signal.SIGKILL)
        s.processes["drafter"].wait()
        for t in threads:
            t.join(timeout=180)
        assert sorted(results) == list(range(SLOTS))
        for i, ref in enumerate(expected):
            text, usage = results[i]
            assert text == ref.text, f"prompt {i} changed after the drafter died"
            assert usage.completion_tokens == ref.completion_tokens == max_tokens
            assert chunks[i] > at_kill[i], f"prompt {i} had finished before the kill"
            sd = usage.model_extra["speculative_decoding"]
            # drafted, and had drafts accepted, before the kill (the drafter stayed dead until every
            # request finished), and not after it: later rounds ran without drafts
            assert 0 < sd["num_accepted_tokens"] <= sd["num_draft_tokens"] < k * sd["num_verify_steps"], (i, sd)
        assert health(s)["drafter"] == {"address": s.drafter_address, "available": False}  # the replica probes it
        usage = stream_text(client, model_id, prompts[0], 8)[1]  # target-only meanwhile
        assert usage.model_extra["speculative_decoding"]["num_draft_tokens"] == 0
        s.restart("drafter")
        want = reference(local_engine, prompts[:1], MAX_TOKENS, ignore_eos=True)[0]
        deadline = time.monotonic() + 30
        drafted = 0
        while time.monotonic() < deadline and not drafted:
            text, usage, _ = stream_text(client, model_id, prompts[0], MAX_TOKENS, ignore_eos=True)
            drafted = usage.model_extra["speculative_decoding"]["num_draft_tokens"]
            assert text == want.text
        assert drafted > 0 and health(s)["drafter"]["available"] is True
        s.processes["drafter"].send_signal(signal.SIGTERM)  # a graceful stop ends the replica's open stream
        assert s.processes["drafter"].wait(timeout=30) == 0
        text, usage, _ = stream_text(client, model_id, prompts[0], MAX_TOKENS, ignore_eos=True)
        assert text == want.text
        assert "the drafter service is shutting down" in s.logs["verifier"].read_text()
        assert_quiet_logs(s)
    finally:
        s.stop()


class Streams:
    """Greedy chat streams run in threads, to their full length (ignore_eos): what each received,
    how many text chunks so far, and the error of those that failed."""

    def __init__(self, client, model_id: str, prompts: list[str], max_tokens: int, whole=()) -> None:
        self.whole = set(whole)  # these are not streamed (stream = false): the answer comes in one piece
        self.texts: dict[int, str] = {}
        self.errors: dict[int, Exception] = {}
        self.chunks = [0] * len(prompts)
        self.threads = [threading.Thread(target=self._run, args=(client, model_id, i, p, max_tokens))
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, client, model_id: str, i: int, prompt: str, max_tokens: int) -> None:
        parts = []
        try:
            if i in self.whole:
                r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
                self.texts[i] = r.choices[0].message.content
                return
            for chunk in client.chat.completions.create(
                    model=model_id, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                    self.chunks[i] += 1
            self.texts[i] = "".join(parts)
        except openai.APIError as exc:
            self.errors[i] = exc

    def wait_running(self, chunks: int = 3, timeout_s: float = 120) -> None:
        """Until every stream has received ``chunks`` text chunks (all decoding, none finished); the
        answers taken whole are not waited for."""
        streamed = [c for i, c in enumerate(self.chunks) if i not in self.whole]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and min(streamed) < chunks:
            time.sleep(0.02)
            streamed = [c for i, c in enumerate(self.chunks) if i not in self.whole]
        assert min(streamed) >= chunks and not self.texts and not self.errors, self.chunks

    def join(self, timeout_s: float = 180) -> None:
        for t in self.threads:
            t.join(timeout=timeout_s)


def test_a_dead_or_hung_replica_loses_no_request(tiny_dir, local_engine, prompts):
    """Two verifier replicas, 2 x SLOTS long greedy streams spread over them. SIGKILL one mid-stream:
    its requests resume on the other from their accepted prefix (those not streamed, whose replica
    sent nothing yet, from their prompt), and every request completes with exactly the no-fault
    output, no error. Restarted, the replica serves again. SIGSTOP one (hung,
    not dead) mid-stream: its requests move within the router's keepalive deadline and again
    complete unchanged. The replicas own their slots: none is left held."""
    deadline_s = 2.0
    stack = start_stack(StackConfig(model=tiny_dir, drafter="ngram", max_batch_size=SLOTS, max_seq_len=CONTEXT,
                                    num_verifiers=2, verifier_timeout_s=deadline_s, grpc_front_door=False),
                        timeout_s=180)
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        work = [prompts[i % len(prompts)] for i in range(2 * SLOTS)]
        n = 64
        want = [r.text for r in reference(local_engine, work, n, ignore_eos=True)]

        runs = Streams(client, model_id, work, n, whole=range(1, len(work), 3))
        runs.wait_running()
        assert wait_held(stack, SLOTS, replica=0) == SLOTS and wait_held(stack, SLOTS, replica=1) == SLOTS
        stack.processes["verifier0"].send_signal(signal.SIGKILL)
        stack.processes["verifier0"].wait()
        runs.join()
        assert not runs.errors and [runs.texts[i] for i in range(len(work))] == want
        assert [v["healthy"] for v in health(stack)["verifiers"]] == [False, True]
        assert "resuming after" in stack.logs["router"].read_text()

        stack.restart("verifier0")
        deadline = time.monotonic() + 15
        while not all(v["healthy"] for v in health(stack)["verifiers"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(v["healthy"] for v in health(stack)["verifiers"])

        runs = Streams(client, model_id, work, n)
        runs.wait_running()
        assert wait_held(stack, SLOTS, replica=1) == SLOTS
        stack.processes["verifier1"].send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            runs.join()
            moved_s = time.monotonic() - t0
        finally:
            stack.processes["verifier1"].send_signal(signal.SIGCONT)
        assert not runs.errors and [runs.texts[i] for i in range(len(work))] == want
        assert moved_s < 4 * deadline_s + 20, moved_s  # the keepalive deadline, then the rest of the decode
        assert wait_held(stack, 0, replica=0) == 0 and wait_held(stack, 0, replica=1) == 0

        # shut down gracefully (SIGTERM: a rolling update) mid-stream, a replica ends its streams with
        # UNAVAILABLE and exits 0; its requests resume on the other, unchanged
        deadline = time.monotonic() + 15
        while not all(v["healthy"] for v in health(stack)["verifiers"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        runs = Streams(client, model_id, work, n)
        runs.wait_running()
        assert wait_held(stack, SLOTS, replica=0) == SLOTS
        stack.processes["verifier0"].send_signal(signal.SIGTERM)
        assert stack.processes["verifier0"].wait(timeout=30) == 0
        runs.join()
        assert not runs.errors and [runs.texts[i] for i in range(len(work))] == want
        assert "the verifier replica is shutting down" in stack.logs["router"].read_text()
        assert_quiet_logs(stack)  # killed, hung and stopped replicas: no process logged a traceback
    finally:
        stack.stop()


def assert_quiet_logs(stack) -> None:
    """No process of ``stack`` logged a traceback or an asyncio complaint (a task left pending, an
    exception never retrieved): failures and shutdowns are reported in one line each."""
    for name, path in stack.logs.items():
        if path.exists():
            text = path.read_text()
            for needle in ("Traceback", "Task was destroyed", "never retrieved", "already running"):
                assert needle not in text, f"{name} logged {needle!r}:\n{text[-3000:]}"


def test_replica_crash_then_router_restart_leaks_no_slot(tiny_dir, local_engine, prompts):
    """One verifier replica. Killed with SLOTS streams in flight, a request arriving during the
    outage, then restarted: every request resumes (or starts) there, complete and unchanged.
    The router killed mid-stream, then restarted: the replica freed the dead router's slots (a
    later SLOTS-wide batch runs at once). With no replica for ``failover_wait_s`` a request gets
    a clear 503 (a stream is refused up front) and the router's gRPC health says NOT_SERVING."""
    stack = start_stack(StackConfig(model=tiny_dir, drafter="ngram", max_batch_size=SLOTS, max_seq_len=CONTEXT,
                                    api_key=KEY, verifier_timeout_s=2.0, failover_wait_s=20.0), timeout_s=180)
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=KEY, max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        n = 48
        want = [r.text for r in reference(local_engine, prompts[:SLOTS + 1], n, ignore_eos=True)]
        runs = Streams(client, model_id, prompts[:SLOTS], n)
        runs.wait_running()
        stack.processes["verifier"].send_signal(signal.SIGKILL)
        stack.processes["verifier"].wait()
        late = Streams(client, model_id, prompts[SLOTS:SLOTS + 1], n)  # arrives during the outage
        stack.restart("verifier")
        runs.join()
        late.join()
        assert not runs.errors and not late.errors, (runs.errors, late.errors)
        assert [runs.texts[i] for i in range(SLOTS)] + [late.texts[0]] == want

        runs = Streams(client, model_id, prompts[:SLOTS], CONTEXT // 2)
        runs.wait_running()
        stack.processes["router"].send_signal(signal.SIGKILL)
        stack.processes["router"].wait()
        runs.join()
        assert len(runs.errors) == SLOTS  # their router died
        stack.restart("router")
        assert wait_held(stack, 0) == 0  # the replica freed them when the router's calls broke
        runs = Streams(client, model_id, prompts[:SLOTS], 8)
        runs.join()
        assert not runs.errors and [runs.texts[i] for i in range(SLOTS)] == [
            r.text for r in reference(local_engine, prompts[:SLOTS], 8, ignore_eos=True)]

        stack.processes["verifier"].send_signal(signal.SIGKILL)
        stack.processes["verifier"].wait()
        deadline = time.monotonic() + 10
        while health(stack)["status"] != "unavailable" and time.monotonic() < deadline:
            time.sleep(0.2)
        h = health(stack)
        assert h["status"] == "unavailable" and not h["verifiers"][0]["healthy"]
        t0 = time.monotonic()
        refused = {}

        def ask(stream: bool) -> None:
            try:
                client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompts[0]}],
                                               max_tokens=8, temperature=0, stream=stream)
            except openai.APIStatusError as exc:
                refused[stream] = (exc, time.monotonic() - t0)

        asking = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
        for t in asking:
            t.start()
        for t in asking:
            t.join(timeout=120)
        # both waited failover_wait_s for a replica to come back, then a 503; the stream is refused
        # up front, not a 200 then an error
        assert sorted(refused) == [False, True]
        for exc, waited in refused.values():
            # (streamed or not, the same reason: the wait, and each replica's last error)
            assert exc.status_code == 503 and "no verifier replica is available after" in exc.message
            assert exc.message.endswith("; retry later")
            assert 15 < waited < 60, waited
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(stack.grpc_address) as ch:  # the standard health service follows
            stub = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 10
            status = None
            while time.monotonic() < deadline and status != health_pb2.HealthCheckResponse.NOT_SERVING:
                status = stub.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Router"), timeout=5).status
                time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        stack.stop()


# ----------------------------------------------------------------------------- sampling over gRPC is lossless


def test_speculative_sampling_over_grpc_is_lossless(sampling_setup):
    """Draft-model drafts with sparse top-K q (K < vocabulary, so the truncation matters) go through
    the drafter service and a verifier replica's client of it; sampled tokens still follow
    target-only sampling exactly (chi-square on marginals and a joint, as in test_speculative)."""
    from test_speculative import SAMPLING_CONFIGS, SAMPLING_DEPTH, check_distributions, exact_distributions

    from services.drafter.server import serve as serve_drafter
    from services.drafter.client import RemoteDrafter
    from tandem.target import LocalTarget

    target, draft_ck, prompt, logits = sampling_setup
    n = 1200
    cfg = RunnerConfig(device="cpu", max_batch_size=64, max_seq_len=64)
    local = LocalTarget(target.checkpoint, cfg)
    draft_model = DraftModelDrafter(draft_ck, cfg)
    drafter = BackgroundServer(lambda ready, stop: serve_drafter(draft_model, 64, 0, max_probs_per_token=8,
                                                              ready=ready, stop=stop))
    try:
        remote = RemoteDrafter(drafter.address, SMALL_VOCAB)
        eng = Engine(tokenizer=target.tokenizer, drafter=remote, num_draft_tokens=SAMPLING_DEPTH - 2, target=local)
        params = SAMPLING_CONFIGS["T1.0"]
        ids = [eng.add_request(prompt_ids=prompt, params=replace(params, max_tokens=SAMPLING_DEPTH, seed=s,
                                                                   ignore_eos=True)) for s in range(n)]
        done = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = eng.completion(out.request_id)
        samples = torch.tensor([done[i].token_ids for i in ids])
        marginals, pair = exact_distributions(logits, params)
        check_distributions(samples, marginals, pair, "draft model over gRPC, top-8 q")
        assert eng.stats.num_drafted > n and 0.05 < eng.stats.acceptance_rate < 0.95, eng.stats
        remote.close()
    finally:
        drafter.stop()


def test_seeded_sampling_through_a_drafter_service_is_reproducible(sampling_setup):
    """A seeded sampled request drafted by a drafter service gives the same tokens whatever runs
    beside it and whether the replica asks for next-round drafts early (prefetch) or not: the
    service draws each draft from (seed, position), not from a generator whose draws depend on
    how many rounds were asked for."""
    from services.drafter.client import RemoteDrafter
    from services.drafter.server import serve as serve_drafter
    from tandem.target import LocalTarget

    target, draft_ck, prompt, _ = sampling_setup
    cfg = RunnerConfig(device="cpu", max_batch_size=8, max_seq_len=64)
    drafter = BackgroundServer(lambda ready, stop: serve_drafter(DraftModelDrafter(draft_ck, cfg), 64, 0,
                                                              max_probs_per_token=8, ready=ready, stop=stop))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
    runs = []
    try:
        for overlap, beside in ((True, 0), (True, 5), (False, 2)):
            remote = RemoteDrafter(drafter.address, SMALL_VOCAB)
            eng = Engine(tokenizer=target.tokenizer, drafter=remote, num_draft_tokens=3,
                         target=LocalTarget(target.checkpoint, cfg))
            eng.overlap_drafting = overlap
            rid = eng.add_request(prompt_ids=prompt, params=seeded)
            for i in range(beside):
                eng.add_request(prompt_ids=prompt[i:], params=replace(seeded, seed=100 + i, temperature=1.0))
            while eng.has_unfinished():
                eng.step()
            runs.append(eng.completion(rid).token_ids)
            assert eng.stats.num_drafted > 0
            remote.close()
    finally:
        drafter.stop()
    assert runs[0] == runs[1] == runs[2], runs


# ----------------------------------------------------------------------------- the real model (slow)


@pytest.mark.slow
def test_real_model_through_the_stack(on_real_target):
    """The bundled SmolLM2-135M through verifier + n-gram drafter + router processes: greedy
    outputs (streamed and not) equal the in-process engine's, and drafts are accepted; a
    non-streamed request whose client goes away is aborted within 2 s."""
    stack = start_stack(StackConfig(drafter="ngram", max_batch_size=4, max_seq_len=1024), timeout_s=300)
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", max_retries=0, timeout=300)
        model_id = client.models.list().data[0].id
        engine = on_real_target(NgramDrafter(), num_draft_tokens=4)  # in-process, same model and context
        prompts = [spec_bench_prompts(250)[i] for i in (244, 41)]  # qa, coding
        accepted = 0
        for prompt in prompts:
            ref = engine.generate([prompt], SamplingParams(max_tokens=32))[0]
            r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=32, temperature=0)
            assert r.choices[0].message.content == ref.text
            text, usage, _ = stream_text(client, model_id, prompt, 32)
            assert text == ref.text
            accepted += usage.model_extra["speculative_decoding"]["num_accepted_tokens"]
        assert accepted > 0
        _stop_after_held_text_ends_a_logprobs_stream(client, model_id)
        _disconnect_aborts_a_non_streamed_request(stack, model_id, prompts[0])
    finally:
        stack.stop()


def _stop_after_held_text_ends_a_logprobs_stream(client, model_id: str) -> None:
    """A stop string ("3.") whose first character ended an earlier step's text (held back then,
    cut now): the request's last step adds no token, so its last event carries no tokens and no
    log-probabilities. Streamed chat with logprobs still ends with its finish chunk and [DONE]
    (it broke off with a server error once), and the log-probabilities' tokens join to the text,
    streamed and not."""
    kw = dict(model=model_id, messages=[{"role": "user", "content": "Count from 1 to 20 separated by commas."}],
              max_tokens=30, temperature=0, stop=["3."], logprobs=True)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == "3."
    assert "".join(t.token for t in c.logprobs.content) == c.message.content
    parts, tokens, reasons = [], [], []
    for chunk in client.chat.completions.create(**kw, stream=True):  # the client raises if the stream breaks off
        parts.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
        if chunk.choices[0].logprobs is not None:
            tokens += [t.token for t in chunk.choices[0].logprobs.content]
    assert "".join(parts) == "".join(tokens) == c.message.content
    assert reasons[-1] == "stop" and not any(reasons[:-1])


def _disconnect_aborts_a_non_streamed_request(stack, model_id: str, prompt: str) -> None:
    """A non-streamed request whose client goes away is aborted: the running-requests gauge drops
    to zero within 2 s of the connection closing, and the request never finishes (on the real
    model on a CPU its 900 tokens would take many seconds more)."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(stack.http_url)
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                       "max_tokens": 900, "ignore_eos": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    finished = metric_sum(stack, "tandem_request_success_total")
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and metric(stack, "tandem_num_requests_running") < 1:
            time.sleep(0.05)
        assert metric(stack, "tandem_num_requests_running") == 1  # decoding
    closed = time.monotonic()
    while time.monotonic() - closed < 2 and metric(stack, "tandem_num_requests_running") > 0:
        time.sleep(0.05)
    assert metric(stack, "tandem_num_requests_running") == 0, "still running 2 s after the client left"
    assert metric_sum(stack, "tandem_request_success_total") == finished  # aborted, not finished


def test_trace_report_of_a_distributed_run(tiny_dir, prompts, tmp_path):
    """Each process writes its spans (TANDEM_TRACE_FILE): the router's ``route`` span parents the
    replica's ``generate`` span of the same request (trace context in the call's metadata), and the
    replica's rpc.client.draft spans parent the drafter service's rpc.server.draft spans through
    the trace context each stream message carries, so trace-report pairs them into network samples
    inside rounds."""
    from click.testing import CliRunner

    from tandem.cli import main

    traces = tmp_path / "traces"
    s = start_stack(StackConfig(model=tiny_dir, drafter="ngram", drafter_service=True, max_batch_size=SLOTS,
                                max_seq_len=CONTEXT, trace_dir=str(traces), overlap=False), timeout_s=180)
    try:
        client = openai.OpenAI(base_url=f"{s.http_url}/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        for p in prompts[:3]:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0)
    finally:
        s.stop()
    files = sorted(str(f) for f in traces.glob("*.jsonl"))
    assert [f.rsplit("/", 1)[1] for f in files] == ["drafter.jsonl", "router.jsonl", "verifier.jsonl"]
    res = CliRunner().invoke(main, ["trace-report", *files, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    ph = report["phases"]
    assert ph["request"]["count"] == 3 and ph["round"]["count"] >= 3
    from tandem.trace_report import read_spans

    spans = [sp for f in files for sp in read_spans(f)]
    # every draft round crossed the wire once, inside a round: one network sample per client RPC
    draft_rpcs = [sp for sp in spans if sp.name == "rpc.client.draft"]
    assert ph["network"]["count"] == len(draft_rpcs) > 0
    assert 0 < report["network_share"] < 1
    requests = [sp for sp in spans if sp.name == "request"]  # OpenTelemetry's GenAI conventions on each
    assert len(requests) == 3
    for sp in requests:
        a = sp.attributes
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == model
        assert a["gen_ai.usage.input_tokens"] > 0 and 0 < a["gen_ai.usage.output_tokens"] <= MAX_TOKENS
        assert a["gen_ai.request.max_tokens"] == MAX_TOKENS and a["outcome"] == "finished"
    client_traces = {sp.trace_id for sp in spans if sp.name.startswith("rpc.client.")}
    servers = [sp for sp in spans if sp.name.startswith("rpc.server.")]
    assert servers and all(sp.trace_id in client_traces for sp in servers)  # joined their callers' traces
    routes = {sp.span_id: sp for sp in spans if sp.name == "route"}
    generates = [sp for sp in spans if sp.name == "generate"]
    assert len(routes) == len(generates) == 3
    assert all(g.parent_span_id in routes and routes[g.parent_span_id].trace_id == g.trace_id for g in generates)
    # the instrumentations' spans: HTTP requests (FastAPI) and whole RPCs (gRPC), with their conventions
    http = [sp for sp in spans if (sp.attributes.get("http.request.method") or sp.attributes.get("http.method")) == "POST"
            and "/v1/chat/completions" in str(sp.attributes.get("http.route", ""))]
    assert http and {sp.trace_id for sp in requests} <= {sp.trace_id for sp in http}  # each request under its POST
    rpcs = {(sp.attributes.get("rpc.service"), sp.attributes.get("rpc.method")) for sp in spans
            if sp.attributes.get("rpc.system") == "grpc"}
    assert {("tandem.v1.Verifier", "Generate"), ("tandem.v1.Verifier", "Info"), ("tandem.v1.Drafter", "Draft")} <= rpcs


def test_port_in_use_is_a_one_line_error():
    """A service on a taken port fails at once with a clear message (no silent port sharing)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = str(held.getsockname()[1])
        for service in (["drafter", "--drafter", "ngram"], ["router", "--verifier", "127.0.0.1:9"]):
            args = [service[0], "--port", taken, *service[1:]]
            res = subprocess.run([sys.executable, "-m", "tandem", "serve", *args], capture_output=True, text=True,
                                 timeout=120)
            assert res.returncode == 2 and f"cannot listen on 127.0.0.1:{taken}" in res.stderr, res.stderr
            assert "Traceback" not in res.stderr


def test_drafter_service_sends_predictor_scores(tiny_dir, tmp_path):
    """`tandem serve drafter --predictor PATH`: each draft arrives with the predictor's acceptance
    probability of its features (the router then allocates with those)."""
    import subprocess
    import sys

    from services.launch import free_port, wait_grpc_healthy
    from services.drafter.client import RemoteDrafter
    from tandem.drafters.base import DraftRequest
    from tandem.predictor import AcceptancePredictor

    pred = "tandem/drafters/weights/draft-model-smollm2-135m/predictor.safetensors"
    port = free_port()
    log = open(tmp_path / "drafter.log", "wb")  # in the test's own directory: nothing left in /tmp
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "drafter", "--port", str(port), "--drafter",
                             "ngram", "--model", tiny_dir, "--predictor", pred], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_grpc_healthy(f"127.0.0.1:{port}", 120, proc, log.name)
        drafter = RemoteDrafter(f"127.0.0.1:{port}", 1000)
        seq = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # n-gram lookup proposes 8, 5, 6, 7
        [p] = drafter.propose([DraftRequest(0, seq, 4, SamplingParams(max_tokens=8))])
        assert p.tokens and p.scores is not None and len(p.scores) == len(p.tokens)
        want = AcceptancePredictor.load(pred).predict(p.features)
        assert torch.allclose(p.scores, want, atol=1e-5)
        drafter.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_categories_are_short_names_and_a_replica_counts_a_bounded_number():
    """A request's ``category`` names a state-store key, so it is a short name (1-64 characters of
    letters, digits, "_", ".", ":", "-"; empty means "default") at every boundary, and a replica
    keeps counters for its first ``MAX_CATEGORIES`` distinct ones, every later one under "other"."""
    from services.common import MAX_CATEGORIES, AcceptanceCategories, check_category
    from tandem.errors import InvalidRequestError

    assert check_category("") == "default" and check_category("math_reasoning") == "math_reasoning"
    assert check_category("team-a:qa.v2") == "team-a:qa.v2"
    for bad in ("c" * 65, "a b", "x/y", "caf\u00e9", "line\nbreak"):
        with pytest.raises(InvalidRequestError, match="is not 1-64 characters") as err:
            check_category(bad)
        assert err.value.param == "category" and len(str(err.value)) < 200
    seen = AcceptanceCategories(limit=3)
    keys = [seen.key(c) for c in ("a", "b", "a", "c", "d", "e", "b")]
    assert keys == ["a", "b", "a", "c", "other", "other", "b"] and MAX_CATEGORIES >= 64


def test_fields_at_their_no_op_value_are_accepted():
    """OpenAI fields Tandem does not implement pass only at the value that changes nothing
    (``NO_OP_VALUES``); any other value, or a field nobody knows, is a 400 naming it."""
    from services.router.schema import ChatCompletionRequest, CompletionRequest
    from tandem.errors import InvalidRequestError

    hi = [{"role": "user", "content": "hi"}]
    ok = ChatCompletionRequest(messages=hi, functions=[], user="user-1", store=False, max_tokens=8)
    assert ok.sampling(16).max_tokens == 8
    for extra, name in [({"functions": [{"name": "f"}]}, "functions"), ({"store": True}, "store")]:
        with pytest.raises(InvalidRequestError, match=f"unsupported field\\(s\\): {name}") as err:
            ChatCompletionRequest(messages=hi, **extra).sampling(16)
        assert "no-op value (" in str(err.value)  # and says which value that is
    with pytest.raises(InvalidRequestError, match="unknown field\\(s\\): max_token ") as err:  # a typo: unknown
        ChatCompletionRequest(messages=hi, max_token=5, store=True).sampling(16)
    assert err.value.param == "max_token"
    for name, value in [("user", 5), ("safety_identifier", {"a": 1}), ("prompt_cache_key", [1, 2])]:
        with pytest.raises(InvalidRequestError, match=f"{name} must be a string"):
            ChatCompletionRequest(messages=hi, **{name: value}).sampling(16)
    with pytest.raises(InvalidRequestError, match="unsupported field\\(s\\): messages.0.name"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "name": "ann"}]).sampling(16)
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "name": None}]).sampling(16)
    nulls = ChatCompletionRequest.model_validate({"messages": hi, "temperature": None, "stream": None, "top_p": None,
                                                  "category": None, "min_tokens": None, "seed": None})
    assert (nulls.temperature, nulls.stream, nulls.category) == (1.0, False, "default")  # null: as if left out
    assert nulls.sampling(16).min_tokens == 0
    with pytest.raises(InvalidRequestError, match="suffix"):
        CompletionRequest(prompt="hi", suffix="!").sampling(16)


def test_chat_with_only_empty_messages_is_an_empty_prompt():
    """A chat whose every message is empty is refused like an empty completions prompt (the chat
    template around it is not a prompt); one non-empty message is enough."""
    from services.router.http import ChatMessage, _chat_content
    from tandem.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        _chat_content([ChatMessage(role="system", content=""), ChatMessage(role="user", content="  ")], [], None)
    assert _chat_content([ChatMessage(role="system", content=""), ChatMessage(role="user", content="hi")],
                         [], None)[1] == {"role": "user", "content": "hi"}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    rendered = _chat_content([ChatMessage(role="user", content="hi"),
                              ChatMessage(role="assistant", content=None, tool_calls=[call]),
                              ChatMessage(role="tool", content="42", tool_call_id="call_1")], [], None)
    assert rendered[1] == {"role": "assistant", "content": '{"name": "f", "arguments": {}}'}
    assert rendered[2] == {"role": "tool", "content": "Result of tool call call_1: 42"}
    with pytest.raises(InvalidRequestError, match="arguments"):
        _chat_content([ChatMessage(role="assistant", content=None, tool_calls=[{"function": {"name": "f"}}])], [], None)


def test_body_over_the_limit_is_a_413_chunked_or_not():
    """A body over MAX_BODY_BYTES is refused before anything parses it, whether its size comes in
    Content-Length or only shows while a chunked body is read (no router is reached either way)."""
    from fastapi.testclient import TestClient

    from services.router.http import MAX_BODY_BYTES, build_app

    client = TestClient(build_app(router=None))
    chunks = (b"x" * 2**20 for _ in range(MAX_BODY_BYTES // 2**20 + 2))
    for body in (b"x" * (MAX_BODY_BYTES + 1), chunks):
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "over 4 MiB" in r.json()["error"]["message"], r.text



def test_a_body_that_stops_arriving_is_a_408(monkeypatch):
    """Fewer body bytes than Content-Length said, then silence: the request gets 408 after
    BODY_READ_TIMEOUT_S instead of holding its connection; a complete body is not timed after."""
    import asyncio

    from services.router import http

    monkeypatch.setattr(http, "BODY_READ_TIMEOUT_S", 0.2)
    app = http.build_app(router=None)

    async def call(parts):
        sent = []
        queue = list(parts)

        async def receive():
            if queue:
                return queue.pop(0)
            await asyncio.sleep(3600)  # the client sends nothing more

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]}
        await asyncio.wait_for(app(scope, receive, send), 5)
        return sent

    sent = asyncio.run(call([{"type": "http.request", "body": b'{"model": "x"', "more_body": True}]))
    assert sent[0]["status"] == 408
    assert "stopped arriving" in json.loads(sent[1]["body"])["error"]["message"]
    # a complete (here invalid) body is answered at once, whatever receive does afterwards
    sent = asyncio.run(call([{"type": "http.request", "body": b'{"model": 1}', "more_body": False}]))
    assert sent[0]["status"] == 400


def test_router_reads_the_replicas_tokenizer(tiny_dir):
    """The router's tokenizer: ``--model`` when given; else the replicas' model path when it is
    readable on the router's host; else the bundled model only if that is what they serve; a model
    elsewhere is a one-line ConfigError asking for --model."""
    from services.router.core import router_model
    from tandem.errors import ConfigError
    from tandem.models.weights import default_model_path

    assert router_model("/my/copy", "/elsewhere/model.gguf") == "/my/copy"
    assert router_model(None, tiny_dir) == tiny_dir
    assert router_model(None, f"/on/another/host/{default_model_path().name}") is None
    with pytest.raises(ConfigError, match="pass --model"):
        router_model(None, "/on/another/host/other-model.gguf")


def test_unary_calls_are_retried_by_grpc_on_unavailable():
    """``retry_options``: gRPC's own retryPolicy retries a unary call that failed with UNAVAILABLE
    (the router's Info / Load polls), with no retry loop of ours; other codes are not retried."""

    from services.common import CLIENT_OPTIONS, GrpcServer, retry_options
    from services.proto.tandem.v1 import verifier_pb2, verifier_pb2_grpc

    calls = []

    class Flaky(verifier_pb2_grpc.VerifierServicer):
        async def Load(self, request, context):
            calls.append("load")
            if len(calls) < 3:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
            return verifier_pb2.LoadReport(num_slots=4)

        async def Info(self, request, context):
            calls.append("info")
            await context.abort(grpc.StatusCode.INTERNAL, "broken")

    async def serve(ready, stop):
        server = GrpcServer()
        verifier_pb2_grpc.add_VerifierServicer_to_server(Flaky(), server.server)
        await server.serve_until(["tandem.v1.Verifier"], ready, stop)

    server = BackgroundServer(serve)
    try:
        with grpc.insecure_channel(server.address, options=CLIENT_OPTIONS + retry_options(
                "tandem.v1.Verifier", ["Info", "Load"])) as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            assert stub.Load(verifier_pb2.LoadRequest(), timeout=10).num_slots == 4
            assert calls == ["load"] * 3  # two UNAVAILABLE answers retried by gRPC
            with pytest.raises(grpc.RpcError) as err:
                stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.INTERNAL and calls.count("info") == 1
    finally:
        server.stop()


def test_a_replica_steps_events_become_one_message_per_stream():
    """``VerifierServicer._events``: one engine step's events of a stream as one message: a
    request's consecutive deltas merged, plain deltas (tokens and text) in the message's columns,
    a delta with log-probabilities as an event, a request's last delta sent with its completion
    (finish reason, stop reason, counters), a failure as an error event; engine ids carry the
    stream's prefix, the message the router's ids. The router (``step_events``) reads it back as
    one event per request and step, in order, also when steps were sent as one message; it merges
    what queued for a request the same way."""
    from services.common import Delta, Done, Failed
    from services.proto.tandem.v1 import verifier_pb2
    from services.router.replicas import merge_events, step_events
    from services.verifier.server import VerifierServicer, merge_outputs
    from tandem.metrics import SpecDecodeStats
    from tandem.requests import Completion, RequestOutput

    spec = SpecDecodeStats(3, 5, 8, 2, [3, 3, 2], [1, 1, 0])
    done = Completion("s0/b", "xyz", [7, 8, 9], "stop", 4, 0.1, 0.2, 0.05, spec, stop_reason="\n")
    events = [("s0/a", Delta(RequestOutput("s0/a", [1, 2], "ab", False, None))),
              ("s0/b", Delta(RequestOutput("s0/b", [7, 8], "xy", False, None))),
              ("s0/a", Delta(RequestOutput("s0/a", [3], "c", False, None))),
              ("s0/b", Delta(RequestOutput("s0/b", [9], "z", True, "stop"))),
              ("s0/b", Done(done)),
              ("s0/c", Failed("bad prompt", invalid=True)),
              ("s0/d", Delta(RequestOutput("s0/d", [4], "d", False, None, [-0.25], ["d"]))),
              ("s0/e", Delta(RequestOutput("s0/e", [], "", False, None)))]  # nothing new: not sent
    msg, settled = VerifierServicer._events(events, "s0/")
    assert settled == ["b", "c"]
    assert list(msg.deltas.request_ids) == ["a"] and list(msg.deltas.num_tokens) == [3]
    assert list(msg.deltas.token_ids) == [1, 2, 3] and list(msg.deltas.texts) == ["abc"]
    by_id = {e.request_id: e for e in msg.events}
    assert list(by_id) == ["b", "c", "d"]
    b = by_id["b"]
    assert list(b.token_ids) == [7, 8, 9] and b.text == "xyz" and b.finished and b.finish_reason == "stop"
    assert b.stop_string == "\n" and (b.spec.num_drafted, b.spec.num_accepted) == (8, 2)
    assert b.since_first_token_s == pytest.approx(0.1)  # latency less TTFT: the router's TTFT of a whole answer
    assert list(b.spec.accepted_per_pos) == [1, 1, 0]
    assert by_id["c"].error == "bad prompt" and by_id["c"].invalid
    assert list(by_id["d"].token_ids) == [4] and list(by_id["d"].logprobs) == [-0.25]
    assert list(by_id["d"].token_texts) == ["d"]

    # a later step of a and its end, sent with the first as one message (a stream that fell behind)
    later, _ = VerifierServicer._events([("s0/a", Delta(RequestOutput("s0/a", [5, 6], "ef", False, None))),
                                         ("s0/f", Delta(RequestOutput("s0/f", [11], "k", False, None)))], "s0/")
    end, _ = VerifierServicer._events([("s0/a", Delta(RequestOutput("s0/a", [], "", True, "length"))),
                                       ("s0/a", Done(Completion("s0/a", "abcef", [1, 2, 3, 5, 6], "length", 2, 0.1,
                                                                0.2, 0.05, SpecDecodeStats())))], "s0/")
    wire = verifier_pb2.ReplicaEvents()
    for part in (msg, later, end):
        wire.MergeFrom(part)
    read = list(step_events(verifier_pb2.ReplicaEvents.FromString(wire.SerializeToString())))
    of_a = [(list(e.token_ids), e.text, e.finished) for e in read if e.request_id == "a"]
    assert of_a == [([1, 2, 3], "abc", False), ([5, 6], "ef", False), ([], "", True)]
    assert [(list(e.token_ids), e.text) for e in read if e.request_id == "f"] == [([11], "k")]
    assert [e.request_id for e in read if e.request_id not in ("a", "f")] == ["b", "c", "d"]
    bad = verifier_pb2.ReplicaEvents()
    bad.deltas.request_ids.extend(["a", "b"])
    bad.deltas.num_tokens.extend([1, 2])
    bad.deltas.token_ids.extend([1, 2])
    bad.deltas.texts.extend(["x", "y"])
    with pytest.raises(ValueError, match="malformed step deltas"):
        list(step_events(bad))

    lp = merge_outputs(RequestOutput("r", [1], "a", False, None, [-0.5], ["a"]),
                       RequestOutput("r", [2], "b", True, "length", [-1.5], ["b"]))
    assert (lp.new_token_ids, lp.text_delta, lp.logprobs, lp.token_texts, lp.finished) == (
        [1, 2], "ab", [-0.5, -1.5], ["a", "b"], True)
    merged = merge_events(read[0], b)
    assert list(merged.token_ids) == [1, 2, 3, 7, 8, 9] and merged.text == "abcxyz" and merged.finished


def test_readme_lists_every_request_field():
    """The README's field table names every field the request models define and every field
    NO_OP_VALUES knows; a field it does not list is refused."""
    import re
    from pathlib import Path

    from services.router.schema import NO_OP_VALUES, ChatCompletionRequest, CompletionRequest
    from tandem.errors import InvalidRequestError

    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    table = readme[readme.index("Every OpenAI request field"):readme.index("Routing: each request goes")]
    listed = set(re.findall(r"`([a-z_]+)`", table))
    defined = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields) | set(NO_OP_VALUES)
    assert defined <= listed, sorted(defined - listed)
    with pytest.raises(InvalidRequestError, match="unknown field\\(s\\): frobnicate"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], frobnicate=1).sampling(16)
    for name, value in [("audio", {"voice": "x"}), ("reasoning_effort", "high"), ("service_tier", "flex"),
                        ("modalities", ["text", "audio"]), ("best_of", 2)]:
        with pytest.raises(InvalidRequestError, match=f"unsupported field\\(s\\): {name}"):
            ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **{name: value}).sampling(16)
    ok = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], safety_identifier="u1",
                               prompt_cache_key="k", service_tier="auto", modalities=["text"], best_of=1)
    assert ok.sampling(16).max_tokens == 16


def test_a_cancelled_streams_cross_context_detach_is_not_logged_as_an_error():
    """A streaming call cancelled when its peer goes away has its generator closed from another
    task, so OpenTelemetry's server interceptor cannot detach the context it attached and logs
    "Failed to detach context" with a ValueError (the span still ends). A server's process drops
    that one report; any other detach failure is still logged."""
    import contextvars
    import logging

    from opentelemetry import context

    from services.common import quiet_cross_context_detach

    quiet_cross_context_detach()  # what every GrpcServer of a process does
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    logging.getLogger("opentelemetry.context").addHandler(handler)
    try:
        token = context.attach(context.get_current())
        contextvars.copy_context().run(context.detach, token)  # detached in another Context
        assert records == []
        context.detach("not a token")
        assert [r.getMessage() for r in records] == ["Failed to detach context"]
    finally:
        logging.getLogger("opentelemetry.context").removeHandler(handler)


def test_load_report_counts_the_replicas_graph_captures(tiny_dir, monkeypatch):
    """A replica's ``Load`` report carries the CUDA graphs its process has captured (what the
    distributed bench's warm-up watches): ``CapturedCall.made``, not a constant; and its engine
    thread's steps and their time, its rounds, their rows and its prefills, counted as they run."""
    import asyncio

    from services.proto.tandem.v1 import verifier_pb2
    from services.verifier.replica import ReplicaEngine
    from services.verifier.server import VerifierServicer
    from tandem.engine import Engine
    from tandem.models.graphs import CapturedCall
    from tandem.models.runner import RunnerConfig

    replica = ReplicaEngine(Engine(tiny_dir, RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=64)))
    try:
        servicer = VerifierServicer(replica, eos_token_ids=[0])
        for made in (0, 7):
            monkeypatch.setattr(CapturedCall, "made", made)
            assert asyncio.run(servicer.Load(verifier_pb2.LoadRequest(), None)).graphs_captured == made
        # and its engine thread's steps: none yet, then those one request ran, with their time
        report = asyncio.run(servicer.Load(verifier_pb2.LoadRequest(), None))
        assert (report.engine_steps, report.engine_step_s, report.engine_deliver_s) == (0, 0.0, 0.0)
        assert (report.engine_rounds, report.engine_round_rows, report.engine_prefills) == (0, 0, 0)
        done = threading.Event()
        req = replica.engine.make_request(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=3))
        replica.submit(req, lambda events: done.set() if any(isinstance(e, Done) for _, e in events) else None)
        assert done.wait(60)
        report = asyncio.run(servicer.Load(verifier_pb2.LoadRequest(), None))
        assert 2 <= report.engine_steps <= 4 and report.engine_step_s > 0 and report.engine_deliver_s > 0
        # one prefill (its first token), then rounds of one row for the other two tokens
        assert report.engine_prefills == 1 and report.engine_prefill_s > 0
        assert 1 <= report.engine_rounds <= 3 and report.engine_round_rows == report.engine_rounds
    finally:
        replica.stop()
