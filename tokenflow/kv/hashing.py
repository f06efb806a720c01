"""Prefix-cache block hashes: stable 64-bit digests of (parent hash, block tokens, extra keys).

The hash must be identical in every process and on every machine (routers compute it too to
route a prompt to the replica that caches its prefix), so it is a blake2b digest over an explicit
little-endian byte layout, never Python's salted `hash()`.

Layout of the hashed bytes:
    parent:  b"\\x00" for the first block, else b"\\x01" + uint64
    tokens:  uint32 count, then one int64 per token
    extras:  only when present, a tagged encoding of each key (see `_encode_key`)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

_NO_PARENT = b"\x00"
_PARENT = struct.Struct("<BQ")
# One compiled Struct per block length: in practice there is a single block size, so this holds
# one or two entries and saves re-parsing a format string on every full block.
_TOKEN_STRUCTS: dict[int, struct.Struct] = {}


def _token_struct(n: int) -> struct.Struct:
    s = _TOKEN_STRUCTS.get(n)
    if s is None:
        s = _TOKEN_STRUCTS[n] = struct.Struct(f"<I{n}q")
    return s


def _encode_key(key: Any, out: bytearray) -> None:
    """Append a self-delimiting, type-tagged encoding of one extra key."""
    # bool before int: bool is an int subclass, and True must not hash like 1.
    if key is None:
        out += b"n"
    elif isinstance(key, bool):
        out += b"T" if key else b"F"
    elif isinstance(key, int):
        digits = str(key).encode()
        out += b"i" + struct.pack("<I", len(digits)) + digits
    elif isinstance(key, str):
        data = key.encode("utf-8")
        out += b"s" + struct.pack("<I", len(data)) + data
    elif isinstance(key, bytes):
        out += b"b" + struct.pack("<I", len(key)) + key
    elif isinstance(key, float):
        out += b"d" + struct.pack("<d", key)
    elif isinstance(key, (tuple, list)):
        out += b"(" + struct.pack("<I", len(key))
        for item in key:
            _encode_key(item, out)
    else:
        raise ValueError(f"unsupported extra key type for block hashing: {type(key).__name__}")


def hash_block_tokens(
    parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> int:
    """Stable 64-bit hash (in [0, 2**64)) of one block chained to its parent's hash."""
    head = _NO_PARENT if parent_hash is None else _PARENT.pack(1, parent_hash)
    h = hashlib.blake2b(head, digest_size=8)
    h.update(_token_struct(len(token_ids)).pack(len(token_ids), *token_ids))
    if extra_keys:
        extras = bytearray(b"x")
        _encode_key(tuple(extra_keys), extras)
        h.update(extras)
    return int.from_bytes(h.digest(), "little")


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple = ()) -> None:
    """Append the hash of every full block of `token_ids` that `block_hashes` does not cover yet.

    Block i chains from block i-1's hash (block 0 from None), so equal hashes mean equal
    prefixes, not just equal blocks. A trailing partial block is never hashed. `extra_keys`
    go into every block's hash (as vLLM's: the LoRA adapter's name, whose KV differs).
    """
    num_full = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for i in range(len(block_hashes), num_full):
        start = i * block_size
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        block_hashes.append(parent)
