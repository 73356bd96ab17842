"""Mean accepted length of pure prompt lookup (the n-gram drafter, with the one lookup rule of
tandem/drafters/lookup.py, k = 4) by exact greedy replay of the committed Spec-Bench traces, for
several longest match lengths: does matching longer suffixes than MAX_N = 4 help? (CPU, seconds.)

    python scripts/lookup_max_n.py [TRACES] [--max-n 1,2,4,8,16]
"""
import argparse
from pathlib import Path

from tandem.bench.replay import load_traces, replay, token_drafter_drafts
from tandem.drafters import NgramDrafter

TOP = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="?", default=str(TOP / "docs/results/2026-12-01/drafters/spec-bench-traces.jsonl.gz"))
    ap.add_argument("--max-n", default="1,2,4,8,16")
    a = ap.parse_args()
    try:
        sizes = [int(v) for v in a.max_n.split(",")]
        traces = load_traces(a.traces)
    except ValueError as exc:
        ap.error(str(exc))
    if not sizes or min(sizes) < 1:
        ap.error("--max-n takes positive integers")
    for max_n in sizes:
        overall, per_cat = replay(traces, token_drafter_drafts(NgramDrafter(max_n=max_n), traces), 4)
        per = ", ".join(f"{c} {s['mean_accepted_length']:.2f}" for c, s in per_cat.items())
        print(f"max_n {max_n}: overall {overall['mean_accepted_length']:.3f} ({per})")


if __name__ == "__main__":
    main()
