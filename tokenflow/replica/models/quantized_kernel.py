"""The CPU's quantized matrix products (quantized_mv.cpp): built once per machine
against torch's C++ headers (replica/native_build.py caches it), loaded as the torch ops
`tokenflow::int4_mv` and `tokenflow::int8_mv`, and the weight layouts they read.

`make install` builds it (`python -m tokenflow.replica.models.quantized_kernel`, ~10 s); a
process that finds it missing builds it on first use. No C++ compiler, or a failed build:
`available()` is False and the layers use torch's packed kernels instead.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenflow.replica.native_build import build_torch_ops, load_torch_ops

SOURCE = Path(__file__).with_name("quantized_mv.cpp")
ROWS = 16  # output rows of a tile
GROUP = 32  # input columns of an int4 group
GROUP_BYTES = GROUP // 2 * ROWS + 2 * ROWS * 2  # codes, then 16 scales and 16 zeros (bfloat16)


def build() -> Path:
    """Compile the kernels into the cache (once per machine, source and torch version)."""
    return build_torch_ops(SOURCE)


@cache
def available() -> bool:
    """Whether this process has the ops (built and loaded on the first call)."""
    if not load_torch_ops(SOURCE, "torch's packed kernels"):
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    """Shapes for `torch.compile`'s tracing (the kernels themselves are C++)."""

    @torch.library.register_fake("tokenflow::int4_mv")
    def _int4(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake("tokenflow::int8_mv")
    def _int8(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, n: int
              ) -> torch.Tensor:
        return x.new_empty((x.shape[0], n), dtype=torch.float32)


def int4_tiles(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15, bfloat16 scale and zero [N, K / 32] (w = (code - 8) * scale +
    zero) -> the int4 kernel's tiles, uint8 [ceil(N / 16), K / 32, 320]."""
    rows, cols = codes.shape
    pad = -rows % ROWS
    codes = F.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    scale, zero = (F.pad(t.to(torch.bfloat16), (0, 0, 0, pad)) for t in (scale, zero))
    tiles, groups = (rows + pad) // ROWS, cols // GROUP
    # [tile, row, group, pair, 2] -> [tile, group, pair, row]: byte j of pair p holds row j's
    # columns 2p (low nibble) and 2p + 1 (high).
    c = codes.view(tiles, ROWS, groups, GROUP // 2, 2)
    packed = (c[..., 0] | (c[..., 1] << 4)).permute(0, 2, 3, 1).reshape(tiles, groups, -1)

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [tile, group, 32 bytes]
        return t.view(tiles, ROWS, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat((packed, per_group(scale), per_group(zero)), dim=-1).contiguous()


def int4_mv(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """bfloat16 x [M, K] times int4 tiles -> float32 [M, n]; each row's result is the same
    whatever M (batch invariance)."""
    return torch.ops.tokenflow.int4_mv(x, tiles, n)


def int8_tiles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] -> the int8 kernel's tiles [ceil(N / 16), K, 16] (a tile's 16 rows
    side by side, column by column)."""
    rows, cols = codes.shape
    padded = F.pad(codes.to(torch.int8), (0, 0, 0, -rows % ROWS))
    return padded.view(-1, ROWS, cols).transpose(1, 2).contiguous()


def int8_scales(scales: torch.Tensor) -> torch.Tensor:
    """Per-row scales [N] -> float32 [tiles * 16] (the padding's rows scaled by 0)."""
    return F.pad(scales.float(), (0, -scales.shape[0] % ROWS)).contiguous()


def int8_mv(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """bfloat16 x [M, K] times int8 tiles scaled per row -> float32 [M, n]; each row's result
    is the same whatever M."""
    return torch.ops.tokenflow.int8_mv(x, tiles, scales, n)


if __name__ == "__main__":
    print(build())
