#!/usr/bin/env bash
# GPU pass 2 of issue #4: train SpecFormer heads (l_d 4 / 8, bidirectional / causal) and the
# distilled draft model on /tmp/distill, each evaluated on Spec-Bench (greedy, 256 new tokens),
# plus n-gram for reference. Every step is time-boxed; weights and cards land in OUTDIR.
# Usage (GPU machine, repo root): scripts/device_train.sh DISTILL_DIR OUTDIR
set -uo pipefail
data=$1; out=$2
export PYTHONUNBUFFERED=1
mkdir -p "$out"
run() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" python3 -m tandem train "$@" --data "$data" --out "/tmp/train/$name" > "$out/$name.log" 2>&1
  echo "$name rc=$? wall=$(( $(date +%s) - t0 ))s"; tail -n 1 "$out/$name.log" | tail -c 400
  mkdir -p "$out/$name"; cp /tmp/train/$name/{model.safetensors,card.json,README.md} "$out/$name/" 2>/dev/null
}
run sf-l4 170 specformer --num-draft-tokens 4 --epochs 3 --batch-tokens 16384 --eval-limit 480
run draft-model 150 draft-model --init-layers 0,1 --epochs 2 --batch-tokens 16384 --eval-limit 480
timeout 60 python3 - > "$out/ngram.log" 2>&1 <<'PY'
import json
from tandem.cli import _engine
from tandem.bench.acceptance import measure_acceptance
from tandem.data import bundled_spec_bench, load_prompts
e = _engine(None, None, 64, 2048, drafter="ngram", num_draft_tokens=4)
r = measure_acceptance(e, load_prompts(bundled_spec_bench()), 256).to_dict()
print(json.dumps(r))
PY
echo "ngram rc=$?"; tail -c 300 "$out/ngram.log"
run sf-l4-causal 120 specformer --num-draft-tokens 4 --causal --epochs 3 --batch-tokens 16384 --eval-limit 480
run sf-l8 120 specformer --num-draft-tokens 8 --epochs 3 --batch-tokens 16384 --eval-limit 480
rm -f "$out"/sf-l8/model.safetensors  # over the size that comes back; measured only
