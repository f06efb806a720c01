"""Fixtures for tests that need several real Ray nodes (see `netns.py`).

A machine that cannot make network namespaces fails these tests in CI (`CI` set, as `.ci/run`
does), and skips them with the reason elsewhere: a laptop without root still runs the rest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.multinode.netns import NamespaceCluster, check_netns_support


def require_netns() -> None:
    """Fail (in CI) or skip (elsewhere) the calling test when namespaces cannot be made here."""
    reason = check_netns_support()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"multinode tests need network namespaces: {reason}", pytrace=False)
    pytest.skip(f"multinode tests need network namespaces: {reason} (this fails in CI)")


@pytest.fixture(scope="module")
def netns_cluster() -> Iterator[NamespaceCluster]:
    """A head and two workers ("w1", "w2"), one CPU each, shared by the tests of a module."""
    require_netns()
    with NamespaceCluster(num_workers=2, cpus_per_node=1) as cluster:
        yield cluster
