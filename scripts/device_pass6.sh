#!/usr/bin/env bash
# Sixth GPU pass (issue #4), planned on 2026-12-01 for one H200: SpecFormer heads with the
# EAGLE-style shifted next-token context (--context-next-token) and soft-label distillation
# (--soft-labels 0.5), measured by exact greedy replay on the committed Spec-Bench traces (all 480
# prompts, max 256 new tokens). Staging as in scripts/device_pass4.sh (wheels, then
# scripts/stage_model.sh 9); then, back to back:
#   scripts/device_pass6.sh MODEL OUT one          # resume the distillation in the background;
#       # meanwhile heads A (1 context layer) and B (2) train concurrently on the committed 8,060
#       # answers; replay A, B and the shipped head
#   scripts/device_pass6.sh MODEL OUT two 'FLAGS'  # head C (the better of A/B, FLAGS) on every
#       # answer, longer; replay it
#   scripts/device_pass6.sh MODEL OUT three HEAD   # live engine, batch 1 and 64: target-only vs
#       # SpecFormer with head HEAD (/tmp/train/NAME): lossless check, tau_acc, speed
# Pass 7 (same staging): head E, whose context sub-layers are decoder blocks copied from target
# blocks 0 and 29 (--context-init-layers), on the whole distillation cut to 256 answer tokens:
#   scripts/device_pass6.sh MODEL OUT seven-one    # finish the distillation (alone, <= 420 s), then head E
#   scripts/device_pass6.sh MODEL OUT seven-two    # head E resumed (540 s box); weights back
#   scripts/device_pass6.sh MODEL OUT seven-three  # head E to its last step; replay E and the shipped
#       # head on all 480 Spec-Bench traces; live engine at batch 1 (no compile): target-only vs E
# Pass 8 (same staging; see docs/benchmarks.md "Pass 8"): head G = head E's recipe on whole answers
# (no 256 cut) plus --lookup-tokens (every draft slot also reads the context lookup continuation):
#   scripts/device_pass6.sh MODEL OUT eight-one    # finish the distillation (alone) and send it back whole
#       # ($OUT/distill-full.tgz, ~7 MB), then start head G
#   scripts/device_pass6.sh MODEL OUT eight-two    # head G resumed (560 s box); weights back
#   scripts/device_pass6.sh MODEL OUT eight-three  # G to its last step; replay G and C; live batch 1 with a
#       # (pass 8 ran these at commit aff7405, whose bench used --warmup short; the traced bench needs the
#       # wheels of scripts/device_wheels.sh)
#       # trace file (TANDEM_TRACE_FILE) so `tandem trace-report` splits a SpecFormer round into
#       # draft / verify / observe (the ~27 ms round against 2.9 ms for a target-only token)
# Planned for pass 9 (staging: scripts/device_wheels.sh, then scripts/stage_model.sh; see docs/benchmarks.md
# "Pass 8"): head H = head G's recipe on the distillation plus 6,000 document-task prompts built from
# the training set (scripts/make_document_prompts.py: summarise / extract / answer from / translate a
# text that is one of the target's own answers or a long user prompt), since G's held-out tau (3.56)
# far exceeds its Spec-Bench tau (2.43) and Spec-Bench's document categories are what the training
# prompts lack:
#   scripts/device_pass6.sh MODEL OUT nine-one     # batch-1 bench of the shipped head G with --warmup full and
#       # a trace file (does bucketing the head's attended length remove the ~27 ms per round?), round
#       # profile; distil the document prompts; start head H
#   scripts/device_pass6.sh MODEL OUT nine-two     # head H resumed (560 s box); weights back
#   scripts/device_pass6.sh MODEL OUT nine-three   # H to its last step; replay H and G; traced bench of H
# Pass 9 ran nine-one|nine-two|nine-three (docs/benchmarks.md "Pass 9": head I = G fine-tuned, shipped; head H).
# Planned for pass 10 (same staging): head J = the shipped head I fine-tuned for 4,000 more steps, alone:
#   scripts/device_pass6.sh MODEL OUT ten-one      # head J (575 s box)
#   scripts/device_pass6.sh MODEL OUT ten-two      # head J resumed (560 s box); weights back
#   [BENCH_END=S] scripts/device_pass6.sh MODEL OUT ten-three [BOX]  # the head's graph tests on the GPU (bf16 too); training-step profile
#       # (scripts/profile_train.py); J to its last step; replay J
#       # and I; traced batch-1 bench of J (measures the head's CUDA graphs and SERVING_SDPA, new since pass 9)
# Heads come back split in 15 MB parts ($OUT/NAME.safetensors.partN); logs and JSON in $OUT/STEP.tgz.
set -uo pipefail
model=$1; out=$2; step=$3; arg=${4:-}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=4
w=/tmp/p6
mkdir -p "$out" $w/logs /tmp/train
full=/tmp/distill          # grows to every answer (the resumed distillation writes here)
committed=/tmp/distill-committed  # the answers in the repository (8,060 until pass 8, all 18,904 since)
[[ -d $full ]] || cp -r data/distill/smollm2-135m-instruct $full
[[ -d $committed ]] || cp -r data/distill/smollm2-135m-instruct $committed
[[ -f $w/traces.jsonl ]] || gunzip -c docs/results/2026-12-01/drafters/spec-bench-traces.jsonl.gz > $w/traces.jsonl
log() { echo "[$(date +%T)] $*"; }
flags=(--num-draft-tokens 4 --bonus-token --context-next-token --soft-labels 0.5 --batch-tokens 16384)
# head E (pass 7): no separate bonus-token branch (the shifted-token context already holds the bonus
# token), context decoder blocks from target blocks 0 and 29, draft SwiGLU 576 wide (< 25 MB)
head_e=(--no-bonus-token --context-init-layers 0,29 --intermediate-size 576 --max-answer-tokens 256)
head_g=(--no-bonus-token --context-init-layers 0,29 --intermediate-size 576 --lookup-tokens)
# fine-tuning the shipped head at a lower peak lr: head I (pass 9, from G, on the distillation plus the
# document-task answers), head J (pass 10, from I, 4,000 more steps on the same data)
fine_tune=(--init-from tandem/drafters/weights/specformer-smollm2-135m --lr 3e-4)
# the step count of resume_head / finish / distill_then (a resume needs the count its run began with)
case $step in ten-*) max_steps=4000 ;; *) max_steps=3000 ;; esac
bench_b1() {  # TAG HEAD BOX: traced batch-1 bench, target-only vs SpecFormer head HEAD, full warm-up; trace report
  local tag=$1 head=$2 box=$3
  TANDEM_TRACE_FILE=$w/spans-$tag.jsonl timeout "$box" python3 -m tandem bench --model "$model" --max-tokens 256 \
    --limit 13 --batch-sizes 1 --no-hf-baseline --no-compile --configs target,specformer --specformer "$head" \
    --warmup full --out $w/bench-$tag > $w/logs/bench-$tag.log 2>&1
  log "bench $tag rc=$?"
  python3 -m tandem trace-report $w/spans-$tag.jsonl > $w/logs/trace-report-$tag.txt 2>&1
  grep -v '^\[\|INFO' $w/logs/bench-$tag.log | head -4; head -30 $w/logs/trace-report-$tag.txt; }
train() {  # NAME DATA STEPS TIME_LIMIT [more flags]: SIGTERM at the limit saves the best step so far
  local name=$1 data=$2 steps=$3 limit=$4; shift 4
  timeout "$limit" python3 -m tandem train specformer "${flags[@]}" --max-steps "$steps" "$@" --data "$data" \
    --out /tmp/train/"$name" --model "$model" > $w/logs/train-"$name".log 2>&1
  log "train $name rc=$? $(tail -c 300 $w/logs/train-"$name".log | tr '\r' '\n' | tail -1)"; }
replay() {  # TAG HEAD...: replay the heads (and the shipped one) on the Spec-Bench traces
  local tag=$1; shift
  timeout 120 python3 -m tandem replay --traces $w/traces.jsonl --model "$model" --drafter specformer \
    $(for h in "$@"; do echo "--drafter specformer:/tmp/train/$h"; done) --out $w/replay-"$tag".json \
    > $w/logs/replay-"$tag".log 2>&1
  log "replay $tag rc=$?"; }
finished() {  # NAME: true when head NAME has trained to its last planned step
  python3 -c "import json,sys; t=json.load(open('/tmp/train/$1/card.json'))['training']; \
sys.exit(t['steps'] < t['planned_steps'])" 2>/dev/null; }
ship() { for h in "$@"; do [[ -f /tmp/train/$h/model.safetensors ]] && \
  split -b 15M -d -a 1 /tmp/train/"$h"/model.safetensors "$out/$h.safetensors.part"; done; }
distill_then() {  # TAG NAME BOX [flags]: finish the distillation alone (BOX s; it comes back whole as
  # $OUT/distill-full.tgz, ~7 MB), then train head NAME until 570 s into the call
  local tag=$1 name=$2 box=$3; shift 3
  timeout -s INT "$box" python3 -m tandem distill-data --prompts data/train_prompts.jsonl.gz --max-tokens 512 \
    --out $full --batch-size 512 --model "$model" > $w/logs/distill.log 2>&1
  log "distill rc=$? $(tail -c 300 $w/logs/distill.log | tr '\r' '\n' | tail -1)"
  tar -C /tmp -czf "$out/distill-full.tgz" distill
  train "$name" $full "$max_steps" $((570 - SECONDS)) "$@"
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/$tag-one.tgz" p6/logs train/"$name"; }
resume_head() {  # TAG NAME [flags]: head NAME resumed under a 560 s box; weights back
  local tag=$1 name=$2; shift 2
  train "$name" $full "$max_steps" 560 "$@"
  ship "$name"
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/$tag-two.tgz" p6/logs train/"$name"; }
finish() {  # NAME TAG [flags]: head NAME to its last step, replay it beside the shipped head, weights back,
  # traced live batch-1 bench (target-only vs NAME, no compile, full warm-up; `tandem trace-report`)
  local name=$1 tag=$2; shift 2
  train "$name" $full "$max_steps" "${arg:-240}" "$@"
  replay "$tag" "$name"
  ship "$name"
  bench_b1 "$tag" /tmp/train/"$name" $((${BENCH_END:-560} - SECONDS))  # BENCH_END: when the bench must end
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/$tag-three.tgz" p6/logs p6/replay-"$tag".json \
    p6/bench-"$tag" train/"$name"
  tail -22 $w/logs/replay-"$tag".log; }
case $step in
one)
  timeout -s INT 540 python3 -m tandem distill-data --prompts data/train_prompts.jsonl.gz --max-tokens 512 --out $full \
    --batch-size 512 --model "$model" > $w/logs/distill.log 2>&1 &
  dpid=$!
  train sf-a $committed 1200 470 &
  apid=$!
  train sf-b $committed 1200 470 --context-layers 2
  wait $apid
  replay one sf-a sf-b
  wait $dpid; log "distill rc=$? $(tail -c 400 $w/logs/distill.log | tr '\r' '\n' | tail -2 | tr '\n' ' ')"
  ship sf-a sf-b
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/one.tgz" p6/logs p6/replay-one.json train
  tail -22 $w/logs/replay-one.log ;;
two)
  # shellcheck disable=SC2086  # FLAGS is a word list
  train sf-c $full 3000 500 $arg
  replay two sf-c
  ship sf-c
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/two.tgz" p6/logs p6/replay-two.json train/sf-c
  tail -22 $w/logs/replay-two.log ;;
seven-one) distill_then seven sf-e 420 "${head_e[@]}" ;;
seven-two) resume_head seven sf-e "${head_e[@]}" ;;
seven-three) finish sf-e seven "${head_e[@]}" ;;
eight-one) distill_then eight sf-g 480 "${head_g[@]}" ;;
eight-two) resume_head eight sf-g "${head_g[@]}" ;;
eight-three) finish sf-g eight "${head_g[@]}" ;;
nine-one)  # document-task prompts distilled into the whole distillation; then heads I (G fine-tuned) and H (from scratch)
  python3 scripts/make_document_prompts.py --out $w/document_prompts.jsonl > $w/logs/document-prompts.log 2>&1
  timeout -s INT 240 python3 -m tandem distill-data --prompts $w/document_prompts.jsonl --max-tokens 512 --out $full \
    --batch-size 512 --model "$model" > $w/logs/distill-doc.log 2>&1
  log "distill rc=$? $(tail -c 300 $w/logs/distill-doc.log | tr '\r' '\n' | tail -1)"
  tar -C /tmp -czf "$out/distill-doc.tgz" distill
  train sf-i $full 1500 $((575 - SECONDS)) "${head_g[@]}" "${fine_tune[@]}" &
  train sf-h $full 3000 $((575 - SECONDS)) "${head_g[@]}"
  wait
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/nine-one.tgz" p6/logs train/sf-h train/sf-i ;;
nine-two)  # both resumed; replay what finished; weights back
  train sf-i $full 1500 "${arg:-500}" "${head_g[@]}" "${fine_tune[@]}" &
  train sf-h $full 3000 "${arg:-500}" "${head_g[@]}"
  wait
  done_heads=$(for h in sf-i sf-h; do finished $h && echo $h; done)
  [[ -n $done_heads ]] && replay nine-two $done_heads
  ship sf-i sf-h
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/nine-two.tgz" p6/logs p6/replay-nine-two.json \
    train/sf-h train/sf-i 2>/dev/null
  tail -22 $w/logs/replay-nine-two.log ;;
nine-three)  # H (and I, if short) to the last step; replay both beside G; weights back; traced bench of G if time is left
  train sf-i $full 1500 "${arg:-200}" "${head_g[@]}" "${fine_tune[@]}" &
  train sf-h $full 3000 "${arg:-200}" "${head_g[@]}"
  wait
  replay nine sf-i sf-h
  ship sf-i sf-h
  (( SECONDS < 380 )) && bench_b1 g tandem/drafters/weights/specformer-smollm2-135m $((500 - SECONDS))
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/nine-three.tgz" p6/logs p6/replay-nine.json \
    p6/bench-g train/sf-h train/sf-i 2>/dev/null
  tail -22 $w/logs/replay-nine.log ;;
ten-one)  # head J: the shipped head I fine-tuned longer, alone on the GPU (pass 9: extra steps helped in every category)
  train sf-j $full "$max_steps" $((575 - SECONDS)) "${head_g[@]}" "${fine_tune[@]}"
  tar --exclude='*.pt' --exclude='model.safetensors' -C /tmp -czf "$out/ten-one.tgz" p6/logs train/sf-j ;;
ten-two) resume_head ten sf-j "${head_g[@]}" "${fine_tune[@]}" ;;
ten-three)  # the GPU tests first (the head's own CUDA graphs are new since pass 9), then finish J
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_specformer.py \
    -k "cuda_graphs or eager_twin or static_buffer or failed_graph" > $w/logs/gpu-tests.log 2>&1
  log "gpu tests rc=$? $(tail -1 $w/logs/gpu-tests.log)"
  timeout 90 python3 scripts/profile_train.py "$model" $full tandem/drafters/weights/specformer-smollm2-135m $w/logs \
    > $w/logs/profile-train.log 2>&1  # where a training step's time goes (pass 9: ~4.5 steps/s)
  log "profile-train rc=$? $(grep 'ms/step' $w/logs/profile-train.log)"
  finish sf-j ten "${head_g[@]}" "${fine_tune[@]}" ;;
three)
  timeout 260 python3 -m tandem bench --model "$model" --max-tokens 256 --limit 26 --batch-sizes 1,64 \
    --no-hf-baseline --configs target,specformer --specformer "$arg" --warmup short --out $w/bench-sf \
    > $w/logs/bench-sf.log 2>&1
  log "bench rc=$?"
  tar -C /tmp -czf "$out/three.tgz" p6/logs p6/bench-sf
  grep -v '^\[\|INFO' $w/logs/bench-sf.log | tail -20 ;;
esac
