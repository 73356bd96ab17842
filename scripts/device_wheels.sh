#!/usr/bin/env bash
# Download, into the ignored folder .whl/, the wheels the GPU machine lacks: it has torch, numpy,
# transformers, grpcio and protobuf, but not gguf, prometheus_client, the fastapi stack or
# OpenTelemetry (with the OTLP JSON-file exporter that `TANDEM_TRACE_FILE` writes through), llguidance.
# The device call that runs scripts/device_pass.sh carries .whl/ and installs them first.
#   scripts/device_wheels.sh
set -euo pipefail
top=$(git rev-parse --show-toplevel)
pip=$top/.venv/bin/pip
grep -qxF '/.whl/' "$top/.git/info/exclude" || echo '/.whl/' >> "$top/.git/info/exclude"
mkdir -p "$top/.whl"
"$pip" download -q --no-deps -d "$top/.whl" gguf opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-json-file==0.66b1 \
  opentelemetry-exporter-otlp-json-common==0.66b1 opentelemetry-proto-json==0.66b1 \
  opentelemetry-exporter-otlp-common==0.66b1 prometheus_client==0.26.0 grpcio-health-checking==1.84.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 sse-starlette==3.7.0 pydantic==2.14.4 anyio==4.16.0 \
  sniffio==1.3.1 h11==0.16.0 annotated-types annotated-doc typing-inspection \
  opentelemetry-instrumentation==0.66b2 opentelemetry-instrumentation-grpc==0.66b2 \
  opentelemetry-instrumentation-fastapi==0.66b2 opentelemetry-instrumentation-asgi==0.66b2 \
  opentelemetry-util-http==0.66b2 asgiref
"$pip" download -q --no-deps -d "$top/.whl" --platform manylinux2014_x86_64 --python-version 3.12 \
  --only-binary=:all: pydantic_core==2.50.5
# wrapt (the instrumentations' dependency) and structured output's grammar engine (one abi3 wheel)
"$pip" download -q --no-deps -d "$top/.whl" --platform manylinux2014_x86_64 --python-version 3.12 \
  --only-binary=:all: wrapt==2.5.2
"$pip" download -q --no-deps -d "$top/.whl" --platform manylinux_2_31_x86_64 --python-version 3.12 \
  --only-binary=:all: llguidance==1.9.1
echo "$(ls "$top/.whl" | wc -l) wheels, $(du -sh "$top/.whl" | cut -f1) in .whl/"
