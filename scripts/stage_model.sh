#!/usr/bin/env bash
# Split the bundled target GGUF into N parts (default 6) in ignored folders .device-stage/pI, so
# each device call stays under the 64 MiB it may carry *with* the working tree (the shipped
# drafter weights make the tree ~36 MiB, too big beside ../shared/tools/stage-for-device's 56 MiB
# parts). Prints the calls to make back to back; the last one rebuilds and checks the file.
#   scripts/stage_model.sh [PARTS] [FILE]
set -euo pipefail
top=$(git rev-parse --show-toplevel)
parts=${1:-6}
file=${2:-$("$top/.venv/bin/python" -c 'from tandem.models.weights import default_model_path; print(default_model_path())')}
name=$(basename "$file")
stage=$top/.device-stage
grep -qxF '/.device-stage/' "$top/.git/info/exclude" || echo '/.device-stage/' >> "$top/.git/info/exclude"
rm -rf "$stage"; mkdir -p "$stage"
last=$((parts - 1)); digits=${#last}  # suffix width: part0..part9, or part00..part13, ...
split -n "$parts" -d -a "$digits" "$file" "$stage/$name.part"
for i in $(seq 1 "$parts"); do
  mkdir -p "$stage/p$i"; mv "$stage/$name.part$(printf "%0${digits}d" $((i - 1)))" "$stage/p$i/"
done
echo "$(sha256sum "$file" | cut -d' ' -f1)  /tmp/stage/$name" > "$stage/p$parts/$name.sha256"
tree_mb=$(git -C "$top" ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
echo "tracked tree: $((tree_mb / 1048576)) MiB; part: $(( $(stat -c %s "$stage"/p1/"$name".part*) / 1048576 )) MiB"
for i in $(seq 1 "$parts"); do
  cmd="mkdir -p /tmp/stage && cp .device-stage/p$i/* /tmp/stage/"
  if (( i == parts )); then
    cmd="$cmd && cat /tmp/stage/$name.part* > /tmp/stage/$name && sha256sum -c /tmp/stage/$name.sha256 && rm /tmp/stage/$name.part* && <run>"
  fi
  echo "call $i: carry [\".device-stage/p$i\"]  $cmd"
done
