"""Pipeline stages: how a model's layers are split, and how a stage hands its activations on.

Every stage of one replica is a rank of one `torch.distributed` group (nccl on GPU, gloo on
CPU). Stage k > 0 receives `(hidden, residual)` from stage k - 1 before its layers run; stage
k < last sends its own to stage k + 1 after. Each stage sees every step's SchedulerOutput, so
the receiver knows the shape (`total_num_scheduled_tokens` x hidden) without being told.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenflow.net import interface_of
from tokenflow.replica.worker.model_runner import IntermediateTensors


def stage_layer_ranges(num_layers: int, num_stages: int,
                       stage_layers: list[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage: `stage_layers` as given, or an even split whose remainder
    goes to the first stages (the last one also computes the logits)."""
    if stage_layers is None:
        if num_stages > num_layers:
            raise ValueError(f"{num_stages} pipeline stages for a model of {num_layers} layers")
        base, extra = divmod(num_layers, num_stages)
        stage_layers = [base + (1 if k < extra else 0) for k in range(num_stages)]
    if sum(stage_layers) != num_layers:
        raise ValueError(f"stage_layers {stage_layers} add up to {sum(stage_layers)}, but the "
                         f"model has {num_layers} layers")
    bounds = [0]
    for n in stage_layers:
        bounds.append(bounds[-1] + n)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class StagePipe:
    """Owns one stage's place in its replica's process group: receives the previous stage's
    activations and sends its own to the next.

    Sends are asynchronous: the next stage may still be busy with the previous batch, and this
    stage should go on with its next one meanwhile. A send's buffer is kept until it completed.
    """

    def __init__(self, rank: int, world_size: int, backend: str, master: tuple[str, int],
                 node_ip: str, timeout_s: float) -> None:
        # Gloo binds to the interface named here, else to what the hostname resolves to
        # (often 127.0.0.1): stages on different nodes would never meet.
        if backend == "gloo":
            os.environ["GLOO_SOCKET_IFNAME"] = interface_of(node_ip)
        dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.rank, self.world_size = rank, world_size
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> IntermediateTensors:
        both = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        dist.recv(both, src=self.rank - 1)
        return IntermediateTensors(both[0], both[1])

    def send(self, tensors: IntermediateTensors) -> None:
        assert tensors.residual is not None, "a stage's output always carries the residual"
        self.wait_sends()
        both = torch.stack((tensors.hidden, tensors.residual))  # one message, not two
        self._pending.append((dist.isend(both, dst=self.rank + 1), both))

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
