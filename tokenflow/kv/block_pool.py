"""The physical KV blocks: who holds them, which are free, and which hold a cached prefix."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from tokenflow.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of the paged KV cache: owns its reference count and its cache key.

    `block_hash` / `token_ids` are set only while the block is registered in the pool's prefix
    cache; they survive `free_blocks` and are cleared when the block is evicted for reuse.
    `prev_free` / `next_free` are the free-queue links (both set exactly while queued).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Owns the LRU order of free blocks: a doubly-linked list threaded through the blocks.

    Head = least recently freed = next to be evicted. Every operation is O(1), including
    `remove` from the middle, which a prefix hit on a freed block needs. Two sentinel nodes
    spare the edge-case branches; a block is queued iff its links are set.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        if self._len == 0:
            raise IndexError("popleft from an empty FreeBlockQueue")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink the first `n` blocks in one pass (admission takes dozens at a time)."""
        if n > self._len:
            raise IndexError(f"popleft_n({n}) from a FreeBlockQueue of {self._len}")
        head = self._head
        node = head.next_free
        out = []
        for _ in range(n):
            assert node is not None
            out.append(node)
            node.prev_free, node = None, node.next_free
            out[-1].next_free = None
        assert node is not None
        head.next_free = node
        node.prev_free = head
        self._len -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not queued"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None, f"block {block.block_id} is already queued"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put `blocks` at the head, in order: blocks[0] becomes the next one popped."""
        head = self._head
        for block in reversed(blocks):
            assert block.prev_free is None, f"block {block.block_id} is already queued"
            first = head.next_free
            assert first is not None
            block.prev_free, block.next_free = head, first
            first.prev_free = block
            head.next_free = block
        self._len += len(blocks)


class BlockPool:
    """Owns every KV block: reference counts, the LRU free queue and the prefix-cache map.

    Invariants (checked by `check_integrity`):
    - a block is in the free queue iff its `ref_cnt` is 0; ref counts are never negative;
    - `block.block_hash is not None` iff the map holds `block_hash -> block` (one block per hash:
      a second block with the same content stays unregistered rather than steal the entry).
    Freed blocks keep their hash, so a later request can hit them until they are evicted.
    With `medium` set, every change to the cached set is recorded as a KV-cache event
    (`tokenflow.kv.events`) until `take_events()` drains them. After `record_evictions()`,
    every evicted block is recorded too, `(block_id, hash, token_ids)`, until
    `take_evicted()` drains them (the offload tier copies them out before they are reused).
    """

    def __init__(self, num_blocks: int, enable_caching: bool, medium: str | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[int, KVCacheBlock] = {}
        self.medium = medium
        self._events: list[KVCacheEvent] | None = [] if medium is not None else None
        self._evicted: list[tuple[int, int, tuple[int, ...]]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks from the LRU head, evicting their cached content; ref_cnt becomes 1."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self.free_queue):
            raise ValueError(f"need {n} blocks but only {len(self.free_queue)} are free")
        out = self.free_queue.popleft_n(n)
        for block in out:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self._events is not None:
            self._events.append(BlockRemoved([block.block_hash], self.medium))
        if self._evicted is not None:
            assert block.token_ids is not None
            self._evicted.append((block.block_id, block.block_hash, block.token_ids))
        block.block_hash = None
        block.token_ids = None

    def record_evictions(self) -> None:
        """From now on, record every evicted block for `take_evicted`."""
        if self._evicted is None:
            self._evicted = []

    def take_evicted(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Blocks evicted since the last call, in order: (block_id, hash, token_ids). Their
        KV is still in place until a step the caller has not sent yet writes over it."""
        if not self._evicted:
            return []
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (none unless recording)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block; a freed (ref 0) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. Those reaching 0 join the free queue: a block
        without a hash (it can never be hit again) at the head, to be reused first; a cached
        block at the tail, in the given order, so it survives as long as possible."""
        uncached: list[KVCacheBlock] = []
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed more often than held"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    self.free_queue.append(block)
        if uncached:
            self.free_queue.prepend_n(uncached)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int],
                          token_ids: Sequence[int], block_size: int, start: int, end: int,
                          lora_name: str | None = None) -> int:
        """Register blocks[start:end] in the prefix cache, block i holding
        token_ids[i*bs:(i+1)*bs] under block_hashes[i]; returns how many were registered.
        `lora_name`: the adapter whose KV they hold (for the events).

        An existing entry for a hash wins (an identical block of another request, or a
        colliding one): the caller's block stays private, so nobody's KV is replaced under them.
        """
        if not self.enable_caching:
            return 0
        cached = self._cached
        registered = 0
        run_start = None  # the first block of a run of registered ones, for the events
        for i in range(start, end):
            block_hash = block_hashes[i]
            if block_hash in cached:
                if run_start is not None:
                    self._record_stored(block_hashes, token_ids, block_size, run_start, i, lora_name)
                    run_start = None
                continue
            block = blocks[i]
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block.block_hash = block_hash
            block.token_ids = tuple(token_ids[i * block_size:(i + 1) * block_size])
            cached[block_hash] = block
            registered += 1
            if run_start is None:
                run_start = i
        if run_start is not None:
            self._record_stored(block_hashes, token_ids, block_size, run_start, end, lora_name)
        return registered

    def _record_stored(self, block_hashes: Sequence[int], token_ids: Sequence[int],
                       block_size: int, start: int, end: int, lora_name: str | None) -> None:
        """One `BlockStored` for the registered blocks [start, end), chained to block start-1."""
        if self._events is None:
            return
        parent = block_hashes[start - 1] if start > 0 else None
        self._events.append(BlockStored(
            list(block_hashes[start:end]), parent,
            list(token_ids[start * block_size:end * block_size]), block_size,
            None, self.medium, lora_name))

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The block cached under `block_hash` if it holds exactly `token_ids`, else None."""
        block = self._cached.get(block_hash)
        if block is None:
            return None
        # The token check turns a 64-bit hash collision into a miss instead of wrong KV.
        if block.token_ids != tuple(token_ids):
            return None
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is held by a request."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def check_integrity(self) -> None:
        """Assert the pool's invariants; O(num_blocks)."""
        queued = 0
        for block in self.free_queue:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert block.next_free is not None and block.next_free.prev_free is block
            queued += 1
        assert queued == len(self.free_queue), "free queue length is out of sync with its links"
        num_zero = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.ref_cnt == 0:
                num_zero += 1
                assert block in self.free_queue, f"block {block.block_id} has ref 0, not queued"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, (
                    f"block {block.block_id} carries a hash whose map entry is another block"
                )
        assert num_zero == len(self.free_queue), "free + used != total"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"map entry points at block {block.block_id}"
            assert block.token_ids is not None
