"""transformers reads a GGUF file (the tests' reference loads) through the `gguf` package,
which builds the same tensor-name table once per tensor: ~5 s of every `from_pretrained` of
SmolLM2. `cache_tensor_name_maps` memoizes the table (a pure function of the architecture and
the layer count); what transformers loads is unchanged."""

from __future__ import annotations

import functools


def cache_tensor_name_maps() -> None:
    """Memoize `gguf.get_tensor_name_map` where transformers looks it up (`from gguf import
    get_tensor_name_map`, at call time). Idempotent."""
    import gguf

    if not hasattr(gguf.get_tensor_name_map, "cache_info"):
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
