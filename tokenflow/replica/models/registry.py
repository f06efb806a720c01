"""HF architecture name (`config.json` "architectures") -> model class."""

from __future__ import annotations

from tokenflow.replica.models.llama import CausalLM, LlamaForCausalLM, MistralForCausalLM
from tokenflow.replica.models.qwen2 import Qwen2ForCausalLM
from tokenflow.replica.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]
