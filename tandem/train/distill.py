"""Self-distillation data: the target answers training prompts, and drafters learn from that.

SpecFormer (AAAI 2026) trains its head on the target's *own* answers (keep the prompts, let the
target regenerate the responses): without it the head barely helps. ``distill`` runs the target
greedily with the chat template through the engine at large batch and writes:

- ``shard-NNNNN.bin.gz``: gzip-compressed token ids (``uint16`` when the vocabulary fits, else
  ``uint32``), each record stored as ``prompt ids + answer ids`` back to back (a small target's
  answers repeat themselves, so the shards compress about 4x; uncompressed ``.bin`` shards of
  older runs are read too, and ``compress_shards`` converts them);
- ``manifest.json``: per record the prompt id, shard, offset, prompt and answer lengths and
  finish reason; the target model's sha256 and the generation settings.

Shards are flushed as answers finish, so a run cut short keeps what it wrote, and a second run
with the same output directory skips the prompts already answered (resume). Benchmark prompts
(Spec-Bench, MT-Bench) are never training data: prompts matching any of their turns are dropped.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..data import PromptRecord, bundled_spec_bench
from ..errors import InvalidRequestError

log = logging.getLogger(__name__)

FORMAT = "tandem-distill-v1"


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_fingerprint(path: str | Path) -> str:
    """sha256 identifying a model: of the GGUF file, or of a directory's sorted safetensors hashes."""
    p = Path(path)
    if p.is_file():
        return file_sha256(p)
    h = hashlib.sha256()
    for f in sorted(p.glob("*.safetensors")):
        h.update(f"{f.name}:{file_sha256(f)}\n".encode())
    return h.hexdigest()


def benchmark_texts() -> set[str]:
    """Every turn of the bundled Spec-Bench and MT-Bench files (normalised whitespace)."""
    texts: set[str] = set()
    data_dir = bundled_spec_bench().parent
    for name in ("spec_bench_question.jsonl", "mt_bench_question.jsonl"):
        path = data_dir / name
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                texts.update(" ".join(t.split()) for t in json.loads(line).get("turns", []) if isinstance(t, str))
    return texts


@dataclass
class DistillRecord:
    """One distilled answer: where its tokens are and how it ended."""

    prompt_id: str
    shard: int
    offset: int
    prompt_len: int
    answer_len: int
    finish_reason: str


@dataclass
class DistillManifest:
    """Contents of ``manifest.json``."""

    target: dict
    settings: dict
    records: list[DistillRecord] = field(default_factory=list)
    shards: list[dict] = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    format: str = FORMAT

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def save(self, out_dir: Path) -> None:
        tmp = out_dir / "manifest.json.tmp"
        tmp.write_text(json.dumps(asdict(self), separators=(",", ":")))
        tmp.replace(out_dir / "manifest.json")

    @classmethod
    def load(cls, out_dir: str | Path) -> "DistillManifest":
        """Raises InvalidRequestError: no manifest, not a distillation manifest, or a damaged one
        (unreadable JSON, missing or mistyped fields)."""
        path = Path(out_dir) / "manifest.json"
        if not path.is_file():
            raise InvalidRequestError(f"no distillation data at {str(out_dir)!r} (manifest.json missing); "
                                      "make it with `tandem distill-data` (the bundled target's ships in "
                                      "data/distill/smollm2-135m-instruct)")
        try:
            raw = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"{path} is damaged (not JSON: {exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise InvalidRequestError(f"{path} is not a {FORMAT} manifest")
        try:
            raw["records"] = [DistillRecord(**r) for r in raw["records"]]
            manifest = cls(**raw)
            ok = (isinstance(manifest.target.get("vocab_size"), int) and all(
                isinstance(sh["file"], str) and isinstance(sh["tokens"], int) and isinstance(sh["sha256"], str)
                for sh in manifest.shards))
        except (KeyError, TypeError, AttributeError) as exc:
            raise InvalidRequestError(f"{path} is damaged ({type(exc).__name__}: {exc})") from None
        if not ok:
            raise InvalidRequestError(f"{path} is damaged (target or shard entries of the wrong type)")
        return manifest


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def _write_shard(path: Path, arr: np.ndarray) -> dict:
    """Write ``arr`` gzip-compressed (deterministic: no timestamp) and return its manifest entry."""
    path.write_bytes(gzip.compress(arr.tobytes(), compresslevel=6, mtime=0))
    return {"file": path.name, "tokens": int(arr.size), "sha256": file_sha256(path)}


def _read_shard(path: Path, dtype: np.dtype) -> np.ndarray:
    data = path.read_bytes()
    return np.frombuffer(gzip.decompress(data) if path.name.endswith(".gz") else data, dtype=dtype)


def compress_shards(out_dir: str | Path) -> int:
    """Rewrite a distillation directory's uncompressed ``.bin`` shards as ``.bin.gz`` (checked
    against their manifest sha256 first) and update the manifest; returns the shards converted.

    Raises:
        InvalidRequestError: see ``DistillManifest.load``; a shard missing or corrupt.
    """
    out = Path(out_dir)
    manifest = DistillManifest.load(out)
    dtype = _dtype(manifest.target["vocab_size"])
    done = 0
    for entry in manifest.shards:
        path = out / entry["file"]
        if path.name.endswith(".gz"):
            continue
        if not path.is_file() or file_sha256(path) != entry["sha256"]:
            raise InvalidRequestError(f"distillation shard {path} is missing or corrupt (sha256 mismatch)")
        entry.update(_write_shard(out / (path.name + ".gz"), np.fromfile(path, dtype=dtype)))
        manifest.save(out)
        path.unlink()
        done += 1
    return done


class _ShardWriter:
    """Buffers finished records and flushes them as shards (manifest rewritten on each flush)."""

    def __init__(self, out_dir: Path, manifest: DistillManifest, dtype: np.dtype, shard_tokens: int) -> None:
        self.out_dir, self.manifest, self.dtype, self.shard_tokens = out_dir, manifest, dtype, shard_tokens
        self.buffer: list[tuple[str, list[int], list[int], str]] = []
        self.buffered = 0

    def add(self, prompt_id: str, prompt_ids: list[int], answer_ids: list[int], finish_reason: str) -> None:
        self.buffer.append((prompt_id, prompt_ids, answer_ids, finish_reason))
        self.buffered += len(prompt_ids) + len(answer_ids)
        if self.buffered >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        index = len(self.manifest.shards)
        name = f"shard-{index:05d}.bin.gz"
        tokens, offset = [], 0
        for pid, p, a, reason in self.buffer:
            self.manifest.records.append(DistillRecord(pid, index, offset, len(p), len(a), reason))
            tokens.extend(p)
            tokens.extend(a)
            offset += len(p) + len(a)
        self.manifest.shards.append(_write_shard(self.out_dir / name, np.asarray(tokens, dtype=self.dtype)))
        self.manifest.save(self.out_dir)
        self.buffer, self.buffered = [], 0


def distill(engine, prompts: list[PromptRecord], out_dir: str | Path, max_tokens: int = 512,
            max_prompt_tokens: int = 1024, shard_tokens: int = 1 << 20, settings: dict | None = None,
            on_record: Callable[[int], None] | None = None) -> DistillManifest:
    """Answer ``prompts`` greedily with the target (chat template) and write shards + manifest.

    Args:
        engine: a target-only ``Engine`` (its batch size sets the concurrency).
        prompts: training prompts; benchmark prompts and ids already in ``out_dir`` are skipped.
        out_dir: output directory (created; resumed when it holds a manifest for the same target).
        max_tokens: answer length limit (tokens).
        max_prompt_tokens: longer prompts (after the chat template) are skipped.
        shard_tokens: tokens per shard file (about; 2 bytes each for vocabularies <= 65,536).
        settings: extra provenance written to the manifest (command line, dtype, ...).
        on_record: called with the number of answer tokens after each finished prompt.

    Returns:
        The manifest (also at ``out_dir/manifest.json``).

    Raises:
        InvalidRequestError: every prompt is a benchmark prompt, or ``out_dir`` holds data made by
            another target model or with another answer length limit.
    """
    from ..sampling import SamplingParams

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ck = engine.checkpoint
    target = {"path": ck.path.name, "sha256": model_fingerprint(ck.path), "architecture": ck.config.architecture,
              "num_layers": ck.config.num_layers, "vocab_size": ck.config.vocab_size}
    resumed = (out / "manifest.json").is_file()
    if resumed:
        manifest = DistillManifest.load(out)
        if manifest.target.get("sha256") != target["sha256"]:
            raise InvalidRequestError(f"{out} holds data distilled from another target model; use a new --out")
        was = manifest.settings.get("max_tokens")
        if was is not None and was != max_tokens:  # answers cut at another length would mix silently
            raise InvalidRequestError(f"{out} holds answers of at most {was} tokens (max_tokens {was} -> "
                                      f"{max_tokens}); resume with --max-tokens {was}, or use a new --out")
        new_file = (settings or {}).get("prompts_file")
        files = manifest.settings.get("prompts_files") or [manifest.settings.get("prompts_file")]
        if new_file is not None and new_file not in files:  # answers to another prompt set join this data
            manifest.settings["prompts_files"] = [*files, new_file]
    else:
        manifest = DistillManifest(target, dict(settings or {}, max_tokens=max_tokens, greedy=True, chat_template=True,
                                                max_prompt_tokens=max_prompt_tokens))
    done = {r.prompt_id for r in manifest.records}
    banned = benchmark_texts()
    todo = []
    skipped = dict(manifest.skipped) or {"benchmark": 0, "too_long": 0}
    for rec in prompts:
        if rec.prompt_id in done:
            continue
        if " ".join(rec.text.split()) in banned:
            skipped["benchmark"] += 1
            continue
        ids = engine.encode_prompt(rec.text)
        if len(ids) > max_prompt_tokens or len(ids) + 1 >= engine.max_seq_len:
            skipped["too_long"] += 1
            continue
        todo.append((rec.prompt_id, ids))
    if prompts and not todo and not done and skipped["benchmark"] == len(prompts):
        raise InvalidRequestError("every prompt is a Spec-Bench / MT-Bench prompt; benchmarks are never training data")
    if resumed and todo and settings:  # the top-level settings are the first run's: note each later one
        manifest.settings.setdefault("resumed", []).append(
            dict({k: v for k, v in settings.items() if k in ("command", "prompts_file", "device")},
                 answers_before=len(done)))
    manifest.skipped = skipped
    writer = _ShardWriter(out, manifest, _dtype(ck.config.vocab_size), shard_tokens)
    params = SamplingParams(max_tokens=max_tokens)
    by_rid = {}
    for pid, ids in todo:
        by_rid[engine.add_request(prompt_ids=ids, params=params)] = (pid, ids)
    try:
        while by_rid:
            for o in engine.step():
                if o.finished and o.request_id in by_rid:
                    pid, ids = by_rid.pop(o.request_id)
                    c = engine.completion(o.request_id)
                    writer.add(pid, ids, c.token_ids, c.finish_reason)
                    if on_record is not None:
                        on_record(len(c.token_ids))
    finally:
        for rid in by_rid:
            engine.abort(rid)
        writer.flush()
        manifest.save(out)
    return manifest


@dataclass(frozen=True)
class DistilledSequence:
    """``tokens`` = prompt + answer ids; the answer starts at ``prompt_len``."""

    tokens: np.ndarray
    prompt_len: int


def read_distilled(out_dir: str | Path, verify: bool = True) -> tuple[DistillManifest, list[DistilledSequence]]:
    """Load a distillation directory.

    Raises:
        InvalidRequestError: missing manifest or shard, or a shard whose sha256 does not match.
    """
    out = Path(out_dir)
    manifest = DistillManifest.load(out)
    dtype = _dtype(manifest.target["vocab_size"])
    shards = []
    for s in manifest.shards:
        path = out / s["file"]
        if not path.is_file():
            raise InvalidRequestError(f"distillation shard {path} is missing")
        if verify and file_sha256(path) != s["sha256"]:
            raise InvalidRequestError(f"distillation shard {path} is corrupt (sha256 mismatch)")
        try:
            shards.append(_read_shard(path, dtype))
        except (OSError, EOFError) as exc:  # a truncated or non-gzip file under a .gz name
            raise InvalidRequestError(f"distillation shard {path} cannot be read: {exc}") from None
    for s, arr in zip(manifest.shards, shards):
        if arr.size != s["tokens"]:
            raise InvalidRequestError(f"distillation shard {out / s['file']} holds {arr.size} tokens; the manifest "
                                      f"says {s['tokens']}")
    for r in manifest.records:
        fields = (r.shard, r.offset, r.prompt_len, r.answer_len)
        if not (all(isinstance(x, int) for x in fields) and 0 <= r.shard < len(shards) and min(r.offset, r.prompt_len) >= 0
                and r.answer_len >= 0 and r.offset + r.prompt_len + r.answer_len <= shards[r.shard].size):
            raise InvalidRequestError(f"{out / 'manifest.json'} is damaged: record {r.prompt_id!r} points outside "
                                      "its shard")
    seqs = [DistilledSequence(shards[r.shard][r.offset:r.offset + r.prompt_len + r.answer_len].astype(np.int64),
                              r.prompt_len) for r in manifest.records]
    return manifest, seqs


def cut_answers(seqs: list[DistilledSequence], max_len: int | None = None,
                max_answer_tokens: int | None = None) -> list[DistilledSequence]:
    """Sequences cut to at most ``max_len`` tokens in all and ``max_answer_tokens`` answer tokens
    (the answers' tails are dropped; None: no limit)."""
    out = []
    for s in seqs:
        n = len(s.tokens)
        if max_len is not None:
            n = min(n, max_len)
        if max_answer_tokens is not None:
            n = min(n, s.prompt_len + max_answer_tokens)
        out.append(s if n == len(s.tokens) else DistilledSequence(s.tokens[:n], s.prompt_len))
    return out


def iter_batches(seqs: list[DistilledSequence], max_batch_tokens: int, rng: np.random.Generator,
                 max_len: int | None = None, max_answer_tokens: int | None = None) -> Iterator[list[DistilledSequence]]:
    """Length-bucketed batches (padded rows x longest length <= ``max_batch_tokens``) in random order.

    Sequences are cut to ``max_len`` tokens and ``max_answer_tokens`` answer tokens (``cut_answers``).
    """
    seqs = cut_answers(seqs, max_len, max_answer_tokens)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens))
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, len(seqs[i].tokens))
        if cur and w * (len(cur) + 1) > max_batch_tokens:
            batches.append(cur)
            cur, w = [], len(seqs[i].tokens)
        cur.append(seqs[i])
        width = w
    if cur:
        batches.append(cur)
    for j in rng.permutation(len(batches)):
        yield batches[j]
