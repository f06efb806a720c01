"""Block pool: LRU free queue, ref counts, prefix-cache map and its integrity check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflow.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def cache(pool: BlockPool, block: KVCacheBlock, block_hash: int, tokens: list[int]) -> bool:
    """Register one full block; True if it was registered."""
    return pool.cache_full_blocks([block], [block_hash], tokens, len(tokens), 0, 1) == 1


def test_free_queue_basic_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks[:3])
    assert len(q) == 3 and ids(q) == [0, 1, 2]
    q.remove(blocks[1])
    assert ids(q) == [0, 2] and blocks[1] not in q
    q.append_n(blocks[3:])
    q.append(blocks[1])
    assert ids(q) == [0, 2, 3, 4, 1]
    assert q.popleft() is blocks[0]
    assert ids(q) == [2, 3, 4, 1] and len(q) == 4
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pop", "remove", "append"]), st.integers(0, 7))))
def test_free_queue_matches_a_list_model(ops: list[tuple[str, int]]) -> None:
    blocks = [KVCacheBlock(i) for i in range(8)]
    q = FreeBlockQueue(blocks)
    model = list(range(8))
    for op, i in ops:
        if op == "pop" and model:
            assert q.popleft().block_id == model.pop(0)
        elif op == "remove" and i in model:
            q.remove(blocks[i])
            model.remove(i)
        elif op == "append" and i not in model:
            q.append(blocks[i])
            model.append(i)
        assert ids(q) == model and len(q) == len(model)


def test_oldest_freed_cached_block_is_reused_first() -> None:
    pool = BlockPool(4, enable_caching=True)
    b = pool.get_new_blocks(4)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    cache(pool, b[2], 2, [2])
    cache(pool, b[0], 0, [0])
    pool.free_blocks([b[2]])
    pool.free_blocks([b[0]])
    assert ids(pool.get_new_blocks(1)) == [2]
    assert ids(pool.get_new_blocks(1)) == [0]
    pool.check_integrity()


def test_freed_blocks_without_hash_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4, enable_caching=True)
    b = pool.get_new_blocks(4)
    cache(pool, b[0], 10, [0])
    cache(pool, b[1], 11, [1])
    pool.free_blocks([b[0], b[2]])  # b2 has no hash: it can never be hit again
    pool.free_blocks([b[1], b[3]])
    assert ids(pool.free_queue) == [3, 2, 0, 1]
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert pool.get_cached_block(10, [0]) is b[0] and pool.get_cached_block(11, [1]) is b[1]
    pool.check_integrity()


def test_freeing_in_reverse_order_evicts_the_tail_first() -> None:
    pool = BlockPool(3, enable_caching=True)
    seq = pool.get_new_blocks(3)
    pool.free_blocks(reversed(seq))
    assert ids(pool.free_queue) == [2, 1, 0]
    assert ids(pool.get_new_blocks(2)) == [2, 1]


def test_touch_revives_a_free_block_from_the_middle() -> None:
    pool = BlockPool(4, enable_caching=True)
    b = pool.get_new_blocks(4)
    pool.free_blocks(b[:3])
    pool.touch([b[1]])
    assert b[1].ref_cnt == 1 and b[1] not in pool.free_queue
    assert ids(pool.free_queue) == [0, 2]
    pool.touch([b[3]])  # a held block just gains a reference
    assert b[3].ref_cnt == 2
    pool.check_integrity()


def test_hash_survives_free_until_eviction() -> None:
    pool = BlockPool(2, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    assert cache(pool, b0, 111, [1, 2])
    pool.free_blocks([b0, b1])
    assert pool.get_cached_block(111, [1, 2]) is b0
    pool.check_integrity()
    assert pool.get_new_blocks(1) == [b1]  # no hash: it is reused first
    assert pool.get_new_blocks(1) == [b0]  # then the cached block is evicted
    assert b0.block_hash is None and b0.token_ids is None
    assert pool.get_cached_block(111, [1, 2]) is None
    pool.check_integrity()


def test_hash_collision_with_other_tokens_is_a_miss() -> None:
    pool = BlockPool(2, enable_caching=True)
    (b0,) = pool.get_new_blocks(1)
    cache(pool, b0, 42, [1, 2])
    assert pool.get_cached_block(42, [1, 2]) is b0
    assert pool.get_cached_block(42, [1, 3]) is None
    assert pool.get_cached_block(43, [1, 2]) is None


def test_existing_mapping_wins_over_a_duplicate() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert cache(pool, a, 5, [1])
    assert not cache(pool, b, 5, [1])
    assert b.block_hash is None and pool.get_cached_block(5, [1]) is a
    pool.check_integrity()


def test_not_enough_free_blocks_raises_and_changes_nothing() -> None:
    pool = BlockPool(3, enable_caching=True)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="only 1"):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    assert pool.num_free_blocks == 1 and pool.get_new_blocks(0) == []
    pool.check_integrity()


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    cache(pool, b, 9, [0])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(9, [0]) is b
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(9, [0]) is None and b.block_hash is None
    pool.check_integrity()


def test_caching_disabled_never_registers() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    assert not cache(pool, b, 1, [1])
    assert pool.get_cached_block(1, [1]) is None and b.block_hash is None


def test_usage_and_bad_sizes() -> None:
    pool = BlockPool(4, enable_caching=True)
    assert pool.usage == 0.0
    pool.get_new_blocks(1)
    assert pool.usage == 0.25
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)


def test_integrity_check_catches_corruption() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.check_integrity()
    a.ref_cnt = 0  # held-looking block with ref 0 that is not in the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()
    a.ref_cnt = 1
    b.block_hash = 77  # a hash the map does not know
    with pytest.raises(AssertionError):
        pool.check_integrity()
    b.block_hash = None
    pool.free_blocks([a])
    with pytest.raises(AssertionError):
        pool.free_blocks([a])  # freed more often than held
