#!/usr/bin/env bash
# GPU pass 1 of issue #4: GPU tests, then self-distillation data for the bundled target
# (greedy answers to data/train_prompts.jsonl, max 512 tokens, batch 256), time-boxed.
# Usage (GPU machine, repo root): scripts/device_distill.sh MODEL.gguf OUTDIR SECONDS
set -uo pipefail
model=$1; out=$2; budget=${3:-420}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu tests/test_kv_cache.py tests/test_specformer.py -p no:cacheprovider \
  > "$out/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$out/gpu_tests.log"
t0=$(date +%s)
timeout "$budget" python3 -m tandem distill-data --prompts data/train_prompts.jsonl --max-tokens 512 \
  --out /tmp/distill --batch-size 256 --model "$model" > "$out/distill.log" 2>&1
echo "distill rc=$? wall=$(( $(date +%s) - t0 ))s"
tail -c 600 "$out/distill.log"
cp -r /tmp/distill "$out/distill"
python3 - <<'PY'
import json; m = json.load(open("/tmp/distill/manifest.json"))
print("records", len(m["records"]), "answer tokens", sum(r["answer_len"] for r in m["records"]),
      "shards", len(m["shards"]), "skipped", m["skipped"])
PY
