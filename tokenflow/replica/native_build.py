"""Builds the CPU kernels shipped as source (attention/paged_attention.c, models/quantized_mv.cpp)
once per machine, into tokenflow's cache (`$TOKENFLOW_CACHE_DIR/kernels`).

A library is named by the hash of its source, its flags and torch's version, so an edited
kernel (or a new torch, whose C++ headers a torch op is built against) is rebuilt and a
restart finds the built one. Builds are atomic: concurrent builders do not collide.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from tokenflow.local_cache import cache_dir

# -march=native: the cache is per machine. -fopenmp: torch (loaded first) provides libgomp.
# -ffp-contract=fast: multiply-adds fuse (ISO C mode would keep them apart).
COMMON_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")


def library_path(source: Path, flags: Sequence[str]) -> Path:
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()
                            + torch.__version__.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{digest}.so"


def build_library(source: Path, flags: Sequence[str], libs: Sequence[str], compiler_env: str,
                  compilers: Sequence[str]) -> Path:
    """Compile `source` with `flags`, linking `libs` (after the source, as linkers want), with
    the first of `$compiler_env` or `compilers` found; the cached library's path. FileNotFoundError: no compiler; CalledProcessError: it failed."""
    target = library_path(source, [*flags, *libs])
    if target.exists():
        return target
    compiler = os.environ.get(compiler_env) or next(
        (found for name in compilers if (found := shutil.which(name))), None)
    if compiler is None:
        raise FileNotFoundError(f"no compiler (${compiler_env}, {', '.join(compilers)}) "
                                f"to build {source.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        scratch = Path(tmp.name)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", str(scratch), *libs],
                       check=True, capture_output=True, text=True)
        scratch.replace(target)
    finally:
        scratch.unlink(missing_ok=True)
    return target
