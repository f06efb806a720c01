"""`ResumingStream` on scripted replica streams: a stream whose replica dies goes on from the
prompt plus what was sent, and the caller sees one stream; what cannot resume fails as before.
The real thing (a replica process killed under 16 streams) is in test_serving_modes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenflow.cluster.messages import Accepted, Finished, Rejected, SeqDelta
from tokenflow.cluster.resume import MAX_RESUMES, ResumingStream, resumable
from tokenflow.scheduler import SamplingParams


class Gone(Exception):
    """Stands for Ray's "the actor died"."""


class Refused(Exception):
    """What the stream raises for a request that cannot go on (the ingress's 503)."""


class Replicas:
    """Scripted replicas: each opened stream plays the next script; `None` in a script is
    the replica dying there. Records what each stream was opened with."""

    def __init__(self, *scripts: list[Any]) -> None:
        self.scripts = list(scripts)
        self.opened: list[tuple[list[list[int]], SamplingParams, str, Any]] = []

    def open(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
             transfer: dict[str, Any] | None) -> Any:
        self.opened.append((prompts, params, request_id, transfer))
        return _Scripted(self.scripts.pop(0))


class _Scripted:
    def __init__(self, events: list[Any]) -> None:
        self.events, self.cancelled = list(events), False

    async def __anext__(self) -> Any:
        if not self.events:
            raise StopAsyncIteration
        event = self.events.pop(0)
        if event is None:
            raise Gone()
        return event

    def cancel(self) -> None:
        self.cancelled = True


def _delta(*tokens: int, finish: str | None = None) -> list[SeqDelta]:
    return [SeqDelta(0, "".join(f"<{t}>" for t in tokens), list(tokens), finish_reason=finish)]


def _stream(replicas: Replicas, params: SamplingParams, prompts: list[list[int]] | None = None
            ) -> ResumingStream:
    return ResumingStream(replicas.open, prompts or [[1, 2, 3]], params, "req", (Gone,),
                          lambda exc: Refused(str(exc)))


async def _drain(stream: ResumingStream) -> list[Any]:
    return [event async for event in stream]


GREEDY = SamplingParams(temperature=0, max_tokens=6, min_tokens=4, seed=7)


def test_a_stream_whose_replica_dies_goes_on_where_it_stopped() -> None:
    replicas = Replicas(
        [Accepted("req", [3]), _delta(10, 11), _delta(12), None],
        [Accepted("req-r1", [6]), _delta(13, 14), _delta(15, finish="length"),
         Finished(6, 3, 5)])
    events = asyncio.run(_drain(_stream(replicas, GREEDY)))
    assert events[0] == Accepted("req", [3])  # one Accepted: the continuation's is swallowed
    tokens = [t for e in events if isinstance(e, list) for d in e for t in d.token_ids]
    assert tokens == [10, 11, 12, 13, 14, 15]
    assert events[-1] == Finished(3, 6, 3)  # the original prompt, every generated token
    # The same request again, arriving with the outputs already sent (and marked sent).
    prompts, params, request_id, transfer = replicas.opened[1]
    assert prompts == [[1, 2, 3]] and params == GREEDY and request_id == "req-r1"
    assert transfer == {"first_token_ids": [10, 11, 12], "first_token_sent": True}
    assert replicas.opened[0][3] is None


def test_a_continuation_is_retried_until_a_live_replica_takes_it() -> None:
    replicas = Replicas([Accepted("req", [3]), _delta(10), None],
                        [None],  # Serve still routed it to the dead replica
                        [Accepted("req-r1", [4]), None],  # that one dies too
                        [Accepted("req-r2", [4]), _delta(11, finish="stop"), Finished(4, 1, 0)])
    events = asyncio.run(_drain(_stream(replicas, GREEDY)))
    assert [t for e in events if isinstance(e, list) for d in e for t in d.token_ids] == [10, 11]
    assert [r for _, _, r, _ in replicas.opened] == ["req", "req-r1", "req-r1", "req-r2"]
    assert replicas.opened[-1][3]["first_token_ids"] == [10]  # nothing came from req-r1


def test_what_cannot_resume_fails_as_before() -> None:
    # n > 1, several prompts, structured output: not resumable.
    assert not resumable([[1]], SamplingParams(n=2))
    assert not resumable([[1], [2]], GREEDY)
    with pytest.raises(Refused):
        asyncio.run(_drain(_stream(Replicas([Accepted("req", [1, 1]), _delta(5), None]),
                                   GREEDY, prompts=[[1], [2]])))
    # Each resume may lose its replica again, but not forever.
    scripts = [[Accepted("req", [3]), _delta(10), None]]
    scripts += [[Accepted(f"req-r{i}", [4]), _delta(11 + i), None] for i in range(MAX_RESUMES)]
    with pytest.raises(Refused):
        asyncio.run(_drain(_stream(Replicas(*scripts), GREEDY)))
    # A refused continuation (its replica's engine died) is the request's failure.
    with pytest.raises(Refused):
        asyncio.run(_drain(_stream(Replicas([Accepted("req", [3]), _delta(10), None],
                                            [Rejected("engine dead", status_code=503)]),
                                   GREEDY)))


def test_a_request_whose_replica_dies_before_accepting_it_starts_over_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing reached the client: any request (n > 1 too) is sent again, as it was."""
    two = SamplingParams(n=2, max_tokens=1)
    replicas = Replicas([None], [None],  # the second: Serve still routed it to the dead one
                        [Accepted("req-r1", [3]), [SeqDelta(0, "a", [7], finish_reason="length"),
                                                   SeqDelta(1, "b", [8], finish_reason="length")],
                         Finished(3, 2, 0)])
    events = asyncio.run(_drain(_stream(replicas, two)))
    assert events[0] == Accepted("req-r1", [3]) and events[-1] == Finished(3, 2, 0)
    assert [transfer for *_, transfer in replicas.opened] == [None, None, None]
    # A refusal from the new replica is the caller's answer, as from the first.
    events = asyncio.run(_drain(_stream(Replicas([None], [Rejected("too long")]), GREEDY)))
    assert events == [Rejected("too long")]
    # Not forever: until the deadline, then the 503.
    monkeypatch.setattr("tokenflow.cluster.resume.RESUME_DEADLINE_S", 0.0)
    with pytest.raises(Refused):
        asyncio.run(_drain(_stream(Replicas([None], [None]), GREEDY)))


def test_a_replica_that_dies_after_the_last_token_still_gives_usage() -> None:
    replicas = Replicas([Accepted("req", [3]), _delta(10, finish="stop"), None])
    events = asyncio.run(_drain(_stream(replicas, GREEDY)))
    assert events[-1] == Finished(3, 1, 0) and len(replicas.opened) == 1


def test_an_engine_given_the_sent_tokens_goes_on_with_the_same_tokens_and_text() -> None:
    """The replica's side of a resume, in process: the request again, arriving with the first
    k tokens of an uninterrupted run as sent outputs, streams exactly the rest of that run:
    the same tokens, and the text the first k tokens' deltas had not yet carried (bytes of a
    character split at the seam included)."""
    from tests.cluster.conftest import ENGINE_ARGS
    from tokenflow.cluster.server import LLMServer

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = [[7, 99, 23, 5]]

    async def run() -> tuple[list[list[SeqDelta]], dict[int, list[list[SeqDelta]]]]:
        server = LLMServer(ENGINE_ARGS)
        try:
            async def deltas(request_id: str, transfer: Any = None) -> list[list[SeqDelta]]:
                events = [e async for e in server.generate(prompt, params, request_id,
                                                           kv_transfer_params=transfer)]
                return [e for e in events if isinstance(e, list)]

            whole = await deltas("whole")
            flat = [d for batch in whole for d in batch]
            sent = [t for d in flat for t in d.token_ids]
            # Cut where the text so far lacks bytes of a split character (its delta carried
            # no text), and at two plain places.
            split = [k for k in range(1, 40) if flat[k - 1].text == ""][:3]
            assert split, "this prompt's output splits no character: pick another"
            cuts = {k: await deltas(f"cut{k}", {"first_token_ids": sent[:k],
                                                 "first_token_sent": True})
                    for k in [*split, 1, 33]}
            return whole, cuts
        finally:
            server.engine.shutdown()

    whole, cuts = asyncio.run(run())
    tokens = [t for batch in whole for d in batch for t in d.token_ids]
    text = "".join(d.text for batch in whole for d in batch)
    assert len(tokens) == 40
    for k, rest in cuts.items():
        # What the client had after k tokens: the deltas up to the k-th token.
        had_tokens, had_text = [], ""
        for batch in whole:
            for d in batch:
                if len(had_tokens) + len(d.token_ids) > k:
                    break
                had_tokens += d.token_ids
                had_text += d.text
        assert len(had_tokens) == k  # one token per delta without coalescing
        rest_tokens = [t for batch in rest for d in batch for t in d.token_ids]
        assert had_tokens + rest_tokens == tokens, k
        assert had_text + "".join(d.text for batch in rest for d in batch) == text, k
