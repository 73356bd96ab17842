#!/usr/bin/env bash
# Second GPU pass: where a step's time goes (T(b,q), cProfile, torch.profiler), the engine's
# throughput at batch 1/16/64, and a float32 lossless check (batch 16 vs batch 1 outputs).
set -uo pipefail
model=$1; out=$2
export PYTHONUNBUFFERED=1
python3 scripts/device_profile.py "$model" > "$out/profile.log" 2>&1
head -8 "$out/profile.log"
python3 -m tandem bench --model "$model" --batch-sizes 1,16,64 --limit 20 --max-tokens 256 --no-hf-baseline \
  --out "$out/compile_graphs" 2>&1 | tee "$out/compile_graphs.log"
python3 -m tandem bench --model "$model" --batch-sizes 1,16 --limit 16 --max-tokens 128 --dtype float32 \
  --no-hf-baseline --out "$out/fp32" 2>&1 | tee "$out/fp32.log"
