"""The documents point at files that exist: raw results under docs/results/ and scripts/."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "tandem" / "drafters" / "weights").glob("*/README.md"))]


def mentioned(pattern: str) -> list[tuple[str, str]]:
    """(document, path) for every match of ``pattern`` in the documents."""
    return [(str(doc.relative_to(ROOT)), m.group(0)) for doc in DOCS for m in re.finditer(pattern, doc.read_text())]


def test_every_results_path_in_the_docs_exists():
    paths = mentioned(r"docs/results/[A-Za-z0-9_.*/-]*[A-Za-z0-9_*/-]")
    assert len(paths) > 20  # the benchmarks page cites its raw files
    missing = [(doc, p) for doc, p in paths if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not missing, missing


def test_every_script_in_the_docs_exists():
    paths = mentioned(r"(?<![:\w/])scripts/[A-Za-z0-9_]+\.(?:sh|py)")
    assert paths
    missing = [(doc, p) for doc, p in paths if not (ROOT / p).is_file()]
    assert not missing, missing
