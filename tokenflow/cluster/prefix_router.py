"""Prefix-aware routing: send a request to the LLMServer replica most likely to hold its
prompt's prefix in its KV cache, unless that would pile load onto one replica.

`PrefixAwareRouter` is a Serve `RequestRouter` (`deployment.request_router: prefix_aware` in the app
config). It sees each request's routing arguments: the token ids, when the request comes
through the OpenAIIngress deployment (which tokenized it); the OpenAI request body, in the
`haproxy` mode (whose ingress request router forwards it; the router then renders and tokenizes
it with the model's tokenizer, as the replica will). From the token ids it computes the
prompt's chained block hashes (`kv.hashing`, the same in every process as in the engine's
prefix cache) and looks them up in a `PrefixIndex` of which replica it sent which blocks to.

The choice, in order:
1. Load guard: when the most loaded candidate holds more than `imbalanced_threshold` requests
   beyond the least loaded one, prefix affinity is off and power of two choices decides.
2. The candidates with the longest matched prefix (at least `min_match_blocks` blocks); the
   least loaded of them.
3. No match: power of two choices (the less loaded of two random candidates).
The chosen replica is tried first; the rest follow, least loaded first, should it be full.
Load is Serve's count of a replica's ongoing requests (its queue-length probes), else the
replica's own report (`record_routing_stats`).
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from tokenflow.cluster.adapter_routing import adapter_candidates
from tokenflow.kv.hashing import extend_block_hashes

logger = logging.getLogger(__name__)


class PrefixIndex:
    """Owns which replicas were sent which prompt blocks: chained block hash -> replica ids,
    the least recently used hashes dropped beyond `capacity` (the replicas' caches evict too,
    so old entries are guesses at best)."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[int, set[Hashable]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def match(self, hashes: Sequence[int], candidates: set[Hashable]
              ) -> tuple[int, set[Hashable]]:
        """The longest prefix of `hashes` (in blocks) some candidates were sent, and those
        candidates. A hash chains its whole prefix, so a replica holding block i holds 0..i."""
        matched, owners = 0, set()
        for h in hashes:
            have = self._owners.get(h)
            common = candidates & have if have else None
            if not common:
                break
            self._owners.move_to_end(h)
            matched, owners = matched + 1, common
        return matched, owners

    def insert(self, hashes: Sequence[int], replica: Hashable) -> None:
        for h in hashes:
            owners = self._owners.get(h)
            if owners is None:
                self._owners[h] = {replica}
            else:
                owners.add(replica)
                self._owners.move_to_end(h)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def drop(self, replica: Hashable) -> None:
        """Forget a replica that is gone."""
        for h in [h for h, owners in self._owners.items() if replica in owners]:
            owners = self._owners[h]
            owners.discard(replica)
            if not owners:
                del self._owners[h]


class PromptBlocks:
    """Turns a request's routing arguments into its prompt's chained block hashes, keyed by
    its LoRA adapter as the engine's prefix cache keys them (so a request goes where its
    adapter's blocks are); owns the tokenizer the `haproxy` mode needs (loaded on first use).
    `model_name`: the base model's served name (a body naming it uses no adapter);
    `chat_template`: the configured one (`engine.chat_template`), to render as the ingress does."""

    def __init__(self, block_size: int, tokenizer: str | None,
                 model_name: str | None = None, chat_template: str | None = None) -> None:
        self.block_size = block_size
        self._tokenizer_path = tokenizer
        self._model_name = model_name
        self._chat_template = chat_template
        self._renderer: Any = None

    def hashes(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
        """[] when there is nothing to route on (no prompt, a batch of several prompts, or a
        body the tokenizer cannot render: the replica will say what is wrong with it)."""
        first = args[0] if args else kwargs.get("prompts")
        tokens: Sequence[int] | None = None
        adapter = None
        if isinstance(first, list) and first and isinstance(first[0], list):
            tokens = first[0]  # token ids from the OpenAIIngress; a batch routes on the first
            params = args[1] if len(args) > 1 else kwargs.get("params")
            adapter = getattr(params, "lora", None)
        elif isinstance(first, dict):
            tokens = self._tokenize(first)
            model = first.get("model")
            if isinstance(model, str) and model != self._model_name:
                adapter = model  # vLLM's convention: `model` names the adapter
        hashes: list[int] = []
        if tokens:
            extend_block_hashes(hashes, tokens, self.block_size,
                                () if adapter is None else (adapter,))
        return hashes

    def _tokenize(self, body: dict[str, Any]) -> list[int] | None:
        if self._tokenizer_path is None:
            return None
        if self._renderer is None:
            from tokenflow.cluster.prompts import PromptRenderer

            self._renderer = PromptRenderer(self._tokenizer_path, self._chat_template)
        try:
            messages = body.get("messages")
            if isinstance(messages, list):
                # Tools are part of the prompt unless tool_choice is none (tools.plan_tools).
                tools = body.get("tools") if body.get("tool_choice") != "none" else None
                return self._renderer.render_chat(
                    messages, body.get("add_generation_prompt", True),
                    body.get("chat_template_kwargs"), tools=tools)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0]
            if isinstance(prompt, str):
                return self._renderer.tokenize(prompt, None)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        except Exception:  # noqa: BLE001 - a bad body is the replica's to refuse, not ours
            logger.debug("cannot tokenize a request for routing", exc_info=True)
        return None


class PrefixAffinity:
    """Owns the routing decision on replica ids and loads (see the module docstring) and the
    `PrefixIndex` it learns from its own choices."""

    def __init__(self, imbalanced_threshold: int = 8, min_match_blocks: int = 1,
                 index_capacity: int = 1 << 18, seed: int | None = None) -> None:
        self.index = PrefixIndex(index_capacity)
        self.imbalanced_threshold = imbalanced_threshold
        self.min_match_blocks = min_match_blocks
        self._rng = random.Random(seed)

    def choose(self, loads: dict[Hashable, int], hashes: Sequence[int]) -> Hashable:
        """The replica (a key of `loads`, its load the value) for a prompt of `hashes`."""
        chosen = self._choose(loads, hashes)
        if hashes:
            self.index.insert(hashes, chosen)
        return chosen

    def forget(self, replica: Hashable) -> None:
        """A replica that is gone: nothing is sent to it for its prefixes any more."""
        self.index.drop(replica)

    def _choose(self, loads: dict[Hashable, int], hashes: Sequence[int]) -> Hashable:
        if len(loads) == 1:
            return next(iter(loads))
        balanced = max(loads.values()) - min(loads.values()) <= self.imbalanced_threshold
        if hashes and balanced:
            matched, owners = self.index.match(hashes, set(loads))
            if matched >= self.min_match_blocks:
                return min(owners, key=lambda rid: (loads[rid], str(rid)))
        a, b = self._rng.sample(sorted(loads, key=str), 2)
        return a if loads[a] <= loads[b] else b


def ongoing_requests(queue_len_cache: Any, replica: RunningReplica) -> int:
    """A replica's ongoing requests: Serve's count (its queue-length cache, which Serve keeps
    as it sends and finishes requests), else the replica's own last report."""
    queued = queue_len_cache.get(replica.replica_id)
    if queued is not None:
        return queued
    return int((replica.routing_stats or {}).get("requests", 0))


class PrefixAwareRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """A Serve request router that keeps requests with a common prompt prefix on the replica
    that already caches it (see the module docstring); the decision is `PrefixAffinity`'s."""

    def initialize_state(self, block_size: int = 16, tokenizer: str | None = None,
                         imbalanced_threshold: int = 8, min_match_blocks: int = 1,
                         index_capacity: int = 1 << 18, seed: int | None = None,
                         model_name: str | None = None, chat_template: str | None = None
                         ) -> None:
        self._blocks = PromptBlocks(block_size, tokenizer, model_name, chat_template)
        self._affinity = PrefixAffinity(imbalanced_threshold, min_match_blocks,
                                        index_capacity, seed)
        self._known: set[Hashable] = set()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._forget_gone(candidate_replicas)
        if pending_request is not None:  # every replica is ranked at once: a retry backs off
            pending_request.routing_context.should_backoff = True
        # A request for a LoRA adapter: among the replicas that hold it first.
        candidate_replicas = adapter_candidates(self, candidate_replicas, pending_request)
        loads = {r.replica_id: ongoing_requests(self.replica_queue_len_cache, r)
                 for r in candidate_replicas}
        hashes = (self._blocks.hashes(pending_request.args, pending_request.kwargs)
                  if pending_request is not None else [])
        chosen_id = self._affinity.choose(loads, hashes)
        chosen = next(r for r in candidate_replicas if r.replica_id == chosen_id)
        rest = sorted((r for r in candidate_replicas if r is not chosen),
                      key=lambda r: loads[r.replica_id])
        return [[chosen], rest] if rest else [[chosen]]

    def _forget_gone(self, candidates: list[RunningReplica]) -> None:
        current = {r.replica_id for r in self.curr_replicas.values()} | {
            r.replica_id for r in candidates}
        for gone in self._known - current:
            self._affinity.forget(gone)
        self._known = current
