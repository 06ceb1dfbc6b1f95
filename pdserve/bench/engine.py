"""Engine speed of pdserve's workers vs a bare vLLM engine, same settings, same cores.

The engines run one after another, each alone on ``--cores``:

- ``vllm``: a bare ``AsyncLLM`` built from exactly the engine arguments a pdserve worker of
  each role in ``--engines`` gets on this machine (``pdserve.worker.engine``; the roles differ:
  a CPU prefill worker computes at most 512 tokens a step), without the KV connector, driven
  in-process: one bare engine per role (the prefill role's when no worker is listed);
- ``prefill``: a real ``pdserve prefill`` worker (KV connector, transfer process, gRPC),
  driven over gRPC (each prefill's blocks are released right after);
- ``decode``: a real ``pdserve decode`` worker, driven over gRPC without a hand-off.

Each is measured the same way: prefill tokens/s = prompt tokens / time to the first token of
a fresh random prompt (median of ``--repeat``); decode tokens/s = tokens streamed by
``--batch`` concurrent requests after all of them had their first token / that time, and
the gaps between one request's streamed tokens over that time (ITL p50 and p99: the decode
step as the engine's caller sees it, with nothing else running). The ratios worker / bare
engine of the same role, of the tokens/s figures, are the per-engine overhead of pdserve
(target: within 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from pdserve.bench.systems import child_process
from pdserve.placement import machine, topology

# One request: (prompt token ids, max tokens) -> token counts as they stream in.
Stream = Callable[[list[int], int], AsyncIterator[int]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cores", default="0", help="cores of every engine (as --cpu-cores)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prefill prompt length")
    parser.add_argument("--batch", type=int, default=4, help="concurrent decode requests")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens per decode request")
    parser.add_argument(
        "--decode-prompt-tokens", type=int, default=16, help="prompt length of decode requests"
    )
    parser.add_argument("--repeat", type=int, default=3, help="prefills measured per engine")
    parser.add_argument("--engines", default="vllm,prefill,decode", help="which, in order")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the engines this many times; report medians"
    )
    parser.add_argument("--port", type=int, default=8800, help="worker gRPC port (+1: KV)")
    parser.add_argument("--json", default="", help="also write the results to this file")


# ---- the measurement, the same for every engine ------------------------------------------
async def measure(stream: Stream, args: argparse.Namespace, decode: bool) -> dict[str, float]:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    await _drain(stream(prompt(16), 2))  # warm-up
    times = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        await _drain(stream(prompt(args.prompt_tokens), 1))
        times.append(time.perf_counter() - started)
    result = {"prefill_tokens_per_s": args.prompt_tokens / statistics.median(times)}
    if decode:
        result.update(await _decode(stream, args, prompt))
    return result


async def _drain(tokens: AsyncIterator[int]) -> None:
    async for _ in tokens:
        pass


async def _decode(stream: Stream, args: argparse.Namespace, prompt: Any) -> dict[str, float]:
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(args.batch)]

    async def one(i: int) -> None:
        async for count in stream(prompt(args.decode_prompt_tokens), args.output_tokens):
            arrivals[i].append((time.perf_counter(), count))

    await asyncio.gather(*(one(i) for i in range(args.batch)))
    return decode_figures(arrivals)


def decode_figures(arrivals: list[list[tuple[float, int]]]) -> dict[str, float]:
    """From each request's (time, tokens) arrivals: tokens/s and the gaps between a request's
    arrivals (ms), both over the time every request was streaming."""
    all_started = max(a[0][0] for a in arrivals)
    ended = max(a[-1][0] for a in arrivals)
    tokens = sum(n for a in arrivals for t, n in a if t > all_started)
    gaps = [(t - before) * 1e3 for a in arrivals
            for (before, _), (t, _) in itertools.pairwise(a) if before >= all_started]  # fmt: skip
    figures = {"decode_tokens_per_s": tokens / (ended - all_started)}
    if len(gaps) >= 2:
        cuts = statistics.quantiles(gaps, n=100, method="inclusive")
        figures |= {"decode_itl_p50_ms": cuts[49], "decode_itl_p99_ms": cuts[98]}
    return figures


# ---- the bare engine (child process) -----------------------------------------------------
def _bare_child(args: argparse.Namespace) -> dict[str, float]:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from decode_service.config import DecodeSettings
    from pdserve.model import resolve_model
    from pdserve.worker.engine import apply_environment, engine_args
    from prefill_service.config import PrefillSettings

    role_settings = {"prefill": PrefillSettings, "decode": DecodeSettings}[args.role]
    settings = role_settings.model_validate({"cpu_cores": args.cores})
    apply_environment(settings)
    engine_arguments = engine_args(settings, resolve_model(None))
    engine_arguments.kv_transfer_config = None
    engine = AsyncLLM.from_engine_args(engine_arguments)
    counter = iter(range(1 << 30))

    async def stream(tokens: list[int], max_tokens: int) -> AsyncIterator[int]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                output_kind=RequestOutputKind.DELTA)  # fmt: skip
        prompt = TokensPrompt(prompt_token_ids=tokens)
        async for out in engine.generate(prompt, params, f"bench-{next(counter)}"):
            if out.outputs[0].token_ids:
                yield len(out.outputs[0].token_ids)

    try:
        return asyncio.run(measure(stream, args, decode=True))
    finally:
        engine.shutdown()


# ---- the workers (driven over gRPC) ------------------------------------------------------
async def _worker_rates(role: str, address: str, args: argparse.Namespace) -> dict[str, float]:
    from decode_service.client import DecodeClient
    from prefill_service.client import PrefillClient
    from protos.v1 import common_pb2

    counter = iter(range(1 << 30))
    if role == "prefill":
        client: Any = PrefillClient(address, default_timeout_s=600)

        async def stream(tokens: list[int], max_tokens: int) -> AsyncIterator[int]:
            request_id = f"bench-{next(counter)}"
            await client.prefill(request_id, tokens, common_pb2.SamplingParams(max_tokens=1))
            await client.abort(request_id)  # unpin now rather than at the lease's end
            yield 1

    else:
        client = DecodeClient(address, default_timeout_s=600)

        async def stream(tokens: list[int], max_tokens: int) -> AsyncIterator[int]:
            params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                               temperature=0.0)  # fmt: skip
            async for chunk in client.decode(f"bench-{next(counter)}", tokens, params):
                if chunk.token_ids:
                    yield len(chunk.token_ids)

    try:
        return await measure(stream, args, decode=role == "decode")
    finally:
        await client.close()


async def _wait_serving(address: str, process: subprocess.Popen[bytes]) -> None:
    from pdserve.cluster.ready import grpc_serving

    check = grpc_serving(address)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the worker exited with {process.returncode}")
        if await check():
            return
        await asyncio.sleep(1)
    raise RuntimeError(f"the worker at {address} was not serving after 900 s")


def _run_worker(role: str, args: argparse.Namespace, log: Path) -> dict[str, float]:
    argv = [sys.executable, "-m", "pdserve", role, "--worker-id", f"bench-{role}", "--port",
            str(args.port), "--kv-port", str(args.port + 1), "--cpu-cores", args.cores]  # fmt: skip
    address = f"127.0.0.1:{args.port}"

    async def drive(process: subprocess.Popen[bytes]) -> dict[str, float]:
        await _wait_serving(address, process)
        return await _worker_rates(role, address, args)

    with child_process(argv, dict(os.environ), log) as process:
        return asyncio.run(drive(process))


def _run_bare(args: argparse.Namespace, role: str, log: Path, out: Path) -> dict[str, float]:
    argv = [sys.executable, "-m", "pdserve.bench.engine", "--child-json", str(out), "--role", role,
            "--cores", args.cores, "--prompt-tokens", str(args.prompt_tokens), "--batch",
            str(args.batch), "--output-tokens", str(args.output_tokens), "--repeat",
            str(args.repeat), "--decode-prompt-tokens", str(args.decode_prompt_tokens)]  # fmt: skip
    with open(log, "wb") as log_file:
        code = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"the bare vLLM engine failed ({code}); see {log}")
    return dict(json.loads(out.read_text()))


def run(args: argparse.Namespace) -> int:
    engines = _engines(args.engines)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, not {args.rounds}")
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-engine-"))
    info = machine.cpu_info()
    print(f"bench engine: {machine.describe(info)}; cores {args.cores}; logs in {work}")
    rounds: list[dict[str, Any]] = []
    for r in range(1, args.rounds + 1):
        results: dict[str, dict[str, float]] = {}
        for i, name in enumerate(engines, 1):
            print(f"  [{r}/{args.rounds}: {i}/{len(engines)}] {name} engine: starting and "
                  "measuring ...", flush=True)  # fmt: skip
            log = work / f"{name}-{r}.log"
            if name.startswith("vllm_"):
                role = name.removeprefix("vllm_")
                results[name] = _run_bare(args, role, log, work / f"{name}-{r}.json")
            else:
                results[name] = _run_worker(name, args, log)
            print(f"        {json.dumps({k: round(v, 1) for k, v in results[name].items()})}")
        rounds.append({"results": results, "ratios": _ratios(results)})
    ratios = _medians([one["ratios"] for one in rounds])
    for key, ratio in ratios.items():
        each = ", ".join(f"{one['ratios'][key]:.3f}" for one in rounds)
        print(f"  {key}: worker / bare vLLM of its role = {ratio:.3f}"
              + (f" (median of {each})" if len(rounds) > 1 else ""))  # fmt: skip
    results = {name: _medians([one["results"][name] for one in rounds]) for name in engines}
    splits = _splits(results, args)
    report = {"machine": info, "cores": args.cores, "results": results, "ratios": ratios,
              "splits": splits, "rounds": rounds}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _ratios(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each worker's rates (tokens/s) over the bare engine's of its role."""
    ratios = {}
    for name in ("prefill", "decode"):
        bare = results.get(f"vllm_{name}", {})
        for key, value in results.get(name, {}).items():
            if key.endswith("_tokens_per_s") and bare.get(key):
                ratios[f"{name}_{key.removesuffix('_tokens_per_s')}"] = value / bare[key]
    return ratios


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Key by key, the median over the rounds."""
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]} if rows else {}


def _engines(listed: str) -> list[str]:
    """``--engines`` with ``vllm`` as one bare engine per worker role listed (in the roles'
    order; the prefill role's when none is), each named ``vllm_<role>``."""
    names = [e for e in listed.split(",") if e]
    unknown = set(names) - {"vllm", "prefill", "decode"}
    if unknown:
        raise SystemExit(f"unknown engine {sorted(unknown)[0]!r}: vllm, prefill or decode")
    roles = [n for n in names if n != "vllm"] or ["prefill"]
    expanded: list[str] = []
    for name in names:
        expanded += [f"vllm_{role}" for role in roles] if name == "vllm" else [name]
    return list(dict.fromkeys(expanded))


def _splits(results: dict[str, dict[str, float]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """From the bare engines' rates on ``--cores`` (``topology.rates_from_report``, the report
    ``pdserve up --split-rates`` reads): the best prefill/decode split of larger machines for a
    512-in/64-out workload (pdserve.placement.topology; one core per measured rate)."""
    try:
        rates = topology.rates_from_report({"cores": args.cores, "results": results}, "this run")
    except ValueError:
        return []
    rows = []
    print(
        f"  best split for 512 in / 64 out at decode batch {args.batch} "
        "(pdserve.placement.topology; pdserve up --split-rates <this --json report>):"
    )
    for cores in (2, 4, 8, 16, 32):
        split = topology.best_split(cores, 512, 64, rates.prefill_tokens_per_s,
                                    rates.decode_tokens_per_s)  # fmt: skip
        rows.append({"cores": cores, **split.__dict__})
        print(f"    {cores:>2} cores: {split.prefill_cores} prefill + {split.decode_engines} "
              f"decode, {split.requests_per_s:.2f} req/s ({split.bound}-bound)")  # fmt: skip
    return rows


def _child_main() -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--child-json", required=True)
    parser.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    args = parser.parse_args()
    Path(args.child_json).write_text(json.dumps(_bare_child(args)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(_child_main())
