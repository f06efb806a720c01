"""`TransferScheduler`: the scheduler half shared by tokenflow's connectors.

It tracks three kinds of request:
- loads (consumer): a request with `do_remote_prefill` params, its blocks allocated, waiting for
  every stage to report the load finished or failed;
- saves (producer): a request with `do_remote_decode`, published by every stage in the step its
  prefill completes, so `request_finished` can return where its blocks are;
- holds (producer, when the transport reads the producer's blocks in place): blocks kept after
  the request finished, until every stage reported it finished sending (its consumers read all
  the layers it published: with a consumer of more stages, every consumer stage that reads
  them), or the lease expired.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenflow.kv.connector.base import (
    ConnectorMeta,
    KVConnectorOutput,
    KVConnectorScheduler,
    LoadResult,
    LoadSpec,
    PendingLoad,
    RemoteRequest,
    SaveSpec,
)


@dataclass
class _Hold:
    deadline: float
    done: int = 0  # stages that reported the request finished sending (each reports it once)


class TransferScheduler(KVConnectorScheduler):
    """Owns the connector's view of loads, publishes and holds for one engine."""

    def __init__(self, *, name: str, engine_id: str, block_size: int, num_stages: int,
                 lease_s: float, holds_blocks: bool,
                 get_block_ids: Callable[[str], list[int]]) -> None:
        self.name = name
        self.engine_id = engine_id
        self.block_size = block_size
        self.num_stages = num_stages
        self.lease_s = lease_s
        # Whether the transport reads a producer's blocks in place (they must outlive the
        # request) or copies them out when publishing (they can be freed at once).
        self.holds_blocks = holds_blocks
        self._get_block_ids = get_block_ids
        self._loads: dict[str, PendingLoad[LoadSpec]] = {}
        self._to_load: list[LoadSpec] = []
        self._producers: dict[str, RemoteRequest] = {}
        self._published: dict[str, list[dict[str, Any]]] = {}
        self._holds: dict[str, _Hold] = {}
        self._releases: list[str] = []
        self._finished_loads: list[LoadResult] = []
        self._stats = [0, 0.0, 0]

    # ----------------------------------------------------------------- consumer side
    def get_num_new_matched_tokens(self, request: RemoteRequest,
                                   num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or request.request_id in self._loads:
            return 0, False
        if (params.get("block_size") != self.block_size
                or params.get("num_tokens") != request.num_prompt_tokens):
            return 0, False  # not this prompt's KV, or another block layout: recompute
        remote = int(params["num_tokens"])
        if request.num_tokens == request.num_prompt_tokens:
            # No first token came along (a router that sent just the producer's params): leave
            # the last prompt token to compute here, for the logits of the first token.
            remote -= 1
        return max(0, remote - num_computed), True

    def update_state_after_alloc(self, request: RemoteRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._producers[request.request_id] = request
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        start = request.num_computed_tokens  # the local prefix hits
        first = start // bs
        last = -(-(start + num_external_tokens) // bs)
        spec = LoadSpec(request.request_id, block_ids[first:last], first, params)
        self._loads[request.request_id] = PendingLoad(spec)
        self._to_load.append(spec)

    # ------------------------------------------------------------------------- steps
    def build_connector_meta(self, sched_out: Any) -> ConnectorMeta:
        meta = ConnectorMeta(self._to_load, [], self._releases)
        self._to_load, self._releases = [], []
        for spec in meta.loads:
            self._loads[spec.req_id].started = True
        for req_id in sched_out.num_scheduled_tokens:
            request = self._producers.get(req_id)
            if request is not None and request.num_computed_tokens >= request.num_prompt_tokens:
                # This step completes the prompt: its KV is written by the end of the step.
                del self._producers[req_id]
                self._published[req_id] = []
                num_blocks = -(-request.num_prompt_tokens // self.block_size)
                meta.saves.append(SaveSpec(req_id, self._get_block_ids(req_id)[:num_blocks],
                                           request.num_prompt_tokens))
        return meta

    def update_connector_output(self, outputs: list[KVConnectorOutput]) -> None:
        for out in outputs:
            for req_id, descriptor in out.published.items():
                if req_id in self._published:
                    self._published[req_id].append(descriptor)
            for req_id in out.finished_recving:
                self._stage_loaded(req_id, None)
            for req_id, reason in out.failed_recving.items():
                self._stage_loaded(req_id, reason)
            for req_id in out.finished_sending:  # this stage's layers were all read
                hold = self._holds.get(req_id)
                if hold is not None:
                    hold.done += 1
            self._stats[0] += out.bytes_received
            self._stats[1] += out.seconds_receiving

    def _stage_loaded(self, req_id: str, failure: str | None) -> None:
        load = self._loads.get(req_id)
        if load is None:
            return
        if load.stage_reported(failure, self.num_stages):
            del self._loads[req_id]
            self._stats[2] += bool(load.failures)
            self._finished_loads.append(load.result(req_id))

    def take_finished_loads(self) -> list[LoadResult]:
        results, self._finished_loads = self._finished_loads, []
        return results

    def cancel_load(self, req_id: str) -> bool:
        load = self._loads.get(req_id)
        if load is None:
            return False
        if not load.started:  # no worker has it yet
            del self._loads[req_id]
            self._to_load = [s for s in self._to_load if s.req_id != req_id]
            return False
        load.cancelled = True
        return True

    # ----------------------------------------------------------------- producer side
    def request_finished(self, request: RemoteRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._producers.pop(req_id, None)
        if self.cancel_load(req_id):  # a consumer request that ended while loading
            return False, None
        descriptors = self._published.pop(req_id, None)
        if not descriptors or len(descriptors) != self.num_stages:
            return False, None  # never published (aborted before its prefill completed)
        params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "connector": self.name,
            "num_tokens": request.num_prompt_tokens, "block_size": self.block_size,
            "stages": sorted(descriptors, key=lambda d: d["layers"][0]),
            "expires_at": time.time() + self.lease_s,
        }
        if not self.holds_blocks:
            self._holds[req_id] = _Hold(time.monotonic() + self.lease_s)  # the copies' lease
            return False, params
        self._holds[req_id] = _Hold(time.monotonic() + self.lease_s)
        return True, params

    def take_releasable(self, now: float) -> list[str]:
        done = [r for r, h in self._holds.items()
                if h.done >= self.num_stages or now >= h.deadline]
        for req_id in done:
            del self._holds[req_id]
        self._releases.extend(done)
        return done if self.holds_blocks else []

    def has_pending_transfers(self) -> bool:
        return bool(self._loads or self._holds or self._releases)

    def take_stats(self) -> tuple[int, float, int]:
        stats, self._stats = self._stats, [0, 0.0, 0]
        return stats[0], stats[1], stats[2]

    @property
    def num_holds(self) -> int:
        return len(self._holds)
