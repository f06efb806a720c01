"""Small network facts the distributed parts need: which interface holds an address, a free
port, and this process's node IP."""

from __future__ import annotations

import fcntl
import socket
import struct

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


def free_port(ip: str) -> int:
    """A TCP port free on `ip` now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This process's node IP: Ray's view when Ray runs here, else loopback."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
