"""`PrefillClient` on a scripted prefill deployment: a failed prefill is computed on the decode
side, and so are the prefills of the next `FALLBACK_S` seconds, without asking (a dead prefill
replica would hold each of them until Serve has replaced it); then one asks again, with a short
deadline, and a success ends the fallback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenflow.cluster import pd
from tokenflow.cluster.messages import Accepted, Finished, SeqDelta
from tokenflow.cluster.pd import PrefillClient
from tokenflow.scheduler import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


class _Stream:
    def __init__(self, events: list[Any] | BaseException | None) -> None:
        self.events = events

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        if isinstance(self.events, BaseException):
            raise self.events
        if self.events is None:  # no replica to route to: Serve waits
            await asyncio.sleep(3600)
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self) -> None:
        pass


class _Deployment:
    """A prefill deployment whose calls play the scripts given, in order."""

    def __init__(self, *scripts: list[Any] | BaseException | None) -> None:
        self.scripts, self.calls = list(scripts), 0

    def options(self, stream: bool) -> _Deployment:
        return self

    @property
    def generate(self) -> _Deployment:
        return self

    def remote(self, *args: Any) -> _Stream:
        self.calls += 1
        return _Stream(self.scripts.pop(0))


def _ok() -> list[Any]:
    return [Accepted("p", [3]), [SeqDelta(0, "a", [7], finish_reason="length")],
            Finished(3, 1, 0, {"remote": "kv"})]


def test_after_a_failed_prefill_the_next_ones_are_computed_here_then_one_asks_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(pd, "PROBE_TIMEOUT_S", 0.05)
    deployment = _Deployment(RuntimeError("the actor died"), None, _ok())
    client = PrefillClient(deployment, clock=lambda: clock[0])

    async def prefill() -> Any:
        return await client.prefill([1, 2, 3], PARAMS, "r", 0)

    assert asyncio.run(prefill()) is None and deployment.calls == 1
    clock[0] += pd.FALLBACK_S / 2
    assert asyncio.run(prefill()) is None and deployment.calls == 1  # not asked
    clock[0] += pd.FALLBACK_S
    # The first to ask again waits PROBE_TIMEOUT_S, not PREFILL_TIMEOUT_S, for no replica.
    assert asyncio.run(prefill()) is None and deployment.calls == 2
    clock[0] += pd.FALLBACK_S + 1
    prefilled = asyncio.run(prefill())
    assert prefilled is not None and prefilled.kv_transfer_params == {"remote": "kv"}
    assert client.num_fallbacks == 3
