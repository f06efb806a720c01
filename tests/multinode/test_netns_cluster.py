"""The namespace cluster fixture: real nodes with their own IPs, gloo across them, clean teardown."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multinode import conftest, network
from tests.multinode.netns import REPO_ROOT, NamespaceCluster

pytestmark = pytest.mark.multinode

WHERE_DRIVER = """
import json, os, ray
ray.init(log_to_driver=False)
nodes = json.loads(os.environ["TF_NODES"])

@ray.remote(num_cpus=0)
def where():
    return {"ip": ray.util.get_node_ip_address(), "netns": os.readlink("/proc/self/ns/net")}

alive = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
pinned = {name: ray.get(where.options(resources={n["resource"]: 0.01}).remote())
          for name, n in nodes.items()}
print(json.dumps({"alive": alive, "pinned": pinned}))
"""

GLOO_DRIVER = """
import json, os, ray
from tests.multinode.dist import gloo_group
ray.init(log_to_driver=False)
nodes = json.loads(os.environ["TF_NODES"])
peers, infos = gloo_group([nodes["w1"]["resource"], nodes["w2"]["resource"]])
sums = ray.get([p.all_reduce.remote([float(rank + 1)] * 4) for rank, p in enumerate(peers)])
# What a pipeline stage does: rank 0 sends activations, rank 1 receives them.
_, received = ray.get([peers[0].send.remote([0.5, -1.0, 3.25], dst=1),
                       peers[1].recv.remote(3, src=0)])
ray.get([p.destroy.remote() for p in peers])
print(json.dumps({"infos": infos, "sums": sums, "received": received}))
"""


def test_each_node_has_its_own_ip_and_namespace(netns_cluster: NamespaceCluster) -> None:
    out = netns_cluster.run_driver(WHERE_DRIVER).json()
    subnet = ipaddress.ip_network(netns_cluster.subnet)
    ips = [n.ip for n in netns_cluster.nodes]
    assert len(netns_cluster.nodes) == 3
    assert sorted(out["alive"]) == sorted(ips)
    assert len(set(ips)) == 3 and all(ipaddress.ip_address(i) in subnet for i in ips)
    for node in netns_cluster.nodes:
        where = out["pinned"][node.name]
        assert where["ip"] == node.ip, node.name
        # The task ran in that node's namespace, not just on a node claiming its IP.
        assert where["netns"] == f"net:[{network.netns_inode(node.netns)}]", node.name


def test_gloo_all_reduce_and_send_recv_across_worker_nodes(
        netns_cluster: NamespaceCluster) -> None:
    out = netns_cluster.run_driver(GLOO_DRIVER).json()
    w1, w2 = netns_cluster.node("w1"), netns_cluster.node("w2")
    assert [(i["rank"], i["ip"]) for i in out["infos"]] == [(0, w1.ip), (1, w2.ip)]
    assert all(i["ifname"] == network.HOST_IFNAME for i in out["infos"])
    assert out["sums"] == [[3.0] * 4, [3.0] * 4]
    assert out["received"] == [0.5, -1.0, 3.25]


def _processes(cluster: NamespaceCluster) -> dict[int, str]:
    """pid -> start time (field 22 of /proc/PID/stat) of every process in the cluster's
    namespaces: a pid reused later by another process has another start time."""
    procs = {}
    for pid in network.pids_in_netns(cluster.network.inodes()):
        procs[pid] = _start_time(pid)
    return {pid: t for pid, t in procs.items() if t}


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def _assert_gone(names: list[str], procs: dict[int, str], run_dir: Path) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listed], listed
    assert all(network.netns_inode(n) is None for n in names)
    # Not even as zombies: the node init processes reap what they adopted.
    assert not [pid for pid, t in procs.items() if _start_time(pid) == t]
    assert not run_dir.exists()


def test_teardown_leaves_nothing_even_when_the_test_fails() -> None:
    conftest.require_netns()
    cluster = NamespaceCluster(num_workers=1)
    with pytest.raises(RuntimeError, match="the test failed"), cluster:
        procs = _processes(cluster)
        names, run_dir = cluster.netns_names, cluster.run_dir
        assert len(names) == 3 and run_dir is not None
        # gcs, raylets, agents of both nodes, and the two node init processes.
        assert len(procs) >= 6, procs
        raise RuntimeError("the test failed")
    _assert_gone(names, procs, run_dir)


OWNER = """
import json, sys, time
from tests.multinode.netns import NamespaceCluster
from tests.multinode.test_netns_cluster import _processes
cluster = NamespaceCluster(num_workers=0).__enter__()
print(json.dumps({"names": cluster.netns_names, "run_dir": str(cluster.run_dir),
                  "procs": _processes(cluster)}), flush=True)
time.sleep(600)
"""


def test_watchdog_tears_down_after_the_owner_is_killed() -> None:
    conftest.require_netns()
    owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=REPO_ROOT, text=True,
                             stdout=subprocess.PIPE,
                             env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
    try:
        line = owner.stdout.readline()  # type: ignore[union-attr]
        assert line, "the owner process died before its cluster started"
        started = json.loads(line)
    finally:
        owner.send_signal(signal.SIGKILL)  # no finally, no __exit__: only the watchdog is left
        owner.wait()
    procs = {int(pid): t for pid, t in started["procs"].items()}
    # The watchdog removes the namespaces, then the run directory: wait for both (on a busy
    # machine the directory went a moment after the namespaces).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (any(network.netns_inode(n) for n in started["names"])
                                           or Path(started["run_dir"]).exists()):
        time.sleep(0.5)
    # The node init process, orphaned by the kill, stays a zombie until pid 1 reaps it; it went
    # last, so it left no other zombie behind.
    zombies = {pid for pid in procs if _is_zombie(pid) and _start_time(pid) == procs[pid]}
    assert len(zombies) <= 1, zombies
    procs = {pid: t for pid, t in procs.items() if pid not in zombies}
    _assert_gone(started["names"], procs, Path(started["run_dir"]))


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


@pytest.mark.parametrize("ci", ["1", ""])
def test_no_namespaces_fails_in_ci_and_skips_elsewhere(ci: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "check_netns_support", lambda: "no `ip` here")
    monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(expected, match="no `ip` here"):
        conftest.require_netns()
