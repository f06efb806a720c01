"""Scenario tests of the token-budget scheduler, through factories and the fake runner."""

from __future__ import annotations

import pickle
import random
import warnings

import pytest

from tests.scheduler import utils
from tests.scheduler.utils import (
    FakeRunner,
    create_requests,
    create_scheduler,
    fake_token,
    run_until_done,
)
from tokenflow.config import CacheConfig, SchedulerConfig
from tokenflow.scheduler import (
    ModelRunnerOutput,
    PauseState,
    RepetitionDetectionParams,
    Request,
    RequestStatus,
    Scheduler,
    build_scheduler,
    create_request_queue,
)
from tokenflow.scheduler import scheduler as scheduler_module
from tokenflow.scheduler.stop import ends_in_repetition


def pytest_generate_tests(metafunc) -> None:
    # Every scenario runs against both schedulers, except those marked sync_only (they are
    # not generated for the AsyncScheduler, rather than skipped).
    kinds = [False] if metafunc.definition.get_closest_marker("sync_only") else [False, True]
    metafunc.parametrize("scheduler_kind", kinds, ids=["sync", "async"][:len(kinds)],
                         indirect=True)


@pytest.fixture(autouse=True)
def scheduler_kind(request, monkeypatch):
    """Which scheduler a scenario runs against: `create_scheduler` builds an AsyncScheduler in
    the async run, and `run_until_done` then keeps two steps in flight. (`step` below applies
    each step's results before the next is scheduled: there the AsyncScheduler must behave
    exactly as the synchronous one.)"""
    monkeypatch.setattr(utils, "ASYNC", request.param)
    return request.param


def step(scheduler, runner):
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, runner.execute_model(out))
    return out, outputs


def assert_no_leaks(scheduler):
    scheduler.kv.check_integrity()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting


# ------------------------------------------------------------------------------ budget
def test_budget_split_among_long_prompts_with_threshold():
    scheduler = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for r in create_requests(3, 1000):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"req0": 400, "req1": 400, "req2": 224}
    assert out.total_num_scheduled_tokens == 1024
    scheduler.update_from_output(out, FakeRunner().execute_model(out))
    out = scheduler.schedule()
    # Running requests continue in order, each capped again by the threshold.
    assert out.num_scheduled_tokens == {"req0": 400, "req1": 400, "req2": 224}


def test_zero_token_request_is_skipped_not_a_stop():
    scheduler = create_scheduler(max_num_batched_tokens=100, max_model_len=40,
                                 num_blocks=100)
    a, b = create_requests(2, 20, max_tokens=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    runner = FakeRunner()
    step(scheduler, runner)
    # Force `a` to have nothing to compute this step: pretend all its tokens are computed.
    a.num_computed_tokens = a.num_tokens
    out = scheduler.schedule()
    assert "req0" not in out.num_scheduled_tokens
    assert out.num_scheduled_tokens == {"req1": 1}


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_on_and_off(chunked):
    scheduler = create_scheduler(max_num_batched_tokens=1000, enable_chunked_prefill=chunked)
    for r in create_requests(3, [600, 600, 100]):
        scheduler.add_request(r)
    out = scheduler.schedule()
    if chunked:
        assert out.num_scheduled_tokens == {"req0": 600, "req1": 400}
    else:
        # req1 does not fit the budget left: admission stops, req2 may not jump the queue.
        assert out.num_scheduled_tokens == {"req0": 600}
    scheduler.update_from_output(out, FakeRunner().execute_model(out))
    out = scheduler.schedule()
    if chunked:
        assert out.num_scheduled_tokens == {"req0": 1, "req1": 200, "req2": 100}
    else:
        assert out.num_scheduled_tokens == {"req0": 1, "req1": 600, "req2": 100}


def test_max_num_seqs_limits_running():
    scheduler = create_scheduler(max_num_seqs=2)
    for r in create_requests(4, 8):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"req0", "req1"}
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2


# ------------------------------------------------------------------------ stop checks
def test_eos_stops_and_is_kept():
    (r,) = create_requests(1, 5, max_tokens=50)
    r.eos_token_id = fake_token("req0", 5 + 3)  # the 4th output token
    scheduler = create_scheduler()
    scheduler.add_request(r)
    res = run_until_done(scheduler)["req0"]
    assert res["finish_reason"] == "stop"
    assert len(res["tokens"]) == 4 and res["tokens"][-1] == r.eos_token_id
    assert_no_leaks(scheduler)


def test_ignore_eos_and_max_tokens():
    (r,) = create_requests(1, 5, max_tokens=7, ignore_eos=True)
    r.eos_token_id = fake_token("req0", 5)
    scheduler = create_scheduler()
    scheduler.add_request(r)
    res = run_until_done(scheduler)["req0"]
    assert res["finish_reason"] == "length" and len(res["tokens"]) == 7


def test_stop_token_ids_sets_stop_reason():
    stop = fake_token("req0", 5 + 2)
    (r,) = create_requests(1, 5, max_tokens=50, stop_token_ids=[stop])
    scheduler = create_scheduler()
    scheduler.add_request(r)
    res = run_until_done(scheduler)["req0"]
    assert res["finish_reason"] == "stop" and res["stop_reason"] == stop
    assert len(res["tokens"]) == 3


def test_min_tokens_blocks_every_stop_before_it():
    eos = fake_token("req0", 5)  # first output token would be EOS
    (r,) = create_requests(1, 5, max_tokens=10, min_tokens=10, eos_token_id=eos,
                           stop_token_ids=[eos])
    scheduler = create_scheduler()
    scheduler.add_request(r)
    res = run_until_done(scheduler)["req0"]
    assert res["finish_reason"] == "length" and len(res["tokens"]) == 10


def test_max_model_len_caps_length():
    (r,) = create_requests(1, 30, max_tokens=100)
    scheduler = create_scheduler(max_model_len=40)
    scheduler.add_request(r)
    res = run_until_done(scheduler)["req0"]
    assert res["finish_reason"] == "length" and len(res["tokens"]) == 10


@pytest.mark.sync_only  # speculative decoding: synchronous only
def test_tokens_after_a_stop_are_trimmed():
    # Speculative decoding can produce several tokens in a step; a stop in the middle trims.
    scheduler = create_scheduler()
    stop = fake_token("req0", 5 + 2)
    (r,) = create_requests(1, 5, max_tokens=50, stop_token_ids=[stop])
    scheduler.add_request(r)
    runner = FakeRunner()
    step(scheduler, runner)  # prefill, samples position 5
    scheduler.update_draft_token_ids({"req0": [fake_token("req0", 6 + i) for i in range(4)]})
    out, outputs = step(scheduler, runner)
    assert out.scheduled_spec_decode_tokens["req0"]
    (o,) = outputs.outputs
    assert o.finish_reason == "stop"
    assert o.new_token_ids == [fake_token("req0", 6), stop]
    assert r.output_token_ids == [fake_token("req0", 5), fake_token("req0", 6), stop]
    assert_no_leaks(scheduler)


# ---------------------------------------------------------------- repetition detection
PROMPT_LEN = 5


def scripted(outputs_by_req: dict[str, list[int]]) -> FakeRunner:
    """A runner whose listed requests sample the given outputs, in order (then fake tokens)."""
    def sample(req_id: str, position: int) -> int:
        script = outputs_by_req.get(req_id, [])
        index = position - PROMPT_LEN
        return script[index] if index < len(script) else fake_token(req_id, position)
    return FakeRunner(sample)


def repeating(max_size: int, count: int, min_size: int = 1) -> RepetitionDetectionParams:
    return RepetitionDetectionParams(max_pattern_size=max_size, min_pattern_size=min_size,
                                     min_count=count)


def naive_ends_in_repetition(tokens: list[int], params: RepetitionDetectionParams) -> bool:
    """Whether `tokens` end in `min_count` copies of one pattern: the definition, spelled out,
    to check the scheduler's detector against."""
    for size in range(params.min_pattern_size, params.max_pattern_size + 1):
        length = size * params.min_count
        if len(tokens) >= length and tokens[-length:] == tokens[-size:] * params.min_count:
            return True
    return False


def naive_first_repetition(tokens: list[int], params: RepetitionDetectionParams) -> int | None:
    """The fewest outputs that end in a repetition; None if no prefix does."""
    return next((end for end in range(1, len(tokens) + 1)
                 if naive_ends_in_repetition(tokens[:end], params)), None)


def run_scripted(script: list[int], params: RepetitionDetectionParams | None,
                 max_tokens: int = 30, **sampling) -> tuple[Request, dict]:
    scheduler = create_scheduler()
    (r,) = create_requests(1, PROMPT_LEN, max_tokens=max_tokens, repetition_detection=params,
                           **sampling)
    scheduler.add_request(r)
    res = run_until_done(scheduler, scripted({"req0": script}))["req0"]
    assert_no_leaks(scheduler)
    return r, res


def test_repetition_stops_at_the_first_full_repeat():
    script = [10, 11, 12, 7, 8, 7, 8, 7, 8, 7, 8, 7, 8]
    r, res = run_scripted(script, repeating(max_size=3, count=3))
    assert r.status == RequestStatus.FINISHED_REPETITION
    assert (res["finish_reason"], res["stop_reason"]) == ("stop", "repetition")
    assert res["tokens"] == script[:9]  # the third "7 8" ends it, and is kept


@pytest.mark.parametrize(("script", "params", "expected"), [
    ([4, 4, 4, 4, 4, 4], repeating(max_size=1, count=4), 4),  # one token, four times
    ([1, 2, 3, 1, 2, 3, 1, 2, 3], repeating(max_size=2, count=2), None),  # pattern too long
    ([5, 5, 5, 5, 5, 5, 5, 5], repeating(max_size=4, count=2, min_size=3), 6),  # "5 5 5" twice
    ([1, 2, 1, 2, 1, 2], repeating(max_size=2, count=4), None),  # too few copies
])
def test_repetition_pattern_sizes_and_counts(script, params, expected):
    script = script + [900 + i for i in range(30)]  # then no repetition at all
    assert naive_first_repetition(script, params) == expected
    r, res = run_scripted(script, params)
    if expected is None:
        assert res["finish_reason"] == "length" and len(res["tokens"]) == 30
    else:
        assert r.status == RequestStatus.FINISHED_REPETITION
        assert res["tokens"] == script[:expected]


def test_repetition_counts_only_output_tokens():
    # The prompt ends in "7 8 7 8": two more copies in the output are only two, not four.
    scheduler = create_scheduler()
    (r,) = create_requests(1, PROMPT_LEN, max_tokens=30, repetition_detection=repeating(2, 3))
    r.prompt_token_ids[-4:] = r.all_token_ids[-4:] = [7, 8, 7, 8]
    scheduler.add_request(r)
    script = [7, 8, 7, 8, 7, 8, 1]
    res = run_until_done(scheduler, scripted({"req0": script}))["req0"]
    assert res["tokens"] == script[:6]


def test_min_tokens_holds_back_repetition():
    script = [3] * 12 + [900 + i for i in range(30)]
    r, res = run_scripted(script, repeating(max_size=1, count=3), min_tokens=8)
    assert r.status == RequestStatus.FINISHED_REPETITION
    assert res["tokens"] == script[:9]  # repeated since the 3rd token, but 8 must come first


def test_a_stop_token_wins_over_a_repetition_it_completes():
    script = [6, 6, 6, 6]
    r, res = run_scripted(script, repeating(max_size=1, count=3), stop_token_ids=[6],
                          min_tokens=2)
    assert (res["finish_reason"], res["stop_reason"]) == ("stop", 6)
    assert res["tokens"] == [6, 6, 6]


@pytest.mark.sync_only  # multi-token steps come from speculative decoding: synchronous only
def test_repetition_in_multi_token_steps_is_cut_at_the_earliest_point():
    # Accepted drafts bring several tokens a step: the repetition completes inside the third
    # step, spanning the second, and the tokens after it are trimmed as after a stop token.
    script = [1, 2, 3, 4, 3, 4, 3, 4, 9, 9]
    params = repeating(max_size=2, count=3, min_size=2)
    assert naive_first_repetition(script, params) == 8
    scheduler = create_scheduler()
    (r,) = create_requests(1, PROMPT_LEN, max_tokens=50, repetition_detection=params)
    scheduler.add_request(r)
    runner = scripted({"req0": script})
    _, outputs = step(scheduler, runner)  # prefill: samples 1
    scheduler.update_draft_token_ids({"req0": script[1:4]})
    _, outputs = step(scheduler, runner)  # 2 3 4, and 3 sampled after them
    assert outputs.outputs[0].new_token_ids == script[1:5]
    assert outputs.outputs[0].finish_reason is None
    scheduler.update_draft_token_ids({"req0": script[5:9]})
    out, outputs = step(scheduler, runner)  # 4 3 4 9 and 9: the repetition ends at the 3rd
    assert out.scheduled_spec_decode_tokens["req0"] == script[5:9]
    (o,) = outputs.outputs
    assert (o.finish_reason, o.stop_reason) == ("stop", "repetition")
    assert o.new_token_ids == script[5:8]
    assert r.output_token_ids == script[:8]
    assert r.all_token_ids == r.prompt_token_ids + script[:8]
    assert_no_leaks(scheduler)


def test_repetition_detection_leaves_other_requests_alone(monkeypatch):
    # Both sample the same loop; only the one that asked is stopped. The other pays for no
    # full stop check until its length limit (the per-token pre-check lets it through).
    calls = {"with0": 0, "without0": 0}
    real_check = scheduler_module.check_stop

    def counting_check(request, *args):
        calls[request.request_id] += 1
        return real_check(request, *args)

    monkeypatch.setattr(scheduler_module, "check_stop", counting_check)
    loop = [1, 2, 3] * 10
    scheduler = create_scheduler()
    (watched,) = create_requests(1, PROMPT_LEN, max_tokens=20, id_prefix="with",
                                 repetition_detection=repeating(max_size=4, count=3))
    (plain,) = create_requests(1, PROMPT_LEN, max_tokens=20, id_prefix="without")
    for r in (watched, plain):
        scheduler.add_request(r)
    assert plain.full_check_from == 20
    assert watched.full_check_from == 3  # no repetition of count 3 fits in fewer outputs
    res = run_until_done(scheduler, scripted({"with0": loop, "without0": loop}))
    assert res["with0"]["tokens"] == loop[:9]
    assert (res["with0"]["finish_reason"], res["with0"]["stop_reason"]) == ("stop", "repetition")
    assert res["without0"]["tokens"] == loop[:20]
    assert (res["without0"]["finish_reason"], res["without0"]["stop_reason"]) == ("length", None)
    assert calls == {"with0": 9 - 3 + 1, "without0": 1}
    assert_no_leaks(scheduler)


def test_detector_agrees_with_the_definition():
    rng = random.Random(7)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 25))]
        params = repeating(max_size=rng.randrange(1, 6), count=rng.randrange(2, 5))
        params.min_pattern_size = rng.randrange(1, params.max_pattern_size + 1)
        for end in range(1, len(tokens) + 1):
            expected = naive_ends_in_repetition(tokens[:end], params)
            assert ends_in_repetition(tokens, end, params) == expected, (tokens[:end], params)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_pattern_size": 0, "min_count": 2}, "max_pattern_size must be >= 1"),
    ({"max_pattern_size": 3, "min_pattern_size": 0, "min_count": 2},
     "min_pattern_size must be >= 1"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2},
     r"min_pattern_size \(3\) must be <= max_pattern_size \(2\)"),
    ({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
])
def test_repetition_params_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RepetitionDetectionParams(**kwargs)


# ------------------------------------------------------------------------- preemption
def _fill_cache(policy, priorities):
    # 3 requests of 2 blocks each fill a 6-block cache; the next decode token needs a block.
    scheduler = create_scheduler(num_blocks=6, block_size=4, policy=policy, max_model_len=24)
    requests = create_requests(3, 8, max_tokens=10, priorities=priorities)
    for r in requests:
        scheduler.add_request(r)
    runner = FakeRunner()
    step(scheduler, runner)
    return scheduler, runner, requests


def test_fcfs_preempts_last_running():
    scheduler, runner, requests = _fill_cache("fcfs", None)
    out, _ = step(scheduler, runner)
    assert out.preempted_req_ids == {"req2"}
    assert requests[2].status == RequestStatus.PREEMPTED
    assert requests[2].num_computed_tokens == 0 and requests[2].num_preemptions == 1
    assert scheduler.waiting.peek() is requests[2]
    scheduler.kv.check_integrity()


def test_priority_preempts_lowest_priority():
    # Larger value = lower priority. req0 is the victim although it runs first.
    scheduler, runner, requests = _fill_cache("priority", [5, 0, 1])
    out, _ = step(scheduler, runner)
    assert out.preempted_req_ids == {"req0"}
    assert "req0" not in out.num_scheduled_tokens
    assert set(out.num_scheduled_tokens) == {"req1", "req2"}
    scheduler.kv.check_integrity()


def test_no_admission_in_a_step_that_preempted():
    scheduler, runner, requests = _fill_cache("fcfs", None)
    (late,) = create_requests(1, 2, id_prefix="late")
    scheduler.add_request(late)
    out, _ = step(scheduler, runner)
    assert out.preempted_req_ids and not out.scheduled_new_reqs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_resume_after_preemption_gives_identical_tokens(policy):
    lengths = [30, 17, 45, 8, 60, 23, 12, 39]
    priorities = [3, 1, 2, 0, 1, 3, 2, 0]
    alone = {}
    for r in create_requests(8, lengths, max_tokens=40, priorities=priorities):
        s = create_scheduler(policy=policy)
        s.add_request(r)
        alone.update(run_until_done(s))
    scheduler = create_scheduler(num_blocks=24, block_size=8, policy=policy,
                                 max_num_batched_tokens=64)
    requests = create_requests(8, lengths, max_tokens=40, priorities=priorities)
    for r in requests:
        scheduler.add_request(r)
    together = run_until_done(
        scheduler, on_step=lambda s, out: s.kv.check_integrity())
    assert sum(r.num_preemptions for r in requests) > 0
    assert together == alone
    assert_no_leaks(scheduler)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_lost_workers_restart_every_request_from_its_tokens(policy):
    """The workers die mid-run (a pipeline rebuilt): steps in flight are lost, new workers
    know nothing, and after `restart_all` every request ends with the tokens it would have had,
    the prefix cache forgets what was lost, and a PAUSED_NEW pause still lets them run."""
    lengths = [30, 17, 45, 8, 60, 23, 12, 39]
    priorities = [3, 1, 2, 0, 1, 3, 2, 0]
    alone = {}
    for r in create_requests(8, lengths, max_tokens=40, priorities=priorities, prefix=[7] * 16):
        s = create_scheduler(policy=policy)
        s.add_request(r)
        alone.update(run_until_done(s))
    scheduler = create_scheduler(num_blocks=24, block_size=8, policy=policy,
                                 max_num_batched_tokens=64)
    requests = create_requests(8, lengths, max_tokens=40, priorities=priorities,
                               prefix=[7] * 16)
    for r in requests[:6]:
        scheduler.add_request(r)
    driver = utils.StepDriver(scheduler)
    got: dict[str, list[int]] = {}
    for _ in range(12):  # prefills done, some decodes and preemptions
        for o in driver.step()[1].outputs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert scheduler.running and scheduler.kv.num_free_blocks < scheduler.kv.num_blocks
    admitted = {r.request_id for r in requests if r.num_cached_tokens >= 0}
    assert len(admitted) >= 3
    scheduler.pause(PauseState.PAUSED_NEW)
    for r in requests[6:]:  # never admitted (nor those still waiting): the pause holds them
        scheduler.add_request(r)
    scheduler.restart_all("the workers died")  # the steps in flight are dropped with them
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert scheduler.kv.get_computed_blocks(requests[0])[1] == 0  # nothing cached survives
    driver = utils.StepDriver(scheduler, FakeRunner(keep_sampled=utils.ASYNC))
    for _ in range(2000):
        if not driver.has_unfinished_requests() or not scheduler.has_work():
            break
        for o in driver.step()[1].outputs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert {r.request_id for r in scheduler.waiting} == {r.request_id for r in requests} - admitted
    assert all(len(got[req_id]) == 40 for req_id in admitted)
    scheduler.resume()
    rest = run_until_done(scheduler, driver)
    for req_id, entry in rest.items():
        got.setdefault(req_id, []).extend(entry["tokens"])
    assert got == {req_id: entry["tokens"] for req_id, entry in alone.items()}
    assert_no_leaks(scheduler)


# ------------------------------------------------------------------------------ abort
def test_abort_in_each_state():
    scheduler, runner, requests = _fill_cache("fcfs", None)
    (waiting,) = create_requests(1, 4, id_prefix="w")
    scheduler.add_request(waiting)
    step(scheduler, runner)  # preempts req2
    assert requests[2].status == RequestStatus.PREEMPTED
    assert requests[0].status == RequestStatus.RUNNING
    scheduler.finish_requests(["req0", "req2", "w0"], RequestStatus.FINISHED_ABORTED)
    for r in (requests[0], requests[2], waiting):
        assert r.status == RequestStatus.FINISHED_ABORTED
    out = scheduler.schedule()
    assert {"req0", "req2", "w0"} <= out.finished_req_ids
    assert set(out.num_scheduled_tokens) == {"req1"}
    scheduler.finish_requests(["req1", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(out, runner.execute_model(out))
    assert_no_leaks(scheduler)


# -------------------------------------------------------------------------- ignored
def test_prompt_too_long_is_ignored_and_nothing_else_disturbed():
    scheduler = create_scheduler(max_model_len=64)
    ok, too_long = create_requests(2, [10, 64], max_tokens=5)
    scheduler.add_request(ok)
    scheduler.add_request(too_long)
    assert too_long.status == RequestStatus.FINISHED_IGNORED
    results = run_until_done(scheduler)
    assert results["req1"]["finish_reason"] == "length" and results["req1"]["tokens"] == []
    assert len(results["req0"]["tokens"]) == 5
    assert_no_leaks(scheduler)


def test_prompt_that_never_fits_the_cache_is_ignored():
    scheduler = create_scheduler(num_blocks=4, block_size=4, max_model_len=1000)
    (r,) = create_requests(1, 20)
    scheduler.add_request(r)
    assert r.status == RequestStatus.FINISHED_IGNORED and "max_model_len" in r.error


# ------------------------------------------------------------------------ prefix cache
def test_shared_prefix_hits_whole_blocks():
    prefix = list(range(100, 140))  # 40 tokens = 2 full blocks of 16 + 8
    scheduler = create_scheduler()
    a, = create_requests(1, 5, prefix=prefix, id_prefix="a", max_tokens=2)
    scheduler.add_request(a)
    run_until_done(scheduler)
    b, = create_requests(1, 7, prefix=prefix, id_prefix="b", seed=1, max_tokens=2)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert out.num_scheduled_tokens["b0"] == b.num_tokens - 32
    assert b.num_cached_tokens == 32


def test_never_the_whole_prompt():
    scheduler = create_scheduler()
    a, = create_requests(1, 32, id_prefix="a", max_tokens=1)
    scheduler.add_request(a)
    run_until_done(scheduler)
    b, = create_requests(1, 32, id_prefix="b", max_tokens=1)  # same seed: same prompt
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert b.prompt_token_ids == a.prompt_token_ids
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens["b0"] == 16


def test_multi_turn_follow_up_hits_previous_turn():
    scheduler = create_scheduler(block_size=4)
    first, = create_requests(1, 10, max_tokens=8, id_prefix="t1-")
    scheduler.add_request(first)
    results = run_until_done(scheduler)
    history = first.prompt_token_ids + results["t1-0"]["tokens"]
    second, = create_requests(1, 6, prefix=history, id_prefix="t2-", seed=7)
    scheduler.add_request(second)
    out = scheduler.schedule()
    # 18 tokens of history; the last output token has no KV yet: 17 computed -> 4 blocks.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16


def test_identical_prompts_admitted_in_same_step():
    # Full blocks are cached when allocated (the step writes every layer's K/V before any
    # attention reads it), so the second identical prompt already hits the first one's blocks.
    scheduler = create_scheduler()
    (a,) = create_requests(1, 40, max_tokens=4)
    b = Request("twin", list(a.prompt_token_ids), a.sampling_params)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 32]
    assert out.num_scheduled_tokens == {"req0": 40, "twin": 8}
    runner = FakeRunner()
    scheduler.update_from_output(out, runner.execute_model(out))
    scheduler.kv.check_integrity()
    ids_a, ids_b = scheduler.kv.get_block_ids("req0"), scheduler.kv.get_block_ids("twin")
    assert ids_a[:2] == ids_b[:2]  # the shared prefix blocks
    assert ids_a[-1] != ids_b[-1]  # the partial last block is never shared
    run_until_done(scheduler, runner)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_eviction_prefers_oldest_freed_and_tail_blocks():
    scheduler = create_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    prefix = list(range(500, 508))  # 2 blocks
    a, = create_requests(1, 4, prefix=prefix, id_prefix="a", max_tokens=1)
    scheduler.add_request(a)
    run_until_done(scheduler)  # a held 4 blocks (13 tokens), all freed with hashes kept
    # A newcomer needing 4 fresh blocks evicts free blocks in LRU order: a's tail goes
    # first (freed in reverse), so its shared prefix survives.
    other, = create_requests(1, 13, id_prefix="o", seed=3, max_tokens=1)
    scheduler.add_request(other)
    run_until_done(scheduler)
    c, = create_requests(1, 4, prefix=prefix, id_prefix="c", seed=5, max_tokens=1)
    scheduler.add_request(c)
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8


# ---------------------------------------------------------------------- spec decoding
@pytest.mark.sync_only  # speculative decoding: synchronous only
def test_spec_tokens_scheduled_only_when_decoding_and_rolled_back():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    (r,) = create_requests(1, 20, max_tokens=50)
    scheduler.add_request(r)
    runner = FakeRunner()
    scheduler.update_draft_token_ids({"req0": [1, 2, 3]})  # still waiting: ignored
    assert r.spec_token_ids == []
    out, _ = step(scheduler, runner)  # prefill chunk of 8
    scheduler.update_draft_token_ids({"req0": [1, 2, 3]})  # mid-prefill: ignored
    assert r.spec_token_ids == []
    for _ in range(2):
        step(scheduler, runner)
    assert r.num_output_tokens == 1
    good = [fake_token("req0", 21), fake_token("req0", 22)]
    scheduler.update_draft_token_ids({"req0": [*good, 7777]})  # third draft wrong
    out, outputs = step(scheduler, runner)
    assert out.num_scheduled_tokens["req0"] == 4
    assert out.scheduled_spec_decode_tokens["req0"] == [*good, 7777]
    assert outputs.outputs[0].new_token_ids == [*good, fake_token("req0", 23)]
    assert r.num_computed_tokens == r.num_tokens - 1  # the rejected draft was rolled back
    stats = outputs.scheduler_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)


# ---------------------------------------------------------------------- configuration
def test_scheduler_cls_is_imported_with_one_warning():
    cfg = SchedulerConfig(max_model_len=128,
                          scheduler_cls="tests.scheduler.utils:CustomScheduler")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = build_scheduler(cfg, CacheConfig(), 100, 128)
    assert type(scheduler).__name__ == "CustomScheduler"
    assert isinstance(scheduler, Scheduler)
    assert len([w for w in caught if "not stable" in str(w.message)]) == 1
    with pytest.raises(ValueError, match="module:Class"):
        build_scheduler(SchedulerConfig(max_model_len=128, scheduler_cls="nocolon"),
                        CacheConfig(), 100, 128)


def test_unknown_policy_names_valid_ones():
    with pytest.raises(ValueError, match="fcfs, priority"):
        create_request_queue("lifo")
    with pytest.raises(ValueError, match="fcfs, priority"):
        SchedulerConfig(policy="lifo")


def test_priority_queue_order():
    queue = create_request_queue("priority")
    for r in create_requests(4, 3, priorities=[2, 0, 2, 1]):
        queue.add(r)
    assert [r.request_id for r in queue] == ["req1", "req3", "req0", "req2"]


# ------------------------------------------------------------------------------ stats
def test_stats_and_no_leaks_after_full_run():
    scheduler = create_scheduler(num_blocks=30, block_size=4, max_num_batched_tokens=32)
    for r in create_requests(10, [5, 9, 13, 2, 30, 7, 11, 3, 8, 20], max_tokens=12):
        scheduler.add_request(r)
    seen = []
    run_until_done(scheduler, on_step=lambda s, out: seen.append(s.make_stats()))
    assert_no_leaks(scheduler)
    assert all(0.0 <= st.kv_cache_usage <= 1.0 for st in seen)
    assert all(block.ref_cnt == 0 for block in scheduler.kv.pool.blocks)


def test_stats_counts():
    scheduler, runner, _ = _fill_cache("fcfs", None)
    out, outputs = step(scheduler, runner)
    stats = outputs.scheduler_stats
    assert stats.num_preemptions == 1
    assert stats.num_running_reqs == 2 and stats.num_waiting_reqs == 1
    assert stats.kv_cache_usage == pytest.approx(1.0)


def test_decode_step_output_pickles_small():
    scheduler = create_scheduler(max_num_seqs=64)
    for r in create_requests(64, 100, max_tokens=100):
        scheduler.add_request(r)
    runner = FakeRunner()
    step(scheduler, runner)
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 64 and not out.scheduled_new_reqs
    size = len(pickle.dumps(out))
    assert size < 64 * 40, size  # ids, counts and one token each: tens of bytes a request


def test_partial_prefill_gets_no_output():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    (r,) = create_requests(1, 40)
    scheduler.add_request(r)
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(["req0"], [[]]))
    assert outputs.outputs == []
    assert r.num_computed_tokens == 16


@pytest.mark.sync_only  # counts admission attempts of the synchronous step timing
def test_prefix_lookups_are_counted_once_per_admission():
    # Without chunking, b (a full block behind a) waits for budget for several steps; each
    # failed admission attempt looks its prefix up again, but only the admission counts.
    scheduler = create_scheduler(max_num_batched_tokens=48, enable_chunked_prefill=False)
    prefix = list(range(100, 132))  # 2 full blocks
    a, = create_requests(1, 8, prefix=prefix, id_prefix="a", max_tokens=3)
    b, = create_requests(1, 8, prefix=prefix, id_prefix="b", seed=1, max_tokens=3)
    c, = create_requests(1, 40, id_prefix="c", seed=2, max_tokens=3)
    for r in (a, c, b):
        scheduler.add_request(r)
    waited = []
    run_until_done(scheduler, on_step=lambda s, out: waited.append(b in s.waiting))
    assert sum(waited) >= 2  # b's admission failed at least twice
    assert b.num_cached_tokens == 32
    kv = scheduler.kv
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (40 + 40 + 40, 32)


# ---------------------------------------------------------------------------- pausing
def test_paused_new_admits_nothing_new_and_running_requests_finish():
    scheduler = create_scheduler()
    runner = FakeRunner()
    (early,) = create_requests(1, 8, max_tokens=6, id_prefix="early")
    scheduler.add_request(early)
    step(scheduler, runner)
    scheduler.pause(PauseState.PAUSED_NEW)
    (late,) = create_requests(1, 8, max_tokens=6, id_prefix="late")
    scheduler.add_request(late)
    assert scheduler.has_unfinished_requests() and scheduler.has_work()
    finished = None
    for _ in range(20):
        out, outputs = step(scheduler, runner)
        assert not out.scheduled_new_reqs and "late0" not in out.num_scheduled_tokens
        if any(o.finish_reason for o in outputs.outputs):
            finished = outputs
            break
    assert finished is not None and early.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # Drained: only the never admitted request is left, and no step can run it.
    assert late.status == RequestStatus.WAITING and scheduler.has_unfinished_requests()
    assert not scheduler.has_work()
    assert scheduler.request_counts() == (0, 1)
    assert scheduler.schedule().total_num_scheduled_tokens == 0


@pytest.mark.sync_only  # async holds a slot per token in flight: other preemptions
def test_paused_new_readmits_preempted_requests():
    # This scheduler frees a victim's blocks, so a preempted request holds none; it ran
    # before, though, and a drain must see it finish.
    scheduler, runner, requests = _fill_cache("fcfs", None)
    scheduler.pause(PauseState.PAUSED_NEW)
    out, _ = step(scheduler, runner)
    assert out.preempted_req_ids == {"req2"}
    assert scheduler.kv.num_blocks_held("req2") == 0 and scheduler.has_work()
    results = run_until_done(scheduler, runner)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert "req2" in results and requests[2].num_preemptions == 1
    assert_no_leaks(scheduler)


def test_paused_new_admits_a_waiting_request_that_holds_blocks():
    # As a consumer's request after its prompt KV was loaded from another engine: it holds
    # blocks for 8 of its 10 prompt tokens and waits to compute the rest.
    scheduler = create_scheduler(block_size=4)
    loaded, fresh = create_requests(2, 10, max_tokens=4)
    scheduler.add_request(loaded)
    scheduler.add_request(fresh)
    assert scheduler.kv.allocate_slots(loaded, 8, delay_cache_blocks=True) is not None
    loaded.num_computed_tokens = 8
    scheduler.pause(PauseState.PAUSED_NEW)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"req0": 2}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["req0"]
    assert fresh.status == RequestStatus.WAITING and scheduler.waiting.peek() is fresh


def test_paused_all_schedules_nothing_and_resume_goes_on():
    alone = {}
    for r in create_requests(3, 12, max_tokens=8):
        alone.update(run_until_done(_with(create_scheduler(), [r])))
    scheduler = create_scheduler(max_num_seqs=2)
    runner = FakeRunner()
    requests = create_requests(3, 12, max_tokens=8)
    _with(scheduler, requests)
    _, first = step(scheduler, runner)
    progress = [r.num_computed_tokens for r in requests]
    scheduler.pause(PauseState.PAUSED_ALL)
    assert not scheduler.has_work() and scheduler.has_unfinished_requests()
    for _ in range(3):
        out, outputs = step(scheduler, runner)
        assert out.total_num_scheduled_tokens == 0 and not out.num_scheduled_tokens
        assert not outputs.outputs
    assert [r.num_computed_tokens for r in requests] == progress
    assert [r.status for r in requests] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING]
    # An abort while paused still reaches the workers.
    (doomed,) = create_requests(1, 4, id_prefix="doomed")
    scheduler.add_request(doomed)
    scheduler.finish_requests(["doomed0"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.schedule().finished_req_ids == {"doomed0"}
    scheduler.resume()
    assert scheduler.pause_state is PauseState.UNPAUSED and scheduler.has_work()
    rest = run_until_done(scheduler, runner)
    # Each request's tokens are those of an undisturbed run: the pause only delayed them.
    for o in first.outputs:
        rest[o.request_id]["tokens"][:0] = o.new_token_ids
    assert rest == alone
    assert_no_leaks(scheduler)


def _with(scheduler, requests):
    for r in requests:
        scheduler.add_request(r)
    return scheduler


def test_pausing_with_unpaused_is_an_error():
    with pytest.raises(ValueError, match="resume"):
        create_scheduler().pause(PauseState.UNPAUSED)


def test_pause_modes_of_the_http_api():
    assert PauseState.from_mode("new") is PauseState.PAUSED_NEW
    assert PauseState.from_mode("all") is PauseState.PAUSED_ALL
    with pytest.raises(ValueError, match="valid: new, all"):
        PauseState.from_mode("everything")


def test_max_num_active_seqs_caps_running_not_the_runner_slots():
    config = SchedulerConfig(max_num_seqs=8, max_num_active_seqs=2)
    assert config.max_num_seqs == 8 and config.active_seqs_limit == 2
    assert SchedulerConfig(max_num_seqs=8).active_seqs_limit == 8
    scheduler = Scheduler(config, CacheConfig(), 1000, 4096)
    for r in create_requests(4, 8, max_tokens=3):
        scheduler.add_request(r)
    runner = FakeRunner()
    seen_running = []
    results = run_until_done(scheduler, runner,
                             on_step=lambda s, out: seen_running.append(len(s.running)))
    assert max(seen_running) == 2 and len(results) == 4
    with pytest.raises(ValueError, match="max_num_active_seqs=9 exceeds max_num_seqs=8"):
        SchedulerConfig(max_num_seqs=8, max_num_active_seqs=9)
