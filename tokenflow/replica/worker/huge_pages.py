"""Zeroed CPU tensors on transparent huge pages, for the paged KV cache.

A decode step reads each request's blocks of 16 tokens from anywhere in the cache: with 4 KiB
pages nearly every block costs TLB misses, with 2 MiB pages almost none. Linux gives huge pages
to a range the process marks with `madvise(MADV_HUGEPAGE)` before it first touches it (the
default `transparent_hugepage` mode, `madvise`, gives them to nothing else). Measured on a
2-core AMD VM, the paged decode kernel over 30 layers' caches: 16 requests of 300 tokens
629 -> 582 us a layer, 4 requests 169 -> 142 us (bench/README, "What each part ... contributes").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys
from functools import cache

import torch

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE_BYTES = 2 << 20


@cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Mark the whole 2 MiB pages inside `tensor`'s memory for huge pages; the bytes marked
    (0: too small, not Linux, or refused). Only pages not yet touched get them."""
    madvise = _madvise()
    start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    length = (start + size - first) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if madvise is None or tensor.device.type != "cpu" or length <= 0:
        return 0
    return length if madvise(first, length, MADV_HUGEPAGE) == 0 else 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros(shape)`, on huge pages where it is a CPU tensor and the OS allows. The
    memory is a fresh anonymous mapping of its own: memory from the allocator may have been
    touched before (a freed tensor's), and a marked page that is already in gets no huge
    page."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    if size < HUGE_PAGE_BYTES or _madvise() is None:
        return torch.zeros(shape, dtype=dtype)
    # Private: a shared anonymous mapping is shmem, which has huge pages of its own policy.
    region = mmap.mmap(-1, size + HUGE_PAGE_BYTES,  # room to start on a 2 MiB boundary
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` while it lives
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES
    tensor = whole[skip:skip + size].view(dtype).view(shape)
    advise_huge_pages(tensor)  # before the first touch: zeroing faults the pages in
    return tensor.zero_()
