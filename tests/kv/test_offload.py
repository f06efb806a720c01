"""The offload tier's halves without an engine: the scheduler half's index (stores at
eviction, hits by hash and tokens, LRU with pinned slots, failed loads dropped, events named
by the tier), the stores (a flipped byte or a missing file is detected) and the worker half
(a block stored and loaded back is the same KV)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenflow.kv.connector import KVConnectorOutput, combine_schedulers
from tokenflow.kv.connector.composite import CompositeScheduler
from tokenflow.kv.connector.offload_scheduler import OffloadScheduler
from tokenflow.kv.connector.offload_worker import DiskTier, MemoryTier, OffloadWorker
from tokenflow.kv.events import BlockRemoved, BlockStored

BS = 4


class Evictions:
    def __init__(self) -> None:
        self.pending: list[tuple[int, int, tuple[int, ...]]] = []

    def evict(self, block_id: int, block_hash: int) -> None:
        self.pending.append((block_id, block_hash, tokens_of(block_hash)))

    def take(self) -> list[tuple[int, int, tuple[int, ...]]]:
        out, self.pending = self.pending, []
        return out


def tokens_of(block_hash: int) -> tuple[int, ...]:
    return tuple(range(block_hash * BS, (block_hash + 1) * BS))


def request(req_id: str, hashes: list[int], extra: int = 1) -> SimpleNamespace:
    tokens = [t for h in hashes for t in tokens_of(h)] + [0] * extra
    return SimpleNamespace(request_id=req_id, block_hashes=list(hashes), all_token_ids=tokens,
                           num_tokens=len(tokens), num_prompt_tokens=len(tokens),
                           num_computed_tokens=0, kv_transfer_params=None)


def tier(num_slots: int = 4, stages: int = 1) -> tuple[OffloadScheduler, Evictions]:
    ev = Evictions()
    return OffloadScheduler(block_size=BS, num_stages=stages, num_slots=num_slots,
                            take_evicted=ev.take, medium="CPU_OFFLOAD"), ev


def test_evicted_blocks_are_stored_once_and_hit_by_hash_and_tokens() -> None:
    sched, ev = tier()
    ev.evict(7, 1)
    ev.evict(8, 2)
    meta = sched.build_connector_meta(None)
    assert meta.store_block_ids == [7, 8] and len(set(meta.store_slots)) == 2
    ev.evict(9, 1)  # the same block again: already there, nothing stored
    assert not sched.build_connector_meta(None)
    req = request("a", [1, 2, 3])
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    assert sched.get_num_new_matched_tokens(req, BS) == (BS, True)  # after a pool hit
    # A hash collision (other tokens) is a miss; so is a chain that starts with a miss.
    bad = request("b", [1, 2])
    bad.all_token_ids[0] += 1
    assert sched.get_num_new_matched_tokens(bad, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(request("c", [3, 1]), 0) == (0, False)
    # The last prompt token is always computed: a prompt of exactly two blocks hits one.
    assert sched.get_num_new_matched_tokens(request("d", [1, 2], extra=0), 0) == (BS, True)


def test_a_load_pins_its_slots_and_reports_once_every_stage_did() -> None:
    sched, ev = tier(num_slots=2, stages=2)
    ev.evict(0, 1)
    ev.evict(1, 2)
    sched.build_connector_meta(None)
    req = request("a", [1, 2], extra=0)
    assert sched.get_num_new_matched_tokens(req, 0) == (BS, True)
    sched.update_state_after_alloc(req, [5, 6], BS)
    meta = sched.build_connector_meta(None)
    (load,) = meta.tier_loads
    assert load.block_ids == [5]
    pinned = load.slots[0]
    # Two more evictions with two slots, one pinned: only one is stored, not over the pin.
    ev.evict(2, 3)
    ev.evict(3, 4)
    meta = sched.build_connector_meta(None)
    assert pinned not in meta.store_slots
    sched.update_connector_output([KVConnectorOutput(finished_recving={"a"})])
    assert not sched.take_finished_loads() and sched.has_pending_transfers()
    sched.update_connector_output([KVConnectorOutput(finished_recving={"a"})])
    (result,) = sched.take_finished_loads()
    assert result.ok and not sched.has_pending_transfers()
    assert sched.take_tier_stats().hit_tokens == BS


def test_a_failed_load_drops_its_entries_and_frees_their_slots() -> None:
    sched, ev = tier(num_slots=2)
    ev.evict(0, 1)
    sched.build_connector_meta(None)
    req = request("a", [1])
    req.all_token_ids.append(0)  # one block and two more tokens
    req.num_tokens += 1
    assert sched.get_num_new_matched_tokens(req, 0) == (BS, True)
    sched.update_state_after_alloc(req, [3, 4], BS)
    sched.build_connector_meta(None)
    sched.update_connector_output([KVConnectorOutput(failed_recving={"a": "corrupt"})])
    (result,) = sched.take_finished_loads()
    assert not result.ok
    assert sched.num_stored == 0 and sched.take_tier_stats().failures == 1
    assert sched.get_num_new_matched_tokens(request("b", [1]), 0) == (0, False)
    events = sched.take_events()
    assert isinstance(events[0], BlockStored) and events[0].medium == "CPU_OFFLOAD"
    assert isinstance(events[-1], BlockRemoved) and events[-1].block_hashes == [1]
    ev.evict(0, 5)
    ev.evict(1, 6)
    assert len(sched.build_connector_meta(None).store_slots) == 2  # both slots free again


def test_lru_drops_the_oldest_entry_and_a_hit_refreshes_it() -> None:
    sched, ev = tier(num_slots=2)
    ev.evict(0, 1)
    ev.evict(1, 2)
    sched.build_connector_meta(None)
    ev.evict(2, 1)  # block 1 again: now the most recent
    ev.evict(3, 3)  # takes block 2's slot
    sched.build_connector_meta(None)
    assert sched.get_num_new_matched_tokens(request("a", [2]), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(request("b", [1]), 0) == (BS, True)


def test_a_cancelled_load_before_it_started_unpins() -> None:
    sched, ev = tier(num_slots=1)
    ev.evict(0, 1)
    sched.build_connector_meta(None)
    req = request("a", [1])
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [2], BS)
    assert sched.cancel_load("a") is False
    ev.evict(3, 2)
    assert sched.build_connector_meta(None).store_slots == [0]  # the slot was not pinned


def test_the_composite_gives_a_load_to_the_part_that_claimed_it() -> None:
    sched, ev = tier()
    assert combine_schedulers(None, sched) is sched
    other, _ = tier()
    both = combine_schedulers(other, sched)
    assert isinstance(both, CompositeScheduler)
    ev.evict(0, 1)
    both.build_connector_meta(None)
    req = request("a", [1])
    assert both.get_num_new_matched_tokens(req, 0) == (BS, True)
    both.update_state_after_alloc(req, [9], BS)
    meta = both.build_connector_meta(None)
    assert not meta.parts[0] and meta.parts[1].tier_loads[0].block_ids == [9]


# ------------------------------------------------------------------------------ stores
SHAPE = (2, 2, BS, 2, 8)  # [layers, 2, block_size, kv_heads, head_dim]


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_store_round_trips_and_detects_damage(tmp_path, kind) -> None:
    store = (MemoryTier(4, SHAPE, torch.bfloat16, pin=False) if kind == "memory"
             else DiskTier(str(tmp_path), "t-", SHAPE, torch.bfloat16))
    blocks = torch.randn(2, *SHAPE).to(torch.bfloat16)
    store.write([3, 1], [30, 10], blocks)
    assert torch.equal(store.read([1, 3], [10, 30]), blocks[[1, 0]])
    with pytest.raises(ValueError, match="not stored"):
        store.read([1], [30])  # the slot holds another block (its store never ran)
    if kind == "memory":
        store.data.view(torch.uint8)[3, 0, 0, 0, 0, 0] ^= 1
    else:
        path = store.path(3)
        raw = bytearray(path.read_bytes())
        raw[5] ^= 1
        path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupt"):
        store.read([3], [30])
    if kind == "disk":
        store.path(1).unlink()
        with pytest.raises(ValueError, match="missing"):
            store.read([1], [10])
        store.close()
        assert not store.dir.exists()


@pytest.mark.parametrize("backend", ["cpu", "disk"])
def test_the_worker_stores_before_the_step_and_loads_back_exactly(tmp_path, backend) -> None:
    from tokenflow.kv.connector.offload_scheduler import OffloadMeta, TierLoad

    caches = [torch.randn(2, 6, BS, 2, 8) for _ in range(2)]
    worker = OffloadWorker(backend, 1 << 20, str(tmp_path))
    worker.register_kv_caches(caches, (0, 2))
    original = [c[:, [1, 2]].clone() for c in caches]
    worker.start_load_kv(OffloadMeta(store_block_ids=[1, 2], store_slots=[0, 1],
                                     store_hashes=[11, 12]))
    for cache in caches:  # the step overwrites the evicted blocks right away
        cache[:, [1, 2]] = 0
    worker.start_load_kv(OffloadMeta(tier_loads=[TierLoad("r", [4, 5], [0, 1], [11, 12])]))
    worker._io.submit(lambda: None).result()
    out = worker.get_finished(1.0)
    assert out.finished_recving == {"r"} and not out.failed_recving
    for cache, before in zip(caches, original, strict=True):
        assert torch.equal(cache[:, [4, 5]], before)
    worker.shutdown()
