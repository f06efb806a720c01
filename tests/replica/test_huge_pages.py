"""The KV cache's allocation on transparent huge pages (worker/huge_pages.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from tokenflow.replica.worker import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _os_gives_huge_pages_at_fault() -> bool:
    """Linux with THP for marked ranges, which a fault may compact memory for."""
    def mode(name: str) -> str:
        path = THP / name
        return path.read_text() if path.exists() else "[never]"
    return sys.platform.startswith("linux") and "[never]" not in mode("enabled") \
        and "[never]" not in mode("defrag")


def _huge_bytes_in(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap the tensor's memory (/proc/self/smaps)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            lo, hi = int(m[1], 16), int(m[2], 16)
            inside = lo < end and hi > start
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def test_zeros_are_zeros_of_the_shape_and_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        t = huge_pages.zeros((2, 64, 16, 3, 64), dtype, torch.device("cpu"))
        assert t.shape == (2, 64, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
        assert not t.any()


def test_a_large_cache_is_marked_and_gets_huge_pages_where_the_os_gives_them() -> None:
    shape = (2, 512, 16, 3, 64)  # one layer of the default model's cache: 12 MiB
    t = huge_pages.zeros(shape, torch.float32, torch.device("cpu"))
    if not sys.platform.startswith("linux"):
        assert huge_pages.advise_huge_pages(t) == 0
        return
    # Whole 2 MiB pages inside it are marked (at least 4 of its 6).
    assert huge_pages.advise_huge_pages(t) >= 4 * huge_pages.HUGE_PAGE_BYTES
    if _os_gives_huge_pages_at_fault():
        assert _huge_bytes_in(t) >= huge_pages.HUGE_PAGE_BYTES


def test_a_small_tensor_is_left_alone() -> None:
    assert huge_pages.advise_huge_pages(torch.zeros(100)) == 0


def test_memory_touched_before_does_not_keep_a_cache_off_huge_pages() -> None:
    """In a process that has freed large tensors (a test worker, a replica that rebuilt its
    engine), the cache still gets fresh memory to mark."""
    for _ in range(4):
        scratch = torch.ones(40 << 20, dtype=torch.uint8)
        del scratch
    t = huge_pages.zeros((2, 512, 16, 3, 64), torch.float32, torch.device("cpu"))
    assert not t.any() and t.is_contiguous()
    if _os_gives_huge_pages_at_fault():
        assert _huge_bytes_in(t) >= huge_pages.HUGE_PAGE_BYTES
