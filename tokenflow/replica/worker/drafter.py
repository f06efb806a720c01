"""N-gram (prompt lookup) drafting: propose the tokens that followed the last time the
request's latest n tokens appeared in its own prompt or output.

Text that quotes or edits its input (summaries, code edits, extraction) repeats long runs of
it; after such a match the next tokens are often a copy, which the model can verify for up to
k tokens in one forward instead of k. The search is numpy over the request's token row, never a
per-token Python loop.
"""

from __future__ import annotations

import numpy as np


class NgramDrafter:
    """Owns the drafting rule: the longest n in [min_n, max_n] whose last n tokens occurred
    before, most recent occurrence first; up to `k` tokens that followed it."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"need 1 <= min_n <= max_n and k >= 1, got {min_n}, {max_n}, {k}")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Drafts continuing `tokens` (1-D int array), at most `max_tokens` of them."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        length = tokens.shape[0]
        if limit <= 0 or length <= self.min_n:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # Every earlier window of n tokens (excluding the suffix itself).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence's continuation
                return tokens[start:start + limit].tolist()
        return []
