"""The CPU's paged decode kernel (attention/paged_attention.c) against the torch backend's gather
path: decodes read in place through their block table rows, GQA groups, sliding windows,
mixed with prompts; and what happens without a C compiler."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tokenflow.replica.attention import cpu_kernel
from tokenflow.replica.attention.backends import (
    AttentionMetadata,
    CpuAttentionBackend,
    TorchAttentionBackend,
    attend,
    attention_step,
    select_backend,
)

BLOCK_SIZE = 16


def _step(seq_lens: list[int], query_lens: list[int], heads: int, kv_heads: int, dim: int,
          window: int | None, seed: int):
    """A random cache with scattered blocks and one step's q/k/v and metadata."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 3
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen)
    table, slots, qsl = [], [], [0]
    width = max(8, -(-max(seq_lens) // BLOCK_SIZE) + 1)
    for n, q in zip(seq_lens, query_lens, strict=True):
        own = [order.pop() for _ in range(-(-n // BLOCK_SIZE))]
        table.append(own + [-1] * (width - len(own)))  # -1: padding past the request's blocks
        slots += [own[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n - q, n)]
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata.build(slot_mapping=slots, block_table=table, query_start_loc=qsl,
                                   seq_lens=seq_lens, block_size=BLOCK_SIZE, window=window)
    qkv = torch.randn(qsl[-1], heads + 2 * kv_heads, dim, generator=gen)  # strided q, k, v
    q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
    return cache, q, k, v, meta


@pytest.fixture(scope="module")
def kernel() -> cpu_kernel.PagedAttentionKernel:
    loaded = cpu_kernel.load()
    assert loaded is not None, "the paged decode kernel did not build (is a C compiler there?)"
    return loaded


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("shape", ["decodes", "many decodes", "mixed", "one long", "few long"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("invariant", [False, True])
def test_kernel_equals_the_gather_path(kernel, heads, kv_heads, dim, window, shape,
                                       cache_dtype, invariant) -> None:
    if shape == "decodes":  # few: a task per request
        seq_lens, query_lens = [1, 17, 100, 33, 64, 120], [1] * 6
    elif shape == "many decodes":  # a task per request
        seq_lens = [1, 17, 100, 33, 64, 120, 31, 32, 33, 127, 5, 80]
        query_lens = [1] * len(seq_lens)
    elif shape == "one long":  # one request: its context split into chunks, merged
        seq_lens, query_lens = [700], [1]
    elif shape == "few long":  # chunks of unequal contexts, some shorter than a chunk
        seq_lens, query_lens = [300, 129, 7, 1000], [1] * 4
    else:  # a prompt first, a chunk after a prefix, decodes between
        seq_lens, query_lens = [40, 5, 90, 70, 2], [40, 1, 1, 30, 1]
    cache, q, k, v, meta = _step(seq_lens, query_lens, heads, kv_heads, dim, window, seed=1)
    cache = cache.to(cache_dtype)  # bfloat16: the step's K/V are rounded as they are written
    expected_cache = cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, expected_cache, meta, dim**-0.5)
    out = CpuAttentionBackend(kernel, invariant).forward(q, k, v, cache, meta, dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(cache, expected_cache)  # the step's K/V written (and rounded) the same


@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 40), (5, 5, 16)])
@pytest.mark.parametrize("window", [None, 20, 77])
@pytest.mark.parametrize("shape", ["prompts", "chunks", "mixed"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("invariant", [False, True])
def test_prefill_kernel_equals_sdpa(kernel, heads, kv_heads, dim, window, shape,
                                    cache_dtype, invariant) -> None:
    """Prompts (one task and many: up to 48 query rows a task, 16 for the batch invariant
    kernel), chunks at offsets that are no tile's (a prefix hit, a prompt's later chunk), and
    both beside decodes."""
    if shape == "prompts":
        seq_lens, query_lens = [300, 2, 17, 130], [300, 2, 17, 130]
    elif shape == "chunks":
        seq_lens, query_lens = [300, 129, 61], [133, 100, 60]
    else:
        seq_lens, query_lens = [250, 9, 200, 33, 3], [250, 1, 37, 1, 3]
    cache, q, k, v, meta = _step(seq_lens, query_lens, heads, kv_heads, dim, window, seed=7)
    cache = cache.to(cache_dtype)
    expected_cache = cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, expected_cache, meta, dim**-0.5)
    out = CpuAttentionBackend(kernel, invariant).forward(q, k, v, cache, meta, dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(cache, expected_cache)


def test_a_prompt_s_rows_do_not_depend_on_its_chunks(kernel) -> None:
    """The kernel computes each query row alone: a prompt attended whole and in chunks of
    any size above one (each over what the cache holds) gives bit-identical rows. (A chunk of
    one token is a decode: the decode kernel's sums run in another order.)"""
    gen = torch.Generator().manual_seed(11)
    n, heads, kv_heads, dim = 150, 9, 3, 64
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = (torch.randn(n, kv_heads, dim, generator=gen) for _ in range(2))
    blocks = -(-n // BLOCK_SIZE)
    table = [list(range(blocks))]
    attention = CpuAttentionBackend(kernel)

    def run(cuts: list[int]) -> torch.Tensor:
        cache = torch.zeros(2, blocks, BLOCK_SIZE, kv_heads, dim, dtype=torch.bfloat16)
        rows = []
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            meta = AttentionMetadata.build(slot_mapping=list(range(lo, hi)), block_table=table,
                                           query_start_loc=[0, hi - lo], seq_lens=[hi],
                                           block_size=BLOCK_SIZE)
            rows.append(attention.forward(q[lo:hi], k[lo:hi], v[lo:hi], cache, meta, 0.125))
        return torch.cat(rows)

    whole = run([])
    assert torch.equal(run([37]), whole)
    assert torch.equal(run([5, 64, 100, 148]), whole)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_batch_invariant_attention_gives_a_row_the_same_bits_in_any_step(
        kernel, cache_dtype, window) -> None:
    """With `batch_invariant`, a decode's row is computed as a prompt's row is: a prompt
    attended whole, then its last token attended as a decode (after the rest), alone or beside
    other decodes and prompts, gives that token bit-identical results."""
    gen = torch.Generator().manual_seed(21)
    n, heads, kv_heads, dim = 90, 9, 3, 64
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = (torch.randn(n, kv_heads, dim, generator=gen) for _ in range(2))
    others = [torch.randn(m, heads + 2 * kv_heads, dim, generator=gen) for m in (1, 30, 1)]
    attention = CpuAttentionBackend(kernel, batch_invariant=True)
    blocks = -(-n // BLOCK_SIZE)

    def run(beside: list[torch.Tensor]) -> torch.Tensor:
        """The prompt's first n - 1 tokens, then its last one as a decode beside `beside`
        (each a fresh request of its own); returns the last token's row."""
        cache = torch.zeros(2, blocks * (1 + len(beside)), BLOCK_SIZE, kv_heads, dim,
                            dtype=cache_dtype)
        table = [list(range(blocks))]
        meta = AttentionMetadata.build(slot_mapping=list(range(n - 1)), block_table=table,
                                       query_start_loc=[0, n - 1], seq_lens=[n - 1],
                                       block_size=BLOCK_SIZE, window=window)
        attention.forward(q[:n - 1], k[:n - 1], v[:n - 1], cache, meta, dim**-0.5)
        slots, qsl, seqs, qs, ks, vs = [n - 1], [0, 1], [n], [q[-1:]], [k[-1:]], [v[-1:]]
        for i, t in enumerate(beside, start=1):
            m = t.shape[0]
            table.append(list(range(i * blocks, (i + 1) * blocks)))
            slots += [i * blocks * BLOCK_SIZE + p for p in range(m)]
            qsl.append(qsl[-1] + m)
            seqs.append(m)
            bq, bk, bv = t.split((heads, kv_heads, kv_heads), dim=1)
            qs.append(bq)
            ks.append(bk)
            vs.append(bv)
        meta = AttentionMetadata.build(slot_mapping=slots, block_table=table,
                                       query_start_loc=qsl, seq_lens=seqs,
                                       block_size=BLOCK_SIZE, window=window)
        return attention.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta,
                                 dim**-0.5)[0]

    cache = torch.zeros(2, blocks, BLOCK_SIZE, kv_heads, dim, dtype=cache_dtype)
    meta = AttentionMetadata.build(slot_mapping=list(range(n)), block_table=[list(range(blocks))],
                                   query_start_loc=[0, n], seq_lens=[n], block_size=BLOCK_SIZE,
                                   window=window)
    whole = attention.forward(q, k, v, cache, meta, dim**-0.5)[-1]
    assert torch.equal(run([]), whole)
    assert torch.equal(run(others), whole)
    assert torch.equal(run(others[:1]), whole)


def test_kernel_declines_groups_beyond_its_buffers(kernel) -> None:
    cache, q, k, v, meta = _step([10, 20], [1, 1], 32, 1, 8, None, seed=2)
    out, before = torch.full(q.shape, 7.0), cache.clone()
    assert not kernel(q, k, v, cache, meta, 1.0, out)
    assert torch.all(out == 7.0) and torch.equal(cache, before)
    expected = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 1.0)
    torch.testing.assert_close(CpuAttentionBackend(kernel).forward(q, k, v, cache, meta, 1.0),
                               expected)


def test_the_cpu_gets_the_kernel_and_no_compiler_gets_the_gather_path(
        kernel, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(select_backend("cpu"), CpuAttentionBackend)
    monkeypatch.setenv("TOKENFLOW_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_kernel.load.__wrapped__() is None
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


def test_each_thread_attends_with_its_own_step() -> None:
    """Two engines stepping in two threads of one process: each layer's `attend` finds its own
    thread's metadata and caches, however the threads interleave."""
    barrier = threading.Barrier(2)
    results: dict[int, bool] = {}

    def engine(seed: int) -> None:
        cache, q, k, v, meta = _step([5 + seed, 30], [1, 1], 4, 2, 8, None, seed=seed)
        expected = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.5)
        with attention_step(meta, [cache], TorchAttentionBackend()):
            barrier.wait()  # both threads are inside their steps now
            out = attend(q, k, v, 0, 0, 0.5)
            barrier.wait()
        results[seed] = torch.equal(out, expected)

    threads = [threading.Thread(target=engine, args=(seed,)) for seed in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {3: True, 4: True}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_bfloat16_cache_gives_a_whole_prompt_what_its_chunks_get(kernel, backend) -> None:
    """A prompt attended whole (over its fresh K/V) and in two chunks (the second reading the
    first's K/V back from the cache) agree when the cache is bfloat16: the whole prompt's K/V
    are rounded as the cache rounds them. With float32 K/V the whole prompt differs."""
    gen = torch.Generator().manual_seed(5)
    n, first, heads, kv_heads, dim = 40, 24, 9, 3, 64
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = (torch.randn(n, kv_heads, dim, generator=gen) for _ in range(2))
    blocks = -(-n // BLOCK_SIZE)
    table, slots = [list(range(blocks))], list(range(n))
    attention = TorchAttentionBackend() if backend == "torch" else CpuAttentionBackend(kernel)

    def run(cache, tokens, seq_len):
        count = tokens.stop - tokens.start
        meta = AttentionMetadata.build(slot_mapping=slots[seq_len - count:seq_len],
                                       block_table=table, query_start_loc=[0, count],
                                       seq_lens=[seq_len], block_size=BLOCK_SIZE)
        return attention.forward(q[tokens], k[tokens], v[tokens], cache, meta, dim**-0.5)

    def fresh():
        return torch.zeros(2, blocks, BLOCK_SIZE, kv_heads, dim, dtype=torch.bfloat16)

    whole = run(fresh(), slice(0, n), n)
    cache = fresh()
    run(cache, slice(0, first), first)
    second = run(cache, slice(first, n), n)
    torch.testing.assert_close(second, whole[first:], atol=2e-6, rtol=1e-5)
    unrounded = run(torch.zeros(2, blocks, BLOCK_SIZE, kv_heads, dim), slice(0, n), n)
    assert (unrounded - whole).abs().max() > 1e-4
