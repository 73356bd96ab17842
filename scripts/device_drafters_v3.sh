#!/usr/bin/env bash
# Third GPU pass (issues #4, #5, #7), three device calls made back to back after
# scripts/stage_model.sh's staging calls (the last staging call runs STEP train itself):
#   scripts/device_drafters_v3.sh MODEL OUT train   # drafters trained side by side on the one GPU
#   scripts/device_drafters_v3.sh MODEL OUT bench   # replay every drafter on 480 Spec-Bench prompts, then tandem bench
#   scripts/device_drafters_v3.sh MODEL OUT ablate  # tandem bench --ablation, then --mode distributed at 64
# Every step is time-boxed; training stops cleanly on SIGTERM (weights saved), results land in OUT
# (at most 8 files come back per call: logs and JSON go into one tarball).
set -uo pipefail
model=$1; out=$2; step=$3
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p "$out" /tmp/train /tmp/s3 /tmp/s3/logs
data=/tmp/distill
[[ -d $data ]] || cp -r data/distill/smollm2-135m-instruct "$data"
t() { local name=$1 limit=$2; shift 2
      timeout "$limit" python3 -m tandem train "$@" --data "$data" --out "/tmp/train/$name" --model "$model" \
        > "/tmp/s3/logs/train-$name.log" 2>&1; echo "$name rc=$? $(tail -c 120 /tmp/s3/logs/train-$name.log | tr '\r' '\n' | tail -1)"; }
case $step in
train)
  # The GPU is mostly idle in one run of this size (launch- and host-bound), so four jobs share it.
  t sf-l4-bonus 500 specformer --num-draft-tokens 4 --bonus-token --max-steps 1300 --batch-tokens 16384 &
  ( t sf-l4-causal 230 specformer --num-draft-tokens 4 --causal --max-steps 702 --batch-tokens 16384
    t sf-l8 260 specformer --num-draft-tokens 8 --max-steps 702 --batch-tokens 16384 ) &
  t draft-3 420 draft-model --init-layers 0,1,29 --max-steps 900 --lr 1e-3 --batch-tokens 16384 &
  timeout 200 python3 -m tandem replay --drafter specformer --max-tokens 256 --batch-size 160 \
    --save-traces /tmp/s3/traces.jsonl --model "$model" --out /tmp/s3/replay-shipped.json > /tmp/s3/logs/traces.log 2>&1
  echo "traces rc=$?"
  wait
  nvidia-smi --query-gpu=memory.used --format=csv
  tar -C /tmp -czf "$out/train-logs.tgz" s3 train --exclude='*.pt' --exclude='*.safetensors'
  ls -la /tmp/train/*/ ;;
bench)
  args=()
  for n in sf-l4-bonus sf-l4-causal sf-l8; do [[ -f /tmp/train/$n/model.safetensors ]] && args+=(--drafter "specformer:/tmp/train/$n"); done
  [[ -f /tmp/train/draft-3/model.safetensors ]] && args+=(--drafter "draft-model:/tmp/train/draft-3")
  timeout 150 python3 -m tandem replay --traces /tmp/s3/traces.jsonl --model "$model" --drafter specformer \
    --drafter draft-model "${args[@]}" --out /tmp/s3/replay.json > /tmp/s3/logs/replay.log 2>&1
  echo "replay rc=$?"; tail -25 /tmp/s3/logs/replay.log
  sf=/tmp/train/sf-l4-bonus; [[ -f $sf/model.safetensors ]] || sf=tandem/drafters/weights/specformer-smollm2-135m
  dm=/tmp/train/draft-3; [[ -f $dm/model.safetensors ]] || dm=tandem/drafters/weights/draft-model-smollm2-135m
  ca=${CA_DRAFTER:-specformer}
  common=(--model "$model" --max-tokens 256 --cost-table --specformer "$sf" --draft-model "$dm" --ca-drafter "$ca")
  timeout 150 python3 -m tandem bench "${common[@]}" --limit 26 --hf-limit 5 --batch-sizes 1 \
    --configs target,ngram,draft-model,specformer,context-aware,hf-generate,hf-prompt-lookup --out /tmp/s3/bench-b1 \
    > /tmp/s3/logs/bench-b1.log 2>&1; echo "bench b1 rc=$?"
  timeout 230 python3 -m tandem bench "${common[@]}" --limit 128 --batch-sizes 16,64,128 --no-hf-baseline \
    --configs target,ngram,draft-model,specformer,context-aware --out /tmp/s3/bench-big \
    > /tmp/s3/logs/bench-big.log 2>&1; echo "bench 16-128 rc=$?"
  tar -C /tmp -czf "$out/bench.tgz" s3 --exclude=traces.jsonl
  for n in sf-l4-bonus draft-3; do [[ -d /tmp/train/$n ]] && tar -C /tmp/train -cf - "$n" --exclude='*.pt' | split -b 15M - "$out/$n.tar."; done
  tail -30 /tmp/s3/logs/bench-b1.log; tail -30 /tmp/s3/logs/bench-big.log ;;
ablate)
  dm=/tmp/train/draft-3; [[ -f $dm/model.safetensors ]] || dm=tandem/drafters/weights/draft-model-smollm2-135m
  if [[ $dm == /tmp/* ]]; then  # a new draft model gets its own predictor, trained on its own verification logs
    timeout 120 python3 -m tandem collect-logs --drafter draft-model --draft-model "$dm" --prompts data/train_prompts.jsonl \
      --limit 512 --batch-size 128 --max-tokens 128 --model "$model" --out /tmp/s3/vlogs.npz > /tmp/s3/logs/collect.log 2>&1
    echo "collect-logs rc=$?"
    timeout 60 python3 -m tandem train predictor --logs /tmp/s3/vlogs.npz --out "$dm/predictor.safetensors" \
      > /tmp/s3/logs/predictor.log 2>&1; echo "predictor rc=$?"; tail -5 /tmp/s3/logs/predictor.log
    cp "$dm"/predictor* /tmp/s3/ 2>/dev/null
  fi
  abl() { timeout "$1" python3 -m tandem bench --ablation --model "$model" --drafter draft-model --draft-model "$dm" \
            --predictor auto --num-draft-tokens 5 --limit "$2" --batch-sizes "$3" --max-tokens 256 --out "/tmp/s3/ablation-b$3" \
            > "/tmp/s3/logs/ablation-b$3.log" 2>&1; echo "ablation b$3 rc=$?"; tail -12 "/tmp/s3/logs/ablation-b$3.log"; }
  abl 150 13 1
  abl 150 64 64
  timeout 150 python3 -m tandem bench --mode distributed --model "$model" --limit 128 --batch-sizes 64 \
    --configs target,ngram --no-hf-baseline --max-tokens 256 --out /tmp/s3/distributed \
    > /tmp/s3/logs/distributed.log 2>&1; echo "distributed rc=$?"
  tar -C /tmp -czf "$out/ablate.tgz" s3 --exclude=traces.jsonl --exclude=vlogs.npz
  tail -20 /tmp/s3/logs/distributed.log ;;
esac
