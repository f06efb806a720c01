"""Where a replica's step loop runs: a thread of the serving process (`EngineThread`), or a
process of its own (`EngineProcess`, as vLLM runs its EngineCore), so that the engine and the
HTTP event loop do not take turns on one GIL. `AsyncEngine` talks to either the same way:
commands in (`send`), each step's outputs out (`deliver`), and an `EngineState` to read.

Both run `run_steps`, THE step loop: apply the commands that arrived, step while there is
work, wait for commands when there is none.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import logging
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

from tokenflow.config import EngineConfig
from tokenflow.net import NODE_IP_ENV, node_ip
from tokenflow.replica.engine.engine import Engine, EngineState
from tokenflow.replica.engine.input_processor import ProcessedRequest
from tokenflow.replica.engine.output_processor import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
)
from tokenflow.replica.loading.resolve import load_tokenizer
from tokenflow.replica.loading.tokenizer import Tokenizer
from tokenflow.scheduler import PauseState

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ commands to the loop
@dataclass(frozen=True, slots=True)
class AddRequest:
    processed: ProcessedRequest


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class Pause:
    mode: PauseState


@dataclass(frozen=True, slots=True)
class Resume:
    pass


@dataclass(frozen=True, slots=True)
class AddLoRA:
    """Serve a LoRA adapter (validated by the sender already)."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class RemoveLoRA:
    name: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Ends an engine process's loop (a thread's ends through `EngineThread.shutdown`)."""


# What `AsyncEngine` sends; `Stop` only ever goes to an engine process, by its host.
Command = AddRequest | AbortRequest | Pause | Resume | AddLoRA | RemoveLoRA
Deliver = Callable[[list[RequestOutput]], None]
Fail = Callable[[BaseException], None]
# How long an idle loop waits for a command before it looks again.
_IDLE_WAIT_S = 1.0
# The engine process's environment where the serving process's has no value: torch's OpenMP
# threads (libgomp) spin at most 10,000 times, not 300,000, for their next parallel region
# before they sleep. A long spin burns the cores the serving side needs between steps (to
# stream each token) and the step then waits for a preempted thread: served one request's
# step took 7.8 -> 7.1 ms, its TPOT 8.7-8.9 -> 8.0-8.1 ms (bench/README, "The graph's caller
# in C++, and OpenMP's spin").
ENGINE_PROCESS_ENV = {"GOMP_SPINCOUNT": "10000"}


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; the replica must be replaced."""


@dataclass
class EngineInfo:
    """What the serving side needs to know of a loaded engine, once."""

    model_name: str
    max_model_len: int
    vocab_size: int
    load_time_s: float
    # Where its KV-cache events are published (and replayed): None when they are not.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        events = engine.kv_events
        return cls(engine.model_name, engine.max_model_len, engine.vocab_size,
                   engine.load_time_s, events.endpoint if events else None,
                   events.replay_endpoint if events else None)


def run_steps(engine: Engine, receive: Callable[[bool], list[Command] | None],
              emit: Callable[[list[RequestOutput], int, bool], None]) -> None:
    """THE step loop: step `engine` until `receive(busy)` returns None. `receive` returns the
    commands that arrived (waiting a while for one when not busy); `emit(outputs, applied,
    busy)` gets each step's outputs, and is told of commands applied with no step to follow."""
    applied, busy = 0, engine.has_work()
    while True:
        commands = receive(busy)
        if commands is None:
            return
        for command in commands:
            apply_command(engine, command)
        applied += len(commands)
        stepped = engine.has_work()
        outputs = engine.step() if stepped else []
        busy = engine.has_work() if stepped else False
        if stepped or commands:
            emit(outputs, applied, busy)


def apply_command(engine: Engine, command: Command) -> None:
    match command:
        case AddRequest(processed):
            engine.add_processed(processed)
        case AbortRequest(request_id):
            engine.abort_request(request_id)
        case Pause(mode):
            engine.pause(mode)
        case Resume():
            engine.resume()
        case AddLoRA(name, path):
            try:
                engine.add_lora(name, path)
            except ValueError:  # its files changed since the sender checked them
                logger.exception("LoRA adapter %r not added", name)
        case RemoveLoRA(name):
            engine.remove_lora(name)
        case _:
            raise ValueError(f"unknown engine command {command!r}")


class EngineThread:
    """Owns the thread that steps an `Engine` of this process, and its command inbox."""

    def __init__(self, engine: Engine, deliver: Deliver, fail: Fail) -> None:
        self.engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.info = EngineInfo.of(engine)
        self.error: BaseException | None = None
        self._deliver, self._fail = deliver, fail
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = False
        self._sent = 0
        self._sent_lock = threading.Lock()
        self._applied, self._has_work = 0, False
        self._thread = threading.Thread(target=self._run, name="tokenflow-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> int:
        """Queue a command; returns how many commands the loop has been sent so far."""
        with self._sent_lock:
            self._sent += 1
            sent = self._sent
            self._inbox.put(command)
        self._wakeup.set()
        return sent

    def state(self) -> EngineState:
        return self.engine.state(self._applied, self._has_work)

    def is_idle(self) -> bool:
        return not self._has_work and self._applied == self._sent

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def check_health(self) -> None:
        self.engine.check_health()

    def shutdown(self) -> None:
        self._stop = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    def _receive(self, busy: bool) -> list[Command] | None:
        self._has_work = busy
        if not busy and self._inbox.empty():
            self._wakeup.wait(timeout=_IDLE_WAIT_S)
            self._wakeup.clear()
        if self._stop:
            return None
        commands = []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _emit(self, outputs: list[RequestOutput], applied: int, busy: bool) -> None:
        self._applied, self._has_work = applied, busy
        if outputs:
            self._deliver(outputs)

    def _run(self) -> None:
        try:
            run_steps(self.engine, self._receive, self._emit)
        except BaseException as exc:  # the loop itself broke: fail every stream
            logger.exception("engine loop died")
            self.error = exc
            self._fail(EngineDeadError(f"engine loop died: {exc!r}"))


class EngineProcess:
    """Owns an engine process (the `Engine`: scheduler, model, detokenizer), the pipe to
    it, and the thread that reads its outputs here. The serving process keeps only what
    validating requests needs (the tokenizer) and the latest `EngineState` it was sent.

    The engine process ends when told to, and when this process goes away (its pipe closes).
    It runs the model in-process: no Ray inside it (`EngineConfig.engine_loop` says which
    configurations it serves)."""

    def __init__(self, config: EngineConfig, deliver: Deliver, fail: Fail) -> None:
        self.engine = None
        self.error: BaseException | None = None
        self._deliver, self._fail = deliver, fail
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_engine_process_main,
                                        args=(config, child, node_ip()),
                                        name="tokenflow-engine", daemon=True)
        with _environment_defaults(ENGINE_PROCESS_ENV):  # a spawned child inherits os.environ
            self._process.start()
        child.close()
        self.tokenizer: Tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            kind, payload = "failed", f"it exited with code {self._process.exitcode}"
        if kind != "ready":
            self._process.join(timeout=10)
            raise RuntimeError(f"the engine process did not start: {payload}")
        self.info: EngineInfo
        self._state: EngineState
        self.info, self._state = payload
        self._sent = 0
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="tokenflow-engine-reader",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def send(self, command: Command) -> int:
        """Send a command; returns how many commands the process has been sent so far."""
        with self._send_lock:
            if self.error is not None:
                raise EngineDeadError(f"the engine process is gone: {self.error}")
            self._sent += 1
            self._conn.send(command)
            return self._sent

    def state(self) -> EngineState:
        return self._state

    def is_idle(self) -> bool:
        state = self._state
        return not state.has_work and state.applied == self._sent

    def is_alive(self) -> bool:
        return self._process.is_alive() and self.error is None

    def check_health(self) -> None:
        if not self.is_alive():
            raise EngineDeadError(f"the engine process is gone: {self.error}")

    def shutdown(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError), self._send_lock:  # OSError: already gone
            self._conn.send(Stop())
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        self._reader.join(timeout=10)
        self._conn.close()

    def _read(self) -> None:
        try:
            while True:
                kind, outputs, state = self._conn.recv()
                if kind == "dead":
                    raise EngineDeadError(f"engine loop died: {outputs}")
                self._state = state
                if outputs:
                    self._deliver(outputs)
        except EOFError:
            if self._stopping:
                return
            self._process.join(timeout=5)
            self.error = EngineDeadError(
                f"the engine process exited with code {self._process.exitcode}")
        except (OSError, EngineDeadError) as exc:
            self.error = exc
        logger.error("engine process failed: %s", self.error)
        self._fail(self.error if isinstance(self.error, EngineDeadError)
                   else EngineDeadError(str(self.error)))


@contextlib.contextmanager
def _environment_defaults(defaults: dict[str, str]) -> Iterator[None]:
    """Set the variables of `defaults` this process has no value for, while inside."""
    added = {name: value for name, value in defaults.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _pickle_by_position(cls: type) -> None:
    """Pickle a dataclass as its constructor's arguments: a step's deltas are a few objects a
    request, and unpickling them by keyword (pickle's default) costs the serving process
    three times as much."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    copyreg.pickle(cls, lambda obj: (cls, tuple(obj.__dict__[n] for n in names)))


def _engine_process_main(config: EngineConfig, conn: Connection, ip: str) -> None:
    """The engine process: load the engine, say it is ready, then step it with commands from
    the pipe and send each step's outputs back with the engine's state. `ip` is the node's
    address as the replica knows it (Ray does not run here): KV peers reach this process
    there."""
    os.environ[NODE_IP_ENV] = ip
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for cls in (RequestOutput, CompletionOutput, RequestMetrics):
        _pickle_by_position(cls)
    try:
        engine = Engine(config)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    # The state goes with "ready": the replica answers stats (KV blocks) before any step.
    conn.send(("ready", (EngineInfo.of(engine), engine.state())))

    def receive(busy: bool) -> list[Command] | None:
        if not conn.poll(0 if busy else _IDLE_WAIT_S):
            return []
        commands = []
        while True:
            command = conn.recv()  # EOFError: the serving process is gone
            if isinstance(command, Stop):
                return None
            commands.append(command)
            if not conn.poll(0):
                return commands

    def emit(outputs: list[RequestOutput], applied: int, busy: bool) -> None:
        for output in outputs:
            # The serving side has each request's prompt: sending it with every delta would
            # make most of a step's bytes (and of its pickling, on both sides).
            output.prompt, output.prompt_token_ids = None, []
        conn.send(("step", outputs, engine.state(applied, busy)))

    try:
        run_steps(engine, receive, emit)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the serving process is gone: so is the reason to run
    except BaseException as exc:
        logger.exception("engine loop died")
        with contextlib.suppress(OSError):
            conn.send(("dead", repr(exc), None))
    finally:
        engine.shutdown()
