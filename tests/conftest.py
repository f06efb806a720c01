"""The session's single-node Ray cluster (and Serve instance), on 127.0.0.1 only.

It starts when the first test that needs it runs (most tests never do) and stops right after
the last one (`pytest_runtest_teardown`); every test that needs Ray in this process shares it
(Ray allows one per process).

The run's order (`pytest_collection_modifyitems`): the tests that need no cluster, then the
session cluster's users, then the tests that start clusters or `tokenflow serve` of their own,
then the multinode ones (the users of the shared namespace cluster first). So each session-wide
cluster runs only while its users do, and the tests that start their own clusters do not share
the machine's cores with an idle one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest_plugins = ["tests.tiers"]  # the fast and slow tiers, marked at collection

from tests.gguf_reading import cache_tensor_name_maps  # noqa: E402

cache_tensor_name_maps()  # transformers' GGUF loads, the reference of many tests: 5 s each less

# Before anything imports ray: a single-node cluster on loopback addresses only, set up for
# the default serving mode (Serve reads its switches when first imported, in this process
# and in every process of the cluster), so the serving tests run in the mode users get.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
from tokenflow.cluster.serving_mode import body_forwarding, switches  # noqa: E402
from tokenflow.config import AppConfig  # noqa: E402
from tokenflow.net import free_port  # noqa: E402
from tokenflow.ops.cluster_env import apply_cluster_env, release_cluster_env  # noqa: E402

DEFAULT_SERVING_MODE = AppConfig().serving_mode
os.environ.update({**switches(DEFAULT_SERVING_MODE), **body_forwarding(DEFAULT_SERVING_MODE)})


@dataclass(frozen=True)
class Cluster:
    """The session's Ray cluster: Serve's HTTP address and the Prometheus export port."""

    http_url: str
    metrics_port: int
    gcs_address: str


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    # The rest of the mode's environment (HAProxy's files and ports) now, not at import: a port
    # picked long before HAProxy binds it has had all that time to be taken.
    env = apply_cluster_env(DEFAULT_SERVING_MODE)
    http_port, metrics_port = free_port(), free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port,
             # Export metrics every second instead of every 10, for the metrics test.
             _system_config={"metrics_report_interval_ms": 1000})
    gcs_address = ray.get_runtime_context().gcs_address
    assert gcs_address.startswith("127.0.0.1:"), (
        f"Ray listens on {gcs_address}: something imported ray before this conftest could set "
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; set it in the environment or a root conftest")
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        yield Cluster(f"http://127.0.0.1:{http_port}", metrics_port, gcs_address)
    finally:
        serve.shutdown()
        ray.shutdown()
        release_cluster_env(env)
        print("\n[tests/conftest.py] session cluster stopped", file=sys.stderr)


# ------------------------------------------------------------------------- order and teardown

# The session-scoped clusters, each stopped right after the last test that uses it: this
# process's `cluster`, and the multinode tests' shared namespace cluster
# (tests/multinode/conftest.py).
NETNS_SESSION = "shared_netns_cluster"
SESSION_CLUSTERS = ("cluster", NETNS_SESSION)
# The groups of the run, in order.
NO_CLUSTER, SESSION_CLUSTER, OWN_CLUSTERS, MULTINODE_SHARED, MULTINODE_OWN = range(5)


def run_group(item: pytest.Item) -> int:
    """Where `item` runs: a test that uses the session's cluster runs with the others that do;
    one that starts its own clusters or servers (`own_cluster`, or marked slow by hand without
    using the session's cluster) after them; the multinode tests last."""
    names = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("multinode") is not None or NETNS_SESSION in names:
        return MULTINODE_SHARED if NETNS_SESSION in names else MULTINODE_OWN
    if "cluster" in names:
        return SESSION_CLUSTER
    if ("own_cluster" in names or item.get_closest_marker("own_cluster") is not None
            or item.get_closest_marker("slow") is not None):
        return OWN_CLUSTERS
    return NO_CLUSTER


# Last: after tests/tiers.py has marked the slow tests (and pytest deselected with -k/-m).
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the run by `run_group`, stably: within a group, file order, except that a
    package's tests stay together (as they are in file order), so a package-scoped app is
    deployed once. Not under `-p randomly`'s shuffle: there a random order is the point (the
    session cluster still stops after its last user, wherever that falls)."""
    if config.getoption("randomly_reorganize", False):  # absent unless `-p randomly`
        return
    first_seen: dict[tuple[int, str], int] = {}
    for item in items:
        first_seen.setdefault((run_group(item), item.path.parent.as_posix()), len(first_seen))
    items.sort(key=lambda i: (run_group(i), first_seen[(run_group(i), i.path.parent.as_posix())]))


_LAST_USERS = pytest.StashKey[dict[str, pytest.Item]]()


def _last_users(session: pytest.Session) -> dict[str, pytest.Item]:
    """The last item of the final order (after every reordering and deselection) that uses
    each of `SESSION_CLUSTERS`."""
    if _LAST_USERS not in session.stash:
        last: dict[str, pytest.Item] = {}
        for item in session.items:
            for name in set(getattr(item, "fixturenames", ())) & set(SESSION_CLUSTERS):
                last[name] = item
        session.stash[_LAST_USERS] = last
    return session.stash[_LAST_USERS]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last user of a session cluster, stop that cluster (and, first, whatever depends
    on it, such as a package's Serve app) instead of at the end of the session."""
    try:
        return (yield)
    finally:
        if nextitem is not None:  # else the session's teardown has just stopped everything
            for name, last in _last_users(item.session).items():
                if last is item:
                    _finish_fixture(item, name)


def _finish_fixture(item: pytest.Item, name: str) -> None:
    """Tear down the session fixture `name` now, as pytest does at the session's end: its
    dependents' finalizers first, then its own; a later request would set it up anew."""
    fixturedefs = item._fixtureinfo.name2fixturedefs.get(name)  # type: ignore[attr-defined]
    if fixturedefs:
        fixturedefs[-1].finish(item._request)  # type: ignore[attr-defined]
