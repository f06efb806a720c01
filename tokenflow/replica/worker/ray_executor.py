"""RayExecutor: a replica's pipeline stages as Ray actors, one per stage, in a placement group.

Each step, every stage actor receives the SchedulerOutput (`parallel.pipeline_control`),
either through a Ray Compiled Graph (one input, one `execute_model` node per stage, up to one
execution in flight per stage; the control round trip costs well under a millisecond, but the
driver spins while it waits for a result) or by plain actor calls (one `ray.put` and one call
per stage: a few milliseconds, no spinning; bench/README.md). Either way each stage runs the
batches in the order the engine scheduled them. Activations travel between the stages over
`torch.distributed` (see `pipeline.py`), never through Ray. The last stage's return value is
the step's `ModelRunnerOutput`. Pings and timings use a separate concurrency group, so they
are answered while a step runs.

Placement: one bundle per stage (`{"CPU": n}`, or `{"GPU": 1, "CPU": n}`). Inside a Serve
replica that reserved them (`placement_group_bundles`), the stages go into that replica's
group; elsewhere (the offline `LLM`, tests) the executor creates its own group and removes it
on shutdown. A stage that dies fails the step it was in (and every other step in flight): the
executor kills the other stages, so none of them hangs in a receive. `recover()` then builds
the whole pipeline again in the same bundles (Ray places a bundle whose node died elsewhere, if
the cluster can), with empty KV caches; the engine starts its requests over. At most
`parallel.stage_rebuilds_per_minute` rebuilds in any `REBUILD_WINDOW_S`: a stage that dies more
often (a request or memory that kills it) leaves the executor dead, and the replica unhealthy
for Serve to replace.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from typing import Any

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelTimeoutError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenflow.config import EngineConfig, resolve_max_model_len
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.replica.worker.stage_bundles import cluster_gpus, stage_bundles, stages_use_gpu
from tokenflow.replica.worker.worker import Worker
from tokenflow.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
_START_TIMEOUT_S = 600.0
# A rebuilt pipeline must be up within this (a stage whose node is gone and whose bundle
# cannot be placed elsewhere must not hold the replica's requests for ten minutes).
_REBUILD_TIMEOUT_S = 120.0
REBUILD_WINDOW_S = 60.0


class StageDiedError(RuntimeError):
    """A pipeline stage died or stopped answering; the replica cannot run steps any more."""


class StageWorker(Worker):
    """A `Worker` run as a Ray actor: it can tell which node it is on, and answers pings and
    timing requests on its own thread while it runs a step."""

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        return self.stage

    @ray.method(concurrency_group="control")
    def take_timings(self) -> dict[str, float]:
        return super().take_timings()


def resolve_pipeline_control(control: str, use_gpu: bool) -> str:
    """`parallel.pipeline_control` made concrete: auto is a compiled graph on GPUs and plain
    actor calls on CPUs, where the graph's spinning reads take a core from the stages."""
    if control != "auto":
        return control
    return "compiled_graph" if use_gpu else "actor_calls"


class StepFuture:
    """One step in flight on every stage; `result()` is the last stage's output, or raises
    `StageDiedError` when a stage of the step fails (stages finish in order, so the first
    failure found is the stage that broke the pipeline)."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self._executor = executor
        self._refs = refs

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        timeout = self._executor.step_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        results = []
        for stage, ref in enumerate(self._refs):
            try:
                results.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
            except (GetTimeoutError, RayChannelTimeoutError) as exc:
                raise self._executor.fail(stage, f"no answer within {timeout:.0f} s") from exc
            except RayError as exc:
                raise self._executor.fail(stage, repr(exc)) from exc
        out = results[-1]
        assert isinstance(out, ModelRunnerOutput)
        # Every stage moves its own layers' KV: the scheduler hears from each.
        reports = [r for r in results[:-1] if r is not None]
        if reports:
            out.kv_connector_outputs = reports + (out.kv_connector_outputs or [])
        return out


class RayExecutor:
    """Owns a replica's stage actors, their placement group (unless a Serve replica lent it)
    and the liveness of the pipeline."""

    def __init__(self, config: EngineConfig) -> None:
        if not ray.is_initialized():
            # The offline LLM with stages: join RAY_ADDRESS, or start a cluster of our own.
            ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=False)
        arch = resolve_model(config.model.model).arch_config()
        self.vocab_size = arch.vocab_size
        self.step_timeout_s = config.parallel.step_timeout_s
        self._config = config
        # The failure, the pings and the rebuild are shared with health checks on other
        # threads (re-entrant: a health check that finds a dead stage calls `fail`).
        self._lock = threading.RLock()
        self._failure: str | None = None
        self._rebuilding = False
        self._pings: list[ray.ObjectRef] = []
        self._graph: Any = None
        self.num_rebuilds = 0
        self._rebuilds: deque[float] = deque()  # when each rebuild in the window began
        # The rule the Serve options reserved the replica's bundles by.
        use_gpu = stages_use_gpu(config.model.device, cluster_gpus())
        self.kv_medium = "GPU" if use_gpu else "CPU"
        self.control = resolve_pipeline_control(config.parallel.pipeline_control, use_gpu)
        self._bundles = stage_bundles(config, use_gpu)
        self._pg, self._owns_pg = self._placement_group(self._bundles, config)
        self._actors = self._create_actors()
        try:
            blocks = self._start(_START_TIMEOUT_S)
            self.num_blocks = min(blocks)
            self.num_offload_blocks = min(ray.get(
                [a.num_offload_blocks.remote() for a in self._actors], timeout=_START_TIMEOUT_S))
            self.max_model_len = resolve_max_model_len(config, arch.max_position_embeddings,
                                                       self.num_blocks)
            self._init_caches()
        except BaseException:
            self.shutdown()
            raise

    def _create_actors(self) -> list[Any]:
        actor_cls = ray.remote(concurrency_groups={"control": 1})(StageWorker)
        pipeline_id = uuid.uuid4().hex[:8]
        return [
            actor_cls.options(
                # Named, so an operator (or a test) can find one stage of one pipeline.
                name=f"tokenflow-stage{k}-{pipeline_id}",
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=k),
            ).remote(self._config, k)
            for k, bundle in enumerate(self._bundles)]

    @staticmethod
    def _placement_group(bundles: list[dict[str, float]], config: EngineConfig
                         ) -> tuple[PlacementGroup, bool]:
        current = get_current_placement_group()
        if current is not None:  # a Serve replica that reserved its stages' bundles
            if len(current.bundle_specs) < len(bundles):
                raise ValueError(f"the replica's placement group has {len(current.bundle_specs)}"
                                 f" bundles for {len(bundles)} pipeline stages")
            return current, False
        pg = placement_group(bundles, strategy=config.parallel.placement_strategy)
        try:
            ray.get(pg.ready(), timeout=_START_TIMEOUT_S)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(f"the cluster cannot place {len(bundles)} pipeline stages of "
                               f"{bundles[0]} ({config.parallel.placement_strategy})") from None
        return pg, True

    def _start(self, timeout_s: float) -> list[int]:
        """Join the stages into one pipe; returns the KV blocks each can hold."""
        actors = self._actors
        ips = ray.get([a.node_ip.remote() for a in actors], timeout=timeout_s)
        master = ray.get(actors[0].rendezvous_address.remote(ips[0]), timeout=timeout_s)
        # Every stage at once: joining the group blocks until all of them joined.
        ray.get([a.init_pipe.remote(master, ip) for a, ip in zip(actors, ips, strict=True)],
                timeout=timeout_s)
        self.stage_nodes = ips
        return ray.get([a.num_blocks_available.remote() for a in actors], timeout=timeout_s)

    def _init_caches(self) -> None:
        """Give every stage its KV cache (and build the compiled graph over them)."""
        actors = self._actors
        ray.get([a.init_cache.remote(self.num_blocks, self.max_model_len) for a in actors])
        if self.control == "compiled_graph":
            with InputNode() as sched_out:
                steps = MultiOutputNode([a.execute_model.bind(sched_out) for a in actors])
            self._graph = steps.experimental_compile(_max_inflight_executions=len(actors))
        logger.info("pipeline of %d stages on %s, %d KV blocks each, control by %s",
                    len(actors), self.stage_nodes, self.num_blocks, self.control)

    # ------------------------------------------------------------------------- steps
    def execute_model(self, sched_out: SchedulerOutput) -> StepFuture:
        if self._failure is not None:
            raise StageDiedError(self._failure)
        if self._graph is not None:
            return StepFuture(self, self._graph.execute(sched_out))
        ref = ray.put(sched_out)  # pickled once for every stage
        return StepFuture(self, [a.execute_model.remote(ref) for a in self._actors])

    def fail(self, stage: int, reason: str) -> StageDiedError:
        """Record that `stage` failed, stop every stage (none may hang waiting for it), and
        return the error to raise."""
        with self._lock:
            if self._failure is None:
                self._failure = f"pipeline stage {stage} of {len(self._actors)} died: {reason}"
                logger.error("%s; stopping the pipeline", self._failure)
                self._kill_actors()
            return StageDiedError(self._failure)

    def may_recover(self) -> bool:
        """Whether `recover()` would try a rebuild (fewer than the configured number in the
        last `REBUILD_WINDOW_S`)."""
        now = time.monotonic()
        while self._rebuilds and now - self._rebuilds[0] > REBUILD_WINDOW_S:
            self._rebuilds.popleft()
        return len(self._rebuilds) < self._config.parallel.stage_rebuilds_per_minute

    def recover(self) -> bool:
        """After a stage died: build every stage again in the same bundles, with empty KV
        caches of the same size (again, while the budget lasts, if a new stage dies while it
        starts). True when steps can run again (every request and all KV the old stages held
        are gone); False when the pipeline stays dead (past the budget, or the new stages did
        not come up). Runs on the engine's thread; health checks meanwhile pass
        (`_rebuilding`) and send no pings."""
        with self._lock:
            if self._failure is None:
                return True
            failure = self._failure
            self._rebuilding, self._pings = True, []
        try:
            while self.may_recover():
                self._rebuilds.append(time.monotonic())
                logger.warning("rebuilding the pipeline after: %s", failure)
                try:
                    self._rebuild()
                except Exception as exc:  # a new stage died too, or never came up
                    self._kill_actors()
                    failure = f"{failure}; rebuilding it failed: {exc!r}"
                    logger.error("%s", failure)
                    continue
                with self._lock:
                    self._failure = None
                    self.num_rebuilds += 1
                return True
            with self._lock:
                self._failure = failure
            return False
        finally:
            with self._lock:
                self._rebuilding = False

    def _rebuild(self) -> None:
        self._actors = self._create_actors()
        blocks = self._start(_REBUILD_TIMEOUT_S)
        if min(blocks) < self.num_blocks:
            raise RuntimeError(f"the new stages hold {min(blocks)} KV blocks, not "
                               f"{self.num_blocks}")
        self._init_caches()

    def check_health(self) -> None:
        """Raise if a stage died and the pipeline cannot be rebuilt (a death the engine's
        next step repairs with `recover()` is not a reason to replace the replica). Never
        waits: stages answer pings only between steps, so a ping sent at the previous check
        is looked at now. Called from any thread."""
        with self._lock:
            if self._rebuilding:
                return
            if self._failure is None and self._pings:
                done, _ = ray.wait(self._pings, num_returns=len(self._pings), timeout=0)
                for k, ref in enumerate(self._pings):
                    if ref in done:
                        try:
                            ray.get(ref)
                        except RayActorError as exc:
                            self.fail(k, repr(exc))
                if len(done) == len(self._pings):
                    self._pings = []
            if self._failure is not None:
                if self.may_recover():
                    return
                raise StageDiedError(self._failure)
            if not self._pings:
                self._pings = [a.ping.remote() for a in self._actors]

    def take_timings(self) -> list[dict[str, float]]:
        """Each stage's `StageTimings` since the last call (for benchmarks)."""
        return ray.get([a.take_timings.remote() for a in self._actors])

    # ---------------------------------------------------------------------- shutdown
    def _kill_actors(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.teardown()
            except Exception as exc:  # a stage is already dead
                logger.debug("tearing the compiled graph down: %r", exc)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone
                logger.debug("killing a stage actor: %r", exc)

    def shutdown(self) -> None:
        self._kill_actors()
        if self._owns_pg:
            try:
                remove_placement_group(self._pg)
            except Exception as exc:  # the cluster is going away too
                logger.debug("removing the placement group: %r", exc)
            self._owns_pg = False
