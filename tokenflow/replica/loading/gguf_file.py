"""One GGUF file, parsed once per process: its metadata as plain values, its tensors by name.

Read with the `gguf` package (numpy only: the HTTP ingress imports this for the tokenizer and
must not import torch). Parsing a real model's metadata (a vocabulary of ~50k strings and as
many merges) takes seconds, and one replica asks for the config, the weights and the tokenizer
separately, so the parsed file is cached per path, size and modification time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor, dequantize

# The reader's pseudo-fields describe the container, not the model.
_CONTAINER_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """Owns one parsed GGUF file: its metadata (key -> Python value) and its tensors, still
    memory-mapped and quantized, by GGUF name in file order."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, ReaderTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def arch_value(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped value: `arch_value("block_count")` reads `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def dequantized(self, name: str) -> np.ndarray:
        """Tensor `name` as float32, in PyTorch's shape order (GGUF lists dimensions reversed)."""
        tensor = self.tensors[name]
        qtype = tensor.tensor_type
        try:
            array = dequantize(tensor.data, qtype)
        except NotImplementedError:
            raise ValueError(
                f"{self.path.name}: tensor {name} is stored as {qtype.name}, a type the gguf "
                "package cannot dequantize; tokenflow reads the types it can (F32, F16, BF16, "
                "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K- and I-quants)") from None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        # F32 comes back as a read-only view of the memory map: copy it so torch may own it.
        return np.array(array, dtype=np.float32, copy=not array.flags.writeable).reshape(shape)


def read_gguf(path: str | Path) -> GGUFFile:
    """The parsed file at `path`; parsed again only if the file changed."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return _read(resolved, stat.st_size, stat.st_mtime_ns)


class _Reader(GGUFReader):
    """The gguf package's reader over a plain ndarray view of its memory map: the same parse,
    without np.memmap's Python-level `__getitem__`/`__array_finalize__` on each of the ~250k
    small reads a real vocabulary takes (3-4x faster; tensors stay memory-mapped)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = np.asarray(value)


@functools.lru_cache(maxsize=4)
def _read(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    del size, mtime_ns  # part of the cache key only
    try:
        reader = _Reader(path)
    except ValueError as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if key not in _CONTAINER_KEYS}
    return GGUFFile(path, metadata, {t.name: t for t in reader.tensors})
