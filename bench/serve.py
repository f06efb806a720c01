"""Serving benchmark: replay a seeded request trace against a server and report latency.

Like vLLM's `benchmark_serving`: requests arrive all at once (`--request-rate inf`) or as a
seeded Poisson process, at most `--max-concurrency` in flight; each streams its tokens and the
client measures TTFT (time to the first token), ITL (every gap between token-bearing chunks),
TPOT ((e2e - ttft) / (tokens - 1)) and E2E latency, then prints one readable line and a table
and, where `--result-dir` says, writes JSON to `<result-dir>/serve-<label>.json`.

    python -m bench.serve --base-url http://127.0.0.1:8000 --endpoint completions \\
        --dataset random --input-len 128 --output-len 128 --num-prompts 200 --request-rate 8

The timing core, `run_benchmark(send_fn, ...)`, knows nothing about HTTP: `send_fn(request)`
is any async iterator of `(time.perf_counter() timestamp, tokens in the chunk)`, so the same
trace replays against an in-process engine or an OpenAI-compatible URL (`http_send_fn`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):
    # Run as `python bench/serve.py`: put the repo root on the path so `bench.` resolves.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.datasets import BenchRequest, random_requests, shared_prefix_requests  # noqa: E402

Chunk = tuple[float, int]  # (time.perf_counter() when it arrived, tokens it carries)
SendFn = Callable[[BenchRequest], AsyncIterator[Chunk]]
PERCENTILES = (50, 90, 99)
_MAX_ERRORS_KEPT = 10


# ---------------------------------------------------------------- timing core


@dataclass
class RequestResult:
    """What one request measured; times in seconds. `error` is set when it failed."""

    prompt_len: int
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    start: float = 0.0  # seconds after the benchmark began
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class BenchmarkResult:
    """Aggregate of one run. Latency stats are in milliseconds: `{"mean", "p50", "p90",
    "p99"}`, with None values when no request produced that metric."""

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_rate: float
    max_concurrency: int | None
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    errors: list[str]
    requests: list[RequestResult] = field(repr=False, default_factory=list)

    def summary_line(self) -> str:
        return (
            f"{self.completed}/{self.num_requests} ok in {self.duration_s:.2f} s | "
            f"{self.request_throughput:.2f} req/s, {self.output_throughput:.1f} out tok/s | "
            f"TTFT p50 {_fmt(self.ttft_ms['p50'])} p99 {_fmt(self.ttft_ms['p99'])} ms | "
            f"TPOT p50 {_fmt(self.tpot_ms['p50'])} ms | ITL p50 {_fmt(self.itl_ms['p50'])} ms | "
            f"E2E p50 {_fmt(self.e2e_ms['p50'])} ms"
        )

    def table(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        lines = [
            f"requests: {self.completed} ok, {self.failed} failed, of {self.num_requests} "
            f"(rate {rate}/s, max concurrency {self.max_concurrency or 'unbounded'})",
            f"duration: {self.duration_s:.2f} s   tokens in/out: {self.total_input_tokens}"
            f"/{self.total_output_tokens}",
            f"throughput: {self.request_throughput:.2f} req/s, {self.output_throughput:.1f} "
            f"output tok/s, {self.total_token_throughput:.1f} total tok/s",
            f"{'ms':<6}" + "".join(f"{k:>10}" for k in ("mean", *_pct_keys())),
        ]
        for name, stats in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms),
                            ("ITL", self.itl_ms), ("E2E", self.e2e_ms)):
            lines.append(f"{name:<6}" + "".join(f"{_fmt(v):>10}" for v in stats.values()))
        lines += [f"error: {e}" for e in self.errors]
        return "\n".join(lines)

    def to_dict(self, per_request: bool = True) -> dict[str, Any]:
        """JSON-ready: `inf` rate as the string "inf" (JSON has no infinity)."""
        data = asdict(self)
        data["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        data.pop("requests")
        if per_request:
            data["per_request"] = [
                {"prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "ttft": r.ttft,
                 "tpot": r.tpot, "e2e": r.e2e, "start": r.start, "error": r.error}
                for r in self.requests
            ]
        return data


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """When each request is sent, in seconds after the start: all at 0 for an infinite rate,
    else a Poisson process (exponential gaps of mean 1/rate) drawn from `seed`."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_requests)
    # The first request goes at once: the run measures the server, not an idle lead-in.
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def run_benchmark(
    send_fn: SendFn,
    requests: Sequence[BenchRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    *,
    request_timeout_s: float = 600.0,
    progress: bool = True,
) -> BenchmarkResult:
    """Send `requests` on the seeded arrival schedule and measure each stream.

    A failed or timed-out request is recorded with its error and the run goes on; every
    request is bounded by `request_timeout_s`, so the run always ends.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")
    t0 = time.perf_counter()

    async def one(request: BenchRequest) -> RequestResult:
        async with limit:
            result = await measure_request(send_fn, request, request_timeout_s, t0)
        bar.update(1)
        return result

    tasks = []
    for request, offset in zip(requests, offsets, strict=True):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return summarize(list(results), duration, request_rate, max_concurrency)


async def measure_request(send_fn: SendFn, request: BenchRequest, timeout_s: float,
                          t0: float) -> RequestResult:
    """Send one request and time its stream (`start` relative to `t0`); a failure or a
    timeout is recorded in the result, never raised."""
    result = RequestResult(prompt_len=request.prompt_len)
    start = time.perf_counter()
    result.start = start - t0

    async def consume() -> None:
        last: float | None = None
        async for stamp, num_tokens in send_fn(request):
            if num_tokens <= 0:
                continue  # role-only or usage-only chunks carry no token
            if last is None:
                result.ttft = stamp - start
            else:
                result.itls.append(stamp - last)
            last = stamp
            result.output_tokens += num_tokens

    try:
        await asyncio.wait_for(consume(), timeout_s)
        result.e2e = time.perf_counter() - start
        if result.output_tokens == 0:
            result.error = "the response carried no tokens"
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout_s:g} s"
    except Exception as exc:  # one bad request must not end the run
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def summarize(results: list[RequestResult], duration_s: float, request_rate: float,
              max_concurrency: int | None) -> BenchmarkResult:
    """Throughput and latency percentiles over the successful requests."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    duration = max(duration_s, 1e-9)
    errors = list(dict.fromkeys(r.error for r in results if r.error))[:_MAX_ERRORS_KEPT]
    return BenchmarkResult(
        num_requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(ok) / duration,
        output_throughput=out_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration,
        ttft_ms=_stats([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=_stats([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=_stats([gap for r in ok for gap in r.itls]),
        e2e_ms=_stats([r.e2e for r in ok if r.e2e is not None]),
        errors=[e for e in errors if e],
        requests=results,
    )


def _pct_keys() -> list[str]:
    return [f"p{p}" for p in PERCENTILES]


def _stats(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"mean": None, **{k: None for k in _pct_keys()}}
    ms = np.asarray(seconds) * 1000.0
    pcts = np.percentile(ms, PERCENTILES)
    return {"mean": float(ms.mean()), **{k: float(v) for k, v in zip(_pct_keys(), pcts, strict=True)}}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# ---------------------------------------------------------------- HTTP (OpenAI-compatible)


class HttpSender:
    """`send_fn` for an OpenAI-compatible server: one streaming POST per request.

    Counts one token per chunk with text, then corrects the last chunk with the server's
    `usage.completion_tokens` when it reports one (a chunk can carry several tokens, or one
    token's text can be held back). It yields each chunk one behind, which changes no timing:
    the timestamps are taken when the bytes arrive. Use as `async with`, or call `aclose()`.
    `prompt_tokens` and `cached_tokens` add up the usage of every request (the prefix-cache
    hit rate is their ratio).
    """

    def __init__(self, base_url: str, endpoint: str, model: str, *, api_key: str | None = None,
                 timeout_s: float = 600.0, ignore_eos: bool = True,
                 temperature: float = 0.0) -> None:
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
        root = base_url.rstrip("/").removesuffix("/v1")
        path = "chat/completions" if endpoint == "chat" else "completions"
        self.url = f"{root}/v1/{path}"
        self.endpoint, self.model = endpoint, model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s, self.ignore_eos, self.temperature = timeout_s, ignore_eos, temperature
        self._session: aiohttp.ClientSession | None = None
        self.prompt_tokens = self.cached_tokens = 0

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "temperature": self.temperature, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # every request then produces exactly output_len tokens
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.prompt
            body["max_tokens"] = request.output_len
        return body

    async def __call__(self, request: BenchRequest) -> AsyncIterator[Chunk]:
        pending: Chunk | None = None
        counted, reported = 0, None
        async for stamp, event in self._events(self.payload(request)):
            if event.get("usage"):
                usage = event["usage"]
                reported = usage.get("completion_tokens")
                self.prompt_tokens += usage.get("prompt_tokens") or 0
                self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens") or 0
            if self._text(event):
                if pending is not None:
                    yield pending
                pending, counted = (stamp, 1), counted + 1
        if pending is not None:
            missing = reported - counted if reported is not None else 0
            yield pending[0], pending[1] + max(missing, 0)

    def _text(self, event: dict[str, Any]) -> str:
        choices = event.get("choices") or []
        if not choices:
            return ""
        if self.endpoint == "chat":
            return (choices[0].get("delta") or {}).get("content") or ""
        return choices[0].get("text") or ""

    async def _events(self, body: dict[str, Any]) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        session = self._get_session()
        async with session.post(self.url, json=body, headers=self.headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                stamp = time.perf_counter()
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"server error: {event['error'].get('message')}")
                yield stamp, event

    def _get_session(self) -> aiohttp.ClientSession:
        # Created on first use so that it binds to the running event loop.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # limit=0: aiohttp's default pool of 100 connections would cap concurrency.
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                read_bufsize=1 << 20,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> HttpSender:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def http_send_fn(base_url: str, endpoint: str, model: str, **kwargs: Any) -> HttpSender:
    """The HTTP `send_fn` (see `HttpSender` for keyword options); close it when done."""
    return HttpSender(base_url, endpoint, model, **kwargs)


async def first_model(base_url: str, api_key: str | None = None) -> str:
    """The first id `GET /v1/models` lists, for when `--model` is not given."""
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(f"{root}/v1/models", headers=headers) as resp,
    ):
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


# ---------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128,
                   help="prompt words (the unique suffix for shared-prefix)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix words")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--label", default=None, help="results file: serve-<label>.json")
    p.add_argument("--result-dir", type=Path, default=None,
                   help="write the result JSON here (nothing is written otherwise)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p.parse_args(argv)


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(args.num_prompts, args.prefix_len, args.input_len,
                                      args.output_len, args.seed)
    return random_requests(args.num_prompts, args.input_len, args.output_len, args.seed)


def default_label(args: argparse.Namespace) -> str:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    return (f"{args.dataset}-{args.endpoint}-in{args.input_len}-out{args.output_len}"
            f"-rate{rate}-c{args.max_concurrency or 'max'}")


async def _run(args: argparse.Namespace) -> BenchmarkResult:
    model = args.model or await first_model(args.base_url, args.api_key)
    args.model = model
    async with http_send_fn(args.base_url, args.endpoint, model, api_key=args.api_key,
                            timeout_s=args.request_timeout, ignore_eos=args.ignore_eos) as send:
        return await run_benchmark(send, build_requests(args), args.request_rate,
                                   args.max_concurrency, args.seed,
                                   request_timeout_s=args.request_timeout,
                                   progress=args.progress)


def write_result(result: BenchmarkResult, args: argparse.Namespace, label: str) -> Path:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k != "api_key"}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    record = {"label": label, "date": datetime.now(timezone.utc).isoformat(), "config": config,
              **result.to_dict()}
    args.result_dir.mkdir(parents=True, exist_ok=True)
    path = args.result_dir / f"serve-{label}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    label = args.label or default_label(args)
    result = asyncio.run(_run(args))
    print(result.table())
    where = f" -> {write_result(result, args, label)}" if args.result_dir else ""
    print(f"serve[{label}]: {result.summary_line()}{where}")
    return 0 if result.completed else 1


if __name__ == "__main__":
    sys.exit(main())
