"""Streaming-input sessions in the scheduler: a finished turn keeps its blocks for the next."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.scheduler.utils import VOCAB, FakeRunner, run_until_done
from tokenflow.config import CacheConfig, SchedulerConfig
from tokenflow.scheduler import PauseState, Request, RequestStatus, SamplingParams, Scheduler
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


def test_a_reused_request_id_does_not_touch_a_parked_session():
    scheduler, runner, _ = make_scheduler()
    run_turn(scheduler, runner, turn("a", list(range(1, 30))))
    held = scheduler.kv.num_blocks - scheduler.kv.num_free_blocks
    _, computed, cached = run_turn(scheduler, runner, turn("a", list(range(50, 60)), None))
    assert cached == 0 and computed == 10
    assert scheduler.kv.num_blocks - scheduler.kv.num_free_blocks == held
    _, _, cached = run_turn(scheduler, runner, turn("b", list(range(1, 30)) + [1]))
    assert cached > 20
    scheduler.kv.check_integrity()


def test_idle_sessions_are_no_work_for_a_drain_and_a_follow_up_runs_in_it():
    scheduler, runner, _ = make_scheduler()
    tokens, _, _ = run_turn(scheduler, runner, turn("a", list(range(1, 30))))
    scheduler.pause(PauseState.PAUSED_NEW)
    assert not scheduler.has_work() and not scheduler.has_unfinished_requests()
    scheduler.add_request(turn("fresh", [1, 2, 3], None))
    follow = turn("b", list(range(1, 30)) + tokens + [4])
    scheduler.add_request(follow)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["b"], "the session was admitted before"
    scheduler.update_from_output(out, runner.execute_model(out))
    scheduler.resume()
    run_until_done(scheduler, runner)
    assert scheduler.requests == {}


# ------------------------------------------------------------------------------ hypothesis
class KVCheckingRunner(FakeRunner):
    """A fake runner that also remembers which token's KV each block slot holds, and checks
    that every scheduled request finds its own tokens' KV in front of what it computes: a
    block handed over, shared or cut short with the wrong content fails here."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def execute_model(self, out):
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        result = super().execute_model(out)  # applies the deltas first
        bs = self.block_size
        for req_id, start in starts.items():  # the step writes, then attention reads
            state = self.requests[req_id]
            for pos in range(start, start + out.num_scheduled_tokens[req_id]):
                self.slots[state.block_ids[pos // bs], pos % bs] = state.token_ids[pos]
        for req_id, start in starts.items():
            state = self.requests[req_id]
            for pos in range(start):
                held = self.slots.get((state.block_ids[pos // bs], pos % bs))
                assert held == state.token_ids[pos], f"{req_id} reads wrong KV at {pos}"
        return result


class SessionMachine(RuleBasedStateMachine):
    """Random interleavings of session turns (extending, diverging, closing), plain requests,
    aborts, steps and expiry, against a small KV cache."""

    @initialize(budget=st.integers(4, 64), limit=st.integers(1, 4),
                num_blocks=st.integers(8, 40), block_size=st.sampled_from([2, 4, 8]),
                caching=st.booleans())
    def setup(self, budget, limit, num_blocks, block_size, caching):
        config = SchedulerConfig(max_num_seqs=limit, max_num_batched_tokens=budget,
                                 session_idle_timeout_s=5.0)
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
        # The engine's context limit never exceeds what the whole cache holds.
        self.scheduler = Scheduler(config, cache, num_blocks, min(256, num_blocks * block_size))
        self.clock = Clock()
        self.scheduler.sessions.clock = self.clock
        self.runner = KVCheckingRunner(block_size)
        self.limit = limit
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.last_turn: dict[str, str] = {}
        self.counter = 0

    @rule(session=st.sampled_from(["A", "B", None]),
          extension=st.lists(st.integers(0, 20), min_size=1, max_size=12),
          cut=st.sampled_from([None, None, 0.5]), close=st.sampled_from([False, False, True]),
          max_tokens=st.integers(1, 8))
    def add(self, session, extension, cut, close, max_tokens):
        last = self.last_turn.get(session)
        base = self.prompts[last] + self.tokens.get(last, []) if last else []
        if cut is not None:
            base = base[:int(len(base) * cut)]
        req_id = f"r{self.counter}"
        self.counter += 1
        self.prompts[req_id] = (base + extension)[-200:]
        if session is not None:
            self.last_turn[session] = req_id
        self.scheduler.add_request(turn(req_id, self.prompts[req_id], session, max_tokens,
                                        close and session is not None))

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    @rule()
    def step(self):
        out = self.scheduler.schedule()
        for o in self.scheduler.update_from_output(out, self.runner.execute_model(out)).outputs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

    @rule(seconds=st.sampled_from([1.0, 6.0]))
    def wait(self, seconds):
        self.clock.now += seconds

    @invariant()
    def consistent(self):
        if not hasattr(self, "scheduler"):
            return
        self.scheduler.kv.check_integrity()
        assert len(self.scheduler.running) + len(self.scheduler.sessions) <= self.limit

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        # Idle sessions hold their slots until they expire: time goes on while it drains.
        run_until_done(self.scheduler, self.runner, max_steps=5000,
                       on_step=lambda _s, _out: setattr(self.clock, "now", self.clock.now + 1))
        self.clock.now += 10
        self.scheduler.schedule()
        assert len(self.scheduler.sessions) == 0
        assert self.scheduler.kv.num_free_blocks == self.scheduler.kv.num_blocks


SessionMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSessionMachine = SessionMachine.TestCase


def test_a_running_request_takes_the_blocks_a_waiting_turn_took_over() -> None:
    """Hypothesis's case: turn r2 of a session runs while the next turn r3 waits behind it
    holding the 4 blocks it took over from the session; r2 needs a fifth of the 8, and
    preempted itself for it again and again while r3 kept its blocks. Now a waiting turn's
    blocks give way before a running request is preempted."""
    machine = SessionMachine()
    machine.setup(budget=4, limit=2, num_blocks=8, block_size=2, caching=False)
    machine.add(session="A", extension=[0], cut=None, close=False, max_tokens=1)
    machine.add(session="A", extension=[0] * 7, cut=None, close=False, max_tokens=1)
    machine.step()
    machine.step()
    machine.add(session="A", extension=[0], cut=None, close=False, max_tokens=1)
    machine.step()
    machine.add(session="A", extension=[0], cut=None, close=False, max_tokens=1)
    assert machine.scheduler.kv.num_blocks_held("r3") == 4  # r3 waits with the session's KV
    machine.teardown()  # every request finishes; nothing is held after


def test_the_first_in_line_takes_the_blocks_a_waiting_turn_behind_it_holds() -> None:
    """Hypothesis's case: turn r3, first in line with the session's 8 blocks, needs a ninth of
    12, and turn r2 behind it holds the other 4: neither could start. Now r2's give way."""
    machine = SessionMachine()
    machine.setup(budget=6, limit=2, num_blocks=12, block_size=2, caching=False)
    machine.add(session="A", extension=[0] * 7, cut=None, close=False, max_tokens=1)
    machine.step()
    machine.add(session="A", extension=[0] * 7, cut=None, close=False, max_tokens=2)
    for _ in range(3):
        machine.step()
    machine.add(session="A", extension=[0], cut=None, close=False, max_tokens=1)
    machine.step()
    machine.add(session="A", extension=[0], cut=None, close=False, max_tokens=1)
    assert machine.scheduler.kv.num_blocks_held("r2") == 4
    assert machine.scheduler.kv.num_blocks_held("r3") == 8
    machine.teardown()
