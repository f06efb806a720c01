"""Builds the CPU kernels shipped as source (attention/paged_attention.c, models/quantized_mv.cpp,
models/lora_delta.cpp) once per machine, into tokenflow's cache (`$TOKENFLOW_CACHE_DIR/kernels`),
and loads the ones that are torch ops.

A library is named by the hash of its source, its flags and torch's version, so an edited
kernel (or a new torch, whose C++ headers a torch op is built against) is rebuilt and a
restart finds the built one. Builds are atomic: concurrent builders do not collide.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils import cpp_extension

from tokenflow.local_cache import cache_dir

log = logging.getLogger(__name__)

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


def torch_op_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Compiler flags and libraries of a C++ source that registers torch ops."""
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    return ((*COMMON_FLAGS, "-std=gnu++20", abi, *includes),
            (f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"))


def build_torch_ops(source: Path) -> Path:
    """Compile a C++ source of torch ops into the cache (once per machine, source and torch)."""
    flags, libs = torch_op_flags()
    return build_library(source, flags, libs, "CXX", ("c++", "g++"))


def load_torch_ops(source: Path, fallback: str) -> bool:
    """Build (if needed) and load `source`'s ops into this process; False, with a warning
    naming what runs instead (`fallback`), where there is no compiler or the build fails."""
    try:
        torch.ops.load_library(str(build_torch_ops(source)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("%s unavailable (%s); %s instead", source.name, detail, fallback)
        return False
    return True
