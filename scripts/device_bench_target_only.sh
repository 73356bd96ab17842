#!/usr/bin/env bash
# GPU run behind docs/benchmarks.md "Target-only decoding": our engine (compile + CUDA graphs,
# graphs only, eager) beside HF transformers generate, on Spec-Bench prompts.
# Usage (on the GPU machine, repo root): scripts/device_bench_target_only.sh MODEL.gguf OUTDIR
set -uo pipefail
model=$1; out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$out/gpu.txt"
python3 -m tandem bench --model "$model" --batch-sizes 1,16,64 --limit 20 --max-tokens 256 \
  --out "$out/compile_graphs" 2>&1 | grep -v -E "it/s\]|Converting" | tee "$out/compile_graphs.log"
python3 -m tandem bench --model "$model" --batch-sizes 1 --limit 10 --max-tokens 256 --no-compile \
  --no-hf-baseline --out "$out/graphs_only" 2>&1 | tee "$out/graphs_only.log"
python3 -m tandem bench --model "$model" --batch-sizes 1 --limit 3 --max-tokens 128 --no-compile \
  --no-cuda-graphs --no-hf-baseline --out "$out/eager" 2>&1 | tee "$out/eager.log"
