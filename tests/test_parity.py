"""The real default model (SmolLM2-135M-Instruct GGUF) against Hugging Face transformers' own
load of the same file: logits, and greedy generation through the whole engine."""

from __future__ import annotations

import pytest
import torch
from conftest import spec_bench_prompts
from helpers import hf_logits

from tandem.sampling import SamplingParams

pytestmark = pytest.mark.slow


def test_logits_match_hf_over_64_token_prompt(real_engine, hf_model):
    ids = real_engine.encode_prompt(" ".join(spec_bench_prompts(4)))[:64]
    assert len(ids) == 64
    ref = hf_logits(hf_model, ids)

    runner = real_engine.runner
    slot = runner.cache.allocate()
    try:
        ours = runner.step({slot: ids}).logits[slot, :64].clone()
    finally:
        runner.cache.free(slot)
    err = (ours - ref).abs().max().item()
    assert err < 1e-3, f"max abs logit difference {err:.2e} over 64 positions"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_incremental_decode_matches_hf(real_engine, hf_model):
    """Prefill then one token at a time through the KV cache == HF's full forward."""
    ids = real_engine.encode_prompt(spec_bench_prompts(1)[0])[:24]
    ref = hf_logits(hf_model, ids)
    runner = real_engine.runner
    slot = runner.cache.allocate()
    try:
        rows = [runner.prefill({slot: ids[:16]})[0]]
        for t in ids[16:]:
            rows.append(runner.step({slot: [t]}).logits[slot, 0].clone())
    finally:
        runner.cache.free(slot)
    torch.testing.assert_close(torch.stack(rows), ref[15:], atol=1e-3, rtol=0)  # positions 15 .. 23


def test_greedy_generation_matches_hf_generate(real_engine, hf_model):
    prompts = spec_bench_prompts(5)
    encoded = [real_engine.encode_prompt(p) for p in prompts]
    results = real_engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    eos = set(real_engine.tokenizer.eos_token_ids)
    for i, (ids, res) in enumerate(zip(encoded, results)):
        assert res.prompt_tokens == len(ids)
        assert len(res.token_ids) == 32 and res.finish_reason == "length"
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=32, pad_token_id=min(eos))
        hf_new = out[0, len(ids):].tolist()
        if len(hf_new) < 32:  # HF stopped at EOS; ours ignores EOS and runs on
            assert hf_new[-1] in eos
        assert res.token_ids[:len(hf_new)] == hf_new, f"prompt {i}: {prompts[i][:60]!r}"
        assert res.text == real_engine.tokenizer.decode(res.token_ids)


def test_gguf_chat_template_matches_hf(real_engine):
    """Our chat-template encoding is what transformers' tokenizer produces for the same GGUF."""
    prompt = spec_bench_prompts(1)[0]
    hf_tok = real_engine.tokenizer.hf
    expected = hf_tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                          add_generation_prompt=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert real_engine.encode_prompt(prompt) == list(expected)
    assert real_engine.tokenizer.eos_token_ids == (2,)
