"""Checkpoint loading: GGUF and HF safetensors, numerics against HF's forward, load errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import copy_checkpoint, edit_config, hf_logits, make_runner, our_logits
from safetensors.torch import load_file, save_file

from tandem.models import ModelLoadError, load_checkpoint
from tandem.models.runner import ModelRunner, RunnerConfig

ATOL = 1e-4  # float32 on CPU

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}

TINY_CASES = [
    pytest.param(dict(arch="llama"), id="llama"),
    pytest.param(dict(arch="llama", tied=True), id="llama-tied"),
    pytest.param(dict(arch="llama", sharded=True), id="llama-sharded"),
    pytest.param(dict(arch="mistral"), id="mistral"),
    pytest.param(dict(arch="qwen2"), id="qwen2-attention-bias"),
    pytest.param(dict(arch="qwen2", tied=True), id="qwen2-attention-bias-tied"),
    pytest.param(dict(arch="qwen3"), id="qwen3-qk-norm"),
    pytest.param(dict(arch="qwen3", tied=True, sharded=True), id="qwen3-qk-norm-tied-sharded"),
    pytest.param(dict(arch="llama", rope_parameters=LLAMA3_ROPE), id="llama3-rope-scaling"),
    pytest.param(dict(arch="llama", rope_parameters=LINEAR_ROPE), id="linear-rope-scaling"),
]


def _hf_model(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


# ----------------------------------------------------------------------------- formats


@pytest.mark.slow
def test_gguf_default_model_loads(real_checkpoint):
    ck = real_checkpoint
    assert ck.is_gguf and ck.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    c = ck.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == pytest.approx(1e5)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert "lm_head.weight" not in ck.tensors
    assert ck.tensors["embed.weight"].shape == (49152, 576)
    assert ck.tensors["layers.0.wqkv.weight"].shape == ((9 + 2 * 3) * 64, 576)
    assert ck.tensors["layers.29.w13.weight"].shape == (2 * 1536, 576)
    assert all(t.dtype == torch.float32 for t in ck.tensors.values())
    assert ck.chat_template and "im_start" in ck.chat_template


@pytest.mark.parametrize("case", TINY_CASES)
def test_hf_dir_logits_match_transformers(tiny_checkpoint, case):
    d = tiny_checkpoint(**case)
    if case.get("sharded"):
        assert (d / "model.safetensors.index.json").is_file()
        assert len(list(d.glob("*.safetensors"))) > 1
    ck = load_checkpoint(d)
    hf = _hf_model(d)
    c, hc = ck.config, hf.config
    assert c.architecture == case["arch"]
    assert c.tie_word_embeddings == bool(case.get("tied", False))
    assert c.attention_bias == (case["arch"] == "qwen2")
    assert c.qk_norm == (case["arch"] == "qwen3")
    assert c.head_dim == hf.model.layers[0].self_attn.head_dim
    assert c.vocab_size == hc.vocab_size
    if c.tie_word_embeddings:
        assert "lm_head.weight" not in ck.tensors
    else:
        assert not torch.equal(ck.tensors["lm_head.weight"], ck.tensors["embed.weight"])

    ids = torch.randint(0, c.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)
    assert ref.std() > 0.3, "random weights too small for the comparison to mean anything"
    runner = make_runner(ck, slots=2, max_seq_len=64)
    ours = our_logits(runner, ids)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)

    # prefill (chunked) gives the same last-position logits as the one-forward step
    runner2 = ModelRunner(ck, RunnerConfig(device="cpu", max_batch_size=1, max_seq_len=64, prefill_chunk=7))
    last = runner2.prefill({runner2.cache.allocate(): ids})[0]
    torch.testing.assert_close(last, ref[-1], atol=ATOL, rtol=0)


def test_tied_and_untied_differ_only_in_lm_head(tiny_checkpoint):
    untied = load_checkpoint(tiny_checkpoint("llama"))
    tied = load_checkpoint(tiny_checkpoint("llama", tied=True))
    assert set(untied.tensors) - set(tied.tensors) == {"lm_head.weight"}
    runner = make_runner(tied)
    assert runner.model.lm_head.weight.data_ptr() == runner.model.embed.weight.data_ptr()


def _permute_like_llama_cpp(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute`` for q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf_dir, path, arch: str) -> None:
    """Write an F32 GGUF of a tiny HF checkpoint the way llama.cpp's converter lays it out."""
    import gguf

    hf = _hf_model(hf_dir)
    c = hf.config
    sd = {k: v.detach().float() for k, v in hf.state_dict().items()}
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_float32(f"{arch}.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps))
    w.add_uint32(f"{arch}.vocab_size", c.vocab_size)
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)

    def put(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, t.contiguous().numpy())

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        pre, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = sd[pre + "self_attn.q_proj.weight"], sd[pre + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _permute_like_llama_cpp(q, heads), _permute_like_llama_cpp(k, kv_heads)
        put(b + "attn_q.weight", q)
        put(b + "attn_k.weight", k)
        put(b + "attn_v.weight", sd[pre + "self_attn.v_proj.weight"])
        if arch == "qwen2":
            for x in "qkv":
                put(b + f"attn_{x}.bias", sd[pre + f"self_attn.{x}_proj.bias"])
        if arch == "qwen3":
            put(b + "attn_q_norm.weight", sd[pre + "self_attn.q_norm.weight"])
            put(b + "attn_k_norm.weight", sd[pre + "self_attn.k_norm.weight"])
        put(b + "attn_output.weight", sd[pre + "self_attn.o_proj.weight"])
        put(b + "attn_norm.weight", sd[pre + "input_layernorm.weight"])
        put(b + "ffn_norm.weight", sd[pre + "post_attention_layernorm.weight"])
        put(b + "ffn_gate.weight", sd[pre + "mlp.gate_proj.weight"])
        put(b + "ffn_up.weight", sd[pre + "mlp.up_proj.weight"])
        put(b + "ffn_down.weight", sd[pre + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_gguf_of_tiny_model_matches_hf(tiny_checkpoint, tmp_path, arch, tied):
    """GGUF reading for every supported GGUF architecture (llama q/k rows un-permuted, qwen
    kept in HF order), checked against HF's forward of the original safetensors."""
    d = tiny_checkpoint(arch, tied=tied)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(d, path, arch)
    ck = load_checkpoint(path)
    assert ck.is_gguf and ck.config.architecture == arch
    assert ck.config.tie_word_embeddings == tied
    assert ck.config.attention_bias == (arch == "qwen2") and ck.config.qk_norm == (arch == "qwen3")
    hf_cfg = load_checkpoint(d).config
    assert ck.config.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)  # GGUF stores float32
    assert ck.config == dataclasses.replace(hf_cfg, eos_token_ids=(0,), bos_token_id=None,
                                            rms_norm_eps=ck.config.rms_norm_eps)
    ids = torch.randint(0, ck.config.vocab_size, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(our_logits(make_runner(ck), ids), hf_logits(_hf_model(d), ids), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="does not exist") as exc:
        load_checkpoint(missing)
    assert str(missing) in str(exc.value)


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        load_checkpoint(f)


def test_corrupt_gguf(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_checkpoint(f)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_directory_without_safetensors(tiny_checkpoint, tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text((tiny_checkpoint("llama") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_checkpoint(d)


def test_unknown_model_type(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck")
    edit_config(d, model_type="gpt2")
    with pytest.raises(ModelLoadError, match="'gpt2'") as exc:
        load_checkpoint(d)
    assert "llama" in str(exc.value)  # names what is supported


def test_config_missing_key(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck")
    edit_config(d, intermediate_size=None)
    with pytest.raises(ModelLoadError, match="intermediate_size"):
        load_checkpoint(d)


def test_config_not_json(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck")
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')  # truncated
    with pytest.raises(ModelLoadError, match="config.json"):
        load_checkpoint(d)


def test_unsupported_rope_scaling(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck")
    edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="yarn"):
        load_checkpoint(d)


def test_heads_not_multiple_of_kv_heads(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck")
    edit_config(d, num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match="num_kv_heads"):
        load_checkpoint(d)


@pytest.mark.parametrize("key,value,tensor", [
    ("hidden_size", 80, "embed.weight"),
    ("intermediate_size", 96, "w13.weight"),
    ("vocab_size", 1200, "embed.weight"),
])
def test_shape_mismatch(tiny_checkpoint, tmp_path, key, value, tensor):
    d = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck")
    edit_config(d, **{key: value})
    with pytest.raises(ModelLoadError, match="shape mismatch") as exc:
        make_runner(load_checkpoint(d))
    assert tensor in str(exc.value)


def test_missing_shard(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint("llama", sharded=True), tmp_path / "ck")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (d / shard).unlink()
    with pytest.raises(ModelLoadError, match=shard):
        load_checkpoint(d)


@pytest.mark.parametrize("tensor,message,build_runner", [
    ("model.layers.1.mlp.up_proj.weight", "layer 1.*up_proj", False),  # caught while fusing
    ("model.norm.weight", "norm.weight", True),  # caught when the weights are copied in
])
def test_missing_tensor(tiny_checkpoint, tmp_path, tensor, message, build_runner):
    d = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck")
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    del tensors[tensor]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=message):
        ck = load_checkpoint(d)
        if build_runner:
            make_runner(ck)


def test_engine_surfaces_load_errors(tmp_path):
    from tandem.engine import Engine

    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(str(tmp_path / "nothing-here"))
