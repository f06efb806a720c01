"""Small network facts the distributed parts need: which interface holds an address, a free
port, and this process's node IP."""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
import struct
import tempfile
from typing import IO

_SIOCGIFADDR = 0x8915


def interface_of(ip: str) -> str:
    """The local network interface holding the IPv4 address `ip`. Gloo binds to the interface
    named in GLOO_SOCKET_IFNAME, else to what the hostname resolves to (often 127.0.0.1, which
    peers on other nodes cannot reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                ifreq = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(ifreq[20:24]) == ip:
                return name
    raise ValueError(f"no local interface has address {ip}")


# Ports a listener picks for itself come from here, outside the ranges others take without
# asking: the kernel's ephemeral range (32768-60999 by default), where every outgoing
# connection (Ray opens hundreds) holds a local port, so a port that was free a moment ago is
# often taken by the time a server binds it; Ray's worker ports (10002-19999); and Serve's
# direct-ingress replica ports (30000-31000). Each process walks the range from its own
# offset, so two processes picking at once rarely meet, and one never hands a port out twice.
_PORT_RANGE = range(20000, 29990)
_port_cursor = os.getpid() * 7919


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port nobody holds on `ip` now and that no one takes by chance before the caller
    binds it (see _PORT_RANGE)."""
    global _port_cursor
    for _ in range(len(_PORT_RANGE)):
        _port_cursor += 1
        port = _PORT_RANGE[_port_cursor % len(_PORT_RANGE)]
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:  # held by someone else
                continue
            return port
    raise OSError(f"no free port on {ip} in {_PORT_RANGE.start}-{_PORT_RANGE.stop - 1}")


# A process that Ray does not run but that serves peers for a Ray worker (the engine process
# of a replica) is told its node's IP here by its parent.
NODE_IP_ENV = "TOKENFLOW_NODE_IP"


def node_ip() -> str:
    """This process's node IP: what its parent said (NODE_IP_ENV), else Ray's view when Ray
    runs here, else loopback."""
    if os.environ.get(NODE_IP_ENV):
        return os.environ[NODE_IP_ENV]
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


# Serve's direct ingress gives each replica a port from one range (30000-31000 by default),
# and each cluster's controller knows only its own: two clusters on one machine hand out the
# same ports, and a port one frees can be taken by the other while the first's HAProxy still
# routes to it (a request then reaches the other cluster's replica). Blocks of this range,
# below the kernel's ephemeral ports, are claimed one per process that starts clusters (the
# launcher starts one; the tests' other clusters run in network namespaces of their own).
_PORT_BLOCK_SIZE = 128
_PORT_BLOCKS = range(30000, 32768 - _PORT_BLOCK_SIZE + 1, _PORT_BLOCK_SIZE)
_claimed: tuple[IO[str], range] | None = None  # the open lock file holds the block


def claim_port_block() -> range:
    """This process's block of ports, which no other live process on this machine holds
    through this function. It stays claimed while this process lives (the lock goes with
    it); later calls return the same block."""
    global _claimed
    if _claimed is not None:
        return _claimed[1]
    directory = os.path.join(tempfile.gettempdir(), "tokenflow-port-blocks")
    os.makedirs(directory, exist_ok=True)
    offset = os.getpid() % len(_PORT_BLOCKS)  # processes claiming at once rarely meet
    for i in range(len(_PORT_BLOCKS)):
        start = _PORT_BLOCKS[(offset + i) % len(_PORT_BLOCKS)]
        lock = open(os.path.join(directory, str(start)), "w")  # noqa: SIM115 - held open
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by another live process
            lock.close()
            continue
        atexit.register(lock.close)  # held until then (closing it is what releases it)
        _claimed = lock, range(start, start + _PORT_BLOCK_SIZE)
        return _claimed[1]
    raise OSError(f"every block of ports in {_PORT_BLOCKS.start}-{_PORT_BLOCKS.stop} is claimed")
