"""Structured output (``tandem.structured``): outputs match their JSON schema or grammar at
temperature 0 and 0.8 for every drafter, greedy structured output equals target-only structured
output token for token, structured requests leave the others in their batch untouched, bad
schemas are refused at the boundary, and the grammar's masks are exact (drafts cut at the first
forbidden one, the matcher rolled back)."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.errors import InvalidRequestError
from tandem.sampling import SamplingParams
from tandem.structured import Structure, unpack_bitmask

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colours"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                         "colours": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}
PROMPTS = ["Give me a JSON object describing a person named Ann, aged 30, who likes red and blue.",
           "Describe a made-up person as JSON."]
MAX_TOKENS = 72


def _drafted_engine(mode: str, real_checkpoint, real_engine, on_real_target):
    """An engine on the real model's target with ``mode``'s drafter."""
    from tandem.control import DraftPolicy
    from tandem.drafters import DraftModelDrafter, NgramDrafter, load_draft_checkpoint
    from tandem.speculation import SpeculativeConfig, build_engine

    cfg = real_engine.runner_config
    if mode == "target":
        return on_real_target(None)
    if mode == "ngram":  # a chained engine: structured requests make its rounds host-driven
        return on_real_target(NgramDrafter(), num_draft_tokens=4)
    if mode == "draft-model-tree":  # trees become chains under a grammar
        policy = DraftPolicy(lambda f: torch.where(f[:, 3] <= 1, 0.95, 0.05), acceptance_threshold=0.5, branch_top_m=3)
        return on_real_target(DraftModelDrafter(load_draft_checkpoint("truncate:4", real_checkpoint), cfg),
                              num_draft_tokens=3, draft_policy=policy)
    assert mode == "specformer"  # the shipped head, on a tapping target of its own
    return build_engine(SpeculativeConfig(drafter="specformer", num_draft_tokens=4), share=real_engine)


def _run(engine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return [engine.completion(i) for i in ids]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ngram", "draft-model-tree", "specformer"])
def test_structured_output_is_lossless_and_valid(real_checkpoint, real_engine, on_real_target, mode):
    """For each drafter: greedy JSON-schema output equals target-only's token for token, every
    output (greedy and sampled at 0.8) parses and validates, drafts were verified, and a plain
    request decoding beside the structured ones gets its own target-only output."""
    jsonschema = pytest.importorskip("jsonschema")
    structure = Structure("json_schema", json.dumps(PERSON))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, structure=structure)
    want = _run(on_real_target(None), PROMPTS, [greedy] * 2)
    plain_prompt = "Write the numbers 1 to 12 separated by spaces."
    plain_want = _run(on_real_target(None), [plain_prompt], [SamplingParams(max_tokens=24)])[0]
    engine = _drafted_engine(mode, real_checkpoint, real_engine, on_real_target)
    got = _run(engine, PROMPTS + [plain_prompt], [greedy] * 2 + [SamplingParams(max_tokens=24)])
    assert engine.stats.num_drafted > 0 and engine.stats.num_accepted > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids, (g.text, w.text)
        assert g.finish_reason == "stop"
        jsonschema.validate(json.loads(g.text), PERSON)
    assert got[2].token_ids == plain_want.token_ids  # the batch's plain request is untouched
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=s, structure=structure) for s in (1, 2)]
    sampled += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3, structure=Structure("json_object"))]
    outs = _run(engine, PROMPTS + PROMPTS[:1], sampled)
    for out in outs[:2]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert outs[2].text.startswith("{")  # any JSON object: complete when it stopped, else cut by max_tokens
    if outs[2].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].text), dict)
    assert engine.chains_rounds == (mode in ("ngram", "specformer"))  # chained again once they finished


@pytest.mark.slow
def test_lark_and_regex_structures(real_engine):
    """Other grammar kinds: a regex and a Lark grammar hold the output to their language."""
    out = real_engine.generate(["What is 6 times 7? Answer with a number."],
                               SamplingParams(max_tokens=8, structure=Structure("regex", r"[0-9]{1,3}")))[0]
    assert out.text.isdigit() and 1 <= len(out.text) <= 3 and out.finish_reason == "stop"
    lark = 'start: "yes" | "no"'
    out = real_engine.generate(["Is the sky blue?"], SamplingParams(max_tokens=8, temperature=0.9, seed=5,
                                                                   structure=Structure("lark", lark)))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("structure, needle", [
    (Structure("json_schema", "{not json"), "not valid JSON"),
    (Structure("json_schema", "[1, 2]"), "must be a JSON object"),
    (Structure("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}})), "bad"),
    (Structure("lark", "start: ("), "bad lark"),
    (Structure("regex", "(unclosed"), 'bad regex: invalid regex "\\(unclosed" \\(in regex\\): regex parse error: unclosed group$'),
    (Structure("regex", "["), "bad regex: .*unclosed character class$"),
])
def test_bad_structures_are_refused_at_the_boundary(real_engine, structure, needle):
    with pytest.raises(InvalidRequestError, match=needle) as info:
        real_engine.add_request("hi", SamplingParams(max_tokens=4, structure=structure))
    assert "\n" not in str(info.value)  # one line, as the HTTP error and the CLI print it
    assert info.value.param == "response_format"
    assert not real_engine.requests and not real_engine._structured


def test_structure_kinds_are_checked():
    with pytest.raises(InvalidRequestError, match="kind"):
        Structure("xml")
    with pytest.raises(InvalidRequestError, match="the JSON schema is empty"):
        Structure("json_schema")
    for clash in ({"min_tokens": 3}, {"ignore_eos": True}):  # a complete grammar allows only EOS
        with pytest.raises(InvalidRequestError, match="cannot be combined with structured output") as info:
            SamplingParams(max_tokens=8, structure=Structure("json_object"), **clash)
        assert info.value.param == next(iter(clash))


@pytest.mark.slow
def test_masks_cut_drafts_at_the_first_forbidden_one(real_engine):
    """``Grammar.masks`` allows exactly the grammar's next tokens at each kept draft, cuts the
    drafts at the first forbidden one, and leaves the matcher where it was."""
    tok = real_engine.tokenizer
    grammar = real_engine.grammars.compile(Structure("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})))
    V = real_engine.target.info.vocab_size
    good = tok.encode('{"a": 12}')
    bad = good[:3] + tok.encode(" x")  # a letter where an integer must come
    masks, m = grammar.masks(bad)
    assert m == 3 and masks.shape[0] == 4
    allowed = unpack_bitmask(masks, V)
    assert all(bool(allowed[j, t]) for j, t in enumerate(bad[:3]))  # each kept draft was allowed where it stood
    assert not bool(allowed[3, bad[3]])  # the cut draft is not
    again, m2 = grammar.masks(good)  # the matcher was rolled back: the good drafts all pass from the start
    assert m2 == len(good) and torch.equal(again[:4], masks)
    grammar.advance(good)
    end = unpack_bitmask(grammar.masks([])[0], V)[0]
    assert end.nonzero().flatten().tolist() == [tok.eos_token_ids[0]]  # complete: only EOS


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["none", "ngram", "specformer"])
def test_cuda_graph_rounds_with_adjustments_top_logprobs_and_grammars(real_checkpoint, drafter):
    """On the GPU (float32, CUDA graphs): logit adjustments and top_logprobs inside chained
    rounds' graphs, and a structured request (host-driven rounds with grammar masks) beside them,
    give target-only's greedy tokens and alternatives; rounds chain again once the structured
    request is done."""
    from tandem.engine import Engine
    from tandem.models.runner import RunnerConfig
    from tandem.speculation import SpeculativeConfig, build_engine

    cfg = RunnerConfig(device="cuda", dtype=torch.float32, max_batch_size=4, max_seq_len=512, cuda_graphs=True)
    ref = Engine(real_checkpoint, cfg)
    engine = ref if drafter == "none" else build_engine(SpeculativeConfig(drafter=drafter, num_draft_tokens=4),
                                                        share=ref)
    adjusted = SamplingParams(max_tokens=40, frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.1,
                              min_tokens=12, logit_bias={28: 2.0})
    structured = SamplingParams(max_tokens=MAX_TOKENS, structure=Structure("json_schema", json.dumps(PERSON)))
    prompts = ["Write the numbers 1 to 12 separated by spaces.", "Answer with one word: is the sky blue?"]

    def run(e, with_structure: bool):
        ids = [e.add_request(p, adjusted, top_logprobs=3) for p in prompts]
        if with_structure:
            ids.append(e.add_request(PROMPTS[0], structured))
        while e.has_unfinished():
            e.step()
        return [e.completion(i) for i in ids]

    want = [run(ref, False), run(ref, True)]
    got = [run(engine, False), run(engine, True)]
    for w_run, g_run in zip(want, got):
        for w, g in zip(w_run, g_run):
            assert g.token_ids == w.token_ids, (g.text, w.text)
            if w.top_logprobs is not None:
                assert [[t for t, _ in a] for a in g.top_logprobs] == [[t for t, _ in a] for a in w.top_logprobs]
    json.loads(got[1][2].text)
    if drafter != "none":
        assert engine.stats.num_accepted > 0
    assert engine.chains_rounds


@pytest.mark.slow
def test_a_resumed_request_continues_its_grammar_and_penalties(real_engine):
    """A request resumed elsewhere (a replica failure: its prompt then holds the output already
    streamed, ``resumed`` of its tokens) continues exactly where it stopped: its grammar and its
    penalty counts start after that output."""
    from dataclasses import replace

    params = SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=2.0, presence_penalty=1.5,
                            structure=Structure("json_schema", json.dumps(PERSON)))
    prompt_ids = real_engine.encode_prompt(PROMPTS[0])
    whole = _run_ids(real_engine, prompt_ids, params, 0)
    assert len(whole) > 12
    for done in (1, 12, 20):
        rest = _run_ids(real_engine, prompt_ids + whole[:done], replace(params, max_tokens=MAX_TOKENS - done), done)
        assert rest == whole[done:], done
    with pytest.raises(InvalidRequestError, match="resumed output"):
        real_engine.make_request(prompt_ids=[1, 2], params=params, resumed=2)


def _run_ids(engine, prompt_ids, params, resumed):
    req = engine.make_request(prompt_ids=prompt_ids, params=params, resumed=resumed)
    engine.submit(req)
    while engine.has_unfinished():
        engine.step()
    return engine.completion(req.request_id).token_ids


@pytest.mark.slow
def test_the_mask_walk_overlaps_the_forward(real_engine, on_real_target, monkeypatch):
    """A round's grammar masks are walked on a thread while the forward is queued: every round's
    forward is queued while its walk is still running (the walk made slow here to show it), and
    the output is still target-only's."""
    import threading
    import time

    import tandem.structured as structured
    from tandem.drafters import NgramDrafter

    pending = threading.Event()  # a round's walk was started and has not ended
    during: list[bool] = []  # per forward: was a walk pending
    walk, start = structured.batch_masks, structured.MaskWalk.__init__

    def slow_walk(*args, **kwargs):
        time.sleep(0.05)
        out = walk(*args, **kwargs)
        pending.clear()
        return out

    def started(self, *args, **kwargs):
        pending.set()
        start(self, *args, **kwargs)

    params = SamplingParams(max_tokens=24, structure=Structure("json_schema", json.dumps(PERSON)))
    want = _run(on_real_target(None), PROMPTS[:1], [params])[0]
    engine = on_real_target(NgramDrafter(), num_draft_tokens=4)
    step = engine.runner.step

    def traced_step(*args, **kwargs):
        during.append(pending.is_set())
        return step(*args, **kwargs)

    monkeypatch.setattr(structured, "batch_masks", slow_walk)
    monkeypatch.setattr(structured.MaskWalk, "__init__", started)
    monkeypatch.setattr(engine.runner, "step", traced_step)
    got = _run(engine, PROMPTS[:1], [params])[0]
    assert got.token_ids == want.token_ids
    assert len(during) > 3 and all(during), during


@pytest.mark.slow
def test_a_waiting_structured_request_leaves_rounds_chained(real_engine, on_real_target):
    """Rounds turn host-driven when a structured request takes a KV slot, not while it waits for
    one, and chain again once it is done."""
    from tandem.drafters import NgramDrafter

    engine = on_real_target(NgramDrafter(), num_draft_tokens=4)
    engine.max_running = 1  # the plain request holds the only slot; the structured one waits
    plain = engine.add_request("Write the numbers 1 to 12 separated by spaces.", SamplingParams(max_tokens=16))
    structured = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, structure=Structure(
        "json_schema", json.dumps(PERSON))))
    seen = []  # (chained, structured request admitted) per step
    while engine.has_unfinished():
        engine.step()
        seen.append((engine.chains_rounds, engine.requests[structured].slot is not None
                     if structured in engine.requests else None))
    assert (True, False) in seen  # the plain request decoded in chained rounds while the other waited
    assert all(not chained for chained, admitted in seen if admitted)  # host-driven while it held a slot
    assert engine.chains_rounds
    assert engine.completion(plain).token_ids and json.loads(engine.completion(structured).text)
