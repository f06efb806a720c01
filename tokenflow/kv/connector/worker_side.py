"""`TransferWorker`: the worker half shared by tokenflow's connectors, over a `Transport`.

Publishing (producer): when a request's prefill completes, the worker gathers its blocks from
this stage's layers into `[num_blocks, layers, 2, block_size, kv_heads, head_dim]`, checksums
each block, and hands them to the transport, which either keeps serving them from the cache in
place (torch point-to-point) or copies them out (Ray object store). The descriptor it returns
travels to the consumer in the request's `kv_transfer_params`. A transport that hears back
from consumers reports each finished read with the layers that consumer stage keeps; the worker
reports the request finished sending once every layer it published was read, so a consumer
whose layers span several stages has all of them read before the producer frees the blocks.

Loading (consumer): in a background thread, for every producer stage whose layers overlap this
stage's, the worker fetches the blocks it lacks, verifies each block's checksum (a producer
that reused the blocks after its lease expired sends other KV: a mismatch is a failed load,
never someone else's KV served), and copies this stage's layers into its cache. The engine
loop never waits on a transfer.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from tokenflow.kv.connector.base import (
    ConnectorMeta,
    KVConnectorOutput,
    KVConnectorWorker,
    LoadSpec,
    SaveSpec,
)

logger = logging.getLogger(__name__)


def block_checksums(blocks: torch.Tensor) -> list[int]:
    """CRC32 of each block of `[num_blocks, ...]` (CPU tensors; others are copied first)."""
    data = blocks.detach().to("cpu").contiguous()
    return [zlib.crc32(data[i].view(torch.uint8).numpy()) for i in range(data.shape[0])]


class Transport(Protocol):
    """Moves published blocks from a producer's worker to a consumer's worker."""

    holds_blocks: bool  # True: it reads the producer's cache in place at fetch time

    def publish(self, req_id: str, block_ids: list[int], blocks: torch.Tensor
                ) -> dict[str, Any]: ...

    def fetch(self, descriptor: dict[str, Any], indices: list[int], timeout_s: float,
              layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Blocks `indices` of a published request, `[len(indices), layers, 2, ...]`, of which
        the caller keeps `layers` [start, end) (None: all the descriptor's)."""

    def release(self, req_id: str) -> None: ...

    def take_finished_reads(self) -> list[tuple[str, tuple[int, int]]]:
        """Reads of this worker's published blocks that consumers finished since the last
        call: (request, the layers [start, end) that consumer kept). Empty for a transport
        that never hears back (its copies live out their lease)."""

    def close(self) -> None: ...


class TransferWorker(KVConnectorWorker):
    """Owns one stage's view of the KV cache for transfers, its transport, and the loads it
    runs in the background."""

    def __init__(self, transport: Transport, load_timeout_s: float) -> None:
        self.transport = transport
        self.load_timeout_s = load_timeout_s
        self.kv_caches: list[torch.Tensor] = []
        self.layer_range = (0, 0)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-load")
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._out = KVConnectorOutput()
        self._saves: list[SaveSpec] = []
        # Published requests -> this stage's layers no consumer has read yet.
        self._unread: dict[str, set[int]] = {}

    def register_kv_caches(self, kv_caches: list[Any], layer_range: tuple[int, int]) -> None:
        self.kv_caches = kv_caches
        self.layer_range = layer_range
        if hasattr(self.transport, "register_kv_caches"):
            self.transport.register_kv_caches(kv_caches, layer_range)

    # ----------------------------------------------------------------------- publish
    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """This stage's KV of `block_ids`: `[num_blocks, layers, 2, bs, kv_heads, head_dim]`."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        per_layer = [cache.index_select(1, index) for cache in self.kv_caches]  # [2, n, ...]
        return torch.stack(per_layer).permute(2, 0, 1, 3, 4, 5).contiguous()

    def save_kv_layer(self, layer: int, meta: ConnectorMeta) -> None:
        # The whole request is published at `wait_for_save`, once every layer has run: a
        # consumer loads a request only after it was published, so nothing is gained earlier.
        if layer == self.layer_range[0]:
            self._saves = list(meta.saves)

    def wait_for_save(self) -> None:
        saves, self._saves = self._saves, []
        for spec in saves:
            blocks = self.gather(spec.block_ids)
            descriptor = self.transport.publish(spec.req_id, spec.block_ids, blocks)
            descriptor.update(layers=list(self.layer_range), num_blocks=len(spec.block_ids),
                              checksums=block_checksums(blocks),
                              block_shape=list(blocks.shape[1:]),
                              dtype=str(blocks.dtype).removeprefix("torch."))
            self._unread[spec.req_id] = set(range(*self.layer_range))
            with self._lock:
                self._out.published[spec.req_id] = descriptor

    # -------------------------------------------------------------------------- load
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for req_id in meta.releases:
            self.transport.release(req_id)
            self._unread.pop(req_id, None)
        for spec in meta.loads:
            self._pool.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        started = time.perf_counter()
        try:
            received = self._load_blocks(spec)
        except Exception as exc:  # a failed load is recomputed by the consumer, never fatal
            logger.warning("KV load of %s failed: %s", spec.req_id, exc)
            reason = repr(exc)
            self._report(lambda out: out.failed_recving.__setitem__(spec.req_id, reason))
            return
        seconds = time.perf_counter() - started

        def done(out: KVConnectorOutput) -> None:
            out.finished_recving.add(spec.req_id)
            out.bytes_received += received
            out.seconds_receiving += seconds

        self._report(done)

    def _load_blocks(self, spec: LoadSpec) -> int:
        start, end = self.layer_range
        indices = list(range(spec.first_block, spec.first_block + len(spec.block_ids)))
        received = 0
        for stage in spec.remote["stages"]:
            lo, hi = stage["layers"]
            if hi <= start or lo >= end:
                continue
            kept = (max(lo, start), min(hi, end))
            blocks = self.transport.fetch(stage, indices, self.load_timeout_s, kept)
            expected = [stage["checksums"][i] for i in indices]
            if block_checksums(blocks) != expected:
                raise ValueError("checksum mismatch: the producer's blocks changed (lease "
                                 "expired?) or the transfer corrupted them")
            received += blocks.numel() * blocks.element_size()
            self._copy_in(blocks, spec.block_ids, lo, *kept)
        return received

    def _copy_in(self, blocks: torch.Tensor, block_ids: list[int], remote_start: int,
                 first: int, last: int) -> None:
        """Write layers [first, last) of `blocks` (whose layer 0 is `remote_start`) into the
        local cache blocks `block_ids`."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        for layer in range(first, last):
            cache = self.kv_caches[layer - self.layer_range[0]]
            data = blocks[:, layer - remote_start].to(cache.device, cache.dtype)  # [n, 2, ...]
            cache.index_copy_(1, index, data.transpose(0, 1).contiguous())

    def _report(self, update: Any) -> None:
        with self._lock:
            update(self._out)
        self._event.set()

    # --------------------------------------------------------------------- reporting
    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput:
        """What ended since the last call; with `wait_s`, wait that long for something to end
        (a step with nothing else to do should not spin)."""
        if wait_s > 0 and self._out.is_empty():
            self._event.wait(wait_s)
        self._event.clear()
        sending = self._fully_read(self.transport.take_finished_reads())
        with self._lock:
            out, self._out = self._out, KVConnectorOutput()
        out.finished_sending |= sending
        return out

    def _fully_read(self, reads: list[tuple[str, tuple[int, int]]]) -> set[str]:
        """Requests whose every published layer of this stage has now been read. One consumer
        stage's done covers only its layers: the producer must not free the blocks while
        another consumer stage has yet to read its own."""
        done = set()
        for req_id, (first, last) in reads:
            unread = self._unread.get(req_id)
            if unread is None:  # released already (its lease expired), or reported
                continue
            unread.difference_update(range(first, last))
            if not unread:
                del self._unread[req_id]
                done.add(req_id)
        return done

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
