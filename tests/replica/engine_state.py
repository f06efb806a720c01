"""What tests read of an engine's state, for an `Engine` (its `state()` now) or an
`AsyncEngine` (the state its step loop last reported)."""

from __future__ import annotations

from tokenflow.replica.engine.async_engine import AsyncEngine
from tokenflow.replica.engine.engine import Engine, EngineState


def state_of(engine: Engine | AsyncEngine) -> EngineState:
    return engine.state if isinstance(engine, AsyncEngine) else engine.state()


def kv_blocks(engine: Engine | AsyncEngine) -> tuple[int, int]:
    """(free, total) KV blocks."""
    state = state_of(engine)
    return state.num_free_blocks, state.num_blocks


def request_counts(engine: Engine | AsyncEngine) -> tuple[int, int]:
    """(running, waiting) requests."""
    state = state_of(engine)
    return state.num_running, state.num_waiting
