"""KV cache manager: prefix hits, allocation, freeing and counters, on fake requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from unittest import mock

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tokenflow.kv import hashing
from tokenflow.kv.manager import KVCacheManager

BS = 4


@dataclass(eq=False)
class FakeReq:
    """The fields of `KVRequest`, nothing else."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    lora_name: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def admit(mgr: KVCacheManager, req: FakeReq) -> int:
    """Look up hits, allocate the whole prompt, mark it computed; returns hit tokens."""
    hits, n_hit = mgr.get_computed_blocks(req)
    out = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
    assert out is not None
    mgr.record_prefix_lookup(req.num_tokens, n_hit)
    req.num_computed_tokens = req.num_tokens
    return n_hit


def decode(mgr: KVCacheManager, req: FakeReq, token: int) -> None:
    """One decode step: the sampled token joins the sequence, then its KV is computed."""
    req.all_token_ids.append(token)
    assert mgr.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is not None
    req.num_computed_tokens = req.num_tokens


def test_shared_prefix_hits_and_shares_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = FakeReq("a", list(range(10)))
    assert admit(mgr, a) == 0
    b = FakeReq("b", list(range(8)) + [99, 98, 97])
    hits, n_hit = mgr.get_computed_blocks(b)
    assert n_hit == 8 and [h.block_id for h in hits] == mgr.get_block_ids("a")[:2]
    new = mgr.allocate_slots(b, b.num_tokens - n_hit, n_hit, hits)
    assert new is not None and len(new) == 1
    assert mgr.get_block_ids("b")[:2] == mgr.get_block_ids("a")[:2]
    assert all(blk.ref_cnt == 2 for blk in hits)
    mgr.check_integrity()


def test_never_the_whole_prompt() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    admit(mgr, FakeReq("a", list(range(8))))
    twin = FakeReq("b", list(range(8)))
    blocks, n_hit = mgr.get_computed_blocks(twin)
    assert len(blocks) == 1 and n_hit == 4  # a prompt of exactly 2 blocks hits at most 1


def test_multi_turn_follow_up_hits_the_previous_turn() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    turn1 = FakeReq("t1", [7, 7, 7, 1, 2, 3])
    admit(mgr, turn1)
    for tok in range(20, 27):
        decode(mgr, turn1, tok)
    old_ids = mgr.get_block_ids("t1")
    mgr.free(turn1)
    turn2 = FakeReq("t2", turn1.all_token_ids + [5, 5, 5])  # 13 old + 3 new tokens
    blocks, n_hit = mgr.get_computed_blocks(turn2)
    assert n_hit == 12 and [b.block_id for b in blocks] == old_ids[:3]
    assert all(b.ref_cnt == 0 for b in blocks)  # freed, still cached
    new = mgr.allocate_slots(turn2, 4, n_hit, blocks)
    assert new is not None and len(new) == 1 and mgr.get_block_ids("t2")[:3] == old_ids[:3]
    mgr.check_integrity()


def test_allocate_returns_none_and_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = FakeReq("a", list(range(11)))
    admit(mgr, a)
    b = FakeReq("b", [50] * 5)
    before = (mgr.num_free_blocks, mgr.get_block_ids("a"))
    assert mgr.allocate_slots(b, 5) is None
    assert (mgr.num_free_blocks, mgr.get_block_ids("a")) == before
    assert mgr.get_block_ids("b") == [] and mgr.num_blocks_held("b") == 0
    mgr.check_integrity()
    decode(mgr, a, 0)  # fills a's 3rd block
    assert mgr.allocate_slots(a, 1, num_lookahead_tokens=BS) is None
    assert mgr.num_blocks_held("a") == 3
    mgr.check_integrity()


def test_hits_sitting_in_the_free_queue_do_not_count_as_free() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = FakeReq("a", list(range(8)))
    admit(mgr, a)
    mgr.free(a)  # a's two blocks: free but cached, at the queue tail
    admit(mgr, FakeReq("c", [60] * 8))  # takes the two never-used blocks
    b = FakeReq("b", list(range(12)))
    hits, n_hit = mgr.get_computed_blocks(b)
    assert n_hit == 8 and mgr.num_free_blocks == 2
    # 2 hits + 1 new block needed, but the only free blocks are the hits themselves.
    assert mgr.allocate_slots(b, 4, n_hit, hits) is None
    assert mgr.num_free_blocks == 2 and all(h.ref_cnt == 0 for h in hits)
    assert mgr.get_computed_blocks(b)[1] == 8  # still cached
    mgr.check_integrity()


def test_free_releases_everything_and_is_idempotent() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    a, b = FakeReq("a", list(range(9))), FakeReq("b", list(range(9)))
    admit(mgr, a)
    admit(mgr, b)
    mgr.free(a)
    mgr.free(a)
    mgr.free(FakeReq("never-seen", [1]))
    mgr.check_integrity()
    mgr.free(b)
    assert all(blk.ref_cnt == 0 for blk in mgr.pool.blocks)
    assert mgr.num_free_blocks == 6 and mgr.usage == 0.0
    mgr.check_integrity()


def test_counters_and_stats_deltas() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    admit(mgr, FakeReq("a", list(range(10))))
    admit(mgr, FakeReq("b", list(range(10))))
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (20, 8)
    assert mgr.take_prefix_cache_stats() == (20, 8)
    assert mgr.take_prefix_cache_stats() == (0, 0)
    admit(mgr, FakeReq("c", list(range(5))))
    assert mgr.take_prefix_cache_stats() == (5, 4)


def test_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = FakeReq("a", list(range(10)))
    admit(mgr, a)
    b = FakeReq("b", list(range(10)))
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (0, 0)
    assert a.block_hashes == [] and mgr.pool.num_cached_blocks == 0


def test_lookahead_slots_are_never_cached() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = FakeReq("a", [1, 2, 3, 4, 5, 6])
    new = mgr.allocate_slots(a, 6, num_lookahead_tokens=2)
    assert new is not None and len(new) == 2
    assert new[0].block_hash is not None and new[1].block_hash is None


def test_identical_prompts_in_one_step_do_not_corrupt_each_other() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a, b = FakeReq("a", list(range(9))), FakeReq("b", list(range(9)))
    # Both look up before either allocates: no hits, each gets its own blocks.
    hits_a, _ = mgr.get_computed_blocks(a)
    hits_b, _ = mgr.get_computed_blocks(b)
    assert hits_a == hits_b == []
    mgr.allocate_slots(a, 9)
    mgr.allocate_slots(b, 9)
    ids_a, ids_b = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    assert not set(ids_a) & set(ids_b)
    assert all(mgr.pool.blocks[i].block_hash is None for i in ids_b)  # a's mapping kept
    mgr.check_integrity()
    mgr.free(b)  # b's private blocks go back without touching a's cache entries
    c = FakeReq("c", list(range(9)))
    blocks, n_hit = mgr.get_computed_blocks(c)
    assert n_hit == 8 and [blk.block_id for blk in blocks] == ids_a[:2]


def test_decode_does_not_rehash_or_allocate_inside_a_block() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = FakeReq("a", list(range(5)))
    admit(mgr, a)
    calls = []
    real = hashing.extend_block_hashes

    def counting(hashes: list[int], tokens: Sequence[int], bs: int, extra: tuple = ()) -> None:
        calls.append(len(tokens))
        real(hashes, tokens, bs, extra)

    with mock.patch("tokenflow.kv.manager.extend_block_hashes", counting):
        for tok in range(6):  # tokens 5..10: block 1 fills at the 8th token, only once
            decode(mgr, a, tok)
    assert len(a.block_hashes) == 2 and len(calls) == 1
    assert mgr.num_blocks_held("a") == 3


def test_stale_hits_and_late_hits_are_rejected() -> None:
    mgr = KVCacheManager(num_blocks=2, block_size=BS)
    a = FakeReq("a", list(range(8)))
    admit(mgr, a)
    mgr.free(a)
    b = FakeReq("b", list(range(8)))
    hits, n_hit = mgr.get_computed_blocks(b)
    mgr.allocate_slots(FakeReq("x", [0] * 8), 8)  # evicts b's hit meanwhile
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate_slots(b, 4, n_hit, hits)
    mgr.free(FakeReq("x", []))
    c = FakeReq("c", [1])
    mgr.allocate_slots(c, 1)
    with pytest.raises(ValueError, match="first allocation"):
        mgr.allocate_slots(c, 1, 0, [mgr.pool.blocks[0]])
    with pytest.raises(ValueError):
        mgr.allocate_slots(c, -1)


def test_block_arithmetic() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    assert [mgr.blocks_needed(n) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert mgr.can_ever_fit(12) and not mgr.can_ever_fit(13)
    assert (mgr.num_blocks, mgr.block_size) == (3, BS)


# --- stateful: random admit / grow / free on a tiny pool, with a model of the KV contents ---


class KVMachine(RuleBasedStateMachine):
    """Writes each computed token into a fake KV store (block id -> slot -> token), so a hit
    or a cache entry whose contents are not exactly the request's tokens is caught."""

    NUM_BLOCKS = 8

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(self.NUM_BLOCKS, BS)
        self.running: dict[str, FakeReq] = {}
        self.history: list[list[int]] = [[]]
        self.kv: dict[int, list[int | None]] = {}
        self.next_id = 0

    def _write(self, req: FakeReq, start: int, end: int) -> None:
        table = self.mgr.get_block_ids(req.request_id)
        for pos in range(start, end):
            slots = self.kv.setdefault(table[pos // BS], [None] * BS)
            slots[pos % BS] = req.all_token_ids[pos]

    def _allocate(
        self, req: FakeReq, num_new: int, lookahead: int, n_hit: int = 0, hits: list | None = None
    ) -> bool:
        snapshot = (self.mgr.num_free_blocks, self.mgr.get_block_ids(req.request_id))
        out = self.mgr.allocate_slots(req, num_new, n_hit, hits, num_lookahead_tokens=lookahead)
        if out is None:
            assert (self.mgr.num_free_blocks, self.mgr.get_block_ids(req.request_id)) == snapshot
            return False
        start = req.num_computed_tokens + n_hit
        self._write(req, start, start + num_new)
        req.num_computed_tokens = start + num_new
        return True

    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def admit(self, data: st.DataObject, tail: list[int]) -> None:
        base = data.draw(st.sampled_from(self.history))  # often a follow-up of a past turn
        req = FakeReq(f"r{self.next_id}", base + tail)
        self.next_id += 1
        hits, n_hit = self.mgr.get_computed_blocks(req)
        assert n_hit == len(hits) * BS < req.num_tokens
        for i, blk in enumerate(hits):
            assert self.kv[blk.block_id] == req.all_token_ids[i * BS : (i + 1) * BS]
        chunk = data.draw(st.integers(1, req.num_tokens - n_hit))
        if self._allocate(req, chunk, data.draw(st.integers(0, 3)), n_hit, hits):
            self.running[req.request_id] = req
            assert self.mgr.get_block_ids(req.request_id)[: len(hits)] == [h.block_id for h in hits]
        else:
            assert self.mgr.num_blocks_held(req.request_id) == 0

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if req.num_computed_tokens == req.num_tokens:  # decode: the sampled token joins
            req.all_token_ids.append(data.draw(st.integers(0, 1)))
        num_new = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
        if not self._allocate(req, num_new, data.draw(st.integers(0, 3))):
            self._finish(req.request_id)  # preempted: out of blocks

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(data.draw(st.sampled_from(sorted(self.running))))

    def _finish(self, request_id: str) -> None:
        req = self.running.pop(request_id)
        self.mgr.free(req)
        self.history.append(req.all_token_ids[: req.num_computed_tokens])

    @invariant()
    def consistent(self) -> None:
        self.mgr.check_integrity()
        for req in self.running.values():
            table = self.mgr.get_block_ids(req.request_id)
            assert len(table) >= self.mgr.blocks_needed(req.num_computed_tokens)
            for pos in range(req.num_computed_tokens):
                assert self.kv[table[pos // BS]][pos % BS] == req.all_token_ids[pos]
        for blk in self.mgr.pool.blocks:
            if blk.block_hash is not None:
                assert blk.token_ids is not None and self.kv[blk.block_id] == list(blk.token_ids)

    def teardown(self) -> None:
        for request_id in list(self.running):
            self._finish(request_id)
        self.mgr.check_integrity()
        assert self.mgr.num_free_blocks == self.NUM_BLOCKS
        assert all(blk.ref_cnt == 0 for blk in self.mgr.pool.blocks)


_FAST = settings(max_examples=80, stateful_step_count=30, deadline=None)


def test_kv_state_machine() -> None:
    run_state_machine_as_test(KVMachine, settings=_FAST)


def _colliding_hashes(hashes: list[int], tokens: Sequence[int], block_size: int,
                      extra: tuple = ()) -> None:
    # Every prompt's block i hashes to i: only the token check stands between requests.
    hashes.extend(range(len(hashes), len(tokens) // block_size))


def test_kv_state_machine_with_colliding_hashes() -> None:
    with mock.patch("tokenflow.kv.manager.extend_block_hashes", _colliding_hashes):
        run_state_machine_as_test(KVMachine, settings=_FAST)


def test_hand_over_keeps_a_prefix_and_never_a_cached_block_it_would_overwrite() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = FakeReq("a", list(range(10)))  # blocks 0, 1 full and cached; block 2 holds 2 tokens
    admit(mgr, a)
    ids = mgr.get_block_ids("a")
    # Inside the private partial block: kept as is, written over from token 9 on.
    assert mgr.hand_over("a", "b", 9) == 9 and mgr.get_block_ids("b") == ids
    # Inside cached block 1: the count drops to its start, and block 1 goes back to the pool.
    assert mgr.hand_over("b", "c", 6) == 4 and mgr.get_block_ids("c") == ids[:1]
    assert mgr.num_free_blocks == 9
    mgr.check_integrity()
    assert mgr.hand_over("c", "d", 0) == 0 and mgr.num_free_blocks == 10
    assert mgr.hand_over("nobody", "e", 5) == 0
    mgr.check_integrity()
