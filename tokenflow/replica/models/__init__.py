"""Model definitions: one file per family, shared blocks in `layers`, names in `registry`."""

from tokenflow.replica.models.llama import CausalLM
from tokenflow.replica.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["MODEL_REGISTRY", "CausalLM", "get_model_class"]
