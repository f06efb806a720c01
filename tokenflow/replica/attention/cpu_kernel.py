"""The CPU's paged attention kernels (paged_attention.c: decodes, prompts or chunks, and a batch
invariant one for both): built
once per machine with the C compiler, cached, and called through ctypes.

The shared library is cached by replica/native_build.py (an edited kernel is rebuilt, a
restart finds the built one). `make install` builds it (`python -m tokenflow.replica.attention.cpu_kernel`);
a process that finds it missing builds it on first use (~1 s). No compiler: `load()` returns
None and the torch backend's gather path attends instead.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenflow.replica.native_build import COMMON_FLAGS, build_library

if TYPE_CHECKING:  # backends.py imports this module
    from tokenflow.replica.attention.backends import AttentionMetadata

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
FLAGS = (*COMMON_FLAGS, "-std=c11")

_i64, _f32 = ctypes.c_int64, ctypes.c_float
_ptr = ctypes.c_void_p


def build() -> Path:
    """Compile the kernel into the cache (once per machine and source)."""
    return build_library(SOURCE, FLAGS, ("-lm",), "CC", ("cc", "gcc"))


@cache
def load() -> PagedAttentionKernel | None:
    """The kernel of this process, built if needed; None where it cannot be built."""
    try:
        return PagedAttentionKernel(ctypes.CDLL(str(build())))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("paged attention kernels unavailable (%s); attention runs through torch's "
                    "SDPA instead", detail)
        return None


class PagedAttentionKernel:
    """Owns the loaded library (per cache dtype, float32 or bfloat16, a decode, a prefill and
    a batch invariant function); `__call__` attends a step's decodes into `out`, `prefill` its
    prompts and chunks, `invariant` all of them with one arithmetic."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = _bind(lib, "paged_decode", [
            _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr,
            _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _ptr])
        self._prefill_fns = _bind(lib, "paged_prefill", [
            _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
            _i64, _i64, _f32, _ptr, _i64, _ptr])
        self._invariant_fns = _bind(lib, "paged_invariant", [
            _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr,
            _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _ptr])

    def supports(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor) -> bool:
        return (q.device.type == "cpu" and kv_cache.is_contiguous()
                and q.dtype == k.dtype == v.dtype == torch.float32
                and kv_cache.dtype in self._fns
                and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 out: torch.Tensor) -> bool:
        """Write the step's k/v [T, KVH, D] to their slots (`meta.slot_mapping`) of kv_cache
        [2, blocks, block_size, KVH, D] (float32 or bfloat16: rounded to nearest even, as
        `.to()` rounds), then attend q [T, H, D] of the decodes (float32, last dims contiguous) through `meta.decode_block_table`, `decode_seq_lens` and
        `decode_token_idx`, keys limited to `meta.window`; out [T, H, D] contiguous: its rows
        of decodes are written. False: the shapes are beyond the kernel (nothing written, not
        even k/v)."""
        slots, block_table, token_idx = (meta.slot_mapping, meta.decode_block_table,
                                         meta.decode_token_idx)
        _, _, block_size, kv_heads, head_dim = kv_cache.shape
        k_cache, v_cache = _halves(kv_cache)
        rc = self._fns[kv_cache.dtype](
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            slots.data_ptr(), slots.shape[0], q.data_ptr(), q.stride(0), q.stride(1), k_cache,
            v_cache, block_table.data_ptr(), block_table.stride(0),
            meta.decode_seq_lens.data_ptr(), token_idx.data_ptr(), token_idx.shape[0],
            q.shape[1], kv_heads, head_dim, block_size, meta.window or 0, scale, out.data_ptr())
        return rc == 0

    def invariant(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                  out: torch.Tensor) -> bool:
        """Batch invariant attention of the whole step (paged_invariant_*): write the step's
        k/v to their slots, then attend every query row, a decode's or a prompt's, in one
        arithmetic that depends on the row alone; out [T, H, D] contiguous, every row written.
        False: the shapes are beyond the kernel (nothing written, or only k/v)."""
        _, _, block_size, kv_heads, head_dim = kv_cache.shape
        k_cache, v_cache = _halves(kv_cache)
        slots, table = meta.slot_mapping, meta.block_table
        rc = self._invariant_fns[kv_cache.dtype](
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            slots.data_ptr(), slots.shape[0], q.data_ptr(), q.stride(0), q.stride(1), k_cache,
            v_cache, table.data_ptr(), table.stride(0), meta.query_start_loc.data_ptr(),
            meta.seq_lens.data_ptr(), meta.seq_lens.shape[0], q.shape[1], kv_heads, head_dim,
            block_size, meta.window or 0, scale, out.data_ptr())
        return rc == 0

    @staticmethod
    def prefill_workspace_floats(meta: AttentionMetadata, kv_heads: int, head_dim: int) -> int:
        """Floats of the workspace `prefill` needs for this step (an upper bound: each context
        as float32, K and V, rounded up to 16 keys and V's rows to 16 floats)."""
        padded_dim = -(-head_dim // 16) * 16
        keys = sum(-(-span.seq_len // 16) * 16 for span in meta.prefills)
        return keys * kv_heads * (head_dim + padded_dim)

    def prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, workspace: torch.Tensor, out: torch.Tensor) -> bool:
        """Attend the step's prompts and chunks (`meta.prefill_reqs`) causally over their
        contexts in kv_cache, whose slots already hold this step's K/V: out's rows of their
        tokens are written. workspace: float32, at least `prefill_workspace_floats` long.
        False: the shapes are beyond the kernel (nothing written)."""
        _, _, block_size, kv_heads, head_dim = kv_cache.shape
        k_cache, v_cache = _halves(kv_cache)
        table, reqs = meta.block_table, meta.prefill_reqs
        rc = self._prefill_fns[kv_cache.dtype](
            q.data_ptr(), q.stride(0), q.stride(1), k_cache, v_cache, table.data_ptr(),
            table.stride(0), meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
            reqs.data_ptr(), reqs.shape[0], q.shape[1], kv_heads, head_dim, block_size,
            meta.window or 0, scale, workspace.data_ptr(), workspace.numel(), out.data_ptr())
        return rc == 0


def _bind(lib: ctypes.CDLL, stem: str, argtypes: list) -> dict[torch.dtype, Any]:
    """The library's `{stem}_f32` and `{stem}_bf16` (one per cache dtype), typed."""
    fns = {}
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        fn = getattr(lib, f"{stem}_{suffix}")
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
        fns[dtype] = fn
    return fns


def _halves(kv_cache: torch.Tensor) -> tuple[int, int]:
    """Addresses of a contiguous [2, ...] cache's K and V halves."""
    return kv_cache.data_ptr(), kv_cache[1].data_ptr()


if __name__ == "__main__":
    print(build())
