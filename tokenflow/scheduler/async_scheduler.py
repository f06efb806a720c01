"""The scheduler of async scheduling: step N+1 is scheduled while step N runs."""

from __future__ import annotations

from tokenflow.scheduler.engine_output import EngineCoreOutputs
from tokenflow.scheduler.request import Request, RequestStatus
from tokenflow.scheduler.runner_output import ModelRunnerOutput
from tokenflow.scheduler.sched_output import SchedulerOutput
from tokenflow.scheduler.scheduler import Scheduler, _StepPlan


class AsyncScheduler(Scheduler):
    """A `Scheduler` that counts a token it has scheduled to be sampled, but not yet received,
    as an output placeholder (`Request.num_output_placeholders`), so the scheduling rule gives
    the request its next decode step before that token is known. The worker feeds the token
    it sampled itself (it remembers its own samples), so the step's result is the one the
    synchronous scheduler would get.

    Invariants: a running request's placeholders are the steps in flight that sample it, in
    order, so each result replaces the oldest one (`update_from_output`). A result for a
    request that finished (stop, abort, stop string) or was preempted meanwhile is dropped:
    a finished request's step scheduled ahead is wasted, a preempted one recomputes that token
    (greedy and seeded sampling give it again). Not scheduled ahead: a request whose next
    token is its last by length (nothing follows it) and a structured-output request (its
    grammar must accept the token before the next bitmask); they wait for their token as
    under the synchronous scheduler.
    """

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        requests = self.requests
        max_len = self.max_model_len
        for req_id in out.num_scheduled_tokens:
            request = requests[req_id]
            num_tokens = request.num_tokens + request.num_output_placeholders
            if request.num_computed_tokens < num_tokens:
                continue  # a prefill chunk short of the last token: it samples nothing
            params = request.sampling_params
            limit = min(params.max_tokens or max_len, max_len - request.num_prompt_tokens)
            if (num_tokens - request.num_prompt_tokens + 1 < limit
                    and params.structured_outputs is None):
                request.num_output_placeholders += 1
        return out

    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> EngineCoreOutputs:
        # Each sampled token replaces its request's oldest placeholder; the base class then
        # appends it as the synchronous scheduler does.
        requests = self.requests
        running = RequestStatus.RUNNING
        for req_id, sampled in zip(runner_out.req_ids, runner_out.sampled_token_ids,
                                   strict=True):
            if sampled:
                request = requests.get(req_id)
                if (request is not None and request.status == running
                        and request.num_output_placeholders):
                    request.num_output_placeholders -= len(sampled)
        return super().update_from_output(sched_out, runner_out)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        raise RuntimeError("async scheduling does not verify drafts (EngineConfig refuses "
                           "speculative decoding with it)")

    def _preempt(self, victim: Request, plan: _StepPlan) -> None:
        # Its step in flight is dropped when it returns; recomputing starts from known tokens.
        super()._preempt(victim, plan)
        victim.num_output_placeholders = 0
