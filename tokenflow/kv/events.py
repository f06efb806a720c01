"""KV-cache events in vLLM's wire format: what a replica's block pool stored, evicted or cleared,
for routers and KV indexers that track where every block lives (llm-d's indexer, Dynamo's KV
router, tokenflow's `kv_aware` router).

The structs are msgpack-encoded with msgspec exactly as vLLM encodes its own (struct fields as a
map, events tagged with their class name under "type"), so a consumer written for vLLM decodes
them unchanged. Field names and order follow `vllm/distributed/kv_events.py`; the field
meanings:

- `block_hashes`: chained 64-bit prefix hashes (`tokenflow.kv.hashing`), in block order;
  `parent_block_hash`: the hash of the block before the first one (None: they start the prompt).
- `token_ids`: the tokens of those blocks, concatenated (`block_size` per block).
- `medium`: the tier the blocks live in (`GPU`, `CPU` for the primary pool of a CPU engine,
  and the offload tiers' names).
- `lora_id` / `lora_name`: the adapter whose KV it is (None: the base model).
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """One engine step's events, stamped with the wall-clock time they were drained."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """A change to the set of cached (prefix-hittable) blocks."""


class BlockStored(KVCacheEvent):
    """Full blocks joined the prefix cache: a request may now hit them."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted (their memory went to other tokens)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block was forgotten (a cache reset, or workers that restarted)."""


class KVEventBatch(EventBatch):
    """An `EventBatch` whose events decode as the three KV-cache event types."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decoder() -> msgspec.msgpack.Decoder:
    """A decoder of published payloads (consumers and tests)."""
    return msgspec.msgpack.Decoder(type=KVEventBatch)
