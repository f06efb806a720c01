"""AsyncEngine: asyncio streams for callers, over the step loop that runs in a thread of
this process or in a process of its own (`engine_loop`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenflow.config import EngineConfig
from tokenflow.replica.engine.engine import Engine, EngineState
from tokenflow.replica.engine.engine_loop import (
    AbortRequest,
    AddLoRA,
    AddRequest,
    Command,
    EngineDeadError,
    EngineProcess,
    EngineThread,
    Pause,
    RemoveLoRA,
    Resume,
)
from tokenflow.replica.engine.input_processor import InputProcessor, ProcessedRequest
from tokenflow.replica.engine.lora_registry import LoRARegistry
from tokenflow.replica.engine.output_processor import RequestOutput
from tokenflow.scheduler import PauseState, SamplingParams
from tokenflow.scheduler.continuation import continuable, continuation_params

logger = logging.getLogger(__name__)
# How often a caller waiting for a pause to apply (or to end) looks again.
_PAUSE_POLL_S = 0.005
# An engine process that dies is restarted once; one that dies again within this many seconds
# of the last restart is not (something kills it: a request, memory), and the replica fails.
RESTART_WINDOW_S = 60.0


@dataclass
class _Stream:
    """One submitted request as this side knows it: where its deltas go, and what an engine
    restart needs to continue it (the request, the tokens it has been given so far)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    processed: ProcessedRequest
    generated: list[int]  # its tokens so far (those it arrived with included)
    finished: bool = False

    @property
    def prompt(self) -> str | None:
        return self.processed.prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.processed.prompt_token_ids


class AsyncEngine:
    """Owns the client streams of one engine and the host of its step loop (`EngineThread`:
    an `Engine` in a thread here; `EngineProcess`: one in a process of its own, as
    `EngineConfig.engine_loop` says).

    Callers on any asyncio loop get `generate(...)`, an async iterator of `RequestOutput`
    deltas; closing or cancelling the iterator aborts the request and frees its blocks.
    `pause`/`resume` reach the scheduler (which holds the pause state) through the loop, in
    order with requests.
    """

    def __init__(self, config: EngineConfig, engine: Engine | None = None) -> None:
        self._streams: dict[str, _Stream] = {}
        self._config = config
        # An engine process that dies is replaced (`_restart`); while that runs, commands
        # wait in `_backlog`. The lock orders sends against the swap of processes.
        self._restart_lock = threading.Lock()
        self._restarting = self._closing = False
        self._backlog: list[Command] = []
        self._last_restart = -RESTART_WINDOW_S
        self.num_restarts = 0
        self._loop: EngineThread | EngineProcess
        if engine is None and config.uses_engine_process:
            self._loop = EngineProcess(config, self._deliver_step, self._engine_process_died)
        else:
            self._loop = EngineThread(engine or Engine(config), self._deliver_step,
                                      self._fail_all)
        # The engine of this process (None when it runs in its own).
        self.engine: Engine | None = self._loop.engine
        info = self._loop.info
        # This side validates requests, so it keeps its own table of the engine's adapters.
        self._inputs = InputProcessor(self._loop.tokenizer, info.max_model_len,
                                      info.vocab_size, config.structured_outputs,
                                      LoRARegistry(config.lora, config.model.model))

    # ---------------------------------------------------------------------- public API
    @property
    def model_name(self) -> str:
        return self._loop.info.model_name

    @property
    def tokenizer(self):
        return self._loop.tokenizer

    @property
    def load_time_s(self) -> float:
        return self._loop.info.load_time_s

    @property
    def max_model_len(self) -> int:
        return self._loop.info.max_model_len

    @property
    def kv_events_endpoints(self) -> tuple[str | None, str | None]:
        """(PUB, replay) addresses of the engine's KV-cache events, None where not published.
        An engine process that restarts binds new ones."""
        info = self._loop.info
        return info.kv_events_endpoint, info.kv_events_replay_endpoint

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (None when the engine runs in this process)."""
        return self._loop.pid if isinstance(self._loop, EngineProcess) else None

    @property
    def state(self) -> EngineState:
        """The engine as of its latest step or applied command: requests, KV blocks and
        usage, counters since start, the pause state."""
        return self._loop.state()

    @property
    def error(self) -> BaseException | None:
        """Why the loop stopped (None while it runs)."""
        return self._loop.error

    @error.setter
    def error(self, error: BaseException | None) -> None:
        self._loop.error = error

    @property
    def is_running(self) -> bool:
        return self._loop.is_alive()

    def check_health(self) -> None:
        if self._restarting:
            return  # a new engine process is on its way; its requests wait for it
        if not self.is_running:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        try:
            self._loop.check_health()
        except EngineDeadError:
            raise
        except Exception as exc:
            raise EngineDeadError(f"the model executor failed: {exc}") from exc

    def process_inputs(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       kv_transfer_params: dict | None = None) -> ProcessedRequest:
        return self._inputs.process(request_id or uuid.uuid4().hex, prompt, params, priority,
                                    kv_transfer_params)

    # --------------------------------------------------------------------------- LoRA
    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name`: validated here (ValueError if it does
        not fit), then sent to the engine; requests submitted after this call may name it."""
        adapter = self._inputs.loras.add(name, path)
        self._send(AddLoRA(adapter.name, adapter.path))

    def remove_lora(self, name: str) -> bool:
        """Stop serving `name` (requests using it finish); False if it was not served."""
        removed = self._inputs.loras.remove(name)
        if removed:
            self._send(RemoveLoRA(name))
        return removed

    def list_loras(self) -> list[str]:
        return self._inputs.loras.names()

    def with_kv_transfer(self, processed: ProcessedRequest,
                         kv_transfer_params: dict) -> ProcessedRequest:
        """See `InputProcessor.with_kv_transfer`: a validated request, continued from another
        engine's prefill."""
        return self._inputs.with_kv_transfer(processed, kv_transfer_params)

    async def generate(self, prompt: str | list[int] | ProcessedRequest,
                       params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request. Bad input raises ValueError before anything runs."""
        batches = self.generate_batched(prompt, params, request_id, priority)
        try:
            async for batch in batches:
                for item in batch:
                    yield item
        finally:
            await batches.aclose()

    async def generate_batched(self, prompt: str | list[int] | ProcessedRequest,
                               params: SamplingParams | None = None,
                               request_id: str | None = None, priority: int = 0
                               ) -> AsyncIterator[list[RequestOutput]]:
        """`generate`, but each item is every delta that arrived since the caller last asked
        (one step's, or several when the caller fell behind): a consumer that sends each item
        somewhere sends fewer, larger ones exactly when it is the bottleneck."""
        self.check_health()
        processed = (prompt if isinstance(prompt, ProcessedRequest)
                     else self.process_inputs(prompt, params, request_id, priority))
        batches = self.submit(processed)
        try:
            async for items in batches:
                yield items
        finally:
            await batches.aclose()

    def submit(self, processed: ProcessedRequest) -> RequestBatches:
        """Send `processed` to the engine now and return its batches (as `generate_batched`
        yields them). The engine starts on it at once, while the caller does whatever comes
        before reading (a server sends its response headers). `aclose()` the result,
        read or not: that aborts the request if it has not finished."""
        self.check_health()
        request_id = processed.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), processed,
                         list(processed.sequences[0].output_token_ids))
        # Registered before it is sent: the engine may answer before `_send` returns.
        self._streams[request_id] = stream
        try:
            self._send(AddRequest(processed))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return RequestBatches(self, request_id, stream.queue)

    def release(self, request_id: str, aborted: bool) -> None:
        """Forget a submitted request's stream; `aborted`: the engine drops it too."""
        self._streams.pop(request_id, None)
        if aborted:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead engine holds nothing to free
            self._send(AbortRequest(request_id))

    @property
    def restarting(self) -> bool:
        """Whether a new engine process is starting in place of one that died."""
        return self._restarting

    # --------------------------------------------------------------------------- pausing
    async def pause(self, mode: PauseState = PauseState.PAUSED_NEW) -> None:
        """See `PauseState`. Returns once the step loop has applied it (after the step under
        way, if any): requests sent after this call are not admitted (PAUSED_NEW) or nothing
        is scheduled (PAUSED_ALL) until `resume`."""
        if mode is PauseState.UNPAUSED:
            raise ValueError("pause needs PAUSED_NEW or PAUSED_ALL; resume() unpauses")
        await self._restarted()  # a count of applied commands means one engine's
        await self._applied(self._send(Pause(mode)))

    async def resume(self) -> None:
        await self._restarted()
        await self._applied(self._send(Resume()))

    async def _restarted(self) -> None:
        """Return once no engine restart is under way."""
        while self._restarting:
            await asyncio.sleep(_PAUSE_POLL_S * 10)

    @property
    def pause_state(self) -> PauseState:
        """The scheduler's, as of the last applied command."""
        return self.state.pause_state

    def is_paused(self) -> bool:
        return self.pause_state is not PauseState.UNPAUSED

    async def wait_unpaused(self) -> None:
        """Return once the engine is not paused (at once when it is not)."""
        while self.is_paused():
            await asyncio.sleep(_PAUSE_POLL_S)

    def is_idle(self) -> bool:
        """No step could make progress: nothing runs and nothing waits that may run (paused,
        what the pause holds back does not count), with no command left to apply. Drained,
        once paused with PAUSED_NEW."""
        return not self._restarting and self._loop.is_idle()

    def shutdown(self) -> None:
        with self._restart_lock:
            self._closing = True
        self._loop.shutdown()

    # ------------------------------------------------------------------ the loop's side
    def _send(self, command: Command) -> int:
        """Send a command to the step loop; returns how many it will have applied after it
        (during a restart: held for the new engine process, which gets it first thing)."""
        with self._restart_lock:
            if not self._restarting:
                try:
                    return self._loop.send(command)
                except OSError:
                    # The process died, and its reader has not said so yet: it will, and
                    # either a restart sends this on or every open request fails with it.
                    pass
            if isinstance(command, AbortRequest):  # of a request not resubmitted yet
                self._backlog = [c for c in self._backlog if not (
                    isinstance(c, AddRequest) and c.processed.request_id == command.request_id)]
            else:
                self._backlog.append(command)
            return 0

    def _engine_process_died(self, error: BaseException) -> None:
        """The engine process is gone (the reader thread's call): start a new one, unless the
        last one was started too recently or the engine is shutting down."""
        with self._restart_lock:
            now = time.monotonic()
            restart = not self._closing and now - self._last_restart > RESTART_WINDOW_S
            if restart:
                self._restarting, self._last_restart = True, now
        if not restart:
            logger.error("the engine process died again within %.0f s of its restart: "
                         "failing its requests (%s)", RESTART_WINDOW_S, error)
            self._fail_all(error)
            return
        logger.warning("the engine process died (%s); starting a new one for its %d requests",
                       error, len(self._streams))
        threading.Thread(target=self._restart, args=(self._loop,), name="tokenflow-restart",
                         daemon=True).start()

    def _restart(self, dead: EngineProcess) -> None:
        """Replace `dead` with a new engine process and send it every open request, each with
        the tokens it has been given as its first outputs (greedy ones go on token-exactly),
        then whatever was sent meanwhile. A request that cannot go on from its tokens
        (`continuable`) fails with the engine's error."""
        dead.shutdown()
        try:
            new = EngineProcess(self._config, self._deliver_step, self._engine_process_died)
        except Exception as exc:
            logger.exception("the new engine process did not start")
            with self._restart_lock:
                self._restarting, self._backlog = False, []
            self._fail_all(EngineDeadError(f"the engine process died and did not restart: {exc}"))
            return
        with self._restart_lock:
            if self._closing:
                new.shutdown()
                return
            paused = dead.state().pause_state
            if paused is not PauseState.UNPAUSED:  # the pause outlives the process
                new.send(Pause(paused))
            for adapter in self._inputs.loras.adapters():  # and adapters added since start
                new.send(AddLoRA(adapter.name, adapter.path))
            waiting = {c.processed.request_id for c in self._backlog if isinstance(c, AddRequest)}
            lost = []
            for request_id, stream in list(self._streams.items()):
                if stream.finished or request_id in waiting:
                    continue
                if not continuable(stream.processed.params):
                    lost.append(request_id)
                    continue
                processed = stream.processed
                if stream.generated:
                    processed = self._inputs.with_kv_transfer(
                        processed, continuation_params(stream.generated))
                new.send(AddRequest(processed))
            for command in self._backlog:
                new.send(command)
            self._loop, self._backlog, self._restarting = new, [], False
            self.num_restarts += 1
        logger.warning("engine process %s restarted: %d requests go on, %d failed",
                       new.pid, len(self._streams) - len(lost), len(lost))
        for request_id in lost:
            self._deliver(request_id, EngineDeadError(
                "the engine process died; a request with n > 1, structured output or prompt "
                "logprobs cannot go on in a new one"))

    async def _applied(self, count: int) -> None:
        """Wait until the step loop has applied `count` commands."""
        while self.state.applied < count:
            self.check_health()
            await asyncio.sleep(_PAUSE_POLL_S)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, error)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one per
        request (each wake-up costs the engine thread a GIL hand-off)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                if self.engine is None:  # the engine process sent the deltas without them
                    output.prompt, output.prompt_token_ids = (stream.prompt,
                                                              stream.prompt_token_ids)
                    if output.outputs:  # what a restarted engine process continues from
                        stream.generated.extend(output.outputs[0].token_ids)
                stream.finished = output.finished
                by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


class RequestBatches:
    """The batches of deltas of one submitted request (`AsyncEngine.submit`): every delta
    that arrived since the last read, up to and including the finished one. Owns the
    request's registration with the engine: `aclose` ends it, aborting an unfinished one."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self._engine, self._request_id, self._queue = engine, request_id, queue
        self._finished = self._closed = False
        self._error: BaseException | None = None

    def __aiter__(self) -> RequestBatches:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self._error is not None:
            raise self._error
        if self._finished:
            raise StopAsyncIteration
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for i, item in enumerate(items):
            if isinstance(item, BaseException):
                if not i:
                    raise item
                self._error = item  # raised on the next read, after the deltas before it
                return items[:i]
            if item.finished:
                self._finished = True
                return items[:i + 1]
        return items

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.release(self._request_id, aborted=not self._finished)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, output in items:
        queue_.put_nowait(output)
