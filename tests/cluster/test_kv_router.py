"""The kv_aware router's parts, without a cluster: the index the events feed, the feed itself
on real ZeroMQ sockets (a router that starts late learns what the replicas hold through their
replay sockets, a gap is filled, a new endpoint starts over), and the cost it routes by."""

from __future__ import annotations

import time

from tokenflow.cluster.kv_router import KVBlockIndex, KVEventFeed, KVRouting
from tokenflow.config import KVEventsConfig
from tokenflow.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tokenflow.replica.engine.kv_event_publisher import KVEventPublisher


def stored(hashes: list[int], parent: int | None = None, medium: str = "CPU") -> BlockStored:
    return BlockStored(hashes, parent, [0] * (2 * len(hashes)), 2, None, medium, None)


def batch(*events) -> KVEventBatch:
    return KVEventBatch(time.time(), list(events), 0)


def test_the_index_follows_stored_removed_and_cleared() -> None:
    index = KVBlockIndex()
    index.apply("a", batch(stored([1, 2, 3])))
    index.apply("b", batch(stored([1, 2]), stored([9], medium="DISK")))
    assert index.cached_prefix([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    index.apply("a", batch(BlockRemoved([2], "CPU")))  # evicted: a's match ends at block 1
    assert index.cached_prefix([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    # A block in two tiers stays until both let it go.
    index.apply("b", batch(stored([1], medium="DISK"), BlockRemoved([1], "CPU")))
    assert index.cached_prefix([1, 2], ["b"]) == {"b": 2}
    index.apply("b", batch(AllBlocksCleared()))
    assert index.cached_prefix([1, 2], ["a", "b"]) == {"a": 1, "b": 0}
    index.drop("a")
    assert len(index) == 0


def _publisher() -> KVEventPublisher:
    config = KVEventsConfig(enabled=True, endpoint="tcp://127.0.0.1:0",
                            replay_endpoint="tcp://127.0.0.1:0")
    return KVEventPublisher(config, "127.0.0.1")


def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the feed did not catch up"
        time.sleep(0.05)


def test_a_feed_that_starts_late_learns_what_a_replica_holds_and_follows_it() -> None:
    publisher = _publisher()
    feed = KVEventFeed()
    try:
        publisher.publish([stored([1, 2])])
        publisher.publish([stored([3], parent=2)])
        time.sleep(0.3)  # published before anyone listened
        feed.watch("a", publisher.endpoint, publisher.replay_endpoint)

        def prefix() -> int:
            with feed.lock:
                return feed.index.cached_prefix([1, 2, 3, 4], ["a"])["a"]

        _until(lambda: prefix() == 3)  # from the replay
        publisher.publish([stored([4], parent=3)])
        _until(lambda: prefix() == 4)  # live
        publisher.publish([BlockRemoved([2], "CPU")])
        _until(lambda: prefix() == 1)

        # The replica's engine restarted: new endpoints, an empty cache.
        restarted = _publisher()
        try:
            feed.watch("a", restarted.endpoint, restarted.replay_endpoint)
            _until(lambda: prefix() == 0)
            restarted.publish([stored([1])])
            _until(lambda: prefix() == 1)
        finally:
            restarted.shutdown()
        feed.unwatch("a")
        _until(lambda: prefix() == 0)
    finally:
        feed.shutdown()
        publisher.shutdown()


def test_a_gap_in_the_live_sequence_is_replayed() -> None:
    publisher = _publisher()
    feed = KVEventFeed()
    try:
        feed.watch("a", publisher.endpoint, publisher.replay_endpoint)
        publisher.publish([stored([1])])

        def prefix() -> int:
            with feed.lock:
                return feed.index.cached_prefix([1, 2, 3], ["a"])["a"]

        _until(lambda: prefix() == 1)
        publisher.publish([stored([2], parent=1)])
        _until(lambda: prefix() == 2)
        # As if batch 1 had been lost on the way (a subscriber's queue overflowed): the feed
        # then sees batch 2 follow batch 0, and asks the replay socket for what is missing.
        with feed.lock:
            feed._subs["a"].last_seq = 0  # noqa: SLF001
            feed.index.apply("a", batch(BlockRemoved([2], "CPU")))
        assert prefix() == 1
        publisher.publish([stored([3], parent=2)])
        _until(lambda: prefix() == 3)
    finally:
        feed.shutdown()
        publisher.shutdown()


def test_the_cost_weighs_prefill_saved_against_kv_load() -> None:
    routing = KVRouting(overlap_weight=1.0, seed=0)
    idle = {"num_blocks": 100, "num_free_blocks": 100, "report": 1}
    busy = {"num_blocks": 100, "num_free_blocks": 40, "report": 1}  # 60 blocks held
    # 10 of 12 blocks cached on a: a is cheaper (2 to prefill) while both are idle...
    assert routing.choose(12, {"a": 10, "b": 0}, {"a": idle, "b": idle})[0] == "a"
    # ...but not when its running requests hold 60 blocks more than b's (2 + 60 > 12).
    assert routing.choose(12, {"a": 10, "b": 0}, {"a": busy, "b": dict(idle, report=2)})[0] == "b"
    # A tie goes to the longer cached prefix.
    assert KVRouting(1.0).choose(4, {"a": 2, "b": 1}, {"a": dict(idle, num_free_blocks=99),
                                                    "b": idle})[0] == "a"
    # A request's blocks count as its replica's load, until its next report (which counts
    # them itself)...
    fresh = KVRouting(1.0, seed=0)
    reports = {"a": dict(idle), "b": dict(idle)}
    first = fresh.choose(8, {"a": 0, "b": 0}, reports)[0]
    assert fresh.costs(8, {"a": 0, "b": 0}, reports)[first] == 16
    assert fresh.choose(8, {"a": 0, "b": 0}, reports)[0] != first
    reports[first] = dict(idle, report=2)
    assert fresh.costs(8, {"a": 0, "b": 0}, reports)[first] == 8
    # ...also for a request whose prompt is cached whole (it decodes there all the same):
    # with weight 1, a cached 8-block prompt goes to its replica until that one has been sent
    # 8 blocks more than the other.
    warm = KVRouting(1.0, seed=0)
    assert [warm.choose(8, {"a": 8, "b": 0}, {"a": idle, "b": idle})[0]
            for _ in range(3)] == ["a", "a", "b"]
