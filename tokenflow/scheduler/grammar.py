"""`GrammarBackend`: what the scheduler asks of structured output, and nothing more.

The engine's structured-output manager compiles grammars with xgrammar; the scheduler only
calls these five methods, so it depends on this protocol, not on the package that has it.
"""

from __future__ import annotations

from typing import Protocol

from tokenflow.scheduler.request import Request
from tokenflow.scheduler.sched_output import GrammarBitmask


class GrammarBackend(Protocol):
    """Compiles each constrained request's grammar and keeps its matcher in step with the
    request's tokens."""

    def submit(self, request: Request) -> None:
        """Start compiling the request's grammar; `ready()` tells when it can run."""

    def ready(self, request: Request) -> bool:
        """Whether the grammar is compiled; raises ValueError if it failed to compile."""

    def bitmask(self, rows: list[tuple[Request, list[int]]]) -> GrammarBitmask:
        """Allowed tokens for each (request, drafts it verifies) that samples this step."""

    def accept(self, request: Request, token_ids: list[int]) -> bool:
        """Advance the matcher over new tokens; True once the grammar is done."""

    def valid_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts from where the request is."""
