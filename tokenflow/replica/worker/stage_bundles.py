"""What a replica's pipeline stages reserve: one placement-group bundle per stage.

Two places decide whether a stage runs on a GPU: the Serve options, when they reserve the
replica's bundles, and the executor, when it starts the stage actors inside them. Both ask
`stages_use_gpu`, so that a stage never requests a GPU its bundle lacks (or the reverse)."""

from __future__ import annotations

from typing import Any

from tokenflow.config import EngineConfig


def stages_use_gpu(device: str, cluster_gpus: float) -> bool:
    """Whether each stage reserves a GPU: always for "cuda", never for "cpu"; for "auto" when
    the cluster has GPUs (a stage given one then sees CUDA, and "auto" resolves to it)."""
    return device == "cuda" or (device == "auto" and cluster_gpus > 0)


def cluster_gpus() -> float:
    """The GPUs of the Ray cluster this process is connected to; none when it is not (a config
    check outside any cluster)."""
    import ray

    if not ray.is_initialized():
        return 0.0
    return float(ray.cluster_resources().get("GPU", 0))


def stage_bundles(config: EngineConfig, use_gpu: bool) -> list[dict[str, float]]:
    """The placement-group bundle of each stage, first stage first."""
    cpus = config.parallel.stage_num_cpus
    bundle = {"CPU": cpus, "GPU": 1.0} if use_gpu else {"CPU": cpus}
    return [dict(bundle) for _ in range(config.parallel.pipeline_parallel_size)]


def replica_bundles(config: EngineConfig, replica_resources: dict[str, Any],
                    gpus: float | None = None) -> list[dict[str, float]]:
    """A Serve replica's `placement_group_bundles` for its pipeline: the stage bundles, the
    replica's own resources merged into the first (Serve places the replica in bundle 0).
    `gpus`: the cluster's GPU count (None: ask the cluster)."""
    gpus = cluster_gpus() if gpus is None else gpus
    bundles = stage_bundles(config, use_gpu=stages_use_gpu(config.model.device, gpus))
    first = bundles[0]
    first["CPU"] = first.get("CPU", 0) + float(replica_resources.get("num_cpus", 0) or 0)
    if replica_resources.get("num_gpus"):
        first["GPU"] = first.get("GPU", 0) + float(replica_resources["num_gpus"])
    return bundles
