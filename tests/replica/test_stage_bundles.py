"""Whether a replica's stages reserve GPUs: one rule for the Serve options that reserve the
bundles and the executor that starts the stages in them, checked without a GPU by handing it
the cluster's GPU count."""

from __future__ import annotations

import pytest

from tokenflow.config import EngineConfig, ModelConfig, ParallelConfig
from tokenflow.replica.worker import ray_executor, stage_bundles
from tokenflow.replica.worker.stage_bundles import replica_bundles, stages_use_gpu


@pytest.mark.parametrize(("device", "gpus", "expected"), [
    ("cuda", 0, True), ("cuda", 2, True),
    ("auto", 0, False), ("auto", 1, True),  # "auto" runs on a GPU where the cluster has one
    ("cpu", 0, False), ("cpu", 4, False),
])
def test_the_gpu_rule(device: str, gpus: float, expected: bool) -> None:
    assert stages_use_gpu(device, gpus) is expected


def _config(device: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(device=device),
                        parallel=ParallelConfig(pipeline_parallel_size=2, stage_num_cpus=2))


@pytest.mark.parametrize("gpus", [0, 4])
def test_auto_stages_reserve_a_gpu_where_the_cluster_has_them(gpus: float) -> None:
    """Under Serve, device "auto" on a cluster with GPUs: the executor gives each stage a
    GPU, so each stage's bundle must hold one."""
    bundles = replica_bundles(_config("auto"), {"num_cpus": 1}, gpus=gpus)
    assert bundles == [{"CPU": 3.0, **({"GPU": 1.0} if gpus else {})},
                       {"CPU": 2.0, **({"GPU": 1.0} if gpus else {})}]


def test_cuda_and_cpu_ignore_the_cluster() -> None:
    assert all(b["GPU"] == 1.0 for b in replica_bundles(_config("cuda"), {}, gpus=0))
    assert not any("GPU" in b for b in replica_bundles(_config("cpu"), {}, gpus=8))


def test_the_executor_asks_the_same_rule() -> None:
    assert ray_executor.stages_use_gpu is stage_bundles.stages_use_gpu
    assert ray_executor.cluster_gpus is stage_bundles.cluster_gpus


@pytest.mark.parametrize("control,use_gpu,want", [
    ("auto", False, "actor_calls"), ("auto", True, "compiled_graph"),
    ("compiled_graph", False, "compiled_graph"), ("actor_calls", True, "actor_calls")])
def test_pipeline_control_auto_spins_only_where_a_core_is_cheap(
        control: str, use_gpu: bool, want: str) -> None:
    """A compiled graph's reads spin a driver core: auto uses it on GPUs only."""
    assert ray_executor.resolve_pipeline_control(control, use_gpu) == want
