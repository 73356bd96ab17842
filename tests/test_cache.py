"""The derived-file cache (``tandem.cache``) and the GGUF tokenizer kept in it."""

from __future__ import annotations

import os

import pytest

from tandem import cache
from tandem.models import default_model_path
from tandem.tokenizer import load_hf_tokenizer


def test_entries_are_keyed_by_content_and_written_whole(tmp_path, monkeypatch):
    """An entry's name follows the source file's content (an edit moves it, a copy shares it);
    a stored entry appears whole under its name, a second store of it keeps the first, and a
    failed write leaves nothing behind."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "model.gguf"
    src.write_bytes(b"weights v1")
    first = cache.entry_dir("things", src, "v1")
    assert first.parent == tmp_path / "cache" / "things" and not first.exists()
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(b"weights v1")
    assert cache.entry_dir("things", copy, "v1") == first
    assert cache.entry_dir("things", src, "v2") != first  # the tag (library versions) is part of the key
    src.write_bytes(b"weights v2, longer")  # new size and mtime: hashed again
    assert cache.entry_dir("things", src, "v1") != first

    assert cache.store_dir(first, lambda d: (d / "a.txt").write_text("one"))
    assert (first / "a.txt").read_text() == "one"
    assert cache.store_dir(first, lambda d: (d / "a.txt").write_text("two"))  # already there: kept
    assert (first / "a.txt").read_text() == "one"

    def broken(d):
        (d / "half.txt").write_text("x")
        raise OSError("disk full")

    other = cache.entry_dir("things", copy, "v3")
    assert not cache.store_dir(other, broken)
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temporary left


def test_cache_off_or_unwritable(tmp_path, monkeypatch):
    """``TANDEM_CACHE_DIR=`` turns the cache off; a cache directory that cannot be written only
    means no entry."""
    src = tmp_path / "f.gguf"
    src.write_bytes(b"x")
    monkeypatch.setenv("TANDEM_CACHE_DIR", "")
    assert cache.cache_root() is None and cache.entry_dir("things", src, "v1") is None
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker))
    assert not cache.store_dir(cache.entry_dir("things", src, "v1"), lambda d: None)
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "tandem"


@pytest.mark.slow
def test_cached_gguf_tokenizer_is_the_built_one(real_tokenizer):
    """The GGUF tokenizer read back from the cache is the one transformers builds from the file
    (``real_tokenizer``, built without the cache): same vocabulary, merges, normalizer and
    decoder (the Rust tokenizer's full serialization), special tokens, chat template, and the same
    ids and text on a mixed sample."""
    import transformers

    if cache.cache_root() is None:
        pytest.skip("the cache is turned off (TANDEM_CACHE_DIR is empty)")
    path = default_model_path()
    load_hf_tokenizer(path)  # builds and stores the entry unless an earlier load did
    entry = cache.entry_dir("tokenizers", path, f"transformers-{transformers.__version__}")
    assert (entry / "tokenizer_config.json").is_file()
    stamp = os.stat(entry / "tokenizer.json").st_mtime_ns
    cached = load_hf_tokenizer(path)
    assert os.stat(entry / "tokenizer.json").st_mtime_ns == stamp  # read, not rewritten
    built = real_tokenizer.hf
    assert type(cached) is type(built)
    assert cached.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    assert cached.chat_template == built.chat_template and cached.chat_template
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "clean_up_tokenization_spaces"):
        assert getattr(cached, attr) == getattr(built, attr), attr
    assert len(cached) == len(built)
    texts = ["Hello, world!", "  leading spaces\tand tabs\n\nnew lines", "naïve café — 日本語 🙂",
             "def f(x):\n    return x ** 2  # code", "<|im_start|>user\nhi<|im_end|>"]
    for t in texts:
        ids = built.encode(t, add_special_tokens=False)
        assert cached.encode(t, add_special_tokens=False) == ids
        assert cached.decode(ids, skip_special_tokens=True) == built.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": texts[2]}]
    assert (cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == built.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.slow
def test_cached_gguf_checkpoint_is_the_conversion(real_checkpoint):
    """A GGUF checkpoint read back from the cache is exactly what converting the file gives:
    same config, chat template and float32 tensors, bit for bit (the entry's keying by content
    is checked above)."""
    import importlib.metadata

    import torch

    from tandem.models.weights import GGUF_CACHE_FORMAT, _convert_gguf, load_checkpoint

    if cache.cache_root() is None:
        pytest.skip("the cache is turned off (TANDEM_CACHE_DIR is empty)")
    path = default_model_path()
    entry = cache.entry_dir("checkpoints", path, f"gguf-{importlib.metadata.version('gguf')}-f{GGUF_CACHE_FORMAT}")
    assert (entry / "checkpoint.json").is_file()  # stored when real_checkpoint was loaded (or earlier)
    cached, converted = load_checkpoint(path), _convert_gguf(path)
    assert cached.config == converted.config == real_checkpoint.config
    assert cached.chat_template == converted.chat_template and cached.path == converted.path
    assert cached.tensors.keys() == converted.tensors.keys()
    for name, t in converted.tensors.items():
        assert cached.tensors[name].dtype == t.dtype == torch.float32
        assert torch.equal(cached.tensors[name], t), name
