"""Pausing a scheduler: which requests may still be admitted and scheduled (vLLM's PauseState)."""

from __future__ import annotations

import enum


class PauseState(enum.Enum):
    """How far a scheduler is paused. Requests that arrive while it is paused wait in its queue
    and are admitted on resume; nothing is aborted.

    - UNPAUSED: the normal rule.
    - PAUSED_NEW: nothing new is admitted. Requests that were admitted before go on to their end:
      running ones, preempted ones (they are readmitted: a drain must not wait forever on a
      request that once ran), and waiting ones that hold KV blocks (a prompt being loaded from
      another engine). Pause new, wait until idle, stop: a graceful drain.
    - PAUSED_ALL: nothing is scheduled at all, as in vLLM. Running requests keep their KV blocks
      but make no progress until resumed; batches already in flight complete.
    """

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"
    PAUSED_ALL = "paused_all"

    @classmethod
    def from_mode(cls, mode: str) -> PauseState:
        """The state of a pause mode as the HTTP API names it: "new" or "all"."""
        try:
            return PAUSE_MODES[mode]
        except KeyError:
            raise ValueError(f"unknown pause mode {mode!r}; valid: "
                             f"{', '.join(PAUSE_MODES)}") from None


PAUSE_MODES = {"new": PauseState.PAUSED_NEW, "all": PauseState.PAUSED_ALL}
