#!/usr/bin/env bash
# One GPU pass, run on the GPU machine from the repository root: install the carried wheels,
# assemble the staged target model, then run each argument as a command line, in order, with
#   $MODEL  the assembled GGUF (/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf)
#   $OUT    where files come back
# available to it. Each command's output goes to $OUT/NN.log (NN = its index) and to the call's
# output; the pass ends with one summary line per command (exit code, seconds), and everything under
# $OUT is packed into $OUT/pass.tgz (results folders, kernel tables and logs in one file).
# PASS_TIMEOUT (seconds, default none) bounds each command, so one slow command cannot take the
# whole pass and its archive with it.
#
# Before the pass, here:
#   scripts/device_wheels.sh        # .whl/: the Python packages the GPU machine lacks
#   scripts/stage_model.sh [PARTS]  # .device-stage/p1..pN: the model in parts, and the calls to make
# then make the staging calls back to back (the machine keeps /tmp only while it is warm); the
# last one carries [".whl", ".device-stage/pN"] and runs, after the reassembly:
#   bash scripts/device_pass.sh 'python3 -m tandem bench --model $MODEL ... --out $OUT/bench' '...'
# docs/benchmarks.md gives the exact commands behind every committed figure.
set -uo pipefail
if (( $# == 0 )); then
  echo "usage: scripts/device_pass.sh 'COMMAND' ['COMMAND' ...]  (see the header)" >&2; exit 2
fi
# A later call in the same lease may leave .whl/ behind (room for other files): the packages
# installed by an earlier call are still in /tmp/site while the machine stays warm.
if compgen -G '.whl/*.whl' > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
elif [[ ! -d /tmp/site ]]; then
  echo "no .whl/ carried and nothing installed in /tmp/site (scripts/device_wheels.sh)" >&2; exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export MODEL=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf OUT=${OUT:-/tmp/out}
[[ -f $MODEL ]] || { echo "no staged model at $MODEL (scripts/stage_model.sh)" >&2; exit 1; }
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
summary=()
i=0
for cmd in "$@"; do
  i=$((i + 1)); log=$(printf "%s/%02d.log" "$OUT" "$i")
  echo "=== [$i] $cmd"
  start=$SECONDS
  if [[ -n ${PASS_TIMEOUT:-} ]]; then timeout "$PASS_TIMEOUT" bash -c "$cmd" 2>&1 | tee "$log"
  else bash -c "$cmd" 2>&1 | tee "$log"; fi
  rc=${PIPESTATUS[0]}
  summary+=("[$i] rc=$rc $((SECONDS - start))s  $cmd")
done
echo "=== summary"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf /tmp/pass.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/pass.tgz "$OUT/"
