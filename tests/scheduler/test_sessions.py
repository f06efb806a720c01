"""Streaming-input sessions in the scheduler: a finished turn keeps its blocks for the next."""

from __future__ import annotations

import pytest

from tests.scheduler.utils import VOCAB, FakeRunner, run_until_done
from tokenflow.config import CacheConfig, SchedulerConfig
from tokenflow.scheduler import Request, RequestStatus, SamplingParams, Scheduler
from tokenflow.scheduler.sessions import common_prefix_len

BLOCK = 4


class Clock:
    """A clock the test moves by hand: expiry without sleeping."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks: int = 1000, max_num_active_seqs: int | None = None,
                   max_num_seqs: int = 8, timeout_s: float = 10.0
                   ) -> tuple[Scheduler, FakeRunner, Clock]:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_active_seqs=max_num_active_seqs,
                             max_num_batched_tokens=512, session_idle_timeout_s=timeout_s)
    scheduler = Scheduler(config, CacheConfig(block_size=BLOCK), num_blocks, 1024)
    clock = Clock()
    scheduler.sessions.clock = clock
    return scheduler, FakeRunner(), clock


def turn(req_id: str, prompt: list[int], session: str | None = "s", max_tokens: int = 5,
         close: bool = False, **kwargs) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, session_id=session,
                            session_close=close, **kwargs)
    return Request(req_id, prompt, params)


def run_turn(scheduler: Scheduler, runner: FakeRunner, request: Request
             ) -> tuple[list[int], int, int]:
    """Run one request to its end: (its output tokens, prompt tokens it computed, its
    reported cached tokens)."""
    scheduler.add_request(request)
    computed = 0

    def count(_scheduler, out) -> None:
        nonlocal computed
        n = out.num_scheduled_tokens.get(request.request_id, 0)
        computed += n
        scheduler.kv.check_integrity()

    result = run_until_done(scheduler, runner, on_step=count)[request.request_id]
    assert result["finish_reason"] == "length"
    # Every step but the last one's sampled token is a token computed once.
    return result["tokens"], computed - (len(result["tokens"]) - 1), request.num_cached_tokens


def conversation(scheduler, runner, session, num_turns=5, seed=1):
    """num_turns turns, each prompt = the previous prompt + its output + 3..9 new tokens."""
    prompt, turns = [], []
    for k in range(num_turns):
        prompt = prompt + [(seed * 31 + k * 7 + i) % VOCAB for i in range(3 + 2 * k)]
        tokens, computed, cached = run_turn(scheduler, runner, turn(f"t{k}", prompt, session))
        turns.append((list(prompt), tokens, computed, cached))
        prompt = prompt + tokens
    return turns


def test_five_turns_compute_each_prefix_once():
    scheduler, runner, _ = make_scheduler()
    turns = conversation(scheduler, runner, "s")
    held = 0  # tokens whose KV the session holds after the previous turn
    for k, (prompt, tokens, computed, cached) in enumerate(turns):
        assert cached == held, f"turn {k}"
        assert computed == len(prompt) - held, f"turn {k}: recomputed part of its prefix"
        held = len(prompt) + len(tokens) - 1  # all but the last sampled token have KV
    # The same tokens as fresh requests (the fake runner's token is f(id, position)).
    fresh, runner2, _ = make_scheduler()
    for k, (prompt, tokens, _, _) in enumerate(turns):
        assert run_turn(fresh, runner2, turn(f"t{k}", prompt, None))[0] == tokens
    # The last turn is parked, holding its blocks, and a closing turn frees them.
    assert "s" in scheduler.sessions and scheduler.kv.num_free_blocks < scheduler.kv.num_blocks
    prompt, tokens = turns[-1][0], turns[-1][1]
    run_turn(scheduler, runner, turn("close", prompt + tokens + [1, 2], close=True))
    assert len(scheduler.sessions) == 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_idle_session_expires_and_frees_its_blocks():
    scheduler, runner, clock = make_scheduler(timeout_s=30)
    conversation(scheduler, runner, "s", num_turns=2)
    assert scheduler.kv.num_free_blocks < scheduler.kv.num_blocks
    clock.now += 29
    assert not scheduler.has_unfinished_requests()
    scheduler.schedule()
    assert "s" in scheduler.sessions
    clock.now += 2
    assert scheduler.has_unfinished_requests() and scheduler.has_work()  # a step frees it
    scheduler.schedule()
    assert len(scheduler.sessions) == 0 and not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    scheduler.kv.check_integrity()
    # A follow-up after expiry runs as a fresh request (and opens the session again).
    _, _, cached = run_turn(scheduler, runner, turn("late", list(range(1, 30))))
    assert cached == 0 and "s" in scheduler.sessions


def test_sessions_count_against_max_num_active_seqs():
    scheduler, runner, clock = make_scheduler(max_num_active_seqs=2)
    run_turn(scheduler, runner, turn("a", [1, 2, 3, 4, 5], "A"))
    run_turn(scheduler, runner, turn("b", [6, 7, 8, 9, 10], "B"))
    scheduler.add_request(turn("c", [11, 12, 13], None))
    out = scheduler.schedule()
    assert not out.num_scheduled_tokens, "two idle sessions hold both slots"
    # A follow-up takes its own session's slot back, ahead of the waiting request.
    follow = turn("a2", [1, 2, 3, 4, 5] + [0] * 3, "A")
    scheduler.add_request(follow)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["a2"]
    scheduler.update_from_output(out, runner.execute_model(out))
    # Expiry frees the slots.
    clock.now += 11
    run_until_done(scheduler, runner)
    assert scheduler.requests == {}


def test_follow_up_that_does_not_extend_reuses_the_common_prefix():
    scheduler, runner, _ = make_scheduler()
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks and a partial one
    tokens, _, _ = run_turn(scheduler, runner, turn("a", prompt))
    # Edits the conversation at token 21 (inside block 5, which is full and cached): the
    # held KV is kept up to the start of that block, never written over.
    edited = prompt[:21] + [7, 7, 7]
    _, computed, cached = run_turn(scheduler, runner, turn("b", edited))
    assert cached == 20 and computed == len(edited) - 20
    # Shares nothing: a fresh request (its own blocks), and the old ones are freed.
    _, computed, cached = run_turn(scheduler, runner, turn("c", [999, 998, 997]))
    assert cached == 0 and computed == 3
    scheduler.sessions.close("s")
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    scheduler.kv.check_integrity()


def test_partial_block_is_continued_in_place():
    scheduler, runner, _ = make_scheduler()
    prompt = list(range(1, 11))  # 10 tokens + 5 outputs: KV for 14, block 3 partly filled
    tokens, _, _ = run_turn(scheduler, runner, turn("a", prompt))
    _, computed, cached = run_turn(scheduler, runner, turn("b", prompt + tokens + [5]))
    assert cached == 14 and computed == 2


def test_aborted_turn_ends_its_session_and_busy_session_runs_apart():
    scheduler, runner, _ = make_scheduler()
    run_turn(scheduler, runner, turn("a", list(range(1, 20))))
    follow = turn("b", list(range(1, 25)))
    scheduler.add_request(follow)
    assert follow.num_computed_tokens > 0 and len(scheduler.sessions) == 0
    # A second request for the session while its turn runs: a fresh request of its own.
    other = turn("c", list(range(1, 25)))
    scheduler.add_request(other)
    assert other.num_computed_tokens == 0
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    run_until_done(scheduler, runner)
    assert "s" in scheduler.sessions  # c finished normally: now it is the session
    scheduler.sessions.close("s")
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_idle_sessions_give_way_to_requests_that_need_blocks():
    scheduler, runner, _ = make_scheduler(num_blocks=12)
    run_turn(scheduler, runner, turn("a", list(range(1, 30))))  # holds 9 of 12 blocks
    tokens, _, _ = run_turn(scheduler, runner, turn("big", list(range(200, 240)), None))
    assert len(tokens) == 5 and len(scheduler.sessions) == 0
    scheduler.kv.check_integrity()


def test_prompt_logprobs_follow_up_computes_everything():
    scheduler, runner, _ = make_scheduler()
    tokens, _, _ = run_turn(scheduler, runner, turn("a", list(range(1, 20))))
    follow = turn("b", list(range(1, 20)) + tokens + [3], prompt_logprobs=1)
    scheduler.add_request(follow)
    assert follow.num_computed_tokens == 0 and len(scheduler.sessions) == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"session_id": ""}, "session_id"),
    ({"session_id": "x" * 257}, "session_id"),
    ({"session_id": "s", "n": 2}, "n=1"),
    ({"session_close": True}, "session_close needs"),
])
def test_session_params_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert common_prefix_len([1, 2, 3], [1, 5, 3], 10) == 1
    assert common_prefix_len([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix_len([], [1], 5) == 0
