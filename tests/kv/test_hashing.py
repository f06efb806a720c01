"""Block hashes: stable across processes, sensitive to parent, tokens and extra keys."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tokenflow.kv.hashing import extend_block_hashes, hash_block_tokens


def test_same_input_same_hash_in_another_process() -> None:
    args = "(12345, [1, 2, 3, 4], ('lora-a', 7))"
    here = hash_block_tokens(12345, [1, 2, 3, 4], ("lora-a", 7))
    code = f"from tokenflow.kv.hashing import hash_block_tokens as h; print(h(*{args}))"
    # A fresh interpreter gets a fresh PYTHONHASHSEED: a salted hash() would differ here.
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert int(out) == here


def test_hash_is_unsigned_64_bit() -> None:
    for parent in (None, 0, 2**64 - 1):
        h = hash_block_tokens(parent, [0, 1, 2])
        assert 0 <= h < 2**64


def test_parent_tokens_and_extras_all_matter() -> None:
    base = hash_block_tokens(7, [1, 2, 3, 4])
    assert base == hash_block_tokens(7, (1, 2, 3, 4))
    assert base != hash_block_tokens(8, [1, 2, 3, 4])
    assert base != hash_block_tokens(None, [1, 2, 3, 4])
    assert base != hash_block_tokens(7, [1, 2, 3, 5])
    assert base != hash_block_tokens(7, [2, 1, 3, 4])
    assert base != hash_block_tokens(7, [1, 2, 3, 4], ("salt",))
    # The first block (no parent) is not the same as a parent hash of 0.
    assert hash_block_tokens(None, [1]) != hash_block_tokens(0, [1])


def test_extra_keys_are_type_tagged() -> None:
    toks = [5, 6]
    variants = [(1,), (True,), ("1",), (b"1",), (1.0,), (None,), ((1,),), (1, 2), ((1, 2),)]
    hashes = {hash_block_tokens(None, toks, v) for v in variants}
    assert len(hashes) == len(variants)


def test_unsupported_extra_key_raises() -> None:
    with pytest.raises(ValueError, match="unsupported extra key"):
        hash_block_tokens(None, [1], (object(),))


def test_numpy_tokens_hash_like_ints() -> None:
    toks = [3, 1, 4, 1, 5]
    assert hash_block_tokens(9, np.array(toks, dtype=np.int64)) == hash_block_tokens(9, toks)


def test_extend_hashes_full_blocks_only_and_chains() -> None:
    tokens = list(range(10))
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, block_size=4)
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert hashes == [h0, h1]  # tokens 8, 9 form a partial block: not hashed


def test_extend_is_incremental() -> None:
    tokens = list(range(5))
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, 4)
    first = hashes[0]
    tokens += [9, 9, 9, 9, 9]
    extend_block_hashes(hashes, tokens, 4)
    assert hashes[0] == first and len(hashes) == 2
    one_shot: list[int] = []
    extend_block_hashes(one_shot, tokens, 4)
    assert hashes == one_shot
    extend_block_hashes(hashes, tokens, 4)  # nothing new: no change
    assert hashes == one_shot


def test_a_different_prefix_changes_every_later_hash() -> None:
    a: list[int] = []
    b: list[int] = []
    extend_block_hashes(a, [1, 1, 1, 1, 2, 2, 2, 2], 4)
    extend_block_hashes(b, [1, 1, 1, 0, 2, 2, 2, 2], 4)
    assert a[0] != b[0] and a[1] != b[1]
