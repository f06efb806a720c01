"""KV transfer between engines: the connector API (`base`), the scheduler and worker halves
tokenflow's connectors share, and their transports (torch.distributed point-to-point, the Ray
object store). A connector is chosen by name in `KVTransferConfig.connector`: a registered name,
or `module:Class` for a user's: a class built without arguments whose `scheduler(config, *,
block_size, num_stages, get_block_ids)` and `worker(config, backend)` return its halves, a
`KVConnectorScheduler` and a `KVConnectorWorker` (see `base`).

The offload tier (`KVOffloadConfig`: evicted prefix blocks kept in CPU memory or on disk) is a
connector too (`offload_scheduler`, `offload_worker`); with a transfer connector as well, the
two run side by side in a `composite` connector."""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Callable
from typing import Any

from tokenflow.config import KVOffloadConfig, KVTransferConfig
from tokenflow.kv.connector.base import (
    ConnectorMeta,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadResult,
    LoadSpec,
    SaveSpec,
)
from tokenflow.kv.connector.composite import CompositeScheduler, CompositeWorker
from tokenflow.kv.connector.offload_scheduler import TIER_MEDIUM, OffloadScheduler
from tokenflow.kv.connector.scheduler_side import TransferScheduler

__all__ = [
    "CONNECTORS", "ConnectorMeta", "KVConnectorOutput", "KVConnectorScheduler",
    "KVConnectorWorker", "LoadResult", "LoadSpec", "SaveSpec", "TokenflowConnector",
    "OffloadScheduler", "combine_schedulers", "combine_workers", "create_offload_scheduler",
    "create_offload_worker", "create_scheduler_connector", "create_worker_connector",
]


class TokenflowConnector:
    """Builds both halves of one of tokenflow's connectors over a named transport."""

    def __init__(self, transport: str) -> None:
        self.transport = transport

    @property
    def holds_blocks(self) -> bool:
        return self.transport == "torch_p2p"

    def scheduler(self, config: KVTransferConfig, *, block_size: int, num_stages: int,
                  get_block_ids: Callable[[str], list[int]]) -> KVConnectorScheduler:
        return TransferScheduler(
            name=self.transport, engine_id=uuid.uuid4().hex, block_size=block_size,
            num_stages=num_stages, lease_s=config.lease_s, holds_blocks=self.holds_blocks,
            get_block_ids=get_block_ids)

    def worker(self, config: KVTransferConfig, backend: str) -> KVConnectorWorker:
        from tokenflow.kv.connector.worker_side import TransferWorker

        if self.transport == "torch_p2p":
            from tokenflow.kv.connector.torch_p2p import TorchP2PTransport

            transport: Any = TorchP2PTransport(backend, config.load_timeout_s)
        else:
            from tokenflow.kv.connector.ray_store import RayObjectTransport

            transport = RayObjectTransport()
        return TransferWorker(transport, config.load_timeout_s)


CONNECTORS: dict[str, Any] = {
    "torch_p2p": TokenflowConnector("torch_p2p"),
    "ray_object_store": TokenflowConnector("ray_object_store"),
}


def _connector(name: str) -> Any:
    if name in CONNECTORS:
        return CONNECTORS[name]
    module, sep, cls = name.partition(":")
    if not sep:
        raise ValueError(f"unknown KV connector {name!r}; registered: {', '.join(CONNECTORS)}, "
                         "or name a class as 'module:Class'")
    return getattr(importlib.import_module(module), cls)()


def create_scheduler_connector(config: KVTransferConfig, *, block_size: int, num_stages: int,
                               get_block_ids: Callable[[str], list[int]]
                               ) -> KVConnectorScheduler | None:
    if config.connector is None:
        return None
    return _connector(config.connector).scheduler(
        config, block_size=block_size, num_stages=num_stages, get_block_ids=get_block_ids)


def create_worker_connector(config: KVTransferConfig, backend: str) -> KVConnectorWorker | None:
    if config.connector is None:
        return None
    return _connector(config.connector).worker(config, backend)


# ------------------------------------------------------------------ the offload tier
def create_offload_scheduler(config: KVOffloadConfig, *, block_size: int, num_stages: int,
                             num_slots: int, take_evicted: Callable[[], list[Any]],
                             record_events: bool) -> OffloadScheduler | None:
    """The tier's scheduler half (None when off); `num_slots`: blocks every stage's store
    holds (the smallest stage's count)."""
    if not config.enabled or num_slots < 1:
        return None
    return OffloadScheduler(block_size=block_size, num_stages=num_stages, num_slots=num_slots,
                            take_evicted=take_evicted,
                            medium=TIER_MEDIUM[config.backend] if record_events else None)


def create_offload_worker(config: KVOffloadConfig) -> KVConnectorWorker | None:
    if not config.enabled:
        return None
    from tokenflow.kv.connector.offload_worker import OffloadWorker

    return OffloadWorker(config.backend, int(config.size_gb * 2**30), config.path)


def combine_schedulers(*parts: KVConnectorScheduler | None) -> KVConnectorScheduler | None:
    """None, the one part configured, or a `CompositeScheduler` of them (in this order)."""
    present = [p for p in parts if p is not None]
    if len(present) < 2:
        return present[0] if present else None
    return CompositeScheduler(present)


def combine_workers(*parts: KVConnectorWorker | None) -> KVConnectorWorker | None:
    present = [p for p in parts if p is not None]
    if len(present) < 2:
        return present[0] if present else None
    return CompositeWorker(present)
