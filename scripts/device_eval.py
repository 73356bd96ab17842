"""GPU pass 3 of issue #4 (and first figures for #7): Spec-Bench with each drafter beside
target-only decoding in the same engine (CUDA graphs, no compile), greedy, 256 new tokens.

Writes one JSON per (config, batch size) under OUTDIR as it goes: TPS, acceptance rate, mean
accepted length per category, and the share of outputs identical to target-only.
Also runs on CPU (no warm-up; MAX_TOKENS overrides 256).
Usage: python3 scripts/device_eval.py OUTDIR NAME=DRAFTER[:PATH][:K]@BATCH[/LIMIT] ...
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

from tandem.cli.common import _engine
from tandem.speculation import SpeculativeConfig
from tandem.data import bundled_spec_bench, load_prompts, round_robin_by_category
from tandem.bench.acceptance import measure_acceptance
from tandem.sampling import SamplingParams

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
records = load_prompts(bundled_spec_bench())
reference: dict[tuple[int, int], list] = {}
for spec in sys.argv[2:]:
    name, rest = spec.split("=", 1)
    what, tail = rest.split("@")
    batch, limit = (tail.split("/") + [None])[:2]
    batch = int(batch)
    recs = round_robin_by_category(records, int(limit)) if limit else records
    parts = what.split(":")
    drafter, path, k = parts[0], (parts[1] or None) if len(parts) > 1 else None, int(parts[2]) if len(parts) > 2 else 4
    t_load = time.perf_counter()
    e = _engine(None, None, batch, 2048, SpeculativeConfig(drafter, draft_model=path, num_draft_tokens=k), compile_=False)
    params = SamplingParams(max_tokens=int(os.environ.get("MAX_TOKENS", 256)))
    if torch.cuda.is_available():  # warm-up: captures the graphs
        e.generate([r.text for r in recs[:min(len(recs), 2 * batch)]], params)
    t0 = time.perf_counter()
    report, res = measure_acceptance(e, recs, params.max_tokens)
    wall = report.wall_s
    ids = [c.token_ids for c in res]
    key = (batch, len(recs))
    if drafter == "none":
        reference[key] = ids
    ref = reference.get(key)
    row = {"name": name, "drafter": drafter, "k": k, "batch": batch, "prompts": len(recs),
           "output_tokens": report.output_tokens, "wall_s": wall, "tps": report.output_tokens / wall,
           "identical_to_target": None if ref is None else sum(a == b for a, b in zip(ids, ref)) / len(ids),
           "overall": report.overall, "per_category": report.per_category, "load_and_warmup_s": t0 - t_load}
    (out / f"{name}-b{batch}.json").write_text(json.dumps(row, indent=1))
    o = row["overall"]
    print(f"{name:14s} b{batch:<3d} k{k} tps {row['tps']:8.1f}  acc {o['acceptance_rate']:.3f}  "
          f"tau {o['mean_accepted_length']:.2f}  identical {row['identical_to_target']}  wall {wall:.1f}s", flush=True)
    del e
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
