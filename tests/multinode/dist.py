"""torch.distributed (gloo) between Ray actors on different nodes, as pipeline stages need it.

`gloo_group(resources)` starts one `GlooPeer` actor per entry, each pinned by a custom resource
(e.g. the `tf_node_<name>` of a `NamespaceCluster` node); rank 0 picks a free port on its own
node IP, the address travels through Ray, and every rank joins with `tcp://IP:PORT`. Run it in
a driver (see `netns.py`).

Gloo binds its sockets to the interface named by `GLOO_SOCKET_IFNAME`, else to whatever the
hostname resolves to. In a namespace (and on many hosts) the hostname resolves to 127.0.0.1, and
a group across nodes would hang; so each peer binds to the interface that carries its Ray node
IP, the address the other nodes already reach it at.
"""

from __future__ import annotations

import os
from typing import Any

from tokenflow.net import free_port, interface_of


class GlooPeer:
    """One rank of a gloo process group, run as a Ray actor; owns that process group."""

    def __init__(self) -> None:
        import ray
        import torch

        torch.set_num_threads(1)  # the test machines are small and shared
        self.ip = ray.util.get_node_ip_address()
        self.rank = -1

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: where rank 0 hosts the rendezvous."""
        return self.ip, free_port(self.ip)

    def init(self, rank: int, world_size: int, master_addr: str, master_port: int,
             timeout_s: float = 120.0) -> dict[str, Any]:
        """Join the group (blocks until every rank joined); returns where this rank runs."""
        from datetime import timedelta

        import torch.distributed as dist

        ifname = interface_of(self.ip)
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.rank = rank
        return {"rank": rank, "ip": self.ip, "ifname": ifname}

    def all_reduce(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float32)
        dist.all_reduce(t)
        return t.tolist()

    def send(self, values: list[float], dst: int) -> None:
        import torch
        import torch.distributed as dist

        dist.send(torch.tensor(values, dtype=torch.float32), dst=dst)

    def recv(self, numel: int, src: int) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.empty(numel, dtype=torch.float32)
        dist.recv(t, src=src)
        return t.tolist()

    def destroy(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def gloo_group(resources: list[str], timeout_s: float = 120.0) -> tuple[list[Any], list[dict]]:
    """One `GlooPeer` per resource name (rank i on the node holding `resources[i]`), joined in
    one gloo group. Returns the actor handles, by rank, and what each `init` returned."""
    import ray

    peer_cls = ray.remote(num_cpus=0)(GlooPeer)
    peers = [peer_cls.options(resources={r: 0.01}).remote() for r in resources]
    master_addr, master_port = ray.get(peers[0].address.remote())
    # All ranks at once: init_process_group blocks until the whole group has joined.
    infos = ray.get([p.init.remote(rank, len(peers), master_addr, master_port, timeout_s)
                     for rank, p in enumerate(peers)])
    return peers, infos
