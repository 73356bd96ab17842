"""Mean accepted length of pure context lookup (prompt lookup decoding with the lookup rule of
tandem/drafters/lookup.py, k = 4) on the committed greedy Spec-Bench traces, for several longest
match lengths: does matching longer suffixes than MAX_N = 4 help? (CPU, seconds.)

    python scripts/lookup_max_n.py [TRACES] [--max-n 1,2,4,8,16]
"""
import argparse
import collections
import gzip
import json
from pathlib import Path

import numpy as np

from tandem.drafters.lookup import lookup_continuations

TOP = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="?", default=str(TOP / "docs/results/2026-12-01/drafters/spec-bench-traces.jsonl.gz"))
    ap.add_argument("--max-n", default="1,2,4,8,16")
    a = ap.parse_args()
    try:
        sizes = [int(v) for v in a.max_n.split(",")]
        rows = [json.loads(line) for line in (gzip.open if a.traces.endswith(".gz") else open)(a.traces, "rt")]
    except (OSError, ValueError) as exc:
        ap.error(str(exc))
    if not sizes or min(sizes) < 1:
        ap.error("--max-n takes positive integers")
    for max_n in sizes:
        emitted, rounds = collections.Counter(), collections.Counter()
        for r in rows:
            x = np.array(r["prompt_ids"] + r["output_ids"])
            cont, _ = lookup_continuations(x, 4, max_n)
            i = len(r["prompt_ids"])  # each round drafts after the last accepted token x[i]
            while i < len(x) - 1:
                acc = 0
                while acc < 4 and i + 1 + acc < len(x) and cont[i][acc] == x[i + 1 + acc]:
                    acc += 1
                rounds[r["category"]] += 1
                emitted[r["category"]] += acc + 1
                i += acc + 1
        per = ", ".join(f"{c} {emitted[c] / rounds[c]:.2f}" for c in sorted(rounds))
        print(f"max_n {max_n}: overall {sum(emitted.values()) / sum(rounds.values()):.3f} ({per})")


if __name__ == "__main__":
    main()
