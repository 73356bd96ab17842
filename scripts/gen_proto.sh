#!/usr/bin/env bash
# Regenerate the gRPC stubs in services/proto/ from proto/tandem/v1/*.proto.
# Needs grpcio-tools on the 1.84 line (pip install -e '.[dev]'): stubs from it load with
# grpcio >= 1.84 (the GPU hosts have 1.84.0). The generated modules import each other as
# `tandem.v1.*`; the sed rewrites that to `services.proto.tandem.v1.*` so they never shadow
# the `tandem` core package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=services/proto
rm -rf "$out/tandem"
"$PY" -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/tandem/v1/*.proto
find "$out/tandem" -name '*.py' -o -name '*.pyi' | xargs sed -i -E 's/^from tandem\.v1 import/from services.proto.tandem.v1 import/'
touch "$out/tandem/__init__.py" "$out/tandem/v1/__init__.py"
echo "stubs in $out/tandem/v1: $(ls "$out/tandem/v1")"
