"""AsyncEngine: concurrent streams, cancellation, per-request errors; stop strings; the CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.replica.engine_state import kv_blocks, request_counts
from tokenflow.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow.replica.engine.async_engine import AsyncEngine
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import PauseState, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    # The loop in a thread of this process: these tests reach into the engine it steps
    # (test_engine_loop.py runs the engine process against it).
    config = EngineConfig(cache=CacheConfig(num_blocks=128, block_size=16),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256),
                          engine_loop="thread")
    engine = AsyncEngine(config)
    yield engine
    engine.shutdown()


async def wait_all_free(engine, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        free, total = kv_blocks(engine)
        if free == total:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("blocks were not returned to the pool")


async def collect(engine, prompt, params=GREEDY, request_id=None):
    text, token_ids, finish = "", [], None
    async for delta in engine.generate(prompt, params, request_id=request_id):
        for c in delta.outputs:
            text += c.text
            token_ids += c.token_ids
            finish = c.finish_reason or finish
    return text, token_ids, finish


async def test_concurrent_streams_match_sequential(engine):
    prompts = [f"Request number {i} says hello" for i in range(8)]
    alone = [await collect(engine, p) for p in prompts]
    together = await asyncio.gather(*(collect(engine, p) for p in prompts))
    assert together == alone
    assert all(len(ids) == 12 and finish == "length" for _, ids, finish in together)
    await wait_all_free(engine)


async def test_cancel_mid_stream_frees_blocks(engine):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    seen = 0
    stream = engine.generate("a long story " * 20, params, request_id="to-cancel")
    async for delta in stream:
        seen += len(delta.outputs[0].token_ids)
        if seen >= 5:
            break
    # Still running when we walk away: only the cancellation can free it.
    assert engine.engine.has_request("to-cancel")
    await stream.aclose()
    await wait_all_free(engine)
    assert not engine.engine.has_request("to-cancel")


async def test_a_submitted_request_runs_before_it_is_read(engine):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = await collect(engine, "submitted early", params)
    processed = engine.process_inputs("submitted early", params, "submitted")
    queries = engine.state.totals.prefix_cache_queries
    batches = engine.submit(processed)
    # Nobody reads it, and the engine runs it to the end all the same.
    await wait_until(engine.is_idle)
    assert engine.state.totals.prefix_cache_queries > queries
    assert request_counts(engine) == (0, 0)
    text, token_ids = "", []
    async for outs in batches:
        for out in outs:
            text += out.outputs[0].text
            token_ids += out.outputs[0].token_ids
    await batches.aclose()
    assert (text, token_ids) == expected[:2]
    await wait_all_free(engine)


async def test_a_submitted_request_closed_unread_is_aborted(engine):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    batches = engine.submit(engine.process_inputs("never read " * 10, params, "unread"))
    for _ in range(200):
        if engine.engine.has_request("unread"):
            break
        await asyncio.sleep(0.01)
    assert engine.engine.has_request("unread")
    await batches.aclose()
    await wait_all_free(engine)
    assert not engine.engine.has_request("unread")


async def test_task_cancellation_aborts(engine):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    task = asyncio.create_task(collect(engine, "cancel me please", params, "task-cancel"))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_all_free(engine)


class ExplodingDetokenizer:
    finished = False

    def push(self, token_ids):
        raise RuntimeError("detokenizer exploded")


async def test_error_in_one_request_does_not_stop_others(engine, monkeypatch):
    processor = engine.engine.output_processor
    original = processor.add_request

    def add_request(request_id, child_ids, *args, **kwargs):
        original(request_id, child_ids, *args, **kwargs)
        if request_id == "bad":
            processor._children["bad"].detokenizer = ExplodingDetokenizer()

    monkeypatch.setattr(processor, "add_request", add_request)
    good = asyncio.create_task(collect(engine, "a good request"))
    errors = []
    async for delta in engine.generate("a bad request", GREEDY, request_id="bad"):
        errors.append(delta.error)
        finish = delta.outputs[0].finish_reason
    assert finish == "error" and "exploded" in errors[-1]
    _, good_ids, good_finish = await good
    assert good_finish == "length" and len(good_ids) == 12
    assert engine.is_running
    await wait_all_free(engine)


async def test_bad_input_raises_before_running(engine):
    with pytest.raises(ValueError, match="empty"):
        await collect(engine, [])
    with pytest.raises(ValueError, match="context"):
        await collect(engine, "x", SamplingParams(max_tokens=10**6))
    assert (await collect(engine, "still fine"))[2] == "length"


def test_stop_string_ends_generation_and_frees_at_once():
    llm = LLM("tokenflow-tiny", num_blocks=128)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    full = llm.generate(["The weather today"], greedy, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 10
    stop = full.text[6:9]
    cut = llm.generate(["The weather today"],
                       SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert full.text.startswith(cut.text) and stop not in cut.text
    assert len(cut.token_ids) < len(full.token_ids)
    kept = llm.generate(["The weather today"],
                        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                       stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text.endswith(stop) and kept.text == cut.text + stop
    llm.engine.check_idle()


def test_cli_generate_on_default_model():
    result = subprocess.run(
        [sys.executable, "-m", "tokenflow.cli", "generate", "Hello", "--max-tokens", "5",
         "--num-blocks", "64"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "'Hello' -> " in result.stdout and "(length)" in result.stdout


def test_cli_generate_reports_missing_model():
    result = subprocess.run(
        [sys.executable, "-m", "tokenflow.cli", "generate", "Hi", "--model", "/no/such/dir"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "never downloads" in result.stderr


async def test_failed_step_errors_its_requests_and_the_loop_goes_on(engine, monkeypatch):
    executor = engine.engine.executor
    original = executor.execute_model
    calls = {"n": 0}

    def fail_once(sched_out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return original(sched_out)

    monkeypatch.setattr(executor, "execute_model", fail_once)
    outputs = [delta async for delta in engine.generate("this step will fail", GREEDY)]
    assert outputs[-1].outputs[0].finish_reason == "error"
    assert "device fell over" in outputs[-1].error
    assert engine.is_running
    _, ids, finish = await collect(engine, "the next one works")
    assert finish == "length" and len(ids) == 12
    await wait_all_free(engine)


# ----------------------------------------------------------------------------- pausing
async def wait_until(condition, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


def count_steps(engine, monkeypatch) -> dict[str, int]:
    steps = {"n": 0}
    original = engine.engine.step

    def counting_step():
        steps["n"] += 1
        return original()

    monkeypatch.setattr(engine.engine, "step", counting_step)
    return steps


async def test_pause_all_holds_requests_without_spinning_until_resumed(engine, monkeypatch):
    unpaused = await collect(engine, "held while paused")
    await engine.pause(PauseState.PAUSED_ALL)
    try:
        assert engine.is_paused() and engine.pause_state is PauseState.PAUSED_ALL
        task = asyncio.create_task(collect(engine, "held while paused", request_id="held"))
        await wait_until(lambda: request_counts(engine) == (0, 1) and engine.is_idle())
        steps = count_steps(engine, monkeypatch)
        await asyncio.sleep(0.3)
        assert steps["n"] == 0, "a paused engine must sleep, not step"
        assert not task.done()
    finally:
        await engine.resume()
    assert await task == unpaused
    assert not engine.is_paused()
    await wait_all_free(engine)


async def test_pause_new_lets_running_requests_finish_and_holds_new_ones(engine):
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    stream = engine.generate("a long story " * 5, long, request_id="drain-long")
    first = await stream.__anext__()  # admitted: it runs to its end through the pause
    await engine.pause(PauseState.PAUSED_NEW)
    try:
        late = asyncio.create_task(collect(engine, "a late request", request_id="drain-late"))
        num_tokens, finish = len(first.outputs[0].token_ids), None
        async for delta in stream:
            num_tokens += len(delta.outputs[0].token_ids)
            finish = delta.outputs[0].finish_reason
        assert (num_tokens, finish) == (60, "length")
        await wait_until(engine.is_idle)  # drained: only never admitted requests are left
        assert request_counts(engine) == (0, 1) and not late.done()
    finally:
        await engine.resume()
    _, ids, late_finish = await late
    assert late_finish == "length" and len(ids) == 12
    await wait_all_free(engine)


async def test_pausing_with_unpaused_is_an_error(engine):
    with pytest.raises(ValueError, match="resume"):
        await engine.pause(PauseState.UNPAUSED)
    assert not engine.is_paused()
