"""The SpecFormer head on the fused kernels, as chained rounds run it on a GPU (its norms, SwiGLU
activations, RoPE + K/V write and attention as Triton kernels; the residual adds folded into the
norms; the target's final norm as one kernel), checked on the CPU under Triton's interpreter
(float32) against the same head on the plain ops, round by round: the same drafts, context
states within float32 rounding, the same tokens. Both look up through the lookup kernel, as on a
GPU (``tests/test_lookup_kernel.py`` checks it against the plain lookup)."""

from __future__ import annotations

import pytest
import torch

from tandem.drafters.specformer import SpecFormerDrafter
from tandem.engine import Engine
from tandem.models import kernels
from tandem.models.runner import RunnerConfig
from tandem.models.weights import load_checkpoint
from tandem.sampling import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not kernels.interpreted(),
                                reason="needs triton, and no GPU (the tests' conftest turns the interpreter on then)")

# head_dim 64 (the fused kernels' size), 3 query heads per KV head, as the bundled SmolLM2
FUSED_SHAPE = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, intermediate_size=512)


def _engine(ckpt, kernels_path: str) -> Engine:
    from test_specformer import VARIANTS, _random_head

    head = _random_head(ckpt.config, **VARIANTS["lookup"], context_layers=2, context_mlp=True)
    engine = Engine(ckpt, RunnerConfig(device="cpu", max_batch_size=2, max_seq_len=64, kernels=kernels_path),
                    drafter=SpecFormerDrafter(head), num_draft_tokens=4)
    assert engine.chains_rounds and engine.drafter._fused is (kernels_path == "fused")
    return engine


@pytest.mark.parametrize("rope_inside", [False, True], ids=["rope-apart", "rope-inside"])
def test_chained_head_on_the_fused_kernels_drafts_as_on_the_plain_ops(tiny_checkpoint, monkeypatch, rope_inside):
    """(``rope_inside``: the target's chain steps and the head's context layers take the attention
    with the RoPE + K/V write inside, ``Transformer.rope_in_attention``.)"""
    from tandem.drafters import lookup

    monkeypatch.setattr(lookup, "_on_kernel", lambda history, kernel: kernel is not False)
    ckpt = load_checkpoint(tiny_checkpoint("llama", with_tokenizer=True, **FUSED_SHAPE))
    fused, plain = _engine(ckpt, "fused"), _engine(ckpt, "reference")
    fused.runner.model.rope_in_attention = rope_inside
    prompts = [[5, 9, 5, 9, 5, 9, 5], [100, 200, 300, 100, 200]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for e in (fused, plain):
        for ids in prompts:
            e.add_request(prompt_ids=ids, params=params)
    got: dict[str, dict[str, list[int]]] = {"fused": {}, "plain": {}}
    rounds = 0
    while fused.has_unfinished() or plain.has_unfinished():
        for name, e in (("fused", fused), ("plain", plain)):
            for out in e.step():
                got[name].setdefault(out.request_id, []).extend(out.new_token_ids)
        n = 2
        assert torch.equal(fused.drafter._draft_tokens[:n], plain.drafter._draft_tokens[:n]), rounds
        torch.testing.assert_close(fused.drafter._state[:n], plain.drafter._state[:n], atol=2e-4, rtol=2e-4)
        rounds += 1
        assert rounds < 40
    assert list(got["fused"].values()) == list(got["plain"].values())
    assert fused.stats.num_drafted == plain.stats.num_drafted > 0
