#!/usr/bin/env bash
# Next GPU pass for issue #4 (run after scripts/stage_model.sh's calls): resume the distillation
# from the committed data, then train and evaluate the drafter variants the first pass could not
# finish, each step time-boxed and each result written to OUT as soon as it exists.
#   scripts/device_drafters_v2.sh MODEL OUT STEP   (STEP = distill | train | eval)
# Each STEP is one device call (<= 10 min); /tmp persists only while the machine stays warm, so
# make the calls back to back.
set -uo pipefail
model=$1; out=$2; step=$3
export PYTHONUNBUFFERED=1
mkdir -p "$out" /tmp/train
data=/tmp/distill
case $step in
distill)  # ~55% of the prompts are not answered yet; resume where the committed data stops
  [[ -d $data ]] || cp -r data/distill/smollm2-135m-instruct "$data"
  timeout 540 python3 -m tandem distill-data --prompts data/train_prompts.jsonl --max-tokens 512 \
    --out "$data" --batch-size 256 --model "$model" > "$out/distill.log" 2>&1
  echo "distill rc=$?"; tail -c 300 "$out/distill.log"
  tar -C /tmp -czf "$out/distill.tgz" distill; ls -la "$out/distill.tgz" ;;
train)  # bonus-token head (the likely win), the paper's head for longer, causal and l_d = 8 ablations, 4-block draft
  [[ -d $data ]] || cp -r data/distill/smollm2-135m-instruct "$data"
  t() { local name=$1 limit=$2; shift 2
        timeout "$limit" python3 -m tandem train "$@" --data "$data" --out "/tmp/train/$name" --model "$model" \
          > "$out/$name.log" 2>&1; echo "$name rc=$?"; tail -c 200 "$out/$name.log"; }
  t sf-l4-bonus 150 specformer --num-draft-tokens 4 --bonus-token --epochs 3 --batch-tokens 16384
  t sf-l4-causal 110 specformer --num-draft-tokens 4 --causal --epochs 3 --batch-tokens 16384
  t sf-l8 130 specformer --num-draft-tokens 8 --epochs 3 --batch-tokens 16384
  t draft-4 150 draft-model --init-layers 0,1,2,29 --epochs 3 --lr 1e-3 --batch-tokens 16384
  for n in sf-l4-bonus draft-4; do mkdir -p "$out/$n"; cp /tmp/train/$n/model.safetensors "$out/$n/" 2>/dev/null; done ;;
eval)  # Spec-Bench, batch 64, all 480 prompts, against target-only in the same script
  args=(target=none@64)
  for n in sf-l4-bonus sf-l4-causal sf-l8; do [[ -f /tmp/train/$n/model.safetensors ]] && args+=("$n=specformer:/tmp/train/$n@64"); done
  [[ -f /tmp/train/draft-4/model.safetensors ]] && args+=("draft-4=draft-model:/tmp/train/draft-4@64")
  args+=("draft-2=draft-model:@64")   # the shipped 2-block draft model
  timeout 560 python3 scripts/device_eval.py "$out/eval" "${args[@]}" 2>&1 | grep -v -E "it/s|Warn" | tail -12 ;;
esac
