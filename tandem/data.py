"""Prompt files: Spec-Bench / MT-Bench style JSONL (``question_id``, ``category``, ``turns``) or
rows with a ``prompt`` field."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidRequestError


@dataclass(frozen=True)
class PromptRecord:
    """One benchmark prompt: id, category and the first-turn text."""

    prompt_id: str
    category: str
    text: str


def bundled_spec_bench() -> Path:
    """The repository's copy of Spec-Bench (480 prompts, 13 categories)."""
    return Path(__file__).resolve().parent.parent / "data" / "spec_bench_question.jsonl"


def read_text(path: str | Path) -> str:
    """A file's UTF-8 text, gunzipped first when its name ends in ``.gz``.

    Raises:
        OSError: unreadable, or not gzip under a ``.gz`` name (``gzip.BadGzipFile``).
        EOFError: a truncated gzip stream.
        UnicodeDecodeError: not UTF-8.
    """
    import gzip

    p = Path(path)
    raw = p.read_bytes()
    return (gzip.decompress(raw) if p.suffix == ".gz" else raw).decode("utf-8")


# Request fields a prompts file row might carry, expecting them to apply to that prompt: refused,
# since a prompts file sets prompts only (other keys are the row's metadata, e.g. Spec-Bench's
# ``reference``).
REQUEST_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "max_new_tokens", "temperature", "top_p", "top_k",
                            "seed", "stop", "stop_sequences", "n", "stream", "messages", "model", "system",
                            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",
                            "logprobs", "top_logprobs", "response_format", "tools"})


class DuplicateKey(ValueError):
    """A key twice in one JSON object (``args[0]``: the key)."""


def refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads``'s ``object_pairs_hook`` for input we read (prompts files, HTTP request
    bodies): a key twice in one object would leave one of its values ignored in silence (JSON
    parsers keep the last).

    Raises:
        DuplicateKey: the first repeated key.
    """
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


PROMPT_KEYS = frozenset({"prompt", "turns", "question_id", "id", "category"})


def _misspelled_request_fields(row: dict) -> list[tuple[str, str]]:
    """(key, request field) for each key of ``row`` that reads as a misspelt ``REQUEST_FIELDS``
    name (``temprature``): metadata keys are free, but a request field typed wrong would
    otherwise be dropped without a word, as the right spelling is refused."""
    out = []
    for key in row:
        if key in PROMPT_KEYS or key.lower() in REQUEST_FIELDS:
            continue
        match = difflib.get_close_matches(key.lower(), REQUEST_FIELDS, n=1, cutoff=0.8)
        if match:
            out.append((key, match[0]))
    return out


def load_prompts(path: str | Path, limit: int | None = None) -> list[PromptRecord]:
    """Read prompts from a JSONL file, gzip-compressed when its name ends in ``.gz``: each row's
    ``prompt``, or the first turn of its ``turns`` (Spec-Bench / MT-Bench rows; the later turns of
    a multi-turn row are not run). Other keys are metadata (``question_id`` or ``id`` names the
    prompt, ``category`` its task). A UTF-8 byte-order mark at the start is skipped.

    Raises:
        InvalidRequestError: the file is missing, not UTF-8, not gzip under a ``.gz`` name, or a row
            is not JSON, repeats a key, lacks text, has both ``prompt`` and ``turns``, or carries a
            request field (``REQUEST_FIELDS``, or a key that reads as one misspelt: sampling and
            length come from the command, not the file).
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"prompts file {str(p)!r} does not exist")
    records: list[PromptRecord] = []
    try:
        lines = read_text(p).split("\n")  # not splitlines(): JSON strings may hold U+2028
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"{p} is not valid UTF-8: {exc}") from None
    except (OSError, EOFError) as exc:  # BadGzipFile is an OSError
        raise InvalidRequestError(f"{p} cannot be read as gzip: {exc}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.removeprefix("\ufeff") if lineno == 1 else line,
                             object_pairs_hook=refuse_duplicate_keys)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{p}:{lineno}: not JSON ({exc.msg})") from None
        except DuplicateKey as exc:
            raise InvalidRequestError(f"{p}:{lineno}: the key {exc.args[0]!r} appears twice") from None
        if isinstance(row, dict) and (fields := sorted(k for k in row if k.lower() in REQUEST_FIELDS)):
            raise InvalidRequestError(f"{p}:{lineno}: {', '.join(map(repr, fields))}: a prompts file holds prompts only; "
                                      "sampling and length are the command's options (--max-tokens, --temperature, ...)")
        if isinstance(row, dict) and (near := _misspelled_request_fields(row)):
            raise InvalidRequestError(f"{p}:{lineno}: " + ", ".join(f"{k!r} (did you mean {f!r}?)" for k, f in near)
                                      + ": a prompts file holds prompts only; sampling and length are the "
                                      "command's options (--max-tokens, --temperature, ...)")
        if isinstance(row, dict) and "prompt" in row and "turns" in row:
            raise InvalidRequestError(f"{p}:{lineno}: both 'prompt' and 'turns': give one")
        if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        elif isinstance(row, dict) and "prompt" in row:
            text = row["prompt"]
        else:
            raise InvalidRequestError(f"{p}:{lineno}: expected a non-empty 'turns' list or a 'prompt' field")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{p}:{lineno}: the prompt is not a string")
        if not text.strip():
            raise InvalidRequestError(f"{p}:{lineno}: the prompt is empty (or only whitespace)")
        records.append(PromptRecord(str(row.get("question_id", row.get("id", lineno))), str(row.get("category", "-")), text))
        if limit is not None and len(records) >= limit:
            break
    return records


# Spec-Bench (Xia et al. 2024) reports six tasks; its MT-Bench rows keep MT-Bench's eight
# categories, which together are the "multi-turn conversation" task.
MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                 "humanities"})


def spec_bench_task(category: str) -> str:
    """Spec-Bench task of a row's ``category``: "mt_bench" for the eight MT-Bench categories,
    else the category itself (translation, summarization, qa, math_reasoning, rag)."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def round_robin_by_category(records: list[PromptRecord], n: int,
                            key: Callable[[PromptRecord], str] | None = None) -> list[PromptRecord]:
    """The first ``n`` prompts taking one from each category in turn (file order within a
    category), so a small benchmark subset still covers every Spec-Bench category.

    Args:
        key: groups rows (default: ``record.category``; ``spec_bench_task`` of it balances the six
            Spec-Bench tasks instead of the 13 categories).
    """
    by_cat: dict[str, list[PromptRecord]] = {}
    for r in records:
        by_cat.setdefault(key(r) if key is not None else r.category, []).append(r)
    queues = list(by_cat.values())
    out: list[PromptRecord] = []
    i = 0
    while len(out) < min(n, len(records)):
        q = queues[i % len(queues)]
        if q:
            out.append(q.pop(0))
        i += 1
    return out
