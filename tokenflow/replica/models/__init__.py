"""Model definitions: one file per family, shared blocks in `layers`, names in `registry`, the
architecture config in `config`.

The model classes are imported on first use: `models.config` is read by processes that never run
a model (the HTTP ingress), and importing it must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenflow.replica.models.llama import CausalLM
    from tokenflow.replica.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["MODEL_REGISTRY", "CausalLM", "get_model_class"]


def __getattr__(name: str) -> Any:
    if name == "CausalLM":
        from tokenflow.replica.models.llama import CausalLM

        return CausalLM
    if name in ("MODEL_REGISTRY", "get_model_class"):
        from tokenflow.replica.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
