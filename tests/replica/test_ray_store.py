"""The Ray object store transport gives its published copies back: a released copy leaves the
object store (out-of-band references are pinned by Ray until unpinned)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import Cluster
from tokenflow.kv.connector.ray_store import RayObjectTransport


def _owned_refs() -> set[bytes]:
    import ray

    return set(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


@pytest.mark.slow
def test_a_released_copy_leaves_the_object_store(cluster: Cluster) -> None:
    transport = RayObjectTransport()
    before = _owned_refs()
    blocks = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    descriptor = transport.publish("req-1", [0, 1, 2], blocks)
    assert _owned_refs() - before, "the published copy is held"
    # A consumer's read (here in the same process) sees the copy.
    assert torch.equal(transport.fetch(descriptor, [2, 0], timeout_s=10), blocks[[2, 0]])
    transport.release("req-1")
    assert _owned_refs() - before == set(), "a released copy must not stay pinned"
    transport.close()
