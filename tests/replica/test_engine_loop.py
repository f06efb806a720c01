"""The engine loop in a process of its own (`engine_loop: process`): the same tokens, text and
behaviour as the loop in a thread (streams, stop strings, n > 1, cancellation, pause and
drain, bad input), a dead engine process is restarted once and its requests go on (a second
death soon after fails them), and shutdown leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from tests.replica.engine_state import kv_blocks, request_counts
from tokenflow.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tokenflow.replica.engine.async_engine import AsyncEngine, EngineDeadError
from tokenflow.scheduler import PauseState, SamplingParams

CONFIG = EngineConfig(cache=CacheConfig(num_blocks=128, block_size=16),
                      scheduler=SchedulerConfig(max_num_batched_tokens=256))
PROMPTS = [f"Request number {i} says hello" for i in range(6)]
REQUESTS = [
    *[(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for p in PROMPTS],
    ("stop me", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                               stop=["e", "a"])),
    ("two seeded", SamplingParams(max_tokens=10, temperature=1.0, n=2, seed=3,
                                  ignore_eos=True)),
]


@pytest.fixture(scope="module")
def process_engine():
    engine = AsyncEngine(CONFIG.model_copy(update={"engine_loop": "process"}))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams
                  ) -> list[tuple[str, list[int], str | None]]:
    choices: dict[int, tuple[str, list[int], str | None]] = {}
    async for delta in engine.generate(prompt, params):
        for c in delta.outputs:
            text, ids, finish = choices.get(c.index, ("", [], None))
            choices[c.index] = (text + c.text, ids + c.token_ids, c.finish_reason or finish)
    return [choices[i] for i in sorted(choices)]


async def run_all(engine: AsyncEngine) -> list[list[tuple[str, list[int], str | None]]]:
    return await asyncio.gather(*(collect(engine, p, s) for p, s in REQUESTS))


async def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_engine_process_gives_what_the_engine_thread_gives(process_engine) -> None:
    thread_engine = AsyncEngine(CONFIG.model_copy(update={"engine_loop": "thread"}))
    try:
        expected = asyncio.run(run_all(thread_engine))
    finally:
        thread_engine.shutdown()
    got = asyncio.run(run_all(process_engine))
    assert got == expected
    assert expected[6][0][2] == "stop" and len(expected[7]) == 2
    # The engine lives in another process; its state comes back with every step.
    assert process_engine.engine is None and process_engine.engine_pid != os.getpid()
    free, total = kv_blocks(process_engine)
    assert free == total == 128 and request_counts(process_engine) == (0, 0)
    assert process_engine.state.totals.prefix_cache_queries > 0


def test_bad_input_is_refused_here_before_it_reaches_the_engine(process_engine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        process_engine.process_inputs([1] * (process_engine.max_model_len + 1))
    with pytest.raises(ValueError, match="empty"):
        process_engine.process_inputs([])


def test_cancel_frees_blocks_and_pause_drains(process_engine) -> None:
    async def run() -> None:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = process_engine.generate("a long story " * 20, params)
        async for _ in stream:
            break
        assert kv_blocks(process_engine)[0] < 128  # still running when we walk away
        await stream.aclose()
        await wait_for(lambda: kv_blocks(process_engine)[0] == 128 and process_engine.is_idle(),
                       "the aborted request's blocks")
        # Paused with PAUSED_NEW: a running request finishes, a new one waits.
        long = asyncio.create_task(collect(process_engine, "before the pause",
                                           SamplingParams(max_tokens=60, ignore_eos=True)))
        await wait_for(lambda: request_counts(process_engine)[0] == 1, "the first request")
        await process_engine.pause(PauseState.PAUSED_NEW)
        late = asyncio.create_task(collect(process_engine, "after the pause",
                                           SamplingParams(max_tokens=4, ignore_eos=True)))
        assert len((await long)[0][1]) == 60
        await wait_for(process_engine.is_idle, "a drained engine")
        assert not late.done() and request_counts(process_engine) == (0, 1)
        await process_engine.resume()
        assert len((await late)[0][1]) == 4

    asyncio.run(run())


def test_a_dead_engine_process_is_restarted_and_its_requests_go_on() -> None:
    """The replica lives on when its engine process dies: a new process continues every open
    request from the tokens it had been given (greedy: token-exactly the uninterrupted run),
    one sent during the restart waits for it, and one that cannot continue (n > 1) fails."""
    greedy = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=50, temperature=1.0, seed=7, ignore_eos=True)
    two = SamplingParams(max_tokens=50, temperature=1.0, n=2, seed=3, ignore_eos=True)
    engine = AsyncEngine(CONFIG.model_copy(update={"engine_loop": "process"}))
    try:
        async def run() -> None:
            [uninterrupted] = await collect(engine, "a long story", greedy)
            first_pid = engine.engine_pid
            survivor = engine.generate("a long story", greedy)
            text, ids = "", []
            others = [asyncio.ensure_future(collect(engine, "seeded", seeded)),
                      asyncio.ensure_future(collect(engine, "two choices", two))]
            async for delta in survivor:
                text, ids = text + delta.outputs[0].text, ids + delta.outputs[0].token_ids
                if len(ids) >= 10 and engine.engine_pid == first_pid:
                    assert len(ids) < 120
                    os.kill(first_pid, signal.SIGKILL)  # a process this test started
                    # Sent while the old process is dying or the new one starts.
                    others.append(asyncio.ensure_future(collect(engine, "late", seeded)))
            assert (text, ids) == uninterrupted[:2]
            seeded_out, two_out, late = await asyncio.gather(*others, return_exceptions=True)
            assert len(seeded_out[0][1]) == 50 and len(late[0][1]) == 50
            assert isinstance(two_out, EngineDeadError)
            assert engine.engine_pid != first_pid and engine.num_restarts == 1
            engine.check_health()
            await wait_for(engine.is_idle, "the engine to drain")
            assert request_counts(engine) == (0, 0) and kv_blocks(engine) == (128, 128)

        asyncio.run(run())
    finally:
        engine.shutdown()


def test_an_engine_process_that_dies_again_soon_fails_its_streams_and_health() -> None:
    engine = AsyncEngine(CONFIG.model_copy(update={"engine_loop": "process"}))
    try:
        async def run() -> None:
            params = SamplingParams(max_tokens=10_000 // 16, temperature=0.0, ignore_eos=True)
            stream = engine.generate("doomed", params)
            pids = []
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    if engine.engine_pid not in pids and not engine.restarting:
                        pids.append(engine.engine_pid)
                        os.kill(engine.engine_pid, signal.SIGKILL)  # one this test started
            assert len(pids) == 2

        asyncio.run(run())
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(engine, "after", SamplingParams(max_tokens=2)))
    finally:
        engine.shutdown()


def test_a_new_engine_process_reports_its_state_before_any_step() -> None:
    # Autoscaling and routing ask a fresh replica for its KV usage before it served anything.
    engine = AsyncEngine(CONFIG.model_copy(update={"engine_loop": "process"}))
    try:
        assert kv_blocks(engine) == (128, 128) and engine.is_idle()
    finally:
        engine.shutdown()


def test_the_engine_process_gets_a_short_openmp_spin_unless_one_is_set(
        process_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """libgomp reads GOMP_SPINCOUNT when torch loads it, so the engine process must be
    started with it: 10,000 where the serving process has none, the user's value where it
    has one; the serving process's own environment is left as it was."""
    assert psutil.Process(process_engine.engine_pid).environ()["GOMP_SPINCOUNT"] == "10000"
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    engine = AsyncEngine(CONFIG.model_copy(update={"engine_loop": "process"}))
    try:
        assert psutil.Process(engine.engine_pid).environ()["GOMP_SPINCOUNT"] == "123"
    finally:
        engine.shutdown()


def test_shutdown_leaves_no_engine_process() -> None:
    engine = AsyncEngine(CONFIG.model_copy(update={"engine_loop": "process"}))
    pid = engine.engine_pid
    assert psutil.pid_exists(pid)
    engine.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_engine_process_refuses_what_needs_ray_inside_it() -> None:
    with pytest.raises(ValueError, match="engine_loop"):
        EngineConfig(engine_loop="process", parallel=ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="engine_loop"):
        EngineConfig(engine_loop="process",
                     kv_transfer={"connector": "ray_object_store"})
    # auto: the engine process wherever it can run, the thread where Ray must be inside.
    assert EngineConfig().uses_engine_process
    assert EngineConfig(kv_transfer={"connector": "torch_p2p"}).uses_engine_process
    assert not EngineConfig(parallel=ParallelConfig(pipeline_parallel_size=2)
                            ).uses_engine_process
    assert not EngineConfig(kv_transfer={"connector": "ray_object_store"}).uses_engine_process
    assert not EngineConfig(engine_loop="thread").uses_engine_process
