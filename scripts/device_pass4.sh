#!/usr/bin/env bash
# Fourth GPU pass (issues #4, #5, #7) on an nvidia-h200-x2 machine: two device calls made back to
# back after the staging calls, each running one timed job on GPU 0 and one untimed job on GPU 1.
#   scripts/device_pass4.sh MODEL OUT one   # GPU 0: tandem bench at batch 1 (with the HF references),
#                                           #        then the context-aware ablation at batch 1 and 64
#                                           # GPU 1: greedy traces of all 480 Spec-Bench prompts (+ n-gram
#                                           #        replay), then resume the self-distillation (all prompts)
#   scripts/device_pass4.sh MODEL OUT two   # GPU 0: tandem bench at batch 16/64/128, then --mode distributed
#                                           # GPU 1: SpecFormer l_d=4 bonus-token head and 3-block draft model
#                                           #        on the whole distilled set, then replay both on the traces
# Timing jobs only ever run on GPU 0; GPU 1 runs work whose speed is not reported (distillation,
# training, replay), so the two do not share a GPU. Every step is time-boxed: distillation stops on
# SIGINT with its shards flushed, training on SIGTERM with its weights saved, the bench keeps every
# finished run in results.json. Logs and JSON come back as one tarball per call; trained weights as
# files of their own (split below 16 MiB).
# As run on 2026-12-01 (commit 9377310), before `tandem bench --warmup full` became the default: the
# bench time boxes below fit the short warm-up; with the full one a run takes about twice as long.
# Staging as in scripts/device_drafters_v3.sh: `scripts/stage_model.sh 9`, .whl/ carried in a call of
# its own, `pip install --no-index --no-deps --target /tmp/site /tmp/whl/*.whl`, PYTHONPATH=/tmp/site:$PWD.
set -uo pipefail
model=$1; out=$2; step=$3
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=8
mkdir -p "$out" /tmp/p4/logs /tmp/train
data=/tmp/distill
[[ -d $data ]] || cp -r data/distill/smollm2-135m-instruct "$data"
gpu0() { CUDA_VISIBLE_DEVICES=0 "$@"; }
gpu1() { CUDA_VISIBLE_DEVICES=1 "$@"; }
log() { echo "[$(date +%T)] $*"; }
common=(--model "$model" --max-tokens 256)
case $step in
one)
  ( log "traces start"
    gpu1 timeout 110 python3 -m tandem replay --drafter ngram --max-tokens 256 --batch-size 160 "${common[@]:0:2}" \
      --save-traces /tmp/p4/traces.jsonl --out /tmp/p4/replay-ngram.json > /tmp/p4/logs/replay-ngram.log 2>&1
    log "traces rc=$?"
    gpu1 timeout -s INT 420 python3 -m tandem distill-data --prompts data/train_prompts.jsonl --max-tokens 512 \
      --out "$data" --batch-size 512 --model "$model" > /tmp/p4/logs/distill.log 2>&1
    log "distill rc=$?"; cp "$data/manifest.json" /tmp/p4/distill-manifest.json ) > /tmp/p4/logs/gpu1-one.log 2>&1 &
  log "bench b1 start"
  gpu0 timeout 270 python3 -m tandem -v bench "${common[@]}" --limit 13 --hf-limit 4 --batch-sizes 1 --cost-table \
    --configs target,ngram,draft-model,specformer,context-aware,hf-generate,hf-prompt-lookup --predictor auto \
    --out /tmp/p4/bench-b1 > /tmp/p4/logs/bench-b1.log 2>&1
  log "bench b1 rc=$?"
  gpu0 timeout 250 python3 -m tandem bench --ablation "${common[@]}" --drafter draft-model --predictor auto \
    --num-draft-tokens 5 --limit 26 --batch-sizes 1,64 --out /tmp/p4/ablation > /tmp/p4/logs/ablation.log 2>&1
  log "ablation rc=$?"
  wait; cat /tmp/p4/logs/gpu1-one.log
  tar -C /tmp -czf "$out/one.tgz" p4
  grep -v '^\[' /tmp/p4/logs/bench-b1.log | tail -25; tail -25 /tmp/p4/logs/ablation.log; tail -3 /tmp/p4/logs/distill.log
  ;;
two)
  ( log "train start"
    t() { local name=$1; shift
          gpu1 timeout 330 python3 -m tandem train "$@" --data "$data" --out "/tmp/train/$name" --model "$model" \
            > "/tmp/p4/logs/train-$name.log" 2>&1; log "$name rc=$?"; }
    t sf-l4-bonus specformer --num-draft-tokens 4 --bonus-token --max-steps 1700 --batch-tokens 16384 &
    t draft-3 draft-model --init-layers 0,1,29 --max-steps 1400 --lr 1e-3 --batch-tokens 16384 &
    wait
    args=()
    [[ -f /tmp/train/sf-l4-bonus/model.safetensors ]] && args+=(--drafter specformer:/tmp/train/sf-l4-bonus)
    [[ -f /tmp/train/draft-3/model.safetensors ]] && args+=(--drafter draft-model:/tmp/train/draft-3)
    gpu1 timeout 120 python3 -m tandem replay --traces /tmp/p4/traces.jsonl --model "$model" "${args[@]}" \
      --out /tmp/p4/replay-pass4.json > /tmp/p4/logs/replay-pass4.log 2>&1
    log "replay rc=$?" ) > /tmp/p4/logs/gpu1-two.log 2>&1 &
  log "bench 16-128 start"
  gpu0 timeout 380 python3 -m tandem bench "${common[@]}" --limit 128 --batch-sizes 16,64,128 --no-hf-baseline \
    --cost-table --configs target,ngram,draft-model,specformer,context-aware --predictor auto \
    --out /tmp/p4/bench-big > /tmp/p4/logs/bench-big.log 2>&1
  log "bench 16-128 rc=$?"
  gpu0 timeout 150 python3 -m tandem bench --mode distributed "${common[@]}" --limit 128 --batch-sizes 64 \
    --configs target,ngram --no-hf-baseline --out /tmp/p4/distributed > /tmp/p4/logs/distributed.log 2>&1
  log "distributed rc=$?"
  wait; cat /tmp/p4/logs/gpu1-two.log
  for n in sf-l4-bonus draft-3; do
    [[ -f /tmp/train/$n/model.safetensors ]] && split -b 15M -d -a 1 /tmp/train/$n/model.safetensors "$out/$n.safetensors.part"
  done
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/two.tgz" p4 train
  tail -40 /tmp/p4/logs/bench-big.log; tail -12 /tmp/p4/logs/distributed.log; tail -20 /tmp/p4/logs/replay-pass4.log
  ;;
esac
