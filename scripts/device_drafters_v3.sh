#!/usr/bin/env bash
# Third GPU pass (issues #4, #5, #7): device calls made back to back after the staging calls.
#   scripts/device_drafters_v3.sh MODEL OUT train   # drafter variants trained side by side on the one GPU
#   scripts/device_drafters_v3.sh MODEL OUT prep    # greedy traces + replay of every drafter; predictor for the
#                                                   # shipped draft model from its own verification logs;
#                                                   # (re)trains the causal and l_d = 8 heads meanwhile
#   scripts/device_drafters_v3.sh MODEL OUT bench   # tandem bench: batch 1 (with HF references), then 16/64/128
#   scripts/device_drafters_v3.sh MODEL OUT ablate  # tandem bench --ablation (batch 1), then --mode distributed at 64
# Every step is time-boxed; training stops cleanly on SIGTERM (weights saved); logs, JSON, traces and
# predictors come back as one tarball per call (a call returns at most 8 files).
# Staging: the tree is ~52 MiB, so `scripts/stage_model.sh 9` (parts of ~10 MiB) and carry .whl/ in a
# call of its own (gguf, opentelemetry-api/sdk/semantic-conventions, prometheus_client,
# grpcio-health-checking 1.84, fastapi/starlette/uvicorn/sse-starlette/pydantic(+core cp312)/anyio/
# sniffio/h11/annotated-types/typing-inspection: the GPU machine lacks them), install with
# `pip install --no-index --no-deps --target /tmp/site /tmp/whl/*.whl`, PYTHONPATH=/tmp/site:$PWD.
# Time: bench ~9 min and ablate ~9 min; with staging (~1 min) both fit one session's 30 minutes,
# with prep (~4 min) too if its training runs are dropped.
set -uo pipefail
model=$1; out=$2; step=$3
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p "$out" /tmp/train /tmp/s3/logs /tmp/pred
data=/tmp/distill
[[ -d $data ]] || cp -r data/distill/smollm2-135m-instruct "$data"
t() { local name=$1 limit=$2; shift 2
      timeout "$limit" python3 -m tandem train "$@" --data "$data" --out "/tmp/train/$name" --model "$model" \
        > "/tmp/s3/logs/train-$name.log" 2>&1; echo "$name rc=$? $(tail -c 120 /tmp/s3/logs/train-$name.log | tr '\r' '\n' | tail -1)"; }
pack() { tar --exclude='*.pt' --exclude='model.safetensors' --exclude=vlogs.npz -C /tmp -czf "$out/$1.tgz" s3 train; }
case $step in
train)
  t sf-l4-bonus 500 specformer --num-draft-tokens 4 --bonus-token --max-steps 1300 --batch-tokens 16384 &
  ( t sf-l4-causal 230 specformer --num-draft-tokens 4 --causal --max-steps 702 --batch-tokens 16384
    t sf-l8 260 specformer --num-draft-tokens 8 --max-steps 702 --batch-tokens 16384 ) &
  t draft-3 420 draft-model --init-layers 0,1,29 --max-steps 900 --lr 1e-3 --batch-tokens 16384 &
  wait; pack train ;;
prep)
  t sf-l4-causal 260 specformer --num-draft-tokens 4 --causal --max-steps 702 --batch-tokens 16384 &
  t sf-l8 260 specformer --num-draft-tokens 8 --max-steps 702 --batch-tokens 16384 &
  timeout 150 python3 -m tandem replay --drafter specformer --drafter draft-model --max-tokens 256 --batch-size 160 \
    --save-traces /tmp/s3/traces.jsonl --model "$model" --out /tmp/s3/replay-shipped.json > /tmp/s3/logs/replay-shipped.log 2>&1
  echo "traces + replay rc=$?"; tail -20 /tmp/s3/logs/replay-shipped.log
  timeout 120 python3 -m tandem collect-logs --drafter draft-model --prompts data/train_prompts.jsonl \
    --limit 512 --batch-size 128 --max-tokens 128 --model "$model" --out /tmp/s3/vlogs.npz > /tmp/s3/logs/collect.log 2>&1
  echo "collect-logs rc=$?"; tail -2 /tmp/s3/logs/collect.log
  timeout 60 python3 -m tandem train predictor --logs /tmp/s3/vlogs.npz --out /tmp/pred/predictor.safetensors \
    > /tmp/s3/logs/predictor.log 2>&1; echo "predictor rc=$?"; tail -5 /tmp/s3/logs/predictor.log
  cp /tmp/pred/* /tmp/s3/
  wait
  args=()
  for n in sf-l4-causal sf-l8; do [[ -f /tmp/train/$n/model.safetensors ]] && args+=(--drafter "specformer:/tmp/train/$n"); done
  timeout 100 python3 -m tandem replay --traces /tmp/s3/traces.jsonl --model "$model" "${args[@]}" \
    --out /tmp/s3/replay-ablations.json > /tmp/s3/logs/replay-ablations.log 2>&1
  echo "replay ablations rc=$?"; tail -20 /tmp/s3/logs/replay-ablations.log
  pack prep ;;
bench)
  [[ -f /tmp/s3/replay-shipped.json ]] || { timeout 60 python3 -m tandem replay --traces /tmp/s3/traces.jsonl --drafter specformer \
    --drafter draft-model --model "$model" --out /tmp/s3/replay-shipped.json > /tmp/s3/logs/replay-shipped.log 2>&1
    echo "replay rc=$?"; tail -18 /tmp/s3/logs/replay-shipped.log; }
  ca=$(python3 -c "
import json; d=json.load(open('/tmp/s3/replay-shipped.json'))['drafters']
print(max(d, key=lambda k: d[k]['overall']['mean_accepted_length']))" 2>/dev/null || echo draft-model)
  pred=(); [[ -f /tmp/pred/predictor.safetensors && $ca == draft-model ]] && pred=(--predictor /tmp/pred/predictor.safetensors)
  echo "context-aware over $ca ${pred[*]}"
  common=(--model "$model" --max-tokens 256 --cost-table --ca-drafter "$ca" "${pred[@]}")
  timeout 240 python3 -m tandem bench "${common[@]}" --limit 13 --hf-limit 4 --batch-sizes 1 \
    --configs target,ngram,draft-model,specformer,context-aware,hf-generate,hf-prompt-lookup --out /tmp/s3/bench-b1 \
    > /tmp/s3/logs/bench-b1.log 2>&1; echo "bench b1 rc=$?"
  timeout 300 python3 -m tandem bench "${common[@]}" --limit 128 --batch-sizes 16,64,128 --no-hf-baseline \
    --configs target,ngram,draft-model,specformer,context-aware --out /tmp/s3/bench-big \
    > /tmp/s3/logs/bench-big.log 2>&1; echo "bench 16-128 rc=$?"
  pack bench
  tail -30 /tmp/s3/logs/bench-b1.log; tail -40 /tmp/s3/logs/bench-big.log ;;
ablate)
  if [[ ! -f /tmp/pred/predictor.safetensors ]]; then
    timeout 60 python3 -m tandem collect-logs --drafter draft-model --prompts data/train_prompts.jsonl --max-seq-len 4096 \
      --limit 256 --batch-size 128 --max-tokens 128 --model "$model" --out /tmp/s3/vlogs.npz > /tmp/s3/logs/collect.log 2>&1
    echo "collect-logs rc=$?"; tail -c 300 /tmp/s3/logs/collect.log
    timeout 40 python3 -m tandem train predictor --logs /tmp/s3/vlogs.npz --out /tmp/pred/predictor.safetensors \
      > /tmp/s3/logs/predictor.log 2>&1; echo "predictor rc=$?"; tail -5 /tmp/s3/logs/predictor.log; cp /tmp/pred/* /tmp/s3/
  fi
  # (the ablation rows became tandem bench configurations after this pass: one engine and warm-up per batch size)
  timeout 300 python3 -m tandem bench --ablation --model "$model" --drafter draft-model \
    --predictor /tmp/pred/predictor.safetensors --num-draft-tokens 5 --limit 26 --batch-sizes 1,64 --max-tokens 256 \
    --out /tmp/s3/ablation > /tmp/s3/logs/ablation.log 2>&1; echo "ablation rc=$?"; tail -30 /tmp/s3/logs/ablation.log
  timeout 220 python3 -m tandem bench --mode distributed --model "$model" --limit 128 --batch-sizes 64 \
    --configs target,ngram --no-hf-baseline --max-tokens 256 --out /tmp/s3/distributed \
    > /tmp/s3/logs/distributed.log 2>&1; echo "distributed rc=$?"
  pack ablate
  tail -20 /tmp/s3/logs/distributed.log ;;
esac
