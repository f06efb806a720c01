"""The CPU's multi-LoRA delta (lora_delta.cpp): built once per machine against torch's C++
headers (replica/native_build.py caches it), loaded as the torch op `tokenflow::lora_delta`.

`make install` builds it (`python -m tokenflow.replica.models.lora_kernel`, ~9 s); a process
that finds it missing builds it on first use. No C++ compiler, or a failed build:
`available()` is False and `models/lora.py` computes the delta with torch's matmuls instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from tokenflow.replica.native_build import build_torch_ops, load_torch_ops

SOURCE = Path(__file__).with_name("lora_delta.cpp")
MAX_RANK = 1024  # the kernel's kMaxRank: a larger `max_lora_rank` takes torch's forms


def build() -> Path:
    """Compile the kernel into the cache (once per machine, source and torch version)."""
    return build_torch_ops(SOURCE)


@cache
def available() -> bool:
    """Whether this process has the op (built and loaded on the first call)."""
    return load_torch_ops(SOURCE, "torch's matmuls")


def lora_delta(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor,
               ranks: torch.Tensor, token_slots: torch.Tensor, part_sizes: Sequence[int],
               max_rank: int) -> None:
    """Add to float32 `y` [T, out] each token's adapter delta, in place (lora_delta.cpp)."""
    assert available(), "no lora_delta kernel in this process"
    torch.ops.tokenflow.lora_delta(x, y, lora_a, lora_bt, ranks, token_slots, list(part_sizes),
                                   max_rank)


if __name__ == "__main__":
    print(build())
