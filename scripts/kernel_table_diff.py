"""What one configuration's round spends on the GPU beyond another's, kernel by kernel.

``tandem bench`` with ``TANDEM_KERNEL_TABLES=DIR`` writes, per configuration and batch size, the
profiled round-cost run's table of kernels by total GPU time (``DIR/<config>-b<batch>.txt``, its
first line the number of rounds profiled). This prints, per round, each kernel's GPU time and
calls in table A less table B, largest first, and the total: e.g. what the SpecFormer head adds to
a round over n-gram drafting at the same verify width.

    python3 scripts/kernel_table_diff.py tables/specformer-b64.txt tables/ngram-b64.txt [--top 14]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_UNITS_US = {"us": 1.0, "ms": 1e3, "s": 1e6}


def per_round(path: Path) -> dict[str, tuple[float, float]]:
    """``{kernel name: (GPU µs a round, calls a round)}`` from a kernel table's "by GPU time" part."""
    text = path.read_text()
    rounds = int(text.split()[0])
    part = text.split("by GPU time", 1)[1].split("by host time", 1)[0]
    out: dict[str, tuple[float, float]] = {}
    for line in part.splitlines():
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) < 8 or cols[0] in ("Name",) or cols[0].startswith("-"):
            continue
        m = re.fullmatch(r"([0-9.]+)(us|ms|s)", cols[-3])  # "CUDA total"
        if m is None or not cols[-1].isdigit():
            continue
        out[cols[0]] = (float(m.group(1)) * _UNITS_US[m.group(2)] / rounds, int(cols[-1]) / rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="kernel table of the configuration measured")
    ap.add_argument("b", type=Path, help="kernel table it is compared with")
    ap.add_argument("--top", type=int, default=14, help="kernels printed (default 14)")
    args = ap.parse_args(argv)
    a, b = per_round(args.a), per_round(args.b)
    rows = sorted(((a.get(k, (0, 0))[0] - b.get(k, (0, 0))[0], a.get(k, (0, 0))[1] - b.get(k, (0, 0))[1], k)
                   for k in set(a) | set(b)), reverse=True)
    print(f"{args.a.name} less {args.b.name}, per round: {sum(r[0] for r in rows):.1f} us of GPU time")
    for us, calls, name in rows[:args.top]:
        print(f"{us:8.1f} us {calls:5.1f} calls  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
