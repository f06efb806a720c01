"""A real multi-node Ray cluster on one machine: one network namespace per node.

`NamespaceCluster` starts a head node and N worker nodes, each a `ray start` inside its own
network namespace, with its own IP on a private /24; the nodes reach each other only through
veth pairs into one bridge (see `network.py`), so every byte between two nodes crosses a real
link. Needs root and `ip` (iproute2).

How a test uses it
------------------
A Ray driver must run on a node (it talks to its local raylet), so driver code runs inside the
head's namespace, in a subprocess of the venv's python, through `run_driver`. The driver
finds the cluster through `RAY_ADDRESS` and the token in its environment (a bare `ray.init()`
connects), and `TF_NODES` (JSON: name -> {"ip", "resource", "netns"}) tells it where things are.
Every node carries a custom resource naming it, `tf_node_<name>` with capacity 1: request a
fraction of it (`resources={"tf_node_w1": 0.01}`) to place any number of tasks or actors there.
Nodes are called "head", "w1", "w2", ...; code on PYTHONPATH (the repository) is importable by
drivers and workers alike, so actors can be classes from `tests/` or `tokenflow/`::

    DRIVER = '''
    import json, os, ray
    ray.init()
    nodes = json.loads(os.environ["TF_NODES"])

    @ray.remote(num_cpus=0)
    def node_ip():
        return ray.util.get_node_ip_address()

    pin = {"resources": {nodes["w1"]["resource"]: 0.01}}
    print(json.dumps(ray.get(node_ip.options(**pin).remote())))  # the result: last line
    '''

    def test_w1(netns_cluster: NamespaceCluster) -> None:  # fixture from conftest.py
        assert netns_cluster.run_driver(DRIVER).json() == netns_cluster.node("w1").ip

The `netns_cluster` fixture is a head and two workers shared by every multinode test that asks
for it (one cluster for the session, `conftest.py`): a test leaves it as it found it (a driver's
own actors and placement groups go with its job; Serve, whose actors are detached, is shut down
by the driver that started it). For another shape use
`with NamespaceCluster(num_workers=..., cpus_per_node=..., resources={"w1": {"prefill": 1}})
as cluster:` in the test. `run_driver` also takes a script `Path`, extra `env`, `timeout_s`,
and `check=False` to look at a failing driver's `returncode`/`stderr` instead of raising
`DriverFailed`. For torch.distributed between actors on different nodes (pipeline stages, KV
transfer), see `dist.py` (`gloo_group`).

Ray Client from the test process (the host's root namespace) is not offered: the bridge has no
address in the root namespace by design, so the host never routes into the run's subnet.

What it guarantees
------------------
- Token auth (`RAY_AUTH_MODE=token`) with a fresh per-run token in a 0600 file under the run's
  directory, given to every node and driver as `RAY_AUTH_TOKEN_PATH` (Ray's order is
  `RAY_AUTH_TOKEN`, then `RAY_AUTH_TOKEN_PATH`, then ~/.ray/auth_token, which is never read or
  written here).
- Nodes and drivers get the test process's environment without any `RAY_*` variable: in
  particular not `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which tests/cluster sets for its
  loopback-only cluster and which makes Ray refuse to join nodes. Nor `GLOO_SOCKET_IFNAME`
  (and NCCL's): an earlier in-process KV transfer sets it to `lo`, and a node that inherits it
  binds gloo to its namespace's loopback, where the other nodes cannot reach it.
- Teardown always runs (on exceptions and Ctrl-C by `__exit__`; on SIGKILL of the test process
  by a watchdog process that waits for its stdin to close): it kills exactly the processes in
  the run's namespaces, deletes the namespaces (taking the veths and bridge with them) and the
  run's directory. Never `ray stop`, never a kill by name: other Ray clusters run here too.
- A node reaches only its own loopback and the other nodes of its run: the namespaces have no
  default route and the bridge no address on the host, so nothing leaves or enters the run.
- Names and addresses are per run: namespaces `tfnet-<pid>-<random>-<node>`, subnet
  `10.<200 + pid % 51>.<pid // 51 % 256>.0/24`. The subnet never meets the host's routing
  table, so even a clash with another run or a real network would be harmless.

Ray quirks met on the way
-------------------------
- `--temp-dir` is per node: Ray writes `session_latest` and the cluster's address file there,
  and the default /tmp/ray belongs to whatever other cluster runs on the machine.
- Every node listens on port 6379 and Ray's default ports: each namespace has its own ports.
- `ray start --head` with a `--node-ip-address` that no interface holds hangs instead of failing,
  hence the start timeout.
- Ray's GCS takes seconds to stop on SIGTERM; teardown sends SIGKILL after 2 s.
- Ray daemonizes the node's processes; they are adopted by the node's init process
  (`nodeinit.py`), not by pid 1, so killing them leaves no zombie.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.multinode import network
from tokenflow.cluster.serving_mode import body_forwarding, switches
from tokenflow.config import AppConfig
from tokenflow.ops.cluster_env import cluster_env

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GCS_PORT = 6379  # each node has its own port space: no clash with other clusters
TAIL = 4000  # characters of a log or stderr shown in an error


class NamespaceUnavailable(RuntimeError):
    """This machine or user cannot create network namespaces (not root, or no `ip`)."""


class DriverFailed(RuntimeError):
    """A driver exited non-zero or timed out; the message carries its stdout and stderr tails."""


def check_netns_support() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this runs as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install -y iproute2"
    # Root may still lack the capability (an unprivileged container): try one.
    probe = f"tfnet-probe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        network.ip("netns", "add", probe)
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    network.ip("netns", "delete", probe)
    return None


@dataclass(frozen=True)
class Node:
    """One Ray node: its name, its namespace, its IP and the custom resource that names it."""

    name: str
    netns: str
    ip: str

    @property
    def resource(self) -> str:
        return f"tf_node_{self.name}"


@dataclass(frozen=True)
class DriverResult:
    """What a driver run returned."""

    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """The last stdout line that is a JSON object (drivers print their result last; Ray
        may still print its workers' log lines after it)."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        raise ValueError(f"the driver printed no JSON object\n--- stdout\n"
                         f"{self.stdout[-TAIL:]}\n--- stderr\n{self.stderr[-TAIL:]}")


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-TAIL:]
    except OSError as e:
        return f"(no log: {e})"


# Per-host settings the test process may have picked up (tokenflow's gloo users set
# GLOO_SOCKET_IFNAME to the interface of the address they bind, "lo" on the loopback cluster of
# tests/cluster); inherited, they would bind a namespace node's gloo to its own loopback.
_HOST_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def _clean_env() -> dict[str, str]:
    """The test process's environment minus every RAY_* variable and the per-host network
    interface settings, with the repo on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in _HOST_VARIABLES}
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                if p and p != str(REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class NamespaceCluster:
    """A Ray cluster of one head and `num_workers` workers, each node in its own namespace.

    Owns the run's directory (token, logs, Ray temp dirs), the namespaces and links (through
    `network.Network`), the Ray nodes (one init process per node, see `nodeinit.py`) and the
    watchdog; `close()` (or leaving the `with` block) releases all of them, idempotently.
    `resources` adds custom resources per node name, e.g. `{"w1": {"prefill": 1}}`.
    """

    def __init__(self, num_workers: int = 2, cpus_per_node: int = 1,
                 object_store_mb: int = 128,
                 resources: dict[str, dict[str, float]] | None = None,
                 start_timeout_s: float = 300.0) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        names = ["head"] + [f"w{i + 1}" for i in range(num_workers)]
        unknown = set(resources or {}) - set(names)
        if unknown:
            raise ValueError(f"resources for unknown nodes {sorted(unknown)}; nodes are {names}")
        pid = os.getpid()
        self.prefix = f"tfnet-{pid}-{secrets.token_hex(2)}"
        self.network = network.Network(self.prefix, f"10.{200 + pid % 51}.{pid // 51 % 256}",
                                        names)
        self.nodes = [Node(h.name, h.netns, h.ip) for h in self.network.hosts]
        self.cpus_per_node = cpus_per_node
        self.object_store_mb = object_store_mb
        self.extra_resources = resources or {}
        self.start_timeout_s = start_timeout_s
        self.run_dir: Path | None = None
        self._haproxy_dirs: list[str] = []
        self._inits: dict[str, subprocess.Popen[bytes]] = {}  # node name -> its nodeinit
        self._status_fds: dict[str, int] = {}  # node name -> pipe of its `ray start` status
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._closed = False

    # --- the public view -------------------------------------------------------------------

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def workers(self) -> list[Node]:
        return self.nodes[1:]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ValueError(f"no node {name!r}; nodes are {[n.name for n in self.nodes]}")

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    @property
    def subnet(self) -> str:
        return self.network.subnet

    @property
    def netns_names(self) -> list[str]:
        """Every namespace of the run, the switch (bridge) one included."""
        return self.network.netns_names

    def env(self) -> dict[str, str]:
        """The environment of every node and driver: clean of RAY_*, token auth on, Serve's
        switches (HAProxy's body forwarding among them) for the default serving mode."""
        assert self.run_dir is not None, "the cluster is not started"
        mode = AppConfig().serving_mode
        return _clean_env() | switches(mode) | body_forwarding(mode) | {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.run_dir / "auth_token"),
            "RAY_USAGE_STATS_ENABLED": "0",
            "TF_NODES": json.dumps({n.name: {"ip": n.ip, "resource": n.resource,
                                             "netns": n.netns} for n in self.nodes}),
        }

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> NamespaceCluster:
        reason = check_netns_support()
        if reason:
            raise NamespaceUnavailable(reason)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _start(self) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-", dir="/tmp"))
        token = self.run_dir / "auth_token"
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
        # Started before anything exists, so nothing can outlive a killed test process.
        self._watchdog = subprocess.Popen(
            [sys.executable, str(HERE / "network.py"), "--watch", *self.netns_names,
             "--rmtree", str(self.run_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        self.network.create()
        deadline = time.monotonic() + self.start_timeout_s
        self._launch(self.head, ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"])
        self._wait_started([self.head], deadline)
        for w in self.workers:  # all at once: each takes seconds
            self._launch(w, [f"--address={self.address}"])
        self._wait_started(self.workers, deadline)
        self._wait_for_nodes(deadline)

    def _launch(self, node: Node, role_args: list[str]) -> None:
        assert self.run_dir is not None
        resources = {node.resource: 1.0} | self.extra_resources.get(node.name, {})
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", *role_args,
               f"--node-ip-address={node.ip}", f"--num-cpus={self.cpus_per_node}",
               f"--object-store-memory={self.object_store_mb * 2**20}",
               f"--resources={json.dumps(resources)}",
               # Per node: Ray writes session_latest and the cluster address file there.
               f"--temp-dir={self.run_dir / node.name}", "--disable-usage-stats"]
        read_fd, write_fd = os.pipe()
        with open(self.run_dir / f"{node.name}.log", "wb") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", node.netns, sys.executable, str(HERE / "nodeinit.py"),
                 str(write_fd), *cmd],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env() | self._node_serving_env(node), cwd=self.run_dir,
                pass_fds=(write_fd,),
                # Not in pytest's process group: Ctrl-C reaches pytest, which tears down.
                start_new_session=True)
        os.close(write_fd)
        self._inits[node.name] = proc
        self._status_fds[node.name] = read_fd

    def _node_serving_env(self, node: Node) -> dict[str, str]:
        """Serve's environment for one node: every node runs its own HAProxy, and Ray's
        HAProxy files are per machine, so each node gets its own (removed in `close`)."""
        env = cluster_env(AppConfig().serving_mode)
        base = env.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE")
        if base:
            self._haproxy_dirs.append(base)
        return env

    def _wait_started(self, nodes: list[Node], deadline: float) -> None:
        """Wait until `ray start` returned on every node of `nodes`; raise with its log if not 0."""
        for node in nodes:
            fd = self._status_fds.pop(node.name)
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            status = os.read(fd, 64).decode().strip() if ready else None
            os.close(fd)
            if status != "0":
                assert self.run_dir is not None
                what = ("did not return in time" if status is None
                        else f"exited {status}" if status else "died")
                raise RuntimeError(f"`ray start` on {node.name} ({node.ip}) {what}:\n"
                                   f"{_tail(self.run_dir / f'{node.name}.log')}")

    def _wait_for_nodes(self, deadline: float) -> None:
        """Wait until the GCS sees every node alive, from a driver on the head (this also proves
        that token auth and the links work)."""
        code = (
            "import time, ray\n"
            "ray.init(log_to_driver=False)\n"
            f"while sum(n['Alive'] for n in ray.nodes()) < {len(self.nodes)}:\n"
            "    time.sleep(0.5)\n"
        )
        self.run_driver(code, timeout_s=max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Kill every process in the run's namespaces, delete them, remove the run directory.
        Safe to call twice, and on a half-started cluster."""
        if self._closed:
            return
        self._closed = True
        try:
            self.network.destroy()
        finally:
            for fd in self._status_fds.values():
                os.close(fd)
            for proc in self._inits.values():
                proc.kill()  # a no-op after destroy(); stops it if destroy() failed midway
                proc.wait()
            if self._watchdog is not None:
                self._watchdog.stdin.close()  # type: ignore[union-attr]
                self._watchdog.wait()
            if self.run_dir is not None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            for path in self._haproxy_dirs:
                shutil.rmtree(path, ignore_errors=True)

    # --- drivers -----------------------------------------------------------------------------

    def run_driver(self, source: str | Path, env: dict[str, str] | None = None,
                   timeout_s: float = 300.0, check: bool = True) -> DriverResult:
        """Run a Ray driver in the head's namespace: `source` is a script (Path) or code (str).

        It gets `self.env()` plus `env` and `RAY_ADDRESS`, so `ray.init()` connects. With
        `check`, a non-zero exit or a timeout raises `DriverFailed` with stdout and stderr.
        """
        args = [str(source)] if isinstance(source, Path) else ["-c", source]
        cmd = ["ip", "netns", "exec", self.head.netns, sys.executable, *args]
        full_env = self.env() | {"RAY_ADDRESS": self.address} | (env or {})
        try:
            proc = subprocess.run(cmd, env=full_env, cwd=REPO_ROOT, capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise DriverFailed(f"driver timed out after {timeout_s:.0f}s\n"
                               f"--- stdout\n{_str(e.stdout)[-TAIL:]}\n"
                               f"--- stderr\n{_str(e.stderr)[-TAIL:]}") from None
        result = DriverResult(proc.returncode, proc.stdout, proc.stderr)
        if check and proc.returncode != 0:
            raise DriverFailed(f"driver exited {proc.returncode}\n"
                               f"--- stdout\n{proc.stdout[-TAIL:]}\n"
                               f"--- stderr\n{proc.stderr[-TAIL:]}")
        return result


def _str(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
