"""Adapter-aware routing (`cluster.adapter_routing`): what names an adapter in a request body,
and tokenflow's request routers preferring the replicas that hold a request's adapter (Ray
Serve's multiplexing state, as the replicas report it), over their own prefix/KV cost. The
whole path, replicas and HAProxy included: tests/cluster/test_serving_modes.py
(`test_default_mode_with_two_replicas`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from tokenflow.cluster.adapter_routing import HeldAdapters, adapter_of
from tokenflow.cluster.kv_router import KVAwareRouter
from tokenflow.cluster.prefix_router import PrefixAwareRouter

DEPLOYMENT = DeploymentID(name="LLMServer", app_name="tokenflow")


def test_the_adapter_a_body_names_is_any_model_but_the_base() -> None:
    assert adapter_of({"model": "support-bot", "prompt": "hi"}, "base") == "support-bot"
    assert adapter_of({"model": "base", "prompt": "hi"}, "base") is None
    assert adapter_of({"prompt": "hi"}, "base") is None
    assert adapter_of({"model": 7}, "base") is None


def test_outside_a_serve_replica_nothing_is_advertised() -> None:
    held = HeldAdapters(capacity=2)
    asyncio.run(held.note("support-bot"))  # a no-op, no error
    assert held._hold is None


@dataclass
class _Replica:
    """What a Serve request router reads of a running replica."""
    replica_id: ReplicaID
    multiplexed_model_ids: set[str] = field(default_factory=set)
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 64
    node_id: str = "node"
    availability_zone: str | None = None


def _request(body: dict[str, Any], adapter: str = "") -> PendingRequest:
    metadata = RequestMetadata(request_id="r", internal_request_id="r",
                               multiplexed_model_id=adapter)
    return PendingRequest(args=[body], kwargs={}, metadata=metadata)


@pytest.mark.parametrize("router_class", [PrefixAwareRouter, KVAwareRouter])
def test_a_request_for_an_adapter_goes_to_the_replica_that_holds_it(router_class) -> None:
    async def scenario() -> None:
        router = router_class(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(block_size=4, seed=0)
        plain, holder = (_Replica(ReplicaID(f"r{i}", DEPLOYMENT)) for i in range(2))
        holder.multiplexed_model_ids = {"support-bot"}
        replicas = [plain, holder]
        router.update_replicas(replicas)
        prompt = list(range(40))
        # Several requests for the adapter go to its replica, though the load (the replicas'
        # reports) would send them to the other.
        holder.routing_stats = {"requests": 6}
        for _ in range(4):
            ranks = await router.choose_replicas(
                replicas, _request({"model": "support-bot", "prompt": prompt}, "support-bot"))
            assert ranks[0] == [holder]
        # The base model's requests (no adapter) are balanced as before: the idle one.
        ranks = await router.choose_replicas(replicas, _request({"model": "base",
                                                                 "prompt": prompt}))
        assert ranks[0] == [plain]
        # An adapter no replica holds: Serve's fallback, the replicas holding the fewest.
        ranks = await router.choose_replicas(
            replicas, _request({"model": "other", "prompt": prompt}, "other"))
        assert ranks[0] == [plain]

    asyncio.run(scenario())


@pytest.mark.parametrize("router_class", [PrefixAwareRouter, KVAwareRouter])
def test_a_retried_request_stays_with_the_holder_until_it_is_full(router_class) -> None:
    """Serve calls `choose_replicas` again for the same request when no replica it ranked
    answered its queue-length probe in time (0.1 s at first, a loaded machine misses it):
    the request still goes to the adapter's replica, and leaves it only once the replica is
    known to be full (then to the replicas holding the fewest, as Serve's fallback)."""
    async def scenario() -> None:
        router = router_class(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(block_size=4, seed=0)
        plain, holder, busy = (_Replica(ReplicaID(f"r{i}", DEPLOYMENT)) for i in range(3))
        holder.multiplexed_model_ids = {"support-bot", "other"}
        busy.multiplexed_model_ids = {"third"}
        replicas = [plain, holder, busy]
        router.update_replicas(replicas)
        request = _request({"model": "support-bot", "prompt": list(range(40))}, "support-bot")
        for _ in range(3):  # the first try and two retries
            ranks = await router.choose_replicas(replicas, request)
            assert ranks[0] == [holder]
            assert request.routing_context.should_backoff
        router.replica_queue_len_cache.update(holder.replica_id, holder.max_ongoing_requests)
        ranks = await router.choose_replicas(replicas, request)
        assert [r for rank in ranks for r in rank] == [plain]  # fewer adapters than busy
        # Every replica known full: any of them (Serve then probes and backs off).
        for replica in replicas:
            router.replica_queue_len_cache.update(replica.replica_id,
                                                  replica.max_ongoing_requests)
        ranks = await router.choose_replicas(replicas, request)
        assert {r.replica_id for rank in ranks for r in rank} == {r.replica_id
                                                                 for r in replicas}

    asyncio.run(scenario())
