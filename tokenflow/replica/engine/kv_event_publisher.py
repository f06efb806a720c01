"""`KVEventPublisher`: an engine's KV-cache events on ZeroMQ, as vLLM publishes them.

Protocol (what vLLM's subscribers expect):
- PUB socket: one multipart message per batch, `(topic, seq, payload)`; `seq` is an 8-byte
  big-endian sequence number counting from 0, `payload` the msgpack `KVEventBatch`.
- ROUTER replay socket (optional): a DEALER/REQ client sends `(b"", start_seq)` (8 bytes,
  big-endian) and gets back every buffered batch from `start_seq` on as `(b"", seq, payload)`,
  then `(b"", -1 as 8 signed bytes, b"")` to end the replay. A subscriber that sees a gap in the
  sequence (it joined late, or its queue overflowed) asks for what it missed.

The engine hands over one batch per step (`publish`, which never blocks on the network); a
thread of the publisher owns both sockets (ZeroMQ sockets are not thread-safe), encodes,
sends, keeps the last `buffer_steps` payloads and answers replay requests.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from tokenflow.config import KVEventsConfig
from tokenflow.kv.events import KVCacheEvent, KVEventBatch
from tokenflow.net import free_port

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05
_BIND_ATTEMPTS = 8


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind `sock` to `endpoint` (port 0: a free port of ours); returns the bound address."""
    if not endpoint.startswith("tcp://") or not endpoint.endswith(":0"):
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    host = endpoint[len("tcp://"):-len(":0")]
    for attempt in range(_BIND_ATTEMPTS):
        port = free_port("0.0.0.0" if host in ("*", "0.0.0.0") else host)
        try:
            sock.bind(f"tcp://{host}:{port}")
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:  # taken between the check and the bind
            if attempt == _BIND_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def advertised(bound: str, node_ip: str) -> str:
    """A bound address as a peer on another node reaches it: the wildcard host becomes this
    node's IP."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if bound.startswith(wildcard):
            return f"tcp://{node_ip}:{bound[len(wildcard):]}"
    return bound


class KVEventPublisher:
    """Owns the PUB and replay sockets, the sequence numbers and the replay buffer of one
    engine's KV-cache events, and the thread that serves them."""

    def __init__(self, config: KVEventsConfig, node_ip: str,
                 data_parallel_rank: int = 0) -> None:
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._batches: queue.SimpleQueue[KVEventBatch | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            self.endpoint = advertised(bind(self._pub, config.endpoint), node_ip)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self.replay_endpoint = advertised(bind(self._replay, config.replay_endpoint),
                                                  node_ip)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._serve, name="tokenflow-kv-events",
                                        daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s (replay: %s)", self.endpoint,
                    self.replay_endpoint)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as a batch (returns at once)."""
        self._batches.put(KVEventBatch(time.time(), events, self._rank))

    def shutdown(self) -> None:
        """Send what is queued, then close the sockets."""
        self._batches.put(None)
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.close(linger=0)

    # ------------------------------------------------------------ the publisher's thread
    def _serve(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()
            try:
                batch = self._batches.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # a broken batch must not stop the publisher
                logger.exception("publishing KV-cache event batch %d failed", seq)
                continue
            self._buffer.append((seq, payload))
            seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV-events replay request (%d frames)",
                           len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(  # type: ignore[union-attr]
                    (client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))  # type: ignore[union-attr]
