"""KV-aware and prefix-aware routing against Serve's power of two choices, side by side in one
run, on a shared-prefix workload: many users, a few long system prompts, two replicas.

Each router gets a fresh `tokenflow serve` (its own Ray cluster, the default serving mode) with
two LLMServer replicas of `--config` (the model replaced by `--model`; `--num-blocks` KV blocks
each: by default room for about half of the system prompts, so a replica that is sent all of
them keeps evicting them), then the same seeded trace (`bench.datasets.multi_prefix_requests`)
at `--concurrency` requests in flight. Reported per router: the prefix-cache hit rate (cached
prompt tokens over prompt tokens, from each response's usage), output throughput and TTFT;
then each over power of two. Writes JSON only where `--out` says.

`--restart-router` is the second workload: halfway through the trace the router's process
(HAProxy's ingress request router, which holds the Serve request router) is killed, and Serve
starts another. `prefix_aware` starts over knowing nothing; `kv_aware` replays what each
replica's KV cache holds from its event stream.

    python bench/prefix_routing.py --repeat 3 --overlap-weights 4 8
    python bench/prefix_routing.py --restart-router
    python bench/prefix_routing.py --num-prefixes 8 --prefix-len 400 --num-prompts 200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.datasets import multi_prefix_requests, random_requests  # noqa: E402
from bench.serve import http_send_fn, run_benchmark  # noqa: E402
from bench.serve_overhead import Server  # noqa: E402
from tokenflow.config import load_app_config  # noqa: E402

ROUTERS = ("kv_aware", "prefix_aware", "power_of_two")


async def measure(server: Server, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """`--repeat` traces (seeds seed, seed+1, ...: other system prompts each time) on one
    server; the mean of each figure, and each trace's own."""
    traces = []
    async with http_send_fn(server.url, "completions", args.model) as send:
        # Unrelated prompts first (connections, tokenizer, allocator), not measured.
        await run_benchmark(send, random_requests(8, 16, 4, args.seed + 1000), math.inf, 4,
                            progress=False)
        for seed in range(args.seed, args.seed + args.repeat):
            traces.append(await measure_trace(server, send, args, seed))
            print(f"    {label} seed {seed}: hit rate {100 * traces[-1]['hit_rate']:.0f}% | "
                  f"{traces[-1]['summary']}", flush=True)
    results = [t["result"] for t in traces]
    return {"hit_rate": statistics.mean(t["hit_rate"] for t in traces),
            "output_throughput": statistics.mean(r["output_throughput"] for r in results),
            "request_throughput": statistics.mean(r["request_throughput"] for r in results),
            "ttft_p50_ms": statistics.mean(r["ttft_ms"]["p50"] for r in results),
            "ttft_p90_ms": statistics.mean(r["ttft_ms"]["p90"] for r in results),
            "failed": sum(r["failed"] for r in results), "traces": traces}


async def measure_trace(server: Server, send: Any, args: argparse.Namespace,
                        seed: int) -> dict[str, Any]:
    requests = multi_prefix_requests(args.num_prompts, args.num_prefixes, args.prefix_len,
                                     args.suffix_len, args.output_len, seed)
    send.prompt_tokens = send.cached_tokens = 0
    if not args.restart_router:
        result = await run_benchmark(send, requests, math.inf, args.concurrency, seed,
                                     progress=False)
    else:  # the second half after the router's restart: only that half is measured
        half = len(requests) // 2
        await run_benchmark(send, requests[:half], math.inf, args.concurrency, seed,
                            progress=False)
        await asyncio.to_thread(restart_router, server)
        send.prompt_tokens = send.cached_tokens = 0
        result = await run_benchmark(send, requests[half:], math.inf, args.concurrency, seed,
                                     progress=False)
    return {"seed": seed, "hit_rate": send.cached_tokens / max(send.prompt_tokens, 1),
            "result": result.to_dict(per_request=False), "summary": result.summary_line()}


def restart_router(server: Server, timeout_s: float = 180) -> None:
    """Kill the router's process and return once a new one routes requests again."""
    [router] = [p for p, cmdline in _descendants(server)
                if "ServeReplica:tokenflow:ReplicaRouter" in cmdline]
    router.kill()
    router.wait(30)
    # Until a new one has started (Serve's own proxy, which HAProxy falls back to meanwhile,
    # routes without the prompt), then a moment for HAProxy to ask it again.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if [p for p, cmdline in _descendants(server) if p.pid != router.pid
                and cmdline.strip() == "ray::ServeReplica:tokenflow:ReplicaRouter"]:
            time.sleep(5)
            httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": "warm up", "max_tokens": 1}).raise_for_status()
            return
        time.sleep(0.5)
    raise RuntimeError("no router came back")


def _descendants(server: Server) -> list[tuple[psutil.Process, str]]:
    """The server's live descendants and their command lines (one that exits meanwhile is
    skipped)."""
    found = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            found.append((proc, " ".join(proc.cmdline())))
    return found


def report(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table of the means over the traces, then each router over power of two."""
    lines = ["| router | prefix-cache hit rate | output tok/s | req/s | TTFT p50 ms | "
             "TTFT p90 ms | failed |", "|---|---|---|---|---|---|---|"]
    for router, r in results.items():
        if not r["output_throughput"]:  # every request failed: the server log says why
            lines.append(f"| {router} | - | - | - | - | - | {r['failed']} |")
            continue
        lines.append(f"| {router} | {100 * r['hit_rate']:.0f}% | "
                     f"{r['output_throughput']:.1f} | {r['request_throughput']:.2f} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['failed']} |")
    theirs = results.get("power_of_two")
    if theirs and theirs["output_throughput"]:
        lines.append("")
        for router, ours in results.items():
            if router == "power_of_two" or not ours["output_throughput"]:
                continue
            ttft = ours["ttft_p50_ms"] / theirs["ttft_p50_ms"]
            lines.append(f"{router} / power_of_two: throughput "
                         f"{ours['output_throughput'] / theirs['output_throughput']:.2f}x, "
                         f"TTFT p50 {ttft:.2f}x ({100 * (1 - ttft):.0f}% lower)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=400, help="words per system prompt")
    p.add_argument("--suffix-len", type=int, default=16, help="words of each user's own part")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=160,
                   help="KV blocks per replica, of 16 tokens (default 160: room for about half "
                        "of the default system prompts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap-weights", type=float, nargs="+", default=[None],
                   help="kv_aware: one run per deployment.router_overlap_weight given "
                        "(default: the config's)")
    p.add_argument("--repeat", type=int, default=1,
                   help="traces per router (seeds seed, seed+1, ...), on one server each")
    p.add_argument("--restart-router", action="store_true",
                   help="kill the router's process halfway; measure the second half")
    p.add_argument("--out", help="write the result JSON to this file")
    args = p.parse_args(argv)
    base = load_app_config(args.config).model_dump(mode="json", exclude_unset=True)
    base["engine"]["model"] = {"model": args.model, "num_threads": 1}
    base["engine"].setdefault("cache", {})["num_blocks"] = args.num_blocks
    log_dir = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    print(f"server logs in {log_dir}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    runs = [(router, weight) for router in args.routers
            for weight in (args.overlap_weights if router == "kv_aware" else [None])]
    for router, weight in runs:
        label = router if weight is None else f"{router} w={weight:g}"
        config = json.loads(json.dumps(base))
        config["deployment"] = {**config.get("deployment", {}), "num_replicas": 2,
                                "request_router": router,
                                "ray_actor_options": {"num_cpus": 0.5}}
        if weight is not None:
            config["deployment"]["router_overlap_weight"] = weight
        server = Server(config, log_dir / f"{label.replace(' ', '_')}.log")
        try:
            server.wait_ready()
            results[label] = asyncio.run(measure(server, args, label))
        finally:
            server.stop()
        r = results[label]
        print(f"  {label:<13} mean of {args.repeat}: hit rate {100 * r['hit_rate']:.0f}%, "
              f"{r['output_throughput']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms",
              flush=True)
    print()
    print(report(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"config": vars(args), "results": results},
                                             indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
