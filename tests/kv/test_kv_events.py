"""KV-cache events: the block pool records what joins, leaves and clears the prefix cache, and
the payload decodes with structs written from vLLM's own definitions (not ours)."""

from __future__ import annotations

from typing import Any

import msgspec

from tests.kv.test_manager import FakeReq
from tokenflow.kv.block_pool import BlockPool
from tokenflow.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decoder,
)
from tokenflow.kv.manager import KVCacheManager


# --- a consumer's view: vLLM's definitions (vllm/distributed/kv_events.py), retyped here so a
# change on our side that vLLM's consumers would not decode fails this test.
class VllmEventBatch(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False,  # type: ignore[call-arg]
                       tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


def _request(req_id: str, tokens: list[int]) -> FakeReq:
    return FakeReq(req_id, list(tokens))


def test_nothing_is_recorded_unless_asked() -> None:
    pool = BlockPool(4, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [7], [1, 2], 2, 0, 1)
    pool.free_blocks([block])
    pool.get_new_blocks(4)
    assert pool.take_events() == []


def test_stored_removed_and_cleared_as_the_cache_changes() -> None:
    bs = 4
    kv = KVCacheManager(num_blocks=6, block_size=bs, events_medium="CPU")
    prompt = list(range(100, 111))  # 2 full blocks and 3 tokens
    a = _request("a", prompt)
    assert kv.allocate_slots(a, len(prompt)) is not None
    [stored] = kv.take_events()
    assert stored == BlockStored(a.block_hashes[:2], None, prompt[:8], bs, None, "CPU", None)
    assert kv.take_events() == []  # drained

    # A second request shares the first block and adds its own second one: only the new
    # block is announced, chained to the shared one.
    b_prompt = prompt[:4] + [1, 2, 3, 4, 5]
    b = _request("b", b_prompt)
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    assert kv.allocate_slots(b, len(b_prompt) - num_hit, num_hit, computed) is not None
    assert kv.take_events() == [BlockStored([b.block_hashes[1]], b.block_hashes[0],
                                            b_prompt[4:8], bs, None, "CPU", None)]

    # Freed, the cached blocks stay until their memory is needed: then they are removed.
    kv.free(a)
    kv.free(b)
    assert kv.take_events() == []
    c = _request("c", list(range(500, 524)))  # 6 blocks: takes every block back
    assert kv.allocate_slots(c, 24) is not None
    events = kv.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(a.block_hashes[:2] + [b.block_hashes[1]])
    assert all(e.medium == "CPU" for e in events)
    kv.free(c)
    kv.take_events()
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_a_block_another_request_cached_first_splits_the_stored_run() -> None:
    """cache_full_blocks skips a hash someone else registered: the stored events cover only
    the blocks that joined, each run chained to the block before it."""
    pool = BlockPool(8, enable_caching=True, medium="GPU")
    blocks = pool.get_new_blocks(4)
    hashes, tokens = [11, 12, 13, 14], list(range(8))
    [other] = pool.get_new_blocks(1)
    pool.cache_full_blocks([other], [12], tokens[2:4], 2, 0, 1)
    pool.take_events()
    assert pool.cache_full_blocks(blocks, hashes, tokens, 2, 0, 4) == 3
    assert pool.take_events() == [
        BlockStored([11], None, [0, 1], 2, None, "GPU", None),
        BlockStored([13, 14], 12, [4, 5, 6, 7], 2, None, "GPU", None)]


def test_the_payload_decodes_with_vllms_definitions() -> None:
    batch = KVEventBatch(1733300000.5, [
        BlockStored([2**64 - 1, 5], None, [1, 2, 3, 4], 2, None, "GPU", None),
        BlockRemoved([5], "GPU"),
        AllBlocksCleared()], 0)
    payload = msgspec.msgpack.encode(batch)
    theirs = msgspec.msgpack.Decoder(type=VllmKVEventBatch).decode(payload)
    assert theirs.ts == 1733300000.5 and theirs.data_parallel_rank == 0
    stored, removed, cleared = theirs.events
    assert isinstance(stored, VllmBlockStored) and stored.block_hashes == [2**64 - 1, 5]
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium,
            stored.lora_name) == (None, [1, 2, 3, 4], 2, "GPU", None)
    assert isinstance(removed, VllmBlockRemoved) and removed.block_hashes == [5]
    assert isinstance(cleared, VllmAllBlocksCleared)
    # Tagged by class name, fields as a map: what vLLM's own encoder writes.
    raw = msgspec.msgpack.decode(payload)
    assert raw["events"][0]["type"] == "BlockStored" and raw["events"][2] == {
        "type": "AllBlocksCleared"}
    assert decoder().decode(payload) == batch
