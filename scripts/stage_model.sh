#!/usr/bin/env bash
# Split the bundled target GGUF into N parts in ignored folders .device-stage/pI, so each device
# call stays under the 64 MiB it may carry *with* the working tree (tracked and untracked files:
# ~95 MiB with every shipped drafter and the distillation data; tracked files absent from the work
# tree, e.g. moved aside for a pass that does not need them, do not travel and are not counted:
# docs/benchmarks.md, "How to reproduce a GPU figure", names what a bench pass can leave out).
# Without PARTS the count is the smallest that keeps tree + part under 63 MiB, the last call's
# part small enough to travel with .whl/ too; with PARTS, equal parts. Prints the calls to make
# back to back; the last one rebuilds and checks the file (scripts/device_pass.sh).
#   scripts/stage_model.sh [PARTS] [FILE]
set -euo pipefail
if [[ -n ${1:-} && ! ${1} =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scripts/stage_model.sh [PARTS] [FILE]  (PARTS: a positive integer, got '$1')" >&2; exit 2
fi
top=$(git rev-parse --show-toplevel)
file=${2:-$("$top/.venv/bin/python" -c 'from tandem.models.weights import default_model_path; print(default_model_path())')}
tree_b=$( (cd "$top" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null || true) | tail -1 | cut -f1)
room=$(( 63 * 1048576 - tree_b ))
if [[ -z ${1:-} ]] && (( room < 1048576 )); then
  echo "the working tree is $((tree_b / 1048576)) MiB: no room for a model part under 64 MiB" >&2; exit 1
fi
# The last call also carries .whl/ (scripts/device_wheels.sh): without PARTS, every part but the
# last fills the room a call leaves, and the last is small enough to travel with the wheels.
size=$(stat -c %s "$file")
whl_b=$( (du -cb "$top/.whl" 2>/dev/null || echo 0) | tail -1 | cut -f1)
last_room=$(( room - whl_b ))
if [[ -z ${1:-} ]] && (( last_room < 1048576 )); then
  echo "the working tree ($((tree_b / 1048576)) MiB) and .whl/ ($((whl_b / 1048576)) MiB) leave no room for a part" >&2
  exit 1
fi
name=$(basename "$file")
stage=$top/.device-stage
grep -qxF '/.device-stage/' "$top/.git/info/exclude" || echo '/.device-stage/' >> "$top/.git/info/exclude"
rm -rf "$stage"; mkdir -p "$stage"
if [[ -n ${1:-} ]]; then
  parts=$1
  digits=${#parts}
  split -n "$parts" -d -a "$digits" "$file" "$stage/$name.part"
else
  full=$(( size > last_room ? (size - last_room + room - 1) / room : 0 ))  # parts of `room` bytes before the last
  parts=$(( full + 1 )); digits=${#parts}
  if (( full > 0 )); then
    head -c $(( full * room )) "$file" | split -b "$room" -d -a "$digits" - "$stage/$name.part"
  fi
  tail -c +$(( full * room + 1 )) "$file" > "$stage/$name.part$(printf "%0${digits}d" "$full")"
fi
for i in $(seq 1 "$parts"); do
  mkdir -p "$stage/p$i"; mv "$stage/$name.part$(printf "%0${digits}d" $((i - 1)))" "$stage/p$i/"
done
echo "$(sha256sum "$file" | cut -d' ' -f1)  /tmp/stage/$name" > "$stage/p$parts/$name.sha256"
sizes=""
for i in $(seq 1 "$parts"); do
  part_b=$(stat -c %s "$stage"/p"$i"/"$name".part*); sizes="$sizes $((part_b / 1048576))"
  (( tree_b + part_b + (i == parts ? whl_b : 0) <= 64 * 1048576 )) \
    || echo "warning: call $i (tree + part$( (( i == parts )) && echo ' + .whl/')) exceeds 64 MiB; use more parts" >&2
done
echo "working tree: $((tree_b / 1048576)) MiB, .whl/ $((whl_b / 1048576)) MiB; $parts parts:$sizes MiB"
for i in $(seq 1 "$parts"); do
  cmd="mkdir -p /tmp/stage && cp .device-stage/p$i/* /tmp/stage/"
  if (( i == parts )); then
    cmd="$cmd && cat /tmp/stage/$name.part* > /tmp/stage/$name && sha256sum -c /tmp/stage/$name.sha256 && rm /tmp/stage/$name.part* && <run>"
  fi
  carry="\".device-stage/p$i\""
  (( i == parts )) && [[ -d $top/.whl ]] && carry="$carry, \".whl\""
  echo "call $i: carry [$carry]  $cmd"
done
