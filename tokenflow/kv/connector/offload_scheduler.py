"""`OffloadScheduler`: the scheduler half of the offload tier (a second KV tier, CPU memory or
disk, for prefix blocks evicted from the primary pool), a `KVConnectorScheduler` as vLLM's
offloading connector is.

What it decides, and why here. The tier is `num_slots` slots of one block each, in every
pipeline stage (each stage holds its own layers' share of a block). This half owns the index
`hash -> (slot, token ids)` in LRU order and tells every stage, each step, which slots to
write and which to read: all stages get the same orders, so they hold the same hashes, and a
hit found here is present in every stage (a stage that finds its copy corrupt or missing
reports the load failed; the request recomputes those tokens).

When blocks are stored: at eviction, not when computed. A block evicted from the primary pool
in `schedule()` still holds its KV until a step writes over it; the step the scheduler is
building is the first that can, and its workers copy the evicted blocks out (`start_load_kv`,
before the forward) before anything else. So only blocks that actually leave the pool are
copied (storing every computed block, as vLLM does, copies blocks that are hit in place or
never evicted), and no copy has to finish before reuse at a later time. A block already in
the tier under the same hash and tokens is only touched (moved to the LRU's recent end).

Hits. `get_num_new_matched_tokens` extends a request's primary-pool prefix hit with the
tier's chain of full blocks (tokens compared, so a hash collision is a miss), short of the
last prompt token; the request waits in WAITING_FOR_REMOTE_KVS while every stage copies the
slots into the blocks it was given and verifies each block's checksum, then its blocks join
the prefix cache. The slots it reads are pinned until every stage reported, so no store
reuses them meanwhile. A failed load drops its entries from the index (recompute, never
serve). Stores and loads of one step never touch the same slot: a hit names only entries
stored by an earlier step, and a store takes an unpinned slot.

Events (with `medium` set): a `BlockStored` per stored block and a `BlockRemoved` per entry
the tier dropped (LRU or a failed load), named `medium` ("CPU_OFFLOAD" or "DISK": "CPU" is a
CPU engine's primary pool).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenflow.kv.connector.base import (
    ConnectorMeta,
    KVConnectorOutput,
    KVConnectorScheduler,
    LoadResult,
    PendingLoad,
    RemoteRequest,
)
from tokenflow.kv.events import BlockRemoved, BlockStored, KVCacheEvent

# What KV-cache events call each backend's blocks ("CPU" is a CPU engine's primary pool).
TIER_MEDIUM = {"cpu": "CPU_OFFLOAD", "disk": "DISK"}


class TierRequest(RemoteRequest, Protocol):
    """What a tier lookup reads besides `RemoteRequest` (a `KVRequest`'s hashes and tokens)."""

    block_hashes: list[int]
    all_token_ids: list[int]


@dataclass
class TierLoad:
    """Copy tier `slots` into this engine's `block_ids` (same length, in order)."""

    req_id: str
    block_ids: list[int]
    slots: list[int]
    hashes: list[int]  # what each slot must hold (the store checks it, with the checksum)


@dataclass
class OffloadMeta(ConnectorMeta):
    """One step's tier orders: first store `store_block_ids` into `store_slots` (under
    `store_hashes`), then start `tier_loads`. Pickles small: ints only."""

    store_block_ids: list[int] = field(default_factory=list)
    store_slots: list[int] = field(default_factory=list)
    store_hashes: list[int] = field(default_factory=list)
    tier_loads: list[TierLoad] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.store_slots or self.tier_loads)


@dataclass
class _Entry:
    slot: int
    token_ids: tuple[int, ...]


@dataclass
class TierStats:
    """Counters since the last `take_tier_stats`."""

    hit_tokens: int = 0  # tokens loaded from the tier (verified, every stage)
    stored_blocks: int = 0
    failures: int = 0  # loads that failed a checksum or found a block missing: recomputed


class OffloadScheduler(KVConnectorScheduler):
    """Owns the tier's index (LRU by hash), its slot pins and its loads in flight."""

    def __init__(self, *, block_size: int, num_stages: int, num_slots: int,
                 take_evicted: Callable[[], list[tuple[int, int, tuple[int, ...]]]],
                 medium: str | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the offload tier needs at least one slot, got {num_slots}")
        self.block_size = block_size
        self.num_stages = num_stages
        self.num_slots = num_slots
        self.medium = medium
        self._take_evicted = take_evicted
        self._index: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}  # slot -> loads reading it
        self._orphans: set[int] = set()  # pinned slots whose entry was dropped: free when read
        self._matches: dict[str, list[int]] = {}  # matched, blocks not allocated yet
        self._loads: dict[str, PendingLoad[TierLoad]] = {}
        self._to_load: list[TierLoad] = []
        self._finished: list[LoadResult] = []
        self._events: list[KVCacheEvent] = []
        self._stats = TierStats()

    @property
    def num_stored(self) -> int:
        return len(self._index)

    # ----------------------------------------------------------------------- lookups
    def get_num_new_matched_tokens(self, request: TierRequest,  # type: ignore[override]
                                   num_computed: int) -> tuple[int, bool]:
        bs = self.block_size
        hashes, tokens = request.block_hashes, request.all_token_ids
        first = num_computed // bs
        last = min((request.num_tokens - 1) // bs, len(hashes))
        matched = []
        for i in range(first, last):
            entry = self._index.get(hashes[i])
            if entry is None or entry.token_ids != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            matched.append(hashes[i])
        if not matched:
            return 0, False
        self._matches[request.request_id] = matched
        return len(matched) * bs, True

    def update_state_after_alloc(self, request: RemoteRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        matched = self._matches.pop(request.request_id, None)
        if not matched or num_external_tokens <= 0:
            return
        first = request.num_computed_tokens // self.block_size
        slots = []
        for block_hash in matched:
            entry = self._index[block_hash]
            self._index.move_to_end(block_hash)
            self._pins[entry.slot] = self._pins.get(entry.slot, 0) + 1
            slots.append(entry.slot)
        spec = TierLoad(request.request_id, block_ids[first:first + len(matched)], slots,
                        matched)
        self._loads[request.request_id] = PendingLoad(spec)
        self._to_load.append(spec)

    # ------------------------------------------------------------------------ steps
    def build_connector_meta(self, sched_out: Any) -> OffloadMeta:
        meta = OffloadMeta(tier_loads=self._to_load)
        self._to_load = []
        for spec in meta.tier_loads:
            self._loads[spec.req_id].started = True
        for block_id, block_hash, token_ids in self._take_evicted():
            entry = self._index.get(block_hash)
            if entry is not None and entry.token_ids == token_ids:
                self._index.move_to_end(block_hash)  # the tier has it already
                continue
            slot = self._take_slot()
            if slot is None:
                continue  # every slot is being read: this block is not kept
            if entry is not None:  # a colliding hash: the newer block replaces it
                self._drop(block_hash)
            self._index[block_hash] = _Entry(slot, token_ids)
            meta.store_block_ids.append(block_id)
            meta.store_slots.append(slot)
            meta.store_hashes.append(block_hash)
            if self.medium is not None:
                self._events.append(BlockStored([block_hash], None, list(token_ids),
                                                self.block_size, None, self.medium, None))
        self._stats.stored_blocks += len(meta.store_slots)
        return meta

    def _take_slot(self) -> int | None:
        """A free slot, or the least recently used unpinned entry's (dropped)."""
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, entry in self._index.items():
            if entry.slot not in self._pins:
                self._drop(block_hash)
                return self._free_slots.pop()
        return None

    def _drop(self, block_hash: int) -> None:
        entry = self._index.pop(block_hash)
        if entry.slot in self._pins:
            self._orphans.add(entry.slot)
        else:
            self._free_slots.append(entry.slot)
        if self.medium is not None:
            self._events.append(BlockRemoved([block_hash], self.medium))

    def update_connector_output(self, outputs: list[KVConnectorOutput]) -> None:
        for out in outputs:
            for req_id in out.finished_recving:
                self._stage_loaded(req_id, None)
            for req_id, reason in out.failed_recving.items():
                self._stage_loaded(req_id, reason)

    def _stage_loaded(self, req_id: str, failure: str | None) -> None:
        load = self._loads.get(req_id)
        if load is None:
            return  # another connector's request
        if not load.stage_reported(failure, self.num_stages):
            return
        del self._loads[req_id]
        self._unpin(load)
        if load.failures:  # a corrupt or missing copy: forget it, never serve it
            self._stats.failures += 1
            for block_hash, slot in zip(load.spec.hashes, load.spec.slots, strict=True):
                entry = self._index.get(block_hash)
                if entry is not None and entry.slot == slot:
                    self._drop(block_hash)
        result = load.result(req_id)
        if result.ok:
            self._stats.hit_tokens += len(load.spec.hashes) * self.block_size
        self._finished.append(result)

    def _unpin(self, load: PendingLoad[TierLoad]) -> None:
        for slot in load.spec.slots:
            self._pins[slot] -= 1
            if self._pins[slot] == 0:
                del self._pins[slot]
                if slot in self._orphans:  # its entry was dropped while it was being read
                    self._orphans.discard(slot)
                    self._free_slots.append(slot)

    def take_finished_loads(self) -> list[LoadResult]:
        results, self._finished = self._finished, []
        return results

    def cancel_load(self, req_id: str) -> bool:
        self._matches.pop(req_id, None)
        load = self._loads.get(req_id)
        if load is None:
            return False
        if not load.started:  # no worker has it yet
            del self._loads[req_id]
            self._to_load = [s for s in self._to_load if s.req_id != req_id]
            self._unpin(load)
            return False
        load.cancelled = True
        return True

    # ----------------------------------------------------------------------- the rest
    def request_finished(self, request: RemoteRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, None  # a finished request ran, so its load ended long ago

    def take_releasable(self, now: float) -> list[str]:
        return []

    def has_pending_transfers(self) -> bool:
        return bool(self._loads)

    def take_tier_stats(self) -> TierStats:
        stats, self._stats = self._stats, TierStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Forget everything (the workers holding the tier were replaced); no load may be in
        flight."""
        assert not self._loads, "the tier is reset while loads are in flight"
        if self._index and self.medium is not None:
            self._events.extend(BlockRemoved([h], self.medium) for h in self._index)
        self._index.clear()
        self._pins.clear()
        self._orphans.clear()
        self._matches.clear()
        self._to_load = []
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
