"""What a replica's pipeline stages reserve: one placement-group bundle per stage."""

from __future__ import annotations

from typing import Any

from tokenflow.config import EngineConfig


def stage_bundles(config: EngineConfig, use_gpu: bool) -> list[dict[str, float]]:
    """The placement-group bundle of each stage, first stage first."""
    cpus = config.parallel.stage_num_cpus
    bundle = {"CPU": cpus, "GPU": 1.0} if use_gpu else {"CPU": cpus}
    return [dict(bundle) for _ in range(config.parallel.pipeline_parallel_size)]


def replica_bundles(config: EngineConfig, replica_resources: dict[str, Any]
                    ) -> list[dict[str, float]]:
    """A Serve replica's `placement_group_bundles` for its pipeline: the stage bundles, the
    replica's own resources merged into the first (Serve places the replica in bundle 0)."""
    bundles = stage_bundles(config, use_gpu=config.model.device == "cuda")
    first = bundles[0]
    first["CPU"] = first.get("CPU", 0) + float(replica_resources.get("num_cpus", 0) or 0)
    if replica_resources.get("num_gpus"):
        first["GPU"] = first.get("GPU", 0) + float(replica_resources["num_gpus"])
    return bundles
