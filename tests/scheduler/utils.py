"""Factories and a fake runner for CPU-only scheduler tests.

The fake runner behaves like a worker: it learns requests only from `SchedulerOutput` deltas,
keeps its own copy of every request's tokens and block table, and samples a token that is a
pure function of (request id, position), so a preempted and recomputed request must give
exactly the tokens of an undisturbed one.

`ASYNC` (set per test by the scenario tests' fixture) picks the scheduler `create_scheduler`
builds: the synchronous one or `AsyncScheduler`. `StepDriver` steps a scheduler as `Engine`
does: an AsyncScheduler with two steps in flight, its results arriving a step late.
"""

from __future__ import annotations

import random
import zlib
from collections import deque
from dataclasses import dataclass, field

from tokenflow.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_max_model_len
from tokenflow.scheduler import (
    AsyncScheduler,
    EngineCoreOutputs,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
)

VOCAB = 1000
ASYNC = False  # the default of create_scheduler and FakeRunner (see the module docstring)


class CustomScheduler(Scheduler):
    """Stands for a user's `scheduler_cls`."""


def fake_token(req_id: str, position: int) -> int:
    return zlib.crc32(f"{req_id}:{position}".encode()) % VOCAB


def create_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    num_blocks: int = 10_000,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    max_model_len: int = 4096,
    async_scheduling: bool | None = None,
) -> Scheduler:
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold, policy=policy,
        max_model_len=max_model_len,
        async_scheduling=ASYNC if async_scheduling is None else async_scheduling)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    # The engine's one context limit, resolved as the executor resolves it.
    limit = resolve_max_model_len(EngineConfig(scheduler=sched, cache=cache), max_model_len,
                                  num_blocks)
    return (AsyncScheduler if sched.async_scheduling else Scheduler)(sched, cache, num_blocks,
                                                                     limit)


def create_requests(
    num_requests: int,
    num_tokens: int | list[int] = 10,
    *,
    max_tokens: int = 16,
    prefix: list[int] | None = None,
    seed: int = 0,
    id_prefix: str = "req",
    eos_token_id: int | None = None,
    priorities: list[int] | None = None,
    **sampling_kwargs,
) -> list[Request]:
    rng = random.Random(seed)
    lengths = num_tokens if isinstance(num_tokens, list) else [num_tokens] * num_requests
    requests = []
    for i, length in enumerate(lengths[:num_requests]):
        prompt = list(prefix or []) + [rng.randrange(VOCAB) for _ in range(length)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling_kwargs)
        requests.append(Request(
            f"{id_prefix}{i}", prompt, params, arrival_time=float(i),
            priority=priorities[i] if priorities else 0, eos_token_id=eos_token_id))
    return requests


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    num_prompt: int
    block_ids: list[int] = field(default_factory=list)


class FakeRunner:
    """A worker stand-in: applies deltas, samples `fake_token`, verifies drafts greedily.
    With `keep_sampled` (async scheduling) it remembers what it samples, as the worker does,
    and feeds it to a step scheduled before the scheduler knew it."""

    def __init__(self, sample=fake_token, keep_sampled: bool | None = None) -> None:
        self.sample = sample
        self.keep_sampled = ASYNC if keep_sampled is None else keep_sampled
        self.requests: dict[str, _RunnerRequest] = {}

    def _apply(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in out.preempted_req_ids:
            if req_id in self.requests:
                self.requests[req_id].block_ids = []
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                len(new.prompt_token_ids), list(new.block_ids))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            start = min(max(cached.num_computed_tokens[i], state.num_prompt),
                        len(state.token_ids))
            new_tokens = cached.new_token_ids[i]
            if new_tokens or cached.resumed_from_preemption[i]:
                del state.token_ids[start:]  # as the worker: what it sampled is replaced
                state.token_ids.extend(new_tokens)
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(cached.new_block_ids[i])
            else:
                state.block_ids.extend(cached.new_block_ids[i])

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._apply(out)
        req_ids, sampled = [], []
        for new in out.scheduled_new_reqs:
            req_ids.append(new.req_id)
            sampled.append(self._sample(new.req_id, new.num_computed_tokens, out))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req_ids.append(req_id)
            sampled.append(self._sample(req_id, cached.num_computed_tokens[i], out))
        if self.keep_sampled:
            for req_id, tokens in zip(req_ids, sampled, strict=True):
                self.requests[req_id].token_ids.extend(tokens)
        return ModelRunnerOutput(req_ids, sampled)

    def _sample(self, req_id: str, num_computed: int, out: SchedulerOutput) -> list[int]:
        state = self.requests[req_id]
        drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
        end = num_computed + out.num_scheduled_tokens[req_id] - len(drafts)
        assert end <= len(state.token_ids), "scheduled past the known tokens"
        if end < len(state.token_ids):
            return []  # a prefill chunk that does not reach the last token
        position = len(state.token_ids)
        tokens = []
        for draft in drafts:
            token = self.sample(req_id, position + len(tokens))
            tokens.append(token)
            if token != draft:
                return tokens
        tokens.append(self.sample(req_id, position + len(tokens)))
        return tokens


class StepDriver:
    """Steps a scheduler and a fake runner as `Engine.step()` does: the runner executes a
    step when it is scheduled (workers run steps in order), and with `depth=2` (the default
    for an AsyncScheduler) step N+1 is scheduled before step N's results are applied."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner | None = None,
                 depth: int | None = None) -> None:
        is_async = isinstance(scheduler, AsyncScheduler)
        self.scheduler = scheduler
        self.runner = runner or FakeRunner(keep_sampled=is_async)
        self.depth = depth or (2 if is_async else 1)
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.in_flight)

    def step(self) -> tuple[SchedulerOutput | None, EngineCoreOutputs]:
        """(the step whose results were applied, or None, and the outputs)."""
        if len(self.in_flight) < self.depth:
            out = self.scheduler.schedule()
            if out.total_num_scheduled_tokens or out.finished_req_ids or out.preempted_req_ids:
                self.in_flight.append((out, self.runner.execute_model(out)))
                if out.total_num_scheduled_tokens and len(self.in_flight) < self.depth:
                    return None, EngineCoreOutputs()
            elif not self.in_flight:
                return out, self.scheduler.update_from_output(out, ModelRunnerOutput([], []))
        out, runner_out = self.in_flight.popleft()
        return out, self.scheduler.update_from_output(out, runner_out)


def run_until_done(scheduler: Scheduler, runner: FakeRunner | StepDriver | None = None, *,
                   max_steps: int = 10_000, on_step=None) -> dict[str, dict]:
    """Step until every request finished; returns per request its tokens and finish reason.
    `on_step(scheduler, sched_out)` runs after each step whose results were applied."""
    driver = runner if isinstance(runner, StepDriver) else StepDriver(scheduler, runner)
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not driver.has_unfinished_requests():
            return results
        out, outputs = driver.step()
        if on_step is not None and out is not None:
            on_step(scheduler, out)
        for o in outputs.outputs:
            entry = results.setdefault(o.request_id, {"tokens": [], "finish_reason": None})
            entry["tokens"].extend(o.new_token_ids)
            if o.finish_reason is not None:
                entry["finish_reason"] = o.finish_reason
                entry["stop_reason"] = o.stop_reason
    raise AssertionError(f"not finished after {max_steps} steps")
