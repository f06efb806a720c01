"""Streaming-input sessions: a finished turn keeps its KV blocks for the next one.

A request with `sampling_params.session_id` that ends normally (stop or length) is parked in
WAITING_FOR_STREAMING_REQ instead of freed: the client sees its turn finish as usual, and the
workers forget it, but its blocks stay allocated. The next request with the same session id
takes them over: it keeps the KV of the longest common prefix of its prompt and the parked
tokens (never its whole prompt: one token is computed for the logits), so it computes only
what is new. The last sampled token of a turn has no KV yet; a follow-up that repeats it
computes it with its new tokens (vLLM's streaming input drops it instead). A follow-up that
shares nothing, or asks for prompt logprobs (they need every position computed), frees the
parked blocks and runs as a fresh request. A follow-up for an unknown or expired session runs
as a fresh request and opens the session.

A session ends with a turn that sets `session_close`, a turn that is aborted or fails, after
`session_idle_timeout_s` idle, or when a live request needs its blocks (idle sessions are a
cache: they are evicted, longest idle first, before anyone is preempted; so are the blocks a
waiting turn took over, which it then computes again: `Scheduler._release_waiting_turn`). Parked sessions count
against `max_num_active_seqs` (a waiting request waits for a slot they hold until they end) but
are not work: a drain (PAUSED_NEW) does not wait for them, and expiry is checked by
`schedule()` and by `has_unfinished_requests()`, which an idle engine loop polls. A continued
session holds blocks, so it is admitted work even under PAUSED_NEW, and it goes to the head of
the queue, as a preempted request does. One turn at a time: a request for a session whose turn
still runs is a request of its own, and the turn that ends last is the one parked.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from tokenflow.kv import KVCacheManager
from tokenflow.scheduler.request import Request, RequestStatus

# Normal ends of a turn; an aborted, failed or ignored turn ends its session.
_TURN_ENDS = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
              RequestStatus.FINISHED_REPETITION)


class Sessions:
    """Owns the parked sessions of one scheduler: the finished turn of each, with its KV
    blocks, in the order they went idle (so expiry looks only at the front).

    A parked turn's blocks are held under a key of the session's (`_key`), not its request id,
    so a later request that reuses that id holds nothing it does not own.
    """

    def __init__(self, kv: KVCacheManager, idle_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        # session id -> (its last turn, tokens whose KV it holds, deadline)
        self._parked: OrderedDict[str, tuple[Request, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._parked

    @staticmethod
    def keeps(request: Request) -> bool:
        """Whether a finished request stays parked for its session's next turn."""
        params = request.sampling_params
        return (params.session_id is not None and not params.session_close
                and request.status in _TURN_ENDS and not request.kv_transfer_params)

    def park(self, request: Request) -> None:
        """Keep a finished turn's blocks; replaces (frees) a turn parked under the same id,
        which can only be an older one that ran at the same time."""
        session_id = request.sampling_params.session_id
        self._drop(session_id)
        # KV is written for the computed tokens that are still its tokens (not the last
        # sampled one; nor drafts or tokens after a stop that were trimmed).
        num_valid = min(request.num_computed_tokens, request.num_tokens)
        num_held = self.kv.hand_over(request.request_id, _key(session_id), num_valid)
        if num_held:
            request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
            self._parked[session_id] = (request, num_held, self.clock() + self.idle_timeout_s)

    def resume(self, request: Request) -> int:
        """Give a new turn its session's KV, as computed tokens; returns how many (0: no parked
        session, or nothing reusable, and then nothing is held for it)."""
        session_id = request.sampling_params.session_id
        parked = self._parked.pop(session_id, None)
        if parked is None:
            return 0
        old, num_held, _ = parked
        num_keep = 0
        if request.sampling_params.prompt_logprobs is None:
            prompt = request.prompt_token_ids
            num_keep = min(common_prefix_len(old.all_token_ids, prompt, num_held),
                           len(prompt) - 1)
        num_keep = self.kv.hand_over(_key(session_id), request.request_id, num_keep)
        request.num_computed_tokens = num_keep
        return num_keep

    def close(self, session_id: str) -> bool:
        """End a parked session now, freeing its blocks; False if none is parked."""
        return self._drop(session_id)

    def next_expiry_due(self) -> bool:
        """Whether an idle session has timed out (cheap: looks at the oldest only)."""
        return bool(self._parked) and next(iter(self._parked.values()))[2] <= self.clock()

    def expire(self) -> int:
        """Free every session idle past the timeout; returns how many."""
        if not self._parked:
            return 0
        now, expired = self.clock(), 0
        while self._parked and next(iter(self._parked.values()))[2] <= now:
            self.kv.free_id(_key(self._parked.popitem(last=False)[0]))
            expired += 1
        return expired

    def evict_oldest(self) -> bool:
        """Free the longest idle session (a live request needs blocks); False if none."""
        if not self._parked:
            return False
        self.kv.free_id(_key(self._parked.popitem(last=False)[0]))
        return True

    def drop_all(self) -> None:
        """Free every parked session (their KV is gone: the workers restarted)."""
        while self._parked:
            self.kv.free_id(_key(self._parked.popitem(last=False)[0]))

    def _drop(self, session_id: str) -> bool:
        parked = self._parked.pop(session_id, None)
        if parked is not None:
            self.kv.free_id(_key(session_id))
        return parked is not None


def _key(session_id: str) -> str:
    # A NUL prefix: no request id the API or the engine makes starts with one.
    return "\0session:" + session_id


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `limit`. One C-speed comparison
    when one extends the other (the usual follow-up), a scan otherwise."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
