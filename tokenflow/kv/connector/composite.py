"""Two connectors side by side: a P/D transfer connector and the offload tier, when an engine
has both. Each part sees only its own metadata and its own reports (`CompositeMeta`,
`CompositeOutput`: one entry per part, in order), so neither needs to know the other exists.

A request's load belongs to the first part that claims tokens for it
(`get_num_new_matched_tokens`): a P/D consumer's prompt comes from its producer; any other
request may extend its prefix hit from the tier. Everything else goes to every part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenflow.kv.connector.base import (
    ConnectorMeta,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadResult,
    RemoteRequest,
)


@dataclass
class CompositeMeta(ConnectorMeta):
    parts: list[ConnectorMeta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(self.parts)


@dataclass
class CompositeOutput(KVConnectorOutput):
    parts: list[KVConnectorOutput] = field(default_factory=list)

    def is_empty(self) -> bool:
        return all(part.is_empty() for part in self.parts)


class CompositeScheduler(KVConnectorScheduler):
    """Owns its parts and which of them claimed each request's load."""

    def __init__(self, parts: list[KVConnectorScheduler]) -> None:
        self.parts = parts
        self._claims: dict[str, KVConnectorScheduler] = {}

    def get_num_new_matched_tokens(self, request: RemoteRequest,
                                   num_computed: int) -> tuple[int, bool]:
        for part in self.parts:
            num, load_async = part.get_num_new_matched_tokens(request, num_computed)
            if num > 0:
                self._claims[request.request_id] = part
                return num, load_async
        return 0, False

    def update_state_after_alloc(self, request: RemoteRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        claim = self._claims.pop(request.request_id, None)
        for part in self.parts:
            part.update_state_after_alloc(request, block_ids,
                                          num_external_tokens if part is claim else 0)

    def build_connector_meta(self, sched_out: Any) -> CompositeMeta:
        return CompositeMeta(parts=[p.build_connector_meta(sched_out) for p in self.parts])

    def request_finished(self, request: RemoteRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = False, None
        for part in self.parts:
            part_delay, part_params = part.request_finished(request, block_ids)
            delay_free = delay_free or part_delay
            params = params if params is not None else part_params
        return delay_free, params

    def update_connector_output(self, outputs: list[KVConnectorOutput]) -> None:
        for i, part in enumerate(self.parts):
            part.update_connector_output([out.parts[i] for out in outputs])  # type: ignore[attr-defined]

    def take_finished_loads(self) -> list[LoadResult]:
        return [result for part in self.parts for result in part.take_finished_loads()]

    def take_releasable(self, now: float) -> list[str]:
        return [req_id for part in self.parts for req_id in part.take_releasable(now)]

    def cancel_load(self, req_id: str) -> bool:
        self._claims.pop(req_id, None)
        return any([part.cancel_load(req_id) for part in self.parts])

    def has_pending_transfers(self) -> bool:
        return any(part.has_pending_transfers() for part in self.parts)

    def take_stats(self) -> tuple[int, float, int]:
        stats = [part.take_stats() for part in self.parts]
        return (sum(s[0] for s in stats), sum(s[1] for s in stats), sum(s[2] for s in stats))


class CompositeWorker(KVConnectorWorker):
    """Owns its parts; each gets its own share of the metadata."""

    def __init__(self, parts: list[KVConnectorWorker]) -> None:
        self.parts = parts

    def register_kv_caches(self, kv_caches: list[Any], layer_range: tuple[int, int]) -> None:
        for part in self.parts:
            part.register_kv_caches(kv_caches, layer_range)

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        assert isinstance(meta, CompositeMeta)
        pairs = list(zip(self.parts, meta.parts, strict=True))
        # A part that copies out the blocks this step evicts (the offload tier) goes first: a
        # transfer's loads start writing at once, on a thread of their own, into blocks newly
        # given to their request, which may be those very blocks (the tier then kept the
        # loaded KV under the evicted block's hash, and served it later as that block).
        pairs.sort(key=lambda pair: not pair[0].stores_evicted_blocks)
        for part, part_meta in pairs:
            part.start_load_kv(part_meta)

    def wait_for_layer_load(self, layer: int) -> None:
        for part in self.parts:
            part.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, meta: ConnectorMeta) -> None:
        assert isinstance(meta, CompositeMeta)
        for part, part_meta in zip(self.parts, meta.parts, strict=True):
            part.save_kv_layer(layer, part_meta)

    def wait_for_save(self) -> None:
        for part in self.parts:
            part.wait_for_save()

    def get_finished(self, wait_s: float = 0.0) -> CompositeOutput:
        # Only the last part may wait, and only if nothing ended in the others.
        outs = [part.get_finished(0.0) for part in self.parts[:-1]]
        waited = 0.0 if any(not out.is_empty() for out in outs) else wait_s
        outs.append(self.parts[-1].get_finished(waited))
        return CompositeOutput(parts=outs)

    def shutdown(self) -> None:
        for part in self.parts:
            part.shutdown()
