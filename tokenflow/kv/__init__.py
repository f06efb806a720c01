"""Paged KV cache bookkeeping: the block pool, prefix-cache hashing and the KV cache manager."""

from tokenflow.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tokenflow.kv.hashing import extend_block_hashes, hash_block_tokens
from tokenflow.kv.manager import KVCacheManager, KVRequest

__all__ = [
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVRequest",
    "extend_block_hashes",
    "hash_block_tokens",
]
