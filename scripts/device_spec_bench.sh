#!/usr/bin/env bash
# Spec-Bench comparison on the GPU (issue #7), time-boxed to fit one 10-minute device call:
# every configuration at batch 1, then at 16/64/128, each with the verifier cost table.
# Only the results.json files and the logs land in $out (the device returns 8 files at most);
# merge them here into tables and plots:
#   tandem bench --from-results OUT/b1.json,OUT/big.json --out docs/results/<date>/spec-bench
#
#   scripts/device_spec_bench.sh MODEL OUT [extra tandem bench options, e.g. --draft-model PATH --exact-kernels]
# CONFIGS overrides the configuration list (default: all of them; the trained drafters default to the
# weights shipped in tandem/drafters/weights/, else pass --draft-model / --specformer).
set -uo pipefail
model=$1; out=$2; shift 2
export PYTHONUNBUFFERED=1
configs=${CONFIGS:-target,ngram,draft-model,specformer,context-aware,hf-generate,hf-prompt-lookup}
common=(--model "$model" --max-tokens 256 --limit 20 --configs "$configs" --cost-table "$@")
timeout 300 python3 -m tandem bench "${common[@]}" --batch-sizes 1 --out /tmp/spec_bench_b1 \
  > "$out/b1.log" 2>&1; echo "batch 1 rc=$?"
timeout 270 python3 -m tandem bench "${common[@]}" --batch-sizes 16,64,128 --out /tmp/spec_bench_big \
  > "$out/big.log" 2>&1; echo "batch 16,64,128 rc=$?"
cp /tmp/spec_bench_b1/results.json "$out/b1.json"; cp /tmp/spec_bench_big/results.json "$out/big.json"
tail -25 "$out/b1.log"; tail -25 "$out/big.log"
