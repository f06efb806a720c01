"""Streaming-input sessions through the engine, on the tiny model: a multi-turn conversation
reuses its KV and gives the tokens of fresh requests; idle sessions expire in the loop."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.replica.engine_state import kv_blocks
from tokenflow.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow.replica.engine.async_engine import AsyncEngine
from tokenflow.replica.engine.engine import Engine
from tokenflow.scheduler import SamplingParams

GREEDY = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)


def config(prefix_caching: bool = True, timeout_s: float = 60.0) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(num_blocks=96, block_size=16, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, session_idle_timeout_s=timeout_s))


def run(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams
        ) -> tuple[list[int], int, str]:
    """One request to its end: (tokens, cached prompt tokens, finish reason)."""
    engine.add_request(request_id, prompt, params)
    tokens, cached, finish = [], 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            cached = out.num_cached_tokens
            finish = out.outputs[0].finish_reason or finish
    return tokens, cached, finish


@pytest.fixture(scope="module")
def engines():
    with_sessions, fresh = Engine(config()), Engine(config(prefix_caching=False))
    yield with_sessions, fresh
    with_sessions.shutdown()
    fresh.shutdown()


def test_five_turns_reuse_the_prefix_and_match_fresh_requests(engines):
    engine, fresh = engines
    session = dataclasses.replace(GREEDY, session_id="chat")
    prompt, held = [], 0
    for k in range(5):
        prompt = prompt + [(11 * k + 5 * i) % 500 + 3 for i in range(9 + 4 * k)]
        tokens, cached, finish = run(engine, f"turn{k}", prompt, session)
        assert finish == "length" and len(tokens) == 7
        # The KV of everything before this turn's new tokens was kept: only they are computed
        # (and the last token of the previous turn, which was sampled but never computed).
        assert cached == held, f"turn {k}"
        assert tokens == run(fresh, f"fresh{k}", prompt, GREEDY)[0], f"turn {k}"
        prompt = prompt + tokens
        held = len(prompt) - 1
    free, total = kv_blocks(engine)
    assert free < total  # the session holds its blocks
    run(engine, "bye", prompt + [9], dataclasses.replace(session, session_close=True))
    assert kv_blocks(engine) == (total, total)


async def test_idle_session_expires_in_the_engine_loop():
    engine = AsyncEngine(config(timeout_s=0.3))
    try:
        params = dataclasses.replace(GREEDY, session_id="s")
        async for _ in engine.generate(list(range(3, 40)), params):
            pass
        free, total = kv_blocks(engine)
        assert free < total
        for _ in range(200):  # the loop wakes at least once a second, idle or not
            if kv_blocks(engine) == (total, total):
                break
            await asyncio.sleep(0.05)
        assert kv_blocks(engine) == (total, total)
    finally:
        engine.shutdown()


async def test_a_request_waiting_for_a_slot_idle_sessions_hold_does_not_spin_the_loop():
    engine = AsyncEngine(EngineConfig(
        cache=CacheConfig(num_blocks=96, block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=1, session_idle_timeout_s=30),
        engine_loop="thread"))  # its clock and step are patched here
    now = [0.0]
    scheduler = engine.engine.scheduler
    scheduler.sessions.clock = lambda: now[0]
    steps = [0]
    step = engine.engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.engine.step = counted
    try:
        params = dataclasses.replace(GREEDY, session_id="s")
        async for _ in engine.generate(list(range(3, 40)), params):
            pass
        waiting = asyncio.create_task(_tokens(engine, list(range(50, 60))))
        for _ in range(10):
            await asyncio.sleep(0.05)
        before = steps[0]
        await asyncio.sleep(0.5)
        assert steps[0] - before <= 1 and not waiting.done()  # it sleeps, not spins
        now[0] += 31  # the session expires; the loop notices within its 1 s poll
        assert len(await asyncio.wait_for(waiting, 30)) == 7
    finally:
        engine.shutdown()


async def _tokens(engine: AsyncEngine, prompt: list[int]) -> list[int]:
    tokens = []
    async for out in engine.generate(prompt, GREEDY):
        tokens += out.outputs[0].token_ids
    return tokens
