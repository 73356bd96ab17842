#!/usr/bin/env bash
# Fifth GPU pass (issues #4, #5, #7), planned on 2026-12-01 for an nvidia-h200-x2 machine: re-measure
# what pass 4 could not measure cleanly, with the code that changed after it (compiled batch-1
# graph with one trace for every draft length, `--warmup full`, the allocator's per-round overhead
# fit, early-stop drafting), and train the SpecFormer head longer (pass 4's best held-out step was
# its last). Timed jobs run on GPU 0 only; GPU 1 trains (untimed) in both calls. Two calls back to
# back after the staging calls (scripts/device_pass4.sh says how to stage):
#   scripts/device_pass5.sh MODEL OUT one   # GPU 0: bench batch 1 (compile, HF references), then the
#                                           #        ablation at batch 1 and 64 (draft model, k = 5)
#                                           # GPU 1: distill (resume: the shards are not in the repo),
#                                           #        then SpecFormer l_d = 4 bonus head, 4,000 steps
#   scripts/device_pass5.sh MODEL OUT two   # GPU 0: bench batch 16/64/128, then distributed b64
#                                           # GPU 1: the head's training resumed from its checkpoint,
#                                           #        then replay on the committed Spec-Bench traces
# The distilled shards take ~6 min to regenerate (18,904 answers at batch 512); training needs them.
set -uo pipefail
model=$1; out=$2; step=$3
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=4
mkdir -p "$out" /tmp/p5/logs /tmp/train
data=/tmp/distill
[[ -d $data ]] || cp -r data/distill/smollm2-135m-instruct "$data"
[[ -f /tmp/p5/traces.jsonl ]] || gunzip -c docs/results/2026-12-01/drafters/spec-bench-traces.jsonl.gz > /tmp/p5/traces.jsonl
gpu0() { CUDA_VISIBLE_DEVICES=0 "$@"; }
gpu1() { CUDA_VISIBLE_DEVICES=1 "$@"; }
log() { echo "[$(date +%T)] $*"; }
common=(--model "$model" --max-tokens 256)
train_head() {  # resumable: a second call continues from /tmp/train/sf-l4-long's checkpoint
  gpu1 timeout "$1" python3 -m tandem train specformer --num-draft-tokens 4 --bonus-token --max-steps 4000 \
    --batch-tokens 16384 --data "$data" --out /tmp/train/sf-l4-long --model "$model" \
    >> /tmp/p5/logs/train-sf-l4-long.log 2>&1; log "train rc=$?"; }
case $step in
one)
  ( gpu1 timeout -s INT 420 python3 -m tandem distill-data --prompts data/train_prompts.jsonl --max-tokens 512 \
      --out "$data" --batch-size 512 --model "$model" > /tmp/p5/logs/distill.log 2>&1
    log "distill rc=$?"; train_head 130 ) > /tmp/p5/logs/gpu1-one.log 2>&1 &
  gpu0 timeout 300 python3 -m tandem -v bench "${common[@]}" --limit 13 --hf-limit 4 --batch-sizes 1 --cost-table \
    --configs target,ngram,draft-model,specformer,context-aware,hf-generate,hf-prompt-lookup --predictor auto \
    --out /tmp/p5/bench-b1 > /tmp/p5/logs/bench-b1.log 2>&1
  log "bench b1 rc=$?"
  gpu0 timeout 250 python3 -m tandem bench --ablation "${common[@]}" --drafter draft-model --predictor auto \
    --num-draft-tokens 5 --limit 26 --batch-sizes 1,64 --out /tmp/p5/ablation > /tmp/p5/logs/ablation.log 2>&1
  log "ablation rc=$?"
  wait; cat /tmp/p5/logs/gpu1-one.log
  tar -C /tmp -czf "$out/one.tgz" p5
  grep -v '^\[\|INFO' /tmp/p5/logs/bench-b1.log | tail -25; tail -25 /tmp/p5/logs/ablation.log ;;
two)
  ( train_head 400
    gpu1 timeout 90 python3 -m tandem replay --traces /tmp/p5/traces.jsonl --model "$model" \
      --drafter specformer:/tmp/train/sf-l4-long --out /tmp/p5/replay-sf-long.json > /tmp/p5/logs/replay.log 2>&1
    log "replay rc=$?" ) > /tmp/p5/logs/gpu1-two.log 2>&1 &
  gpu0 timeout 400 python3 -m tandem bench "${common[@]}" --limit 128 --batch-sizes 16,64,128 --no-hf-baseline \
    --cost-table --configs target,ngram,draft-model,specformer,context-aware --predictor auto \
    --out /tmp/p5/bench-big > /tmp/p5/logs/bench-big.log 2>&1
  log "bench 16-128 rc=$?"
  gpu0 timeout 130 python3 -m tandem bench --mode distributed "${common[@]}" --limit 128 --batch-sizes 64 \
    --configs target,ngram --no-hf-baseline --warmup short --out /tmp/p5/distributed > /tmp/p5/logs/distributed.log 2>&1
  log "distributed rc=$?"
  wait; cat /tmp/p5/logs/gpu1-two.log
  [[ -f /tmp/train/sf-l4-long/model.safetensors ]] && split -b 15M -d -a 1 /tmp/train/sf-l4-long/model.safetensors "$out/sf-l4-long.safetensors.part"
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/two.tgz" p5 train
  tail -40 /tmp/p5/logs/bench-big.log; tail -12 /tmp/p5/logs/distributed.log; tail -20 /tmp/p5/logs/replay.log ;;
esac
