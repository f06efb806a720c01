"""Adapter-aware routing: a request for a LoRA adapter goes to a replica that holds it warm.

Built on Ray Serve's model multiplexing (current in Ray 2.60, and how Ray Serve LLM routes
LoRA requests): a replica records the adapters it has served in a `@serve.multiplexed` LRU,
which Serve pushes to its controller and from there to every request router of the
deployment; a request that carries `multiplexed_model_id` goes to a replica holding that id
while one does (and is not full), else to the replicas holding the fewest, else to any.

- `HeldAdapters` (in each `LLMServer`): the replica's side, its LRU of adapter names.
- `adapter_of(body, base_model)`: the adapter an OpenAI request body names (HAProxy's
  ingress request router sets it on its handle call); the ingress deployment of the
  `proxy_ingress` modes sets it from the request's resolved `SamplingParams.lora`.
- `adapter_candidates(router, candidates, request)`: the same preference for tokenflow's own
  request routers (`PrefixAwareRouter`, `KVAwareRouter`), before their own cost, kept
  while a holder has room (Serve's gives up on a holder at the first retry).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve._private.request_router.common import PendingRequest
    from ray.serve._private.request_router.replica_wrapper import RunningReplica
    from ray.serve.request_router import RequestRouter


class HeldAdapters:
    """Owns what this replica advertises to Serve's request routers: the names of the last
    `capacity` adapters it served (the engine keeps as many warm: its LoRA slots and the CPU
    copies behind them). The engine loads and evicts the weights itself; this only names
    them. Outside a Serve replica (a test in process) it advertises nothing."""

    def __init__(self, capacity: int) -> None:
        self._hold = None
        if capacity <= 0 or not _in_serve_replica():
            return
        from ray import serve

        async def hold(name: str) -> str:  # nothing to load here: the engine does it
            return name

        # A function of this instance, not a method: Serve keeps its LRU on the function.
        self._hold = serve.multiplexed(max_num_models_per_replica=capacity)(hold)

    async def note(self, name: str | None) -> None:
        """Record that this replica serves `name` now (the base model: nothing)."""
        if name and self._hold is not None:
            await self._hold(name)


def adapter_of(body: dict[str, Any], base_model: str) -> str | None:
    """The adapter an OpenAI request body names: its `model` when that is not the base
    model's name (vLLM's convention). Unknown names are the replica's to refuse."""
    model = body.get("model")
    return model if isinstance(model, str) and model and model != base_model else None


def adapter_candidates(router: RequestRouter, candidates: list[RunningReplica],
                       request: PendingRequest | None) -> list[RunningReplica]:
    """The candidates a request for an adapter should choose among: the replicas holding it
    that are not known to be full, else those holding the fewest adapters (not known full),
    else all; every candidate for a request that names none.

    Serve's own `apply_multiplex_routing` gives up on the holders at the first retry, and a
    retry also follows a queue-length probe that timed out (0.1 s at first: a loaded
    machine misses it), so its requests for one adapter spread over replicas that are not
    full at all. Here a holder is left only when the router's queue-length cache says it
    is full; a probe that timed out is retried on it, with Serve's growing deadline."""
    if request is None or not request.metadata.multiplexed_model_id:
        return candidates
    name = request.metadata.multiplexed_model_id
    queued = router.replica_queue_len_cache
    open_ = [r for r in candidates
             if (n := queued.get(r.replica_id)) is None or n < r.max_ongoing_requests]
    holders = [r for r in open_ if name in r.multiplexed_model_ids]
    if holders:
        return holders
    if not open_:
        return candidates
    fewest = min(len(r.multiplexed_model_ids) for r in open_)
    return [r for r in open_ if len(r.multiplexed_model_ids) == fewest]


def _in_serve_replica() -> bool:
    try:
        from ray import serve

        serve.get_replica_context()
        return True
    except Exception:  # not running in a Serve replica
        return False
