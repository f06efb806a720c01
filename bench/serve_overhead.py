"""Overhead of the HTTP + Ray Serve path: the same trace against `tokenflow serve` and against
the in-process `AsyncEngine`, in one process, with the same engine config.

Prints both result tables, then one line with the throughput loss and the added median TTFT
of the served path; writes the result JSON only where `--out` says.

    python bench/serve_overhead.py --config configs/local.yaml --num-prompts 200 \
        --max-concurrency 32 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.datasets import BenchRequest, random_requests  # noqa: E402
from bench.serve import BenchmarkResult, http_send_fn, run_benchmark  # noqa: E402
from tokenflow.cluster.launcher import loopback_only  # noqa: E402
from tokenflow.config import AppConfig, load_app_config  # noqa: E402
from tokenflow.replica.async_engine import AsyncEngine  # noqa: E402
from tokenflow.scheduler import SamplingParams  # noqa: E402


class EngineSender:
    """The benchmark's send function for an in-process AsyncEngine (no HTTP, no Serve)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def __call__(self, request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0,
                                ignore_eos=True)
        async for delta in self.engine.generate(request.prompt, params):
            yield time.perf_counter(), sum(len(c.token_ids) for c in delta.outputs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_served(config: AppConfig, requests: list[BenchRequest], args) -> BenchmarkResult:
    import ray
    from ray import serve

    from tokenflow.cluster.app import bind_app

    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(bind_app(config), name="bench", route_prefix="/")
        async with http_send_fn(f"http://127.0.0.1:{port}", "completions",
                                config.engine.model.name) as send:
            await run_benchmark(send, requests[: args.max_concurrency], math.inf,
                                args.max_concurrency, args.seed, progress=False)  # warm-up
            return await run_benchmark(send, requests, args.request_rate,
                                       args.max_concurrency, args.seed)
    finally:
        serve.shutdown()
        ray.shutdown()


async def run_inprocess(config: AppConfig, requests: list[BenchRequest], args
                        ) -> BenchmarkResult:
    engine = AsyncEngine(config.engine)
    try:
        send = EngineSender(engine)
        await run_benchmark(send, requests[: args.max_concurrency], math.inf,
                            args.max_concurrency, args.seed, progress=False)  # warm-up
        return await run_benchmark(send, requests, args.request_rate, args.max_concurrency,
                                   args.seed)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--model", default="tokenflow-tiny",
                   help="engine.model.model for both runs (default tokenflow-tiny: this measures "
                        "the serving path, not the model)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None,
                   help="engine.model.num_threads for both runs (default: the config's)")
    p.add_argument("--stream-interval", type=float, default=None,
                   help="stream_interval_s of the served app (default: the config's)")
    p.add_argument("--out", help="write the result JSON to this file")
    args = p.parse_args(argv)
    loopback_only()
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    data = load_app_config(args.config).model_dump()
    data["engine"]["model"]["model"] = args.model
    if args.num_threads is not None:
        data["engine"]["model"]["num_threads"] = args.num_threads
    if args.stream_interval is not None:
        data["stream_interval_s"] = args.stream_interval
    config = load_app_config(data)
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.seed)
    served = asyncio.run(run_served(config, requests, args))
    inproc = asyncio.run(run_inprocess(config, requests, args))
    print("served (HTTP + Serve):\n" + served.table())
    print("in-process AsyncEngine:\n" + inproc.table())
    s, i = served.to_dict(per_request=False), inproc.to_dict(per_request=False)
    loss = 1 - s["output_throughput"] / i["output_throughput"]
    added_ttft_ms = s["ttft_ms"]["p50"] - i["ttft_ms"]["p50"]
    print(f"serve overhead @ concurrency {args.max_concurrency}: throughput "
          f"{s['output_throughput']:.1f} vs {i['output_throughput']:.1f} tok/s "
          f"({100 * loss:+.1f}% loss), median TTFT {s['ttft_ms']['p50']:.1f} vs "
          f"{i['ttft_ms']['p50']:.1f} ms ({added_ttft_ms:+.1f} ms)")
    record = {"config": vars(args), "served": s, "inprocess": i,
              "throughput_loss": loss, "added_median_ttft_ms": added_ttft_ms}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
