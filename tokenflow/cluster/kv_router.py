"""KV-aware routing: send a request where its prompt's prefix is cached, as the replicas
themselves report it through their KV-cache events, weighed against their load.

Where `prefix_aware` guesses (it remembers what it sent where), this router knows: every
replica publishes what its prefix cache stores, evicts and clears (`engine.kv_events`, vLLM's
wire format), and a `KVEventFeed` in the router subscribes to each replica it may route to and
keeps a `KVBlockIndex` of block hash -> replicas (and tiers) up to date. A new router, or one
that restarted, asks each replica's replay socket for everything from sequence number 0 (up to
the replica's `buffer_steps` batches), so it starts with what the replicas hold, not empty; a
gap in a live sequence is filled the same way. A replica that clears its cache
(`AllBlocksCleared`), restarts its engine (new endpoints) or goes away drops out of the index.

The choice, per candidate replica r, for a prompt of B full blocks (`KVRouting.choose`):

    cost(r) = overlap_weight * (B - cached_prefix_blocks(r)) + B * ongoing_requests(r)

the blocks r would have to prefill plus an estimate of the blocks its requests hold (each
about as large as this one) -- the two terms of Dynamo's KV router cost (prefill work, decode
load), written for this codebase. With the default weight 8 a prompt cached whole is worth
eight requests of imbalance. The load is a count of requests, not KV usage (a replica's
blocks held swing by a whole prompt within a step): Serve's count of ongoing requests where
requests go through Serve's router, else (HAProxy sends them) the replica's last report,
once a second, plus what this router sent it since. The cached prefix is the index's, extended by
what this router itself sent the replica in the last seconds and no event has confirmed yet.
A prefix cached nowhere (its replica evicted it, and no other holds it) counts as cached
whole on the replica this router last sent it to: it goes back there while the load allows,
instead of to whichever replica looks idlest, where it would push out that replica's own
prefixes (which would then move in turn). The cheapest replica is tried first (on a tie, the
one with the longer cached prefix), the rest follow by cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from ray.serve.request_router import (
    FIFOMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from tokenflow.cluster.adapter_routing import adapter_candidates
from tokenflow.cluster.prefix_router import PromptBlocks
from tokenflow.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decoder

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_REPLAY_TIMEOUT_MS = 5000
_POLL_MS = 100
_CATCH_UP_POLLS, _CATCH_UP_POLL_S = 40, 0.025  # at most 1 s
_MAX_HOMES = 65536  # prompts' first blocks whose last replica a router remembers


class KVBlockIndex:
    """Owns where each cached block is: block hash -> {replica: tiers}, and each replica's
    hashes (so a replica drops out at once). Not thread-safe: `KVEventFeed` guards it."""

    def __init__(self) -> None:
        self._where: dict[int, dict[Hashable, set[str]]] = {}
        self._held: dict[Hashable, set[int]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def apply(self, replica: Hashable, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                held = self._held.setdefault(replica, set())
                medium = event.medium or ""
                for h in event.block_hashes:
                    self._where.setdefault(h, {}).setdefault(replica, set()).add(medium)
                    held.add(h)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._remove(replica, h, event.medium or "")
            elif isinstance(event, AllBlocksCleared):
                self.drop(replica)

    def _remove(self, replica: Hashable, block_hash: int, medium: str) -> None:
        owners = self._where.get(block_hash)
        tiers = owners.get(replica) if owners else None
        if tiers is None:
            return
        tiers.discard(medium)
        if not tiers:
            del owners[replica]  # type: ignore[union-attr]
            self._held[replica].discard(block_hash)
            if not owners:
                del self._where[block_hash]

    def drop(self, replica: Hashable) -> None:
        """Forget everything `replica` held."""
        for h in self._held.pop(replica, ()):
            owners = self._where.get(h)
            if owners is not None:
                owners.pop(replica, None)
                if not owners:
                    del self._where[h]

    def cached_prefix(self, hashes: Sequence[int], candidates: Sequence[Hashable]
                      ) -> dict[Hashable, int]:
        """How many leading blocks of `hashes` each candidate holds (in any tier). A hash
        chains its whole prefix, so the first block a replica lacks ends its match."""
        matched = dict.fromkeys(candidates, 0)
        alive = set(candidates)
        for i, h in enumerate(hashes):
            owners = self._where.get(h)
            still = alive & owners.keys() if owners else set()
            for replica in still:
                matched[replica] = i + 1
            alive = still
            if not alive:
                break
        return matched

    def hashes(self, replica: Hashable) -> set[int]:
        """The block hashes `replica` holds, in any tier."""
        return set(self._held.get(replica, ()))


@dataclass
class _Subscription:
    """One replica's event stream: its sockets and the last sequence number applied."""

    endpoint: str
    replay_endpoint: str | None
    sub: zmq.Socket
    last_seq: int = -1
    pending: list[tuple[int, bytes]] = field(default_factory=list)


class KVEventFeed:
    """Owns the subscriptions to the replicas' KV-cache events and the `KVBlockIndex` they
    feed, and the thread that reads them (ZeroMQ sockets stay on that thread; `watch` and
    `unwatch` only queue commands)."""

    def __init__(self) -> None:
        self.index = KVBlockIndex()
        self.lock = threading.Lock()  # guards `index`
        self._commands: queue.SimpleQueue[tuple[Hashable, str | None, str | None]] = (
            queue.SimpleQueue())
        self._subs: dict[Hashable, _Subscription] = {}
        self._watching: dict[Hashable, tuple[str | None, str | None]] = {}
        # Set once a watched replica's replay has been applied (its past is in the index).
        self._caught_up: dict[Hashable, threading.Event] = {}
        self._context = zmq.Context.instance()
        self._decoder = decoder()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tokenflow-kv-feed", daemon=True)
        self._thread.start()

    def watch(self, replica: Hashable, endpoint: str | None, replay: str | None) -> None:
        """Follow `replica`'s events at `endpoint` (None: it publishes none). A new endpoint
        for a known replica (its engine restarted) starts it over from an empty cache."""
        if self._watching.get(replica) != (endpoint, replay):
            self._watching[replica] = (endpoint, replay)
            self._caught_up[replica] = threading.Event()
            self._commands.put((replica, endpoint, replay))

    def caught_up(self, replica: Hashable) -> bool:
        """Whether `replica`'s replayed past is in the index (True if not watched)."""
        event = self._caught_up.get(replica)
        return event is None or event.is_set()

    def unwatch(self, replica: Hashable) -> None:
        self._caught_up.pop(replica, None)
        if self._watching.pop(replica, None) is not None:
            self._commands.put((replica, None, None))

    def watched(self) -> set[Hashable]:
        return set(self._watching)

    def shutdown(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)

    # --------------------------------------------------------------- the feed's thread
    def _run(self) -> None:
        poller = zmq.Poller()
        while not self._stop:
            while not self._commands.empty():
                self._apply_command(poller, *self._commands.get())
            if not self._subs:
                # pyzmq returns at once from a poll of no sockets: wait on the commands
                # instead (a feed that follows nobody, as Serve's proxy's router, spun a core).
                with contextlib.suppress(queue.Empty):
                    self._apply_command(poller, *self._commands.get(timeout=_POLL_MS / 1000))
                continue
            try:
                ready = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError:  # a socket closed under the poll
                time.sleep(_POLL_MS / 1000)
                continue
            for replica, subscription in list(self._subs.items()):
                if subscription.sub in ready:
                    self._read(replica, subscription)
        for subscription in self._subs.values():
            subscription.sub.close(linger=0)

    def _apply_command(self, poller: zmq.Poller, replica: Hashable, endpoint: str | None,
                       replay: str | None) -> None:
        old = self._subs.pop(replica, None)
        if old is not None:
            poller.unregister(old.sub)
            old.sub.close(linger=0)
        with self.lock:
            self.index.drop(replica)
        if endpoint is None:
            return
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        subscription = _Subscription(endpoint, replay, sub)
        self._subs[replica] = subscription
        poller.register(sub, zmq.POLLIN)
        # What it held before this router listened: everything its replay buffer still has.
        self._replay(replica, subscription, 0)
        caught_up = self._caught_up.get(replica)
        if caught_up is not None:
            caught_up.set()

    def _read(self, replica: Hashable, subscription: _Subscription) -> None:
        while True:
            try:
                _, seq_bytes, payload = subscription.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= subscription.last_seq:
                continue  # replayed already
            if seq > subscription.last_seq + 1 and subscription.last_seq >= 0:
                self._replay(replica, subscription, subscription.last_seq + 1)  # a gap
                if seq <= subscription.last_seq:
                    continue
            self._apply(replica, subscription, seq, payload)

    def _replay(self, replica: Hashable, subscription: _Subscription, start: int) -> None:
        if subscription.replay_endpoint is None:
            return
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.connect(subscription.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(_REPLAY_TIMEOUT_MS):
                _, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_OF_REPLAY:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq > subscription.last_seq:
                    self._apply(replica, subscription, seq, payload)
            logger.warning("no end of replay from %s; going on with live events",
                           subscription.replay_endpoint)
        finally:
            dealer.close(linger=0)

    def _apply(self, replica: Hashable, subscription: _Subscription, seq: int,
               payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except Exception:  # noqa: BLE001 - one bad batch must not stop the feed
            logger.warning("undecodable KV event batch %d from %s", seq, subscription.endpoint)
            return
        with self.lock:
            self.index.apply(replica, batch)
        subscription.last_seq = seq


class KVRouting:
    """Owns the routing decision (the module docstring's cost) and the prefixes this router
    sent each replica that its events have not confirmed yet."""

    def __init__(self, overlap_weight: float = 8.0, prediction_ttl_s: float = 10.0,
                 seed: int | None = None) -> None:
        self.overlap_weight = overlap_weight
        self.prediction_ttl_s = prediction_ttl_s
        self._sent: dict[Hashable, dict[int, float]] = {}  # replica -> {hash: expiry}
        # replica -> (the report it was counted from, requests routed there since)
        self._routed: dict[Hashable, tuple[Any, int]] = {}
        self._next_prune = 0.0
        self._rng = random.Random(seed)
        # A prompt's first block hash -> the replica this router last sent it to (bounded).
        self._homes: OrderedDict[int, Hashable] = OrderedDict()

    def cached_prefix(self, hashes: Sequence[int], indexed: dict[Hashable, int],
                      now: float) -> dict[Hashable, int]:
        """Each candidate's cached prefix: what the index says (`indexed`), extended by the
        blocks this router sent it within `prediction_ttl_s` that no event confirmed yet (a
        replica publishes once a step, so the next request of the same prefix, routed a moment
        later, would otherwise find it cached nowhere). A confirmed prediction is dropped: from
        then on the index alone answers, evictions included."""
        hits = {}
        for replica, hit in indexed.items():
            sent = self._sent.get(replica)
            if sent:
                for h in hashes[:hit]:
                    sent.pop(h, None)
                while hit < len(hashes) and sent.get(hashes[hit], 0.0) > now:
                    hit += 1
            hits[replica] = hit
        return hits

    def reported_load(self, replica: Hashable, stats: dict[str, Any]) -> int:
        """The requests a replica held at its last load report, plus those this router sent it
        since: where requests do not go through Serve's own router (HAProxy sends them), Serve
        counts none of them, and a report is up to a second old -- every request routed in
        that second would otherwise go to the same replica, the one that looked idle."""
        report_id, routed = self._routed.get(replica, (None, 0))
        if report_id != stats.get("report"):
            routed = 0
        return int(stats.get("requests", 0)) + routed

    def costs(self, num_blocks: int, cached: dict[Hashable, int],
              loads: dict[Hashable, int]) -> dict[Hashable, float]:
        return {replica: self.overlap_weight * (num_blocks - hit)
                + max(num_blocks, 1) * loads.get(replica, 0)
                for replica, hit in cached.items()}

    def choose(self, hashes: Sequence[int], indexed: dict[Hashable, int],
               loads: dict[Hashable, int], now: float,
               reports: dict[Hashable, Any] | None = None) -> list[Hashable]:
        """The candidates (the keys of `indexed`), cheapest first (ties: the longer cached
        prefix, then at random). The chosen one is predicted to hold the prompt's blocks past
        what its index already shows, and counted as routed one more request since its last
        report (`reports`: each candidate's report id)."""
        cached = self.cached_prefix(hashes, indexed, now)
        home = self._homes.get(hashes[0]) if hashes else None
        if home in cached and not any(cached.values()):
            # Cached nowhere (evicted everywhere, or its prediction expired): the prefix goes
            # back where it went last, as if cached there, while the load allows. It is that
            # replica's share of the prefixes; sent to another it would push out that one's
            # own, which then move in turn.
            cached[home] = len(hashes)
        costs = self.costs(len(hashes), cached, loads)
        order = sorted(costs, key=lambda r: (costs[r], -cached[r], self._rng.random()))
        chosen = order[0]
        if hashes:
            self._homes[hashes[0]] = chosen
            self._homes.move_to_end(hashes[0])
            if len(self._homes) > _MAX_HOMES:
                self._homes.popitem(last=False)
        self._sent.setdefault(chosen, {}).update(
            dict.fromkeys(hashes[indexed[chosen]:], now + self.prediction_ttl_s))
        report = (reports or {}).get(chosen)
        report_id, routed = self._routed.get(chosen, (None, 0))
        self._routed[chosen] = (report, (routed if report_id == report else 0) + 1)
        if now >= self._next_prune:
            self._prune(now)
        return order

    def _prune(self, now: float) -> None:
        for sent in self._sent.values():
            for h in [h for h, expiry in sent.items() if expiry <= now]:
                del sent[h]
        self._next_prune = now + self.prediction_ttl_s

    def forget(self, replica: Hashable) -> None:
        self._sent.pop(replica, None)
        self._routed.pop(replica, None)


class KVAwareRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """A Serve request router that sends each request where its prefix is cached, by the
    replicas' own KV-cache events, weighed against their load (see the module docstring)."""

    def initialize_state(self, block_size: int = 16, tokenizer: str | None = None,
                         overlap_weight: float = 8.0, seed: int | None = None,
                         model_name: str | None = None, chat_template: str | None = None
                         ) -> None:
        self._blocks = PromptBlocks(block_size, tokenizer, model_name, chat_template)
        self._routing = KVRouting(overlap_weight, seed=seed)
        self._feed = KVEventFeed()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._follow(candidate_replicas)
        if pending_request is not None:  # every replica is ranked at once: a retry backs off
            pending_request.routing_context.should_backoff = True
        # A request for a LoRA adapter: among the replicas that hold it first.
        candidate_replicas = adapter_candidates(self, candidate_replicas, pending_request)
        # A replica just followed (this router started, or it did): wait briefly for its
        # replay, so the first requests already go where their prefixes are.
        for _ in range(_CATCH_UP_POLLS):
            if all(self._feed.caught_up(r.replica_id) for r in candidate_replicas):
                break
            await asyncio.sleep(_CATCH_UP_POLL_S)
        hashes = (self._blocks.hashes(pending_request.args, pending_request.kwargs)
                  if pending_request is not None else [])
        by_id = {r.replica_id: r for r in candidate_replicas}
        with self._feed.lock:
            indexed = self._feed.index.cached_prefix(hashes, list(by_id))
        # Serve's count where requests go through Serve's router (exact: it counts each send
        # and each end); in haproxy mode they do not, and the replicas' reports answer.
        stats = {rid: r.routing_stats or {} for rid, r in by_id.items()}
        loads = {rid: (queued if (queued := self.replica_queue_len_cache.get(rid)) is not None
                       else self._routing.reported_load(rid, stats[rid]))
                 for rid in by_id}
        order = self._routing.choose(hashes, indexed, loads, time.monotonic(),
                                     {rid: s.get("report") for rid, s in stats.items()})
        return [[by_id[order[0]]], [by_id[rid] for rid in order[1:]]] if len(order) > 1 else [
            [by_id[order[0]]]]

    def _follow(self, candidates: list[RunningReplica]) -> None:
        """Subscribe to every replica that advertises its events; drop the ones gone."""
        current = {r.replica_id: r for r in self.curr_replicas.values()}
        current.update({r.replica_id: r for r in candidates})
        for gone in self._feed.watched() - set(current):
            self._feed.unwatch(gone)
            self._routing.forget(gone)
        for replica_id, replica in current.items():
            endpoints = (replica.routing_stats or {}).get("kv_events") or {}
            if endpoints.get("endpoint"):
                self._feed.watch(replica_id, endpoints["endpoint"],
                                 endpoints.get("replay_endpoint"))

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._feed.shutdown()
