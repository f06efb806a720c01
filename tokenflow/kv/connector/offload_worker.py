"""`OffloadWorker`: the worker half of the offload tier, in every pipeline stage, over a store
of fixed slots holding this stage's layers of one block each: `MemoryTier` (a tensor in process
memory; pinned on a GPU replica) or `DiskTier` (one file per slot in a directory of its own).
`OffloadScheduler` (offload_scheduler.py) decides which slots to write and read.

A step's orders arrive in `start_load_kv`, before the forward. Stores first: the evicted
blocks are gathered out of the cache into a private copy at once (on a GPU, a copy to pinned
memory queued on the stream before the forward's kernels), since this step may write over
them; writing the copy into the store and checksumming it (CRC32 per block) happen on the I/O
thread. Loads are then queued on the same thread, so a load runs after every store queued
before it: it reads its slots, verifies each block's hash and checksum (a mismatch or a
missing file fails the load: the request recomputes, and the scheduler drops the entries) and copies them
into the blocks the request was given, which no step reads until the load is reported. One
thread in FIFO order is the whole synchronisation; the engine loop never waits on the tier.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

from tokenflow.kv.connector.base import ConnectorMeta, KVConnectorOutput, KVConnectorWorker
from tokenflow.kv.connector.offload_scheduler import OffloadMeta, TierLoad

logger = logging.getLogger(__name__)


def crc32(block: torch.Tensor) -> int:
    """CRC32 of one contiguous CPU block's bytes."""
    return zlib.crc32(block.view(torch.uint8).numpy())


class TierStore(Protocol):
    """Slots of `[layers, 2, block_size, kv_heads, head_dim]` each, and the block hash and
    CRC32 each holds; called on the I/O thread only."""

    def write(self, slots: list[int], hashes: list[int], blocks: torch.Tensor) -> None: ...

    def read(self, slots: list[int], hashes: list[int]) -> torch.Tensor:
        """`[len(slots), ...]` on the CPU; raises ValueError on a corrupt or missing block, or
        one that is not (or no longer) the block `hashes` names."""

    def close(self) -> None: ...


class MemoryTier:
    """Owns a `[num_slots, *block_shape]` tensor and a (hash, checksum) per slot."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin: bool) -> None:
        self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self.checksums: list[tuple[int, int] | None] = [None] * num_slots

    def write(self, slots: list[int], hashes: list[int], blocks: torch.Tensor) -> None:
        self.data.index_copy_(0, torch.tensor(slots), blocks)
        for i, slot in enumerate(slots):
            self.checksums[slot] = (hashes[i], crc32(blocks[i]))

    def read(self, slots: list[int], hashes: list[int]) -> torch.Tensor:
        blocks = self.data.index_select(0, torch.tensor(slots))
        for i, slot in enumerate(slots):
            if self.checksums[slot] != (hashes[i], crc32(blocks[i])):
                raise ValueError(f"offloaded block in slot {slot} is corrupt or not stored")
        return blocks

    def close(self) -> None:
        pass


class DiskTier:
    """Owns one file per slot under a fresh directory in `root` (removed by `close`), and the
    checksums of what it wrote."""

    def __init__(self, root: str, prefix: str, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        self.block_shape = block_shape
        self.dtype = dtype
        self.checksums: dict[int, tuple[int, int]] = {}  # slot -> (hash, crc32)

    def path(self, slot: int) -> Path:
        return self.dir / f"{slot}.kv"

    def write(self, slots: list[int], hashes: list[int], blocks: torch.Tensor) -> None:
        for i, slot in enumerate(slots):
            data = blocks[i].view(torch.uint8).numpy()
            self.path(slot).write_bytes(data.tobytes())
            self.checksums[slot] = (hashes[i], zlib.crc32(data))

    def read(self, slots: list[int], hashes: list[int]) -> torch.Tensor:
        out = []
        for slot, block_hash in zip(slots, hashes, strict=True):
            try:
                raw = self.path(slot).read_bytes()
            except OSError as exc:
                raise ValueError(f"offloaded block file of slot {slot} is missing") from exc
            if (block_hash, zlib.crc32(raw)) != self.checksums.get(slot):
                raise ValueError(f"offloaded block file of slot {slot} is corrupt or not "
                                 "stored")
            block = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            out.append(block.view(self.dtype).view(self.block_shape))
        return torch.stack(out)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class OffloadWorker(KVConnectorWorker):
    """Owns one stage's tier store and the I/O thread that writes and reads it."""

    stores_evicted_blocks = True

    def __init__(self, backend: str, size_bytes: int, path: str | None = None) -> None:
        self.backend = backend
        self.size_bytes = size_bytes
        self.root = path
        self.kv_caches: list[torch.Tensor] = []
        self.layer_range = (0, 0)
        self.store: TierStore | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier")
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._out = KVConnectorOutput()

    def register_kv_caches(self, kv_caches: list[Any], layer_range: tuple[int, int]) -> None:
        self.kv_caches = kv_caches
        self.layer_range = layer_range
        first = kv_caches[0]
        block_shape = (len(kv_caches), 2, *first.shape[2:])
        num_slots = self.num_slots(first, len(kv_caches))
        if self.backend == "disk":
            assert self.root is not None
            self.store = DiskTier(self.root, f"layers{layer_range[0]}-{layer_range[1]}-",
                                  block_shape, first.dtype)
        else:
            self.store = MemoryTier(num_slots, block_shape, first.dtype,
                                    pin=first.device.type == "cuda")

    def num_slots(self, cache: torch.Tensor, num_layers: int) -> int:
        """Blocks of this stage's layers that `size_bytes` holds."""
        per_block = cache[:, 0].numel() * cache.element_size() * num_layers
        return max(1, self.size_bytes // per_block)

    # --------------------------------------------------------------------------- step
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        assert isinstance(meta, OffloadMeta)
        if meta.store_slots:
            blocks, ready = self._gather(meta.store_block_ids)
            self._io.submit(self._store, meta.store_slots, meta.store_hashes, blocks, ready)
        for spec in meta.tier_loads:
            self._io.submit(self._load, spec)

    def _gather(self, block_ids: list[int]) -> tuple[torch.Tensor, Any]:
        """A private copy of `block_ids`, `[n, layers, 2, bs, kv_heads, head_dim]`, taken
        before this step's forward may overwrite them (on a GPU: an event marks when the copy
        to pinned memory is done)."""
        device = self.kv_caches[0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        per_layer = [cache.index_select(1, index) for cache in self.kv_caches]  # [2, n, ...]
        blocks = torch.stack(per_layer).permute(2, 0, 1, 3, 4, 5).contiguous()
        if device.type != "cuda":
            return blocks, None
        host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        host.copy_(blocks, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _store(self, slots: list[int], hashes: list[int], blocks: torch.Tensor,
               ready: Any) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            assert self.store is not None
            self.store.write(slots, hashes, blocks)
        except Exception:  # a lost copy is a later miss (or a failed load), never fatal
            logger.exception("storing %d blocks in the offload tier failed", len(slots))

    def _load(self, spec: TierLoad) -> None:
        try:
            assert self.store is not None
            blocks = self.store.read(spec.slots, spec.hashes)
            self._copy_in(blocks, spec.block_ids)
        except Exception as exc:  # recomputed by the request, never served
            logger.warning("offload tier load of %s failed: %s", spec.req_id, exc)
            reason = repr(exc)
            self._report(lambda out: out.failed_recving.__setitem__(spec.req_id, reason))
            return
        self._report(lambda out: out.finished_recving.add(spec.req_id))

    def _copy_in(self, blocks: torch.Tensor, block_ids: list[int]) -> None:
        device = self.kv_caches[0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        blocks = blocks.to(device)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, index, blocks[:, layer].transpose(0, 1))

    def _report(self, update: Any) -> None:
        with self._lock:
            update(self._out)
        self._event.set()

    def save_kv_layer(self, layer: int, meta: ConnectorMeta) -> None:
        pass  # stores are taken in `start_load_kv`, before the forward overwrites anything

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput:
        if wait_s > 0 and self._out.is_empty():
            self._event.wait(wait_s)
        self._event.clear()
        with self._lock:
            out, self._out = self._out, KVConnectorOutput()
        return out

    def shutdown(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)
        if self.store is not None:
            self.store.close()
