"""Async scheduling on the embedded model: outputs are token-identical with it on and off on
every path (chunked prefill, prefix hits, preemption, stops, stop strings, aborts, n>1, seeds,
penalties, structured output), step N+1 really is scheduled before step N's tokens are known,
and the configurations it cannot serve are refused."""

from __future__ import annotations

import random
import threading

import pytest

from tests.replica.test_engine import SCENARIOS  # the engine tests' paths, async on and off
from tokenflow.config import EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import AsyncScheduler, SamplingParams
from tokenflow.scheduler.sampling_params import StructuredOutputsParams


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 33, 60, 9, 48)]
    return prompts + [shared + [7, 8, 9], shared + [10, 11, 12, 13, 14]]


def make_llm(async_scheduling: bool, **kwargs) -> LLM:
    return LLM("tokenflow-tiny", max_model_len=256, async_scheduling=async_scheduling, **kwargs)


def generate_both(prompts, params, **kwargs) -> tuple[list, list, LLM]:
    """(sync outputs, async outputs, the async LLM) for the same prompts and engine config;
    both engines first see the shared prefix once, so the last prompts hit the cache."""
    results = []
    for flag in (False, True):
        llm = make_llm(flag, **kwargs)
        llm.generate([prompts[-1][:40] + [99]], SamplingParams(max_tokens=1), use_tqdm=False)
        results.append(llm.generate(prompts, params, use_tqdm=False))
    return results[0], results[1], llm


def tokens(outputs) -> list[list[tuple]]:
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
            for o in outputs]


def assert_drained(llm: LLM) -> None:
    llm.engine.check_idle()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_is_token_identical_on_every_path(scenario):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    sync, async_, llm = generate_both(make_prompts(), params, **SCENARIOS[scenario])
    assert tokens(async_) == tokens(sync)
    for a, s in zip(async_, sync, strict=True):
        assert [lp.token_ids for lp in a.outputs[0].logprobs] == [
            lp.token_ids for lp in s.outputs[0].logprobs]
    totals = llm.totals
    if scenario == "preemption":
        assert totals.num_preemptions > 0
    if scenario != "no_prefix_cache":
        assert totals.prefix_cache_hits > 0
    assert_drained(llm)


@pytest.mark.parametrize("scenario", ["plain", "preemption"])
def test_seeded_sampling_n_and_penalties_are_identical(scenario):
    params = SamplingParams(n=3, max_tokens=20, temperature=0.9, top_p=0.9, top_k=50,
                            seed=1234, ignore_eos=True, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.3, min_tokens=3)
    sync, async_, llm = generate_both(make_prompts(1), params, **SCENARIOS[scenario])
    assert tokens(async_) == tokens(sync)
    assert all(len({tuple(c.token_ids) for c in o.outputs}) > 1 for o in async_)  # it samples
    assert_drained(llm)


def test_stops_are_identical_and_the_step_scheduled_ahead_is_dropped():
    prompts = make_prompts(2)
    # The greedy tokens of a free run, then stops in the middle of each: a stop token, a
    # stop string, max_tokens and the context limit, all found while a step is in flight.
    free = make_llm(False).generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                            ignore_eos=True), use_tqdm=False)
    params = []
    for i, out in enumerate(free):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        params.append(
            SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[ids[4 + i % 3]])
            if i % 3 == 0 else
            SamplingParams(max_tokens=30, temperature=0.0, stop=[text[len(text) // 2:][:3]])
            if i % 3 == 1 and len(text) > 6 else
            SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True))
    params[-1] = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    for flag in (False, True):
        llm = make_llm(flag, max_num_batched_tokens=64, num_blocks=64, block_size=4)
        got = tokens(llm.generate(prompts, params, use_tqdm=False))
        if not flag:
            expected = got
        assert_drained(llm)
    assert got == expected
    reasons = [seq[0][1] for seq in expected]
    assert reasons.count("stop") >= 3 and reasons.count("length") >= 3
    assert len(expected[-1][0][0]) == 256 - len(prompts[-1])  # ran to max_model_len


def run_with_aborts(async_scheduling: bool) -> tuple[dict[str, list[int]], LLM]:
    """Eight requests; after a few steps, abort three of them (one mid-prefill)."""
    llm = make_llm(async_scheduling, max_num_batched_tokens=48, num_blocks=128, block_size=4)
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(3)):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        steps += 1
        if steps == 4:
            for request_id in ("r0", "r3", "r7"):
                engine.abort_request(request_id)
    return got, llm


def test_aborts_while_a_step_is_in_flight_free_everything():
    sync, _ = run_with_aborts(False)
    async_, llm = run_with_aborts(True)
    for req_id in ("r1", "r2", "r4", "r5", "r6"):
        assert async_[req_id] == sync[req_id] and len(async_[req_id]) == 16
    assert_drained(llm)


def test_structured_and_free_requests_together_are_identical():
    # Structured requests are not scheduled ahead (their grammar must see each token first);
    # the free ones around them are.
    prompts = make_prompts(4)[:4]
    choice = StructuredOutputsParams(regex=r"[a-z]{2,6}-\d{1,3}")
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=choice)
              if i % 2 else SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    results = []
    for flag in (False, True):
        llm = make_llm(flag)
        results.append(tokens(llm.generate(prompts, params, use_tqdm=False)))
        assert_drained(llm)
    assert results[1] == results[0]


def test_step_n_plus_1_is_scheduled_before_step_n_is_applied():
    llm = make_llm(True)
    engine = llm.engine
    scheduler, worker = engine.scheduler, engine.executor.worker
    assert isinstance(scheduler, AsyncScheduler)
    seen = {"placeholders": 0, "threads": set()}
    schedule, execute = scheduler.schedule, worker.execute_model

    def recording_schedule():
        out = schedule()
        for request in scheduler.running:
            seen["placeholders"] = max(seen["placeholders"], request.num_output_placeholders)
        return out

    def recording_execute(sched_out):
        seen["threads"].add(threading.current_thread().name)
        return execute(sched_out)

    scheduler.schedule = recording_schedule
    worker.execute_model = recording_execute
    llm.generate(make_prompts()[:3], SamplingParams(max_tokens=8, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)
    # Two tokens not yet known: step N's, and step N+1's scheduled on top of it.
    assert seen["placeholders"] == 2
    assert all(name.startswith("tokenflow-model") for name in seen["threads"])
    llm.shutdown()


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(speculative=SpeculativeConfig(method="ngram")), "speculative decoding"),
    (dict(parallel=ParallelConfig(pipeline_parallel_size=2)), "in-process executor"),
    (dict(parallel=ParallelConfig(executor="ray")), "in-process executor"),
])
def test_unsupported_combinations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(scheduler=SchedulerConfig(async_scheduling=True), **kwargs)
