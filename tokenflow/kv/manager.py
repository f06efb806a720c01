"""Per-request block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

from typing import Protocol

from tokenflow.kv.block_pool import BlockPool, KVCacheBlock
from tokenflow.kv.events import KVCacheEvent
from tokenflow.kv.hashing import extend_block_hashes


class KVRequest(Protocol):
    """The request fields the KV cache manager reads (kv/ never imports the scheduler).

    `block_hashes` is filled and extended by the manager itself; it covers full blocks of
    `all_token_ids` only.
    """

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[int]

    @property
    def num_tokens(self) -> int: ...

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter whose KV this is (None: the base model): a block hash key."""
        ...


def hash_keys(request: KVRequest) -> tuple:
    """The extra keys of a request's block hashes: its adapter's name, if any."""
    name = request.lora_name
    return () if name is None else (name,)


class _ReqBlocks:
    """One request's block table and how many of its leading blocks are already cached."""

    __slots__ = ("blocks", "num_cached")

    def __init__(self, blocks: list[KVCacheBlock], num_cached: int) -> None:
        self.blocks = blocks
        self.num_cached = num_cached


class KVCacheManager:
    """Owns the block table of every running request and the prefix-cache hit counters.

    A table always starts at token 0: prefix hits (shared, ref-counted) first, then blocks of
    its own. A full block is registered in the prefix cache as soon as it is allocated for a
    step that computes its last token: the step writes its KV, per layer, before any attention
    reads it, so a request scheduled later in the same step may already share it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events_medium: str | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # events_medium: record KV-cache events, naming the blocks' tier so.
        self.pool = BlockPool(num_blocks, enable_caching, events_medium)
        self._reqs: dict[str, _ReqBlocks] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._stats_taken = (0, 0)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether the whole cache, with nothing else running, could hold `num_tokens`."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        state = self._reqs.get(request_id)
        return [] if state is None else [b.block_id for b in state.blocks]

    def num_blocks_held(self, request_id: str) -> int:
        state = self._reqs.get(request_id)
        return 0 if state is None else len(state.blocks)

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached blocks matching the request's prefix, and its token count.

        Stops short of the last prompt token (the model must compute at least one token to
        produce logits). Takes no references: `allocate_slots` does, with these blocks. Counts
        nothing: the caller records the lookup with `record_prefix_lookup` once it admits.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        hashes, tokens = request.block_hashes, request.all_token_ids
        extend_block_hashes(hashes, tokens, bs, hash_keys(request))
        max_hits = min((request.num_tokens - 1) // bs, len(hashes))
        hits: list[KVCacheBlock] = []
        for i in range(max_hits):
            block = self.pool.get_cached_block(hashes[i], tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a failed admission attempt is not a query)."""
        if not self.enable_caching:
            return
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's table to cover computed + new-computed + new + lookahead tokens.

        Returns the newly allocated blocks (prefix hits excluded; empty when none were needed),
        or None, changing nothing, when the free blocks do not suffice. `new_computed_blocks`
        (from `get_computed_blocks`) are accepted only on the request's first allocation.
        `delay_cache_blocks`: the new tokens' KV comes from elsewhere and is not there yet, so
        no block joins the prefix cache now (`cache_blocks` registers them once it arrived).
        """
        state = self._reqs.get(request.request_id)
        if state is not None and not (num_new_computed_tokens or num_lookahead_tokens):
            # The decode fast path: the table already has the slots and no block fills up.
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(state.blocks) * self.block_size and (
                not self.enable_caching or end < (state.num_cached + 1) * self.block_size
            ) and num_new_tokens >= 0 and not new_computed_blocks:
                return []
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0: new={num_new_tokens}, "
                f"new_computed={num_new_computed_tokens}, lookahead={num_lookahead_tokens}"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        if state is None:
            new_blocks = self._allocate_first(
                request, num_computed, num_required, new_computed_blocks or []
            )
            if new_blocks is None:
                return None
            state = self._reqs[request.request_id]
        else:
            if new_computed_blocks:
                raise ValueError(
                    f"request {request.request_id} already holds blocks: prefix hits are only "
                    "accepted on its first allocation"
                )
            # The decode path: usually nothing to allocate and nothing became full.
            num_missing = num_required - len(state.blocks)
            if num_missing <= 0:
                new_blocks = []
            elif num_missing > self.pool.num_free_blocks:
                return None
            else:
                new_blocks = self.pool.get_new_blocks(num_missing)
                state.blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            # Lookahead (speculative) slots hold guesses, and tokens past num_tokens are not
            # known yet (async placeholders): neither may be cached.
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            if num_full > state.num_cached:
                self._cache_full_blocks(request, state, num_full)
        return new_blocks

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Register the request's full blocks up to `num_tokens` in the prefix cache (blocks
        whose KV arrived from another engine and was verified)."""
        state = self._reqs.get(request.request_id)
        if state is None or not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens, len(state.blocks) * self.block_size)
        num_full //= self.block_size
        if num_full > state.num_cached:
            self._cache_full_blocks(request, state, num_full)

    def _allocate_first(
        self,
        request: KVRequest,
        num_computed: int,
        num_required: int,
        hits: list[KVCacheBlock],
    ) -> list[KVCacheBlock] | None:
        """Create the request's table: its prefix hits, then fresh blocks; None if short."""
        if hits:
            self._check_hits(request, num_computed, hits)
        num_new = max(0, num_required - len(hits))
        # Touching a hit that sits in the free queue takes it out of the free count.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new > self.pool.num_free_blocks - num_revived:
            return None
        # Touch before popping, so the new blocks cannot evict this request's own hits.
        self.pool.touch(hits)
        new_blocks = self.pool.get_new_blocks(num_new)
        self._reqs[request.request_id] = _ReqBlocks(hits + new_blocks, num_cached=len(hits))
        return new_blocks

    def _check_hits(self, request: KVRequest, num_computed: int, hits: list[KVCacheBlock]) -> None:
        """Reject hits that do not cover the request's prefix (misuse, or evicted meanwhile)."""
        if not self.enable_caching:
            raise ValueError("prefix hits given while prefix caching is disabled")
        if len(hits) * self.block_size > num_computed:
            raise ValueError(
                f"{len(hits)} hit blocks exceed the {num_computed} computed tokens of "
                f"request {request.request_id}"
            )
        hashes = request.block_hashes
        for i, block in enumerate(hits):
            if i >= len(hashes) or block.block_hash != hashes[i]:
                raise ValueError(
                    f"stale prefix hit for request {request.request_id}: block "
                    f"{block.block_id} no longer caches block {i} of its prefix"
                )

    def _cache_full_blocks(self, request: KVRequest, state: _ReqBlocks, num_full: int) -> None:
        """Register the request's blocks [num_cached, num_full) in the prefix cache."""
        bs = self.block_size
        hashes, tokens = request.block_hashes, request.all_token_ids
        if len(hashes) < num_full:
            extend_block_hashes(hashes, tokens, bs, hash_keys(request))
        self.pool.cache_full_blocks(state.blocks, hashes, tokens, bs, state.num_cached, num_full,
                                    request.lora_name)
        state.num_cached = num_full

    def free(self, request: KVRequest) -> None:
        """Release the request's blocks, tail first, so a sequence's tail is evicted before the
        prefix it may share with others. A request holding nothing is a no-op."""
        self.free_id(request.request_id)

    def free_id(self, request_id: str) -> None:
        """`free` by id (blocks held under a key that is no request's, e.g. a session's)."""
        state = self._reqs.pop(request_id, None)
        if state is not None:
            self.pool.free_blocks(reversed(state.blocks))

    def hand_over(self, from_id: str, to_id: str, num_tokens: int) -> int:
        """Give `to_id` the blocks of `from_id` that hold its first `num_tokens` tokens (a
        session's next turn takes over its KV) and free the rest, tail first. Returns how many
        tokens the kept blocks hold: the new owner overwrites the rest of a partly kept block,
        so a cached (full, shareable) one is not kept and the count drops to its start."""
        state = self._reqs.pop(from_id, None)
        if state is None:
            return 0
        bs = self.block_size
        if num_tokens % bs and num_tokens // bs < state.num_cached:
            num_tokens -= num_tokens % bs
        num_keep = -(-num_tokens // bs)
        self.pool.free_blocks(reversed(state.blocks[num_keep:]))
        if num_keep:
            del state.blocks[num_keep:]
            state.num_cached = min(state.num_cached, num_tokens // bs)
            self._reqs[to_id] = state
        return num_tokens

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(queries, hits) in tokens since the previous call."""
        last_queries, last_hits = self._stats_taken
        self._stats_taken = (self.prefix_cache_queries, self.prefix_cache_hits)
        return self.prefix_cache_queries - last_queries, self.prefix_cache_hits - last_hits

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's KV-cache events since the last call (see `BlockPool`)."""
        return self.pool.take_events()

    def check_integrity(self) -> None:
        """Assert pool invariants, and that each block's ref count equals its number of holders."""
        self.pool.check_integrity()
        holders = [0] * self.num_blocks
        for request_id, state in self._reqs.items():
            ids = [b.block_id for b in state.blocks]
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice"
            assert state.num_cached <= len(state.blocks), f"request {request_id} over-cached"
            for block_id in ids:
                holders[block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders[block.block_id]} "
                "holders"
            )
