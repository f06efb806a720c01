"""The scheduler's side of KV transfer, one helper so that `schedule()` stays the rule.

The offload tier (a connector too, beside the transfer one or alone) parks a request the same
way while its prefix loads back from CPU memory or disk; a failed load is recomputed.

Consumer: a request whose prompt KV another engine computed (`do_remote_prefill`) gets its
blocks allocated at admission and waits in WAITING_FOR_REMOTE_KVS, keeping its place in the
queue, while the workers load them. Loaded and verified, the blocks join the prefix cache and
the request's computed tokens count them; failed (the producer died, a timeout, a checksum),
the request keeps its blocks and computes its prompt itself. Either way it becomes WAITING
again and is admitted like any request that already holds blocks.

Producer: a request with `do_remote_decode` is published by the workers when its prefill
completes; when it finishes, its blocks are held for the consumer (when the transport reads
them in place) until the consumer is done or the lease expires.

Aborts: a request aborted while its blocks are being loaded keeps them until the load ends,
so no worker writes into blocks another request was given.
"""

from __future__ import annotations

import time
from typing import Any

from tokenflow.kv import KVCacheBlock, KVCacheManager
from tokenflow.kv.connector import KVConnectorScheduler
from tokenflow.scheduler.engine_output import EngineCoreOutput
from tokenflow.scheduler.request import Request, RequestStatus


class RemoteKV:
    """Owns the connector's scheduler half and the requests it keeps: parked loads, blocks held
    for a consumer, and aborted requests whose load has not ended yet."""

    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        # Each parked request, its tokens once loaded, and the status it returns to.
        self._parked: dict[str, tuple[Request, int, RequestStatus]] = {}
        self._held: dict[str, Request] = {}
        self._aborted_loading: dict[str, Request] = {}

    @property
    def num_waiting(self) -> int:
        return len(self._parked)

    def has_pending(self) -> bool:
        return bool(self._parked or self._held or self._aborted_loading
                    or self.connector.has_pending_transfers())

    # ------------------------------------------------------------------- admission
    def try_park(self, request: Request, hit_blocks: list[KVCacheBlock],
                 num_hit: int) -> bool | None:
        """Park `request` while its remaining prompt KV loads: True if parked, None if its
        blocks do not fit now (try again later), False if it has nothing to load."""
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if num_external <= 0 or not load_async:
            return False
        # The blocks join the prefix cache only once their KV arrived and was verified.
        if self.kv.allocate_slots(request, num_external, num_hit, hit_blocks,
                                  delay_cache_blocks=True) is None:
            return None
        self.kv.record_prefix_lookup(request.num_tokens, num_hit)
        request.num_computed_tokens = num_hit
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), num_external)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        # A preempted request (its prefix hit the offload tier) resumes as preempted: the
        # workers still know it.
        back = (RequestStatus.PREEMPTED if request.status == RequestStatus.PREEMPTED
                else RequestStatus.WAITING)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._parked[request.request_id] = (request, num_hit + num_external, back)
        return True

    def note_admitted(self, request: Request) -> None:
        """Producers register too: the workers must publish them when their prefill ends."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self.connector.update_state_after_alloc(
                request, self.kv.get_block_ids(request.request_id), 0)

    # ------------------------------------------------------------------------ steps
    def before_schedule(self) -> list[Request]:
        """Resume requests whose load ended; returns requests whose blocks may now be freed
        (held ones released, aborted ones whose load ended)."""
        to_free = []
        for result in self.connector.take_finished_loads():
            aborted = self._aborted_loading.pop(result.req_id, None)
            if aborted is not None:
                to_free.append(aborted)
                continue
            parked = self._parked.pop(result.req_id, None)
            if parked is None:
                continue
            request, num_loaded, back = parked
            if result.ok:
                request.num_computed_tokens = num_loaded
                self.kv.cache_blocks(request, num_loaded)
            elif request.kv_transfer_params and request.kv_transfer_params.get(
                    "do_remote_prefill"):
                request.kv_transfer_params = None  # compute the prompt here instead
            request.status = back
        for req_id in self.connector.take_releasable(time.monotonic()):
            held = self._held.pop(req_id, None)
            if held is not None:
                to_free.append(held)
        return to_free

    def build_meta(self, sched_out: Any) -> Any:
        return self.connector.build_connector_meta(sched_out)

    def after_step(self, connector_outputs: list[Any] | None) -> None:
        if connector_outputs:
            self.connector.update_connector_output(connector_outputs)

    # ----------------------------------------------------------------------- endings
    def on_finished(self, request: Request, out: EngineCoreOutput | None) -> bool:
        """A request finished: True if its blocks must be held for a consumer (not freed)."""
        delay_free, params = self.connector.request_finished(
            request, self.kv.get_block_ids(request.request_id))
        if out is not None and params is not None:
            out.kv_transfer_params = params
        if delay_free:
            self._held[request.request_id] = request
        return delay_free

    def on_abort(self, request: Request) -> bool:
        """An abort: True if the request's blocks must outlive it until its load ends."""
        self._parked.pop(request.request_id, None)
        if self.connector.cancel_load(request.request_id):
            self._aborted_loading[request.request_id] = request
            return True
        return False

    def take_stats(self) -> tuple[int, float, int]:
        return self.connector.take_stats()
