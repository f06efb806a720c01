"""Network namespaces joined by veth pairs to one bridge, and their teardown.

Every host of a run gets its own namespace with one interface, `eth0`, whose veth peer is a port
of a bridge. The bridge lives in a namespace of its own (the "switch"), not in the host's root
namespace: nothing of a run touches the machine's own interfaces, routes or firewall, interface
names cannot clash between concurrent runs, and no host has a route to anything but the run's
/24. Deleting a run's namespaces (after killing every process inside them) destroys the veths
and the bridge with them.

Run as a script, this module is the watchdog of one run (`--watch`): it blocks on its stdin and,
when that closes (the owner finished, or died even by SIGKILL), destroys the listed namespaces and
removes the run's directory. On a normal exit the owner has already destroyed them: nothing is
left to do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

NETNS_DIR = "/run/netns"
HOST_IFNAME = "eth0"
# The bridge and its ports live in the switch namespace, so these names never clash.
BRIDGE = "br0"


def ip(*args: str) -> None:
    """Run `ip ARGS`; raise with its stderr when it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def netns_inode(name: str) -> int | None:
    """The inode of namespace `name` (as in /proc/PID/ns/net), or None if it does not exist."""
    try:
        return os.stat(os.path.join(NETNS_DIR, name)).st_ino
    except FileNotFoundError:
        return None


def pids_in_netns(inodes: Iterable[int]) -> set[int]:
    """Every live process whose network namespace is one of `inodes` (zombies have none)."""
    wanted = {f"net:[{inode}]" for inode in inodes}
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") in wanted:
                    pids.add(int(entry))
            except OSError:  # exited meanwhile, or a kernel thread
                continue
    return pids


def _signal_in_netns(pid: int, inodes: set[int], sig: int) -> None:
    """Signal `pid` only if it is still in one of `inodes`: a pidfd pins the process, so a pid
    reused by an unrelated process between the scan and the kill is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if os.readlink(f"/proc/{pid}/ns/net") in {f"net:[{i}]" for i in inodes}:
            signal.pidfd_send_signal(fd, sig)
    except (OSError, ProcessLookupError):
        pass  # it exited meanwhile
    finally:
        os.close(fd)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def kill_netns_processes(inodes: set[int], grace_s: float = 2.0,
                         timeout_s: float = 60.0) -> None:
    """Kill every process in the namespaces `inodes`; return when none is left.

    Processes whose parent is in the namespaces go first; the roots (parent outside, such as a
    node's init process) only once nothing is left below them, so that they reap what they
    adopted instead of orphaning it. SIGTERM first, SIGKILL after `grace_s` (Ray's GCS takes
    seconds to stop on SIGTERM, and a test cluster has nothing worth a graceful stop).
    """
    started = time.monotonic()
    while pids := pids_in_netns(inodes):
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            raise RuntimeError(f"processes {sorted(pids)} survived SIGKILL for {timeout_s}s")
        below = {pid for pid in pids if _parent(pid) in pids}
        sig = signal.SIGTERM if elapsed < grace_s else signal.SIGKILL
        for pid in below or pids:
            _signal_in_netns(pid, inodes, sig)
        time.sleep(0.2)


def destroy(names: Iterable[str]) -> None:
    """Kill every process in the namespaces `names`, then delete them (missing ones are skipped).
    Their interfaces (veths, bridge) go with them."""
    names = [n for n in names if netns_inode(n) is not None]
    inodes = {i for n in names if (i := netns_inode(n)) is not None}
    kill_netns_processes(inodes)
    for name in names:
        ip("netns", "delete", name)


@dataclass(frozen=True)
class Host:
    """One host of the network: its namespace and its address on the run's /24."""

    name: str
    netns: str
    ip: str


class Network:
    """The namespaces of one run: a switch namespace holding the bridge, and one namespace per
    host whose `eth0` is a veth into that bridge. Owns their creation and deletion only; the
    processes inside are killed by `destroy`, whoever started them."""

    def __init__(self, prefix: str, subnet_base: str, host_names: list[str]) -> None:
        # subnet_base is "10.A.B": hosts get .1, .2, ... in host_names order.
        self.switch = f"{prefix}-sw"
        self.hosts = [Host(name, f"{prefix}-{name}", f"{subnet_base}.{i + 1}")
                      for i, name in enumerate(host_names)]
        self.subnet = f"{subnet_base}.0/24"

    @property
    def netns_names(self) -> list[str]:
        return [self.switch] + [h.netns for h in self.hosts]

    def create(self) -> None:
        """Create the switch and every host; the caller destroys them even if this fails."""
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", self.switch, "link", "set", BRIDGE, "up")
        for i, host in enumerate(self.hosts):
            port = f"port{i}"
            ip("netns", "add", host.netns)
            ip("-n", host.netns, "link", "set", "lo", "up")
            # Both ends are created directly inside their namespaces: nothing in the root one.
            ip("link", "add", HOST_IFNAME, "netns", host.netns, "type", "veth",
               "peer", "name", port, "netns", self.switch)
            ip("-n", self.switch, "link", "set", port, "master", BRIDGE, "up")
            ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", HOST_IFNAME)
            ip("-n", host.netns, "link", "set", HOST_IFNAME, "up")

    def inodes(self) -> set[int]:
        return {i for n in self.netns_names if (i := netns_inode(n)) is not None}

    def destroy(self) -> None:
        destroy(self.netns_names)


def _watch(names: list[str], run_dir: str | None) -> None:
    # Own session and no SIGINT: a Ctrl-C aimed at pytest must not kill the watchdog first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.stdin.buffer.read()  # returns at EOF: the owner closed it or died
    destroy(names)
    if run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watch", nargs="+", required=True, metavar="NETNS")
    parser.add_argument("--rmtree", default=None, metavar="DIR")
    args = parser.parse_args()
    _watch(args.watch, args.rmtree)
