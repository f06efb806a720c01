"""The Ray object store transport: the producer copies a request's blocks into the object store
when it publishes them; the reference travels in `kv_transfer_params`; the consumer fetches it,
from whichever node holds it.

The blocks can be freed at once (the copy serves the consumer); the copy itself is kept until
the lease runs out, then deleted. A consumer that fetches after that, or from a producer that
died (the owner of the object), gets an error: a failed load, which it recomputes.
"""

from __future__ import annotations

import base64
import threading
from typing import Any

import ray
import torch
from ray import cloudpickle


class RayObjectTransport:
    """Owns the object references of the blocks this worker published, until released."""

    holds_blocks = False

    def __init__(self) -> None:
        if not ray.is_initialized():
            raise RuntimeError("the ray_object_store KV connector needs a Ray cluster")
        self._refs: dict[str, ray.ObjectRef] = {}
        self._lock = threading.Lock()

    def publish(self, req_id: str, block_ids: list[int], blocks: torch.Tensor
                ) -> dict[str, Any]:
        ref = ray.put(blocks.to("cpu"))
        with self._lock:
            self._refs[req_id] = ref
        # The reference leaves Ray's own serialization (it travels as JSON through HTTP):
        # pickled with its owner's address, and kept alive here until released.
        return {"transport": "ray_object_store",
                "ref": base64.b64encode(cloudpickle.dumps(ref)).decode()}

    def fetch(self, descriptor: dict[str, Any], indices: list[int], timeout_s: float,
              layers: tuple[int, int] | None = None) -> torch.Tensor:
        ref = cloudpickle.loads(base64.b64decode(descriptor["ref"]))
        blocks = ray.get(ref, timeout=timeout_s)
        return blocks[indices]

    def release(self, req_id: str) -> None:
        with self._lock:
            ref = self._refs.pop(req_id, None)
        if ref is not None:
            _unpin(ref)

    def take_finished_reads(self) -> list[tuple[str, tuple[int, int]]]:
        # The consumer reads the copy and tells nobody: the copy lives out its lease.
        return []

    def close(self) -> None:
        for req_id in list(self._refs):
            self.release(req_id)


def _unpin(ref: ray.ObjectRef) -> None:
    """Let the object go once nobody holds it. Pickling a reference out of band (with
    cloudpickle, not through a task) makes Ray pin it with one local reference for the
    worker's lifetime, and Ray 2.60 has no public call to free it; removing that one
    reference undoes exactly the pin, so it is freed when the last holder (this dict's entry,
    a consumer still fetching) lets go."""
    ray._private.worker.global_worker.core_worker.remove_object_ref_reference(ref)
