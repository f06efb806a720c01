"""`tokenflow serve` as a user runs it: its own cluster, whatever else runs on the machine; a
clear error for a port in use; and an exit, not a silent hang, when Ray dies under it.

Every Ray process here is started by this test (as a child of a process it started) and is
killed by process group and by PID; a private RAY_TMPDIR keeps the `ray start` cluster's
address file away from every other Ray user of the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import pytest

from tests.cluster.conftest import free_port
from tests.cluster.serve_process import ServeProcess, kill_tree

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]  # starts its own Ray clusters

CONFIG = """
engine:
  model: {model: tokenflow-tiny}
  cache: {block_size: 16, num_blocks: 64}
  scheduler: {max_model_len: 256, max_num_batched_tokens: 256}
deployment:
  num_replicas: 1
  ray_actor_options: {num_cpus: 0.5}
"""
READY = "serving the OpenAI API"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    # A short private temp dir: Ray's socket paths must stay under 108 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="tf-", dir="/tmp")
    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG)
    variables = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    variables.update(RAY_TMPDIR=ray_tmp, TOKENFLOW_TEST_CONFIG=str(config),
                     PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    yield variables
    subprocess.run(["rm", "-rf", ray_tmp], check=False)


def _answers(port: int) -> bool:
    try:
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 2})
    except httpx.HTTPError:
        return False
    return resp.status_code == 200


def _haproxy(server: ServeProcess) -> list[psutil.Process]:
    return server.processes_named("haproxy")


def _gone(process: psutil.Process) -> bool:
    """Not running (a zombie is gone too: an orphan's new parent may never reap it)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_serve_starts_its_own_cluster_stops_only_what_it_started_and_exits_with_ray(
        env: dict[str, str]) -> None:
    # A cluster started by `ray start`, named in Ray's temp dir: a plain ray.init() joins it.
    head_port = free_port()
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={head_port}", "--num-cpus=1",
         "--include-dashboard=false", "--disable-usage-stats"],
        env={**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first = second = None
    try:
        deadline = time.monotonic() + 120
        while not (Path(env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster").exists():
            assert head.poll() is None and time.monotonic() < deadline, "ray start failed"
            time.sleep(0.5)
        port1, port2 = free_port(), free_port()
        # Both at once: each starts a cluster of its own, whatever the other does.
        first = ServeProcess(["--config", env["TOKENFLOW_TEST_CONFIG"], "--port",
                              str(port1)], env)
        second = ServeProcess(["--config", env["TOKENFLOW_TEST_CONFIG"], "--port",
                               str(port2)], env)
        first.wait_for(READY)
        second.wait_for(READY)
        assert _answers(port1) and _answers(port2)
        # Each server runs its own cluster: its own raylet, not the `ray start` one.
        assert first.ray_processes() and second.ray_processes()
        haproxy = {server: _haproxy(server) for server in (first, second)}
        assert all(haproxy.values())
        assert second.stop() == 0
        # Everything it started went, HAProxy (a Ray actor's child) too.
        assert all(_gone(p) for p in haproxy[second])
        assert _answers(port1), "stopping the second server broke the first"
        # A port in use is a clear error, before anything starts.
        busy = ServeProcess(["--config", env["TOKENFLOW_TEST_CONFIG"], "--port", str(port1)],
                            env)
        assert busy.proc.wait(timeout=120) == 2
        busy.kill()
        assert f"cannot serve on 127.0.0.1:{port1}" in busy.output
        assert _answers(port1)
        assert head.poll() is None, "the `ray start` cluster was shut down"
        # Ray dying under a server is an exit, not a silent hang (and not the others' Ray).
        for process in first.ray_processes():
            process.kill()
        assert first.proc.wait(timeout=120) == 1
        assert "died; exiting" in first.output
        # HAProxy outlives its Ray actor's worker: the server stops it as it exits.
        assert all(_gone(p) for p in haproxy[first])
        assert head.poll() is None
    finally:
        for server in (first, second):
            if server is not None:
                server.kill()
        kill_tree(head)


def test_the_watch_notices_a_port_that_stops_answering() -> None:
    import socket

    from tokenflow.config import AppConfig
    from tokenflow.ops import launcher

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    # started_ray: a cluster of our own (with no head processes of ours here to watch)
    watch = launcher.ClusterWatch(AppConfig(port=listener.getsockname()[1]), started_ray=True)
    closer = threading.Timer(2 * launcher.POLL_S, listener.close)
    closer.start()
    problem = launcher._serve_until_stopped(watch)  # returns, does not hang
    closer.join()
    assert problem is not None and "stopped answering" in problem


def test_on_a_joined_cluster_the_watch_ignores_our_configs_port() -> None:
    """Serve's proxy on a joined cluster listens where the cluster's owner put it: a config
    port nobody listens on is no reason to stop (it was, once the server had run 3 s)."""
    import socket

    from tokenflow.config import AppConfig
    from tokenflow.ops import launcher

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    unused_port = probe.getsockname()[1]
    probe.close()
    joined = launcher.ClusterWatch(AppConfig(port=unused_port), started_ray=False)
    ours = launcher.ClusterWatch(AppConfig(port=unused_port), started_ray=True)
    assert [joined.problem() for _ in range(launcher.MAX_REFUSALS)] == [None] * 3
    assert [ours.problem() for _ in range(launcher.MAX_REFUSALS)][-1] is not None


class FakeServerHandle:
    """Stands for the LLMServer deployment's handle: two replicas, idle after some polls."""

    def __init__(self, idle_after_polls: int | None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._idle_after = idle_after_polls

    def broadcast(self, method: str, *args: Any) -> Any:
        self.calls.append((method, *args))
        polls = sum(call[0] == "pause_status" for call in self.calls)
        idle = self._idle_after is not None and polls > self._idle_after
        result = [{"idle": idle}] * 2 if method == "pause_status" else [{}] * 2
        return SimpleNamespace(results=lambda timeout_s=None: result)


@pytest.fixture
def drain_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`_drain` against a fake handle, its signal event exposed instead of installed."""
    from ray import serve

    from tokenflow.ops import launcher

    state: dict[str, Any] = {}
    monkeypatch.setattr(launcher, "DRAIN_POLL_S", 0.01)
    monkeypatch.setattr(launcher, "_on_stop_signals", lambda event: state.update(hurry=event))
    monkeypatch.setattr(serve, "get_deployment_handle",
                        lambda name, app_name: state["handle"])
    return state


def test_drain_pauses_new_then_waits_until_every_replica_is_idle(
        drain_env: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from tokenflow.config import AppConfig
    from tokenflow.ops import launcher
    from tokenflow.scheduler import PauseState

    handle = drain_env["handle"] = FakeServerHandle(idle_after_polls=3)
    launcher._drain(AppConfig(), timeout_s=30)
    assert handle.calls[0] == ("pause", PauseState.PAUSED_NEW)
    assert [call[0] for call in handle.calls[1:]] == ["pause_status"] * 4
    assert capsys.readouterr().err.rstrip().endswith("drained")


def test_drain_stops_waiting_at_its_timeout_or_a_second_signal(
        drain_env: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from tokenflow.config import AppConfig
    from tokenflow.ops import launcher

    drain_env["handle"] = FakeServerHandle(idle_after_polls=None)
    started = time.monotonic()
    launcher._drain(AppConfig(), timeout_s=0.2)
    assert 0.2 <= time.monotonic() - started < 10
    assert "drain cut short" in capsys.readouterr().err
    threading.Timer(0.1, lambda: drain_env["hurry"].set()).start()
    launcher._drain(AppConfig(), timeout_s=60)
    assert "drain cut short" in capsys.readouterr().err
    launcher._drain(AppConfig(), timeout_s=0)  # no drain at all
    assert capsys.readouterr().err == ""
