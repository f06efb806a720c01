"""Prefix-aware routing (`cluster.prefix_router`): the index, the hashes of what a router sees,
and the decision (affinity, the load guard, power of two choices). The router on real Serve is
in test_serving_modes (the default mode, two replicas)."""

from __future__ import annotations

from collections import Counter

from tokenflow.cluster.prefix_router import PrefixAffinity, PrefixIndex, PromptBlocks
from tokenflow.kv import extend_block_hashes
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.scheduler.sampling_params import SamplingParams

BLOCK = 4


def _hashes(tokens: list[int]) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, BLOCK)
    return out


SYSTEM = list(range(100, 116))  # 4 blocks every "user" shares


def test_the_index_matches_the_longest_prefix_a_candidate_was_sent() -> None:
    index = PrefixIndex()
    index.insert(_hashes(SYSTEM + [1, 2, 3, 4]), "a")
    index.insert(_hashes(SYSTEM[:8]), "b")
    assert index.match(_hashes(SYSTEM + [9, 9, 9, 9]), {"a", "b"}) == (4, {"a"})
    assert index.match(_hashes(SYSTEM[:8] + [7] * 4), {"a", "b"}) == (2, {"a", "b"})
    assert index.match(_hashes(SYSTEM), {"b"}) == (2, {"b"})  # among the candidates only
    assert index.match(_hashes([5] * 8), {"a", "b"}) == (0, set())
    index.drop("a")
    assert index.match(_hashes(SYSTEM), {"a", "b"}) == (2, {"b"})


def test_the_index_forgets_the_least_recently_used_blocks_beyond_its_capacity() -> None:
    index = PrefixIndex(capacity=4)
    index.insert(_hashes(SYSTEM), "a")
    index.insert(_hashes([7] * 8), "b")
    assert len(index) == 4
    assert index.match(_hashes([7] * 8), {"a", "b"}) == (2, {"b"})
    assert index.match(_hashes(SYSTEM), {"a", "b"}) == (0, set())  # its first blocks went


def test_prompt_blocks_from_token_ids_and_from_an_openai_body() -> None:
    tokenizer = resolve_model("tokenflow-tiny").tokenizer()
    blocks = PromptBlocks(BLOCK, "tokenflow-tiny")
    text = "the same long system prompt that every user of this service sends first"
    ids = tokenizer.encode(text)
    assert blocks.hashes([[ids, [1, 2]]], {}) == _hashes(ids)  # the ingress's token ids
    assert blocks.hashes([], {"prompts": [ids]}) == _hashes(ids)
    assert blocks.hashes([{"prompt": text, "max_tokens": 4}], {}) == _hashes(ids)  # a body
    assert blocks.hashes([{"prompt": [text, "other"]}], {}) == _hashes(ids)
    chat = blocks.hashes([{"messages": [{"role": "user", "content": text}]}], {})
    assert len(chat) >= len(ids) // BLOCK
    # Nothing to route on: no prompt, or one the tokenizer cannot take.
    assert blocks.hashes([], {}) == []
    assert blocks.hashes([{"messages": "not a list", "prompt": None}], {}) == []
    assert PromptBlocks(BLOCK, None).hashes([{"prompt": text}], {}) == []


def test_prompt_blocks_are_keyed_by_the_lora_adapter_as_the_engines_cache() -> None:
    tokenizer = resolve_model("tokenflow-tiny").tokenizer()
    blocks = PromptBlocks(BLOCK, "tokenflow-tiny", model_name="base")
    text = "the same long system prompt that every user of this service sends first"
    ids = tokenizer.encode(text)
    tuned: list[int] = []
    extend_block_hashes(tuned, ids, BLOCK, ("support-bot",))
    assert tuned != _hashes(ids)
    # A body naming the base model (or none) uses no adapter; one naming an adapter, its key.
    assert blocks.hashes([{"prompt": text, "model": "base"}], {}) == _hashes(ids)
    assert blocks.hashes([{"prompt": text}], {}) == _hashes(ids)
    assert blocks.hashes([{"prompt": text, "model": "support-bot"}], {}) == tuned
    # The ingress's arguments: token ids and the engine's params.
    params = SamplingParams(max_tokens=4, lora="support-bot")
    assert blocks.hashes([[ids], params], {}) == tuned
    assert blocks.hashes([[ids], SamplingParams(max_tokens=4)], {}) == _hashes(ids)


def test_requests_with_a_cached_prefix_follow_it() -> None:
    affinity = PrefixAffinity(imbalanced_threshold=8, seed=0)
    users = [_hashes(SYSTEM + [u] * 4) for u in range(20)]
    first = affinity.choose({"a": 0, "b": 0}, users[0])
    # Every later user lands where the system prompt is, however the loads differ a little.
    for i, hashes in enumerate(users[1:]):
        loads = {"a": i % 3, "b": (i + 1) % 3}
        assert affinity.choose(loads, hashes) == first


def test_the_load_guard_and_unmatched_prompts_use_power_of_two_choices() -> None:
    affinity = PrefixAffinity(imbalanced_threshold=4, seed=0)
    affinity.choose({"a": 0, "b": 0, "c": 0}, _hashes(SYSTEM))
    owner = affinity.index.match(_hashes(SYSTEM), {"a", "b", "c"})[1].pop()
    # Imbalanced: the owner is 5 requests busier than the idlest; the less busy of two.
    loads = {r: (9 if r == owner else 4) for r in "abc"}
    picks = Counter(affinity.choose(loads, _hashes(SYSTEM + [1] * 4)) for _ in range(60))
    assert owner not in picks
    # No prefix anyone has: spread by load, never to the busiest of three.
    loads = {"a": 0, "b": 3, "c": 6}
    picks = Counter(affinity.choose(loads, _hashes([50 + i] * 8)) for i in range(60))
    assert "c" not in picks and picks["a"] > picks["b"] > 0
    # No hashes (a short prompt): the same, and nothing is remembered.
    assert affinity.choose({"a": 0, "b": 5}, []) == "a"
    assert affinity.choose({"only": 3}, _hashes(SYSTEM)) == "only"
