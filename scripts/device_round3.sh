#!/usr/bin/env bash
# Third GPU pass: engine throughput (compile + graphs) at batch 1/16/64, a float32 lossless check
# (graphs only: batch 16 outputs vs batch 1), and the GPU tests. Each step is time-boxed.
set -uo pipefail
model=$1; out=$2
export PYTHONUNBUFFERED=1
timeout 270 python3 -m tandem bench --model "$model" --batch-sizes 1,16,64 --limit 20 --max-tokens 256 --no-hf-baseline \
  --out "$out/compile_graphs" > "$out/compile_graphs.log" 2>&1; echo "compile_graphs rc=$?"
timeout 90 python3 -m tandem bench --model "$model" --batch-sizes 1,16 --limit 16 --max-tokens 128 --dtype float32 \
  --no-compile --no-hf-baseline --out "$out/fp32" > "$out/fp32.log" 2>&1; echo "fp32 rc=$?"
timeout 60 python3 -m pytest -q -m gpu tests/test_kv_cache.py > "$out/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"
tail -3 "$out/gpu_tests.log"; tail -12 "$out/fp32.log"; tail -12 "$out/compile_graphs.log"
