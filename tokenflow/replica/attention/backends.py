"""Paged attention over one flattened varlen batch: per-step metadata and the backends.

A step's tokens are one flat batch; request r owns tokens `query_start_loc[r]:[r+1]`, the last
`query_len` of its `seq_len` context tokens. Each layer writes its new K/V into the paged cache
(`[2, num_blocks, block_size, num_kv_heads, head_dim]`) through `slot_mapping`, then attends over
the request's whole context through its row of `block_table`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tokenflow.replica.attention import cpu_kernel
from tokenflow.replica.attention.cpu_kernel import PagedAttentionKernel

IntArray = np.ndarray | Sequence[int]
# K+V bytes gathered per decode SDPA call: small enough to be still in cache when SDPA reads it
# (on 2 cores, 1.3-2.5x faster than one batch-wide gather at 64 x 300 tokens x 8 KV heads).
_GATHER_BYTES = 8 << 20


@dataclass
class PrefillSpan:
    """One request of the step that computes more than one token (a prompt or a chunk of one)."""

    token_start: int
    token_end: int
    seq_len: int
    # Blocks holding its context [ceil(seq_len / block_size)]; None when the context is exactly
    # this step's tokens, which are then used directly.
    block_ids: torch.Tensor | None
    # [query_len, seq_len] additive mask: query i sees keys 0 .. seq_len - query_len + i (and,
    # under a sliding window, none more than window - 1 behind it); None: plain causal.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Everything the attention of one step needs, built once per step and shared by all layers.

    A layer with a sliding window asks `for_window(w)` for a variant whose masks also hide
    keys more than `w - 1` positions behind each query (built once per step and window).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64 flat slot (block_id * block_size + offset)
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length including this step's tokens
    seq_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative seq_lens (flash-attn's cu_k)
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Requests computing one token (decodes) are attended together as one padded batch.
    decode_token_idx: torch.Tensor  # [num_decodes] int64 token index of each decode
    decode_block_ids: torch.Tensor  # [num_decodes * decode_blocks] int64, row-major
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, decode_blocks * block_size] additive
    # The decodes' own block table rows and context lengths (the CPU kernel reads in place).
    decode_block_table: torch.Tensor  # [num_decodes, decode_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    decodes_lead: bool  # the decodes are exactly tokens [0, num_decodes) of the batch
    prefills: list[PrefillSpan]
    prefill_reqs: torch.Tensor  # [len(prefills)] int64 request index of each prefill span
    window: int | None = None  # keys a query sees, itself included; None = all before it
    _windowed: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)
    _host: tuple[np.ndarray, np.ndarray, np.ndarray, torch.device | str, torch.dtype] | None = (
        field(default=None, repr=False))

    @property
    def num_decodes(self) -> int:
        return self.decode_token_idx.shape[0]

    @classmethod
    def build(
        cls,
        *,
        slot_mapping: IntArray,
        block_table: np.ndarray | Sequence[Sequence[int]],
        query_start_loc: IntArray,
        seq_lens: IntArray,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        window: int | None = None,
    ) -> AttentionMetadata:
        """From host arrays; `dtype` is the model's (the masks are added to its scores)."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        seq = np.asarray(seq_lens, dtype=np.int64)
        table = np.asarray(block_table, dtype=np.int64).reshape(len(seq), -1)
        qlens = np.diff(qsl)
        dec = np.flatnonzero(qlens == 1)
        ids, mask = _decode_gather(table[dec], seq[dec], block_size, window)
        dec_table = ids.reshape(len(dec), -1) if len(dec) else np.zeros((0, 1), np.int64)

        def put(a: np.ndarray, dt: np.dtype | type) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=dt)).to(device)

        return cls(
            slot_mapping=put(np.asarray(slot_mapping), np.int64),
            block_table=put(table, np.int32),
            query_start_loc=put(qsl, np.int32),
            seq_lens=put(seq, np.int32),
            seq_start_loc=put(np.concatenate(([0], np.cumsum(seq))), np.int32),
            max_query_len=int(qlens.max(initial=0)),
            max_seq_len=int(seq.max(initial=0)),
            block_size=block_size,
            query_lens_cpu=qlens.tolist(),
            seq_lens_cpu=seq.tolist(),
            decode_token_idx=put(qsl[dec], np.int64),
            decode_block_ids=put(ids, np.int64),
            decode_mask=put(mask, np.float32).to(dtype),
            decode_block_table=put(dec_table, np.int32),
            decode_seq_lens=put(seq[dec], np.int32),
            decodes_lead=bool(np.array_equal(qsl[dec], np.arange(len(dec)))),
            prefills=[
                _prefill_span(int(qsl[r]), int(qlens[r]), int(seq[r]), table[r], block_size,
                              device, dtype, window)
                for r in np.flatnonzero(qlens > 1)
            ],
            prefill_reqs=put(np.flatnonzero(qlens > 1), np.int64),
            window=window,
            _host=(qsl, seq, table, device, dtype),
        )

    def for_window(self, window: int | None) -> AttentionMetadata:
        """This step's metadata for a layer whose queries see only their last `window` keys."""
        if window is None or window >= self.max_seq_len:
            return self  # no context reaches past the window: plain causal attention
        variant = self._windowed.get(window)
        if variant is None:
            assert self._host is not None
            qsl, seq, table, device, dtype = self._host
            variant = self._windowed[window] = AttentionMetadata.build(
                slot_mapping=self.slot_mapping.cpu().numpy(), block_table=table,
                query_start_loc=qsl, seq_lens=seq, block_size=self.block_size,
                device=device, dtype=dtype, window=window)
        return variant


def _decode_gather(
    table: np.ndarray, seq: np.ndarray, block_size: int, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Block ids to gather for the decodes, padded to the longest, and the mask of the padding
    (and of keys outside the window)."""
    nblocks = -(-int(seq.max(initial=0)) // block_size)
    ids = table[:, :nblocks].copy()  # [num_decodes, nblocks]
    # Entries past a request's own blocks may be stale or -1: point them at block 0, masked out.
    ids[np.arange(nblocks)[None, :] >= -(-seq[:, None] // block_size)] = 0
    keys = np.arange(nblocks * block_size)[None, :]
    visible = keys < seq[:, None]
    if window is not None:  # the query sits at seq - 1
        visible &= keys >= seq[:, None] - window
    mask = np.where(visible, 0.0, -np.inf)  # [num_decodes, nblocks * block_size]
    return ids.reshape(-1), mask[:, None, None, :]


def _prefill_span(
    start: int,
    qlen: int,
    seq_len: int,
    row: np.ndarray,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    window: int | None,
) -> PrefillSpan:
    windowed = window is not None and window < seq_len
    if qlen == seq_len and not windowed:
        return PrefillSpan(start, start + qlen, seq_len, None, None)
    ids = None
    if qlen < seq_len:
        ids = torch.from_numpy(np.ascontiguousarray(row[: -(-seq_len // block_size)])).to(device)
    # Causal with an offset: the queries are the last qlen of seq_len positions.
    query_pos = np.arange(qlen)[:, None] + (seq_len - qlen)
    keys = np.arange(seq_len)[None, :]
    visible = keys <= query_pos
    if windowed:
        visible &= keys > query_pos - window
    mask = torch.from_numpy(np.where(visible, 0.0, -np.inf)).to(device=device, dtype=dtype)
    return PrefillSpan(start, start + qlen, seq_len, ids, mask)


class AttentionBackend(Protocol):
    """Writes a layer's new K/V into its cache and attends; one instance serves all layers."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's K/V [T, KVH, D] into their slots of the paged cache (in the cache's
    dtype: a bfloat16 cache under a float32 model rounds them)."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])  # [2, num_blocks * block_size, KVH, D]
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


class TorchAttentionBackend:
    """Paged attention in plain torch (CPU, and the GPU fallback); owns a reusable gather buffer.

    Decodes are gathered block-wise into padded [B, L, KVH, D] batches of a few MB, each attended
    with one SDPA call in which the query heads of a KV head are its query rows; prompts and
    chunks go one by one, with SDPA's `enable_gqa`. K/V are never repeated per query head. The
    cache must hold finite values (zero-initialise it): padded slots are masked with -inf,
    which a NaN would survive.

    A cache in another dtype than the model's (`cache.dtype: bfloat16` under a float32 model)
    is read back in the model's: every path attends over the K/V as the cache holds them, a
    prompt's own fresh ones included, so chunked, prefix-hit and whole prefills agree.
    """

    def __init__(self) -> None:
        # Fresh multi-MB tensors cost page faults on every layer; reuse one buffer instead.
        self._workspace = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if not meta.prefills and meta.decodes_lead:
            return self._decode(q, kv_cache, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            idx = meta.decode_token_idx
            out.index_copy_(0, idx, self._decode(q.index_select(0, idx), kv_cache, meta, scale))
        return self._attend_prefills(q, k, v, kv_cache, meta, scale, out)

    def _attend_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                         out: torch.Tensor) -> torch.Tensor:
        """Each prompt or chunk of the step into its rows of `out`; returns `out`."""
        for span in meta.prefills:
            s = slice(span.token_start, span.token_end)
            out[s] = self._prefill(q[s], k[s], v[s], kv_cache, span, scale)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q [B, H, D] (one token per request) -> [B, H, D], a cache-sized group at a time."""
        ids = meta.decode_block_ids.view(q.shape[0], -1)  # [B, blocks]
        mask = meta.decode_mask.to(q.dtype)
        per_request = 2 * ids.shape[1] * kv_cache[0, 0].numel() * q.element_size()
        group = max(1, _GATHER_BYTES // per_request)
        if group >= q.shape[0]:
            return self._decode_group(q, ids, mask, kv_cache, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for s in range(0, q.shape[0], group):
            g = slice(s, s + group)
            out[g] = self._decode_group(q[g], ids[g], mask[g], kv_cache, scale)
        return out

    def _decode_group(
        self,
        q: torch.Tensor,
        ids: torch.Tensor,
        mask: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Gather the group's blocks into the reused buffer, then one SDPA over the group."""
        batch, (_, _, block_size, kv_heads, head_dim) = q.shape[0], kv_cache.shape
        flat = ids.reshape(-1)
        numel = flat.numel() * block_size * kv_heads * head_dim
        buf = self._buffer(2 * numel, kv_cache)
        shape = (flat.numel(), block_size, kv_heads, head_dim)
        k = torch.index_select(kv_cache[0], 0, flat, out=buf[:numel].view(shape)).to(q.dtype)
        v = torch.index_select(kv_cache[1], 0, flat, out=buf[numel:].view(shape)).to(q.dtype)
        k = k.view(batch, -1, kv_heads, head_dim).transpose(1, 2)  # [B, KVH, L, D]
        v = v.view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        # The query heads of one KV head act as its query rows: K/V are read once per KV head.
        q = q.view(batch, kv_heads, -1, head_dim)  # [B, KVH, H / KVH, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out.view(batch, -1, head_dim)  # [B, H, D]

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        span: PrefillSpan,
        scale: float,
    ) -> torch.Tensor:
        """One request's q [n, H, D] against its context -> [n, H, D]."""
        if span.block_ids is not None:
            # Earlier context sits in the cache (chunk, prefix hit): read all of it from there.
            ctx = kv_cache.index_select(1, span.block_ids)  # [2, blocks, block_size, KVH, D]
            k, v = ctx.flatten(1, 2)[:, : span.seq_len].to(q.dtype)  # [S, KVH, D] each
        elif kv_cache.dtype != k.dtype:  # as a later chunk would read them back
            k, v = k.to(kv_cache.dtype).to(q.dtype), v.to(kv_cache.dtype).to(q.dtype)
        mask = None if span.mask is None else span.mask.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            k.transpose(0, 1).unsqueeze(0),  # [1, KVH, S, D]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        ws = self._workspace
        if ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
            self._workspace = ws = torch.empty(numel, dtype=like.dtype, device=like.device)
        return ws[:numel]


class CpuAttentionBackend(TorchAttentionBackend):
    """The CPU's backend: every query reads the paged cache through the C kernels
    (`cpu_kernel.py`, one call per layer for all of a step's decodes and one for all of its
    prompts and chunks: no mask tensor; a prompt's rows are computed the same whether it comes
    whole or in chunks). Shapes beyond the kernels go through the torch backend's SDPA. Owns
    the kernel and the prefill kernel's float32 workspace (each context's K and V copied out
    of their blocks: ~2x SDPA at 290 tokens, bench/README).

    `batch_invariant`: the whole step goes through the batch invariant kernel instead, which
    computes every query row, a decode's, a prompt's, a chunk's or a prefix hit's, in one
    arithmetic that depends on the row alone (the decode kernel splits few contexts into
    chunks and merges them; the prefill kernel sums a score in another order than the decode
    kernel). Its cost (bench/README, "Batch invariance"): decodes 1.1-1.3x the decode
    kernel's time, prompts ~2.5x the prefill kernel's (still faster than SDPA)."""

    def __init__(self, kernel: PagedAttentionKernel, batch_invariant: bool = False) -> None:
        super().__init__()
        self._kernel = kernel
        self.batch_invariant = batch_invariant
        self._prefill_workspace = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if not self._kernel.supports(q, k, v, kv_cache):
            return super().forward(q, k, v, kv_cache, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.batch_invariant:
            if self._kernel.invariant(q, k, v, kv_cache, meta, scale, out):
                return out
            return super().forward(q, k, v, kv_cache, meta, scale)
        if not meta.num_decodes:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        # Writes the step's K/V, then attends the decodes.
        elif not self._kernel(q, k, v, kv_cache, meta, scale, out):
            return super().forward(q, k, v, kv_cache, meta, scale)
        if meta.prefills and not self._kernel.prefill(
                q, kv_cache, meta, scale, self._workspace_for(meta, kv_cache), out):
            return self._attend_prefills(q, k, v, kv_cache, meta, scale, out)
        return out

    def _workspace_for(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        need = self._kernel.prefill_workspace_floats(meta, kv_cache.shape[-2], kv_cache.shape[-1])
        if self._prefill_workspace.numel() < need:
            self._prefill_workspace = torch.empty(need)
        return self._prefill_workspace


class FlashAttentionBackend:
    """flash-attn's varlen kernel reading the paged cache through the block table (CUDA only).

    Upstream flash-attn pages only blocks of a multiple of 256 tokens; a cache with smaller
    blocks, or in another dtype than the model's, goes through the torch backend instead.
    """

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func

        self._attn = flash_attn_varlen_func
        self._fallback = TorchAttentionBackend()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.block_size % 256 or kv_cache.dtype != q.dtype:
            return self._fallback.forward(q, k, v, kv_cache, meta, scale)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return self._attn(
            q,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=meta.seq_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            # A query sees itself and the window - 1 keys before it.
            window_size=(-1, -1) if meta.window is None else (meta.window - 1, 0),
            block_table=meta.block_table,
        )


@dataclass
class StepAttention:
    """What the attention of every layer reads during one forward: the step's metadata, the
    stage's KV caches (one per layer) and the backend. The model's layers name only their
    layer index, so a compiled step's graph holds neither the caches nor the metadata (which
    changes every step) and needs no recompile for them."""

    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend


# Per thread: engines in threads of one process (tests, EngineThread) step independently.
_CURRENT = threading.local()


@contextmanager
def attention_step(meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                   backend: AttentionBackend) -> Iterator[None]:
    """Makes (meta, kv_caches, backend) what `attend` uses, in this thread, for the forward
    inside."""
    outer = getattr(_CURRENT, "step", None)
    _CURRENT.step = StepAttention(meta, kv_caches, backend)
    try:
        yield
    finally:
        _CURRENT.step = outer


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, window: int,
           scale: float) -> torch.Tensor:
    """Layer `layer`'s attention in the current step (`attention_step`): write its new K/V,
    attend. `window` 0: none. q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
    step: StepAttention | None = getattr(_CURRENT, "step", None)
    if step is None:
        raise RuntimeError("attend() runs inside attention_step(...): the model's forward")
    meta = step.meta.for_window(window or None)
    return step.backend.forward(q, k, v, step.kv_caches[layer], meta, scale)


# `attend` as one opaque op for `torch.compile`: the graph around it is fused, the paged
# attention runs as it does eagerly. (The KV cache it writes is not a graph input, so it
# mutates none of them.) Defined through `torch.library.Library` rather than `custom_op`,
# whose Python dispatch cost ~6 us more a call (30 calls a step).
_LIBRARY = torch.library.Library("tokenflow", "FRAGMENT")
_LIBRARY.define("attention(Tensor q, Tensor k, Tensor v, int layer, int window, float scale)"
                " -> Tensor")


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    window: int, scale: float) -> torch.Tensor:
    return attend(q, k, v, layer, window, scale).contiguous()


_LIBRARY.impl("attention", _attention_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("tokenflow::attention")
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    window: int, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape)


attention_op = torch.ops.tokenflow.attention.default


def select_backend(device: torch.device | str, batch_invariant: bool = False
                   ) -> AttentionBackend:
    """flash-attn on CUDA when it is installed; on the CPU, the C kernels where they build
    (`batch_invariant`: the whole step through the invariant kernel, `CpuAttentionBackend`);
    the torch backend otherwise, or wherever `TOKENFLOW_ATTENTION_BACKEND=torch` asks for it
    (the benchmarks' comparison)."""
    if os.environ.get("TOKENFLOW_ATTENTION_BACKEND") == "torch":
        return TorchAttentionBackend()
    if torch.device(device).type == "cuda":
        try:
            return FlashAttentionBackend()
        except ImportError:
            return TorchAttentionBackend()
    kernel = cpu_kernel.load()
    return (TorchAttentionBackend() if kernel is None
            else CpuAttentionBackend(kernel, batch_invariant))
