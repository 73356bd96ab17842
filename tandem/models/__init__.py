"""Target model runner: checkpoint loading, transformer forward, KV cache."""

from .config import ModelConfig, ModelLoadError, RopeScaling
from .kv_cache import CacheFullError, KVCache
from .transformer import Transformer
from .weights import Checkpoint, default_model_path, load_checkpoint

__all__ = [
    "CacheFullError", "Checkpoint", "KVCache", "ModelConfig", "ModelLoadError", "RopeScaling", "Transformer",
    "default_model_path", "load_checkpoint",
]
