"""Seeded synthetic request traces for the serving benchmark.

Prompts are made of common English words, each about one token for BPE tokenizers (with the
leading space), so `input_len` words are roughly `input_len` tokens on any model; the exact
count is whatever the server reports in `usage`. The same seed always gives the same trace, so
two runs (or an HTTP run and an in-process run) replay identical requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Short, frequent words: one token each in the common BPE vocabularies.
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "be", "at",
    "by", "this", "had", "not", "but", "from", "or", "have", "an", "they", "which", "one",
    "you", "were", "her", "all", "she", "there", "would", "their", "we", "him", "been", "has",
    "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its",
    "about", "into", "than", "them", "can", "only", "other", "new", "some", "could", "time",
    "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our",
    "over", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before",
    "must", "through", "back", "years", "where", "much", "your", "way", "well", "down",
    "should", "because", "each", "just", "those", "people", "how", "too", "little", "state",
    "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get",
    "here", "between", "both", "life", "being", "under", "never", "day", "same", "another",
    "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since",
    "against", "go", "came", "right", "used", "take", "three",
)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a trace: a text prompt, its approximate length, and how many tokens to
    generate (the client asks for exactly this many, with `ignore_eos`)."""

    prompt: str
    prompt_len: int
    output_len: int


def _words(rng: np.random.Generator, count: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=count))


def random_requests(num_prompts: int, input_len: int, output_len: int,
                    seed: int = 0) -> list[BenchRequest]:
    """`num_prompts` independent random prompts of `input_len` words each."""
    _check_lengths(num_prompts, input_len, output_len)
    rng = np.random.default_rng(seed)
    return [BenchRequest(_words(rng, input_len), input_len, output_len)
            for _ in range(num_prompts)]


def shared_prefix_requests(num_prompts: int, prefix_len: int, suffix_len: int,
                           output_len: int, seed: int = 0) -> list[BenchRequest]:
    """One random prefix of `prefix_len` words shared by every prompt, then a unique random
    suffix of `suffix_len` words: the prefix cache should serve the prefix after the first."""
    _check_lengths(num_prompts, prefix_len + suffix_len, output_len)
    if prefix_len < 0 or suffix_len < 0:
        raise ValueError("prefix_len and suffix_len must be >= 0")
    rng = np.random.default_rng(seed)
    prefix = _words(rng, prefix_len)
    requests = []
    for i in range(num_prompts):
        # The index keeps suffixes distinct even when suffix_len is tiny.
        suffix = f"{i} {_words(rng, suffix_len)}".rstrip()
        prompt = f"{prefix} {suffix}" if prefix else suffix
        requests.append(BenchRequest(prompt, prefix_len + suffix_len + 1, output_len))
    return requests


def multi_prefix_requests(num_prompts: int, num_prefixes: int, prefix_len: int,
                          suffix_len: int, output_len: int, seed: int = 0
                          ) -> list[BenchRequest]:
    """Many users, a few long system prompts: `num_prefixes` random prefixes of `prefix_len`
    words, each request one of them (uniformly at random) then a unique suffix of
    `suffix_len` words. A prefix-aware router keeps each prefix on one replica."""
    _check_lengths(num_prompts, prefix_len + suffix_len, output_len)
    if num_prefixes < 1:
        raise ValueError("num_prefixes must be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [f"system {p}: {_words(rng, prefix_len)}" for p in range(num_prefixes)]
    picks = rng.integers(0, num_prefixes, size=num_prompts)
    return [BenchRequest(f"{prefixes[p]} user {i}: {_words(rng, suffix_len)}",
                         prefix_len + suffix_len + 4, output_len)
            for i, p in enumerate(picks)]


def _check_lengths(num_prompts: int, input_len: int, output_len: int) -> None:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if input_len < 1:
        raise ValueError(f"input length must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
