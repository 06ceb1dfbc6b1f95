"""The GPU path end to end, on one GPU: 1 prefill + 1 decode engine moving KV with NIXL,
greedy parity with a monolithic ``vllm serve``, KV GB/s, and the side-by-side benchmark.

For a user with an NVIDIA GPU, the CUDA build of vLLM 0.32 and the ``nixl`` package (``make
install`` on a GPU host, or the GPU image), one command::

    pdserve bench gpu --model /path/to/model [--gpu 0] [--out DIR]

1. ``pdserve up --prefill 1 --decode 1 --gpus G``: both engines on GPU G, NIXL chosen by GPU
   detection, a side-channel port each, 0.45 of the GPU's memory each, the decode engine
   started once the prefill engine is ready (``pdserve.cluster.gpu``);
2. ``--prompts`` prompts through its gateway, one at a time, greedy (temperature 0): each must
   take the disaggregated path (its routing headers name a prefill worker), and together they
   must move KV over NIXL (the decode worker's transfer counters on ``/metrics``);
3. the KV throughput: bytes / seconds of those transfers as NIXL measured them;
4. a monolithic ``vllm serve`` of the same model on the same GPU (vLLM's default memory share,
   0.9): the same prompts; the first ``--parity-tokens`` tokens of every answer must be equal;
5. ``pdserve bench serve`` with the same GPU and model: TTFT, ITL and throughput of both
   (skip with ``--no-bench``).

Results go to ``<out>/gpu-e2e.json`` (and bench serve's files); the exit code is 1 when a
prompt did not take the disaggregated path, no KV moved over NIXL, or parity failed.

Not part of ``make test``, and never run in this project's own workplace: no GPU there can run
vLLM (docs/deploy.md, "The GPU path").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.bench import serve as bench_serve
from pdserve.bench import systems as bench_systems

# Prompts of a few hundred tokens or more each (many KV blocks to move), all different.
TOPICS = (
    "the history of the printing press",
    "how a heat pump moves heat against a temperature gradient",
    "the rules of chess, piece by piece",
    "why the sky is blue and sunsets are red",
    "how a compiler turns source code into machine code",
    "the water cycle from ocean to cloud to river",
    "what makes a bridge stand: arches, beams, suspension and cables",
    "how vaccines train the immune system",
)
FILLER = (
    "Explain it step by step, with concrete examples, the common misconceptions and how they "
    "arise, the key terms defined in plain words, and a short summary at the end. "
)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_KV = re.compile(
    r"^pdserve_gateway_worker_kv_(transfer_bytes|transfer_seconds|transfers)_total"
    r'\{role="decode",worker="[^"]*"\} (\S+)$'
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory (default: prepared)")
    parser.add_argument("--gpu", default="0", help="the GPU both engines share (index)")
    parser.add_argument("--prompts", type=int, default=8, help="parity prompts (at most 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--parity-tokens", type=int, default=16, help="leading tokens equal")
    parser.add_argument("--engine-args", default="", help="vLLM engine arguments of both")
    parser.add_argument("--no-bench", action="store_true", help="skip pdserve bench serve")
    parser.add_argument("--port", type=int, default=8700, help="first of the ports used")
    parser.add_argument("--out", default="", help="result directory (default: a temp dir)")


def prompts(count: int) -> list[str]:
    return [f"Write about {topic}. " + FILLER * 8 for topic in TOPICS[: max(1, count)]]


def complete(url: str, name: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """(text, prefill worker) of one greedy completion (the worker: pdserve's header)."""
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with _NO_PROXY.open(request, timeout=600) as reply:
        answer = json.loads(reply.read())
        prefill = reply.headers.get("x-pdserve-prefill-worker", "")
    return str(answer["choices"][0]["text"]), prefill


def kv_counters(metrics_text: str) -> dict[str, float]:
    """Decode workers' NIXL transfer counters summed: transfers, transfer_bytes, _seconds."""
    totals = {"transfers": 0.0, "transfer_bytes": 0.0, "transfer_seconds": 0.0}
    for line in metrics_text.splitlines():
        match = _KV.match(line)
        if match:
            totals[match.group(1)] += float(match.group(2))
    return totals


def gb_per_s(counters: dict[str, float]) -> float:
    seconds = counters["transfer_seconds"]
    return counters["transfer_bytes"] / seconds / 1e9 if seconds > 0 else 0.0


def parity(pd: list[list[int]], mono: list[list[int]], tokens: int) -> list[dict[str, Any]]:
    """Per prompt: whether the first ``tokens`` tokens agree, and where they first differ."""
    rows = []
    for i, (a, b) in enumerate(zip(pd, mono, strict=True)):
        first = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        equal = first is None or first >= tokens
        rows.append({"prompt": i, "equal": equal, "first_difference": first})
    return rows


def _metrics(url: str) -> str:
    with _NO_PROXY.open(url + "/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def _moved(url: str, before: dict[str, float], wait_s: float = 30.0) -> dict[str, float]:
    """The counters' growth since ``before``, once the workers have reported it (heartbeat)."""
    deadline = time.monotonic() + wait_s
    while True:
        now = kv_counters(_metrics(url))
        delta = {k: now[k] - before.get(k, 0.0) for k in now}
        if delta["transfers"] > 0 or time.monotonic() >= deadline:
            return delta
        time.sleep(1)


def preflight(gpu: str) -> str | None:
    """Why the GPU path cannot run here (None: it can)."""
    from pdserve.placement.engines import detect_gpus
    from pdserve.worker.config import WorkerSettings
    from pdserve.worker.engine import connector_problem

    if gpu not in detect_gpus():
        return f"no NVIDIA GPU {gpu} here (nvidia-smi -L lists none by that index)"
    nixl = WorkerSettings.model_construct(kv_connector="nixl")
    return connector_problem(nixl, True, importlib.util.find_spec("nixl") is not None)


def through_pdserve(
    serve_args: argparse.Namespace, out: Path, name: str, texts: list[str], max_tokens: int
) -> tuple[list[tuple[str, str]], dict[str, float]]:
    """The answers of a 1P1D cluster and the KV its decode worker read over NIXL."""
    with bench_systems.pdserve_cluster(serve_args, out) as url:
        before = kv_counters(_metrics(url))
        answers = [complete(url, name, t, max_tokens) for t in texts]
        return answers, _moved(url, before)


def run(args: argparse.Namespace) -> int:
    from pdserve.cluster.up import served_model_name
    from pdserve.model import resolve_model

    problem = preflight(args.gpu)
    if problem:
        print(f"bench gpu: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="pdserve-bench-gpu-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, name = resolve_model(args.model or None), served_model_name(args.model)
    serve_args = argparse.Namespace(
        port=args.port, prefill=1, decode=1, model=args.model, gpus=args.gpu,
        engine_args=args.engine_args,
    )  # fmt: skip
    texts = prompts(args.prompts)
    print(f"bench gpu: 1P1D on GPU {args.gpu} with NIXL vs vllm serve; results in {out}")
    answers, moved = through_pdserve(serve_args, out, name, texts, args.max_tokens)
    local = [i for i, (_, prefill) in enumerate(answers) if prefill in ("", "local")]
    print(f"  KV over NIXL: {moved['transfers']:.0f} transfers, "
          f"{moved['transfer_bytes'] / 1e6:.1f} MB in {moved['transfer_seconds'] * 1e3:.1f} ms: "
          f"{gb_per_s(moved):.2f} GB/s")  # fmt: skip
    with bench_systems.monolith(serve_args, model, name, out) as url:
        reference = [complete(url, name, t, args.max_tokens)[0] for t in texts]
    tokenize = tokenizer(model)
    rows = parity([tokenize(a) for a, _ in answers], [tokenize(r) for r in reference],
                  args.parity_tokens)  # fmt: skip
    equal = sum(r["equal"] for r in rows)
    print(f"  greedy parity (first {args.parity_tokens} tokens): {equal}/{len(rows)} prompts")
    report = {"model": model, "gpu": args.gpu, "not_disaggregated": local,
              "kv": {**moved, "gb_per_s": gb_per_s(moved)}, "parity": rows,
              "pdserve": [a for a, _ in answers], "vllm": reference}  # fmt: skip
    (out / "gpu-e2e.json").write_text(json.dumps(report, indent=2))
    for failed, why in ((local, f"prompts {local} did not take the disaggregated path"),
                        (moved["transfers"] <= 0, "no KV moved over NIXL (see the decode log)"),
                        (equal < len(rows), "answers differ from vllm serve's")):  # fmt: skip
        if failed:
            print(f"  FAIL: {why}")
    if not args.no_bench:
        bench = {**_bench_defaults(), **vars(serve_args), "out": str(out / "bench-serve")}
        bench_serve.run(argparse.Namespace(**bench))
    ok = not local and moved["transfers"] > 0 and equal == len(rows)
    print(f"bench gpu: {'passed' if ok else 'FAILED'}; {out / 'gpu-e2e.json'}")
    return 0 if ok else 1


def _bench_defaults() -> dict[str, Any]:
    """``pdserve bench serve``'s own defaults."""
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return vars(parser.parse_args([]))


def tokenizer(model: str) -> Any:
    """Text -> token ids with the model's tokenizer (answers compare token by token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return lambda text: list(tok.encode(text, add_special_tokens=False))
