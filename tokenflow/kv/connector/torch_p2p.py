"""The torch.distributed point-to-point transport: the consumer pulls blocks from the producer's
cache in place, over a pairwise process group (gloo on CPU, nccl on GPU).

The producer's worker runs a small control server (a TCP socket, one thread per consumer) and a
`TCPStore`. A consumer worker's first pull from a producer opens a connection, says hello, and
both sides build a two-rank process group through that store (the rendezvous); the group is
reused for every later pull between the pair. A pull names the request and its block indices;
the producer gathers those blocks from its cache at that moment and sends them; the consumer
then says done, naming the layers it keeps (a consumer stage keeps only its own), which lets
the producer free the blocks, once every layer it published was read, before their lease runs
out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenflow.net import interface_of, node_ip

logger = logging.getLogger(__name__)
_HEADER = 8  # bytes of the length prefix of a control message


def _send_msg(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(len(data).to_bytes(_HEADER, "little") + data)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the peer closed the control connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_msg(sock: socket.socket) -> dict[str, Any]:
    size = int.from_bytes(_recv_exact(sock, _HEADER), "little")
    return json.loads(_recv_exact(sock, size))


def _new_pair_group(store: dist.Store, key: str, rank: int, backend: str,
                    timeout: timedelta) -> Any:
    prefixed = dist.PrefixStore(key, store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, 2)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


class TorchP2PTransport:
    """Owns a producer's control server and store, the pair groups to every peer, and (as a
    consumer) its connections to producers."""

    holds_blocks = True

    def __init__(self, backend: str = "gloo", timeout_s: float = 30.0) -> None:
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self.ip = node_ip()
        if backend == "gloo":  # gloo binds to this interface, not to what the hostname says
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(self.ip))
        self.store = dist.TCPStore(self.ip, 0, is_master=True, wait_for_workers=False,
                                   timeout=self.timeout)
        self.kv_caches: list[torch.Tensor] = []
        self.layer_range = (0, 0)
        self._published: dict[str, list[int]] = {}  # req_id -> its block ids, served in place
        self._lock = threading.Lock()
        self._finished_reads: list[tuple[str, tuple[int, int]]] = []
        self._server = socket.create_server((self.ip, 0))
        self._closed = False
        self._peers: dict[tuple[str, int], tuple[socket.socket, Any, threading.Lock]] = {}
        self._peers_lock = threading.Lock()
        self._tag = 0
        threading.Thread(target=self._serve, name="kv-p2p-server", daemon=True).start()

    def register_kv_caches(self, kv_caches: list[torch.Tensor],
                           layer_range: tuple[int, int]) -> None:
        self.kv_caches = kv_caches
        self.layer_range = layer_range

    # ---------------------------------------------------------------------- producer
    def publish(self, req_id: str, block_ids: list[int], blocks: torch.Tensor
                ) -> dict[str, Any]:
        with self._lock:
            self._published[req_id] = list(block_ids)
        return {"transport": "torch_p2p", "host": self.ip,
                "control_port": self._server.getsockname()[1], "store_port": self.store.port,
                "req_id": req_id}

    def release(self, req_id: str) -> None:
        with self._lock:
            self._published.pop(req_id, None)

    def take_finished_reads(self) -> list[tuple[str, tuple[int, int]]]:
        with self._lock:
            reads, self._finished_reads = self._finished_reads, []
        return reads

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_peer, args=(conn,), name="kv-p2p-peer",
                             daemon=True).start()

    def _serve_peer(self, conn: socket.socket) -> None:
        """One consumer: a hello builds the pair group; then pulls and dones, in order."""
        group = None
        with conn:
            try:
                while True:
                    message = _recv_msg(conn)
                    if message["op"] == "hello":
                        group = _new_pair_group(self.store, message["pair"], 0, self.backend,
                                                self.timeout)
                    elif message["op"] == "pull":
                        self._send_blocks(group, message)
                    elif message["op"] == "done":
                        self._record_read(message)
            except (ConnectionError, OSError, RuntimeError) as exc:
                logger.debug("KV peer connection ended: %r", exc)

    def _record_read(self, message: dict[str, Any]) -> None:
        # A done without layers (a peer that does not name them) read everything published.
        first, last = message.get("layers") or self.layer_range
        with self._lock:
            self._finished_reads.append((message["req_id"], (int(first), int(last))))

    def _send_blocks(self, group: Any, message: dict[str, Any]) -> None:
        with self._lock:
            block_ids = self._published.get(message["req_id"])
        if block_ids is None:  # released (or never published): send zeros, checksums fail
            block_ids = [0] * len(message["indices"])
        blocks = self._gather([block_ids[i] for i in message["indices"]])
        group.send([blocks], 1, message["tag"]).wait()

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        per_layer = [cache.index_select(1, index) for cache in self.kv_caches]
        return torch.stack(per_layer).permute(2, 0, 1, 3, 4, 5).contiguous()

    # ---------------------------------------------------------------------- consumer
    def fetch(self, descriptor: dict[str, Any], indices: list[int], timeout_s: float,
              layers: tuple[int, int] | None = None) -> torch.Tensor:
        key = (descriptor["host"], descriptor["control_port"])
        kept = list(layers or descriptor["layers"])
        sock, group, lock = self._peer(key, descriptor["store_port"], timeout_s)
        shape = (len(indices), *descriptor["block_shape"])
        device = self.kv_caches[0].device if self.kv_caches else torch.device("cpu")
        buffer = torch.empty(shape, dtype=getattr(torch, descriptor["dtype"]), device=device)
        try:
            with lock:  # one pull at a time per pair: messages and tags stay in step
                self._tag += 1
                tag = self._tag
                _send_msg(sock, {"op": "pull", "req_id": descriptor["req_id"],
                                 "indices": indices, "tag": tag})
                group.recv([buffer], 0, tag).wait()
                _send_msg(sock, {"op": "done", "req_id": descriptor["req_id"], "layers": kept})
        except Exception:
            self._forget_peer(key)  # the producer died or the link broke: start over next time
            raise
        return buffer

    def _forget_peer(self, key: tuple[str, int]) -> None:
        with self._peers_lock:
            peer = self._peers.pop(key, None)
        if peer is not None:
            peer[0].close()

    def _peer(self, key: tuple[str, int], store_port: int,
              timeout_s: float) -> tuple[socket.socket, Any, threading.Lock]:
        with self._peers_lock:
            if key not in self._peers:
                sock = socket.create_connection(key, timeout=timeout_s)
                pair = f"pair/{self.ip}:{self._server.getsockname()[1]}/{id(sock)}"
                _send_msg(sock, {"op": "hello", "pair": pair})
                store = dist.TCPStore(key[0], store_port, is_master=False, timeout=self.timeout)
                group = _new_pair_group(store, pair, 1, self.backend, self.timeout)
                self._peers[key] = (sock, group, threading.Lock())
            return self._peers[key]

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the thread in accept(); close() would not
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        with self._peers_lock:
            for sock, _, _ in self._peers.values():
                sock.close()
            self._peers.clear()
