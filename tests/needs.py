"""`need(ok, what)`: a test that needs a tool or data skips without it, except in CI.

CI (`.ci/run`, which exports CI=1) installs everything the suite needs, so there a missing tool
is a failure of the setup, never a silent skip.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def need(ok: bool, what: str) -> None:
    """Skip (outside CI) or fail (in CI) the calling test unless `ok`; `what` says why."""
    if ok:
        return
    if in_ci():
        pytest.fail(f"CI must provide {what}")
    pytest.skip(f"{what} is not available here")
