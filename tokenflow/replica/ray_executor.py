"""RayExecutor: a replica's pipeline stages as Ray actors, one per stage, in a placement group.

Each step, every stage actor receives the SchedulerOutput (plain actor calls, submitted in
order, so each stage runs the batches in the order the engine scheduled them); activations
travel between the stages over `torch.distributed` (see `pipeline.py`), never through Ray.
The last stage's return value is the step's `ModelRunnerOutput`.

Placement: one bundle per stage (`{"CPU": n}`, or `{"GPU": 1, "CPU": n}`). Inside a Serve
replica that reserved them (`placement_group_bundles`), the stages go into that replica's
group; elsewhere (the offline `LLM`, tests) the executor creates its own group and removes it
on shutdown. A stage that dies fails the step it was in (and every other step in flight): the
executor kills the other stages, so none of them hangs in a receive, and reports itself dead.
"""

from __future__ import annotations

import logging
import time
import uuid

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenflow.config import EngineConfig, resolve_max_model_len
from tokenflow.replica.model_source import resolve_model
from tokenflow.replica.stage_bundles import stage_bundles
from tokenflow.replica.worker import Worker
from tokenflow.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
_START_TIMEOUT_S = 600.0


class StageDiedError(RuntimeError):
    """A pipeline stage died or stopped answering; the replica cannot run steps any more."""


class StageWorker(Worker):
    """A `Worker` run as a Ray actor: it can tell which node it is on."""

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


def wants_gpu(config: EngineConfig) -> bool:
    device = config.model.device
    return device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)


class StepFuture:
    """One step in flight on every stage; `result()` is the last stage's output, or raises
    `StageDiedError` as soon as any stage of the step fails."""

    def __init__(self, executor: RayExecutor, refs: list[ray.ObjectRef]) -> None:
        self._executor = executor
        self._refs = refs

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        timeout = self._executor.step_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        stage_of = {ref: k for k, ref in enumerate(self._refs)}
        pending = list(self._refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stage = stage_of[pending[0]]
                raise self._executor.fail(stage, f"no answer within {timeout:.0f} s")
            for ref in ready:
                try:
                    value = ray.get(ref)
                except RayError as exc:
                    raise self._executor.fail(stage_of[ref], repr(exc)) from exc
                if stage_of[ref] == len(self._refs) - 1:
                    out = value
        return out


class RayExecutor:
    """Owns a replica's stage actors, their placement group (unless a Serve replica lent it)
    and the liveness of the pipeline."""

    def __init__(self, config: EngineConfig) -> None:
        arch = resolve_model(config.model.model).arch_config()
        self.vocab_size = arch.vocab_size
        self.step_timeout_s = config.parallel.step_timeout_s
        self._failure: str | None = None
        self._pings: list[ray.ObjectRef] = []
        use_gpu = wants_gpu(config)
        bundles = stage_bundles(config, use_gpu)
        self._pg, self._owns_pg = self._placement_group(bundles, config)
        actor_cls = ray.remote(StageWorker)
        pipeline_id = uuid.uuid4().hex[:8]
        self._actors = [
            actor_cls.options(
                # Named, so an operator (or a test) can find one stage of one pipeline.
                name=f"tokenflow-stage{k}-{pipeline_id}",
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=k),
            ).remote(config, k)
            for k, bundle in enumerate(bundles)]
        try:
            self._start(config, arch.max_position_embeddings)
        except BaseException:
            self.shutdown()
            raise

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

    def _start(self, config: EngineConfig, model_max_len: int) -> None:
        actors = self._actors
        ips = ray.get([a.node_ip.remote() for a in actors], timeout=_START_TIMEOUT_S)
        master = ray.get(actors[0].rendezvous_address.remote(ips[0]))
        # Every stage at once: joining the group blocks until all of them joined.
        ray.get([a.init_pipe.remote(master, ip) for a, ip in zip(actors, ips, strict=True)],
                timeout=_START_TIMEOUT_S)
        blocks = ray.get([a.num_blocks_available.remote() for a in actors])
        self.num_blocks = min(blocks)
        self.max_model_len = resolve_max_model_len(config, model_max_len, self.num_blocks)
        ray.get([a.init_cache.remote(self.num_blocks, self.max_model_len) for a in actors])
        self.stage_nodes = ips
        logger.info("pipeline of %d stages on %s, %d KV blocks each", len(actors), ips,
                    self.num_blocks)

    # ------------------------------------------------------------------------- steps
    def execute_model(self, sched_out: SchedulerOutput) -> StepFuture:
        if self._failure is not None:
            raise StageDiedError(self._failure)
        # Pickled once, not once per stage.
        ref = ray.put(sched_out)
        return StepFuture(self, [a.execute_model.remote(ref) for a in self._actors])

    def fail(self, stage: int, reason: str) -> StageDiedError:
        """Record that `stage` failed, stop every stage (none may hang waiting for it), and
        return the error to raise."""
        if self._failure is None:
            self._failure = f"pipeline stage {stage} of {len(self._actors)} died: {reason}"
            logger.error("%s; stopping the pipeline", self._failure)
            self._kill_actors()
        return StageDiedError(self._failure)

    def check_health(self) -> None:
        """Raise if a stage died. Never waits: stages answer pings only between steps, so a
        ping sent at the previous check is looked at now."""
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
            raise StageDiedError(self._failure)
        if not self._pings:
            self._pings = [a.ping.remote() for a in self._actors]

    def actor_ids(self) -> list[str]:
        return [a._actor_id.hex() for a in self._actors]

    # ---------------------------------------------------------------------- shutdown
    def _kill_actors(self) -> None:
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
