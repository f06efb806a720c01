"""Requests, queues and the token-budget scheduler. Knows nothing of torch, Ray or HTTP."""

from tokenflow.scheduler.async_scheduler import AsyncScheduler
from tokenflow.scheduler.engine_output import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from tokenflow.scheduler.factory import build_scheduler, import_scheduler_cls
from tokenflow.scheduler.pause import PAUSE_MODES, PauseState
from tokenflow.scheduler.queue import FCFSQueue, PriorityQueue, RequestQueue, create_request_queue
from tokenflow.scheduler.request import Request, RequestStatus
from tokenflow.scheduler.runner_output import ModelRunnerOutput, TokenLogprobs
from tokenflow.scheduler.sampling_params import RepetitionDetectionParams, SamplingParams
from tokenflow.scheduler.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenflow.scheduler.scheduler import Scheduler

__all__ = [
    "PAUSE_MODES", "AsyncScheduler", "CachedRequestData", "EngineCoreOutput", "EngineCoreOutputs", "FCFSQueue",
    "ModelRunnerOutput", "NewRequestData", "PauseState", "PriorityQueue",
    "RepetitionDetectionParams", "Request", "RequestQueue", "RequestStatus", "SamplingParams",
    "Scheduler", "SchedulerOutput", "SchedulerStats", "TokenLogprobs", "build_scheduler",
    "create_request_queue", "import_scheduler_cls",
]
