"""Fixtures for tests that need several real Ray nodes (see `netns.py`).

Every multinode test that needs the standard shape (a head and two workers, one CPU each, the
default serving mode) shares one namespace cluster, `shared_netns_cluster`: it starts with the
first such test and stops right after the last one (tests/conftest.py runs them together, after
every other test). A test that fails gets the cluster checked: anything it left on it (a Serve
instance, actors) is removed, and a cluster that is not whole any more is torn down, so the next
test starts a fresh one. The namespaces go in every case: `NamespaceCluster.close` at the
fixture's teardown, and its watchdog if this process is killed.

A machine that cannot make network namespaces fails these tests in CI (`CI` set, as `.ci/run`
does), and skips them with the reason elsewhere: a laptop without root still runs the rest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.multinode.netns import DriverFailed, NamespaceCluster, check_netns_support

NUM_WORKERS, CPUS_PER_NODE = 2, 1

# After a failed test: stop Serve if it runs (its actors are detached, they outlive their
# driver), then wait until every node is alive and every CPU free again (a driver's own actors
# and placement groups go with its job).
RESET_DRIVER = """
import json, os, time, ray
from ray import serve
ray.init(log_to_driver=False)
serve.shutdown()
nodes, cpus = int(os.environ["TF_NUM_NODES"]), float(os.environ["TF_CPUS_PER_NODE"])
deadline, state = time.monotonic() + 30, {}
while time.monotonic() < deadline:
    state = {"alive": sum(n["Alive"] for n in ray.nodes()),
             "free": ray.available_resources().get("CPU", 0.0),
             "total": ray.cluster_resources().get("CPU", 0.0)}
    if state["alive"] == nodes and state["free"] >= state["total"] == nodes * cpus:
        break
    time.sleep(0.5)
print(json.dumps(state))
"""


def require_netns() -> None:
    """Fail (in CI) or skip (elsewhere) the calling test when namespaces cannot be made here."""
    reason = check_netns_support()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"multinode tests need network namespaces: {reason}", pytrace=False)
    pytest.skip(f"multinode tests need network namespaces: {reason} (this fails in CI)")


class SharedNamespaceCluster:
    """The session's namespace cluster, started on first use; `reset` after a failed test."""

    def __init__(self) -> None:
        self.cluster: NamespaceCluster | None = None
        self.failed_start: str | None = None
        self.starts = 0

    def get(self) -> NamespaceCluster:
        if self.failed_start is not None:  # as a session fixture's failed setup would
            raise RuntimeError(f"the shared namespace cluster did not start:\n{self.failed_start}")
        if self.cluster is None:
            cluster = NamespaceCluster(num_workers=NUM_WORKERS, cpus_per_node=CPUS_PER_NODE)
            try:
                cluster.__enter__()  # closes what it started if it fails
            except Exception as e:
                self.failed_start = f"{type(e).__name__}: {e}"
                raise
            self.cluster, self.starts = cluster, self.starts + 1
        return self.cluster

    def reset(self) -> None:
        """Remove what a failed test left on the cluster; if the cluster is not whole (a node
        lost, CPUs still taken), close it: the next test gets a fresh one."""
        if self.cluster is None:
            return
        env = {"TF_NUM_NODES": str(NUM_WORKERS + 1), "TF_CPUS_PER_NODE": str(CPUS_PER_NODE)}
        try:
            state = self.cluster.run_driver(RESET_DRIVER, env=env, timeout_s=180).json()
            whole = (state["alive"] == NUM_WORKERS + 1
                     and state["free"] >= state["total"] == (NUM_WORKERS + 1) * CPUS_PER_NODE)
        except (DriverFailed, ValueError, KeyError, json.JSONDecodeError):
            whole = False
        if not whole:
            self.close()

    def close(self) -> None:
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.close()


@pytest.fixture(scope="session")
def shared_netns_cluster() -> Iterator[SharedNamespaceCluster]:
    """The namespace cluster every `netns_cluster` test shares; tests/conftest.py tears this
    down right after its last user."""
    shared = SharedNamespaceCluster()
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def netns_cluster(request: pytest.FixtureRequest,
                  shared_netns_cluster: SharedNamespaceCluster) -> Iterator[NamespaceCluster]:
    """A head and two workers ("w1", "w2"), one CPU each, in the default serving mode: the
    session's shared one (`shared_netns_cluster`). A test that needs another shape starts its
    own with `with NamespaceCluster(...) as cluster:`."""
    require_netns()
    cluster = shared_netns_cluster.get()
    failed_before = request.session.testsfailed
    yield cluster
    if request.session.testsfailed != failed_before:  # this test failed (its call report is in)
        shared_netns_cluster.reset()
