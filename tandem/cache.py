"""On-disk cache of what is slow to derive from a model file and never changes with it (the
tokenizer transformers builds out of a GGUF's metadata: seconds of CPU at every start-up).

Entries live under ``TANDEM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tandem``, else
``~/.cache/tandem``), keyed by the sha256 of the source file's content plus a format tag (the
library versions that shaped the entry), so an edited or replaced file never meets a stale entry.
Each entry is written into a temporary directory and renamed into place: a reader sees a whole
entry or none, and processes that build the same entry at once do not clash. ``TANDEM_CACHE_DIR=``
(empty) turns the cache off; a cache directory that cannot be written is skipped with a debug
message.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_digests: dict[tuple[str, int, int], str] = {}


def cache_root() -> Path | None:
    """The cache directory (not created here); None when ``TANDEM_CACHE_DIR`` is set empty."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    if env is not None:
        return Path(env).expanduser() if env.strip() else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tandem"


def file_digest(path: str | Path) -> str:
    """sha256 of the file's content (hex); remembered per process while its size and mtime stay."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        h = hashlib.sha256()
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _digests[key] = h.hexdigest()
    return _digests[key]


def entry_dir(kind: str, source: str | Path, tag: str) -> Path | None:
    """Where the ``kind`` entry derived from file ``source`` lives (it may not exist yet); None
    without a cache directory."""
    root = cache_root()
    if root is None:
        return None
    safe_tag = "".join(c if c.isalnum() or c in "._-" else "_" for c in tag)
    return root / kind / f"{file_digest(source)}-{safe_tag}"


def store_dir(entry: Path, write: Callable[[Path], None]) -> bool:
    """Write an entry: ``write(tmp)`` fills a fresh temporary directory beside ``entry``, which
    then is renamed to ``entry`` (atomic). An entry another process put there first is kept.
    Returns whether ``entry`` now exists; failures (a read-only cache, a full disk) are logged and
    swallowed: the cache only saves time."""
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        write(tmp)
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700: let other users read the entry
        try:
            os.replace(tmp, entry)
            tmp = None
        except OSError:  # another process stored it meanwhile (a non-empty directory is not replaced)
            pass
        return entry.is_dir()
    except Exception as exc:  # noqa: BLE001 - any failure only means no cache entry
        log.debug("cache entry %s not written: %s", entry, exc)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
