"""The suite's two tiers, decided at collection time (a pytest plugin; tests/conftest.py loads it).

- **slow**: every test that runs on a Ray cluster or starts one. It is marked here, not by hand:
  a test is slow when its fixture closure (`item.fixturenames`, so also through any fixture that
  depends on them) holds one of `CLUSTER_FIXTURES`: the session's `cluster`
  (tests/conftest.py), the multinode `netns_cluster`, or `own_cluster`. A module that starts
  its own clusters or `tokenflow serve` processes says so in one line,
  `pytestmark = pytest.mark.own_cluster` (or a test takes the `own_cluster` fixture). A
  `multinode` test is slow too.
- **fast**: everything else (`make test-fast`, `pytest -m "not slow"`, or `pytest --fast`).

So a new test that starts Ray cannot slip into the fast tier unnoticed: a test of the fast tier
that calls `ray.init` (also implicitly, as `ray.remote`/`serve.run` do) or starts `ray start`,
`serve run` or `tokenflow serve` fails at once, in every run (CI's full run included), with
`RAY_GUARD_MESSAGE`.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

CLUSTER_FIXTURES = frozenset({"cluster", "netns_cluster", "own_cluster"})
RAY_GUARD_MESSAGE = ("this test starts a Ray cluster: use the `cluster` fixture or mark it slow "
                     "(tests/tiers.py)")
# The command lines that start a Ray cluster (or join one as a node).
_STARTS_RAY = re.compile(
    r"(^|[\s/])(ray\s+start|serve\s+(run|start|deploy)|tokenflow(\.cli)?\s+serve)(\s|$)")


class StartsRayError(RuntimeError):
    """A test of the fast tier tried to start Ray."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", default=False,
                     help="run only the fast tier: the tests that start no Ray cluster "
                          "(the same as -m 'not slow and not multinode')")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "own_cluster: the test starts its own Ray cluster or `tokenflow serve` "
                   "(slow, tests/tiers.py)")


@pytest.fixture
def own_cluster() -> None:
    """Names a test that starts its own Ray cluster or server: it is in the slow tier."""


def is_slow(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    return bool(names & CLUSTER_FIXTURES) or item.get_closest_marker("multinode") is not None \
        or item.get_closest_marker("own_cluster") is not None


# First: `-m "not slow"` (pytest's own hook) must see the marks.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    if config.getoption("--fast"):
        fast = [i for i in items if i.get_closest_marker("slow") is None]
        deselected = [i for i in items if i.get_closest_marker("slow") is not None]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = fast


def starts_ray(args: Any) -> bool:
    """Whether a subprocess command line starts Ray: `ray start`, `serve run`, `tokenflow
    serve` (also as `python -m tokenflow.cli serve`, or inside a `sh -c` string)."""
    if isinstance(args, (str, bytes, os.PathLike)):
        line = os.fsdecode(args)
    else:
        line = shlex.join(os.fsdecode(a) for a in args)
    return _STARTS_RAY.search(line) is not None


def _refuse(*_: Any, **__: Any) -> None:
    raise StartsRayError(RAY_GUARD_MESSAGE)


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_ray(request: pytest.FixtureRequest,
                             monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In a fast-tier test: `ray.init` and the subprocesses that start Ray raise."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    import ray
    import ray._private.worker

    monkeypatch.setattr(ray, "init", _refuse)
    monkeypatch.setattr(ray._private.worker, "init", _refuse)
    popen_init = subprocess.Popen.__init__

    @functools.wraps(popen_init)
    def guarded(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if starts_ray(args):
            raise StartsRayError(f"{RAY_GUARD_MESSAGE}: {args!r}")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield
