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


def test_the_cost_weighs_prefill_saved_against_load() -> None:
    def first(weight: float, cached: dict[str, int], loads: dict[str, int]) -> str:
        return KVRouting(weight, seed=0).choose(hashes, cached, loads, now=0.0)[0]

    hashes = list(range(12))
    # 10 of 12 blocks cached on a: a is cheaper (2 blocks to prefill) while both are idle...
    assert first(1.0, {"a": 10, "b": 0}, {"a": 0, "b": 0}) == "a"
    # ...but not with one request more than b (2 + 12 > 12 + 0).
    assert first(1.0, {"a": 10, "b": 0}, {"a": 1, "b": 0}) == "b"
    # With weight 4 a whole cached prompt is worth four requests of imbalance.
    assert first(4.0, {"a": 12, "b": 0}, {"a": 3, "b": 0}) == "a"
    assert first(4.0, {"a": 12, "b": 0}, {"a": 5, "b": 0}) == "b"
    # A tie goes to the longer cached prefix.
    assert KVRouting(1.0).choose(hashes[:4], {"a": 3, "b": 2}, {"a": 0, "b": 1},
                                 now=0.0)[0] == "a"


def test_what_the_router_sent_counts_as_cached_until_its_events_answer() -> None:
    routing = KVRouting(overlap_weight=4.0, prediction_ttl_s=10.0, seed=0)
    prompt, other = [1, 2, 3, 4], [9, 8, 7, 6]
    first = routing.choose(prompt, {"a": 0, "b": 0}, {"a": 0, "b": 0}, now=0.0)[0]
    second = "b" if first == "a" else "a"
    # No event yet: the next request of that prefix still follows the first...
    assert routing.choose(prompt, {"a": 0, "b": 0}, {"a": 0, "b": 0}, now=1.0)[0] == first
    # ...an unrelated one goes where the load is lower, and builds its own prediction.
    assert routing.choose(other, {"a": 0, "b": 0}, {first: 1, second: 0},
                          now=1.0)[0] == second
    # Unconfirmed past the TTL, a prediction no longer counts.
    assert routing.cached_prefix(prompt, {"a": 0, "b": 0}, now=20.0) == {"a": 0, "b": 0}
    # Once the index has the blocks, it alone answers: a later eviction (the index
    # shrinks) is believed at once.
    held = routing.choose(prompt, {first: 4, second: 0}, {"a": 0, "b": 0}, now=31.0)[0]
    assert held == first
    assert routing.cached_prefix(prompt, {first: 1, second: 0}, now=32.0)[first] == 1


def test_a_replicas_load_is_its_last_report_plus_what_was_routed_there_since() -> None:
    routing = KVRouting(overlap_weight=4.0, seed=0)
    report = {"requests": 2, "report": 7}
    assert routing.reported_load("a", report) == 2
    # Three requests routed to a before its next report: each counts at once (a wave of
    # requests within one report's second must not all go to the replica that looked idle).
    for _ in range(3):
        routing.choose([1, 2], {"a": 0, "b": 0}, {"a": 0, "b": 9}, now=0.0, reports={"a": 7})
    assert routing.reported_load("a", report) == 5
    # The next report counts them itself.
    assert routing.reported_load("a", {"requests": 4, "report": 8}) == 4


def test_a_prefix_cached_nowhere_goes_back_where_it_went_while_the_load_allows() -> None:
    routing = KVRouting(overlap_weight=4.0, prediction_ttl_s=1.0, seed=0)
    prompt = [5, 6, 7, 8]
    home = routing.choose(prompt, {"a": 0, "b": 0}, {"a": 0, "b": 1}, now=0.0)[0]
    assert home == "a"  # the idler one, the first time
    # Long after (the prediction expired), evicted everywhere: back to a, though b is idler...
    assert routing.choose(prompt, {"a": 0, "b": 0}, {"a": 3, "b": 0}, now=10.0)[0] == "a"
    # ...but not past the weight's worth of imbalance, and then b becomes its home.
    assert routing.choose(prompt, {"a": 0, "b": 0}, {"a": 5, "b": 0}, now=20.0)[0] == "b"
    assert routing.choose(prompt, {"a": 0, "b": 0}, {"a": 1, "b": 2}, now=30.0)[0] == "b"
    # Cached somewhere, the index decides, not the memory.
    assert routing.choose(prompt, {"a": 4, "b": 0}, {"a": 1, "b": 1}, now=40.0)[0] == "a"


def test_a_feed_that_follows_nobody_waits_instead_of_spinning() -> None:
    """Serve's proxy has a router of its own that follows no replica: its feed's thread must
    sleep (it once spun a core: pyzmq returns at once from a poll of no sockets)."""
    import psutil

    feed = KVEventFeed()
    try:
        me = psutil.Process()
        before = sum(me.cpu_times()[:2])
        time.sleep(1.0)
        assert sum(me.cpu_times()[:2]) - before < 0.3  # a spinning thread takes ~1 s of it
    finally:
        feed.shutdown()
