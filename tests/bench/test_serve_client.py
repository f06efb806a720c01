"""The serving benchmark client against a fake OpenAI-compatible streaming server on 127.0.0.1.

The fake server runs an aiohttp app in its own thread and event loop (so the CLI's
`asyncio.run` works too) and streams exactly `max_tokens` one-token chunks, 1 ms apart. Prompt
markers change its behaviour: `FAIL` answers 500, `SLOW` stalls, `PAIRS` sends two tokens per
chunk (usage then corrects the count).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

# `bench/` holds scripts, not an installed package: make the repo root importable. (No
# tests/bench/__init__.py on purpose: pytest would import it as a package named `bench`
# and hide the real one.)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.datasets import (  # noqa: E402
    BenchRequest,
    multi_prefix_requests,
    random_requests,
    shared_prefix_requests,
)
from bench.serve import (  # noqa: E402
    BenchmarkResult,
    RequestResult,
    arrival_offsets,
    http_send_fn,
    main,
    run_benchmark,
)

MODEL = "fake-model"
BODIES = web.AppKey("bodies", list)
TOKEN_GAP_S = 0.001


# ---------------------------------------------------------------- the fake server


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _chunk(chat: bool, text: str | None, finish: str | None = None,
           role: bool = False) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                "model": MODEL, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "finish_reason": finish}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [choice]}


async def _stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[BODIES].append(body)
    chat = request.path.endswith("/chat/completions")
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    if "FAIL" in prompt:
        return web.json_response({"error": {"message": "boom", "type": "internal_error",
                                            "param": None, "code": None}}, status=500)
    num_tokens = body.get("max_completion_tokens") or body["max_tokens"]
    per_chunk = 2 if "PAIRS" in prompt else 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if "SLOW" in prompt:
        await asyncio.sleep(30)
    if chat:
        await resp.write(_sse(_chunk(chat, "", role=True)))  # carries no token
    for _ in range(0, num_tokens, per_chunk):
        await asyncio.sleep(TOKEN_GAP_S)
        await resp.write(_sse(_chunk(chat, "tok " * per_chunk)))
    await resp.write(_sse(_chunk(chat, None, finish="length")))
    if body.get("stream_options", {}).get("include_usage"):
        usage = {"prompt_tokens": 3, "completion_tokens": num_tokens,
                 "total_tokens": 3 + num_tokens, "prompt_tokens_details": {"cached_tokens": 2}}
        await resp.write(_sse({**_chunk(chat, None), "choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _models(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                          "created": 0, "owned_by": "me"}]})


class FakeServer:
    """A threaded aiohttp server on 127.0.0.1 with a random free port."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.app[BODIES] = []
        self.app.router.add_post("/v1/completions", _stream)
        self.app.router.add_post("/v1/chat/completions", _stream)
        self.app.router.add_get("/v1/models", _models)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner = web.AppRunner(self.app, shutdown_timeout=1.0)
        self.base_url = ""

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return self.app[BODIES]


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    fake.start()
    yield fake
    fake.stop()


def _requests(num: int, output_len: int, marker: str = "") -> list[BenchRequest]:
    return [BenchRequest(f"{marker} prompt {i}", 3, output_len) for i in range(num)]


def _assert_ordered(result: BenchmarkResult) -> None:
    for stats in (result.ttft_ms, result.tpot_ms, result.itl_ms, result.e2e_ms):
        assert stats["p50"] is not None and stats["p90"] is not None and stats["p99"] is not None
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"]


# ---------------------------------------------------------------- HTTP runs


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_http_stream_counts(server: FakeServer, endpoint: str) -> None:
    num, out_len = 8, 6
    async with http_send_fn(server.base_url, endpoint, MODEL) as send:
        result = await run_benchmark(send, _requests(num, out_len), request_rate=math.inf,
                                     max_concurrency=4, seed=0, progress=False)
    assert (result.completed, result.failed) == (num, 0), result.errors
    assert result.total_output_tokens == num * out_len
    for req in result.requests:
        assert req.output_tokens == out_len
        assert len(req.itls) == out_len - 1  # the role-only chat chunk is not a token
        assert req.ttft is not None and req.e2e is not None and 0 < req.ttft <= req.e2e
    _assert_ordered(result)
    assert result.output_throughput > 0 and result.request_throughput > 0
    body = server.bodies[-1]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == MODEL
    assert (send.prompt_tokens, send.cached_tokens) == (3 * num, 2 * num)  # from usage


async def test_usage_corrects_multi_token_chunks(server: FakeServer) -> None:
    async with http_send_fn(server.base_url, "completions", MODEL) as send:
        result = await run_benchmark(send, _requests(2, 7, "PAIRS"), progress=False)
    assert result.completed == 2
    assert [r.output_tokens for r in result.requests] == [7, 7]
    assert [len(r.itls) for r in result.requests] == [3, 3]  # 4 chunks: 3 gaps


async def test_failures_are_recorded_and_run_goes_on(server: FakeServer) -> None:
    requests = _requests(3, 4) + _requests(2, 4, "FAIL")
    async with http_send_fn(server.base_url, "chat", MODEL) as send:
        result = await run_benchmark(send, requests, max_concurrency=2, progress=False)
    assert (result.completed, result.failed) == (3, 2)
    assert any("HTTP 500" in e and "boom" in e for e in result.errors)
    assert result.total_output_tokens == 12


async def test_stalled_request_times_out(server: FakeServer) -> None:
    started = time.perf_counter()
    async with http_send_fn(server.base_url, "completions", MODEL) as send:
        result = await run_benchmark(send, _requests(1, 3, "SLOW") + _requests(1, 3),
                                     request_timeout_s=0.5, progress=False)
    assert time.perf_counter() - started < 10
    assert (result.completed, result.failed) == (1, 1)
    assert any("timed out" in e for e in result.errors)


def test_cli_writes_json(server: FakeServer, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--base-url", server.base_url, "--endpoint", "chat", "--dataset",
                 "shared-prefix", "--prefix-len", "20", "--input-len", "5", "--output-len",
                 "4", "--num-prompts", "6", "--request-rate", "500", "--seed", "3",
                 "--label", "t1", "--result-dir", str(tmp_path), "--no-progress"])
    assert code == 0
    record = json.loads((tmp_path / "serve-t1.json").read_text())
    assert record["label"] == "t1" and record["completed"] == 6 and record["failed"] == 0
    assert record["config"]["model"] == MODEL  # taken from GET /v1/models
    assert record["config"]["request_rate"] == 500
    assert "api_key" not in record["config"]
    assert record["total_output_tokens"] == 24 and len(record["per_request"]) == 6
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(record[key]) == {"mean", "p50", "p90", "p99"}
    out = capsys.readouterr().out
    assert "serve[t1]: 6/6 ok" in out and "TTFT" in out


def test_cli_inf_rate_label_and_json(server: FakeServer, tmp_path: Path) -> None:
    code = main(["--base-url", f"{server.base_url}/v1", "--model", MODEL, "--input-len", "4",
                 "--output-len", "3", "--num-prompts", "3", "--result-dir", str(tmp_path),
                 "--no-progress"])
    assert code == 0
    (path,) = tmp_path.glob("serve-*.json")
    assert path.name == "serve-random-completions-in4-out3-rateinf-cmax.json"
    record = json.loads(path.read_text())  # strict JSON: no bare Infinity
    assert record["request_rate"] == "inf"


# ---------------------------------------------------------------- timing core, no HTTP


async def test_max_concurrency_is_respected() -> None:
    in_flight, peak = 0, 0

    async def send(_request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            for _ in range(3):
                await asyncio.sleep(0.002)
                yield time.perf_counter(), 1
        finally:
            in_flight -= 1

    result = await run_benchmark(send, _requests(12, 3), max_concurrency=3, progress=False)
    assert result.completed == 12 and peak == 3


async def test_tpot_and_itl_from_chunks() -> None:
    async def send(_request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        yield time.perf_counter(), 0  # no token: ignored for timing
        for tokens in (1, 2, 1):
            await asyncio.sleep(0.01)
            yield time.perf_counter(), tokens

    result = await run_benchmark(send, _requests(2, 4), progress=False)
    for req in result.requests:
        assert req.output_tokens == 4 and len(req.itls) == 2
        assert req.ttft is not None and req.e2e is not None and req.tpot is not None
        assert req.ttft >= 0.009 and min(req.itls) >= 0.009
        assert req.tpot == pytest.approx((req.e2e - req.ttft) / 3)


async def test_send_fn_exception_is_a_failed_request() -> None:
    async def send(request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        if "bad" in request.prompt:
            raise ValueError("nope")
        yield time.perf_counter(), 1

    result = await run_benchmark(send, _requests(2, 1) + _requests(1, 1, "bad"), progress=False)
    assert (result.completed, result.failed) == (2, 1)
    assert result.errors == ["ValueError: nope"]
    assert result.tpot_ms["p50"] is None  # one-token outputs have no TPOT
    assert "-" in result.table() and "2/3 ok" in result.summary_line()


def test_request_result_tpot_needs_two_tokens() -> None:
    assert RequestResult(prompt_len=1, output_tokens=1, ttft=0.1, e2e=0.2).tpot is None
    assert RequestResult(prompt_len=1, output_tokens=3, ttft=0.1, e2e=0.3).tpot == \
        pytest.approx(0.1)


def test_poisson_arrivals_are_seeded() -> None:
    first = arrival_offsets(2000, request_rate=50.0, seed=7)
    assert first == arrival_offsets(2000, request_rate=50.0, seed=7)
    assert first != arrival_offsets(2000, request_rate=50.0, seed=8)
    assert first[0] == 0.0 and all(b >= a for a, b in zip(first, first[1:], strict=False))
    mean_gap = first[-1] / (len(first) - 1)
    assert mean_gap == pytest.approx(1 / 50.0, rel=0.1)
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0, seed=0)


async def test_poisson_schedule_is_followed() -> None:
    starts: list[float] = []
    t0 = time.perf_counter()

    async def send(_request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        starts.append(time.perf_counter() - t0)
        yield time.perf_counter(), 1

    await run_benchmark(send, _requests(10, 1), request_rate=100.0, seed=1, progress=False)
    expected = arrival_offsets(10, 100.0, seed=1)
    # Never early; late only by scheduling noise (generous: the CI machine is shared).
    assert all(s >= e - 1e-3 and s - e < 0.5 for s, e in zip(starts, expected, strict=True))


# ---------------------------------------------------------------- datasets


def test_random_dataset_is_seeded() -> None:
    a = random_requests(5, input_len=12, output_len=7, seed=1)
    assert a == random_requests(5, input_len=12, output_len=7, seed=1)
    assert a != random_requests(5, input_len=12, output_len=7, seed=2)
    assert all(len(r.prompt.split()) == 12 and r.output_len == 7 for r in a)
    assert len({r.prompt for r in a}) == 5


def test_multi_prefix_dataset() -> None:
    reqs = multi_prefix_requests(40, num_prefixes=3, prefix_len=20, suffix_len=4,
                                 output_len=2, seed=0)
    assert reqs == multi_prefix_requests(40, 3, 20, 4, 2, seed=0)
    heads = {" ".join(r.prompt.split()[:22]) for r in reqs}  # "system N:" and 20 words
    assert len(heads) == 3 and len({r.prompt for r in reqs}) == 40
    with pytest.raises(ValueError):
        multi_prefix_requests(4, 0, 20, 4, 2)


def test_shared_prefix_dataset() -> None:
    reqs = shared_prefix_requests(4, prefix_len=30, suffix_len=5, output_len=2, seed=0)
    prefix = " ".join(reqs[0].prompt.split()[:30])
    assert all(r.prompt.startswith(prefix + " ") for r in reqs)
    assert len({r.prompt for r in reqs}) == 4
    with pytest.raises(ValueError):
        random_requests(0, input_len=1, output_len=1)
